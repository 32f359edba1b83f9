"""llama.cpp's worker: loads one GGUF with llama-cpp-python and measures an eval job. Never imports qkit.

Run by ``qkit.evaluation.engines.llama_cpp`` as ``python _worker_llama_cpp.py D`` (the exchange of
``qkit.evaluation.engines.worker``). The request::

    model            the GGUF file
    n_ctx            the context (the longest window, prompt + generation, or agreement input)
    n_batch          tokens per llama_decode call (also the micro-batch)
    threads          CPU threads (generation and batch)
    windows          how many corpus windows: arrays window.0 ... (int64 [w])
    battery_prompts  token-id lists; battery_tokens, repetition_penalty
    agreement_inputs token-id lists (prompt + the reference's n tokens); agreement_n

and the answer: arrays ``logprobs.I`` (float32 ``[w-1, V]``: log-softmax of llama.cpp's logits at
positions 0..w-2, which predict tokens 1..w-1; written through a memory map), ``target.I`` (float64
``[w-1]``: the log-probability of each next token) and ``argmax.I`` (int64 ``[w-1]``); JSON
``battery_ids`` (the generated ids per prompt, the end-of-generation token included when reached),
``agreement_argmax`` (per input, the argmax at its last ``n`` positions' predictions),
``load_seconds``, ``run_seconds``, ``version``, ``n_vocab``, ``system_info``.

What llama.cpp computes here is what it deploys with llama-cpp-python's defaults: the file's weights
as stored, its CPU kernels (a quantized matmul rounds its activations to 8 bits first: Q8_0, or Q8_K for
k-quants), an f16 KV cache, flash attention off. Greedy generation reads each step's logits from the
engine (its KV cache, one token per ``llama_decode``) and picks the argmax after the repetition penalty
transformers applies (``RepetitionPenaltyLogitsProcessor``: every id already in the sequence, prompt
included, has its logit divided by the penalty when positive and multiplied when negative); it stops at
the vocabulary's end-of-generation tokens (``llama_vocab_is_eog``) or after ``battery_tokens``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# qkit's own llama_cpp.py sits beside this script: its directory must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

CHUNK = 256  # rows of the log-softmax done at a time: [256, V] float64 temporaries (100 MB at V = 49152)


def _load_io():
    spec = importlib.util.spec_from_file_location("_qkit_worker_io", os.path.join(_HERE, "_worker_io.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


io = _load_io()


def log_softmax_into(logits: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = logits[i] - logsumexp(logits[i])`` in float32, the sum taken in float64, ``CHUNK`` rows at
    a time (``logits`` float32 ``[n, V]``, ``out`` float32 ``[n, V]``, e.g. a memory map)."""
    for s in range(0, logits.shape[0], CHUNK):
        x = logits[s : s + CHUNK]
        m = x.max(axis=1, keepdims=True)
        lse = m.astype(np.float64) + np.log(np.exp((x - m).astype(np.float64)).sum(axis=1, keepdims=True))
        out[s : s + CHUNK] = x - lse.astype(np.float32)


def penalized_argmax(logits: np.ndarray, seen: np.ndarray, penalty: float) -> int:
    """transformers' repetition penalty over the ids in ``seen`` (int64, unique), then the argmax."""
    if penalty == 1.0 or seen.size == 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float32, copy=True)
    v = x[seen]
    x[seen] = np.where(v < 0, v * np.float32(penalty), v / np.float32(penalty))
    return int(np.argmax(x))


def handle(request: dict, arrays: dict, out) -> dict:
    try:
        import llama_cpp
    except ImportError as e:
        raise io.Refused(f"llama-cpp-python is not importable in {sys.executable}: {e}") from None
    t0 = time.perf_counter()
    n_ctx, n_batch, threads = int(request["n_ctx"]), int(request["n_batch"]), int(request["threads"])
    try:
        # One thread for the one-token decode steps of the battery, ``threads`` for batches (the windows,
        # prompts and agreement inputs): a step of this size is too small to split, and with passive OpenMP
        # waits a second thread costs more in wake-ups than it computes (measured on the default model's
        # q8_0 on 2 cores: 12.8 ms a token with 1 thread, 29 ms with 2; a 2,000-token batch 8.0 s with 1, 4.9 s with 2).
        llm = llama_cpp.Llama(model_path=request["model"], n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                              n_threads=1, n_threads_batch=threads, logits_all=True, n_gpu_layers=0,
                              verbose=bool(request.get("verbose", False)))
    except (ValueError, RuntimeError) as e:  # llama.cpp could not load the file (a type it lacks, a bad file)
        raise io.Refused(f"llama.cpp could not load {os.path.basename(request['model'])}: {e}") from None
    load_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    vocab = llm.n_vocab()

    def is_end(token: int) -> bool:
        # what llama.cpp's own generate() stops at (llama.py reads the vocabulary the same way)
        return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))

    def evaluate(ids) -> np.ndarray:
        """Logits float32 [len(ids), V] of one sequence from an empty KV cache (a view of llm.scores)."""
        if len(ids) > n_ctx:
            raise io.BadInput(f"a sequence of {len(ids)} tokens exceeds the context of {n_ctx}")
        llm.reset()  # n_tokens = 0: eval() then clears the KV cache from position 0
        llm.eval([int(t) for t in ids])
        return llm.scores[: len(ids)]

    for i in range(int(request["windows"])):
        w = arrays[f"window.{i}"]
        logits = evaluate(w)[:-1]
        lp = out.memmap(f"logprobs.{i}", np.float32, (w.size - 1, vocab))
        log_softmax_into(logits, lp)
        targets = w[1:].astype(np.int64)
        out.save(f"target.{i}", lp[np.arange(targets.size), targets].astype(np.float64))
        out.save(f"argmax.{i}", lp.argmax(axis=1).astype(np.int64))
        lp.flush()
        del lp

    battery_ids = []
    penalty = float(request["repetition_penalty"])
    for prompt in request["battery_prompts"]:
        seq = [int(t) for t in prompt]
        if len(seq) + int(request["battery_tokens"]) > n_ctx:
            raise io.BadInput(f"a battery prompt of {len(seq)} tokens plus {request['battery_tokens']} new ones "
                              f"exceeds the context of {n_ctx}")
        logits = evaluate(seq)[-1]
        new: list[int] = []
        for _ in range(int(request["battery_tokens"])):
            token = penalized_argmax(logits, np.unique(np.asarray(seq, dtype=np.int64)), penalty)
            new.append(token)
            seq.append(token)
            if is_end(token) or len(new) == int(request["battery_tokens"]):
                break
            llm.eval([token])  # one step on the engine's KV cache
            logits = llm.scores[llm.n_tokens - 1]
        battery_ids.append(new)

    n = int(request["agreement_n"])
    agreement = []
    for ids in request["agreement_inputs"]:
        logits = evaluate(ids)
        agreement.append([int(t) for t in logits[len(ids) - n - 1 : len(ids) - 1].argmax(axis=1)])

    info = llama_cpp.llama_print_system_info()
    return {
        "battery_ids": battery_ids,
        "agreement_argmax": agreement,
        "load_seconds": load_seconds,
        "run_seconds": time.perf_counter() - t1,
        "version": getattr(llama_cpp, "__version__", ""),
        "n_vocab": vocab,
        "system_info": info.decode("utf-8", "replace").strip() if isinstance(info, bytes) else str(info),
    }


if __name__ == "__main__":
    io.serve(handle)
