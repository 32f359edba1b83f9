"""qkit report: kind detection, the figures' data against the JSON, the page, refusals, atomic writes.

The JSON fixtures are built in the shapes the commands write (``make_docs`` of ``tests/helpers_report.py``;
the shapes were taken from real ``--json`` outputs of the default model), so no model runs except the tiny
one for the steps.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="qkit report needs the report extra (matplotlib)")

from adversarial import invoke  # noqa: E402
from helpers_report import MODEL, make_docs, write_docs  # noqa: E402

from qkit.errors import InputError  # noqa: E402
from qkit.evaluation.measures import estimate  # noqa: E402
from qkit.report import build, data, figures, inputs, page  # noqa: E402
from qkit.version import __version__  # noqa: E402


# --------------------------------------------------------------------------- kinds and refusals


def test_every_kind_is_detected_from_its_content():
    for kind, doc in make_docs().items():
        assert inputs.detect_kind(doc) == kind
    for other in ({}, [], {"rows": []}, {"matrices": [{"name": "x"}]}, {"format": "qkit-export"}, 3):
        assert inputs.detect_kind(other) is None


def _refused(tmp_path, docs, *needles):
    paths = write_docs(tmp_path, docs)
    with pytest.raises(InputError) as e:
        inputs.read_inputs(list(paths.values()))
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_another_qkit_version_is_refused(tmp_path):
    docs = make_docs()
    docs["eval"]["provenance"]["qkit_version"] = "0.0.9"
    _refused(tmp_path, docs, "qkit 0.0.9", f"this is qkit {__version__}", "eval-data.json")
    docs = make_docs()
    docs["plan"]["qkit_version"] = "9.9"
    _refused(tmp_path, docs, "qkit 9.9", "plan-data.json")
    for kind in ("errors", "outliers", "sensitivity", "kv", "budget"):  # --json records it at the top
        docs = make_docs()
        docs[kind]["qkit_version"] = "0.0.1"
        _refused(tmp_path, docs, "qkit 0.0.1", f"{kind}-data.json")


def test_every_json_a_command_writes_records_its_qkit_version(tmp_path):
    from qkit.cli.common import start

    for doc in ({"matrices": []}, {"rows": [], "provenance": {"qkit_version": __version__}}, [1, 2]):
        out = tmp_path / "out.json"
        out.unlink(missing_ok=True)
        start(str(out), force=False).write_json(lambda d=doc: d)
        written = json.loads(out.read_text())
        if isinstance(doc, dict) and "provenance" not in doc:
            assert written == {"qkit_version": __version__, **doc}
        else:
            assert written == doc  # an eval's version stays in its provenance, once; a list is written as given


def test_another_model_is_refused(tmp_path):
    docs = make_docs()
    docs["outliers"]["model"] = "other/model"
    _refused(tmp_path, docs, "'other/model'", "outliers-data.json", "one model")
    docs = make_docs()
    docs["budget"]["models"][0]["architecture"]["name"] = "7b"
    _refused(tmp_path, docs, "budget-data.json", "'7b'")


def test_foreign_unreadable_duplicate_and_missing_files_are_refused(tmp_path):
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"hello": 1}))
    with pytest.raises(InputError, match="is not a JSON that qkit eval"):
        inputs.read_inputs([foreign])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not a readable JSON file"):
        inputs.read_inputs([bad])
    with pytest.raises(InputError, match="no such file"):
        inputs.read_inputs([tmp_path / "missing.json"])
    p = write_docs(tmp_path)["kv"]
    copy_ = tmp_path / "kv2.json"
    copy_.write_text(p.read_text())
    with pytest.raises(InputError, match="both kv JSONs"):
        inputs.read_inputs([p, copy_])


def test_same_model_sees_through_paths(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    assert inputs.same_model(str(d), str(tmp_path / "." / "m"))
    assert not inputs.same_model(str(d), "other")


# --------------------------------------------------------------------------- the figures' data equals the JSON's numbers


def test_frontier_points_equal_the_eval_json():
    doc = make_docs()["eval"]
    pts = data.frontier_points(doc)
    # the reference (rows[0]) and the refused vLLM row are not drawn; every other row is, in order
    assert [p["name"] for p in pts] == ["q8_0", "q4_k_m", "plan:gguf@q4_k_m", "q4_k_m"]
    assert [p["kind"] for p in pts] == ["uniform", "uniform", "plan", "engine"]
    measured = [r for r in doc["rows"][1:] if not r["refused"]]
    for p, r in zip(pts, measured):
        assert (p["bits"], p["kld"], p["kld_se"], p["perplexity_change_pct"], p["perplexity_change_se_pct"]) == (
            r["bits_per_weight"], r["kld"], r["kld_se"], r["perplexity_change_pct"], r["perplexity_change_se_pct"])


def test_an_older_eval_json_naming_simulations_runtime_reads_as_a_new_one(tmp_path):
    # qkit eval writes a row's simulations as spec["simulation"]; an eval JSON written before they had that
    # word names them spec["runtime"], and users keep those files: both rows are run-time rows, drawn alike
    kinds = {}
    for key in ("simulation", "runtime"):
        doc = make_docs()["eval"]
        spec = doc["rows"][2]["spec"]  # q4_k_m, with int8 activations simulated (bits/w alone does not place it)
        del spec["simulation"]
        spec[key] = ["act-int8-token"]
        path = tmp_path / f"eval-{key}.json"
        path.write_text(json.dumps(doc))
        kind, read = inputs.read_json(path)  # the schema checks either key's type
        assert kind == "eval" and data.row_kind(read["rows"][2]) == "simulation"
        kinds[key] = [p["kind"] for p in data.frontier_points(read)]
    assert kinds["simulation"] == kinds["runtime"] == ["uniform", "simulation", "plan", "engine"]
    assert data.row_kind(make_docs()["eval"]["rows"][2]) == "uniform"  # no simulation under either key
    for key in ("simulation", "runtime"):  # a wrong type under either key is one line naming it
        doc = make_docs()["eval"]
        doc["rows"][2]["spec"][key] = {"act": "int8"}
        path = tmp_path / f"bad-{key}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(InputError, match=rf"rows\[2\]\.spec\.{key} is"):
            inputs.read_json(path)


def test_a_simulated_row_is_a_simulation_beside_its_torch_runtime(tmp_path):
    # the frontier's kind of a row whose activations / KV cache are simulated in torch is "simulation"; the
    # runtime column (the engine that measured the row) still says torch
    doc = make_docs()["eval"]
    doc["rows"][2]["spec"]["simulation"] = ["act-int8-token"]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(doc))
    html, figs = page.render(inputs.read_inputs([path]))
    frontier = re.search(r'<section id="frontier">.*?</section>', html, re.S).group(0)
    assert re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>", frontier) == [
        ("q8_0", "uniform", "torch"), ("q4_k_m", "simulation", "torch"), ("plan:gguf@q4_k_m", "plan", "torch"),
        ("q4_k_m", "engine", "llama.cpp")]
    legend = "run-time simulation (activations / KV)"
    assert figures.KIND_STYLE["simulation"] == ("tab:gray", "^", legend) and "runtime" not in figures.KIND_STYLE
    assert sum(legend in f.svg() for f in figs) == 1  # the frontier figure's legend
    for f in figs:
        f.close()


def test_the_frontier_table_shows_two_standard_errors(tmp_path):
    html, figs = page.render(inputs.read_inputs([write_docs(tmp_path)["eval"]]))
    frontier = re.search(r'<section id="frontier">.*?</section>', html, re.S).group(0)
    assert "<td>0.0410 ± 0.0060</td>" in frontier  # q4_k_m: KL 0.041, SE 0.003
    assert "<td>+2.10 ± 0.70</td>" in frontier  # the planned row: 2.1% ± 2 x 0.35
    for f in figs:
        f.close()


def test_error_heatmap_cells_equal_inspects_numbers():
    doc = make_docs()["errors"]
    assert data.error_schemes(doc) == ["int8-row", "q4_k"]
    for scheme in ("int8-row", "q4_k"):
        g = data.error_grid(doc, scheme)
        assert g.layers == [0, 1]
        assert g.columns == list(data.MATRIX_ORDER)
        mine = [m for m in doc["matrices"] if m["scheme"] == scheme]
        assert len(g.values()) == len(mine) == 14
        for m in mine:
            layer, matrix = data.split_name(m["name"])
            assert g.cells[g.layers.index(layer)][g.columns.index(matrix)] == m["rel_error"]


def test_split_name_and_grid_golden():
    assert data.split_name("model.layers.12.mlp.down_proj.weight") == (12, "down_proj")
    assert data.split_name("model.layers.3.self_attn.q_proj") == (3, "q_proj")
    assert data.split_name("model.embed_tokens.weight") is None
    g = data.grid({"model.layers.2.mlp.up_proj.weight": 1.0, "model.layers.0.self_attn.q_proj.weight": 2.0,
                   "model.layers.0.extra.weight": 3.0, "lm_head.weight": 9.0})
    assert g.layers == [0, 2]
    assert g.columns == ["q_proj", "up_proj", "extra"]  # the run order first, then unknown names sorted
    assert g.cells == [[2.0, None, 3.0], [None, 1.0, None]]


def test_plan_grid_is_bits_per_weight_of_each_tensor():
    g = data.plan_grid(make_docs()["plan"])
    # q6_k: 725760 bytes for 576 x 1536 weights = 6.5625 bits; q4_k: 186624 / (576 x 576) * 8 = 4.5
    assert g.cells[0][g.columns.index("down_proj")] == 6.5625
    assert g.cells[1][g.columns.index("q_proj")] == 4.5
    assert g.labels[0][g.columns.index("down_proj")] == "q6_k"
    headers, rows = data.plan_types(make_docs()["plan"])
    assert rows[-1] == ["total", "2", "912,384", "6.000"]


def test_sensitivity_outliers_memory_and_engine_data():
    docs = make_docs()
    units = data.sensitivity_units(docs["sensitivity"])
    assert [(u["layer"], u["kl"], u["outlier_dims"]) for u in units] == [(0, 0.05, []), (1, 0.2, [5])]
    assert data.outlier_histogram(docs["outliers"]) == docs["outliers"]["histogram"]
    p = data.outlier_persistence(docs["outliers"])
    assert p == {"layers": [0, 1], "median": [1.5, 1.7], "dims": [{"dim": 5, "values": [30.0, 100.0],
                                                                   "outlier_layers": [1], "n_layers": 1}]}
    headers, rows = data.int8_levels(docs["outliers"])
    assert rows[0][2] == "11 of 256" and rows[1][0] == "without 5" and rows[1][2] == "80 of 256"
    assert [v["bytes_per_token"] for v in data.kv_variants(docs["kv"])] == [23040, 7680]
    bars = data.budget_bars(docs["budget"], MODEL)
    assert [(b["gpu_gib"], b["format"], b["max_tokens"]) for b in bars] == [
        (8.0, "fp16", 8000), (8.0, "int8", 8001), (16.0, "fp16", 16000), (16.0, "int8", 16001)]
    eng = data.engine_rows(docs["eval"])
    assert [(e["name"], e["runtime"], e["dppl_vs_torch"], e["refused"] is not None) for e in eng] == [
        ("q4_k_m", "llama.cpp", 0.2, False), ("q4_0", "vllm", None, True)]


# --------------------------------------------------------------------------- the page


def _sections(html: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r'<section id="([a-z]+)"[^>]*>.*?</section>', html, re.S)}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The report of every fixture document, built once for the tests that only read it: (files, report)."""
    files = list(write_docs(tmp_path_factory.mktemp("docs")).values())
    r = build.build_report(files, run="none")
    yield files, r
    r.close()


