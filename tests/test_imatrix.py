"""The importance matrix: its files (against the gguf package, llama.cpp's own Python reader), its collection
(against an independent computation of the same sums), its chunks, and every refusal.

With llama.cpp's tools built (``python benchmarks/build_llama_ref.py --tools``), the slow tests also compare
qkit's collection with ``llama-imatrix`` on the same tokens and qkit's imatrix GGUF with ``llama-quantize
--imatrix`` on the same file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import benchmark_module, f32_gguf
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.methods.imatrix import (
    Imatrix,
    ImatrixEntry,
    ImatrixOptions,
    collect,
    imatrix_ids,
    quant_weights_for,
    read,
    write_gguf,
)
from qkit.methods.imatrix.file import is_qkit_imatrix
from qkit.schemes import get_scheme

runner = CliRunner()


def _matrix(rng, names_widths, counts=100.0):
    return Imatrix({n: ImatrixEntry((rng.random((1, w)) * 10).astype(np.float32), np.array([counts], np.float32))
                    for n, w in names_widths}, chunk_count=3, chunk_size=64, datasets=["cal.txt"])


# --------------------------------------------------------------------------- files


def test_gguf_file_reads_back_in_the_gguf_package_and_in_qkit(tmp_path):
    rng = np.random.default_rng(0)
    m = _matrix(rng, [("blk.0.attn_q.weight", 64), ("blk.0.ffn_down.weight", 160)])
    m.record = {"qkit_version": "x"}
    write_gguf(m, tmp_path / "im.gguf")
    r = gguf.GGUFReader(str(tmp_path / "im.gguf"))
    f = r.fields
    assert bytes(f["general.type"].parts[f["general.type"].data[0]]).decode() == "imatrix"
    assert int(f["imatrix.chunk_count"].parts[f["imatrix.chunk_count"].data[0]][0]) == 3
    assert int(f["imatrix.chunk_size"].parts[f["imatrix.chunk_size"].data[0]][0]) == 64
    tensors = {t.name: t for t in r.tensors}
    # llama.cpp's order: entries sorted by name, each as in_sum2 then counts
    assert list(tensors) == [n + sfx for n in sorted(m.entries) for sfx in (".in_sum2", ".counts")]
    t = tensors["blk.0.ffn_down.weight.in_sum2"]
    # ggml ne [ne0, n_mat] with n_mat 1, stored 1-D as llama-imatrix's gguf_add_tensor stores it (ggml_n_dims)
    assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [160]
    assert list(tensors["blk.0.ffn_down.weight.counts"].shape) == [1]
    assert np.array_equal(np.asarray(t.data).reshape(-1), m.entries["blk.0.ffn_down.weight"].sums.reshape(-1))
    assert np.asarray(tensors["blk.0.attn_q.weight.counts"].data).reshape(-1).tolist() == [100.0]
    back = read(tmp_path / "im.gguf")
    assert set(back.entries) == set(m.entries) and back.record == {"qkit_version": "x"} and not back.legacy
    for n, e in m.entries.items():
        assert np.array_equal(back.entries[n].sums, e.sums)
        # llama-quantize's normalisation: in_sum2 / (float) count, in fp32
        assert np.array_equal(back.quant_weights(n), (e.sums / np.float32(100)).reshape(-1))
    assert is_qkit_imatrix(tmp_path / "im.gguf")


def test_a_row_without_tokens_weighs_one_as_llama_quantize_does():
    e = ImatrixEntry(np.array([[2.0, 4.0]], np.float32), np.array([0.0], np.float32))
    assert e.quant_weights(legacy=False).tolist() == [1.0, 1.0]


def _legacy_bytes(entries: dict[str, tuple[int, np.ndarray]], chunk_count: int | None, dataset: str | None) -> bytes:
    """The legacy .dat as ``save_imatrix_legacy`` writes it (written here from the C, independently of qkit's reader)."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    if chunk_count is not None:
        out += struct.pack("<i", chunk_count)
        if dataset is not None:
            out += struct.pack("<i", len(dataset)) + dataset.encode()
    return out


def test_legacy_dat_reads_as_llama_quantize_normalises_it(tmp_path):
    v = np.array([3.0, 6.0, 9.0, 0.5], np.float32)
    (tmp_path / "im.dat").write_bytes(_legacy_bytes({"blk.0.attn_q.weight": (3, v), "blk.1.attn_q.weight": (0, v)}, 7, "cal.txt"))
    m = read(tmp_path / "im.dat")
    assert m.legacy and m.chunk_count == 7 and m.datasets == ["cal.txt"]
    assert m.quant_weights("blk.0.attn_q.weight").tolist() == (v / np.float32(3)).tolist()
    assert m.quant_weights("blk.1.attn_q.weight").tolist() == v.tolist()  # ncall 0: the values themselves
    assert not is_qkit_imatrix(tmp_path / "im.dat")
    (tmp_path / "short.dat").write_bytes(_legacy_bytes({"blk.0.attn_q.weight": (3, v)}, None, None))
    assert read(tmp_path / "short.dat").chunk_count == 0


@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00\x00ab", b"GGUF\x03\x00\x00\x00garbage", struct.pack("<i", -1)])
def test_malformed_files_are_one_line(tmp_path, content):
    (tmp_path / "bad").write_bytes(content)
    with pytest.raises(InputError, match="--imatrix"):
        read(tmp_path / "bad")


# --------------------------------------------------------------------------- chunks and collection


def _tiny(tiny_model_dir):
    from qkit.models import load, read_config

    loaded = load(tiny_model_dir, device="cpu")
    return loaded, read_config(tiny_model_dir)


def test_chunks_are_consecutive_from_the_start_with_bos_first(tiny_model_dir):
    """One text (here KJV Genesis+Exodus, the calibration text before the default mix): llama-imatrix's
    chunks, consecutive from its start. The default mix is sampled instead (tests/test_corpora.py)."""
    loaded, _ = _tiny(tiny_model_dir)
    tok = loaded.tokenizer
    ids, prov = imatrix_ids(tok, ImatrixOptions(source="kjv:Genesis,Exodus", chunks=3, chunk_size=32))
    from qkit.texts import load_calibration_text

    plain = tok(load_calibration_text(None).text, add_special_tokens=False)["input_ids"]
    bos = prov["bos"]
    stream = ([bos] + plain) if bos is not None else plain
    want = torch.tensor(stream[: 3 * 32]).view(3, 32)
    if bos is not None:
        want[:, 0] = bos
    assert torch.equal(ids, want)
    assert prov["chunks"] == 3 and prov["chunk_size"] == 32 and prov["disjoint_from"]["name"] == "qkit-heldout-v1"


def test_collection_equals_an_independent_sum_of_squares(tiny_model_dir):
    loaded, config = _tiny(tiny_model_dir)
    model = loaded.model
    ids, prov = imatrix_ids(loaded.tokenizer, ImatrixOptions(chunks=3, chunk_size=32))
    m = collect(model, config, ids, ImatrixOptions(chunks=3, chunk_size=32, batch=2), provenance=prov)
    assert len(m.entries) == 7 * config["num_hidden_layers"]  # every blk linear; the tied head is never collected
    assert m.chunk_count == 3 and m.chunk_size == 32
    # Independently: the inputs of every linear, captured with forward hooks on one whole-batch forward.
    captured: dict[str, list[torch.Tensor]] = {}
    hooks = [mod.register_forward_hook(lambda mod, a, out, n=n: captured.setdefault(n, []).append(a[0].detach().clone()))
             for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and ".layers." in n]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for n, xs in captured.items():
        layer, rest = n.split(".layers.")[1].split(".", 1)
        e = m.entries[f"blk.{layer}.{names[rest]}.weight"]
        x = torch.cat(xs).reshape(-1, xs[0].shape[-1]).double()
        assert e.counts.tolist() == [3 * 32]
        np.testing.assert_allclose(e.sums.reshape(-1), (x * x).sum(0).numpy(), rtol=2e-6)


def test_chunk_refusals(tiny_model_dir, tmp_path):
    loaded, _ = _tiny(tiny_model_dir)
    with pytest.raises(InputError, match="--chunks"):
        imatrix_ids(loaded.tokenizer, ImatrixOptions(chunks=10**6, chunk_size=64))
    (tmp_path / "short.txt").write_text("In the beginning God created the heaven and the earth. " * 2)
    with pytest.raises(InputError, match="fewer than two chunks"):
        imatrix_ids(loaded.tokenizer, ImatrixOptions(source=str(tmp_path / "short.txt"), chunks=1, chunk_size=512))
    from qkit.texts import load_corpus

    (tmp_path / "ruth.txt").write_text(load_corpus(None).text * 3)  # the eval text itself
    with pytest.raises(InputError, match="(?i)overlap|shares|eval"):
        imatrix_ids(loaded.tokenizer, ImatrixOptions(source=str(tmp_path / "ruth.txt"), chunks=1, chunk_size=32))
    for bad in ({"chunks": 0}, {"chunk_size": 8}, {"batch": 0}):
        with pytest.raises(InputError):
            ImatrixOptions(**bad).check()


# --------------------------------------------------------------------------- matching a model


def _shapes(config):
    h, i, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for n in range(L):
        p = f"model.layers.{n}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    return out


CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 160,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 304, "tie_word_embeddings": True}


