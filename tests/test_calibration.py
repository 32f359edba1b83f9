"""Calibration text: pinned, disjoint from the eval text by hash, sampled deterministically."""

from __future__ import annotations

import json

import pytest
import torch

from qkit.errors import InputError
from qkit.methods.calibration import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQLEN,
    CalibrationOptions,
    calibration_ids,
    sample_windows,
)
from qkit.texts import Corpus, check_disjoint, data_file, load_corpus, pinned_calibration_text, shingle_hashes


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from qkit.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def corpus(text: str, name: str = "t") -> Corpus:
    import hashlib

    return Corpus(name, text, hashlib.sha256(text.encode()).hexdigest(), name)


def test_pinned_calibration_text_is_genesis_and_exodus_and_never_ruth():
    spec = json.loads(data_file("kjv-calibration.json").read_text())
    cal = pinned_calibration_text()
    assert cal.sha256 == spec["text_sha256"]
    assert len(cal.text) == spec["chars"] == 366121
    assert cal.text.startswith("In the beginning God created the heaven and the earth.")
    assert "\n\nNow these are the names of the children of Israel, which came into Egypt;" in cal.text  # Exodus 1:1
    ruth = load_corpus()
    assert "whither thou goest, I will go" in ruth.text and "whither thou goest, I will go" not in cal.text
    assert not shingle_hashes(cal.text) & shingle_hashes(ruth.text)
    check_disjoint(cal, ruth)  # does not raise


def test_a_calibration_text_with_one_verse_of_ruth_is_refused_in_one_line():
    ruth = load_corpus()
    verse = "And Ruth said, Entreat me not to leave thee, or to return from following after thee: for whither thou goest, I will go; and where thou lodgest, I will lodge: thy people shall be my people, and thy God my God:"
    assert verse in ruth.text
    text = "Some other text of my own making here. " * 50 + "\n" + verse.replace(" ", "  \n", 3) + " More text follows here now."
    with pytest.raises(InputError) as err:
        check_disjoint(corpus(text, "mine.txt"), ruth)
    msg = str(err.value)
    assert "\n" not in msg and "overlaps the evaluation text kjv-ruth" in msg and "--calibration" in msg
    # The whole eval text inside a calibration text is refused too.
    with pytest.raises(InputError, match="overlaps"):
        check_disjoint(corpus("Preface words of mine. " + ruth.text), ruth)


def test_short_common_phrases_are_not_overlap_but_twelve_words_are():
    # Genesis+Exodus and Ruth share "a famine in the land and" (6 words): not an overlap.
    a = corpus("And there was a famine in the land and they went down to Egypt to buy corn.")
    b = corpus("Now it came to pass that there was a famine in the land and a man of Bethlehem went.")
    check_disjoint(a, b)
    twelve = "one two three four five six seven eight nine ten eleven twelve"
    with pytest.raises(InputError, match="1 of its 1 runs of 12 words"):
        check_disjoint(corpus(f"Start. {twelve.upper()}, end."), corpus(twelve))
    assert len(shingle_hashes(twelve + " thirteen")) == 2
    assert shingle_hashes("Short, text!") == shingle_hashes("short text")  # case and punctuation ignored


def test_sample_windows_are_seeded_disjoint_and_in_text_order():
    ids = torch.arange(1000)
    a = sample_windows(ids, 5, 100, seed=0)
    b = sample_windows(ids, 5, 100, seed=0)
    c = sample_windows(ids, 5, 100, seed=1)
    assert a.shape == (5, 100) and torch.equal(a, b) and not torch.equal(a, c)
    starts = a[:, 0]
    assert torch.all(starts % 100 == 0) and torch.all(starts[1:] > starts[:-1])  # whole windows, text order
    assert torch.equal(a, torch.stack([torch.arange(s, s + 100) for s in starts.tolist()]))
    # The choice is torch.randperm(10) under seed 0, first 5, sorted.
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(0))[:5].sort().values * 100
    assert torch.equal(starts, expected)


def test_text_shorter_than_one_sample_or_too_few_windows_is_refused():
    with pytest.raises(InputError, match="shorter than one sample of 512"):
        sample_windows(torch.arange(100), 1, 512, 0)
    with pytest.raises(InputError) as err:
        sample_windows(torch.arange(1000), 11, 100, 0)
    assert "10 samples of 100 fit, 11 asked" in str(err.value) and "--calibration-samples 10" in str(err.value)


def test_calibration_ids_from_a_file_with_provenance(tmp_path, tokenizer):
    from conftest import TINY_TEXT

    f = tmp_path / "cal.txt"
    f.write_text(TINY_TEXT * 20)
    opts = CalibrationOptions(source=str(f), samples=3, seqlen=32, seed=7)
    ids, prov = calibration_ids(tokenizer, opts)
    again, _ = calibration_ids(tokenizer, opts)
    assert ids.shape == (3, 32) and ids.dtype == torch.long and torch.equal(ids, again)
    assert prov["name"] == "cal.txt" and prov["samples"] == 3 and prov["seqlen"] == 32 and prov["seed"] == 7
    import hashlib

    assert prov["sha256"] == hashlib.sha256((TINY_TEXT * 20).encode()).hexdigest()
    assert prov["disjoint_from"]["name"] == "qkit-heldout-v1"  # the default eval suite's four texts, Ruth first
    assert [t["name"] for t in prov["disjoint_from"]["texts"]] == ["kjv-ruth", "gpl-3.0", "argparse", "much-ado"]
    assert prov["ids_sha256"] == hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def test_calibration_file_too_short_for_one_sample(tmp_path, tokenizer):
    f = tmp_path / "short.txt"
    f.write_text("The quick brown fox jumps over the lazy dog.")
    with pytest.raises(InputError, match="shorter than one sample"):
        calibration_ids(tokenizer, CalibrationOptions(source=str(f), samples=1, seqlen=512))


@pytest.mark.parametrize("field,value", [("samples", 0), ("seqlen", 1), ("samples", -3)])
def test_malformed_numbers_are_refused(field, value):
    with pytest.raises(InputError, match="--calibration-"):
        CalibrationOptions(**{field: value}).check()


def test_defaults_are_documented_values():
    assert (DEFAULT_SAMPLES, DEFAULT_SEQLEN) == (CalibrationOptions().samples, CalibrationOptions().window)


@pytest.mark.parametrize("given,context,want", [(None, 256, 256), (None, 4096, DEFAULT_SEQLEN), (None, None, DEFAULT_SEQLEN),
                                                (300, 256, 300), (128, 4096, 128)])
def test_the_default_window_is_fitted_to_the_context_and_a_given_one_kept(given, context, want):
    """A default never asks for positions the model does not have; a given window is kept (and refused by
    check_fits when it is too long, like the default would have been before it was fitted)."""
    config = {} if context is None else {"max_position_embeddings": context}
    assert CalibrationOptions(seqlen=given).fitted(config).seqlen == want
