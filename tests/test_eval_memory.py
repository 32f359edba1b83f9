"""The eval's memory bounds give exactly the values of the implementations they replaced.

- ``CorpusReference`` (logits a chunk of positions at a time from the final hidden states, the
  reference's log-probabilities in an unnamed temporary file) against the whole-window implementation it
  replaced, frozen in ``tests/helpers_eval.py``, bit for bit: tiny model here, the default model in fp32 (slow);
- nothing it keeps is a ``[tokens, V]`` tensor, and its temporary file has no name;
- ``Swapper.restore`` re-reads the replaced tensors from the source files: every parameter bit-identical
  to a fresh load, fp32 and bf16, tied and untied heads; clones only where the source lacks a tensor;
- ``--dtype bf16``: the row's weights are the same codes (quantized from the source file), its bits/w
  counts the stored scheme, provenance says bf16, the reference's perplexity moves by a little.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

import pytest
import torch

from qkit.api import quantize_model
from qkit.checkpoint import iter_quantized
from qkit.evaluation import EvalOptions, evaluate
from qkit.evaluation.perplexity import MIN_CHUNK, CorpusReference, chunk_positions, split_head
from qkit.evaluation.token_scores import TokenScores
from qkit.evaluation.swap import Swapper
from qkit.models import load
from helpers_eval import assert_same_scores, whole_window_reference, whole_window_score  # the implementations replaced


# window, chunk: one window per chunk, several chunks per window (spans of 12-18 rows, never fewer
# than MIN_CHUNK), a short last window, and the default chunk (every window one span).
@pytest.mark.parametrize("window,chunk", [(16, None), (37, 16), (72, 16), (72, 20), (40, 13), (37, None)])
def test_chunked_reference_and_rows_equal_the_whole_window_implementation(perturbed, window, chunk):
    ref_model, row, _ = perturbed
    ids = torch.randint(3, 300, (72,), generator=torch.Generator().manual_seed(window))
    ref = CorpusReference(ref_model, ids, window, chunk=chunk)
    assert ref.split  # the tiny llama's logits are lm_head(final hidden states): the chunked path is tested
    old_lps, old_tops = whole_window_reference(ref_model, ref.windows)
    assert all(torch.equal(a, b) for a, b in zip(ref.ref_logprobs, old_lps))
    assert all(torch.equal(a, b) for a, b in zip(ref.ref_argmax, old_tops))
    own = ref.own_scores()
    assert torch.equal(own.nll, torch.cat([-lp.gather(1, w[1:, None]).squeeze(1).double() for w, lp in zip(ref.windows, old_lps)]))
    for model in (row, ref_model):
        assert_same_scores(ref.score(model), whole_window_score(old_lps, old_tops, ref.windows, model))
    s = ref.score(row)
    assert s.kld > 1e-3 and s.top1_match < 1.0  # the row really differs: the comparison can fail
    assert ref.score(ref_model).kld == 0.0
    ref.close()


def test_a_model_whose_logits_are_not_the_head_of_its_hidden_states_is_scored_whole(perturbed):
    """A forward hook that scales the logits (as gemma soft-caps or cohere scales them): the split
    would miss it; ``split_head`` sees that and the whole-window path gives the model's own values."""
    ref_model, row, _ = perturbed
    ids = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(1))
    handle = ref_model.register_forward_hook(lambda _m, _i, out: out.__class__(**{**out, "logits": out.logits * 0.5}))
    try:
        assert not split_head(ref_model, ids)
        ref = CorpusReference(ref_model, ids, 30, chunk=16)
        assert not ref.split
        old_lps, old_tops = whole_window_reference(ref_model, ref.windows)
        assert all(torch.equal(a, b) for a, b in zip(ref.ref_logprobs, old_lps))
        assert_same_scores(ref.score(row), whole_window_score(old_lps, old_tops, ref.windows, row))
    finally:
        handle.remove()
    assert split_head(ref_model, ids)


def test_chunk_positions_golden():
    # 64 MiB of float32 rows: 2^26 / (4 V)
    assert chunk_positions(49152) == 341  # the default model (SmolLM2) and the 7B-shaped benchmark
    assert chunk_positions(32000) == 524  # llama-2
    assert chunk_positions(151936) == 110  # qwen2
    assert chunk_positions(10**7) == MIN_CHUNK == 16
    assert chunk_positions(304, chunk_bytes=4 * 304 * 20) == 20


