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
    ("quantize", "--holdout"): ["--method", "gptq", "--calibration", "{T}"],
    ("quantize", "--hessian-shrink"): ["--method", "gptq", "--calibration", "{T}"],
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


def test_minus_zero_is_zero(tiny_model_dir):
    """``-0`` is a number in range where 0 is, and prints as 0 (it printed ``alpha=-0`` and ``-0 GiB``)."""
    r = invoke("speculate", "--alpha", "-0", "--cost", "-0")
    assert r.code == 0 and "-0" not in r.stdout, r.text
    r = invoke("budget", str(tiny_model_dir), "--reserve", "-0")
    assert r.code == 0 and "-0 GiB" not in r.stdout and " 0 GiB reserve" in r.stdout, r.text


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


# --------------------------------------------------------------------------- 8. invalid files, unchecked numbers


def _strict(text: str | bytes, where: str = "") -> object:
    """``json.loads`` that fails on NaN, Infinity and -Infinity (what JavaScript, jq, Go and Rust refuse)."""
    def refuse(word):
        raise AssertionError(f"{where}: {word} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _every_json(root: Path) -> dict[str, object]:
    """Every JSON qkit wrote under ``root``, strictly parsed: ``*.json`` files, each safetensors shard's
    manifest, each GGUF's string metadata that holds JSON (the ``qkit.export`` and ``qkit.imatrix`` records)."""
    import gguf
    from safetensors import safe_open

    docs: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if p.suffix == ".json":
            docs[str(p)] = _strict(p.read_bytes(), str(p))
        elif p.suffix == ".safetensors":
            with safe_open(str(p), "pt") as f:
                for k, v in (f.metadata() or {}).items():
                    if v.startswith("{"):
                        docs[f"{p}:{k}"] = _strict(v, f"{p}:{k}")
        elif p.suffix == ".gguf":
            for field in gguf.GGUFReader(str(p)).fields.values():  # qkit's records (a chat template is not JSON)
                if field.name.startswith("qkit") and field.types == [gguf.GGUFValueType.STRING]:
                    v = bytes(field.parts[-1]).decode("utf-8")
                    docs[f"{p}:{field.name}"] = _strict(v, f"{p}:{field.name}")
    return docs


PLAN = ["--target-bits", "6", "--format", "gguf", "--calibration", "{T}", "--calibration-samples", "2",
        "--calibration-seqlen", "32", "--check-windows", "1"]


def _write_all(tiny: Path, wide: Path, text: Path, root: Path) -> None:
    """Every writing command on the tiny models, outputs under ``root/out`` (each format, a matrix, a plan,
    the plan quantized, each with --json); twice the same arguments give ``first`` and ``out``."""
    o, m, t = root / "out", str(tiny), str(text)
    o.mkdir()
    runs = [
        ["quantize", m, "-s", "int8-row", "-o", f"{o}/q", "--json", f"{o}/q.json"],
        ["quantize", m, "-s", "int4-g32", "--format", "compressed-tensors", "-o", f"{o}/ct", "--json", f"{o}/ct.json"],
        ["quantize", str(wide), "-s", "nf4", "--format", "bitsandbytes", "-o", f"{o}/bnb", "--json", f"{o}/bnb.json"],
        ["quantize", m, "-s", "q8_0", "--format", "gguf", "-o", f"{o}/g.gguf", "--json", f"{o}/g.json"],
        ["imatrix", m, "-o", f"{o}/im.gguf", "--calibration", t, "-c", "32", "--chunks", "2", "--json", f"{o}/im.json"],
        ["plan", m, "-o", f"{o}/p.json", *PLAN, "--json", f"{o}/pj.json"],
        ["quantize", m, "--plan", f"{o}/p.json", "--format", "gguf", "-o", f"{o}/gp.gguf", "--json", f"{o}/gp.json"],
        ["quantize", m, "--plan", f"{o}/p.json", "--format", "qkit", "-o", f"{o}/qp", "--json", f"{o}/qp.json"],
        ["inspect", "errors", m, "-s", "int8-row", "--json", f"{o}/errors.json"],
        ["kv", m, "--json", f"{o}/kv.json"],
        ["speculate", "--alpha", "0.5", "--json", f"{o}/spec.json"],
    ]
    for args in runs:
        r = invoke(*[a.replace("{T}", t) for a in args])
        assert r.code == 0, (args, r.text)


@pytest.fixture(scope="module")
def written(tiny_model_dir, llama128, corpus, tmp_path_factory) -> Path:
    """``root/first`` and ``root/out``: what the same commands wrote, run twice (``_write_all``)."""
    root = tmp_path_factory.mktemp("written")
    _write_all(tiny_model_dir, llama128, corpus, root)
    (root / "out").rename(root / "first")
    _write_all(tiny_model_dir, llama128, corpus, root)
    return root


def test_every_json_a_command_writes_is_strict(written, tiny_model_dir, tmp_path):
    """What every writing command wrote (``written``), and the --json of the commands that only report
    (eval's goes through the same ``console.write_json``, tested by itself below: one eval costs seconds)."""
    m = str(tiny_model_dir)
    for name, args in {"budget": ["budget", m], "batching": ["simulate", "batching"],
                       "matrix": ["inspect", "matrix", m, "model.layers.0.mlp.up_proj.weight"],
                       "next-token": ["inspect", "next-token", m, "hello"], "outliers": ["inspect", "outliers", m]}.items():
        r = invoke(*args, "--json", str(tmp_path / f"{name}.json"))
        assert r.code == 0, (args, r.text)
    docs = {**_every_json(written / "out"), **_every_json(tmp_path)}
    kinds = {Path(k.split(":")[0]).suffix for k in docs}
    assert {".json", ".safetensors", ".gguf"} <= kinds, kinds
    assert any("qkit.export" in k for k in docs) and any("qkit.imatrix" in k for k in docs)
    assert len(docs) > 20


def test_a_json_report_writes_null_for_what_was_not_measured(tmp_path):
    """--json writes a non-finite number as null (the reports' word for "not measured"), never NaN."""
    from qkit import console

    out = tmp_path / "r.json"
    console.write_json(out, {"kld": float("nan"), "rows": [{"perplexity": float("inf")}], "ok": 1.5})
    assert _strict(out.read_text()) == {"kld": None, "rows": [{"perplexity": None}], "ok": 1.5}


def test_a_file_qkit_reads_back_refuses_a_non_finite_number(tmp_path):
    """config.json, an index, a manifest: a NaN there is a bug, refused in one line before the file exists."""
    from qkit.checkpoint import write_json
    from qkit.errors import OutputError

    with pytest.raises(OutputError, match=r"quantization_config\.plan\.predicted_kl is inf"):
        write_json(tmp_path / "config.json", {"quantization_config": {"plan": {"predicted_kl": float("inf")}}})
    assert not (tmp_path / "config.json").exists()


def _plan_with(written: Path, tmp_path: Path, change) -> Path:
    doc = json.loads((written / "out" / "p.json").read_text())
    change(doc)
    p = tmp_path / "hostile-plan.json"
    p.write_text(json.dumps(doc))  # Python's json writes what it is given, NaN and Infinity included
    return p


def _set_all(doc, key, value):
    for t in doc["tensors"].values():
        t[key] = value
        for c in t.get("candidates", {}).values():
            c[1] = value


@pytest.mark.parametrize("case,change,needle", [
    ("kl-1e308-each", lambda d: _set_all(d, "predicted_kl", 1e308), "predicted_kl"),  # each finite, the sum is not
    ("measured-kl-1e308", lambda d: d["check"].__setitem__("measured_kl", 1e308), "check.measured_kl"),
    ("target-infinity", lambda d: d["target"].__setitem__("bits", float("inf")), "target.bits"),
    ("solver-nan", lambda d: d["solver"].__setitem__("cost", float("nan")), "solver.cost"),
    ("shape-400-digits", lambda d: next(iter(d["tensors"].values())).__setitem__("shape", [10**400, 64]), "stores"),
])
def test_a_plan_of_out_of_range_numbers_is_refused_on_read(written, tiny_model_dir, tmp_path, monkeypatch, case, change,
                                                             needle):
    """Issue 48: per-tensor KLs of 1e308 (each finite) made quantize --plan write Infinity into --json and
    config.json. Every number of a plan is range-checked on read, before the model is resolved."""
    plan = _plan_with(written, tmp_path, change)
    tripwire(monkeypatch, "qkit.models.inputs.resolve", "the model was resolved")
    out, js = tmp_path / "out.gguf", tmp_path / "out.json"
    with Unchanged(inputs=[tiny_model_dir, plan], dirs=[tmp_path]):
        line = assert_refused(invoke("quantize", str(tiny_model_dir), "--plan", str(plan), "--format", "gguf", "-o",
                                     str(out), "--json", str(js)), "--plan", needle)
    assert len(line) < 400, line  # a 400-digit number is shown cut


def _report_docs(tmp_path: Path, change) -> list[str]:
    from helpers_report import make_docs, write_docs

    docs = make_docs()
    change(docs)
    return [str(p) for p in write_docs(tmp_path, docs).values()]


def _row(docs, key, value, row=2):
    docs["eval"]["rows"][row][key] = value


@pytest.mark.parametrize("case,change,needle", [
    ("kl-negative", lambda d: _row(d, "kld", -5.0), "rows[2].kld"),
    ("kl-1e308", lambda d: _row(d, "kld", 1e308), "rows[2].kld"),
    ("perplexity-below-1", lambda d: _row(d, "perplexity", 0.5), "rows[2].perplexity"),
    ("probability-above-1", lambda d: _row(d, "top1_match", 1.5), "rows[2].top1_match"),
    ("size-negative", lambda d: _row(d, "size_bytes", -1), "rows[2].size_bytes"),
    ("bits-1e308", lambda d: _row(d, "bits_per_weight", 1e308), "rows[2].bits_per_weight"),
    ("change-below-100pct", lambda d: _row(d, "perplexity_change_pct", -150.0), "rows[2].perplexity_change_pct"),
    ("count-negative", lambda d: _row(d, "agreement", -3), "rows[2].agreement"),
    ("kl-change-inf", lambda d: _row(d, "versus_torch", {"kld_change": float("inf")}, 4), "rows[4].versus_torch.kld_change"),
    ("plan-kl-nan", lambda d: d["plan"]["totals"].__setitem__("predicted_kl", float("nan")), "totals.predicted_kl"),
    ("hist-400-digits", lambda d: d["outliers"]["histogram"][0].__setitem__("hi", 10**400), "histogram[0].hi"),
    ("elsewhere-nan", lambda d: d["eval"]["provenance"].__setitem__("extra", float("nan")), "provenance.extra"),
])
def test_a_report_input_out_of_range_is_refused_naming_the_field(tmp_path, monkeypatch, case, change, needle):
    """qkit report showed a negative KL as -5.0000 and 1e308 as a 309-digit number (with a matplotlib warning
    on stderr): every number it reads is range-checked, the file refused in one line naming the field."""
    files = _report_docs(tmp_path, change)
    tripwire(monkeypatch, "qkit.report.build.render", "the page was drawn")
    out = tmp_path / "report.html"
    with Unchanged(inputs=[Path(f) for f in files], dirs=[tmp_path]):
        assert_refused(invoke("report", *files, "-o", str(out), "--run", "none"), needle)


def test_extreme_numbers_in_range_draw_without_a_warning_or_a_long_number(tmp_path):
    """Values at the ends of their ranges (1e29, a denormal KL) draw: no library warning reaches stderr (a
    denormal made LogNorm raise), and no number is printed with 30 digits."""
    def change(d):
        for r in d["eval"]["rows"][1:4]:
            r["kld"], r["kld_se"], r["perplexity"] = 1e29, 1e29, 1e29
        for m in d["errors"]["matrices"]:
            m["rel_error"] = 5e-324
        for u in d["sensitivity"]["units"]:
            u["kl"] = 5e-324

    files = _report_docs(tmp_path, change)
    out = tmp_path / "report.html"
    r = invoke("report", *files, "-o", str(out), "--run", "none")
    assert r.code == 0, r.text
    assert all(line.startswith(("drawing", "wrote", "- ")) for line in r.lines), r.text  # nothing from a library
    html = out.read_text()
    assert "0" * 20 not in html and "1e+29" in html


# --------------------------------------------------------------------------- 9. terminal injection

ESC = "\x1b]0;PWNED\x07\x1b[31m"  # OSC 0 retitles the terminal; CSI 31m turns it red
HOSTILE_TEXT = "name" + ESC + "\u202e" + "[red]x[/red][link=http://evil]y[/link]\r\x9b"


def _unsafe(text: str, keep: str = "\n") -> list[str]:
    """The control characters of ``text`` a terminal acts on (C0 but ``keep``, DEL, C1, bidirectional, line
    and paragraph separators)."""
    import unicodedata

    bidi = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029")
    return [c for c in text if c not in keep and (unicodedata.category(c) == "Cc" or c in bidi)]


def test_the_sanitiser_escapes_every_control_character_and_keeps_printable_text():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from qkit.console import printable

    @settings(max_examples=300, deadline=None)
    @given(st.text())
    def never_a_control_character(text):
        out = printable(text)
        assert not _unsafe(out, keep="")
        assert printable(out) == out  # escaping twice changes nothing more

    @settings(max_examples=300, deadline=None)
    @given(st.text().filter(lambda t: not _unsafe(t, keep="")))
    def identity_on_printable_text(text):
        assert printable(text) == text

    never_a_control_character()
    identity_on_printable_text()
    assert printable("a\x1b[31mb\u202ec") == "a\\x1b[31mb\\u202ec"
    assert printable("two\nlines\tok", keep="\t\n") == "two\nlines\tok" and printable("a\nb") == "a\\x0ab"


@pytest.fixture
def piped(monkeypatch):
    """The consoles as a pipe sees them, whatever terminal runs the tests."""
    from qkit import console

    monkeypatch.setattr(console, "_out", console._console(stderr=False))
    monkeypatch.setattr(console, "_err", console.Console(stderr=True, highlight=False, soft_wrap=True))


def test_every_printer_of_the_console_escapes_what_it_is_given(piped, capsys):
    """console.py is the only module that prints: its error line, notes, tables (title, headers, cells,
    caption), histograms, status and warnings all go through the one sanitiser, and no string is read as
    rich markup (a [link=...] would emit an OSC 8 hyperlink)."""
    from qkit import console

    console.error(HOSTILE_TEXT)
    console.warn(HOSTILE_TEXT)
    console.note(HOSTILE_TEXT)
    console.status(HOSTILE_TEXT)
    console.table([HOSTILE_TEXT, "b"], [[HOSTILE_TEXT, HOSTILE_TEXT]], title=HOSTILE_TEXT, caption=HOSTILE_TEXT)
    console.histogram([HOSTILE_TEXT], [3], title=HOSTILE_TEXT)
    out, err = capsys.readouterr()
    for text in (out, err):
        assert not _unsafe(text), [hex(ord(c)) for c in _unsafe(text)]
        assert "\\x1b]0;PWNED\\x07" in text and "\\u202e" in text
        assert "[link=http://evil]y[/link]" in text and "[red]x[/red]" in text  # shown, never interpreted


def test_an_importance_matrix_name_reaches_the_terminal_escaped(tiny_model_dir, written, tmp_path):
    """Issue 48: importance-matrix names were echoed raw, so an ESC sequence in one recoloured and retitled
    the terminal. The refusal naming it shows ``\\x1b``, never the character."""
    import copy

    from qkit.methods.imatrix.file import read, write_gguf

    m = copy.deepcopy(read(written / "out" / "im.gguf"))
    first = sorted(m.entries)[0]
    m.entries["blk.0." + ESC + "\u202e.weight"] = m.entries.pop(first)
    m.datasets = ["data" + ESC]
    evil = tmp_path / "evil.gguf"
    write_gguf(m, evil)
    line = assert_refused(invoke("quantize", str(tiny_model_dir), "-s", "q4_k_m", "--format", "gguf", "--imatrix",
                                 str(evil), "-o", str(tmp_path / "o.gguf")), "--imatrix")
    assert not _unsafe(line) and "\\x1b]0;PWNED\\x07" in line and "\\u202e" in line


def test_a_config_field_reaches_the_terminal_escaped(tiny_model_dir, tmp_path, corpus, capfd):
    """model_type and architectures from a config.json, in a table (kv) and in a refusal (quantize); a
    rope_type that transformers logs through its own handler (eval), escaped too."""
    import shutil

    evil = tmp_path / "evil"
    shutil.copytree(tiny_model_dir, evil)
    cfg = json.loads((evil / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama" + ESC, ["Llama" + ESC + "\u202e"]
    (evil / "config.json").write_text(json.dumps(cfg))
    for args in (["kv", str(evil)], ["quantize", str(evil), "-s", "int8-row", "-o", str(tmp_path / "q")]):
        r = invoke(*args)
        assert not _unsafe(r.text) and "\\x1b" in r.text, r.text
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    cfg["rope_scaling"] = {"rope_type": "linear" + ESC, "factor": 2.0}
    (evil / "config.json").write_text(json.dumps(cfg))
    r = invoke("eval", str(evil), "--corpus", str(corpus), "--schemes", "int8-row", "--tokens", "32")
    assert r.code == 2 and not _unsafe(r.text), r.text
    err = capfd.readouterr().err  # what libraries wrote to the process's stderr past the CLI runner
    assert not _unsafe(err), err


def test_library_logs_and_warnings_are_escaped():
    """transformers and huggingface_hub log through handlers of their own, and Python's warnings print
    themselves: the command line makes every record and warning printable first (one sanitiser)."""
    import io
    import logging
    import warnings

    from qkit import console

    console.show_library_status()
    stream = io.StringIO()
    log = logging.getLogger("qkit_test_library")  # a library's logger with its own handler, as transformers has
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    try:
        log.warning("config says %s", ESC)
    finally:
        log.removeHandler(handler)
    shown = warnings.formatwarning("field " + ESC + "\u202e", UserWarning, "lib.py", 7)
    assert "config says \\x1b]0;PWNED" in stream.getvalue() and not _unsafe(stream.getvalue())
    assert "field \\x1b]0;PWNED" in shown and not _unsafe(shown)


def test_a_plan_field_reaches_the_terminal_escaped(tiny_model_dir, written, tmp_path):
    def change(d):
        d["model"], d["model_fingerprint"] = "other" + ESC, "0" * 64

    plan = _plan_with(written, tmp_path, change)
    line = assert_refused(invoke("quantize", str(tiny_model_dir), "--plan", str(plan), "--format", "gguf", "-o",
                                 str(tmp_path / "o.gguf")), "made for")
    assert not _unsafe(line) and "\\x1b]0;PWNED" in line


def test_a_report_input_reaches_the_page_and_the_terminal_escaped(tmp_path):
    """Strings of a report's JSON inputs (row names, the model, notes) are HTML-escaped and, first, made
    printable: the page (its SVG figures included) holds no control character."""
    def change(d):
        d["eval"]["rows"][2]["scheme"] = "q4" + ESC + "\u202e"
        d["eval"]["notes"] = ["note" + ESC]
        d["errors"]["matrices"][0]["name"] = "model.layers.0.self_attn.q" + ESC + ".weight"

    files = _report_docs(tmp_path, change)
    out = tmp_path / "report.html"
    r = invoke("report", *files, "-o", str(out), "--run", "none")
    assert r.code == 0, r.text
    html = out.read_text()
    assert not _unsafe(html) and "\\x1b]0;PWNED" in html
    assert not _unsafe(r.text)


# --------------------------------------------------------------------------- 10. reproducibility


def _timeless(doc):
    """A --json document without its timings (``seconds`` at any depth, a memory budget read from the
    machine): the only part two identical runs may differ in."""
    from qkit.plan.planfile import stable

    return stable(doc)


def test_two_identical_runs_write_the_same_bytes_in_every_format(written):
    """Same command, same inputs, same bytes: qkit's checkpoint, compressed-tensors, bitsandbytes, GGUF, the
    importance matrix, the plan and a checkpoint of it; every --json the same but for its timings."""
    first, second = written / "first", written / "out"
    names = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert {"q/model.safetensors", "ct/model.safetensors", "bnb/model.safetensors", "g.gguf", "im.gguf", "p.json",
            "gp.gguf", "qp/config.json"} <= set(names)
    reports = {n for n in names if "/" not in n and n.endswith(".json") and n != "p.json"}
    differ = [n for n in names if n not in reports and (first / n).read_bytes() != (second / n).read_bytes()]
    assert not differ, f"written twice, different bytes: {differ}"
    for n in sorted(reports):
        a, b = (_timeless(json.loads((d / n).read_text())) for d in (first, second))
        a, b = (json.loads(json.dumps(x).replace(str(first), "OUT").replace(str(second), "OUT")) for x in (a, b))
        assert a == b, n


def test_a_checkpoint_header_is_the_same_bytes_whoever_writes_it(tmp_path):
    """safetensors keeps a shard's metadata in a Rust HashMap seeded at random per map: {"format", "qkit"}
    came out in either order. Eight writes of the same tensors are one file."""
    import torch

    from qkit.checkpoint import ShardWriter

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    blobs = set()
    for i in range(8):
        d = tmp_path / str(i)
        d.mkdir()
        w = ShardWriter(d, manifest={"format": "qkit", "format_version": 1, "b": 2, "a": 1})
        w.add("x.weight", t)
        w.close()
        blobs.add((d / "model.safetensors").read_bytes())
    assert len(blobs) == 1


def test_a_checkpoint_records_no_cache_path(tiny_model_dir, tmp_path):
    """config.json embedded where the source was read from: a GGUF's converted copy records qkit's cache in
    its ``_name_or_path``, and quantize copied it into every checkpoint's config.json."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["_name_or_path"] = "/root/.cache/qkit/assets/some-model/0123456789abcdef"
    (src / "config.json").write_text(json.dumps(cfg))
    for fmt, scheme in (("qkit", "int8-row"), ("compressed-tensors", "int4-g32")):
        out = tmp_path / fmt
        assert invoke("quantize", str(src), "-s", scheme, "--format", fmt, "-o", str(out)).code == 0
        assert ".cache" not in (out / "config.json").read_text()
