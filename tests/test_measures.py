"""qkit eval's metrics as registered measures (``qkit.evaluation.measures``).

- ``kl-p99`` is the 99th percentile of the per-position KL as llama-perplexity's "99.0%   KLD" line
  computes it (llama.cpp ``tools/perplexity/perplexity.cpp``, commit 050fc7f3, the ``percentile`` lambda of
  ``kl_divergence()``: ``float p = fraction*(values.size() - 1); size_t ip = size_t(p); p -= ip;
  return (1 - p)*values[ip] + p*values[std::min(ip+1, values.size()-1)];`` on the sorted values): checked
  against that line re-done here by hand, against numpy's percentile (which forms the index in float64), and
  per domain of an eval suite.
- A toy measure defined here, one class and one registry line, appears in ``qkit eval``'s table, its
  per-domain table, its ``--json`` (each row and each domain) and ``qkit report``'s page (the quality table and a
  panel of the frontier) with no other edit.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from adversarial import invoke
from qkit.evaluation.domains import domain_rows
from qkit.evaluation.klstats import llama_kl_stats
from qkit.evaluation.measures import MEASURES, Evidence, FrontierPanel, TokenMeasure, measure_values, num
from qkit.evaluation.measures.builtin import KLP99
from qkit.evaluation.token_scores import TokenScores
from qkit.jsonfields import MEASURE


def _scores(kl: np.ndarray, domains=()) -> TokenScores:
    n = kl.size
    g = torch.Generator().manual_seed(1)
    return TokenScores(torch.rand(n, generator=g, dtype=torch.float64) + 1, torch.from_numpy(kl),
                       torch.ones(n, dtype=torch.bool), domains=domains)


def _by_hand(kl: np.ndarray, fraction: float = 0.99) -> float:
    """llama.cpp's lambda, line by line: the index in float32, the interpolation between two sorted values."""
    v = np.sort(kl)
    p = np.float32(fraction) * np.float32(v.size - 1)  # float * (size_t converted to float)
    ip = int(p)
    w = float(p - np.float32(ip))
    return (1 - w) * float(v[ip]) + w * float(v[min(ip + 1, v.size - 1)])


@pytest.mark.parametrize("n", [1, 2, 100, 101, 2047, 5000])
def test_p99_kl_is_llama_perplexitys_99_percent_line_and_numpys_percentile(n):
    kl = np.random.default_rng(n).gamma(0.5, 0.02, size=n)  # skewed, as per-token KL is
    got = KLP99().compute(Evidence(_scores(kl), None))["kld_p99"]
    assert got == _by_hand(kl)
    # numpy's linear percentile forms the index 0.99 * (n - 1) in float64; llama.cpp in float32: the two
    # interpolate between the same neighbours, their weights apart by the float32 rounding of the index
    v = np.sort(kl)
    p64, p32 = 0.99 * (n - 1), float(np.float32(0.99) * np.float32(n - 1))
    step = float(v[min(int(p64) + 1, n - 1)] - v[int(p64)])
    assert abs(got - float(np.percentile(kl, 99))) <= abs(p32 - p64) * step + 1e-15
    if n > 1:  # numpy at llama.cpp's own (float32) index: the same number
        assert got == pytest.approx(float(np.quantile(kl, p32 / (n - 1))), rel=1e-12, abs=1e-18)
    # and the llama-perplexity statistics block qkit eval --kl-stats prints gives the same 99.0% line
    assert got == llama_kl_stats(_scores(kl), _scores(np.zeros(n)))["kld_p99"]


def test_p99_kl_without_the_full_distribution_is_not_a_number_and_the_reference_is_zero():
    assert math.isnan(KLP99().compute(Evidence(_scores(np.full(50, np.nan)), None))["kld_p99"])
    assert KLP99().compute(Evidence(_scores(np.zeros(50)), None))["kld_p99"] == 0.0


def test_p99_kl_per_domain_is_each_domains_own_percentile():
    kl = np.random.default_rng(0).gamma(0.5, 0.02, size=300)
    row, ref = _scores(kl, (("a", 120), ("b", 180))), _scores(np.zeros(300), (("a", 120), ("b", 180)))
    got = {d["name"]: d["kld_p99"] for d in domain_rows(row, ref)}
    assert got == {"a": _by_hand(kl[:120]), "b": _by_hand(kl[120:])}
    assert measure_values(Evidence(row, ref))["kld_p99"] == _by_hand(kl)  # the row's own: every position pooled


def test_the_built_in_measures_in_the_order_the_tables_show_them():
    assert MEASURES.names() == ["perplexity", "perplexity-change", "kl", "kl-p99", "top-1", "battery", "agreement"]


# --------------------------------------------------------------------------- a toy measure: one class, one line


