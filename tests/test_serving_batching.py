"""qkit simulate batching: a hand-checked five-request example, an independent step-by-step oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.serving.batching import (
    StepCost,
    constant_cost,
    cost_from_bench,
    draw_lengths,
    simulate_batching,
    simulate_continuous,
    simulate_static,
)


def test_five_requests_by_hand():
    # lengths 5 1 3 2 4, two slots, one time unit per step.
    # static:     [5,1] ends at 5, [3,2] at 5+3 = 8, [4] at 8+4 = 12.
    # continuous: r1 ends at 1; r2 joins, ends at 1+3 = 4; r3 joins, r0 ends at 5; r4 joins,
    #             r3 ends at 4+2 = 6; r4 ends at 5+4 = 9.
    r = simulate_batching(lengths=[5, 1, 3, 2, 4], slots=2)
    assert r.static.latencies == [5, 5, 8, 8, 12]
    assert r.continuous.latencies == [5, 1, 4, 6, 9]
    assert (r.static.makespan, r.continuous.makespan) == (12, 9)
    assert r.static.throughput == 15 / 12 and r.continuous.throughput == 15 / 9
    assert r.static.mean_latency == 7.6 and r.continuous.mean_latency == 5.0
    assert r.static.p95_latency == pytest.approx(8 + 0.8 * 4)  # linear interpolation at rank 3.8
    assert r.continuous.p95_latency == pytest.approx(6 + 0.8 * 3)
    assert r.throughput_ratio == pytest.approx(12 / 9)
    assert r.static.utilisation == 15 / (2 * 12) and r.continuous.utilisation == 15 / 18


def test_batch_dependent_cost_by_hand():
    cost = StepCost((1, 2), (1.0, 1.5), "s", "test")
    # continuous: 1 step of 2 busy (1.5) -> r1 ends 1.5; 3 steps of 2 busy (4.5) -> r2 ends 6;
    # r0 (1 left) and r3: 1 step (1.5) -> r0 ends 7.5; r3 (1 left) and r4: 1 step -> r3 ends 9;
    # r4 alone, 3 steps of 1 busy -> ends 12.
    assert simulate_continuous([5, 1, 3, 2, 4], 2, cost).latencies == [7.5, 1.5, 6.0, 9.0, 12.0]
    # static: 5 steps at 1.5, 3 at 1.5, 4 at 1.0 (the last batch has one request)
    assert simulate_static([5, 1, 3, 2, 4], 2, cost).latencies == [7.5, 7.5, 12.0, 12.0, 16.0]


def _continuous_step_by_step(lengths, slots, cost):
    """Independent oracle: one loop iteration per decode step."""
    remaining, owner, finish, t, nxt = [0] * slots, [-1] * slots, [0.0] * len(lengths), 0.0, 0
    while True:
        for s in range(slots):
            if owner[s] < 0 and nxt < len(lengths):
                owner[s], remaining[s], nxt = nxt, lengths[nxt], nxt + 1
        busy = [s for s in range(slots) if owner[s] >= 0]
        if not busy:
            return finish
        t += cost(len(busy))
        for s in busy:
            remaining[s] -= 1
            if remaining[s] == 0:
                finish[owner[s]], owner[s] = t, -1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=25), st.integers(1, 6))
def test_continuous_matches_step_by_step_oracle(lengths, slots):
    cost = StepCost((1, 4), (1.0, 2.5), "s", "test")
    got = simulate_continuous(lengths, slots, cost).latencies
    assert got == pytest.approx(_continuous_step_by_step(lengths, slots, cost))
    # with a constant step cost, continuous never finishes later than static
    assert simulate_continuous(lengths, slots, StepCost()).makespan <= simulate_static(lengths, slots, StepCost()).makespan


def test_enough_slots():
    r = simulate_batching(lengths=[3, 7, 2], slots=8)
    assert r.continuous.latencies == [3, 7, 2] and r.static.latencies == [7, 7, 7]


def test_lengths_seeded_and_skewed():
    a, b = draw_lengths(64, 0), draw_lengths(64, 0)
    assert a == b and a != draw_lengths(64, 1)
    assert np.mean(a) > np.median(a) and min(a) >= 1
    r = simulate_batching(requests=64, slots=8, seed=0)
    assert r.requests == 64 and r.throughput_ratio > 1 and r.seed == 0


def test_step_cost_from_bench(tmp_path):
    rows = [{"batch": b, "step_seconds": {"median": m}} for b, m in ((1, 0.010), (2, 0.012), (4, 0.016))]
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"batching": {"rows": rows}}))
    c = cost_from_bench(p)
    assert c(1) == 0.010 and c(3) == pytest.approx(0.014) and c(8) == pytest.approx(0.032)
    assert constant_cost(0.02)(7) == 0.02
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(InputError, match="batching table"):
        cost_from_bench(bad)


def test_bad_inputs(tmp_path):
    with pytest.raises(InputError, match="slots"):
        simulate_batching(slots=0)
    with pytest.raises(InputError, match="positive integers"):
        simulate_batching(lengths=[3, 0])
    f = tmp_path / "l.txt"
    f.write_text("3\nx\n")
    with pytest.raises(InputError, match="integer output lengths"):
        simulate_batching(lengths_file=f)


def test_cli(tmp_path):
    f = tmp_path / "lengths.txt"
    f.write_text("5\n1\n3\n2\n4\n")
    runner = CliRunner()
    res = runner.invoke(app, ["simulate", "batching", "--lengths", str(f), "--slots", "2", "--step-ms", "10", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{"):])
    assert data["static"]["makespan"] == pytest.approx(0.12) and data["continuous"]["makespan"] == pytest.approx(0.09)
    res = runner.invoke(app, ["simulate", "batching", "--step-ms", "1", "--bench", "x.json"])
    assert res.exit_code == 2 and "not both" in res.output
