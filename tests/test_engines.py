"""Eval runtimes without any engine installed: the worker exchange, the refusals, and the runner's engine rows.

The runner's side is checked against an independent oracle: a stand-in engine (``TorchEngine``) that loads
each row's written qkit checkpoint and measures it with qkit's own torch code. Its rows must then equal the
torch rows of the same specs bit for bit (perplexity, KL, top-1, battery, agreement) and ``versus_torch``
must be exactly zero: what is left to differ is the plumbing (the job's token ids, the prompt and
continuation unpadding, the score conversion, the row assembly), which is what these tests pin.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from qkit.errors import InputError
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.engine_rows import row_name
from qkit.evaluation.engines import (
    ENGINES,
    EngineOptions,
    EngineRefused,
    EngineScores,
    check_engine_lengths,
    get_engine,
    runtime_names,
)
from qkit.evaluation.engines.llama_cpp import LlamaCppEngine
from qkit.evaluation.engines.scoring import WorkerEngine, engine_scores
from qkit.evaluation.engines.torch_engine import TorchEngine as QkitTorchEngine
from qkit.evaluation.engines.worker import (
    ENGINE_PYTHON,
    WORKER_IO,
    check_importable,
    engine_python,
    run_worker,
)
from qkit.evaluation.measuring import refused_row
from qkit.evaluation.report import EvalReport

FAST = dict(tokens=96, battery_tokens=6, agree_tokens=3)

# --------------------------------------------------------------------------- the worker exchange

WORKER = textwrap.dedent(f'''
    import importlib.util, os, subprocess, sys, time
    spec = importlib.util.spec_from_file_location("_qkit_worker_io", {str(WORKER_IO)!r})
    io = importlib.util.module_from_spec(spec); spec.loader.exec_module(io)
    import numpy as np

    def handle(request, arrays, out):
        mode = request["mode"]
        if mode == "refuse":
            raise io.Refused("no kernel for this\\non this build")
        if mode == "bad":
            raise io.BadInput("window too long")
        if mode == "raise":
            raise ZeroDivisionError("division by zero")
        if mode == "crash":
            print("ggml: fatal error in cpu_gemm", flush=True)
            os._exit(3)
        if mode == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            open("child.pid", "w").write(str(child.pid))
            with open(request["pidfile"], "w") as f:
                f.write(str(child.pid))
            time.sleep(60)
        x = arrays["x"]
        m = out.memmap("double", np.float32, x.shape)
        m[:] = 2 * x
        m.flush()
        out.save("ids", np.arange(3, dtype=np.int64))
        return {{"echo": request["value"], "cwd": os.getcwd()}}

    io.serve(handle)
''')


@pytest.fixture(scope="module")
def worker_script(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("worker") / "worker.py"
    p.write_text(WORKER)
    return p


def test_run_worker_round_trips_json_and_arrays_through_files(worker_script, tmp_path):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    result, out = run_worker(worker_script, {"mode": "ok", "value": [1, "a"]}, {"x": x}, workdir=tmp_path)
    assert result["echo"] == [1, "a"] and result["seconds"] > 0
    assert Path(result["cwd"]) == tmp_path / "exchange"  # run inside its exchange directory
    assert np.array_equal(out["double"], 2 * x) and out["double"].dtype == np.float32
    assert isinstance(out["double"], np.memmap)  # large outputs come back mapped, not read into memory
    assert np.array_equal(out["ids"], [0, 1, 2])
    assert torch.from_numpy(out["double"]).sum().item() == pytest.approx(0.0, abs=1e-6)  # writable: no copy warning


def test_run_worker_removes_its_scratch_directory(worker_script, monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    _, out = run_worker(worker_script, {"mode": "ok", "value": 0}, {"x": np.ones(2, np.float32)})
    assert list(tmp_path.iterdir()) == []
    assert np.array_equal(out["double"], [2, 2])  # the mapping outlives the removed file


@pytest.mark.parametrize("mode, error, words", [
    ("refuse", EngineRefused, "no kernel for this on this build"),  # one line
    ("bad", InputError, "window too long"),
    ("raise", EngineRefused, "ZeroDivisionError: division by zero"),
    ("crash", EngineRefused, "exited with status 3 before answering: ggml: fatal error in cpu_gemm"),
])
def test_a_workers_failure_is_one_line_of_the_right_kind(worker_script, tmp_path, mode, error, words):
    with pytest.raises(error) as e:
        run_worker(worker_script, {"mode": mode}, {"x": np.zeros(1)}, workdir=tmp_path, name="testengine")
    assert str(e.value) == words or str(e.value).endswith(words), str(e.value)
    assert "\n" not in str(e.value)


def test_a_timeout_kills_the_worker_and_what_it_started(worker_script, tmp_path):
    pidfile = tmp_path / "child.pid"
    t0 = time.perf_counter()
    with pytest.raises(EngineRefused, match="did not finish within 3 s"):
        run_worker(worker_script, {"mode": "hang", "pidfile": str(pidfile)}, {}, workdir=tmp_path, timeout=3)
    assert time.perf_counter() - t0 < 30
    child = int(pidfile.read_text())
    for _ in range(50):  # the grandchild was SIGKILLed with the group; wait for init to reap it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker's child {child} is still running")


def test_engine_python_order(monkeypatch):
    monkeypatch.delenv(ENGINE_PYTHON, raising=False)
    assert engine_python(None) == sys.executable
    monkeypatch.setenv(ENGINE_PYTHON, "/opt/engine/bin/python")
    assert engine_python(None) == "/opt/engine/bin/python"
    assert engine_python("/x/python") == "/x/python"


def test_check_importable_refuses_in_one_line_naming_the_extra(monkeypatch):
    monkeypatch.delenv(ENGINE_PYTHON, raising=False)
    assert check_importable("json", None, runtime="r", extra="x", package="p") == sys.executable
    with pytest.raises(InputError, match=r"^--runtime r needs some-pkg, which this Python lacks: pip install 'qkit\[ex\]'"):
        check_importable("qkit_no_such_module", None, runtime="r", extra="ex", package="some-pkg")
    with pytest.raises(InputError, match="does not exist"):
        check_importable("json", "/no/such/python", runtime="r", extra="ex", package="p")
    # another interpreter is asked in a subprocess (here: the same executable through a symlink-free path)
    with pytest.raises(InputError, match=r"which .* lacks: pip install 'qkit\[ex\]' in that environment"):
        check_importable("qkit_no_such_module", "python3", runtime="r", extra="ex", package="p")


# --------------------------------------------------------------------------- llama.cpp's refusals (no engine needed)


@pytest.mark.parametrize("scheme, sims, refused", [
    (None, (), None), ("q8_0", (), None), ("q4_k_m", (), None), ("iq4_xs", (), None), ("mxfp4", (), None),
    ("nf4", (), "nf4 has no GGUF type"), ("int4-g64", (), "int4-g64 has no GGUF type"),
    ("int8-row", (), "int8-row has no GGUF type"),
    ("int8-row", ("act-int8-token",), "it has no act-int8-token"), (None, ("kv-int8",), "it has no kv-int8"),
])
def test_llama_cpp_cannot_run(scheme, sims, refused):
    reason = get_engine("llama.cpp").cannot_run(scheme, sims)
    assert (reason is None) if refused is None else (refused in reason and "\n" not in reason)


def test_llama_cpp_is_registered_with_its_contract():
    e = get_engine("llama.cpp")
    assert get_engine("LLAMA.CPP") is e and get_engine("llama-cpp") is e
    assert (e.name, e.extra, e.format, e.full_distribution) == ("llama.cpp", "llama-cpp", "gguf", True)
    assert e.export_options(()) == {"format": "gguf"}


def test_a_missing_engine_is_refused_before_anything_loads(monkeypatch, tiny_model_dir):
    monkeypatch.delenv(ENGINE_PYTHON, raising=False)
    monkeypatch.setattr(LlamaCppEngine, "module", "qkit_no_such_llama_cpp")
    import qkit.evaluation.runner as runner

    monkeypatch.setattr(runner, "load", _no_load)
    with pytest.raises(InputError, match=r"^--runtime llama.cpp needs llama-cpp-python, which this Python lacks: "
                                         r"pip install 'qkit\[llama-cpp\]'"):
        evaluate(tiny_model_dir, options=EvalOptions(runtimes=("torch", "llama.cpp"), **FAST))


def _no_load(*a, **k):
    raise AssertionError("the model was loaded before the refusal")


def test_max_model_len_shorter_than_the_window_is_refused_before_loading(monkeypatch, tiny_model_dir, fake_engine):
    import qkit.evaluation.runner as runner

    monkeypatch.setattr(runner, "load", _no_load)
    opts = EvalOptions(runtimes=("torch", "torch-oracle"), window=96, engine=EngineOptions(max_model_len=80), **FAST)
    with pytest.raises(InputError, match=r"^--max-model-len 80 is too short for --runtime torch-oracle: the eval "
                                         r"window is 96 tokens; pass --max-model-len 96 or more, or a smaller --window$"):
        evaluate(tiny_model_dir, options=opts)


def test_check_engine_lengths_counts_prompt_plus_generation():
    e = [get_engine("llama.cpp")]
    check_engine_lengths(e, EngineOptions(max_model_len=None), 4096, [10], 32, 9)  # no limit given
    check_engine_lengths(e, EngineOptions(max_model_len=72), 64, [40], 32, 9)  # 40 + 32 = 72 fits
    with pytest.raises(InputError, match=r"the longest battery prompt \(40 tokens\) with 32 more is 72; "
                                         r"pass --max-model-len 72 or more$"):
        check_engine_lengths(e, EngineOptions(max_model_len=71), 64, [40], 32, 9)


# --------------------------------------------------------------------------- score conversion


class _Corpus:
    """A stand-in CorpusReference: two windows over a vocabulary of 5."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.windows = [torch.tensor([1, 2, 3, 4]), torch.tensor([0, 4, 2])]
        self.ref_logprobs = [torch.log_softmax(torch.randn(w.numel() - 1, 5, generator=g), -1) for w in self.windows]
        self.ref_argmax = [lp.argmax(-1) for lp in self.ref_logprobs]
        self.domains = ()  # one text, as CorpusReference over a single corpus

    def logprobs(self, i):
        return self.ref_logprobs[i].clone()