def _full(rng):
    names = {"attn_q": 64, "attn_k": 64, "attn_v": 64, "attn_output": 64, "ffn_gate": 64, "ffn_up": 64, "ffn_down": 160}
    return _matrix(rng, [(f"blk.{i}.{n}.weight", w) for i in range(2) for n, w in names.items()])


def test_quant_weights_by_hugging_face_name():
    shapes = _shapes(CONFIG)
    targets = {n: get_scheme("q5_0") for n in shapes if ".layers." in n}
    m = _full(np.random.default_rng(1))
    qw = quant_weights_for(m, CONFIG, shapes, targets)
    assert set(qw) == set(targets)
    assert torch.equal(qw["model.layers.1.mlp.down_proj.weight"], torch.from_numpy(m.quant_weights("blk.1.ffn_down.weight")))
    # q8_0 reads no importance matrix (quantize_q8_0 ignores it): no weights asked for, none refused
    assert quant_weights_for(Imatrix({}), CONFIG, shapes, dict.fromkeys(targets, get_scheme("q8_0"))) == {}


def test_matrix_refusals():
    shapes = _shapes(CONFIG)
    targets = {n: get_scheme("q4_k") for n in shapes if ".layers." in n}
    rng = np.random.default_rng(2)
    m = _full(rng)
    m.entries["blk.7.attn_q.weight"] = m.entries["blk.0.attn_q.weight"]
    with pytest.raises(InputError, match="another model"):
        quant_weights_for(m, CONFIG, shapes, targets)
    m = _full(rng)
    m.entries["blk.0.ffn_down.weight"] = ImatrixEntry(np.ones((1, 64), np.float32), np.array([1.0], np.float32))
    with pytest.raises(InputError, match="160"):
        quant_weights_for(m, CONFIG, shapes, targets)
    m = _full(rng)
    del m.entries["blk.1.attn_v.weight"]
    with pytest.raises(InputError, match="no entry for 1 tensor.*blk.1.attn_v.weight.*llama-quantize"):
        quant_weights_for(m, CONFIG, shapes, targets)
    with pytest.raises(InputError, match="mixture-of-experts"):
        quant_weights_for(_full(rng), {**CONFIG, "num_local_experts": 8}, shapes, targets)
    with pytest.raises(InputError, match="model_type 'gpt2'"):
        quant_weights_for(_full(rng), {**CONFIG, "model_type": "gpt2"}, shapes, targets)


