"""A llama.cpp recipe writes the whole file llama-quantize writes: token_embd and output included (issue 49).

The oracle is llama-quantize's own file of the default model, from llama.cpp's converter's F32 GGUF
(``convert_hf_to_gguf.py --outtype f32``), with its default options (no ``--token-embedding-type``):
``tests/golden/llama_quantize_whole.json`` holds, for q4_k_m and q3_k_m, every tensor's ggml type and the
sha256 of its bytes, the data section's bytes (the file less its header) and the file's size. qkit's file
must hold the same tensors, byte for byte, and be that size plus the keys llama-quantize does not write
(qkit's ``qkit.export`` record and the published GGUF's descriptive ``general.*`` keys it keeps), within
the header's 32-byte alignment. Recorded with llama.cpp's tools built (``python benchmarks/build_llama_ref.py
--tools``), with the same switch as ``test_golden_llama_quantize.py``:

    QKIT_RECORD_LLAMA_QUANTIZE=1 python -m pytest tests/test_whole_files.py

Beside it: the rule for ``token_embd`` / ``output`` on tiny tied and untied models (hidden 256: whole k-quant
super-blocks; hidden 96: the fallbacks) against llama.cpp's, read off ``llama_tensor_get_type_impl`` here by
hand; ``--token-embedding-type`` / ``--output-tensor-type``; the importance matrix (token_embd unweighted, as
llama-quantize); GPTQ (the two tensors written by RTN, said so); the summary's "kept unquantized"; the whole
file's budget of a plan; and the refusals.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from adversarial import Unchanged, assert_refused, invoke, tripwire
from conftest import TINY_TEXT, benchmark_module, make_tiny_llama

from qkit.api import QuantizeOptions, quantize_model
from qkit.checkpoint import iter_tensors
from qkit.errors import InputError
from qkit.methods.imatrix import Imatrix, ImatrixEntry, write_gguf

GOLDEN_PATH = Path(__file__).parent / "golden" / "llama_quantize_whole.json"
RECORD = os.environ.get("QKIT_RECORD_LLAMA_QUANTIZE") == "1"
RECORD_COMMAND = "QKIT_RECORD_LLAMA_QUANTIZE=1 python -m pytest tests/test_whole_files.py"
RECIPES = [("q4_k_m", "Q4_K_M"), ("q3_k_m", "Q3_K_M")]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


# --------------------------------------------------------------------------- reading a file


def file_tensors(path: Path) -> dict:
    """``{"tensors": {gguf name: [ggml type, sha256 of its bytes]}, "data_bytes", "file_bytes", "extra_kv_bytes"}``;
    ``extra_kv_bytes``: the bytes of the keys only qkit writes (its record, the source's general.* keys)."""
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: [t.tensor_type.name, hashlib.sha256(np.ascontiguousarray(np.asarray(t.data)).view(np.uint8)
                                                            .tobytes()).hexdigest()] for t in r.tensors}
    size = path.stat().st_size
    return {"tensors": dict(sorted(tensors.items())), "data_bytes": size - r.data_offset, "file_bytes": size,
            "keys": sorted(f for f in r.fields if not f.startswith("GGUF.")),
            "kv_bytes": {f.name: sum(int(p.nbytes) for p in f.parts) for f in r.fields.values()}}


