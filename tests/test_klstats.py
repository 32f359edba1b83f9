"""llama.cpp's KL-divergence statistics (qkit.evaluation.klstats): hand-computed golden values, the percentile
index rule, SEs, None for what is undefined, permutation invariance; and, against ``llama-perplexity
--kl-divergence`` on the default model, every printed statistic from llama.cpp's own per-token values
(exact up to the printed digits) and from two of its ``--kl-divergence-base`` files (rigorous bounds)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import benchmark_module
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qkit.cli import app
from qkit.errors import InputError
from qkit.evaluation.klstats import (
    KEYS,
    LINES,
    format_llama_kl_stats,
    llama_kl_stats,
    llama_median,
    llama_percentile,
)
from qkit.evaluation.token_scores import TokenScores

runner = CliRunner()


def scores(nll, kl=None, top1=None) -> TokenScores:
    nll = torch.as_tensor(np.asarray(nll, dtype=np.float64))
    kl = torch.zeros_like(nll) if kl is None else torch.as_tensor(np.asarray(kl, dtype=np.float64))
    top1 = torch.ones(nll.numel(), dtype=torch.bool) if top1 is None else torch.as_tensor(np.asarray(top1, dtype=bool))
    return TokenScores(nll, kl, top1)


# float32 values of llama.cpp's percentile literals, exactly (0.999f is 0x3F7FBE77, ...): the position
# p = fraction * (n - 1) is formed in float32; for n = 5, times 4 is exact
F999, F99, F95, F90 = 0.999000012874603271484375, 0.9900000095367431640625, 0.949999988079071044921875, 0.89999997615814208984375
F10, F05, F01, F001 = 0.100000001490116119384765625, 0.0500000007450580596923828125, 0.00999999977648258209228515625, 0.001000000047497451305389404296875

# --------------------------------------------------------------------------- golden: five positions

P_REF = [0.5, 0.25, 0.8, 0.1, 0.4]   # the reference's probability of each right token
P_ROW = [0.6, 0.25, 0.7, 0.3, 0.2]   # the row's: Δp = +10, 0, -10, +20, -20 percent
KL5 = [0.5, -0.1, 0.4, 0.2, 0.3]     # one negative KL, as llama.cpp can have: not clamped
TOP5 = [True, True, False, True, False]


def five() -> dict:
    return llama_kl_stats(scores(-np.log(P_ROW), KL5, TOP5), scores(-np.log(P_REF)))


def test_five_positions_golden_values():
    s = five()
    assert s["n"] == 5
    # sorted KL: -0.1, 0.2, 0.3, 0.4, 0.5; p = F * 4, interpolating v[floor(p)] .. v[floor(p) + 1]
    expect_kld = {
        "kld_mean": 1.3 / 5, "kld_max": 0.5, "kld_min": -0.1, "kld_median": 0.3,
        "kld_p99_9": 0.4 + 0.1 * (4 * F999 - 3), "kld_p99": 0.4 + 0.1 * (4 * F99 - 3),
        "kld_p95": 0.4 + 0.1 * (4 * F95 - 3), "kld_p90": 0.4 + 0.1 * (4 * F90 - 3),
        "kld_p10": -0.1 + 0.3 * (4 * F10), "kld_p5": -0.1 + 0.3 * (4 * F05),
        "kld_p1": -0.1 + 0.3 * (4 * F01), "kld_p0_1": -0.1 + 0.3 * (4 * F001),
    }
    # sorted Δp (percent): -20, -10, 0, 10, 20
    expect_dp = {
        "dp_mean": 0.0, "dp_max": 20.0, "dp_min": -20.0, "dp_median": 0.0, "dp_p75": 10.0, "dp_p25": -10.0,
        "dp_p99_9": 10 + 10 * (4 * F999 - 3), "dp_p99": 10 + 10 * (4 * F99 - 3), "dp_p95": 10 + 10 * (4 * F95 - 3),
        "dp_p90": 10 + 10 * (4 * F90 - 3), "dp_p10": -20 + 10 * (4 * F10), "dp_p5": -20 + 10 * (4 * F05),
        "dp_p1": -20 + 10 * (4 * F01), "dp_p0_1": -20 + 10 * (4 * F001),
        "dp_rms": 100 * math.sqrt((0.01 + 0 + 0.01 + 0.04 + 0.04) / 5),  # sqrt(0.02) = 14.142 %
    }
    expect_ppl = {
        "ppl": (0.6 * 0.25 * 0.7 * 0.3 * 0.2) ** -0.2,       # 0.0063 ** -1/5 = 2.7551
        "ppl_base": (0.5 * 0.25 * 0.8 * 0.1 * 0.4) ** -0.2,  # 0.004 ** -1/5 = 3.0171
        "ln_ppl_ratio": -0.2 * math.log(0.0063 / 0.004), "ppl_ratio": (0.0063 / 0.004) ** -0.2,
        "ppl_diff": 0.0063 ** -0.2 - 0.004 ** -0.2,
        "same_top_p": 60.0, "same_top_p_se": 100 * math.sqrt(0.6 * 0.4 / 4),  # binomial, n - 1: 24.49 %
    }
    for key, value in {**expect_kld, **expect_dp, **expect_ppl}.items():
        assert s[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    # the float32 position is visible: 99.9 % of the Δp is not 10 + 10 * 0.996
    assert abs(s["dp_p99_9"] - 19.96) > 4e-7
    # five positions: llama.cpp gives no SE below 11 (it prints 0 there); here None, never NaN
    for key in ("ppl_se", "ppl_base_se", "ln_ppl_cor", "ln_ppl_ratio_se", "ppl_ratio_se", "ppl_diff_se",
                "kld_mean_se", "dp_mean_se", "dp_rms_se"):
        assert s[key] is None, key
    assert list(s) == list(KEYS)


def test_twelve_positions_standard_errors():
    """SE = sqrt(population variance / (n - 1)) once n > 10, worked by hand on two-valued data."""
    n = 12
    p_row = [0.25] * 6 + [1.0] * 6           # nll = ln 4 or 0: mean ln 2, deviations +-ln 2
    p_ref = [0.5] * n                        # constant: SE 0, and the correlation divides by it
    kl = [0.0] * 6 + [1.0] * 6
    top = [True] * 9 + [False] * 3
    s = llama_kl_stats(scores(-np.log(p_row), kl, top), scores(-np.log(p_ref)))
    r11 = math.sqrt(11)
    ln2 = math.log(2)
    rms = math.sqrt((6 * 0.25 ** 2 + 6 * 0.5 ** 2) / n)  # Δp = -0.25 or +0.5: dp^2 = 1/16 or 1/4
    expect = {
        "ppl": 2.0, "ppl_se": 2 * ln2 / r11, "ppl_base": 2.0, "ppl_base_se": 0.0,
        "ln_ppl_ratio": 0.0, "ln_ppl_ratio_se": ln2 / r11, "ppl_ratio": 1.0, "ppl_ratio_se": ln2 / r11,
        "ppl_diff": 0.0, "ppl_diff_se": 2 * ln2 / r11,
        "kld_mean": 0.5, "kld_mean_se": 0.5 / r11, "kld_median": 0.5, "kld_p99_9": 1.0, "kld_p90": 1.0,
        "kld_p10": 0.0, "kld_p0_1": 0.0,
        "dp_mean": 12.5, "dp_mean_se": 100 * 0.375 / r11,       # deviations +-0.375
        "dp_rms": 100 * rms, "dp_rms_se": 100 * 0.5 / rms * 0.09375 / r11,  # dp^2 deviations +-0.09375
        "same_top_p": 75.0, "same_top_p_se": 100 * math.sqrt(0.75 * 0.25 / 11),
    }
    for key, value in expect.items():
        assert s[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert s["ln_ppl_cor"] is None  # cov / (SE * 0): undefined, not NaN


def test_percentile_index_rule_on_a_known_vector():
    v = np.arange(4.0)  # on 0, 1, ..., n-1 the percentile is the position p itself
    # 0.1f = 13421773 * 2^-27; times 3 needs 26 bits and rounds (float32) to 10066330 * 2^-25
    assert llama_percentile(v, 0.1) == 0.300000011920928955078125 != 0.1 * 3
    assert llama_percentile(np.arange(1001.0), 0.999) == 999.0  # 0.999f * 1000 = 999.0000129 rounds to 999
    w = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    assert llama_percentile(w, 0.5) == 6.0  # p = 2.5: halfway between 4 and 8
    assert llama_percentile(w, 0.0) == 1.0 and llama_percentile(w, 1.0) == 32.0
    assert llama_median(w) == 6.0 and llama_median(w[:5]) == 4.0


def test_delta_p_sign_and_units():
    """Δp is the row's probability of the right token minus the reference's, in percentage points."""
    s = llama_kl_stats(scores(-np.log([0.6, 0.6])), scores(-np.log([0.5, 0.5])))
    assert s["dp_mean"] == pytest.approx(10.0) and s["dp_min"] == pytest.approx(10.0)
    s = llama_kl_stats(scores(-np.log([0.5, 0.5])), scores(-np.log([0.6, 0.6])))
    assert s["dp_max"] == pytest.approx(-10.0) and s["dp_rms"] == pytest.approx(10.0)


def test_undefined_values_are_none():
    one = llama_kl_stats(scores([1.0], [0.2], [True]), scores([1.0]))
    assert one["same_top_p_se"] is None and one["kld_mean"] == 0.2 and one["kld_p99_9"] == 0.2
    same = llama_kl_stats(scores(np.full(20, 2.0)), scores(np.full(20, 2.0)))
    assert same["dp_rms"] == 0.0 and same["dp_rms_se"] is None  # 0.5 / 0 * 0 in llama.cpp: NaN
    assert same["ln_ppl_cor"] is None and same["ppl_se"] == 0.0 and same["same_top_p_se"] == 0.0
    assert not any(isinstance(v, float) and math.isnan(v) for v in same.values())
    assert "nan" in "\n".join(format_llama_kl_stats(same))  # None prints as C's printf prints NaN


def test_refusals():
    with pytest.raises(InputError, match="same positions"):
        llama_kl_stats(scores([1.0, 2.0, 3.0]), scores([1.0, 2.0]))
    with pytest.raises(InputError, match="at least one"):
        llama_kl_stats(scores([]), scores([]))
    with pytest.raises(InputError, match="llama_kl_stats"):
        format_llama_kl_stats({"n": 3})


def test_format_lines_are_llama_perplexitys():
    lines = format_llama_kl_stats(five())
    assert len(lines) == 39
    assert lines[0] == "====== Perplexity statistics ======"
    assert lines[1] == "Mean PPL(Q)                   :   2.755065 ±        nan"
    assert lines[3] == "Cor(ln(PPL(Q)), ln(PPL(base))):    nan%"
    assert lines[7] == "" and lines[8] == "====== KL divergence statistics ======"
    assert lines[9] == "Mean    KLD:   0.260000 ±        nan"
    assert lines[11] == "99.9%   KLD:   0.499600"
    assert lines[15] == "Median  KLD:   0.300000"
    assert lines[17] == " 5.0%   KLD:  -0.040000"
    assert lines[20] == "Minimum KLD:  -0.100000"
    assert lines[22] == "====== Token probability statistics ======"
    assert re.fullmatch(r"Mean    Δp: [ -]0\.000 ±   nan %", lines[23])  # the mean is 0 up to a rounding residue
    assert lines[24] == "Maximum Δp: 20.000%"
    assert lines[29] == "75.0%   Δp: 10.000%"
    assert lines[32] == "10.0%   Δp: -16.000%"
    assert lines[37] == "RMS Δp    : 14.142 ±   nan %"
    assert lines[38] == "Same top p: 60.000 ± 24.495 %"


def test_the_benchmarks_parser_reads_the_lines_back():
    b = benchmark_module("bench_llama_cpp")
    s = llama_kl_stats(scores(np.linspace(1, 4, 30), np.linspace(0, 1, 30) ** 2, np.arange(30) % 3 > 0),
                       scores(np.linspace(1.5, 3, 30)))
    back = b.parse_kl_stats("noise before\n" + "\n".join(format_llama_kl_stats(s)) + "\nllama_perf: after\n")
    assert set(back) == set(KEYS) - {"n"}
    for k, v in back.items():
        decimals = 2 if k == "ln_ppl_cor" else 3 if k.startswith(("dp_", "same_top")) else 6
        assert v == pytest.approx(s[k], abs=0.51 * 10 ** -decimals), k


# --------------------------------------------------------------------------- properties


def _random_scores(seed: int, n: int, degenerate: str):
    rng = np.random.default_rng(seed)
    base = rng.exponential(2.0, n)
    nll = {"none": rng.exponential(2.0, n), "equal": base.copy(), "constant": np.full(n, 1.5)}[degenerate]
    kl = {"none": rng.exponential(0.1, n) - 0.01, "equal": np.zeros(n), "constant": np.full(n, 0.3)}[degenerate]
    return nll, base, kl, rng.random(n) < 0.7


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 2**31), st.integers(2, 40), st.sampled_from(["none", "equal", "constant"]), st.data())
def test_permuting_positions_changes_no_statistic(seed, n, degenerate, data):
    nll, base, kl, top = _random_scores(seed, n, degenerate)
    perm = np.array(data.draw(st.permutations(range(n))))
    a = llama_kl_stats(scores(nll, kl, top), scores(base))
    b = llama_kl_stats(scores(nll[perm], kl[perm], top[perm]), scores(base[perm]))
    assert list(a) == list(b) == list(KEYS)
    for k in KEYS:
        assert not (isinstance(a[k], float) and math.isnan(a[k])), k  # n >= 2: never NaN
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, k
        else:  # sums in another order: rounding only
            assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-9), k


# --------------------------------------------------------------------------- against llama-perplexity

CTX, CHUNKS, THREADS = 128, 4, 2  # 4 chunks of 128: 4 * 63 = 252 positions (llama.cpp prints from 100)


def _decimals() -> dict[str, int]:
    """Digits after the point of each key as llama-perplexity prints it (from the printf formats)."""
    out = {}
    for line in LINES:
        if len(line) == 4:
            digits = [int(d) for d in re.findall(r"%\d+\.(\d+)f", line[3])]
            for k, d in zip(line[:2], digits):
                if k:
                    out[k] = d
    return out


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, default_model_dir):
    """The default model as llama.cpp's F32 GGUF and as qkit's q4_0 GGUF; llama-perplexity's
    --kl-divergence-base of both (-c 128, 4 chunks, -t 2) on the eval corpus; its --kl-divergence of the
    q4_0 file against the F32 base file, unmodified and (when it builds) with the per-token dump."""
    import time

    blr = benchmark_module("build_llama_ref")
    if not blr.tool_path("llama-perplexity").exists():
        pytest.skip("llama.cpp tools not built: python benchmarks/build_llama_ref.py --tools")
    b = benchmark_module("bench_llama_cpp")
    from qkit.texts import load_corpus

    work = tmp_path_factory.mktemp("klstats")
    seconds = {}
    t = time.perf_counter()
    f32, q = work / "f32.gguf", work / "q4_0.gguf"
    b.convert_f32(default_model_dir, f32, work)
    seconds["convert_f32"] = time.perf_counter() - t
    t = time.perf_counter()
    r = runner.invoke(app, ["quantize", str(default_model_dir), "-s", "q4_0", "--format", "gguf", "-o", str(q)])
    assert r.exit_code == 0, r.output
    seconds["qkit_quantize"] = time.perf_counter() - t
    text = work / "corpus.txt"
    text.write_text(load_corpus(None).text)
    runs = {}
    for name, model in (("base", f32), ("qbase", q)):
        runs[name] = b.llama_kld_base(model, text, CTX, THREADS, work / f"{name}.kld", CHUNKS)
        assert "error" not in runs[name], runs[name]
        seconds[f"kld_base_{name}"] = runs[name]["seconds"]
    kl = b.llama_kl_divergence(q, work / "base.kld", THREADS)
    assert "error" not in kl and kl["chunks"] == CHUNKS, kl
    seconds["kl_divergence"] = kl["seconds"]
    dump, dump_kl, why = None, None, ""
    t = time.perf_counter()
    try:
        tool = b.build_kld_dump_tool()
    except SystemExit as e:  # no compiler, or llama.cpp moved: the exact test says why it skips
        why = str(e).splitlines()[0]
    else:
        seconds["build_dump_tool"] = time.perf_counter() - t
        dump_kl = b.llama_kl_divergence(q, work / "base.kld", THREADS, tool=tool, dump=work / "dump.bin")
        assert "error" not in dump_kl, dump_kl
        seconds["kl_divergence_dump"] = dump_kl["seconds"]
        dump = b.read_kld_dump(work / "dump.bin")
    base, qbase = b.KldBase(work / "base.kld"), b.KldBase(work / "qbase.kld")
    yield SimpleNamespace(kl=kl, dump=dump, dump_kl=dump_kl, why=why, base=base, qbase=qbase, seconds=seconds,
                          rec=b.kl_from_kld_bases(base, qbase))
    print("\nllama-perplexity KL test timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    for f in (f32, q):
        f.unlink(missing_ok=True)


def _mask(line: str) -> str:
    return re.sub(r"[-+]?(?:nan|inf|\d+\.\d+)", "#", line)


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_statistics_equal_llama_perplexitys_on_its_own_per_token_values(llama_run):
    """Every statistic of the final blocks, from llama.cpp's own per-token values, equals what it prints.

    llama.cpp computes the quantized side from its float logits, which it never writes; so
    ``build_kld_dump_tool`` rebuilds llama-perplexity from perplexity.cpp with only stores added: per
    position the ``nll``, ``nll_base``, ``kld`` (the double sum) and ``p_diff`` its ``log_softmax`` computes,
    and whether the top tokens agree. The rebuilt binary prints byte for byte what the unmodified one
    prints (checked here), so these are the values behind the printed statistics. Fed to
    ``llama_kl_stats`` as TokenScores (row: nll, kld, same_top; reference: nll_base) every statistic
    agrees to the printed digits: within half a unit of the last printed digit, plus what llama.cpp's own
    float32 arithmetic can move (it keeps per-token KLD and Δp as float32 for the order statistics and
    interpolates in float32: 3 half-ulps, ``3 * 2^-24 * |v|``; its Δp is ``expf`` of float NLLs where
    this is float64 ``exp``: ``2^-22``, in percent ``100 * 2^-22``; its variances are one-pass sums with
    float products ``nll*nll``: 1e-6 relative on SEs and the correlation; means and counts: 1e-9).
    The layout (labels, order, units, blank lines) is compared line by line with the numbers masked.
    What it proves: the definitions (percentile index, median, SE with n - 1, covariance and correlation,
    ln-ratio and difference SEs, RMS Δp SE, binomial SE, Δp sign and percent units) are llama.cpp's.
    Also: ``KldBase`` decodes llama.cpp's base NLL bit for bit, and the two-file reconstruction's per-token
    bounds (next test) hold against llama.cpp's true per-token values."""
    run = llama_run
    if run.dump is None:
        pytest.skip(f"the per-token dump build of llama-perplexity failed: {run.why}")
    assert run.dump_kl["lines"] == run.kl["lines"] and run.dump_kl["chunk_lines"] == run.kl["chunk_lines"]
    d = run.dump
    assert d.size == run.base.positions == CHUNKS * (CTX - 1 - CTX // 2)
    assert np.array_equal(run.base.nll(), d["nll_base"])  # the decoder reads what llama.cpp reads, exactly

    row = scores(d["nll"].astype(np.float64), d["kld"], d["same_top"] != 0)
    ours = llama_kl_stats(row, scores(d["nll_base"].astype(np.float64)))
    printed = run.kl["stats"]
    assert set(printed) == set(KEYS) - {"n"}, sorted(set(KEYS) - set(printed))
    decimals = _decimals()
    order = {k for k in KEYS if re.match(r"(kld|dp)_(max|min|median|p\d)", k)}
    sums = {"ppl", "ppl_base", "ln_ppl_ratio", "ppl_ratio", "ppl_diff", "kld_mean", "same_top_p"}
    bad = []
    for k, v in printed.items():
        slack = (3 * 2.0**-24 * abs(ours[k]) if k in order else 1e-9 * abs(ours[k]) if k in sums
                 else 1e-6 * abs(ours[k]))
        if k.startswith("dp_"):
            slack += 100 * 2.0**-22
        if abs(ours[k] - v) > 0.5 * 10.0 ** -decimals[k] + slack:
            bad.append((k, ours[k], v))
    assert not bad, bad
    lines = format_llama_kl_stats(ours)
    assert [_mask(x) for x in lines] == [_mask(x) for x in run.kl["lines"]]
    same = sum(a == b for a, b in zip(lines, run.kl["lines"]))
    print(f"\n{same} of {len(lines)} lines byte-identical to llama-perplexity's")

    # the premises of the two-file bounds, per token, against llama.cpp's own values
    rec, delta = run.rec, float(run.qbase.scale.max()) / 2 + 1e-5
    assert np.abs(rec["nll"] - d["nll"]).max() <= delta
    assert np.abs(rec["p_diff"] - d["p_diff"]).max() <= delta + 2.0**-22
    assert (d["kld"] >= rec["kld"] - delta).all()
    assert np.array_equal(rec["same_top"], d["same_top"] != 0)


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_statistics_from_two_base_files_bound_llama_perplexitys(llama_run):
    """The statistics from two unmodified ``--kl-divergence-base`` files (F32 and q4_0), decoded from their
    16-bit storage and combined per position as ``kl_divergence()`` does (``kl_from_kld_bases``), against
    what ``--kl-divergence`` of the q4_0 model on the F32 file prints, within bounds derived here.

    The base side is the same 16-bit values llama.cpp reads. The quantized side differs: llama.cpp uses its
    float logits, here the q4_0 file's 16-bit log-probabilities, off by at most half a step, ``s/2 <= 16 /
    65535 / 2 = 1.2e-4`` nats, for every token above the file's floor (16 nats under the top logit), plus
    float32 rounding (< 1e-5 nats). So per position ``|nll - nll_llama| <= delta`` when the right token is
    above the floor (asserted: none is below), ``|Δp| <= delta + 2^-22`` (exp is 1-Lipschitz on nll >= 0),
    and the top tokens agree exactly when the q4_0 file's top code is unique (asserted). From these,
    rigorous bounds per statistic: means and order statistics move by at most the per-token bound, an SE by
    it over sqrt(n - 1), exp() relatively by e^delta - 1, and products and quotients by the propagated
    terms below. The KL is different: a q4_0 token under its file's floor reads as the floor, so the true
    term ``p (ln p - ln q)`` can only be larger, by an amount the file cannot bound (measured: up to 0.01
    nats on one position). KLD statistics are therefore checked one-sided: llama.cpp's mean and order
    statistics are at least ours minus delta, and the mean from above under one stated assumption (below);
    the test above checks them exactly. What it proves, with llama.cpp's unmodified tools: the perplexity,
    Δp and same-top statistics and their SEs to about 1e-4 relative, and (with that assumption) that the
    KLD is KL(base || Q) in nats over base log-probabilities above -16."""
    run = llama_run
    rec, q = run.rec, run.qbase
    rows = np.arange(q.positions)
    assert (q.codes[rows, q.targets] > 0).all(), "a right token under the q4_0 file's floor: its nll is unbounded"
    top = q.codes.max(axis=1, keepdims=True)
    assert ((q.codes == top).sum(axis=1) == 1).all(), "tied top codes in the q4_0 file: argmax may differ"

    n = q.positions
    r = 1 / math.sqrt(n - 1)
    delta = float(q.scale.max()) / 2 + 1e-5  # nats, per token, on nll
    dpd = delta + 2.0**-22                  # on Δp (probability)
    e = math.expm1(delta)
    row = scores(rec["nll"], rec["kld"], rec["same_top"])
    ours = llama_kl_stats(row, scores(rec["nll_base"]))
    se_nll = float(np.std(rec["nll"]) * r)
    se_d = float(np.std(rec["nll"] - rec["nll_base"]) * r)
    dp2 = (rec["p_diff"]) ** 2
    se_dp2, rms = float(np.std(dp2) * r), math.sqrt(float(dp2.mean()))
    ppl, se_hi = ours["ppl"], se_nll + delta * r
    bound = {
        "ppl": ppl * e, "ppl_se": ppl * e * se_hi + ppl * delta * r,
        "ppl_base": 0.0, "ppl_base_se": 0.0,
        "ln_ppl_ratio": delta, "ln_ppl_ratio_se": delta * r,
        "ppl_ratio": ours["ppl_ratio"] * e, "ppl_ratio_se": ours["ppl_ratio"] * (e * (se_d + delta * r) + delta * r),
        "ppl_diff": ppl * e, "ppl_diff_se": ppl * (1 + e) * delta * r + ppl * e * se_nll,
        "ln_ppl_cor": 100 * delta * r / (se_nll - delta * r) * (1 + abs(ours["ln_ppl_cor"]) / 100),
        "dp_mean": 100 * dpd, "dp_mean_se": 100 * dpd * r, "dp_rms": 100 * dpd,
        "dp_rms_se": 100 * (dpd * r / (rms - dpd) + se_dp2 / 2 * dpd / ((rms - dpd) * rms)),
        "same_top_p": 0.0, "same_top_p_se": 0.0,
    }
    bound.update({k: 100 * dpd for k in KEYS if re.match(r"dp_(max|min|median|p\d)", k)})
    printed, decimals = run.kl["stats"], _decimals()
    bad, kld_keys = [], [k for k in KEYS if re.match(r"kld_(mean|max|min|median|p\d)", k) and k != "kld_mean_se"]
    for k, b in bound.items():
        # + half a printed unit; + llama.cpp's float32 (1e-6 relative; 100 * 2^-22 on Δp in percent)
        tol = b + 0.5 * 10.0 ** -decimals[k] + 1e-6 * abs(ours[k]) + (100 * 2.0**-22 if k.startswith("dp_") else 0)
        if abs(ours[k] - printed[k]) > tol:
            bad.append((k, ours[k], printed[k], tol))
    for k in kld_keys:  # one-sided: llama.cpp's KL is ours minus at most delta, or larger
        if printed[k] < ours[k] - delta - 0.5e-6 - 3 * 2.0**-24 * abs(ours[k]):
            bad.append((k, ours[k], printed[k], "below"))
    # the mean KLD from above, under one stated assumption: no token under the q4_0 floor lies more than
    # L = 16 nats further down, so the excess is at most L times the mean floor mass (4e-5 here); enough
    # to tell KL(base || Q) in nats from bits (x1.44) or from KL(Q || base)
    upper = ours["kld_mean"] + delta + 16 * float(rec["floor_mass"].mean()) + 0.5e-6
    if printed["kld_mean"] > upper:
        bad.append(("kld_mean", ours["kld_mean"], printed["kld_mean"], f"above {upper}"))
    assert not bad, bad
    # the bounds are tight enough to mean something: 2e-4 relative on the perplexity, 0.02 points on Δp
    assert bound["ppl"] / ppl < 2e-4 and bound["dp_mean"] < 0.02 and upper / ours["kld_mean"] - 1 < 5e-3