def test_engine_scores_against_the_formulas():
    c = _Corpus()
    g = torch.Generator().manual_seed(1)
    full = [torch.log_softmax(torch.randn(lp.shape, generator=g), -1) for lp in c.ref_logprobs]
    target = [lp[torch.arange(w.numel() - 1), w[1:]].double() for lp, w in zip(full, c.windows)]
    argmax = [lp.argmax(-1) for lp in full]
    s = engine_scores(EngineScores(target, argmax, [], [], full=full), c, "e")
    p, q = torch.cat(c.ref_logprobs).double(), torch.cat(full).double()
    kl = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(s.kl, kl, atol=1e-6)
    assert torch.equal(s.nll, -torch.cat(target))
    assert torch.equal(s.top1, torch.cat(argmax) == torch.cat(c.ref_argmax))
    # without the full distribution: the same NLL and top-1, no KL
    s2 = engine_scores(EngineScores(target, argmax, [], []), c, "e")
    assert torch.equal(s2.nll, s.nll) and torch.equal(s2.top1, s.top1) and torch.isnan(s2.kl).all()
    assert math.isnan(s2.kld)
    # shapes that do not pair are the engine's failure, said in one line
    with pytest.raises(EngineRefused, match="scored 1 windows, the reference 2"):
        engine_scores(EngineScores(target[:1], argmax[:1], [], []), c, "e")
    with pytest.raises(EngineRefused, match="another vocabulary"):
        engine_scores(EngineScores(target, argmax, [], [], full=[lp[:, :4] for lp in full]), c, "e")


