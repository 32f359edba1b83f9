"""qkit's llama.cpp formats and GGUF export against llama.cpp's own binaries, on the default model.

    python benchmarks/build_llama_ref.py --tools      # once: builds llama-quantize, -perplexity, -tokenize
    python benchmarks/bench_llama_cpp.py [--json PATH] [--repeats 3] [--ctx 2048]

Everything in one run (the llama.cpp vendored by the llama-cpp-python sdist that build_llama_ref.py pins):

1. **F32 GGUF**: llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` on the cached fp32 directory of the
   default model, run with this venv's python. The model has no ``tokenizer.model``, yet the converter
   imports ``sentencepiece`` before looking for that file; without the package, a stand-in module (one
   empty class, on ``PYTHONPATH`` for the converter only) lets it go on to its ``tokenizer.json`` path,
   as it would with the package installed.
2. **Quantize time**: ``llama-quantize F32.gguf OUT TYPE NTHREADS`` for Q8_0, pure Q4_K (``--pure``:
   llama-quantize's ``Q4_K`` is an alias of the ``Q4_K_M`` mixture) and Q4_K_M, with 1 and 2 threads;
   against ``qkit.api.quantize_model(scheme=..., format="gguf")`` in this process with torch at 1 and 2
   threads. Both read their input and write a GGUF: model load is included in both (the input is in the
   page cache after the first run). Median of ``--repeats`` runs.
3. **Bytes**: the 210 block projections (``blk.N.{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down}``)
   of each pair of files compared with ``gguf.GGUFReader``: type and raw block bytes. llama.cpp also
   quantizes ``token_embd`` (the tied output); qkit keeps embeddings in the source's F32 by default.
4. **Perplexity**: ``llama-perplexity -m FILE -f ruth.txt -c CTX -t 2`` (batch defaults) on the F32 GGUF,
   qkit's q8_0 and q4_k_m GGUFs and llama-quantize's, with ``ruth.txt`` the default corpus. What it scores
   (tools/perplexity/perplexity.cpp, ``perplexity()``): the text (one trailing newline stripped) tokenized
   once with ``add_special`` (BOS first when the vocab's ``add_bos`` is set) and no special-token parsing;
   ``n_chunk = n_tokens // CTX`` non-overlapping chunks (the rest unused); in each chunk the first token
   is replaced by BOS (when ``add_bos``), the chunk is decoded from an empty KV cache at positions
   0..CTX-1, and only the second half is scored: logits at positions ``CTX/2 .. CTX-2`` against the tokens
   at ``CTX/2+1 .. CTX-1`` (``CTX/2 - 1`` per chunk). PPL = exp(mean NLL); its ``+/-`` is
   ``PPL * sd(NLL) / sqrt(count - 1)``. It refuses a text with fewer than ``2*CTX`` tokens: the corpus
   then runs at the largest multiple of 256 that fits, said in the output. The token ids come from
   ``llama-tokenize`` on the same file (same vocabulary, same rules), checked against the chunk count
   llama-perplexity prints; qkit (transformers, fp32, torch) then scores exactly those ids and positions
   with the same weights: the source fp32 model for F32, the dequantized qkit tensors
   (``quantize_model(collect=True)``) swapped into it for q8_0 / q4_k_m. The F32 difference is llama.cpp's
   own computation noise (its kernels vs torch fp32 on identical weights). For quantized weights ggml's CPU
   matmul also rounds the activations to its ``vec_dot_type`` (Q8_0, or Q8_K for k-quants) before each dot
   product; a second qkit column applies that rounding (forward pre-hooks on the quantized matrices) to
   show how much of the llama.cpp - qkit difference it accounts for.
5. **Per token**: the runs on the F32 file and qkit's files also write llama.cpp's log-probabilities of
   every scored position (``--kl-divergence-base``, read by ``read_llama_logprobs``); per token, llama.cpp's
   NLL minus qkit's, with and without the activation rounding: mean (= ln of the PPL ratio), paired SE,
   SD. And the noise of the computation itself: qkit's run again with every embedding weight one fp32
   ulp up, against itself. With quantized weights the 8-bit rounding of every matmul input turns fp32-size
   differences into whole quantization steps, so that noise is what llama.cpp's own result is known to.

Skips (one line, exit 0) when the tools are not built.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_llama_ref as blr  # noqa: E402

BLOCK = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
# name, llama-quantize options + type, qkit scheme
SCHEMES = [("q8_0", ["Q8_0"]), ("q4_k", ["--pure", "Q4_K_M"]), ("q4_k_m", ["Q4_K_M"])]
PPL_RE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS_RE = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")
TOO_SHORT_RE = re.compile(r"tokenizes to only (\d+) tokens")


def sh(cmd: list, env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    return time.perf_counter() - t0, p


def check(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode != 0:
        raise SystemExit(f"{what} failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")


# --------------------------------------------------------------------------- 1. F32 GGUF


def convert_f32(model_dir: Path, out: Path, work: Path) -> dict:
    src = blr.fetch()
    env = dict(os.environ)
    stub = None
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        stub = work / "sentencepiece-stub"
        stub.mkdir(exist_ok=True)
        (stub / "sentencepiece.py").write_text(
            '"""Stand-in: convert_hf_to_gguf imports this before finding no tokenizer.model."""\n\n\n'
            "class SentencePieceProcessor:  # never instantiated here\n    pass\n")
        env["PYTHONPATH"] = os.pathsep.join([str(stub), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, src / "convert_hf_to_gguf.py", "--outtype", "f32", "--outfile", out, model_dir]
    sec, p = sh(cmd, env)
    check(p, "convert_hf_to_gguf.py")
    return {"command": " ".join(map(str, cmd)), "seconds": round(sec, 2), "sentencepiece_stub": stub is not None,
            "bytes": out.stat().st_size}


# --------------------------------------------------------------------------- 2. timing


def time_llama_quantize(f32: Path, work: Path, repeats: int, threads: list[int]) -> dict:
    res = {}
    for name, opts in SCHEMES:
        out = work / f"llama-{name}.gguf"
        r = {"command": f"llama-quantize {' '.join(opts[:-1] + ['F32.gguf', 'OUT.gguf', opts[-1], 'NTHREADS'])}".replace("  ", " ")}
        digests = set()
        for t in threads:
            times = []
            for _ in range(repeats):
                out.unlink(missing_ok=True)
                sec, p = sh([blr.tool_path("llama-quantize"), *opts[:-1], f32, out, opts[-1], t])
                check(p, f"llama-quantize {name}")
                times.append(sec)
            digests.add(_file_digest(out))
            r[f"t{t}_s"] = round(statistics.median(times), 3)
            r[f"t{t}_all"] = [round(x, 3) for x in times]
        r["threads_give_same_file"] = len(digests) == 1
        r["file"] = str(out)
        r["bytes"] = out.stat().st_size
        res[name] = r
    return res


def _file_digest(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def time_qkit(work: Path, repeats: int, threads: list[int]) -> tuple[dict, dict]:
    import torch

    from qkit.api import QuantizeOptions, quantize_model

    res, collected = {}, {}
    n0 = torch.get_num_threads()
    for name, _ in SCHEMES:
        out = work / f"qkit-{name}.gguf"
        r = {"call": f"qkit.api.quantize_model(None, output=OUT.gguf, scheme={name!r}, format='gguf', "
                     "options=QuantizeOptions(force=True))"}
        for t in threads:
            torch.set_num_threads(t)
            times = []
            for _ in range(repeats):
                q = quantize_model(None, output=out, scheme=name, format="gguf", collect=True,
                                   options=QuantizeOptions(force=True))
                times.append(q.seconds)
            r[f"t{t}_s"] = round(statistics.median(times), 3)
            r[f"t{t}_all"] = [round(x, 3) for x in times]
        r["bits_per_weight"] = round(q.bits_per_weight, 4)
        r["schemes_used"] = dict(sorted(q.schemes_used.items()))
        r["file"] = str(out)
        r["bytes"] = out.stat().st_size
        res[name] = r
        collected[name] = q.quantized
    torch.set_num_threads(n0)
    return res, collected


# --------------------------------------------------------------------------- 3. bytes


def compare_files(a: Path, b: Path) -> dict:
    """Block projections of GGUF ``a`` (llama-quantize) vs ``b`` (qkit): types and raw bytes."""
    import gguf

    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    blocks = sorted(n for n in ta if BLOCK.match(n))
    types: dict[str, dict[str, int]] = {}  # role -> {"llama/qkit type": count}
    diff_tensors, diff_blocks, total_blocks, type_mismatch, missing = [], 0, 0, [], []
    for n in blocks:
        if n not in tb:
            missing.append(n)
            continue
        x, y = ta[n], tb[n]
        role = BLOCK.match(n).group(2)
        key = f"{x.tensor_type.name}/{y.tensor_type.name}"
        count = types.setdefault(role, {})
        count[key] = count.get(key, 0) + 1
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            type_mismatch.append(n)
            continue
        bsize = gguf.GGML_QUANT_SIZES[x.tensor_type][1]
        xa = np.asarray(x.data).view(np.uint8).reshape(-1, bsize)
        ya = np.asarray(y.data).view(np.uint8).reshape(-1, bsize)
        nd = int((xa != ya).any(axis=1).sum())
        total_blocks += xa.shape[0]
        if nd:
            diff_blocks += nd
            diff_tensors.append({"name": n, "blocks_differing": nd, "blocks": int(xa.shape[0])})
    others = {n: {"llama": ta[n].tensor_type.name, "qkit": tb[n].tensor_type.name if n in tb else None}
              for n in ta if not BLOCK.match(n) and (n not in tb or ta[n].tensor_type != tb[n].tensor_type)}
    return {"block_tensors": len(blocks), "missing_in_qkit": missing, "type_mismatch": type_mismatch,
            "types_llama_qkit": types, "blocks_compared": total_blocks, "blocks_differing": diff_blocks,
            "tensors_differing": diff_tensors, "identical": not (missing or type_mismatch or diff_tensors),
            "other_tensors_differing_type": others}


# --------------------------------------------------------------------------- 4. perplexity


def llama_tokens(gguf_file: Path, text_file: Path) -> list[int]:
    """llama.cpp's ids for the text as llama-perplexity tokenizes it (its -f strips one trailing newline)."""
    _, p = sh([blr.tool_path("llama-tokenize"), "-m", gguf_file, "-f", text_file, "--ids", "--no-escape",
               "--log-disable"])
    check(p, "llama-tokenize")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("[")][-1]
    return json.loads(line)


