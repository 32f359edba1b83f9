"""vLLM's worker: loads one compressed-tensors (or plain) model directory in vLLM and measures an eval job.

Run by ``qkit.evaluation.engines.vllm`` as ``python _worker_vllm.py D`` (the exchange of
``qkit.evaluation.engines.worker``) with the interpreter that has vLLM: qkit's own, or
``$QKIT_ENGINE_PYTHON``. It imports only the standard library, numpy, ``_worker_io.py`` (by path) and
vllm, never qkit, so it runs in a virtual environment that has vLLM and nothing of qkit. The request::

    model              the model directory
    dtype              vLLM's --dtype ("float32", "bfloat16", "float16")
    max_model_len      the engine's length (the job's longest sequence + 1: see below)
    tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend (null: vLLM's default)
    allow_long         set VLLM_ALLOW_LONG_MAX_MODEL_LEN (a full-context window: its + 1 is never read)
    top_k              prompt log-probabilities per position
    windows            how many corpus windows: arrays window.0 ... (int64 [w])
    battery_prompts    token-id lists; battery_tokens, repetition_penalty
    agreement_inputs   token-id lists (prompt + the reference's n tokens); agreement_n

and the answer: arrays ``target.I`` (float64 ``[w-1]``: log q(x_t | x_<t) for t = 1..w-1, the entry of
vLLM's ``prompt_logprobs`` for the token that is there, which vLLM always includes, whatever its rank),
``top_ids.I`` int64 / ``top_logprobs.I`` float32 ``[w-1, k]`` (the k most likely tokens by rank, rank 1
first), ``argmax.I`` int64 ``[w-1]`` (the rank-1 token), ``agreement.J`` int64 ``[n]`` (the rank-1 token at
the last ``n`` positions of agreement input J: ``prompt_logprobs=1`` over prompt + continuation,
teacher-forced); JSON ``battery_ids`` (greedy, temperature 0, stopping at EOS), ``load_seconds``,
``run_seconds``, ``version``, ``kernels`` (the linear kernels vLLM logged that it chose).

vLLM scores a prompt only while generating: ``SamplingParams(max_tokens=1, prompt_logprobs=k)``, so the
engine holds one position more than the job's longest sequence; that generated token is never read.

A failure (vLLM refusing the model, a kernel missing on this build) is ``io.Refused`` with vLLM's own
reason in one line. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
the parent), so vLLM's exception is the root cause; with parallel workers the root cause may only be in
the log, and is read back from it. The ``__main__`` guard is required: vLLM starts its engine and
worker processes with ``spawn``, which re-imports this file as ``__mp_main__``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# qkit's own vllm.py sits beside this script: its directory must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402


def _load_io():
    spec = importlib.util.spec_from_file_location("_qkit_worker_io", os.path.join(_HERE, "_worker_io.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# vLLM's wrappers around the real failure, which name no cause of their own.
GENERIC = ("Engine core initialization failed", "See root cause above", "EngineDeadError", "EngineCore encountered")
_ERROR_LINE = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")


def error_lines(log: str) -> list[str]:
    """``SomeError: message`` lines of a log (vLLM's engine processes log their root cause there)."""
    return [f"{m.group(1)}: {m.group(2).strip()}" for m in (_ERROR_LINE.match(x.strip()) for x in log.splitlines()) if m]


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of the message (400 characters at most); a first line that ends in ``:``
    introduces a list ("Failed to find a kernel ... Reasons:"), whose lines are then joined onto it."""
    lines = [x.strip() for x in str(exc).splitlines() if x.strip()]
    text = " ".join(lines) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:400]


def refusal_reason(exc: BaseException, log: str) -> str:
    """vLLM's reason in one line: the exception's own, unless it is a wrapper ("Engine core
    initialization failed. See root cause above"); then the last specific error line of the log."""
    reason = one_line(exc)
    if not any(g in reason for g in GENERIC):
        return reason
    specific = [x for x in error_lines(log) if not any(g in x for g in GENERIC)]
    return specific[-1][:400] if specific else reason


def _own_log() -> str:
    """What this worker (and the engine processes it started) printed so far: ``D/log.txt``."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        with open(os.path.join(sys.argv[1], "log.txt"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_KERNEL = re.compile(r"(?:Using|Selected) (\w+Kernel\w*) for ([\w-]+)")  # vLLM's kernel choice, as it logs it


def kernels(log: str) -> list[str]:
    """The linear kernels vLLM said it chose (``Selected CPUInt8ScaledMMLinearKernel for
    CompressedTensorsW8A8Int8``), sorted, each once."""
    return sorted({f"{m.group(1)} for {m.group(2)}" for m in _KERNEL.finditer(log)})


def ranked(entries: dict, k: int) -> tuple[list[int], list[float]]:
    """A position's ``{token_id: Logprob}`` -> the ids and log-probs of ranks 1..k, in rank order (vLLM
    returns the top ``k`` plus the token that is there: ``k`` or ``k + 1`` entries, each with its rank)."""
    items = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None and lp.rank <= k)
    return [t for _, t, _ in items], [p for _, _, p in items]


def score(llm, prompts: list[list[int]], k: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``prompt_logprobs=k`` over every prompt in one batched ``generate``: per prompt, float64 ``[w-1]``
    target log-probs and int64 / float32 ``[w-1, k]`` top ids / log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], params, use_tqdm=False)
    scored = []
    for ids, o in zip(prompts, outs):
        plp = o.prompt_logprobs  # [w] entries; entry 0 is None (nothing predicts the first token)
        w = len(ids)
        target = np.empty(w - 1, dtype=np.float64)
        top_ids = np.zeros((w - 1, k), dtype=np.int64)
        top_lp = np.full((w - 1, k), -np.inf, dtype=np.float32)
        for t in range(1, w):  # vLLM hands back one dict of k + 1 Python objects per position
            entries = plp[t]
            target[t - 1] = entries[int(ids[t])].logprob
            tids, lps = ranked(entries, k)
            top_ids[t - 1, : len(tids)] = tids
            top_lp[t - 1, : len(lps)] = lps
        scored.append((target, top_ids, top_lp))
    return scored


def generate(llm, prompts: list[list[int]], max_tokens: int, repetition_penalty: float) -> list[list[int]]:
    """Greedy generation (temperature 0) of up to ``max_tokens`` tokens per prompt, stopping at EOS."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts:
        return []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=repetition_penalty,
                            detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], params, use_tqdm=False)
    return [list(map(int, o.outputs[0].token_ids)) for o in outs]