def test_a_refused_row_has_no_numbers_and_serialises_to_nulls():
    r = refused_row(row_name("nf4", "llama.cpp"), "nf4 has no GGUF type", runtime="llama.cpp")
    assert r.scheme == "nf4 [llama.cpp]" and r.refused == "nf4 has no GGUF type"
    d = EvalReport([r], {}).to_dict()["rows"][0]
    assert d["perplexity"] is None and d["kld"] is None and d["battery_total"] == 0 and d["runtime"] == "llama.cpp"


# --------------------------------------------------------------------------- the runner with a stand-in engine


class TorchEngine(WorkerEngine):
    """A worker engine that is qkit's own torch code, run in-process on the row's written qkit checkpoint."""

    name = "torch-oracle"
    extra = "none"
    format = "qkit"
    full_distribution = True

    def __init__(self, pad_id: int, full: bool = True, refuse_call: int | None = None):
        self.pad_id, self.full, self.refuse_call = pad_id, full, refuse_call
        self.paths: list[Path] = []
        self.full_distribution = full

    def check_available(self, options):
        pass

    def cannot_run(self, scheme, simulations):
        if simulations:
            return f"torch-oracle does not simulate {'+'.join(simulations)}"
        return "torch-oracle cannot read nf4" if scheme == "nf4" else None

    def export_options(self, simulations):
        return {"format": "qkit"}

    def run(self, path, job, options):
        from qkit.evaluation.agreement import _argmax_next
        from qkit.evaluation.perplexity import position_logprobs
        from qkit.models import load

        self.paths.append(Path(path))
        assert Path(path).exists()  # the row's file exists while the engine runs
        if self.refuse_call == len(self.paths):
            raise EngineRefused("torch-oracle: no kernel for this row")
        t0 = time.perf_counter()
        model = load(path, device="cpu").model
        load_s = time.perf_counter() - t0
        lps = [position_logprobs(model, w) for w in job.windows]
        target = [lp[torch.arange(w.numel() - 1), w[1:]].double() for lp, w in zip(lps, job.windows)]
        ids, mask = _left_pad(job.battery_prompts, self.pad_id)
        from transformers import GenerationConfig

        cfg = GenerationConfig(max_new_tokens=job.battery_tokens, do_sample=False, repetition_penalty=job.repetition_penalty,
                               pad_token_id=self.pad_id, eos_token_id=model.generation_config.eos_token_id)
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1]:]
        a_ids, a_mask = _left_pad(job.agreement_inputs, self.pad_id)
        agree = _argmax_next(model, a_ids, a_mask, slice(-job.agreement_n - 1, -1))
        return EngineScores(target_logprobs=target, argmax=[lp.argmax(-1) for lp in lps],
                            battery_ids=[g.tolist() for g in gen], agreement_argmax=list(agree),
                            full=lps if self.full else None, load_seconds=load_s, run_seconds=0.5,
                            version="oracle 1", notes=["computed by qkit's torch code"])