def llama_perplexity(gguf_file: Path, text_file: Path, ctx: int, threads: int, logprobs: Path | None = None) -> dict:
    """``llama-perplexity``; with ``logprobs``, also ``--kl-divergence-base logprobs``: it then writes the
    log-probabilities of every scored position (read by :func:`read_llama_logprobs`)."""
    cmd = [blr.tool_path("llama-perplexity"), "-m", gguf_file, "-f", text_file, "-c", ctx, "-t", threads]
    if logprobs is not None:
        cmd += ["--kl-divergence-base", logprobs]
    sec, p = sh(cmd)
    out = p.stdout + p.stderr
    m, c, short = PPL_RE.search(out), CHUNKS_RE.search(out), TOO_SHORT_RE.search(out)
    r = {"command": "llama-perplexity " + " ".join(map(str, cmd[1:])), "seconds": round(sec, 1), "rc": p.returncode}
    if m:
        r.update(ppl=float(m.group(1)), se=float(m.group(2)))
    if c:
        r.update(chunks=int(c.group(1)), n_ctx=int(c.group(2)), batch=int(c.group(3)), n_seq=int(c.group(4)))
    if short:
        r["error"] = f"the text tokenizes to only {short.group(1)} tokens; -c {ctx} needs {2 * ctx}"
    elif not m:
        r["error"] = out[-2000:]
    return r


