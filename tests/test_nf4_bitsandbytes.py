"""NF4 against the independent oracle, bitsandbytes, bit for bit (CPU).

``bitsandbytes.functional.quantize_4bit(t, blocksize=64, quant_type="nf4")`` returns ``(packed, state)``:
``packed`` uint8 ``[ceil(n/2), 1]`` with the same nibble order as qkit, ``state.absmax`` fp32
``[ceil(n/64)]``. qkit's bytes must equal bitsandbytes' bytes (codes and the padding nibble of an odd
count), its fp32 absmax must equal bitsandbytes' absmax, and with ``scale_dtype=fp32`` its dequantized
values must equal ``bitsandbytes.functional.dequantize_4bit``. The one documented difference: a block of
zeros *at the tail* (a numel not divisible by 64) is stored by bitsandbytes with its clamp floor 1e-38
as absmax, by qkit as 0; both give code 7 and zeros.
"""

from __future__ import annotations

import pytest
import torch

from qkit.schemes import get_scheme, quantize_tensor
from qkit.schemes.nf4 import nf4_tables

bnbf = pytest.importorskip("bitsandbytes.functional")

NF4_FP32 = get_scheme("nf4", scale_dtype="fp32")
NF4_FP16 = get_scheme("nf4")


def bnb_quantize(w: torch.Tensor):
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    return packed, state


def assert_matches_bitsandbytes(w: torch.Tensor, *, zero_tail_ok: bool = False) -> None:
    packed, state = bnb_quantize(w)
    qt = quantize_tensor(w, NF4_FP32)
    assert qt.qweight.dtype == torch.uint8
    assert torch.equal(qt.qweight, packed.view(-1)), "packed bytes differ from bitsandbytes"
    absmax = state.absmax
    if zero_tail_ok and w.numel() % 64 and (w.reshape(-1)[-(w.numel() % 64):] == 0).all():
        assert absmax[-1].item() == pytest.approx(1e-38) and qt.scales[-1].item() == 0.0
        absmax = torch.cat([absmax[:-1], torch.zeros(1)])
    assert torch.equal(qt.scales, absmax), "fp32 absmax differs from bitsandbytes"
    # fp32 scales: dequantized values identical to bitsandbytes' dequantize_4bit
    expected = bnbf.dequantize_4bit(packed, state)
    assert expected.dtype == w.dtype and expected.numel() == w.numel()
    # (bitsandbytes' CPU kernel returns some 1-D shapes as [1, n]; the values are what is compared)
    assert torch.equal(qt.dequantize(), expected.reshape(w.shape))
    # fp16 scales (the default): the very same bytes, the absmax rounded to fp16
    qt16 = quantize_tensor(w, NF4_FP16)
    assert torch.equal(qt16.qweight, packed.view(-1))
    assert torch.equal(qt16.scales, absmax.half())


@pytest.mark.parametrize(
    "shape",
    [(1536, 576), (576, 576), (192, 576), (7, 130), (3, 5), (1,), (63,), (64,), (65,), (2, 2, 33), (4097,)],
    ids=str,
)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_weights_match_bitsandbytes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    assert_matches_bitsandbytes(torch.randn(shape, generator=g) * 0.02)


@pytest.mark.parametrize("dist", ["heavy", "uniform", "ints", "sparse"])
def test_other_distributions_match_bitsandbytes(dist):
    g = torch.Generator().manual_seed(7)
    n = 64 * 50 + 37  # a short tail block
    if dist == "heavy":
        w = torch.randn(n, generator=g) / (torch.rand(n, generator=g) + 0.01)
    elif dist == "uniform":
        w = torch.rand(n, generator=g) * 2 - 1
    elif dist == "ints":  # exact small integers: many values on exact multiples of the absmax
        w = torch.randint(-8, 9, (n,), generator=g).float()
    else:
        w = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.1)
    assert_matches_bitsandbytes(w)


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_match_bitsandbytes(in_dtype):
    w = (torch.randn(130, 70, generator=torch.Generator().manual_seed(4)) * 0.05).to(in_dtype)
    assert_matches_bitsandbytes(w)


def test_zero_blocks_match_bitsandbytes():
    w = torch.randn(64 * 5 + 10, generator=torch.Generator().manual_seed(5))
    w[64:128] = 0.0  # a full zero block: both store absmax 0
    w[-10:] = 0.0  # a zero tail block: bitsandbytes stores its clamp floor 1e-38
    assert_matches_bitsandbytes(w, zero_tail_ok=True)
    assert (quantize_tensor(w, NF4_FP32).dequantize()[64:128] == 0).all()