def _left_pad(seqs, pad):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s)
        mask[i, n - len(s):] = 1
    return ids, mask


@pytest.fixture
def fake_engine(tiny_model_dir):
    from qkit.models import load_tokenizer

    engine = TorchEngine(load_tokenizer(tiny_model_dir).pad_token_id)
    with ENGINES.temporarily(engine.name, engine):
        yield engine
    assert engine.name not in ENGINES  # the registry is as it was


@pytest.fixture
def corpus_file(tmp_path):
    from conftest import TINY_TEXT

    f = tmp_path / "text.txt"
    f.write_text(TINY_TEXT * 3)
    return str(f)


STATS = ("perplexity", "perplexity_se", "perplexity_change_pct", "perplexity_change_se_pct", "kld", "kld_se",
         "top1_match", "battery_correct", "battery_answers", "battery_outputs", "agreement", "agreement_total",
         "bits_per_weight", "size_bytes", "matrices")


@pytest.mark.slow
def test_engine_rows_equal_the_torch_rows_when_the_engine_is_torch(fake_engine, tiny_model_dir, corpus_file, capsys):
    opts = EvalOptions(schemes=("int8-row", "nf4", "w8a8-token"), runtimes=("torch", "torch-oracle"),
                       corpus=corpus_file, **FAST)
    report = evaluate(tiny_model_dir, options=opts)
    names = [r.scheme for r in report.rows]
    assert names == ["reference", "int8-row", "nf4", "w8a8-token", "reference [torch-oracle]",
                     "int8-row [torch-oracle]", "nf4 [torch-oracle]", "w8a8-token [torch-oracle]"]
    rows = {r.scheme: r for r in report.rows}
    for base in ("reference", "int8-row"):
        t, e = rows[base], rows[f"{base} [torch-oracle]"]
        for key in STATS:
            assert getattr(e, key) == getattr(t, key), (base, key)
        assert e.runtime == "torch-oracle" and t.runtime == "torch" and e.refused is None
        assert e.versus_torch["against"] == base
        for key in ("perplexity_change_pct", "kld_change"):
            assert e.versus_torch[key] == 0.0, (base, key)
        assert e.engine["version"] == "oracle 1" and e.engine["full_distribution"] is True
        assert e.engine["load_seconds"] > 0 and e.engine["run_seconds"] == 0.5
        assert e.llama_kl == t.llama_kl or base == "reference"
    # what the engine loaded: the reference's own directory (a safetensors format stores it as is), then the
    # row's checkpoint written in the row's temporary directory (removed after the row)
    assert fake_engine.paths[0] == Path(tiny_model_dir)
    assert fake_engine.paths[1].name == "row" and fake_engine.paths[1].parent.name.startswith("qkit-eval-")
    assert not fake_engine.paths[1].exists()
    # refusals: one line each, no numbers, in the notes; nothing written for them
    assert rows["nf4 [torch-oracle]"].refused == "torch-oracle cannot read nf4"
    assert rows["w8a8-token [torch-oracle]"].refused.startswith("torch-oracle does not simulate act-int8-token")
    assert len(fake_engine.paths) == 2
    assert "nf4 [torch-oracle]: not run: torch-oracle cannot read nf4." in report.notes
    assert any(n.startswith("int8-row [torch-oracle] minus int8-row (torch), paired on the same tokens: perplexity "
                            "+0.00%") and "within two paired SE: the torch row predicts the engine's perplexity; KL +0.0000"
               in n
               for n in report.notes)
    assert not any("collapsed" in n for n in report.notes)  # a refused row's NaNs are not a collapse
    p = report.provenance
    assert p["runtimes"] == ["torch", "torch-oracle"]
    assert p["engines"]["torch-oracle"]["version"] == "oracle 1" and p["engines"]["torch-oracle"]["format"] == "qkit"

    from qkit.cli.eval import render_eval

    capsys.readouterr()
    render_eval(report)
    text = capsys.readouterr().out
    assert "not run (see below)" in text and "engine minus torch" in text