def test_nothing_held_is_tokens_by_vocabulary_and_the_file_has_no_name(perturbed):
    ref_model, _, _ = perturbed
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(2))
    before = {n for n in os.listdir(tempfile.gettempdir()) if "qkit-logprobs" in n}
    ref = CorpusReference(ref_model, ids, 50, chunk=16)
    vocab = ref.vocab
    assert vocab == 304 and ref._store.rows == ref.scored_tokens == 196

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)

    held = [t for v in vars(ref).values() for t in tensors(v)]
    assert held and max(t.numel() for t in held) <= 50  # the windows, their argmax and NLL: never [tokens, V]
    assert {n for n in os.listdir(tempfile.gettempdir()) if "qkit-logprobs" in n} == before  # unlinked
    fd = ref._store.file.fileno()
    if sys.platform.startswith("linux"):
        assert os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
    ref.close()
    assert ref._store.file.closed


def fresh_parameters(directory, dtype):
    return {n: p.detach().clone() for n, p in load(directory, device="cpu", dtype=dtype).model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [True, False])
def test_restore_rereads_every_tensor_bit_identical_to_a_fresh_load(tmp_path, dtype, tie):
    from conftest import make_tiny_llama

    src = tmp_path / "model"
    make_tiny_llama(src, tie=tie, seed=5)
    result = quantize_model(src, output=tmp_path / "row", scheme="int4-g64", collect=True)
    model = load(src, device="cpu", dtype=dtype).model
    swapper = Swapper(model, src)
    swapper.apply([*result.quantized.items()])
    assert swapper.changed == result.matrices == 14
    assert swapper.originals == {}  # nothing cloned: every replaced tensor is in the source file
    assert len(swapper.reread) == 14
    params = dict(model.named_parameters())
    for name, qt in result.quantized.items():  # the row's codes dequantized straight to the model's dtype
        assert params[name].dtype == dtype and torch.equal(params[name], qt.dequantize(dtype))
    swapper.restore()
    fresh = fresh_parameters(src, dtype)
    assert fresh.keys() == params.keys()
    assert all(torch.equal(params[n], fresh[n]) for n in fresh)
    assert swapper.reread == set()
    # a second row after the restore: the same
    swapper.apply(iter_quantized(tmp_path / "row"))  # from the file: every stored tensor, the unchanged skipped
    assert swapper.changed == 14 and len(swapper.reread) == 14
    for name, qt in result.quantized.items():  # the file's tensors are the in-memory row's, bit for bit
        assert torch.equal(params[name], qt.dequantize(dtype))
    swapper.restore()
    assert all(torch.equal(params[n], fresh[n]) for n in fresh)


def test_restore_clones_what_the_source_lacks_and_works_without_a_source(tmp_path):
    from conftest import make_tiny_llama

    src = tmp_path / "model"
    make_tiny_llama(src, tie=True, seed=6)
    fresh = fresh_parameters(src, torch.float32)
    model = load(src, device="cpu").model
    head = model.get_output_embeddings().weight
    swapper = Swapper(model, src)
    assert "lm_head.weight" not in swapper.stored  # tied: the file stores the embedding only
    new_head = torch.full(head.shape, 0.25)
    gate = "model.layers.0.mlp.gate_proj.weight"
    swapper.apply([("lm_head.weight", new_head), (gate, torch.zeros(fresh[gate].shape)),
                   ("model.norm.weight", fresh["model.norm.weight"].clone())])  # equal to the model's: not copied
    assert swapper.changed == 2
    assert set(swapper.originals) == {"lm_head.weight"} and swapper.reread == {gate}
    assert torch.equal(model.get_input_embeddings().weight, new_head)  # tied: the embedding changed with it
    swapper.restore()
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], fresh[n]) for n in fresh)
    plain = Swapper(model)  # no source: the old copy path
    plain.apply([(gate, torch.ones(fresh[gate].shape))])
    assert set(plain.originals) == {gate} and plain.reread == set()
    plain.restore()
    assert all(torch.equal(params[n], fresh[n]) for n in fresh)