def read_llama_logprobs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, NLL of each scored token) from a ``--kl-divergence-base`` file of llama-perplexity.

    Layout (tools/perplexity/perplexity.cpp, ``perplexity()`` with ``logits_file``, and ``log_softmax``):
    the 8 bytes ``_logits_``, int32 ``n_ctx``, int32 ``n_vocab``, int32 ``n_chunk``, int32 tokens
    ``[n_chunk * n_ctx]``, then per scored position (``n_ctx - 1 - n_ctx // 2`` per chunk) ``nv = 2 *
    ((n_vocab + 1) // 2) + 4`` uint16: two fp32 (``scale``, ``min_log_prob``) and per vocabulary entry
    ``q``, with ``log p = min_log_prob + scale * q`` (steps of ``scale`` <= 16 nats / 65535 = 2.4e-4; ``q =
    0`` means at or below ``min_log_prob``, 16 nats under the top logit)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise SystemExit(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3, offset=8))
    tokens = np.frombuffer(raw, dtype="<i4", count=n_chunk * n_ctx, offset=20)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    per_chunk = n_ctx - 1 - n_ctx // 2
    rows = np.frombuffer(raw, dtype="<u2", offset=20 + 4 * n_chunk * n_ctx).reshape(n_chunk * per_chunk, nv)
    head = rows[:, :4].copy().view("<f4")  # [scale, min_log_prob]
    targets = tokens.reshape(n_chunk, n_ctx)[:, n_ctx // 2 + 1:].reshape(-1)
    q = rows[np.arange(rows.shape[0]), 4 + targets].astype(np.float64)
    return tokens, -(head[:, 1].astype(np.float64) + head[:, 0].astype(np.float64) * q)


def per_token(llama_nll: np.ndarray, qkit_nll: np.ndarray) -> dict:
    """Per scored token, llama.cpp's NLL minus qkit's: mean (= ln of the PPL ratio) with its paired SE
    (SD / sqrt(n)), SD, and the largest |difference|."""
    d = llama_nll - qkit_nll
    return {"mean": float(d.mean()), "se": float(d.std(ddof=1) / np.sqrt(d.size)), "sd": float(d.std(ddof=1)),
            "max_abs": float(np.abs(d).max()), "n": int(d.size)}


def scored_positions(n_tokens: int, ctx: int) -> tuple[int, int]:
    """(chunks, scored tokens) as llama-perplexity counts them."""
    n_chunk = n_tokens // ctx
    return n_chunk, n_chunk * (ctx - ctx // 2 - 1)


def qkit_perplexity(model, ids: list[int], ctx: int, bos: int | None) -> dict:
    """llama-perplexity's computation with torch: same chunks, BOS substitution, positions and statistics."""
    import torch

    t = torch.tensor(ids, dtype=torch.long)
    first = ctx // 2
    nll = []
    with torch.inference_mode():
        for i in range(len(ids) // ctx):
            x = t[i * ctx:(i + 1) * ctx].clone()
            if bos is not None:
                x[0] = bos
            logits = model(input_ids=x[None], use_cache=False).logits[0, first:ctx - 1].double()
            lp = torch.log_softmax(logits, dim=-1)
            nll.append(-lp.gather(1, x[first + 1:ctx, None])[:, 0])
    v = torch.cat(nll)
    mean = v.mean().item()
    var = (v.pow(2).mean() - v.mean().pow(2)).item()
    ppl = float(np.exp(mean))
    return {"ppl": ppl, "se": ppl * float(np.sqrt(var / (v.numel() - 1))), "count": int(v.numel()), "nll": v.numpy()}


def swap(model, tensors: dict, originals: dict) -> None:
    import torch

    with torch.no_grad():
        for name, qt in tensors.items():
            p = model.get_parameter(name)
            originals.setdefault(name, p.detach().clone())
            p.copy_(qt.dequantize(p.dtype))


def restore(model, originals: dict) -> None:
    import torch

    with torch.no_grad():
        for name, w in originals.items():
            model.get_parameter(name).copy_(w)


def act_round(x, k_type: bool):
    """What ggml's CPU matmul does to the activations before a quantized weight's dot product: rounds
    them to its ``vec_dot_type``, Q8_K (256-blocks, fp32 scale -127/signed max) for k-quant weights,
    Q8_0 (32-blocks, fp16 scale absmax/127) for the 32-block types."""
    import torch

    shape = x.shape
    if k_type:
        b = x.reshape(-1, shape[-1] // 256, 256)
        idx = b.abs().argmax(dim=-1, keepdim=True)
        mx = b.gather(-1, idx)
        iscale = torch.where(mx == 0, torch.zeros_like(mx), -127.0 / mx)
        q = torch.clamp(torch.round(iscale * b), max=127)  # nearest_int: ties to even, like the SIMD code
        y = torch.where(iscale == 0, torch.zeros_like(b), q / iscale)
    else:
        b = x.reshape(-1, shape[-1] // 32, 32)
        d = b.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        y = torch.round(b * inv) * d.half().float()
    return y.reshape(shape)


def hook_activations(model, tensors: dict) -> list:
    """Forward pre-hooks that apply :func:`act_round` to the input of each quantized matrix."""
    handles = []
    for name, qt in tensors.items():
        k_type = qt.scheme.name.endswith("_k")
        mod = model.get_submodule(name.removesuffix(".weight"))
        handles.append(mod.register_forward_pre_hook(lambda m, a, k=k_type: (act_round(a[0], k), *a[1:])))
    return handles


def bos_of(gguf_file: Path) -> int | None:
    """The BOS id llama.cpp substitutes, or None when the vocab's add_bos is off."""
    import gguf

    r = gguf.GGUFReader(gguf_file)

    def field(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    add = field("tokenizer.ggml.add_bos_token")
    return field("tokenizer.ggml.bos_token_id") if add else None


# --------------------------------------------------------------------------- 5. KL divergence


KLD_CHUNKS_RE = re.compile(r"kl_divergence: computing over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")


def llama_kld_base(gguf_file: Path, text_file: Path, ctx: int, threads: int, out: Path, chunks: int | None = None) -> dict:
    """``llama-perplexity -m FILE -f TEXT -c CTX -t THREADS [--chunks N] --kl-divergence-base OUT``: writes the
    log-probabilities of every scored position to ``out`` (read by :func:`read_kld_base`); returns what
    :func:`llama_perplexity` returns for the run."""
    cmd = [blr.tool_path("llama-perplexity"), "-m", gguf_file, "-f", text_file, "-c", ctx, "-t", threads,
           "--kl-divergence-base", out] + (["--chunks", chunks] if chunks is not None else [])
    sec, p = sh(cmd)
    text = p.stdout + p.stderr
    m, c = PPL_RE.search(text), CHUNKS_RE.search(text)
    r = {"command": "llama-perplexity " + " ".join(map(str, cmd[1:])), "seconds": round(sec, 2), "rc": p.returncode}
    if m:
        r.update(ppl=float(m.group(1)), se=float(m.group(2)))
    if c:
        r.update(chunks=int(c.group(1)), n_ctx=int(c.group(2)), batch=int(c.group(3)), n_seq=int(c.group(4)))
    if p.returncode != 0 or not m:
        r["error"] = text[-2000:]
    return r


def llama_kl_divergence(gguf_file: Path, base_file: Path, threads: int, tool: Path | None = None,
                        dump: Path | None = None) -> dict:
    """``llama-perplexity -m FILE --kl-divergence-base BASE --kl-divergence -t THREADS`` (context and chunks
    come from the base file; ``-c`` is given as the file's ``n_ctx``). ``tool``: another build of the binary
    (:func:`build_kld_dump_tool`), which with ``dump`` also writes its per-token values there
    (:func:`read_kld_dump`). Returns ``stats`` (:func:`parse_kl_stats`), ``lines`` (the final blocks as
    printed), ``chunk_lines`` (the running per-chunk lines), the command, seconds and rc."""
    n_ctx = int(np.frombuffer(Path(base_file).read_bytes()[8:12], dtype="<i4")[0])
    cmd = [tool or blr.tool_path("llama-perplexity"), "-m", gguf_file, "-c", n_ctx, "-t", threads,
           "--kl-divergence-base", base_file, "--kl-divergence"]
    env = dict(os.environ)
    if dump is not None:
        env["QKIT_KLD_DUMP"] = str(dump)
    sec, p = sh(cmd, env)
    text = p.stdout + p.stderr
    r = {"command": f"{Path(cmd[0]).name} " + " ".join(map(str, cmd[1:])), "seconds": round(sec, 2),
         "rc": p.returncode, "stats": parse_kl_stats(text), "lines": kl_stats_lines(text),
         "chunk_lines": [ln for ln in text.splitlines() if re.match(r"^\s*\d+\s+\d+\.\d+ ± ", ln)]}
    c = KLD_CHUNKS_RE.search(text)
    if c:
        r.update(chunks=int(c.group(1)), n_ctx=int(c.group(2)), batch=int(c.group(3)), n_seq=int(c.group(4)))
    if p.returncode != 0 or not r["stats"]:
        r["error"] = text[-2000:]
    return r


_NUMBER = re.compile(r"[-+]?(?:nan|inf|\d+\.\d*|\d+)")


def kl_stats_lines(text: str) -> list[str]:
    """The final blocks of a ``--kl-divergence`` run as printed: from its ``====== Perplexity statistics``
    header to its ``Same top p`` line (empty when it printed none: fewer than 100 positions)."""
    from qkit.evaluation.klstats import HEADER_PPL

    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == HEADER_PPL]
    if not starts:
        return []
    out = []
    for ln in lines[starts[-1]:]:
        out.append(ln)
        if ln.startswith("Same top p:"):
            break
    return out


def parse_kl_stats(text: str) -> dict[str, float | None]:
    """The statistics a ``--kl-divergence`` run printed, under :func:`qkit.evaluation.klstats.llama_kl_stats`'s
    keys and in its units (the printed ones: Δp, same top p and the correlation in percent); ``nan`` as
    printed becomes None. Empty when the run printed no final blocks."""
    from qkit.evaluation.klstats import LINES

    out: dict[str, float | None] = {}
    lines = kl_stats_lines(text)
    for entry in LINES:
        if len(entry) != 4:
            continue
        key, se_key, label, _ = entry
        for ln in lines:
            if ln.startswith(label):
                values = [float(v) for v in _NUMBER.findall(ln[len(label):])]
                for k, v in zip((key, se_key), values):
                    if k:
                        out[k] = None if v != v else v
                break
    return out


class KldBase:
    """A ``--kl-divergence-base`` file, decoded as llama.cpp's ``kl_divergence()`` reads it.

    Layout (``perplexity()`` with ``logits_file``, and the writing ``log_softmax``): the 8 bytes
    ``_logits_``, int32 ``n_ctx``, int32 ``n_vocab``, int32 ``n_chunk``, int32 ``tokens[n_chunk * n_ctx]``,
    then per chunk per scored position (``n_ctx - 1 - n_ctx // 2`` of them, predicting tokens ``n_ctx//2 + 1
    .. n_ctx - 1`` of the chunk) ``nv = 2 * ((n_vocab + 1) // 2) + 4`` uint16: the first 4 are two float32,
    ``scale = (max_logit - min_logit) / 65535`` and ``min_log_prob = min_logit - max_logit - ln sum exp``
    with ``min_logit = max(min logit, max_logit - 16)``; then one uint16 per vocabulary entry,
    ``nearest_int((logit - min_logit) / scale)`` for a logit above ``min_logit``, else 0. A log-probability
    reads back as ``scale * code + min_log_prob`` in float32 (:meth:`log_probs`).

    Attributes: ``n_ctx``, ``n_vocab``, ``n_chunk``; ``tokens`` int32 [n_chunk * n_ctx]; ``targets`` int64 [N]
    (the token each scored position predicts, N = n_chunk * (n_ctx - 1 - n_ctx // 2)); ``scale``,
    ``min_log_prob`` float32 [N]; ``codes`` uint16 [N, n_vocab] (a view of the file's bytes).
    """

    def __init__(self, path: Path):
        raw = Path(path).read_bytes()
        if raw[:8] != b"_logits_":
            raise SystemExit(f"{path}: not a llama-perplexity --kl-divergence-base file")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3, offset=8))
        self.tokens = np.frombuffer(raw, dtype="<i4", count=self.n_chunk * self.n_ctx, offset=20)
        nv = 2 * ((self.n_vocab + 1) // 2) + 4
        per_chunk = self.n_ctx - 1 - self.n_ctx // 2
        offset = 20 + 4 * self.n_chunk * self.n_ctx
        if len(raw) != offset + 2 * self.n_chunk * per_chunk * nv:
            raise SystemExit(f"{path}: {len(raw)} bytes, the header says {offset + 2 * self.n_chunk * per_chunk * nv}")
        rows = np.frombuffer(raw, dtype="<u2", offset=offset).reshape(self.n_chunk * per_chunk, nv)
        head = rows[:, :4].copy().view("<f4")
        self.scale, self.min_log_prob = head[:, 0].copy(), head[:, 1].copy()
        self.codes = rows[:, 4:4 + self.n_vocab]
        first = self.n_ctx // 2
        self.targets = self.tokens.reshape(self.n_chunk, self.n_ctx)[:, first + 1:].reshape(-1).astype(np.int64)

    @property
    def positions(self) -> int:
        return self.codes.shape[0]

    def log_probs(self, rows: slice = slice(None)) -> np.ndarray:
        """float32 [r, n_vocab]: ``scale * code + min_log_prob``, float32 multiply then add, as the C reads it."""
        c = self.codes[rows].astype(np.float32)
        return c * self.scale[rows, None] + self.min_log_prob[rows, None]

    def nll(self) -> np.ndarray:
        """float32 [N]: ``-(scale * code[target] + min_log_prob)``, llama.cpp's ``nll_base``."""
        c = self.codes[np.arange(self.positions), self.targets].astype(np.float32)
        return -(c * self.scale + self.min_log_prob)


def kl_from_kld_bases(base: KldBase, other: KldBase, block: int = 32) -> dict[str, np.ndarray]:
    """Per scored position, ``kl_divergence()``'s quantities with ``other``'s decoded log-probabilities in
    place of the model's float logits (llama.cpp has no way to write those), in float64:
    ``nll`` = -ln q(target), ``nll_base`` (float32 values, as llama.cpp reads them), ``kld`` = sum over
    ``i`` with ``ln p_i > -16`` of ``p_i (ln p_i - ln q_i)``, ``p_diff`` = exp(-nll) - exp(-nll_base),
    ``same_top`` = first argmax of q == first argmax of p; and ``floor_mass``, the base probability of the
    tokens in that sum that ``other`` stores at its floor (code 0: 16 nats or more under its top logit),
    where the decoded ``ln q_i`` is only an upper bound. Both files must score the same tokens."""
    if base.n_ctx != other.n_ctx or base.n_vocab != other.n_vocab or not np.array_equal(base.tokens, other.tokens):
        raise SystemExit("the two --kl-divergence-base files score different tokens or contexts")
    n = base.positions
    kld = np.empty(n)
    same = np.empty(n, dtype=bool)
    floor_mass = np.empty(n)
    for s in range(0, n, block):
        rows = slice(s, min(n, s + block))
        lp = base.log_probs(rows).astype(np.float64)
        lq = other.log_probs(rows).astype(np.float64)
        support = lp > -16.0
        kld[rows] = np.where(support, np.exp(lp) * (lp - lq), 0.0).sum(axis=1)
        floor_mass[rows] = np.where(support & (other.codes[rows] == 0), np.exp(lp), 0.0).sum(axis=1)
        same[rows] = lq.argmax(axis=1) == lp.argmax(axis=1)
    nll, nll_base = other.nll().astype(np.float64), base.nll().astype(np.float64)
    return {"nll": nll, "nll_base": nll_base, "kld": kld, "p_diff": np.exp(-nll) - np.exp(-nll_base), "same_top": same,
            "floor_mass": floor_mass}


# A copy of perplexity.cpp that also writes, per scored position, the values kl_divergence() computes (its
# computation untouched: the patch only stores them): float nll, float nll_base, double kld, float p_diff,
# int32 same_top, 24 bytes a position in scoring order, to the file named by $QKIT_KLD_DUMP.
KLD_DUMP_DTYPE = np.dtype([("nll", "<f4"), ("nll_base", "<f4"), ("kld", "<f8"), ("p_diff", "<f4"), ("same_top", "<i4")])
_KLD_DUMP_PATCHES = (  # (anchor, text, insert before/after): each anchor occurs once in the pinned source
    ("static std::pair<double, float> log_softmax(int n_vocab, const float * logits, const uint16_t * base_log_prob, "
     "int tok, kl_divergence_result & kld) {",
     "struct qkit_kld_token { float nll; float nll_base; double kld; float p_diff; int32_t same_top; };\n"
     "static thread_local qkit_kld_token qkit_last;\n"
     "static std::vector<qkit_kld_token> qkit_dump;\n"
     "static const float * qkit_kld0 = nullptr;\n\n", "before"),
    ("    return std::make_pair(sum, p_diff);\n", "    qkit_last = {nll, nll_base, sum, p_diff, imax == imax_base};\n", "before"),
    ("            p_diff_values[i] = v.second;\n", "            qkit_dump[size_t(kld_values + i - qkit_kld0)] = qkit_last;\n", "after"),
    ("    auto p_diff_ptr = p_diff_values.data();\n",
     "    qkit_kld0 = kld_values.data();\n    qkit_dump.assign(kld_values.size(), qkit_kld_token{});\n", "after"),
    ('    LOG("\\n");\n\n    if (kld.count < 100) return;',
     '    if (const char * qkit_path = getenv("QKIT_KLD_DUMP")) {\n'
     "        std::ofstream qkit_out(qkit_path, std::ios::binary);\n"
     "        qkit_out.write((const char *)qkit_dump.data(), qkit_dump.size()*sizeof(qkit_kld_token));\n"
     "    }\n", "before"),
)


def build_kld_dump_tool() -> Path:
    """``llama-perplexity`` rebuilt from a copy of perplexity.cpp with :data:`_KLD_DUMP_PATCHES` applied, with
    the compile flags and link line CMake used for the tools build (``flags.make``, ``link.txt``), into
    ``build-tools/qkit-kld-dump/``; built once (seconds). Needs :func:`build_llama_ref.build_tools` first."""
    import hashlib
    import shlex

    src = blr.fetch() / "tools" / "perplexity" / "perplexity.cpp"
    text = src.read_text()
    for anchor, add, where in _KLD_DUMP_PATCHES:
        if text.count(anchor) != 1:
            raise SystemExit(f"{src}: the dump patch's anchor {anchor[:60]!r} is not there once; llama.cpp changed")
        text = text.replace(anchor, add + anchor if where == "before" else anchor + add)
    out_dir = blr.tools_dir() / "qkit-kld-dump"
    out_dir.mkdir(exist_ok=True)
    tag = hashlib.sha256(text.encode()).hexdigest()[:12]
    tool = out_dir / f"llama-perplexity-kld-dump-{tag}"
    if tool.exists():
        return tool
    cpp, obj = out_dir / f"perplexity-{tag}.cpp", out_dir / f"perplexity-{tag}.o"
    cpp.write_text(text)
    d = blr.tools_dir() / "tools" / "perplexity"
    flags = {}
    for ln in (d / "CMakeFiles" / "llama-perplexity-impl.dir" / "flags.make").read_text().splitlines():
        if " = " in ln and not ln.startswith("#"):
            k, v = ln.split(" = ", 1)
            flags[k.strip()] = shlex.split(v)
    link = shlex.split((d / "CMakeFiles" / "llama-perplexity.dir" / "link.txt").read_text())
    cxx = link[0]
    _, p = sh([cxx, *flags.get("CXX_DEFINES", []), *flags.get("CXX_INCLUDES", []), *flags.get("CXX_FLAGS", []),
               "-c", cpp, "-o", obj])
    check(p, "compiling the patched perplexity.cpp")
    # the tool's link line with the patched object in place of the library holding perplexity.cpp.o
    link = [str(obj) if a == "libllama-perplexity-impl.a" else a for a in link]
    link[link.index("-o") + 1] = str(tool.with_suffix(".tmp"))
    if str(obj) not in link:
        raise SystemExit(f"unexpected link line for llama-perplexity: {' '.join(link)}")
    p = subprocess.run(link, capture_output=True, text=True, cwd=d)  # link.txt's paths are relative to d
    check(p, "linking the patched llama-perplexity")
    tool.with_suffix(".tmp").rename(tool)
    return tool


def read_kld_dump(path: Path) -> np.ndarray:
    """The per-token values a :func:`build_kld_dump_tool` run wrote: structured array of
    :data:`KLD_DUMP_DTYPE` [N], in scoring order."""
    return np.fromfile(path, dtype=KLD_DUMP_DTYPE)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--repeats", type=int, default=3, help="timing runs per configuration (median; default 3)")
    p.add_argument("--ctx", type=int, default=2048, help="llama-perplexity -c (default 2048)")
    p.add_argument("--work", type=Path, help="scratch folder for the GGUF files (default: the qkit cache)")
    args = p.parse_args(argv)
    if not blr.tools_built():
        print("skipped: llama.cpp's tools are not built (run: python benchmarks/build_llama_ref.py --tools)")
        return 0

    import torch

    from qkit.models import load, resolve
    from qkit.texts import load_corpus
    from qkit.threads import available_cores

    t_start = time.perf_counter()
    work = args.work or (blr.ref_dir() / "bench")
    work.mkdir(parents=True, exist_ok=True)
    ref = resolve(None)
    threads = sorted({1, min(2, available_cores())})
    doc: dict = {"llama_cpp_commit": blr.commit(), "llama_cpp_python_sdist": blr.LLAMA_CPP_PYTHON,
                 "build": blr.tools_record(), "model": ref.spec, "model_dir": str(ref.directory),
                 "cores": available_cores(), "torch_threads_default": torch.get_num_threads()}

    f32 = work / "F32.gguf"
    print(f"[1] F32 GGUF: convert_hf_to_gguf.py --outtype f32 {ref.directory}", flush=True)
    doc["convert"] = convert_f32(ref.directory, f32, work)

    print(f"[2] llama-quantize ({', '.join(n for n, _ in SCHEMES)}) x threads {threads} x {args.repeats}", flush=True)
    doc["llama_quantize"] = time_llama_quantize(f32, work, args.repeats, threads)
    print(f"    qkit quantize_model(format='gguf') x torch threads {threads} x {args.repeats}", flush=True)
    doc["qkit_quantize"], collected = time_qkit(work, args.repeats, threads)

    print("[3] bytes of the 210 block projections", flush=True)
    doc["bytes"] = {n: compare_files(work / f"llama-{n}.gguf", work / f"qkit-{n}.gguf") for n, _ in SCHEMES}

    print("[4] perplexity", flush=True)
    text = load_corpus().text
    ruth = work / "ruth.txt"
    ruth.write_text(text, encoding="utf-8")
    ppl_files = {"F32": f32, "qkit q8_0": work / "qkit-q8_0.gguf", "qkit q4_k_m": work / "qkit-q4_k_m.gguf",
                 "llama q8_0": work / "llama-q8_0.gguf", "llama q4_k_m": work / "llama-q4_k_m.gguf"}
    tokens = {k: llama_tokens(f, ruth) for k, f in ppl_files.items()}
    bos = {k: bos_of(f) for k, f in ppl_files.items()}
    ids = tokens["F32"]
    same_ids = all(v == ids for v in tokens.values()) and len(set(bos.values())) == 1
    hf = resolve_hf_ids(ref, text)
    ctx = args.ctx
    probe = llama_perplexity(f32, ruth, ctx, 2) if 2 * ctx > len(ids) else None
    if probe is not None:
        ctx = (len(ids) // 2) // 256 * 256
    doc["perplexity_setup"] = {
        "corpus": load_corpus().name, "text_chars": len(text), "tokens_llama": len(ids), "bos": bos["F32"],
        "same_ids_all_files": same_ids, "hf_tokenizer_ids_match": hf == ids[1:] if bos["F32"] is not None else hf == ids,
        "requested_ctx": args.ctx, "ctx": ctx, "probe_at_requested_ctx": probe,
        "chunks_and_scored": scored_positions(len(ids), ctx), "first_scored_position": ctx // 2}
    lm = load(None, device="cpu", dtype=torch.float32).model
    lm.eval()
    torch.set_num_threads(min(2, available_cores()))
    weights = {"F32": {}, "qkit q8_0": collected["q8_0"], "qkit q4_k_m": collected["q4_k_m"]}
    rows = {}
    for k, f in ppl_files.items():
        print(f"    llama-perplexity {k} ...", flush=True)
        lp_file = work / f"logprobs-{k.replace(' ', '-')}.bin" if k in weights else None
        r = {"llama": llama_perplexity(f, ruth, ctx, 2, lp_file)}
        if r["llama"].get("chunks") is not None and r["llama"]["chunks"] != len(tokens[k]) // ctx:
            r["warning"] = f"llama-perplexity used {r['llama']['chunks']} chunks, llama-tokenize's ids give {len(tokens[k]) // ctx}"
        if k in weights:
            originals: dict = {}
            swap(lm, weights[k], originals)
            t0 = time.perf_counter()
            r["qkit"] = qkit_perplexity(lm, tokens[k], ctx, bos[k])
            r["qkit"]["seconds"] = round(time.perf_counter() - t0, 1)
            handles = hook_activations(lm, weights[k])
            if weights[k]:  # the same, with llama.cpp's rounding of the activations (see act_round)
                r["qkit_act_rounded"] = qkit_perplexity(lm, tokens[k], ctx, bos[k])
            # The noise of this very computation: the same again with every embedding weight moved by one fp32
            # ulp (a perturbation of the size of fp32 rounding noise), per token against the unperturbed run.
            emb = lm.get_input_embeddings().weight
            saved = emb.detach().clone()
            with torch.no_grad():
                emb.copy_(torch.nextafter(saved, torch.full_like(saved, float("inf"))))
            ulp = qkit_perplexity(lm, tokens[k], ctx, bos[k])
            with torch.no_grad():
                emb.copy_(saved)
            base = r["qkit_act_rounded" if weights[k] else "qkit"]["nll"]
            r["one_ulp_noise"] = per_token(ulp["nll"], base)
            for h in handles:
                h.remove()
                if "ppl" in r["llama"]:
                    r["diff_act_rounded"] = r["llama"]["ppl"] - r["qkit_act_rounded"]["ppl"]
            restore(lm, originals)
            if "ppl" in r["llama"]:
                r["diff"] = r["llama"]["ppl"] - r["qkit"]["ppl"]
                lp_ids, lp_nll = read_llama_logprobs(lp_file)
                r["per_token_ids_match"] = bool(np.array_equal(lp_ids, np.asarray(tokens[k][: lp_ids.size])))
                r["per_token"] = per_token(lp_nll, r["qkit"]["nll"])
                if "qkit_act_rounded" in r:
                    r["per_token_act_rounded"] = per_token(lp_nll, r["qkit_act_rounded"]["nll"])
                    shift = r["qkit_act_rounded"]["nll"] - r["qkit"]["nll"]  # what the rounding moves, per token
                    r["rounding_explains"] = float(np.corrcoef(lp_nll - r["qkit"]["nll"], shift)[0, 1])
                lp_file.unlink()
        for key in ("qkit", "qkit_act_rounded"):
            if key in r:
                r[key].pop("nll")
        rows[k] = r
    doc["perplexity"] = rows
    doc["seconds_total"] = round(time.perf_counter() - t_start, 1)
    report(doc, threads)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


def resolve_hf_ids(ref, text: str) -> list[int]:
    from qkit.models import load_tokenizer

    return load_tokenizer(ref.directory)(text, add_special_tokens=False)["input_ids"]


def report(doc: dict, threads: list[int]) -> None:
    b = doc.get("build") or {}
    print()
    print(f"llama.cpp {doc['llama_cpp_commit'][:12]} (llama-cpp-python {doc['llama_cpp_python_sdist']} sdist); "
          f"tools built in {b.get('seconds', '?')} s with -j {b.get('jobs', '?')}; {doc['cores']} cores")
    c = doc["convert"]
    print(f"F32 GGUF by convert_hf_to_gguf.py: {c['bytes'] / 1e6:.1f} MB in {c['seconds']:.1f} s"
          f"{' (sentencepiece stand-in)' if c['sentencepiece_stub'] else ''}")
    print()
    hdr = "scheme   " + "".join(f"  llama t{t}  qkit t{t}  ratio" for t in threads) + "   MB llama/qkit  bytes of 210 block projections"
    print(hdr)
    for n, _ in SCHEMES:
        lq, qk, by = doc["llama_quantize"][n], doc["qkit_quantize"][n], doc["bytes"][n]
        cells = "".join(f"  {lq[f't{t}_s']:7.2f}s {qk[f't{t}_s']:7.2f}s {qk[f't{t}_s'] / lq[f't{t}_s']:5.2f}x" for t in threads)
        same = "identical" if by["identical"] else (
            f"{by['blocks_differing']} of {by['blocks_compared']} blocks differ in {len(by['tensors_differing'])} tensors"
            + (f"; {len(by['type_mismatch'])} type mismatches" if by["type_mismatch"] else ""))
        print(f"{n:<9}{cells}   {lq['bytes'] / 1e6:5.1f}/{qk['bytes'] / 1e6:5.1f}  {same}")
    for n, _ in SCHEMES:
        by = doc["bytes"][n]
        roles = ", ".join(f"{r} {'+'.join(f'{k}x{v}' for k, v in t.items())}" for r, t in by["types_llama_qkit"].items())
        print(f"  {n} types (llama/qkit): {roles}")
        if by["other_tensors_differing_type"]:
            print("    other tensors (llama vs qkit): " + ", ".join(
                f"{k} {v['llama']} vs {v['qkit']}" for k, v in by["other_tensors_differing_type"].items()))
    s = doc["perplexity_setup"]
    print()
    print(f"perplexity on {s['corpus']}: {s['tokens_llama']} llama.cpp tokens (BOS {s['bos']}); same ids from every file: "
          f"{s['same_ids_all_files']}; HF tokenizer gives the same ids: {s['hf_tokenizer_ids_match']}")
    if s["probe_at_requested_ctx"]:
        print(f"  -c {s['requested_ctx']} refused ({s['probe_at_requested_ctx'].get('error', '?')}): ran -c {s['ctx']}")
    ch, sc = s["chunks_and_scored"]
    print(f"  -c {s['ctx']}: {ch} chunks, positions {s['first_scored_position']}..{s['ctx'] - 2} of each scored: {sc} tokens")
    print(f"  {'file':<14}{'llama.cpp PPL':>20}{'qkit (torch) PPL':>18}{'llama - qkit':>14}{'llama s':>9}"
          f"{'qkit, act. rounded':>20}{'llama - that':>14}")
    for k, r in doc["perplexity"].items():
        ll = r["llama"]
        lt = f"{ll['ppl']:.4f} +/- {ll['se']:.4f}" if "ppl" in ll else "failed"
        qt = f"{r['qkit']['ppl']:.4f}" if "qkit" in r else "-"
        d = f"{r['diff']:+.4f}" if "diff" in r else "-"
        qa = f"{r['qkit_act_rounded']['ppl']:.4f}" if "qkit_act_rounded" in r else "-"
        da = f"{r['diff_act_rounded']:+.4f}" if "diff_act_rounded" in r else "-"
        print(f"  {k:<14}{lt:>20}{qt:>18}{d:>14}{ll['seconds']:>9.1f}{qa:>20}{da:>14}"
              + (f"  ({r['warning']})" if "warning" in r else ""))
    print("  act. rounded: qkit's weights with the activations rounded as ggml's CPU matmul rounds them for a "
          "quantized weight (Q8_0 for 32-block types, Q8_K for k-quants)")
    print()
    print("  per scored token, llama.cpp's NLL - qkit's (llama.cpp's log-probabilities from --kl-divergence-base, "
          "16-bit: steps of <= 2.4e-4 nats):")
    print(f"  {'file':<14}{'qkit':<16}{'mean (ln PPL ratio)':>22}{'paired SE':>11}{'SD':>9}{'max |d|':>9}{'corr. with rounding':>21}")
    for k, r in doc["perplexity"].items():
        for key, label in (("per_token", "torch"), ("per_token_act_rounded", "act. rounded")):
            if key in r:
                t = r[key]
                corr = f"{r['rounding_explains']:.3f}" if key == "per_token" and "rounding_explains" in r else ""
                print(f"  {k:<14}{label:<16}{t['mean']:>+22.5f}{t['se']:>11.5f}{t['sd']:>9.4f}{t['max_abs']:>9.4f}{corr:>21}")
    print("  corr. with rounding: correlation, over tokens, of (llama.cpp - qkit) with what the activation rounding "
          "alone changes in qkit's NLL")
    print()
    print("  the same qkit computation (act. rounded where the weights are quantized) with every embedding weight one "
          "fp32 ulp up, per token against itself unperturbed:")
    for k, r in doc["perplexity"].items():
        if "one_ulp_noise" in r:
            t = r["one_ulp_noise"]
            print(f"  {k:<14}{'1-ulp noise':<16}{t['mean']:>+22.5f}{t['se']:>11.5f}{t['sd']:>9.4f}{t['max_abs']:>9.4f}")
    print(f"total {doc['seconds_total']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