# --------------------------------------------------------------------------- the commands


def test_imatrix_command_writes_and_quantize_reads_it(tiny_model_dir, tmp_path):
    out = tmp_path / "im.gguf"
    r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(out), "--chunks", "2", "--chunk-size", "32",
                            "--json", str(tmp_path / "im.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "im.json").read_text())
    assert doc["entries"] == 14 and doc["tokens"] == 64
    assert read(out).record["calibration"]["chunks"] == 2
    r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(out), "--chunks", "2", "--chunk-size", "32"])
    assert r.exit_code != 0 and "--force" in r.output
    r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(out), "--chunks", "2", "--chunk-size", "32", "--force"])
    assert r.exit_code == 0, r.output
    (tmp_path / "other.gguf").write_bytes(b"not ours")
    r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(tmp_path / "other.gguf"), "--force"])
    assert r.exit_code != 0 and "not something qkit wrote" in r.output
    r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(tiny_model_dir / "im.gguf")])
    assert r.exit_code != 0 and "never writes over what it reads" in r.output
    r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(tmp_path / "x.gguf"), "--chunk-size", "512"])
    assert r.exit_code != 0 and "maximum context 256" in r.output
    q = tmp_path / "q.gguf"
    r = runner.invoke(app, ["quantize", str(tiny_model_dir), "-s", "q4_0", "--format", "gguf", "-o", str(q),
                            "--imatrix", str(out), "--emit-tensor-types", str(tmp_path / "tt.txt")])
    assert r.exit_code == 0, r.output
    assert "14 tensors weighted" in r.output.replace("\n", " ") or "14 tensors" in r.output
    words = (tmp_path / "tt.txt").read_text().split()
    assert len(words) == 14 and all(w.endswith("=Q4_0") and w.startswith("^blk\\.") for w in words)