@pytest.mark.slow
def test_engine_rows_without_torch_rows_and_without_the_full_distribution(fake_engine, tiny_model_dir, corpus_file):
    fake_engine.full = fake_engine.full_distribution = False
    opts = EvalOptions(schemes=("int8-row",), runtimes=("torch-oracle",), corpus=corpus_file, **FAST)
    report = evaluate(tiny_model_dir, options=opts)
    assert [r.scheme for r in report.rows] == ["reference", "reference [torch-oracle]", "int8-row [torch-oracle]"]
    ref, eref, e = report.rows
    assert math.isnan(e.kld) and math.isnan(eref.kld) and e.top1_match > 0.5 and eref.top1_match == 1.0
    assert eref.perplexity == ref.perplexity and eref.versus_torch["perplexity_change_pct"] == 0.0
    assert "kld_change" not in eref.versus_torch and not e.versus_torch  # no torch int8-row row to pair with
    assert e.engine["full_distribution"] is False and e.llama_kl == {}
    assert report.provenance["runtimes"] == ["torch-oracle"]
    assert any("KL needs the full distribution" in n for n in report.notes)


@pytest.mark.slow
def test_an_engine_refusal_while_running_is_a_row_not_a_crash(fake_engine, tiny_model_dir, corpus_file):
    fake_engine.refuse_call = 2  # the second run: the first quantized row
    opts = EvalOptions(schemes=("int8-row", "int4-tensor"), runtimes=("torch-oracle",), corpus=corpus_file, **FAST)
    report = evaluate(tiny_model_dir, options=opts)
    rows = {r.scheme: r for r in report.rows}
    assert rows["int8-row [torch-oracle]"].refused == "torch-oracle: no kernel for this row"
    assert rows["int4-tensor [torch-oracle]"].refused is None and math.isfinite(rows["int4-tensor [torch-oracle]"].kld)


def test_torch_is_an_engine_registered_first():
    torch_engine = get_engine("torch")
    assert isinstance(torch_engine, QkitTorchEngine) and get_engine(" TORCH ") is torch_engine
    assert runtime_names()[0] == "torch" and set(runtime_names()) >= {"torch", "vllm", "llama.cpp"}
    assert (torch_engine.format, torch_engine.full_distribution) == ("qkit", True)
    # it runs every scheme and every simulation; its rows are qkit checkpoints in small shards
    assert torch_engine.cannot_run("nf4", ("act-int8-static", "kv-int4-channel")) is None
    assert torch_engine.export_options(())["format"] == "qkit"


def test_a_stand_in_is_registered_only_for_its_block():
    stand_in = TorchEngine(0)
    with pytest.raises(ZeroDivisionError):
        with ENGINES.temporarily(stand_in.name, stand_in):
            assert get_engine("torch-oracle") is stand_in and "torch-oracle" in runtime_names()
            1 / 0
    assert "torch-oracle" not in ENGINES and "torch-oracle" not in runtime_names()
    with pytest.raises(ValueError, match="registered already"):  # never shadows a real engine
        with ENGINES.temporarily("llama.cpp", stand_in):
            pass
    assert get_engine("llama.cpp") is not stand_in


def test_an_unknown_runtime_lists_every_runtime_torch_included():
    with pytest.raises(InputError) as e:
        EvalOptions(runtimes=("troch",)).resolve()
    assert str(e.value) == "unknown runtime 'troch'; did you mean torch? use one of: torch, vllm, llama.cpp"