def test_page_has_every_section_and_is_self_contained(full):
    r = full[1]
    secs = _sections(r.html)
    assert list(secs) == list(page.SECTION_IDS)
    assert not any('class="absent"' in s for s in secs.values())
    assert r.html.count("<svg") == len(r.figures) == 9
    # nothing to fetch: no script, no link, no external src/href, a CSP that forbids any load
    assert "<script" not in r.html and "<link" not in r.html
    assert not re.search(r'(src|href)="(?!#|data:)', r.html)
    assert "default-src 'none'" in r.html
    assert "llama.cpp" in secs["engines"] and "vLLM cannot load" in secs["engines"]
    assert "0.3.36" in secs["engines"]
    assert "ab" * 32 in secs["provenance"] and "812.5" in secs["provenance"]
    assert len(r.html.encode()) < 2_000_000


def test_same_json_gives_byte_identical_html(full):
    files, first = full
    r = build.build_report(files, run="none")
    pages = [first.html, r.html]
    r.close()
    assert pages[0] == pages[1]
    ids = re.findall(r'\sid="([^"]+)"', pages[0])
    assert len(ids) == len(set(ids)), "two inline SVGs share an element id"


def test_a_missing_section_is_absent_with_a_note(tmp_path):
    paths = write_docs(tmp_path)
    r = build.build_report([paths["kv"]], run="none")
    try:
        secs = _sections(r.html)
        assert list(secs) == list(page.SECTION_IDS)
        for sid in ("quality", "frontier", "errors", "sensitivity", "outliers", "plan", "engines"):
            assert 'class="absent"' in secs[sid]
        assert "qkit inspect outliers --json" in secs["outliers"]
        assert 'class="absent"' not in secs["memory"] and "qkit budget default --json" in secs["memory"]
    finally:
        r.close()