def test_quantize_refusals_of_imatrix_and_tensor_types(tiny_model_dir, tmp_path):
    im = tmp_path / "im.gguf"
    assert runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(im), "--chunks", "2", "--chunk-size", "32"]).exit_code == 0
    cases = [
        (["--method", "awq", "-s", "q4_k"], "--method rtn or gptq"),  # gptq takes the matrix for llama.cpp's types
        (["--method", "gptq", "-s", "int4-g32"], "int4-g32 is not one"),
        (["--tensor-type", "attn_v"], "PATTERN=TYPE"),
        (["--tensor-type", "attn_v=q9_k"], "not a ggml block type"),
        (["--tensor-type", "attn_v=f16"], "--keep none"),
        (["--tensor-type", "(=q8_0"], "not a regular expression"),
        (["--tensor-type", "no_such_tensor=q8_0"], "matches no tensor"),
        (["--imatrix", str(tmp_path / "missing.gguf")], "cannot read"),
        (["--imatrix", str(tiny_model_dir.parent)], "is a directory"),  # refused unopened (qkit.reading)
        (["--imatrix", str(im), "-s", "nf4", "--format", "qkit"], "is not one"),
    ]
    for extra, message in cases:
        out = tmp_path / "o.gguf"
        args = ["quantize", str(tiny_model_dir), "--format", "gguf", "-o", str(out)]
        if "--imatrix" not in extra and "--method" in extra:
            args += ["--imatrix", str(im)]
        r = runner.invoke(app, [*args, *(extra if "-s" in extra else ["-s", "q4_k", *extra])])
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
        assert not out.exists()


