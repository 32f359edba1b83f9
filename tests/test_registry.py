"""The scheme registry: named schemes, the ``int{b}-g{N}`` family, scale dtypes, manifests, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkit.errors import InputError, SchemeError
from qkit.granularity import PerGroup, PerRow, PerTensor
from qkit.schemes import DEFAULT_SCHEMES, AbsmaxScheme, NF4Scheme, get_scheme, register, scheme_names
from qkit.schemes.registry import REGISTRY, parse_scale_dtype, scheme_from_dict


def test_the_quality_table_schemes_in_order():
    assert DEFAULT_SCHEMES == ("int8-tensor", "int8-row", "int4-tensor", "int4-row", "int4-g128", "nf4")
    assert scheme_names()[: len(DEFAULT_SCHEMES)] == list(DEFAULT_SCHEMES)


@pytest.mark.parametrize(
    ("name", "bits", "granularity"),
    [
        ("int8-tensor", 8, PerTensor()),
        ("int8-row", 8, PerRow()),
        ("int4-tensor", 4, PerTensor()),
        ("int4-row", 4, PerRow()),
        ("int4-g128", 4, PerGroup(128)),
    ],
)
def test_named_absmax_schemes(name, bits, granularity):
    s = get_scheme(name)
    assert isinstance(s, AbsmaxScheme)
    assert (s.name, s.bits, s.granularity, s.scale_dtype, s.packed) == (name, bits, granularity, torch.float16, bits == 4)


def test_nf4_scheme():
    s = get_scheme("nf4")
    assert isinstance(s, NF4Scheme)
    assert (s.block_size, s.bits, s.scale_dtype, s.packed) == (64, 4, torch.float16, True)


@pytest.mark.parametrize(("name", "bits", "size"), [("int4-g64", 4, 64), ("int4-g32", 4, 32), ("int8-g128", 8, 128), ("int4-g1", 4, 1)])
def test_group_family_parses_into_the_same_family(name, bits, size):
    s = get_scheme(name)
    assert s == AbsmaxScheme(name, bits, PerGroup(size))
    assert type(s) is type(get_scheme("int4-g128"))
    assert s.to_dict()["granularity"] == "group" and s.to_dict()["group_size"] == size


def test_names_are_case_and_space_insensitive():
    assert get_scheme("  INT4-G128 ") is get_scheme("int4-g128")
    assert get_scheme("Int8-G64").name == "int8-g64"


@pytest.mark.parametrize("bad", ["int3-g64", "int4-g0", "int16-row", "int4-g", "nf5", "fp8", ""])
def test_unknown_names_list_the_valid_ones(bad):
    with pytest.raises(SchemeError) as exc:
        get_scheme(bad)
    msg = str(exc.value)
    assert "use one of: int8-tensor, int8-row, int4-tensor, int4-row, int4-g128, nf4" in msg
    assert "int4-gN / int8-gN" in msg and "\n" not in msg
    assert isinstance(exc.value, InputError)  # the CLI's exit code for bad arguments


def test_close_match_is_suggested():
    with pytest.raises(SchemeError, match=r"did you mean nf4\? "):
        get_scheme("nf5")
    with pytest.raises(SchemeError, match=r"did you mean int8-row\? "):
        get_scheme("int8-rows")


@pytest.mark.parametrize(
    ("word", "dtype"),
    [("fp16", torch.float16), ("float16", torch.float16), ("half", torch.float16), ("bf16", torch.bfloat16),
     ("bfloat16", torch.bfloat16), ("fp32", torch.float32), ("float32", torch.float32), ("float", torch.float32),
     (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_scale_dtypes(word, dtype):
    assert parse_scale_dtype(word) == dtype
    assert get_scheme("int4-g128", scale_dtype=word).scale_dtype == dtype
    assert get_scheme("int4-g128").scale_dtype == torch.float16  # the registered scheme is unchanged


@pytest.mark.parametrize("bad", ["fp8", "int8", torch.float64, torch.int8])
def test_bad_scale_dtype(bad):
    with pytest.raises(SchemeError, match="fp16, bf16, fp32"):
        get_scheme("nf4", scale_dtype=bad)


def test_schemes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_scheme("nf4").block_size = 32  # type: ignore[misc]


def test_duplicate_registration_is_refused_and_a_new_name_registers():
    with pytest.raises(SchemeError, match="already registered"):
        register(AbsmaxScheme("int8-row", 8, PerRow()))
    assert get_scheme("int8-row").granularity == PerRow()
    try:
        s = register(AbsmaxScheme("int8-test-only", 8, PerGroup(16)))
        assert get_scheme("int8-test-only") is s
    finally:
        REGISTRY._entries.pop("int8-test-only", None)  # qkit.registry.Registry has no unregister
        REGISTRY._keys.pop("int8-test-only", None)
    with pytest.raises(SchemeError):
        get_scheme("int8-test-only")


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_group_sizes_and_bits(bad):
    with pytest.raises(SchemeError, match="group size must be a positive integer"):
        PerGroup(bad)
    with pytest.raises(SchemeError, match="bits must be one of"):
        AbsmaxScheme("x", 3, PerRow())
    with pytest.raises(SchemeError, match="block size must be positive"):
        NF4Scheme(block_size=0)


@pytest.mark.parametrize("name", [*DEFAULT_SCHEMES, "int4-g64", "int8-g128"])
@pytest.mark.parametrize("sd", ["fp16", "bf16", "fp32"])
def test_manifest_round_trip(name, sd):
    s = get_scheme(name, scale_dtype=sd)
    d = s.to_dict()
    assert d["name"] == name and d["scale_dtype"] == sd and d["bits"] == s.bits
    assert scheme_from_dict(d) == s


def test_manifest_entry_that_disagrees_with_the_registry_is_refused():
    d = get_scheme("int4-g128").to_dict()
    with pytest.raises(SchemeError, match="does not match"):
        scheme_from_dict({**d, "bits": 8})
    with pytest.raises(SchemeError, match="malformed"):
        scheme_from_dict({"kind": "absmax"})
    nf4_32 = scheme_from_dict({**get_scheme("nf4").to_dict(), "block_size": 32})
    assert nf4_32.block_size == 32
