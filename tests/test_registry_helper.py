"""The one registry idiom (``qkit.registry.Registry``): register, get, names, aliases, families, errors."""

from __future__ import annotations

import pytest

from qkit.errors import InputError, SchemeError
from qkit.registry import Registry


def make() -> Registry[str]:
    r: Registry[str] = Registry("format")
    r.register("compressed-tensors", "CT", aliases=("ct",))
    r.register("gguf", "GGUF")
    r.register_family(r"int(?P<bits>[48])-g(?P<n>[0-9]+)", lambda m: f"int{m['bits']}/{m['n']}", "int{4,8}-gN")
    return r


def test_names_keep_registration_order_and_leave_out_aliases():
    r = make()
    assert r.names() == ["compressed-tensors", "gguf"]
    assert list(r) == ["compressed-tensors", "gguf"] and len(r) == 2
    assert r.items() == [("compressed-tensors", "CT"), ("gguf", "GGUF")]


def test_get_normalizes_and_follows_aliases_and_families():
    r = make()
    assert r.get("Compressed_Tensors") == "CT"
    assert r.get(" CT ") == "CT"
    assert r.get("GGUF") == "GGUF"
    assert r.get("int4-g64") == "int4/64" and r.get("INT8_G128") == "int8/128"
    assert r.canonical("ct") == "compressed-tensors" and r.canonical("int4-g64") is None
    assert "gguf" in r and "int4-g32" in r and "int3-g32" not in r and 3 not in r


def test_unknown_name_says_did_you_mean_and_lists_every_name():
    r = make()
    with pytest.raises(InputError) as e:
        r.get("ggfu")
    assert str(e.value) == "unknown format 'ggfu'; did you mean gguf? use one of: compressed-tensors, gguf, int{4,8}-gN"
    with pytest.raises(InputError) as e:
        r.get("zzzz")
    assert str(e.value) == "unknown format 'zzzz'; use one of: compressed-tensors, gguf, int{4,8}-gN"


def test_error_class_and_hint_are_the_kinds():
    r: Registry[int] = Registry("scheme", error=SchemeError, hint="; see docs/schemes.md")
    r.register("nf4", 4)
    with pytest.raises(SchemeError, match=r"^unknown scheme 'nf5'; did you mean nf4\? use one of: nf4; see docs/schemes.md$"):
        r.get("nf5")


def test_a_name_registered_twice_is_a_programming_error():
    r = make()
    with pytest.raises(ValueError, match="registered twice"):
        r.register("CT", "other")
    r.register("gguf", "GGUF2")  # the same name again replaces its value (a module re-imported)
    assert r.get("gguf") == "GGUF2"


def test_decorator_registers_and_returns_the_value():
    r: Registry[type] = Registry("method")

    @r.decorator("rtn")
    class RTN:
        pass

    assert r.get("rtn") is RTN