def test_tensor_type_overrides_are_llama_quantizes(tiny_model_dir, tmp_path):
    out = tmp_path / "o"
    r = runner.invoke(app, ["quantize", str(tiny_model_dir), "-s", "q4_0", "-o", str(out), "--tensor-type", r"blk\.1\.attn_v=Q8_0",
                            "--tensor-type", "FFN_DOWN=q5_1", "--tensor-type", "ffn=q4_1", "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    types = json.loads((tmp_path / "r.json").read_text())["types"]
    assert types["model.layers.1.self_attn.v_proj.weight"] == "q8_0"
    assert types["model.layers.0.self_attn.v_proj.weight"] == "q4_0"
    assert types["model.layers.0.mlp.down_proj.weight"] == "q5_1"  # the pattern is lowercased, as llama-quantize does
    assert types["model.layers.0.mlp.gate_proj.weight"] == "q4_1"  # first match wins: down_proj matched FFN_DOWN first
    assert sum(t == "q4_0" for t in types.values()) == 14 - 1 - 2 - 4


# --------------------------------------------------------------------------- against llama.cpp's tools


def _blr():
    return benchmark_module("build_llama_ref")


@pytest.mark.slow
@pytest.mark.llama_cpp
@pytest.mark.parametrize("scheme", ["q4_k_m", "q5_1"])
def test_llama_quantize_reads_qkits_imatrix_and_writes_the_same_bytes(default_model_dir, tmp_path, scheme):
    """qkit's imatrix GGUF through ``llama-quantize --imatrix`` on llama.cpp's conversion of the default model:
    every one of the 210 projections has the same type and the same bytes as qkit's file."""
    blr = _blr()
    if not blr.tool_path("llama-quantize").exists():
        pytest.skip("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
    im, q, tt = tmp_path / "im.gguf", tmp_path / "q.gguf", tmp_path / "tt.txt"
    r = runner.invoke(app, ["imatrix", "-o", str(im), "--chunks", "2", "--chunk-size", "128"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["quantize", "-s", scheme, "--format", "gguf", "-o", str(q), "--imatrix", str(im),
                            "--emit-tensor-types", str(tt)])
    assert r.exit_code == 0, r.output
    b = benchmark_module("bench_llama_cpp")
    f32 = tmp_path / "f32.gguf"
    b.convert_f32(default_model_dir, f32, tmp_path)
    lq = tmp_path / "lq.gguf"
    # a recipe's file is whole (token_embd at llama.cpp's type, as llama-quantize writes it); qkit's uniform
    # types quantize the projections only, so llama-quantize keeps the embedding f32 for them too
    whole = scheme in ("q4_k_m",)
    p = subprocess.run([blr.tool_path("llama-quantize"), "--imatrix", im, "--tensor-type-file", tt,
                        *(() if whole else ("--token-embedding-type", "f32")), f32, lq, scheme.upper(), "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "loaded 210 importance matrix entries" in p.stdout + p.stderr
    cmp = b.compare_files(q, lq)
    assert cmp["block_tensors"] == 210 and cmp["blocks_differing"] == 0 and not cmp["type_mismatch"], cmp
    if scheme == "q4_k_m" and blr.tool_path("llama-perplexity").exists():
        # llama-perplexity scores both files alike: the same tensors give the same number
        from qkit.texts import load_corpus

        ruth = tmp_path / "ruth.txt"
        ruth.write_text(load_corpus(None).text)
        ours, theirs = (b.llama_perplexity(f, ruth, 256, 2) for f in (q, lq))
        assert "ppl" in ours and ours["ppl"] == theirs["ppl"] and ours["se"] == theirs["se"], (ours, theirs)


def test_imatrix_refusals_come_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """A calibration text that overlaps the eval text, one too short for two chunks, and a MoE or unnamed
    architecture are refused before any weight is read."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from adversarial import tripwire

    from qkit.texts import load_corpus

    tripwire(monkeypatch, "qkit.api._load", "the model was loaded")
    (tmp_path / "ruth.txt").write_text(load_corpus(None).text * 2)
    (tmp_path / "short.txt").write_text("In the beginning God created the heaven and the earth. " * 3)
    for extra, message in ((["--calibration", str(tmp_path / "ruth.txt"), "--chunk-size", "64"], "Ruth|overlap|shares|eval"),
                           (["--calibration", str(tmp_path / "short.txt"), "--chunk-size", "128"], "fewer than two chunks")):
        r = runner.invoke(app, ["imatrix", str(tiny_model_dir), "-o", str(tmp_path / "im.gguf"), *extra])
        assert r.exit_code != 0 and __import__("re").search(message, r.output), r.output
        assert not (tmp_path / "im.gguf").exists()
    moe = tmp_path / "moe"
    shutil.copytree(tiny_model_dir, moe)
    cfg = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**cfg, "num_local_experts": 4}))
    r = runner.invoke(app, ["imatrix", str(moe), "-o", str(tmp_path / "im.gguf")])
    assert r.exit_code != 0 and "mixture-of-experts" in r.output, r.output


def _random_qwen2(directory: Path, tokenizer_dir: Path) -> Path:
    """A small random qwen2 (256 wide, so the k-quants keep their own super-blocks; biases on q/k/v) with the
    default model's tokenizer, which llama.cpp's converter recognises."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(torch.exp(torch.randn_like(p) * 0.5))  # heavier tails than the init
    model.save_pretrained(str(directory), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    cfg_doc = json.loads((directory / "config.json").read_text())
    cfg_doc["architectures"] = ["Qwen2ForCausalLM"]
    (directory / "config.json").write_text(json.dumps(cfg_doc))
    return directory


def _f32_gguf(src: Path, tmp_path: Path) -> Path:
    """An F32 GGUF of ``src`` for llama-quantize, with qkit's GGUF metadata (llama.cpp's converter does not
    recognise this tokenizer under qwen2)."""
    meta = tmp_path / "meta.gguf"
    assert runner.invoke(app, ["quantize", str(src), "-s", "q8_0", "--format", "gguf", "-o", str(meta)]).exit_code == 0
    return f32_gguf(meta, src, tmp_path / "f32.gguf", 2)


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_a_random_qwen2_gives_llama_quantizes_bytes_with_and_without_imatrix(default_model_dir, tmp_path):
    """qwen2 through the whole ladder: llama-quantize (its own recipe choice, no tensor-type file) and qkit write
    the same types and bytes in every block projection, q2_k, iq4_xs and q5_k_s with the same importance matrix,
    the others without (both for every type with QKIT_REQUANTIZE_ALL_FILES=1)."""
    blr = _blr()
    if not blr.tool_path("llama-quantize").exists():
        pytest.skip("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
    src = _random_qwen2(tmp_path / "qwen2", default_model_dir)
    b = benchmark_module("bench_llama_cpp")
    f32 = _f32_gguf(src, tmp_path)
    im = tmp_path / "im.gguf"
    assert runner.invoke(app, ["imatrix", str(src), "-o", str(im), "--chunks", "2", "--chunk-size", "256"]).exit_code == 0
    ladder = [("q2_k-llama", "Q2_K"), ("q3_k_m", "Q3_K_M"), ("iq4_xs-llama", "IQ4_XS"), ("q4_k_m", "Q4_K_M"),
              ("q5_k_s", "Q5_K_S"), ("q6_k", "Q6_K")]
    # each type once, with and without the matrix in turn (CI time); QKIT_REQUANTIZE_ALL_FILES=1 runs both for each
    both = os.environ.get("QKIT_REQUANTIZE_ALL_FILES") == "1"
    for i, (scheme, ftype) in enumerate(ladder):
        for weighted in (False, True) if both else (i % 2 == 0,):
            q, lq = tmp_path / f"q-{scheme}-{weighted}.gguf", tmp_path / f"l-{scheme}-{weighted}.gguf"
            extra = ["--imatrix", str(im)] if weighted else []
            # the 49152 x 256 embedding kept f32 on both sides: only the block projections are compared, and
            # quantizing it twelve times was most of this test's time
            keep = [] if scheme == "q6_k" else ["--token-embedding-type", "f32"]  # a type, not a recipe: projections only
            r = runner.invoke(app, ["quantize", str(src), "-s", scheme, "--format", "gguf", "-o", str(q), *extra, *keep])
            assert r.exit_code == 0, r.output
            p = subprocess.run([blr.tool_path("llama-quantize"), *extra, "--token-embedding-type", "f32", f32, lq, ftype, "2"],
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stderr[-2000:]
            cmp = b.compare_files(q, lq)
            assert cmp["block_tensors"] == 14 and cmp["identical"], (scheme, weighted, cmp)
