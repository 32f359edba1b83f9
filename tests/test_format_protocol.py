"""Each format answers for what it holds (``export.common.Format``: ``refusal``, ``plan_types``,
``supports``, ``stored_nbytes``), and the planner, the help and the docs ask it: a format registered
with one class and one registry line appears in all three with no other edit (the toy format of
``tests/test_format_registry.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkit.export import REGISTRY, format_help, format_names, get_format
from qkit.export import compressed_tensors as ct
from qkit.errors import ExportError
from qkit.plan import candidates, ladder, plan_formats
from qkit.plan import table as format_table
from qkit.schemes import get_scheme, scheme_names
from qkit.schemes.base import Recipe, stores_natively

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plan.md"


def test_docs_table_is_the_generated_one():
    """``docs/plan.md`` holds what the formats generate; rewrite it with
    ``python -m qkit.plan.table --write docs/plan.md``."""
    assert format_table.current(DOCS.read_text()) == format_table.markdown()


def test_every_format_is_found_by_its_names():
    assert format_names()[0] == "qkit" and set(REGISTRY.names()) <= set(format_names())
    assert get_format("CT") is get_format("compressed-tensors") is ct.FORMAT
    assert get_format("bnb").name == "bitsandbytes" and REGISTRY.find("nope") is None
    assert plan_formats() == ("qkit", "compressed-tensors", "gguf")  # bitsandbytes stores one type


@pytest.mark.parametrize("fmt", ["qkit", "compressed-tensors", "gguf"])
@pytest.mark.parametrize("shape", [(64, 576), (64, 512), (16, 96), (8, 1536)])
def test_supports_is_refusal_and_native_storage(fmt, shape):
    """``supports`` = no refusal and stored as itself (``stores_natively``), for every registered scheme."""
    holder = get_format(fmt)
    for name in scheme_names():
        s = get_scheme(name)
        expect = holder.refusal(s) is None and stores_natively(s, shape)
        assert holder.supports(s, shape) is expect, (fmt, name, shape)


def test_compressed_tensors_has_one_answer():
    """The check, the byte count and the refusal agree for every registered scheme (one place decides)."""
    for name in scheme_names():
        s = get_scheme(name)
        why = ct.FORMAT.refusal(s, "m.weight")
        if why is None:
            assert ct.stored_nbytes(s, (128, 256), torch.float16) > 0
        else:
            assert "\n" not in why and (s.name in why or "NF4" in why)
            with pytest.raises(ExportError):
                ct.stored_nbytes(s, (128, 256), torch.float16)


def test_gguf_refuses_what_is_not_a_block_type():
    from qkit.export import gguf

    assert gguf.FORMAT.refusal(get_scheme("q4_k_m")) is None and gguf.FORMAT.refusal(get_scheme("mxfp4")) is None
    why = gguf.FORMAT.refusal(get_scheme("int4-g64"), "m.weight")
    assert why.startswith("--format gguf stores llama.cpp's block types, and int4-g64 (m.weight) is not one")


def test_plan_types_are_schemes_the_format_can_hold():
    for fmt in plan_formats():
        holder = get_format(fmt)
        for name in holder.plan_types():
            s = get_scheme(name)
            assert not isinstance(s, Recipe) and holder.refusal(s) is None, (fmt, name)


def test_format_help_names_every_format():
    text = format_help()
    assert all(n in text for n in format_names()) and "\n" not in text
    assert all(c in ladder("gguf") for c in ("q4_k", "q8_0", "none"))
    assert [c.name for c in candidates("gguf", (8, 96), torch.float16)] == [
        "iq4_nl", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "none"]