def exact_ties(absmax: float, *, tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weights ``w`` whose scaled value is *exactly* an fp32 NF4 midpoint: ``fl(w * fl(1/a)) == m_i``
    for a full block (bitsandbytes multiplies by the reciprocal), ``fl(w / a) == m_i`` for the tail block
    (it divides). Found by trying the few floats around ``m_i * a``. Returns ``(w, i)``."""
    _, midpoints = nf4_tables()
    a = torch.tensor(absmax, dtype=torch.float32)
    guess = (midpoints * a).unsqueeze(1)
    steps = torch.arange(-6, 7, dtype=torch.int32)
    candidates = (guess.view(torch.int32) + steps).view(torch.float32)  # neighbouring floats (same sign)
    scaled = candidates / a if tail else candidates * (1.0 / a)
    hit = scaled == midpoints.unsqueeze(1)
    index = torch.arange(15).unsqueeze(1).expand_as(hit)
    return candidates[hit], index[hit]


@pytest.mark.parametrize("absmax", [1.0, 0.037109375, 0.0213, 3.3, 0.7771])
def test_ties_on_midpoints_match_bitsandbytes(absmax):
    absmax = torch.tensor(absmax).item()  # the fp32 value
    full, full_i = exact_ties(absmax, tail=False)
    tail, tail_i = exact_ties(absmax, tail=True)
    # Most midpoints have an exact tie (all 15 for a power-of-two absmax; for others, w -> fl(w * inv)
    # can step over an fp32 value, so a midpoint may have no preimage): enough to really test ties.
    need = 15 if absmax == 1.0 else 10
    assert len(set(full_i.tolist())) >= need and len(set(tail_i.tolist())) >= need
    # block 0: the absmax and 63 ties; then a tail block: -absmax and ties (divided, not multiplied)
    body = torch.cat([torch.tensor([absmax]), full.repeat(64)[:63]])
    w = torch.cat([body, torch.tensor([-absmax]), tail[:40]])
    assert w.numel() % 64 and w[:64].abs().max().item() == absmax and w[64:].abs().max().item() == absmax
    assert_matches_bitsandbytes(w)
    # a value exactly on midpoint i (between levels i and i+1) takes the lower level i
    levels, _ = nf4_tables()
    a = torch.tensor(absmax)
    dq = quantize_tensor(w, NF4_FP32).dequantize()
    assert torch.equal(dq[1:64], levels[full_i.repeat(64)[:63]] * a)
    assert torch.equal(dq[65:], levels[tail_i[:40]] * a)


@pytest.mark.slow
def test_real_default_model_weights_match_bitsandbytes(default_model_dir):
    from qkit.checkpoint import iter_tensors
    from qkit.transform import is_block_projection

    wanted = {"model.layers.0.", "model.layers.17.", "model.layers.29."}
    checked = 0
    for name, w in iter_tensors(default_model_dir):
        if not is_block_projection(name, tuple(w.shape)) or not any(name.startswith(p) for p in wanted):
            continue
        assert_matches_bitsandbytes(w.float())
        checked += 1
    assert checked == 21  # 7 projections in each of the three layers


def test_code_lookup_equals_bitsandbytes_bucketize_on_a_sweep_of_fp32_values():
    """qkit computes codes by a table lookup on the top 12 bits plus one compare (``nf4_codes``);
    bitsandbytes by ``torch.bucketize(scaled, midpoints)``. Compare on a sweep of the whole fp32 bit
    space (every 4099th pattern: all signs, exponents and buckets), every bucket edge, and the floats
    within 3 ulps of every midpoint, of 0 and of +-1."""
    from qkit.schemes.nf4 import nf4_codes

    _, midpoints = nf4_tables()
    sweep = torch.arange(-(2**31), 2**31, 4099, dtype=torch.int64).to(torch.int32)
    edges = torch.arange(4096, dtype=torch.int64) << 20
    edges = torch.cat([edges, edges - 1, edges + 1])
    edges = torch.where(edges >= 2**31, edges - 2**32, edges).clamp(-(2**31), 2**31 - 1).to(torch.int32)
    special = torch.cat([midpoints, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    near = (special.view(torch.int32).unsqueeze(1) + torch.arange(-3, 4, dtype=torch.int32)).reshape(-1)
    x = torch.cat([sweep, edges, near]).view(torch.float32)
    x = x[torch.isfinite(x)].contiguous()
    assert torch.equal(nf4_codes(x), torch.bucketize(x, midpoints, out_int32=True))
