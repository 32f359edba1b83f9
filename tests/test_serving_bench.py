"""qkit bench: the analytic MAC model against torch's FLOP counter, the knee rule, a tiny-model smoke run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.serving.bench import BenchConfig, MacCounts, _Runner, bench, find_knee, mac_counts

MINIMAL = BenchConfig(gen_tokens=(3,), prompt_tokens=4, prefill_tokens=(4, 8), decode_cache=(4, 8), batch_sizes=(1, 2),
                      batch_cache=4, repeats=2, warmup=0)


@pytest.fixture(scope="module")
def eager_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    # Eager attention: its matmuls are visible to the FLOP counter (CPU SDPA has no FLOP formula).
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager").eval()


@pytest.mark.parametrize(("past", "new"), [(0, 7), (0, 1), (5, 1), (5, 3)])
def test_forward_macs_equal_flop_counter(eager_tiny, past, new):
    macs = mac_counts(eager_tiny)
    assert macs.block_params == 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 160)  # q,o + k,v + gate,up,down
    run = _Runner(eager_tiny, torch.device("cpu"))
    with torch.inference_mode():
        cache = run.forward(run.ids(1, past))[1] if past else None
        ids = run.ids(1, new, seed=1)
        with FlopCounterMode(display=False) as fc:
            run.forward(ids, cache)
    assert fc.get_total_flops() == 2 * macs.forward(past, new)


def test_generation_macs_by_hand():
    m = MacCounts(block_params=100, layers=1, heads=1, head_dim=1, hidden=2, vocab=3)
    # forward(past, new) = 100 new + 2 new (past + new) + 6
    assert m.forward(0, 2) == 200 + 8 + 6
    assert m.generate_cached(2, 3) == m.forward(0, 2) + m.forward(2, 1) + m.forward(3, 1) == 214 + 112 + 114
    assert m.generate_uncached(2, 3) == m.forward(0, 2) + m.forward(0, 3) + m.forward(0, 4) == 214 + 324 + 438


def test_knee():
    rows = [{"batch": b, "tokens_per_second": t} for b, t in ((1, 10), (2, 19), (4, 30), (8, 32), (16, 40))]
    assert find_knee(rows, 1.10) == 4  # 4 -> 8 gains only 7%
    assert find_knee(rows[:3], 1.10) is None


def test_bench_smoke_tiny(tiny_model_dir):
    before = torch.get_num_threads()
    r = bench(config=str(tiny_model_dir / "config.json"), settings=MINIMAL, device="cpu", threads=1)
    assert r.threads == 1 and torch.get_num_threads() == before  # set for the run, then restored
    g = r.generation[0]
    assert g["same_tokens"] and g["tokens"] == 3 and len(g["with_cache"]["samples"]) == 2
    assert g["macs_without_cache"] > g["macs_with_cache"] > 0
    assert [p["tokens"] for p in r.prefill] == [4, 8] and [d["cache_tokens"] for d in r.decode] == [4, 8]
    assert [b["batch"] for b in r.batching["rows"]] == [1, 2]
    assert all(b["step_seconds"]["median"] > 0 for b in r.batching["rows"])
    json.dumps(r.to_dict())
    with pytest.raises(InputError, match="either MODEL or --config"):
        bench(model="x", config="y")
    with pytest.raises(InputError, match="threads"):
        bench(config="y", threads=0)


def test_cli_quick_tiny(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(BenchConfig, "quick", classmethod(lambda cls: MINIMAL))  # minimal sizes, same code path
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", str(tiny_model_dir), "--quick", "--repeats", "1", "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [g["tokens"] for g in data["generation"]] == [3] and all(g["same_tokens"] for g in data["generation"])
    assert data["config"]["repeats"] == 1 and len(data["generation"][0]["with_cache"]["samples"]) == 1
    res = CliRunner().invoke(app, ["simulate", "batching", "--requests", "10", "--slots", "4", "--bench", str(out)])
    assert res.exit_code == 0 and "measured by qkit bench" in res.output