def test_without_matplotlib_the_report_refuses_in_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(InputError, match=re.escape('pip install "qkit[report]"')):
        build.build_report([write_docs(tmp_path)["kv"]], run="none")


def test_run_steps_parse_and_a_run_on_another_model_is_refused(tmp_path, tiny_model_dir):
    assert build.parse_steps(None) == (build.DEFAULT_STEPS, False)
    assert build.parse_steps("none") == ((), True)
    assert build.parse_steps("eval,kv") == (("kv", "eval"), True)
    with pytest.raises(InputError, match="steps are"):
        build.parse_steps("kv,bogus")
    paths = write_docs(tmp_path)
    with pytest.raises(InputError, match="would run on"):
        build.build_report([paths["eval"]], model=str(tiny_model_dir), run="kv")
    r = build.build_report([paths["eval"]], model=str(tiny_model_dir))  # the default steps: skipped, said so
    assert any("not run" in n for n in r.notes)
    assert 'class="absent"' in _sections(r.html)["memory"]
    r.close()


def test_cheap_steps_run_on_the_model(tiny_model_dir):
    r = build.build_report([], model=str(tiny_model_dir), run="kv,budget")
    try:
        assert set(r.inputs.docs) == {"kv", "budget"} and r.inputs.paths["kv"] is None
        mem = _sections(r.html)["memory"]
        assert 'class="absent"' not in mem and "computed by this run" in r.html
        assert r.inputs.docs["kv"]["architecture"]["name"] == str(tiny_model_dir)
    finally:
        r.close()


