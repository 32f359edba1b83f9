"""Evaluation building blocks against hand-computed values: scorer, Wilson, McNemar, perplexity, KL."""

from __future__ import annotations

import math

import pytest
import torch

from qkit.errors import AssetError, InputError
from qkit.evaluation.battery import is_correct, load_battery
from qkit.texts import load_corpus, verified
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.windows import split_windows
from qkit.evaluation.stats import mcnemar_exact, wilson_interval


# --------------------------------------------------------------------------- battery scorer


@pytest.mark.parametrize(
    "output, answers, expected",
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("paris, of course", ["Paris"], True),  # case-insensitive
        ("PARIS", ["Paris"], True),
        ("A Parisian café", ["Paris"], False),  # near miss: not on a word boundary
        ("Seven days.", ["seven", "7"], True),  # alias
        ("There are 7 days", ["seven", "7"], True),
        ("There are 17 days", ["seven", "7"], False),  # 7 inside 17 must not count
        ("It is 0 degrees", ["0", "zero"], True),
        ("It is 10 degrees", ["0", "zero"], False),
        ("carbon dioxide", ["carbon dioxide", "CO2"], True),
        ("CO2!", ["carbon dioxide", "CO2"], True),
        ("carbon monoxide", ["carbon dioxide", "CO2"], False),
        ("", ["Paris"], False),
    ],
)
def test_battery_scorer(output, answers, expected):
    assert is_correct(output, answers) is expected


def test_battery_has_sixteen_questions_with_answers():
    battery = load_battery()
    assert len(battery) == 16
    assert all(q.answers and q.question.endswith("?") for q in battery)
    assert len({q.question for q in battery}) == 16


# --------------------------------------------------------------------------- statistics


def test_wilson_interval_known_values():
    # Hand computation for k=8, n=16, z=1.959964: p=0.5, z^2=3.841459,
    # centre = (0.5 + 3.841459/32) / (1 + 3.841459/16) = 0.5, half = z*sqrt(0.25/16 + 3.841459/1024)/1.240091
    lo, hi = wilson_interval(8, 16)
    assert lo == pytest.approx(0.2800, abs=1e-4)
    assert hi == pytest.approx(0.7200, abs=1e-4)
    # k = 0: lower bound exactly 0, upper z^2/(n+z^2) = 3.841459/19.841459 = 0.19361
    lo, hi = wilson_interval(0, 16)
    assert lo == 0.0
    assert hi == pytest.approx(0.19361, abs=1e-5)
    lo, hi = wilson_interval(16, 16)
    assert hi == 1.0 and lo == pytest.approx(1 - 0.19361, abs=1e-5)


def test_mcnemar_exact_known_values():
    # 6 discordant pairs, all one way: p = 2 * 0.5**6 = 0.03125
    a = [True] * 6 + [False] * 10
    b = [False] * 16
    assert mcnemar_exact(a, b) == (6, 0, pytest.approx(0.03125))
    # 5 one way: p = 2 * 0.5**5 = 0.0625 (not significant)
    assert mcnemar_exact([True] * 5 + [False] * 11, [False] * 16)[2] == pytest.approx(0.0625)
    # 3 vs 1 discordant: p = 2 * P(X <= 1 | n=4) = 2 * 5/16 = 0.625
    a = [True, True, True, False] + [True] * 12
    b = [False, False, False, True] + [True] * 12
    assert mcnemar_exact(a, b) == (3, 1, pytest.approx(0.625))
    # identical answers: no discordant pair, p = 1
    assert mcnemar_exact([True, False], [True, False]) == (0, 0, 1.0)


# --------------------------------------------------------------------------- perplexity and KL


