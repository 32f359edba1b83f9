"""``qkit eval --schemes file:PATH.gguf``: an existing GGUF file scored as it is, in torch and in llama.cpp.

The oracle is qkit's own row of the same scheme: a GGUF that ``qkit quantize --format gguf -s q4_k_m`` wrote
holds exactly the weights of the eval's ``q4_k_m`` row, so its file row must give the same numbers, digit
for digit, in each runtime (and a q8_0 file the q8_0 row's, which differ from q4_k_m's). The torch row's
weights are checked against the ``gguf`` package's ``dequantize`` of the stored bytes, with llama.cpp's q/k
row permutation written out here as its converter writes it.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from adversarial import invoke

from qkit.checkpoint import iter_tensors
from qkit.errors import InputError
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.engine_rows import Target, refusal
from qkit.evaluation.engines import EngineOptions, get_engine
from qkit.evaluation.specs import RowSpec, file_labels, resolve_rows
from qkit.export.gguf.reader import read_header, read_weights
from qkit.models import read_config

SAME = ("perplexity", "perplexity_se", "perplexity_change_pct", "perplexity_change_se_pct", "kld", "kld_se",
        "top1_match", "battery_outputs", "battery_answers", "agreement", "bits_per_weight", "matrices")


def _written(model: Path, directory: Path, scheme: str) -> Path:
    out = directory / f"{scheme}.gguf"
    r = invoke("quantize", str(model), "-s", scheme, "--format", "gguf", "-o", str(out))
    assert r.code == 0, r.text
    return out


@pytest.fixture(scope="module")
def files(wide_model, tmp_path_factory) -> dict[str, Path]:
    """GGUF files qkit wrote of the 256/512-wide llama (its k-quants stay k-quants): q4_k_m and q8_0."""
    d = tmp_path_factory.mktemp("file-rows")
    return {s: _written(wide_model, d, s) for s in ("q4_k_m", "q8_0")}


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter (``LlamaModel.permute``): the rows of q/k as its rotary kernel pairs them."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_the_header_reader_agrees_with_the_gguf_package(files):
    for path in files.values():
        header, reader = read_header(path), gguf.GGUFReader(str(path))
        assert [(t.name, t.ggml_type, t.ne) for t in header.tensors] == [
            (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape)) for t in reader.tensors]
        assert [header.data_offset + t.offset for t in header.tensors] == [int(t.data_offset) for t in reader.tensors]
        assert header.fields["general.architecture"] == b"llama"


def test_the_torch_weights_are_the_gguf_packages_dequantize(wide_model, files):
    config = read_config(wide_model)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    reference = dict(iter_tensors(wide_model))
    types: dict[str, set[str]] = {}
    for scheme, path in files.items():
        weights = read_weights(path, wide_model, config)
        stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        permuted = 0
        for info, (name, dense) in zip(weights.tensors, weights.iter_tensors(), strict=True):
            t = stored[info.gguf_name]
            want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            assert dense.dtype == torch.float32 and tuple(dense.shape) == tuple(reference[name].shape), name
            n_head = next((h for k, h in heads.items() if f".{k}." in name), None)
            as_stored = _llama_permute(dense, n_head) if n_head else dense
            permuted += n_head is not None
            assert torch.equal(as_stored, want.reshape(as_stored.shape)), name  # bit for bit
            types.setdefault(scheme, set()).add(t.tensor_type.name)
            if t.tensor_type == gguf.GGMLQuantizationType.F32:  # kept tensors: the reference's own values
                assert torch.equal(dense, reference[name]), name
            else:
                assert not torch.equal(dense, reference[name]), name
        assert permuted == 4  # q and k of 2 layers, unpermuted on the way in
        assert len(weights.quantized) == 14 + (scheme == "q4_k_m")  # a recipe's whole file: the tied embedding too
    assert {"Q4_K", "Q6_K", "F32"} <= types["q4_k_m"] and types["q8_0"] == {"Q8_0", "F32"}


def test_a_file_row_equals_the_scheme_row_it_was_written_as(wide_model, files, corpus):
    q4, q8 = files["q4_k_m"], files["q8_0"]
    opts = EvalOptions(schemes=("q4_k_m", "q8_0", f"file:{q4}", f"file:{q8}"), corpus=str(corpus), tokens=128,
                       agree_tokens=3, battery_tokens=8)
    report = evaluate(wide_model, options=opts)
    rows = {r.scheme: r for r in report.rows}
    parent = q4.parent.name  # the files' stems are the scheme rows' names: one directory more makes them unique
    assert list(rows) == ["reference", "q4_k_m", "q8_0", f"{parent}/q4_k_m", f"{parent}/q8_0"]
    for scheme, path in files.items():
        ours, theirs = rows[f"{parent}/{scheme}"], rows[scheme]
        for field in SAME:
            assert getattr(ours, field) == getattr(theirs, field), (scheme, field)
        # q4_k_m's whole file quantizes the tied embedding too: the torch engine swaps it (and with it the head)
        assert ours.weights_changed == theirs.weights_changed == 14 + (scheme == "q4_k_m")
        assert ours.size_bytes == path.stat().st_size  # the file's bytes, as a GGUF row counts its file
        assert ours.spec["file"] == str(path) and ours.spec["scheme"] is None and ours.build_seconds is None
        reader = gguf.GGUFReader(str(path))  # bits/w from the file's own quantized tensors' bytes
        q = [t for t in reader.tensors if t.tensor_type != gguf.GGMLQuantizationType.F32]
        assert ours.bits_per_weight == 8 * sum(int(t.n_bytes) for t in q) / sum(int(t.n_elements) for t in q)
    # the two files are two different rows: the check above cannot pass by reading one row twice
    assert rows[f"{parent}/q4_k_m"].kld > 2 * rows[f"{parent}/q8_0"].kld > 0
    assert rows[f"{parent}/q4_k_m"].perplexity != rows[f"{parent}/q8_0"].perplexity
    assert report.to_dict()["rows"][3]["spec"]["file"] == str(q4)


def test_file_rows_are_named_after_their_files_uniquely():
    assert file_labels(["/p/a/q4_k_m.gguf", "/p/b/model.gguf"], set()) == ["q4_k_m", "model"]
    assert file_labels(["/p/iters0/model.gguf", "/p/iters10/model.gguf"], set()) == ["iters0/model", "iters10/model"]
    assert file_labels(["/p/a/q4_k_m.gguf"], {"q4_k_m"}) == ["a/q4_k_m"]
    assert file_labels(["/x/a/m.gguf", "/y/a/m.gguf"], set()) == ["x/a/m", "y/a/m"]
    assert file_labels(["/a/m.gguf", "/a/m.bin"], set()) == ["/a/m.gguf", "/a/m.bin"]  # nothing shorter differs
    assert file_labels(["/a/reference.gguf"], {"reference"}) == ["a/reference"]


def test_resolved_file_rows_keep_their_order_and_the_reference_name_free(files, tmp_path):
    ref = tmp_path / "reference.gguf"
    ref.write_bytes(files["q8_0"].read_bytes())
    specs = resolve_rows(["q8_0", f"file:{files['q4_k_m']}", f"FILE:{ref}"])
    assert [s.name for s in specs] == ["q8_0", "q4_k_m", f"{tmp_path.name}/reference"]
    assert specs[1] == RowSpec(None, file=str(files["q4_k_m"]), label="q4_k_m") and specs[1].quantized
    link = tmp_path / "link.gguf"
    link.symlink_to(files["q4_k_m"])
    with pytest.raises(InputError, match="given twice .also as file:"):
        resolve_rows([f"file:{files['q4_k_m']}", f"file:{link}"])


def test_an_engine_that_cannot_load_the_file_refuses_its_row(files):
    spec = RowSpec(None, file=str(files["q4_k_m"]))
    target = Target(spec.name, spec)
    assert refusal(get_engine("torch"), target) is None
    assert refusal(get_engine("llama.cpp"), target) is None
    reason = refusal(get_engine("vllm"), target)
    assert reason.startswith("vllm does not load a GGUF file as it is") and "--runtime torch or llama.cpp" in reason


def _llama_cpp_available() -> bool:
    try:
        get_engine("llama.cpp").check_available(EngineOptions())
    except InputError:
        return False
    return True


@pytest.mark.llama_cpp
@pytest.mark.skipif(not _llama_cpp_available(),
                    reason="llama-cpp-python is not importable (pip install 'qkit[llama-cpp]', or QKIT_ENGINE_PYTHON)")
def test_a_file_row_in_llama_cpp_equals_the_scheme_row_there(wide_model, files, corpus):
    q4 = files["q4_k_m"]
    opts = EvalOptions(schemes=("q4_k_m", f"file:{q4}"), runtimes=("torch", "llama.cpp"), corpus=str(corpus),
                       tokens=128, agree_tokens=3, battery_tokens=8)
    report = evaluate(wide_model, options=opts)
    rows = {r.scheme: r for r in report.rows}
    label = f"{q4.parent.name}/q4_k_m"
    assert list(rows) == ["reference", "q4_k_m", label, "reference [llama.cpp]", "q4_k_m [llama.cpp]",
                          f"{label} [llama.cpp]"]
    ours, theirs = rows[f"{label} [llama.cpp]"], rows["q4_k_m [llama.cpp]"]
    assert ours.refused is None and ours.runtime == "llama.cpp" and ours.engine["full_distribution"] is True
    for field in SAME:  # the same tensor bytes, loaded by llama.cpp from the user's file and from the eval's own
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.size_bytes == ours.engine["file_bytes"] == q4.stat().st_size == theirs.size_bytes
    assert 0 < ours.kld and math.isfinite(ours.perplexity)
    assert ours.kld != rows[label].kld  # llama.cpp's arithmetic, not torch's: a different measurement
    assert ours.versus_torch["against"] == label and math.isfinite(ours.versus_torch["kld_change"])
