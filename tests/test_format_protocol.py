"""Each format answers for what it holds (``export.common.Format``: ``refusal``, ``plan_types``,
``supports``, ``stored_nbytes``), and the planner, the help and the docs ask it: a format registered
with one class and one registry line appears in all three with no other edit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qkit.export import REGISTRY, find_format, format_help, format_names
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
    assert find_format("CT") is find_format("compressed-tensors") is ct.FORMAT
    assert find_format("bnb").name == "bitsandbytes" and find_format("nope") is None
    assert plan_formats() == ("qkit", "compressed-tensors", "gguf")  # bitsandbytes stores one type


@pytest.mark.parametrize("fmt", ["qkit", "compressed-tensors", "gguf"])
@pytest.mark.parametrize("shape", [(64, 576), (64, 512), (16, 96), (8, 1536)])
def test_supports_is_refusal_and_native_storage(fmt, shape):
    """``supports`` = no refusal and stored as itself (``stores_natively``), for every registered scheme."""
    holder = find_format(fmt)
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
        holder = find_format(fmt)
        for name in holder.plan_types():
            s = get_scheme(name)
            assert not isinstance(s, Recipe) and holder.refusal(s) is None, (fmt, name)


TOY = textwrap.dedent('''
    from qkit.export import REGISTRY
    from qkit.export.common import SafetensorsFormat


    class ToyFormat(SafetensorsFormat):
        name = library = "toy"
        help = "int4-row, int8-row: the toy loader"

        def plan_types(self):
            return ("int4-row", "int8-row")

        def refusal(self, scheme, tensor=None):
            return None if scheme.name in self.plan_types() else f"toy stores int4-row and int8-row, not {scheme.name}"


    REGISTRY.register("toy", ToyFormat())
    ''')

PROBE = textwrap.dedent('''
    import json, torch
    from typer.testing import CliRunner
    from qkit.cli import app
    from qkit.plan import candidates, plan_formats
    from qkit.plan.table import markdown

    run = CliRunner().invoke
    print(json.dumps({
        "plan_formats": plan_formats(),
        "candidates": [c.name for c in candidates("toy", (64, 128), torch.float32)],
        "bytes": [c.nbytes for c in candidates("toy", (64, 128), torch.float32)],
        "table": [line for line in markdown().splitlines() if "toy" in line],
        "quantize_help": run(app, ["quantize", "--help"], terminal_width=400).output,
        "plan_help": run(app, ["plan", "--help"], terminal_width=400).output,
    }))
    ''')


def test_a_toy_format_appears_everywhere_with_one_class_and_one_registry_line(tmp_path):
    """Registered before the CLI is built (as a plugin would be), the toy format is in the planner's
    candidates with exact bytes, the --format help of quantize and plan, and the docs table."""
    script = tmp_path / "toy.py"
    script.write_text(TOY + PROBE)
    env = {**os.environ, "COLUMNS": "400", "TERMINAL_WIDTH": "400", "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["plan_formats"] == ["qkit", "compressed-tensors", "gguf", "toy"]
    # int4-row: 64 rows x 128 cols x 4 bits = 4096 bytes + 64 fp16 scales; int8-row: 8192 + 128; none: fp32
    assert got["candidates"] == ["int4-row", "int8-row", "none"]
    assert got["bytes"] == [64 * 64 + 64 * 2, 64 * 128 + 64 * 2, 64 * 128 * 4]
    assert got["table"] == ["| `toy` | int4-row, int8-row: the toy loader | `int4-row`, `int8-row`, `none` (the source dtype) |"]
    flat = " ".join(got["quantize_help"].split())
    assert "toy (int4-row, int8-row: the toy loader)" in flat.replace("│ ", "").replace(" │", "")
    assert "toy" in got["plan_help"]


def test_format_help_names_every_format():
    text = format_help()
    assert all(n in text for n in format_names()) and "\n" not in text
    assert all(c in ladder("gguf") for c in ("q4_k", "q8_0", "none"))
    assert [c.name for c in candidates("gguf", (8, 96), torch.float16)] == [
        "iq4_nl", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "none"]
