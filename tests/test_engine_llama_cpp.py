"""``--runtime llama.cpp`` against llama.cpp's own ``llama-perplexity``, and the reference against torch's.

Slow; skipped with a reason when llama-cpp-python (``pip install 'qkit[llama-cpp]'``, docs/runtimes.md) or,
for the first test, the llama.cpp tools (``python benchmarks/build_llama_ref.py --tools``) are absent.

1. **Equal to llama-perplexity.** qkit's q8_0 GGUF of the default model; ``llama-perplexity -c 128 -b 128
   --chunks 2 -fa off --kl-divergence-base`` writes the log-probabilities of every position it scores
   (the second half of each 128-token chunk) with the token ids it scored. The llama.cpp runtime scores
   exactly those chunks (BOS substituted as llama-perplexity does) in its worker, with the same settings
   (flash attention off, batch = chunk). Every log-probability llama-perplexity stored must equal the
   runtime's to within its file's own rounding: it stores ``q = round((logit - min_logit) / scale)`` in 16
   bits, so a value reads back to within ``scale / 2`` (plus float32 rounding); a value it clipped (16
   nats below the top) must be at or below its floor. Its printed PPL must equal the runtime's on the
   same positions to its 4 printed decimals.
2. **Reference parity, and the runner end to end.** ``qkit eval --runtime torch,llama.cpp --schemes
   q8_0 --tokens 256``: the F32 GGUF through llama.cpp against torch's fp32 reference on the same 255
   positions, paired: within 0.2 % in perplexity and 1e-3 nats of KL (measured on this model at 1,534
   tokens: +0.006 % per token, SD 0.0011, docs/export-and-verify.md); the q8_0 row measured in llama.cpp
   with its KL, top-1, battery, agreement and the engine-minus-torch columns.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess

import numpy as np
import pytest
import torch
from conftest import benchmark_module

from qkit.api import quantize_model
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.engines import EngineJob, EngineOptions
from qkit.evaluation.engines.llama_cpp import ENGINE
from qkit.texts import load_corpus

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                       reason="llama-cpp-python is not installed: pip install 'qkit[llama-cpp]' (docs/runtimes.md)"),
]

CTX, CHUNKS = 128, 2


@pytest.mark.llama_cpp
def test_q8_0_scored_by_the_runtime_equals_llama_perplexity(default_model_dir, tmp_path):
    blr = benchmark_module("build_llama_ref")
    if not blr.tool_path("llama-perplexity").exists():
        pytest.skip("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
    bench = benchmark_module("bench_llama_cpp")
    gguf = tmp_path / "q8_0.gguf"
    quantize_model(default_model_dir, output=gguf, scheme="q8_0", format="gguf")
    text = tmp_path / "ruth.txt"
    text.write_text(load_corpus(None).text)
    base = tmp_path / "base.kld"
    cmd = [blr.tool_path("llama-perplexity"), "-m", gguf, "-f", text, "-c", CTX, "-b", CTX, "--chunks", CHUNKS,
           "-t", torch.get_num_threads(), "-fa", "off", "--kl-divergence-base", base]
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = float(bench.PPL_RE.search(done.stdout + done.stderr).group(1))
    kld = bench.KldBase(base)
    assert (kld.n_ctx, kld.n_chunk) == (CTX, CHUNKS)

    bos = bench.bos_of(gguf)
    chunks = []
    for c in range(CHUNKS):
        x = torch.from_numpy(kld.tokens[c * CTX:(c + 1) * CTX].astype(np.int64)).clone()
        if bos is not None:
            x[0] = bos  # llama-perplexity scores the chunk with its first token replaced by BOS
        chunks.append(x)
    job = EngineJob(windows=chunks, battery_prompts=[chunks[0][:8].tolist()], battery_tokens=2, repetition_penalty=1.0,
                    agreement_inputs=[chunks[0][:10].tolist()], agreement_n=2)
    scores = ENGINE.run(gguf, job, EngineOptions())

    first = CTX // 2  # llama-perplexity scores the logits at positions first .. CTX-2
    ours = torch.cat([lp[first:CTX - 1] for lp in scores.full]).numpy()
    theirs = kld.log_probs()
    assert ours.shape == theirs.shape == (CHUNKS * (CTX - 1 - first), kld.n_vocab)
    kept = kld.codes > 0
    slack = kld.scale[:, None] / 2 + 4e-6 * np.abs(ours)  # the 16-bit code's rounding, and float32's
    err = np.abs(ours - theirs)
    assert (err[kept] <= np.broadcast_to(slack, err.shape)[kept]).all(), float(err[kept].max())
    floor = (kld.min_log_prob[:, None] + kld.scale[:, None] / 2 + 1e-5)
    assert (ours[~kept] <= np.broadcast_to(floor, ours.shape)[~kept]).all()
    nll = -ours[np.arange(ours.shape[0]), kld.targets]
    assert math.exp(nll.astype(np.float64).mean()) == pytest.approx(printed, abs=5e-5 + 1e-4 * printed / 100)
    # the same numbers through the runtime's own outputs: the target log-probabilities and argmax
    target = torch.cat([t[first:CTX - 1] for t in scores.target_logprobs]).numpy()
    assert np.allclose(-target, nll, atol=1e-6)
    assert np.array_equal(torch.cat([a[first:CTX - 1] for a in scores.argmax]).numpy(), ours.argmax(1))
    assert len(scores.battery_ids[0]) >= 1 and scores.agreement_argmax[0].shape == (2,)
    assert scores.load_seconds > 0 and scores.version.startswith("llama-cpp-python 0.3.36")


def test_reference_parity_and_a_q8_0_row_through_the_runner(default_model_dir):
    opts = EvalOptions(schemes=("q8_0", "nf4"), runtimes=("torch", "llama.cpp"), tokens=256, battery_tokens=16)
    report = evaluate(default_model_dir, options=opts)
    rows = {r.scheme: r for r in report.rows}
    assert list(rows) == ["reference", "q8_0", "nf4", "reference [llama.cpp]", "q8_0 [llama.cpp]", "nf4 [llama.cpp]"]
    ref, eref, q8, eq8 = rows["reference"], rows["reference [llama.cpp]"], rows["q8_0"], rows["q8_0 [llama.cpp]"]
    # reference parity: the F32 GGUF in llama.cpp against torch fp32, paired on the same 255 positions
    assert abs(eref.versus_torch["perplexity_change_pct"]) < 0.2, eref.versus_torch
    assert 0 <= eref.kld < 1e-3 and eref.top1_match > 0.97
    assert eref.bits_per_weight == ref.bits_per_weight == 32.0 and eref.engine["file_bytes"] > 500e6
    # the q8_0 row: measured by llama.cpp from qkit's GGUF, KL and top-1 from its full distribution
    assert eq8.engine["format"] == "gguf" and eq8.engine["full_distribution"] is True
    assert eq8.size_bytes == eq8.engine["file_bytes"] and 8 < eq8.bits_per_weight < 9
    assert 0 < eq8.kld < 0.05 and eq8.top1_match > 0.9
    assert math.isfinite(eq8.versus_torch["kld_change"]) and math.isfinite(eq8.versus_torch["perplexity_change_se_pct"])
    assert abs(eq8.perplexity / q8.perplexity - 1) < 0.03
    assert eq8.battery_total == 16 and eq8.agreement_total == ref.agreement_total
    assert eref.agreement >= 0.9 * eref.agreement_total
    assert rows["nf4 [llama.cpp]"].refused.startswith("nf4 has no GGUF type")
    assert report.provenance["engines"]["llama.cpp"]["version"].startswith("llama-cpp-python 0.3.36")
    assert any(n.startswith("q8_0 [llama.cpp] minus q8_0 (torch)") for n in report.notes)
