"""``--runtime llama.cpp``: a row's GGUF loaded by llama.cpp (llama-cpp-python), in a worker subprocess.

Layer 6 (``evaluation.engines``). The row's file is qkit's own GGUF export (``quantize_model(format="gguf")``:
the same bytes ``llama-quantize`` writes for the block projections, docs/export-and-verify.md), and the
reference row's is the same writer with nothing quantized (F32 for an fp32 model). The worker
(``_worker_llama_cpp.py``) scores the corpus windows with all logits (``Llama(logits_all=True)``: the full
distribution, so KL and top-1 are computed as for a torch row), generates the battery greedily on its
own KV cache, and reads the agreement inputs teacher-forced.

What differs from the torch row of the same scheme is llama.cpp's computation, not the weights: its
quantized matmuls round each activation row to 8-bit blocks first (Q8_0, or Q8_K for k-quant weights),
its KV cache is f16, and its kernels sum in their own order. The extra is ``qkit[llama-cpp]``
(``llama-cpp-python``, which compiles llama.cpp on install; docs/runtimes.md has the command).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from qkit.errors import InputError
from qkit.evaluation.engines.base import (
    ENGINES,
    EngineJob,
    EngineOptions,
    EngineRefused,
    EngineScores,
)
from qkit.evaluation.engines.scoring import WorkerEngine
from qkit.evaluation.engines.worker import check_importable, run_worker
from qkit.export.gguf.metadata import FILE as GGUF_FILE
from qkit.export.gguf.types import ggml_scheme_names, is_ggml
from qkit.schemes import get_scheme

_SHOWN = ("q8_0", "q4_0", "q4_k", "q6_k", "q4_k_m", "iq4_xs")  # examples named in a refusal
WORKER = Path(__file__).resolve().parent / "_worker_llama_cpp.py"
N_BATCH = 512  # llama-cpp-python's default n_batch / n_ubatch (capped at the context)
NOTE = ("llama.cpp computes with the GGUF's stored weights: its quantized matmuls round activations to 8-bit "
        "blocks (Q8_0, Q8_K for k-quants) before each dot product, its KV cache is f16, and its kernels sum in "
        "their own order; these, not the weights, are what differ from the torch row")


class LlamaCppEngine(WorkerEngine):
    """llama.cpp as an eval runtime (``ENGINES["llama.cpp"]``)."""

    name = "llama.cpp"
    extra = "llama-cpp"
    format = "gguf"
    full_distribution = True
    module = "llama_cpp"  # the package the worker imports
    package = "llama-cpp-python"

    def check_available(self, options: EngineOptions) -> None:
        """``llama_cpp`` importable by the worker's interpreter (``EngineOptions.python``,
        ``$QKIT_ENGINE_PYTHON``, else qkit's); one ``InputError`` line naming ``qkit[llama-cpp]`` if not.
        vLLM's parallelism options do not apply: this engine runs on the CPU, in one process."""
        check_importable(self.module, options.python, runtime=self.name, extra=self.extra, package=self.package)

    def cannot_run(self, scheme: str | None, simulations: tuple[str, ...]) -> str | None:
        """A scheme GGUF has no type for, or a row whose activations or KV cache qkit only simulates."""
        if simulations:
            return (f"llama.cpp runs the GGUF's weights as stored; it has no {'+'.join(simulations)} (a run-time "
                    "simulation of qkit's torch runtime)")
        if scheme is None:
            return None
        if not is_ggml(get_scheme(scheme)):
            return (f"{scheme} has no GGUF type; llama.cpp reads llama.cpp's own types and recipes "
                    f"({', '.join(n for n in ggml_scheme_names() if n in _SHOWN)}, ...) and mxfp4")
        return None

    def export_options(self, simulations: tuple[str, ...]) -> dict[str, str]:
        """The ``QuantizeOptions`` fields a row's file is written with: GGUF (a row with simulations is
        refused by ``cannot_run`` first)."""
        return {"format": self.format}

    def context(self, job: EngineJob, options: EngineOptions) -> int:
        """The context the worker opens: ``--max-model-len``, else the longest sequence the job holds."""
        need = max([int(w.numel()) for w in job.windows]
                   + [len(p) + job.battery_tokens for p in job.battery_prompts]
                   + [len(a) for a in job.agreement_inputs])
        return options.max_model_len or need

    def run(self, path: Path, job: EngineJob, options: EngineOptions, *, workdir: Path | None = None,
            timeout: float | None = None) -> EngineScores:
        """Score ``job`` on the GGUF ``path`` in a worker (see ``_worker_llama_cpp.py``).

        Returns ``EngineScores`` with ``full`` (float32 ``[w-1, V]`` per window, memory-mapped from the
        worker's files), ``target_logprobs`` float64 ``[w-1]``, ``argmax`` int64 ``[w-1]``, the battery's
        generated ids and the agreement argmax (int64 ``[agreement_n]`` per prompt)."""
        path = Path(path)
        if path.is_dir():  # qkit's GGUF export into a directory writes DIR/model.gguf
            path = path / GGUF_FILE
        n_ctx = self.context(job, options)
        longest = max(int(w.numel()) for w in job.windows)
        if n_ctx < longest:  # the runner refuses this before loading; a library caller here
            raise InputError(f"--max-model-len {n_ctx} is shorter than the eval window ({longest} tokens); "
                             "pass a larger --max-model-len or a smaller --window")
        request = {
            "model": str(path.resolve()),
            "n_ctx": n_ctx,
            "n_batch": min(N_BATCH, n_ctx),
            "threads": torch.get_num_threads(),  # qkit's choice (--threads, the CPU quota): the engine's too
            "windows": len(job.windows),
            "battery_prompts": [list(map(int, p)) for p in job.battery_prompts],
            "battery_tokens": job.battery_tokens,
            "repetition_penalty": job.repetition_penalty,
            "agreement_inputs": [list(map(int, a)) for a in job.agreement_inputs],
            "agreement_n": job.agreement_n,
        }
        arrays = {f"window.{i}": w.numpy().astype(np.int64) for i, w in enumerate(job.windows)}
        # libgomp's idle threads spin between ggml's graph computations (one per generated token) and take
        # the CPU from the thread doing the work on a busy machine: 4 prompts x 16 tokens took 91.8 s with
        # spinning, 7.7 s passive (2 threads, load average 13). A user's own setting is kept.
        env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        result, out = run_worker(WORKER, request, arrays, python=options.python, timeout=timeout, workdir=workdir,
                                 name=self.name, env=env)
        n = len(job.windows)
        try:
            full = [torch.from_numpy(out[f"logprobs.{i}"]) for i in range(n)]
            target = [torch.from_numpy(out[f"target.{i}"]) for i in range(n)]
            argmax = [torch.from_numpy(out[f"argmax.{i}"]) for i in range(n)]
        except KeyError as e:
            raise EngineRefused(f"llama.cpp's worker returned no {e.args[0]}") from None
        notes = [NOTE]
        if result.get("system_info"):
            notes.append(f"llama.cpp CPU features: {result['system_info'].rstrip(' |')}")
        return EngineScores(
            target_logprobs=target,
            argmax=argmax,
            battery_ids=[list(map(int, b)) for b in result["battery_ids"]],
            agreement_argmax=[torch.tensor(a, dtype=torch.long) for a in result["agreement_argmax"]],
            full=full,
            load_seconds=float(result["load_seconds"]),
            run_seconds=float(result["run_seconds"]),
            version=f"llama-cpp-python {result.get('version', '')}".strip(),
            notes=notes,
        )


ENGINE = LlamaCppEngine()
ENGINES.register(ENGINE.name, ENGINE, aliases=("llama-cpp", "llamacpp"))

__all__ = ["ENGINE", "LlamaCppEngine", "NOTE", "WORKER"]