def load(request: dict):
    from vllm import LLM

    kwargs = dict(
        model=request["model"], tokenizer=request["model"], dtype=request["dtype"],
        max_model_len=int(request["max_model_len"]),
        tensor_parallel_size=int(request["tensor_parallel_size"]),
        pipeline_parallel_size=int(request["pipeline_parallel_size"]),
        enforce_eager=True,  # no graph capture or compilation: a row is scored once
        enable_prefix_caching=False,  # every position's log-probs computed, none taken from a cache
        max_logprobs=max(20, int(request["top_k"])), seed=0, trust_remote_code=False,
    )
    if request.get("distributed_executor_backend"):
        kwargs["distributed_executor_backend"] = request["distributed_executor_backend"]
    if int(request["pipeline_parallel_size"]) > 1 and request.get("cpu_build"):
        # vLLM 0.32's CPU build skips its warm-up when eager, and that warm-up allocates the tensors passed
        # between pipeline stages: the second stage then fails on its first step. Traced once by dynamo and
        # run by its eager backend instead (no inductor compile; the same numbers as eager, measured).
        kwargs["enforce_eager"] = False
        kwargs["compilation_config"] = {"mode": 2, "backend": "eager"}
    return LLM(**kwargs)


def handle(request: dict, arrays: dict, out) -> dict:
    if request.get("allow_long"):  # read by vLLM when it checks max_model_len against the model's context
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    t0 = time.perf_counter()
    try:
        import vllm

        llm = load(request)
    except Exception as e:  # noqa: BLE001 - whatever vLLM raised is its reason for not running the row
        raise io.Refused(refusal_reason(e, _own_log())) from None
    t1 = time.perf_counter()
    k = int(request["top_k"])
    try:
        windows = [arrays[f"window.{i}"].tolist() for i in range(int(request["windows"]))]
        for i, (target, top_ids, top_lp) in enumerate(score(llm, windows, k)):
            out.save(f"target.{i}", target)
            out.save(f"top_ids.{i}", top_ids)
            out.save(f"top_logprobs.{i}", top_lp)
            out.save(f"argmax.{i}", top_ids[:, 0])
        n = int(request["agreement_n"])
        if request["agreement_inputs"] and n > 0:
            for j, (_, top_ids, _) in enumerate(score(llm, request["agreement_inputs"], 1)):
                out.save(f"agreement.{j}", top_ids[-n:, 0])
        battery = generate(llm, request["battery_prompts"], int(request["battery_tokens"]),
                           float(request["repetition_penalty"]))
    except Exception as e:  # noqa: BLE001
        raise io.Refused(refusal_reason(e, _own_log())) from None
    return {"version": getattr(vllm, "__version__", ""), "load_seconds": t1 - t0,
            "run_seconds": time.perf_counter() - t1, "battery_ids": battery, "kernels": kernels(_own_log())}


if __name__ == "__main__":  # required: vLLM spawns processes that re-import this file as __mp_main__
    io = _load_io()
    io.serve(handle)