def _llama_quantize(f32: Path, out: Path, ftype: str) -> None:
    tool = benchmark_module("build_llama_ref").tool_path("llama-quantize")
    p = subprocess.run([str(tool), str(f32), str(out), ftype, "2"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def _f32(model: Path, work: Path) -> Path:
    f32 = work / "F32.gguf"
    benchmark_module("bench_llama_cpp").convert_f32(model, f32, work)
    return f32


def record(model: Path, work: Path) -> dict:
    blr = benchmark_module("build_llama_ref")
    if not blr.tools_built():
        pytest.fail("recording needs llama.cpp's tools: python benchmarks/build_llama_ref.py --tools")
    f32 = _f32(model, work)
    files = {}
    for scheme, ftype in RECIPES:
        _llama_quantize(f32, work / f"{ftype}.gguf", ftype)
        got = file_tensors(work / f"{ftype}.gguf")
        files[scheme] = {k: got[k] for k in ("tensors", "data_bytes", "file_bytes", "keys")}
    doc = {"description": "llama-quantize's whole file of the default model (SmolLM2-135M-Instruct, from llama.cpp's "
                          "converter's F32 GGUF, default options): every tensor's ggml type and sha256, the data section's "
                          "bytes, the file's bytes and its keys",
           "command": RECORD_COMMAND, "llama_cpp_commit": blr.commit(), "llama_cpp_python_sdist": blr.LLAMA_CPP_PYTHON,
           "convert": "convert_hf_to_gguf.py --outtype f32 --outfile F32.gguf MODEL",
           "llama_quantize": {s: f"llama-quantize F32.gguf OUT.gguf {f} 2" for s, f in RECIPES}, "files": files}
    GOLDEN_PATH.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    if RECORD:
        from qkit.models import resolve

        return record(resolve(None).directory, tmp_path_factory.mktemp("whole-record"))
    return json.loads(GOLDEN_PATH.read_text())


def test_the_golden_file_says_where_it_came_from(golden):
    assert golden["command"] == RECORD_COMMAND
    assert golden["llama_cpp_commit"] == benchmark_module("build_llama_ref").LLAMA_CPP_COMMIT
    assert set(golden["files"]) == {s for s, _ in RECIPES}
    for f in golden["files"].values():
        assert len(f["tensors"]) == 272 and f["tensors"]["token_embd.weight"][0] == "Q8_0"  # tied, 576 wide


def _assert_same_file(got: dict, want: dict) -> None:
    assert list(got["tensors"]) == list(want["tensors"])
    types = {n: (got["tensors"][n][0], t) for n, (t, _) in want["tensors"].items() if got["tensors"][n][0] != t}
    assert not types, f"types differ (qkit, llama-quantize): {types}"
    differ = [n for n in want["tensors"] if got["tensors"][n][1] != want["tensors"][n][1]]
    assert not differ, f"bytes differ from llama-quantize's in {differ}"
    assert got["data_bytes"] == want["data_bytes"]
    extra = sum(got["kv_bytes"][k] for k in set(got["keys"]) - set(want["keys"]))
    assert set(want["keys"]) <= set(got["keys"])
    assert abs(got["file_bytes"] - extra - want["file_bytes"]) < 32, (got["file_bytes"], extra, want["file_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "ftype"), RECIPES, ids=[s for s, _ in RECIPES])
def test_the_recipe_file_is_llama_quantizes(golden, default_model_dir, tmp_path, scheme, ftype):
    """qkit quantize -s RECIPE --format gguf on the default model: every tensor of llama-quantize's file, token_embd
    (Q8_0) included, the same bytes, and the same size less the keys only qkit writes."""
    out = tmp_path / "q.gguf"
    quantize_model(default_model_dir, output=out, options=QuantizeOptions(scheme=scheme, format="gguf"))
    _assert_same_file(file_tensors(out), golden["files"][scheme])


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_the_golden_file_is_what_llama_quantize_writes_now(golden, default_model_dir, tmp_path):
    """With the tools built: llama-quantize run again gives the recorded tensors (the oracle did not move)."""
    if not benchmark_module("build_llama_ref").tools_built():
        pytest.skip("llama.cpp's tools are not built (python benchmarks/build_llama_ref.py --tools)")
    f32 = _f32(default_model_dir, tmp_path)
    for scheme, ftype in RECIPES:
        _llama_quantize(f32, tmp_path / f"{ftype}.gguf", ftype)
        got = file_tensors(tmp_path / f"{ftype}.gguf")
        assert {k: got[k] for k in ("tensors", "data_bytes", "file_bytes")} == {
            k: golden["files"][scheme][k] for k in ("tensors", "data_bytes", "file_bytes")}


# --------------------------------------------------------------------------- the rule on tiny models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tied and untied llamas 256 wide (whole 256-blocks) and 96 wide (only 32-blocks)."""
    root = tmp_path_factory.mktemp("whole-tiny")
    out = {}
    for hidden in (256, 96):
        for tie in (True, False):
            key = f"{hidden}-{'tied' if tie else 'untied'}"
            make_tiny_llama(root / key, hidden=hidden, intermediate=2 * hidden, tie=tie, vocab=320)
            out[key] = root / key
    return out


# llama_tensor_get_type_impl, read off the C by hand: output and a tied token_embd are Q8_0 where the width is not
# whole blocks of the default type, else Q6_K (Q8_0 stays Q8_0); an untied token_embd the default type, then
# tensor_type_fallback (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, IQ4_XS -> IQ4_NL)
HEAD_RULE = {
    # recipe: (default type at 256, its fallback at 96)
    "q2_k-llama": ("q2_k", "q4_0"), "q3_k_s": ("q3_k", "q4_0"), "q3_k_m": ("q3_k", "q4_0"),
    "iq4_xs-llama": ("iq4_xs", "iq4_nl"), "iq4_nl-llama": ("iq4_nl", "iq4_nl"), "q4_k_m": ("q4_k", "q5_0"),
    "q5_k_s": ("q5_k", "q5_1"),
}


@pytest.mark.parametrize("recipe", list(HEAD_RULE))
def test_token_embd_and_output_take_llama_cpps_types(tiny, tmp_path, recipe):
    for key, model in tiny.items():
        res = quantize_model(model, output=tmp_path / key, options=QuantizeOptions(scheme=recipe, format="gguf"))
        wide = key.startswith("256")
        plain = HEAD_RULE[recipe][0 if wide else 1]
        # 96 is not whole blocks of 256: Q8_0 (for IQ4_NL, whose block is 32, the rule's Q6_K falls back to Q8_0)
        head = "q6_k" if wide else "q8_0"
        if key.endswith("-tied"):
            assert res.types[EMBED] == head and HEAD not in res.types, (key, res.types[EMBED])
        else:
            assert (res.types[EMBED], res.types[HEAD]) == (plain, head), key
        assert not res.kept.keys() & {EMBED, HEAD}


def _tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.ascontiguousarray(np.asarray(t.data)).tobytes())
            for t in gguf.GGUFReader(str(path)).tensors}


def test_f32_options_give_back_the_projections_file(tiny, tmp_path):
    """--token-embedding-type f32 --output-tensor-type f32 keeps both as the source has them; every other tensor's
    bytes are the whole file's, and those of the file that excludes the two (what qkit wrote before)."""
    model = tiny["256-untied"]
    wide = quantize_model(model, output=tmp_path / "w.gguf", options=QuantizeOptions(scheme="q4_k_m", format="gguf",
                          token_embedding_type="f32", output_tensor_type="F32"))
    before = quantize_model(model, output=tmp_path / "b.gguf", options=QuantizeOptions(scheme="q4_k_m", format="gguf",
                            exclude=(EMBED, HEAD)))
    whole = quantize_model(model, output=tmp_path / "a.gguf", options=QuantizeOptions(scheme="q4_k_m", format="gguf"))
    a, b, c = _tensor_bytes(tmp_path / "w.gguf"), _tensor_bytes(tmp_path / "b.gguf"), _tensor_bytes(tmp_path / "a.gguf")
    assert a == b
    src = dict(iter_tensors(model))
    assert a["token_embd.weight"] == ("F32", src[EMBED].numpy().tobytes())
    assert a["output.weight"][0] == "F32"
    assert {n: v for n, v in a.items() if n not in ("token_embd.weight", "output.weight")} == {
        n: v for n, v in c.items() if n not in ("token_embd.weight", "output.weight")}
    assert set(wide.kept) >= {EMBED, HEAD} and wide.matrices == before.matrices == whole.matrices - 2
    assert wide.bytes_after > whole.bytes_after


def test_a_block_type_and_f16_as_llama_quantize_reads_them(tiny, tmp_path):
    """A given block type is written as given; f16 keeps the tensor unquantized as F16 (qkit and GGUF alike); on a
    tied model --output-tensor-type sets token_embd unless --token-embedding-type is given."""
    res = quantize_model(tiny["256-untied"], output=tmp_path / "u.gguf", options=QuantizeOptions(
        scheme="q3_k_m", format="gguf", token_embedding_type="q8_0", output_tensor_type="f16"))
    got = _tensor_bytes(tmp_path / "u.gguf")
    assert got["token_embd.weight"][0] == "Q8_0" and got["output.weight"][0] == "F16"
    head = dict(iter_tensors(tiny["256-untied"]))[HEAD]
    assert got["output.weight"][1] == head.to(torch.float16).numpy().tobytes()
    assert res.kept[HEAD] == head.numel() * 2
    res = quantize_model(tiny["256-tied"], output=tmp_path / "t", options=QuantizeOptions(scheme="q4_k_m",
                         output_tensor_type="q5_0"))  # the qkit format: the same types
    assert res.types[EMBED] == "q5_0"
    res = quantize_model(tiny["256-tied"], output=tmp_path / "t2", options=QuantizeOptions(
        scheme="q4_k_m", token_embedding_type="bf16", output_tensor_type="q8_0"))
    assert EMBED not in res.types and res.kept[EMBED] == 320 * 256 * 2 and res.notes  # the head option set nothing


def test_the_importance_matrix_weights_the_head_only_where_it_has_an_entry(tiny, tmp_path):
    """llama-imatrix collects no token_embd (output only with --process-output): llama-quantize quantizes them
    without weights where the matrix has no entry, and so does qkit; an output entry weights the head."""
    model = tiny["256-untied"]
    rng = np.random.default_rng(5)
    blocks = {f"blk.{i}.{role}.weight": w for i in range(2) for role, w in (
        ("attn_q", 256), ("attn_k", 256), ("attn_v", 256), ("attn_output", 256), ("ffn_gate", 256), ("ffn_up", 256),
        ("ffn_down", 512))}

    def matrix(names: dict, path: Path) -> str:
        entries = {n: ImatrixEntry((rng.random(w) * 100 + 1).astype(np.float32).reshape(1, w), np.array([100.0], np.float32))
                   for n, w in names.items()}
        write_gguf(Imatrix(entries, chunk_count=1, chunk_size=100, datasets=["seeded"]), path)
        return str(path)

    plain = tmp_path / "plain.gguf"
    quantize_model(model, output=plain, options=QuantizeOptions(scheme="q4_k_m", format="gguf"))
    without = quantize_model(model, output=tmp_path / "a.gguf", options=QuantizeOptions(
        scheme="q4_k_m", format="gguf", imatrix=matrix(blocks, tmp_path / "a.imatrix")))
    quantize_model(model, output=tmp_path / "b.gguf", options=QuantizeOptions(
        scheme="q4_k_m", format="gguf", imatrix=matrix({**blocks, "output.weight": 256}, tmp_path / "b.imatrix")))
    p, a, b = _tensor_bytes(plain), _tensor_bytes(tmp_path / "a.gguf"), _tensor_bytes(tmp_path / "b.gguf")
    assert a["token_embd.weight"] == p["token_embd.weight"] == b["token_embd.weight"]  # Q4_K, never weighted
    assert a["output.weight"] == p["output.weight"] != b["output.weight"]  # Q6_K: weighted by its entry only
    assert a["blk.0.attn_q.weight"] != p["blk.0.attn_q.weight"]
    assert without.imatrix["unweighted"] == [HEAD, EMBED]


def test_gptq_writes_the_embedding_and_head_by_rtn_and_says_so(tiny, tmp_path):
    cal = tmp_path / "cal.txt"
    cal.write_text(TINY_TEXT * 30)
    model = tiny["96-untied"]
    res = quantize_model(model, output=tmp_path / "g.gguf", method="gptq", options=QuantizeOptions(
        scheme="q4_k_m", format="gguf"), method_options={"calibration": str(cal), "calibration_samples": 4,
                                                          "calibration_seqlen": 64})
    rtn = quantize_model(model, output=tmp_path / "r.gguf", options=QuantizeOptions(scheme="q4_k_m", format="gguf"))
    assert {EMBED, HEAD} <= set(res.method_record["rtn_fallback"])
    assert res.method_record["rtn_fallback_reasons"][EMBED] == "outside the blocks (not a block linear)"
    g, r = _tensor_bytes(tmp_path / "g.gguf"), _tensor_bytes(tmp_path / "r.gguf")
    assert g["token_embd.weight"] == r["token_embd.weight"] and g["output.weight"] == r["output.weight"]
    assert rtn.types[EMBED] == res.types[EMBED] == "q5_0"


# --------------------------------------------------------------------------- what the summary and the planner say


def test_every_formats_summary_says_what_stays_unquantized(tiny, tmp_path):
    model = tiny["96-tied"]
    wide = {"COLUMNS": "400"}  # one line per row of the table
    out = invoke("quantize", str(model), "-s", "int8-row", "-o", str(tmp_path / "i8"), env=wide)
    assert out.code == 0, out.text
    line = next(x for x in out.lines if "kept unquantized" in x)
    assert "model.embed_tokens x1" in line and "% of the file" in line
    out = invoke("quantize", str(model), "-s", "q4_k_m", "--format", "gguf", "-o", str(tmp_path / "q.gguf"), env=wide)
    line = next(x for x in out.lines if "kept unquantized" in x)
    assert "embed_tokens" not in line and "norm" in line


def test_a_plans_budget_is_the_whole_file(tiny, tmp_path):
    """--target-size is the file's tensors: the tensors outside the plan count against it; --target-scheme RECIPE
    plans what the recipe's file quantizes and gets its whole-file bytes."""
    from qkit.api import plan_model
    from qkit.plan import PlanOptions

    model = tiny["96-tied"]
    cal = tmp_path / "cal.txt"
    cal.write_text(TINY_TEXT * 30)
    common = {"format": "gguf", "calibration": str(cal), "samples": 2, "seqlen": 32, "check_windows": 1}
    recipe = quantize_model(model, output=tmp_path / "r.gguf", options=QuantizeOptions(scheme="q4_k_m", format="gguf"))
    at = plan_model(model, options=PlanOptions(target_scheme="q4_k_m", **common)).plan
    tensor_bytes = sum(len(b) for _, b in _tensor_bytes(tmp_path / "r.gguf").values())
    assert EMBED in at.tensors and at.target["file_bytes"] == tensor_bytes
    assert at.target["budget_bytes"] == tensor_bytes - at.target["outside_bytes"] >= at.nbytes
    with pytest.raises(InputError, match="tensors outside the plan, kept as they are; --include the embedding"):
        plan_model(model, options=PlanOptions(target_size=tensor_bytes, **common))  # its f32 embedding leaves too little
    sized = plan_model(model, options=PlanOptions(target_size=tensor_bytes, include=(EMBED,), **common)).plan
    assert EMBED in sized.tensors and sized.target["outside_bytes"] == at.target["outside_bytes"]
    assert sized.nbytes + sized.target["outside_bytes"] <= tensor_bytes < recipe.bytes_after


# --------------------------------------------------------------------------- refusals, before any work


@pytest.mark.parametrize(("args", "needles"), [
    (("-s", "int4-g128", "--token-embedding-type", "q8_0"), ("--token-embedding-type", "recipe", "int4-g128")),
    (("-s", "q4_k", "--output-tensor-type", "q8_0"), ("--output-tensor-type", "recipe")),
    (("-s", "q4_k_m", "--token-embedding-type", "q9_9"), ("--token-embedding-type", "q9_9", "f16")),
    (("-s", "q4_k_m", "--output-tensor-type", "nf4"), ("--output-tensor-type", "nf4")),
    (("-s", "q4_k_m", "--token-embedding-type", " "), ("--token-embedding-type", "empty")),
    (("-s", "q4_k_m", "--token-embedding-type", "q4_k"), ("96 wide", "256")),
    (("-s", "q4_k_m", "--token-embedding-type", "q8_0", "--exclude", EMBED), ("--exclude", EMBED)),
    (("--target-bits", "5", "--token-embedding-type", "q8_0"), ("plan", "--token-embedding-type")),
])
def test_bad_head_types_are_refused_in_one_line_before_any_work(tiny, tmp_path, monkeypatch, args, needles):
    tripwire(monkeypatch, "qkit.api.write_checkpoint", "writing")
    tripwire(monkeypatch, "qkit.api.plan_model", "planning")
    model = tiny["96-tied"]
    with Unchanged(inputs=[model], dirs=[tmp_path]):
        assert_refused(invoke("quantize", str(model), "--format", "gguf", "-o", str(tmp_path / "o.gguf"), *args), *needles)


def test_the_eval_swaps_the_quantized_embedding_and_tied_head_and_restores_them(tiny, tmp_path):
    """The torch engine's Swapper: a row's embedding replaces the tied head with it, and restore puts both back."""
    from qkit.checkpoint import iter_quantized
    from qkit.evaluation.swap import Swapper
    from qkit.models import load

    model = tiny["256-tied"]
    quantize_model(model, output=tmp_path / "row", options=QuantizeOptions(scheme="q4_k_m"))
    loaded = load(model, device="cpu").model
    before = loaded.get_input_embeddings().weight.detach().clone()
    swap = Swapper(loaded, model)
    swap.apply(iter_quantized(tmp_path / "row"))
    emb, head = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
    assert not torch.equal(emb, before) and torch.equal(head, emb)
    swap.restore()
    assert torch.equal(loaded.get_input_embeddings().weight, before)
    assert torch.equal(loaded.get_output_embeddings().weight, before)