# --------------------------------------------------------------------------- the command: outputs


@pytest.mark.slow
def test_cli_writes_page_and_pngs_and_refuses_bad_outputs(tmp_path):
    paths = write_docs(tmp_path)
    files = [str(p) for p in paths.values()]
    out, png = tmp_path / "r.html", tmp_path / "figs"
    res = invoke("report", *files, "-o", out, "--png", png, "--run", "none")
    assert res.code == 0, res.text
    assert out.read_text().startswith("<!DOCTYPE html>")
    names = sorted(p.name for p in png.iterdir())
    assert "frontier.png" in names and "outlier-persistence.png" in names and len(names) == 9
    assert all((png / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    # an existing page without --force; with --force it is replaced
    res = invoke("report", paths["kv"], "-o", out, "--run", "none")
    assert res.code == 2 and "--force" in res.text
    assert invoke("report", paths["kv"], "-o", out, "--run", "none", "--force").code == 0
    assert 'id="frontier" class="absent"' in out.read_text()
    # never over an input, --force or not; never over a file qkit report did not write
    res = invoke("report", *files, "-o", paths["kv"], "--run", "none", "--force")
    assert res.code == 2 and "never writes over what it reads" in res.text
    other = tmp_path / "notes.html"
    other.write_text("<html>mine</html>")
    res = invoke("report", *files, "-o", other, "--run", "none", "--force")
    assert res.code == 2 and "not something qkit wrote" in res.text and other.read_text() == "<html>mine</html>"


@pytest.mark.parametrize("case", ["unwritable", "bad-json", "other-version", "missing-o"])
def test_cli_refusals_are_one_line_and_leave_nothing(tmp_path, case):
    docs = make_docs()
    if case == "other-version":
        docs["eval"]["provenance"]["qkit_version"] = "0.0.1"
    paths = write_docs(tmp_path, docs)
    files = [str(p) for p in paths.values()]
    out = tmp_path / "r.html"
    if case == "unwritable":
        out = Path("/proc/qkit-report.html")  # a pseudo file system: no file can be created there
    if case == "bad-json":
        (tmp_path / "bad.json").write_text("[1, 2")
        files.append(str(tmp_path / "bad.json"))
    before = sorted(p.name for p in tmp_path.iterdir())
    args = ["report", *files, "--run", "none"] + ([] if case == "missing-o" else ["-o", out])
    res = invoke(*args)
    assert res.code == 2
    assert len(res.lines) == 1 and res.lines[0].startswith("error: "), res.text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no page, no temporary sibling


def test_a_failed_write_leaves_no_half_page(tmp_path, monkeypatch):
    r = build.build_report([write_docs(tmp_path)["kv"]], run="none")
    out = tmp_path / "r.html"
    real_open = open

    def failing_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "x" in mode:
            f.write("<!DOCTYPE html> half")
            f.close()
            raise OSError(28, "No space left on device", str(path))
        return f

    import builtins

    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(Exception, match="no space left"):
        build.write_report(r, out)
    monkeypatch.undo()
    r.close()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith((".r.html", "r.html"))] == []


def test_page_escapes_what_the_json_says(tmp_path):
    docs = copy.deepcopy(make_docs())
    docs["eval"]["notes"] = ["<script>alert(1)</script>"]
    r = build.build_report([write_docs(tmp_path, {"eval": docs["eval"]})["eval"]], run="none")
    assert "<script>" not in r.html and "&lt;script&gt;" in r.html
    r.close()


def test_quality_table_numbers_golden():
    headers, rows = data.quality_table(make_docs()["eval"])
    q8 = dict(zip(headers, rows[1]))
    assert (q8["row"], q8["bits/w"], q8["size (MB)"], q8["KL (nats)"], q8["Δ ppl (%)"], q8["top-1"]) == (
        "q8_0", "8.500", "8.5", "0.0012 ± 0.0001", "0.10 ± 0.05", "90.0%")
    assert estimate(0.0013, 3.05e-5, 4) == "0.0013 ± 3e-05"  # an SE below the last digit keeps one digit
    assert rows[0][5] == rows[0][6] == ""  # the reference has no change against itself
    assert rows[-1][2].startswith("refused: vLLM cannot load")