class MeanNLL(TokenMeasure):
    """The mean negative log-likelihood per scored token (nats): ln(perplexity), shown with a marker."""

    keys = ("toy_mean_nll",)
    fields = {"toy_mean_nll": MEASURE}
    header, suite_header, page_header, domain_header = "toy nll", "worst toy nll", "toy nll", "toy nll"
    worst, worst_key = max, "toy_mean_nll"
    frontier = FrontierPanel("the toy", "mean NLL, nats/token", "size against the toy", "symlog", "toy nll", 5)

    def compute(self, e: Evidence) -> dict:
        return {"toy_mean_nll": float(e.scores.nll.mean())}

    def cell(self, v, scored: int, reference: bool) -> str:
        return f"T{num(v.get('toy_mean_nll')):.5f}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from conftest import TINY_TEXT

    f = tmp_path_factory.mktemp("corpus") / "text.txt"
    f.write_text(TINY_TEXT * 3)
    return str(f)


FAST = ("--schemes", "int8-row", "--tokens", "96", "--no-battery", "--agree-tokens", "2")


@pytest.mark.parametrize("suite", [False, True], ids=["one-text", "four-domains"])
def test_a_measure_registered_in_one_line_is_in_the_table_the_json_and_the_report(suite, tiny_model_dir, corpus, tmp_path):
    out, page = tmp_path / "eval.json", tmp_path / "report.html"
    text = () if suite else ("--corpus", corpus)
    with MEASURES.temporarily("toy", MeanNLL()):
        r = invoke("eval", tiny_model_dir, *text, *FAST, "--json", out)
        assert r.code == 0, r.text
        rows = json.loads(out.read_text())["rows"]
        rep = invoke("report", out, "-o", page, "--run", "none")
        assert rep.code == 0, rep.text
    # the JSON: every row (the reference too) and, over the suite, every domain, computed from the row's NLL
    assert [x["scheme"] for x in rows] == ["reference", "int8-row"]
    for x in rows:
        assert x["toy_mean_nll"] == pytest.approx(math.log(x["perplexity"]), rel=1e-9)
        assert "measures" not in x
        for d in x["domains"]:
            assert d["toy_mean_nll"] == pytest.approx(math.log(d["perplexity"]), rel=1e-9)
        assert bool(x["domains"]) == suite
    # the table: its column, each row's value (over the suite: the worst domain's, named; the reference blank)
    header = next(line for line in r.stdout.splitlines() if "scheme" in line and "bits/w" in line)
    assert ("worst toy nll" if suite else "toy nll") in header
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ int8-row"))
    if suite:
        w = max(rows[1]["domains"], key=lambda d: d["toy_mean_nll"])
        assert f"T{w['toy_mean_nll']:.5f} {w['name']}" in row
        assert "T" not in next(line for line in r.stdout.splitlines() if line.startswith("│ reference"))
    else:
        assert f"T{rows[1]['toy_mean_nll']:.5f}" in row
    # over the suite, the per-domain table: its part of the title, and every row's value on every domain (after
    # KL and the change for a row, after the perplexity for the reference: the measures' place, then their order)
    lines = r.stdout.splitlines()
    if suite:
        assert "per domain: KL (nats) · Δ ppl ± paired SE · toy nll" in lines
        for x in rows:
            cells = next(line for line in lines if line.startswith(f"│ {x['scheme']} ") and "·" in line).split("│")[2:-1]
            assert len(cells) == len(x["domains"]) == 4
            for cell, d in zip(cells, x["domains"]):
                assert cell.strip().endswith(f" · T{d['toy_mean_nll']:.5f}"), (cell, d)
    else:
        assert not any(line.startswith("per domain") for line in lines)
    # the report's quality table: its column and every row's value
    html = page.read_text()
    quality = re.search(r'<section id="quality">(.*?)</section>', html, re.S).group(1)
    assert "<th>toy nll</th>" in quality
    for x in rows:
        assert f"<td>T{x['toy_mean_nll']:.5f}</td>" in quality
    # the report's frontier: a third panel, after KL and Δ perplexity, and its column of the points drawn
    frontier = re.search(r'<section id="frontier">(.*?)</section>', html, re.S).group(1)
    assert "each row&#x27;s bits/w, KL, Δ perplexity and the toy from the eval JSON" in frontier
    assert "<th>KL ± 2 SE</th><th>Δ ppl % ± 2 SE</th><th>toy nll</th>" in frontier
    assert f"<td>{rows[1]['toy_mean_nll']:.5f}</td></tr>" in frontier  # no SE: the value alone
    assert "size against the toy" in frontier and "mean NLL, nats/token" in frontier  # the figure's third panel
    assert "toy" not in MEASURES  # the registry is as it was


def test_p99_kl_is_in_the_json_and_the_report_but_not_the_terminal_table(tiny_model_dir, corpus, tmp_path):
    out, page = tmp_path / "eval.json", tmp_path / "report.html"
    r = invoke("eval", tiny_model_dir, "--corpus", corpus, *FAST, "--json", out)
    assert r.code == 0, r.text
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["kld_p99"] == 0.0
    assert rows[1]["kld_p99"] == rows[1]["llama_kl"]["kld_p99"] > 0
    assert "p99" not in r.stdout
    assert invoke("report", out, "-o", page, "--run", "none").code == 0
    quality = re.search(r'<section id="quality">(.*?)</section>', page.read_text(), re.S).group(1)
    assert "<th>KL p99 (nats)</th>" in quality and f"<td>{rows[1]['kld_p99']:,.4f}</td>" in quality