def test_bf16_rows_keep_the_stored_scheme_and_say_their_dtype(tiny_model_dir, tmp_path):
    corpus = tmp_path / "text.txt"
    from conftest import TINY_TEXT

    corpus.write_text(TINY_TEXT * 3)
    opts = dict(schemes=("int8-row",), corpus=str(corpus), tokens=128, battery_tokens=4, agree_tokens=2)
    fp32 = evaluate(tiny_model_dir, options=EvalOptions(**opts))
    bf16 = evaluate(tiny_model_dir, options=EvalOptions(dtype="bf16", **opts))
    assert fp32.provenance["dtype"] == "fp32" and bf16.provenance["dtype"] == "bf16"
    ref32, row32 = fp32.rows
    ref16, row16 = bf16.rows
    assert (ref32.bits_per_weight, ref16.bits_per_weight) == (32, 16)  # the reference's weights as evaluated
    # int8-row: 8 bits a code plus one fp16 scale a row. A tiny layer's projections (hidden 64, 2 of 4 kv heads,
    # intermediate 160) have 64+32+32+64+160+160+64 = 576 rows and 64*512 + 64*160 = 43008 weights
    assert row32.bits_per_weight == row16.bits_per_weight == 8 + 16 * 576 / 43008
    assert row32.size_bytes == row16.size_bytes
    assert ref16.perplexity != ref32.perplexity  # really scored in bf16 ...
    assert math.isclose(ref16.perplexity, ref32.perplexity, rel_tol=0.02)  # ... a rounding away from fp32
    assert row16.kld > 0 and row16.weights_changed == row32.weights_changed == 14


@pytest.mark.slow
def test_default_model_fp32_is_the_whole_window_implementation_bit_for_bit(default_model_dir):
    """The default model in fp32, its real vocabulary (49152: 341-position chunks): two windows (300
    tokens: one span; 700: three spans of 233-234), against the frozen whole-window implementation,
    the reference and an int8-row row."""
    from qkit.models import load_tokenizer
    from qkit.texts import load_corpus

    model = load(default_model_dir, device="cpu").model
    tok = load_tokenizer(default_model_dir)
    ids = torch.tensor(tok(load_corpus(None).text, add_special_tokens=False)["input_ids"][:1000])
    ref = CorpusReference(model, ids, 700)
    assert ref.split and ref.chunk == 341 and [w.numel() for w in ref.windows] == [700, 300]
    old_lps, old_tops = whole_window_reference(model, ref.windows)
    assert all(torch.equal(a, b) for a, b in zip(ref.ref_logprobs, old_lps))
    assert_same_scores(ref.own_scores(), TokenScores(
        torch.cat([-lp.gather(1, w[1:, None]).squeeze(1).double() for w, lp in zip(ref.windows, old_lps)]),
        torch.zeros(ref.scored_tokens, dtype=torch.float64), torch.ones(ref.scored_tokens, dtype=torch.bool)))
    with tempfile.TemporaryDirectory() as tmp:
        result = quantize_model(default_model_dir, output=f"{tmp}/row", scheme="int8-row", collect=True)
    swapper = Swapper(model, default_model_dir)
    swapper.apply(result.quantized.items())
    try:
        got = ref.score(model)
        assert_same_scores(got, whole_window_score(old_lps, old_tops, ref.windows, model))
        assert 1e-4 < got.kld < 0.05 and 0.9 < got.top1_match < 1.0
    finally:
        swapper.restore()
    assert ref.score(model).kld == 0.0


@pytest.mark.slow
def test_default_model_bf16_eval(default_model_dir, tmp_path):
    """``qkit eval --dtype bf16 --schemes int8-row --tokens 256`` on the default model: provenance bf16,
    the row's bits/w the stored scheme's (int8 codes plus one fp16 scale a row), and the reference's
    perplexity within 1% of fp32's on the same tokens (measured: 11.7758 fp32, 11.8352 bf16: +0.50%)."""
    from qkit.texts import load_corpus

    ruth = tmp_path / "ruth.txt"  # one text (the default eval is a suite of four domains)
    ruth.write_text(load_corpus(None).text)
    report = evaluate(None, options=EvalOptions(schemes=("int8-row",), tokens=256, dtype="bf16", agree_tokens=2,
                                                corpus=str(ruth)))
    assert report.provenance["dtype"] == "bf16"
    ref, row = report.rows
    assert ref.bits_per_weight == 16
    # int8 codes plus one fp16 scale a row: per layer 5184 rows over 3538944 weights (hidden 576, kv 192,
    # intermediate 1536), so 8 + 16 * 5184 / 3538944 = 8.0234375 (the fp32 table's value too)
    assert row.bits_per_weight == 8.0234375
    from qkit.models import load_tokenizer

    fp32 = load(default_model_dir, device="cpu").model
    tok = load_tokenizer(default_model_dir)
    ids = torch.tensor(tok(load_corpus(None).text, add_special_tokens=False)["input_ids"][:256])
    ppl32 = CorpusReference(fp32, ids, 2048).own_scores().perplexity
    assert ref.perplexity != ppl32
    assert abs(ref.perplexity / ppl32 - 1) < 0.01
