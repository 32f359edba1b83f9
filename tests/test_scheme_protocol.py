"""Every registered scheme against the ``Scheme`` protocol: members, exact ``nbytes_for``, ``part_layout``
equal to what ``encode`` stores, one-line descriptions; the optional capabilities (``Recipe``,
``GGMLCodable``); and the generated docs table and ``--scheme`` help."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import importance_for

from qkit.errors import SchemeError
from qkit.schemes import (DEFAULT_SCHEMES, GGMLCodable, GGMLScheme, Recipe, Scheme, get_scheme, is_fp4, quantize_tensor,
                          scheme_names)
from qkit.schemes import table
from qkit.schemes.registry import FAMILIES

DOCS = Path(__file__).resolve().parents[1] / "docs" / "schemes.md"
# Whole blocks of every type; a width the k-quants take only through their fallback (576); an odd count.
SHAPES = [(32, 256), (5, 512), (16, 576), (3, 33)]
NAME = "model.layers.0.mlp.down_proj.weight"  # a recipe resolves by name (q4_k_m: Q6_K in layer 0 of 30)
ALL = [*scheme_names(), *(f.example for f in FAMILIES)]


def _bound(name: str) -> Scheme:
    return get_scheme(name).bind({"num_hidden_layers": 30})


def _nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


@pytest.mark.parametrize("name", ALL)
def test_every_scheme_is_a_scheme_with_a_one_line_description(name):
    s = get_scheme(name)
    assert isinstance(s, Scheme)
    assert s.name == name and isinstance(s.kind, str) and isinstance(s.bits, int) and isinstance(s.scale_dtype, torch.dtype)
    assert isinstance(s.description, str) and s.description.strip() and "\n" not in s.description
    assert isinstance(s.to_dict(), dict) and s.to_dict()["name"] == name
    assert s.parts[:2] == ("qweight", "scales")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nbytes_for_and_part_layout_are_what_encode_stores(name, shape):
    s = _bound(name)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    if shape[-1] % 32:  # a width no block format stores (fp4 and llama.cpp's blocks need whole blocks of 32 or 16)
        if isinstance(s, (GGMLScheme, Recipe)) or is_fp4(s):
            with pytest.raises(SchemeError):
                s.resolve(shape, NAME)
            with pytest.raises(SchemeError):
                quantize_tensor(w, s, name=NAME)
            return
    used = s.resolve(shape, NAME)
    assert isinstance(used, Scheme) and not isinstance(used, Recipe)
    parts = used.encode(w, **importance_for(used, shape[-1]))
    layout = used.part_layout(shape)
    assert tuple(layout) == used.parts and set(parts) == set(layout)
    for part, (want_shape, want_dtype) in layout.items():
        assert (tuple(parts[part].shape), parts[part].dtype) == (tuple(want_shape), want_dtype), part
    assert used.nbytes_for(shape) == _nbytes(parts)
    qt = quantize_tensor(w, s, name=NAME, **importance_for(used, shape[-1]))
    assert qt.scheme == used and qt.nbytes == _nbytes(parts)
    if isinstance(s, Recipe):
        assert s.nbytes_for(shape, NAME) == qt.nbytes  # type: ignore[call-arg]  # a recipe prices by name
    else:
        assert s.nbytes_for(shape) == qt.nbytes


@pytest.mark.parametrize("name", ALL)
def test_resolve_and_bind_default_to_the_scheme_itself(name):
    s = get_scheme(name)
    if isinstance(s, Recipe):
        assert s.bind({"num_hidden_layers": 30}) != s
        assert all(isinstance(t, Scheme) and not isinstance(t, Recipe) for t in s.types)
        with pytest.raises(SchemeError, match="recipe"):
            s.part_layout((32, 256))
        return
    assert s.bind({"num_hidden_layers": 30}) is s
    assert s.resolve((32, 256), NAME) is s  # whole blocks of every type: no fallback


@pytest.mark.parametrize("name", [n for n in scheme_names() if isinstance(get_scheme(n), GGMLCodable)])
def test_ggml_codable_blocks_round_trip(name):
    s = get_scheme(name)
    qt = quantize_tensor(torch.randn(8, 256, generator=torch.Generator().manual_seed(3)), s, name=NAME,
                         **importance_for(s, 256))
    blocks = s.to_ggml_blocks(qt)
    assert blocks.dtype == torch.uint8 and blocks.shape[0] == 8
    back = s.from_ggml_blocks(blocks, qt.shape, qt.dtype)
    assert back.parts.keys() == qt.parts.keys()
    assert all(torch.equal(back.parts[k], qt.parts[k]) for k in qt.parts)


def test_capabilities_are_the_expected_ones():
    codable = [n for n in scheme_names() if isinstance(get_scheme(n), GGMLCodable)]
    assert codable == ["mxfp4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k",
                       "iq4_nl", "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m", "tq1_0", "tq2_0"]
    recipes = [n for n in scheme_names() if isinstance(get_scheme(n), Recipe)]
    assert recipes == ["iq1_s-llama", "iq1_m-llama", "iq2_xxs-llama", "iq2_xs-llama", "iq2_s-llama", "iq2_m", "q2_k-llama", "iq3_xxs-llama", "iq3_xs",
                       "iq3_s-llama", "iq3_m", "q3_k_s", "q3_k_m", "q3_k_l", "iq4_nl-llama", "iq4_xs-llama", "q4_k_s",
                       "q4_k_m", "q5_k_s", "q5_k_m", "tq1_0-llama", "tq2_0-llama", "mxfp4_moe"]
    assert all(isinstance(t, GGMLCodable) for r in recipes for t in get_scheme(r).types)


def test_default_schemes_are_registered_first_in_order():
    assert scheme_names()[: len(DEFAULT_SCHEMES)] == list(DEFAULT_SCHEMES)


def test_docs_table_is_the_generated_one():
    """``docs/schemes.md`` holds what the registry generates; rewrite it with
    ``python -m qkit.schemes.table --write docs/schemes.md``."""
    assert table.table_in(DOCS.read_text()) == table.markdown()


def test_help_names_every_registered_scheme_and_family():
    text = table.scheme_help()
    assert all(n in text for n in scheme_names()) and all(f.spelling in text for f in FAMILIES)
    assert "\n" not in text