class BigramModel(torch.nn.Module):
    """logits[t] = table[x_t]: the next-token distribution depends only on the current token."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids, use_cache=False, **_):
        class Out:
            pass

        out = Out()
        out.logits = self.table[input_ids]
        return out


def test_perplexity_hand_computed():
    # From token 0: p(1) = 1/2; from token 1: p(2) = 1/4; from token 2: p(0) = 1/4 (logits are log-probs).
    probs = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])
    model = BigramModel(probs.log())
    ids = torch.tensor([0, 1, 2, 0, 1])  # one window of 5 -> 4 scored predictions: 1/2, 1/4, 1/4, 1/2
    ref = CorpusReference(model, ids, window=5)
    s = ref.score(model)
    # mean nll = (ln2 + ln4 + ln4 + ln2) / 4 = 1.5 ln 2 -> ppl = 2**1.5
    assert s.n == 4
    assert s.perplexity == pytest.approx(2**1.5, rel=1e-6)
    # nll values {ln2, 2ln2, 2ln2, ln2}: sample std = ln2 * sqrt(1/3); SE = that / 2
    assert s.perplexity_se == pytest.approx(2**1.5 * math.log(2) * math.sqrt(1 / 3) / 2, rel=1e-6)
    assert s.kld == 0.0 and s.top1_match == 1.0


def test_windows_do_not_overlap_and_first_token_is_not_scored():
    ids = torch.arange(10)
    w = split_windows(ids, 4)
    assert [x.tolist() for x in w] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    probs = torch.full((10, 10), 0.1)
    model = BigramModel(probs.log())
    ref = CorpusReference(model, ids, window=4)
    assert ref.scored_tokens == 3 + 3 + 1
    assert ref.score(model).perplexity == pytest.approx(10.0, rel=1e-6)  # uniform over 10 tokens
    with pytest.raises(InputError):
        split_windows(ids, 1)


def test_kl_divergence_zero_for_identical_and_hand_computed_otherwise():
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    q = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    ids = torch.tensor([0, 1, 0])
    ref = CorpusReference(BigramModel(p.log()), ids, window=3)
    assert ref.score(BigramModel(p.log())).kld == 0.0
    s = ref.score(BigramModel(q.log()))
    # KL(p||q) = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3) = 0.143841
    assert s.kld == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert s.kld > 0
    # argmax of p is a tie broken to index 0 by torch; q's argmax is 0 too
    assert s.top1_match == 1.0
    # perplexity change: nll under q for targets 1, 0: ln4, ln(4/3); under p: ln2, ln2
    change, _ = s.change_against(ref.score(BigramModel(p.log())))
    expected = math.exp((math.log(4) + math.log(4 / 3)) / 2 - math.log(2)) - 1
    assert change == pytest.approx(100 * expected, rel=1e-6)


# --------------------------------------------------------------------------- corpus


def test_corpus_with_wrong_sha256_is_refused():
    with pytest.raises(AssetError, match="expected"):
        verified("x", "some text", "0" * 64, "test")


def test_local_corpus_file(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("hello world")
    c = load_corpus(str(f))
    assert c.text == "hello world" and len(c.sha256) == 64
    with pytest.raises(InputError):
        load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  ")
    with pytest.raises(InputError):
        load_corpus(str(tmp_path / "empty.txt"))


@pytest.mark.slow
def test_pinned_corpus_is_the_book_of_ruth():
    c = load_corpus()
    assert len(c.text) == 12999
    assert c.sha256 == "bf08bdae999a7c5f7671851e161b9c1bd4f71c1aa4f720113f073920eb0ca59b"
    assert c.text.startswith("Now it came to pass in the days when the judges ruled")


@pytest.mark.slow
def test_kjv_books_are_a_pinned_longer_corpus():
    """kjv:BOOK,... reads the same verified archive: kjv:Ruth is the default text to the byte, books are
    joined in the order given, and a wrong or repeated book is refused in one line."""
    ruth = load_corpus("kjv:ruth")
    assert ruth.text == load_corpus().text and ruth.sha256 == load_corpus().sha256
    both = load_corpus("kjv:Ruth,Jonah")
    assert both.text.startswith(ruth.text + "\n\n") and both.name == "kjv-ruth-jonah"
    assert both.text.endswith("and also much cattle?")  # Jonah 4:11, the book's last words
    assert load_corpus("kjv:Luke").sha256 == "bd9c52074975d2c42a6d989afeca635fa1f85f6a024dabb274bb3f63c7a9a930"
    for spec, message in (("kjv:Lukee", "did you mean Luke"), ("kjv:", "names no book"), ("kjv:Luke,luke", "twice")):
        with pytest.raises(InputError, match=message):
            load_corpus(spec)


def test_own_scores_equal_a_second_forward_pass():
    probs = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.25, 0.5, 0.25]])
    model = BigramModel(probs.log())
    ref = CorpusReference(model, torch.tensor([0, 1, 2, 0, 1, 1]), window=4)
    a, b = ref.own_scores(), ref.score(model)
    assert torch.equal(a.nll, b.nll) and torch.equal(a.top1, b.top1) and b.kld == 0.0
