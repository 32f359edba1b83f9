"""Registry-wide property tests (hypothesis): every registered scheme, a few members of the ``int{b}-g{N}``
family, and the scale dtypes fp16 / bf16 / fp32.

Properties: shape and dtype kept; idempotent re-quantization (exact where it provably is, the precise
weaker property where it is not); zero and constant rows / groups / blocks; the error of every weight
at most half a step (absmax) or half the gap between the two neighbouring levels times the block absmax
(NF4); determinism; NaN / inf and fp16 scale overflow rejected with errors that say what to do.

The bounds are checked against an independent computation: scales are expanded to one per weight here
(``repeat_interleave``), not by ``qkit.granularity``, and NF4 block absmaxes are recomputed here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import importance_for

from qkit.errors import NonFiniteWeightError, SchemeError
from qkit.granularity import PerGroup, PerRow, PerTensor
from qkit.schemes import DEFAULT_SCHEMES, get_scheme, quantize_tensor, scheme_names
from qkit.schemes.nf4 import nf4_tables
from qkit.schemes.packing import unpack_nibbles

SCHEMES = (*DEFAULT_SCHEMES, "int4-g64", "int4-g32", "int8-g128", "int4-g7")
ABSMAX_SCHEMES = tuple(n for n in SCHEMES if get_scheme(n).kind == "absmax")
SCALE_DTYPES = ("fp16", "bf16", "fp32")
PROPS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
EPS32 = 2.0**-23


@st.composite
def matrices(draw, max_rows: int = 5, max_cols: int = 300) -> torch.Tensor:
    """fp32 ``[rows, cols]`` weights: a seeded random body (normal, uniform, heavy-tailed or small
    integers) at a magnitude from 1e-6 (fp16 scales become subnormal) to 1e3, with zero rows,
    constant rows, sprinkled exact zeros and hypothesis-chosen special values written on top."""
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "uniform", "heavy", "ints"]))
    if kind == "normal":
        w = torch.randn(rows, cols, generator=gen)
    elif kind == "uniform":
        w = torch.rand(rows, cols, generator=gen) * 2 - 1
    elif kind == "heavy":  # a normal over a uniform: occasional large outliers
        w = torch.randn(rows, cols, generator=gen) / (torch.rand(rows, cols, generator=gen) + 0.01)
    else:  # exact small integers: many ties and exact levels
        w = torch.randint(-8, 9, (rows, cols), generator=gen).float()
    w *= 10.0 ** draw(st.sampled_from([-6, -3, -1, 0, 1, 3]))
    if draw(st.booleans()):
        w[torch.rand(rows, cols, generator=gen) < 0.3] = 0.0
    for r in draw(st.lists(st.integers(0, rows - 1), max_size=2)):
        w[r] = 0.0
    for r, c in draw(st.lists(st.tuples(st.integers(0, rows - 1), finite_values()), max_size=2)):
        w[r] = c
    for i, v in draw(st.lists(st.tuples(st.integers(0, rows * cols - 1), finite_values()), max_size=4)):
        w.view(-1)[i] = v
    peak = w.abs().max().item()
    if peak > 3e4:  # keep fp16 scales (NF4: the absmax itself) finite; overflow has its own test
        w *= 3e4 / peak
    return w


def finite_values():
    return st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)


def element_scales(qt) -> torch.Tensor:
    """The stored scale of each weight's unit, fp32 ``[rows, cols]``, expanded independently of qkit."""
    rows = qt.shape[0] if len(qt.shape) > 1 else 1
    cols = math.prod(qt.shape) // rows
    g = qt.scheme.granularity
    s = qt.scales.float()
    if isinstance(g, (PerTensor, PerRow)):
        return s.expand(rows, cols)
    assert isinstance(g, PerGroup)
    return s.repeat_interleave(g.size, dim=1)[:, :cols]


def absmax_codes(qt) -> torch.Tensor:
    """The integer ``q`` of each weight (int32 ``[rows, cols]``), unpacked independently of ``dequantize``."""
    rows = qt.shape[0]
    if qt.scheme.bits == 8:
        return qt.qweight.view(rows, -1).int()
    return (unpack_nibbles(qt.qweight, qt.numel).int() - 8).view(rows, -1)


def nf4_reference_absmax(w: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The fp32 absmax of each weight's flattened block, ``[n]`` (zero padding cannot raise an absmax)."""
    flat = w.reshape(-1)
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, (-n) % block)).view(-1, block)
    return padded.abs().amax(dim=1).repeat_interleave(block)[:n]


@pytest.mark.parametrize("name", SCHEMES)
@PROPS
@given(w=matrices(), sd=st.sampled_from(SCALE_DTYPES), in_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_shape_and_dtype_kept(name, w, sd, in_dtype):
    w = w.to(in_dtype)  # the peak is at most 3e4: finite in fp16 too
    qt = quantize_tensor(w, get_scheme(name, scale_dtype=sd), name="w")
    out = qt.dequantize()
    assert out.shape == w.shape and out.dtype == in_dtype
    assert qt.dequantize(torch.float32).dtype == torch.float32
    assert qt.scales.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[sd]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", ABSMAX_SCHEMES)
@PROPS
@given(w=matrices(), sd=st.sampled_from(SCALE_DTYPES))
def test_absmax_error_at_most_half_a_step(name, w, sd):
    """``|W - W_hat| <= scale/2`` per weight, ``scale`` the *stored* scale of its unit, plus float slack:
    the quotient ``W/scale`` is rounded once in fp32 before ``round`` (it can cross a .5 boundary by
    ``|W/scale| * 2**-24``, i.e. ``|W| * 2**-24`` in weight units) and the product ``q * scale`` is
    rounded once (``|W_hat| * 2**-24``): slack ``2**-23 * (|W| + |W_hat|)``. This holds for fp16
    scales that are subnormal too (see ``qkit.schemes.absmax``), which magnitude 1e-6 exercises."""
    qt = quantize_tensor(w, get_scheme(name, scale_dtype=sd))
    w_hat = qt.dequantize()
    s = element_scales(qt)
    slack = EPS32 * (w.abs() + w_hat.abs())
    excess = (w - w_hat).abs() - (s / 2 + slack)
    assert excess.max().item() <= 0, f"worst excess {excess.max().item():.3g}"


@PROPS
@given(w=matrices(), sd=st.sampled_from(SCALE_DTYPES))
def test_nf4_error_at_most_half_the_gap_between_neighbouring_levels(w, sd):
    """Per weight: ``x = W / a`` (``a`` the fp32 absmax of its block) lies between two neighbouring
    levels ``l_j <= x <= l_j+1`` and the chosen level is the nearer one, so
    ``|W - level * a| <= (l_j+1 - l_j) / 2 * a``. Dequantization uses the *stored* absmax ``a_s``
    (fp16/bf16/fp32), which adds ``|level| * |a - a_s|`` (0 for fp32). Float slack ``2**-21 * a``: the
    scaled value is ``fl(W * fl(1/a))`` (two roundings, so near a midpoint the other of the two
    neighbours may win: ``2 * 2**-24`` of ``a``) and ``level * a_s`` is rounded once."""
    qt = quantize_tensor(w, get_scheme("nf4", scale_dtype=sd))
    levels, _ = nf4_tables()
    flat = w.reshape(-1).double()
    a = nf4_reference_absmax(w).double()
    n = flat.numel()
    a_s = qt.scales.double().repeat_interleave(64)[:n]
    codes = unpack_nibbles(qt.qweight, n).long()
    lv = levels.double()
    x = torch.where(a > 0, flat / a, torch.zeros_like(flat)).clamp(-1, 1)
    j = (torch.searchsorted(lv, x, right=True) - 1).clamp(0, 14)
    half_gap = (lv[j + 1] - lv[j]) / 2
    bound = half_gap * a + lv[codes].abs() * (a - a_s).abs() + 2.0**-21 * a
    err = (flat - qt.dequantize().reshape(-1).double()).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    # and the code is one of the two neighbours of x
    assert ((codes == j) | (codes == j + 1)).all()


@pytest.mark.parametrize("name", ABSMAX_SCHEMES)
@PROPS
@given(w=matrices(), sd=st.sampled_from(["fp16", "bf16"]))
def test_absmax_requantization_is_exact_for_fp16_and_bf16_scales(name, w, sd):
    """Exact where the stored scale ``s`` is a normal number of the scale dtype (or 0):

    * the cast moves ``absmax / s`` by at most ``qmax * 2**-9`` (bf16; fp16 ``2**-11``) < 1/2, so the
      largest weight gets ``|q| = qmax`` and ``W_hat`` has absmax ``qmax * s``;
    * ``q * s`` is exact in fp32 (``|q| <= 128`` has 8 significant bits, ``s`` 11 or 8), so
      re-quantizing computes ``qmax * s / qmax = s`` exactly, the cast keeps it, and
      ``round(q * s / s) = q``: the same codes, the same scale, the same ``W_hat``.

    A subnormal scale (fp16, units with absmax below ``qmax * 2**-14``, i.e. magnitude 1e-6 here) sits
    on an absolute grid of ``2**-24``, so ``absmax / s`` can land well below ``qmax`` (or the scale is
    moved up a step, see ``qkit.schemes.absmax``); there the largest code can be below ``qmax``, the
    re-computed scale ``max|q| * s / qmax`` differs, and only the half-step bound is guaranteed: that
    weaker property is asserted for those units."""
    scheme = get_scheme(name, scale_dtype=sd)
    qt = quantize_tensor(w, scheme)
    w_hat = qt.dequantize()
    qt2 = quantize_tensor(w_hat, scheme)
    w_hat2 = qt2.dequantize()
    s = element_scales(qt)
    normal = (s == 0) | (s >= torch.finfo(scheme.scale_dtype).tiny)
    assert torch.equal(w_hat2[normal], w_hat[normal])
    assert torch.equal(qt2.scales[qt.scales.float() >= torch.finfo(scheme.scale_dtype).tiny],
                       qt.scales[qt.scales.float() >= torch.finfo(scheme.scale_dtype).tiny])
    s2 = element_scales(qt2)
    assert ((w_hat2 - w_hat).abs() <= s2 / 2 + EPS32 * (w_hat.abs() + w_hat2.abs()))[~normal].all()


@pytest.mark.parametrize("name", ABSMAX_SCHEMES)
@PROPS
@given(w=matrices())
def test_absmax_requantization_with_fp32_scales_keeps_codes_and_scale_within_one_ulp(name, w):
    """Not exact with fp32 scales, and that is expected: ``W_hat = fl(q * s)`` is *rounded* (``s`` has 24
    significant bits), so re-quantizing computes ``s' = fl(fl(qmax * s) / qmax)``, a double rounding
    that misses ``s`` by one ulp for a few percent of the scales (about 7% for qmax = 7, 0.6% for 127,
    measured on random scales). What does hold: ``s'`` is within one ulp of ``s`` (each rounding is at
    most half an ulp and ``fl(qmax * s)`` is within ``qmax * s * 2**-24`` of ``qmax * s``), hence
    ``q * s / s'`` is within ``128 * 3 * 2**-24`` of ``q`` and the codes are identical, and ``W_hat'``
    differs from ``W_hat`` by at most ``|q|`` ulps of ``s`` plus one rounding."""
    scheme = get_scheme(name, scale_dtype="fp32")
    qt = quantize_tensor(w, scheme)
    qt2 = quantize_tensor(qt.dequantize(), scheme)
    assert torch.equal(absmax_codes(qt2), absmax_codes(qt))
    s, s2 = qt.scales, qt2.scales
    up = torch.nextafter(s, torch.full_like(s, math.inf))
    down = torch.nextafter(s, torch.full_like(s, -math.inf))
    assert ((s2 == s) | (s2 == up) | (s2 == down)).all()
    w_hat, w_hat2 = qt.dequantize(), qt2.dequantize()
    q = absmax_codes(qt).float()
    ulp = element_scales(qt) * EPS32
    assert ((w_hat2 - w_hat).abs() <= q.abs() * ulp + EPS32 * w_hat.abs() + 1e-45).all()


@PROPS
@given(w=matrices(), sd=st.sampled_from(SCALE_DTYPES))
def test_nf4_requantization_is_exact(w, sd):
    """Exact values for every scale dtype: the largest weight of a block scales to ``+-1`` (within two
    ulps), so it gets code 0 or 15, level ``+-1`` and dequantizes to exactly ``+-a_s`` (``a_s`` the
    stored absmax, exact in fp32); no other ``|level * a_s|`` exceeds it, so the re-quantized block has
    absmax ``a_s`` again (stored unchanged), and each ``fl(level * a_s) * fl(1 / a_s)`` is within a few
    ulps of its level, which is at least 0.04 away from any midpoint: the same codes, the same values.

    One exception for the codes, not the values: codes follow bitsandbytes and are chosen from the fp32
    absmax, so a block whose absmax underflows the scale dtype (fp16: below 2**-25) keeps its codes
    but stores absmax 0 and dequantizes to zeros; re-quantizing those zeros gives code 7 (level 0) and
    zeros again. The values are identical either way; the codes are, wherever the stored absmax is not 0."""
    scheme = get_scheme("nf4", scale_dtype=sd)
    qt = quantize_tensor(w, scheme)
    qt2 = quantize_tensor(qt.dequantize(), scheme)
    assert torch.equal(qt2.dequantize(), qt.dequantize())
    assert torch.equal(qt2.scales, qt.scales)
    n = w.numel()
    codes = lambda q: torch.stack([q >> 4, q & 15], 1).reshape(-1)[:n]  # noqa: E731
    kept = (qt.scales != 0).repeat_interleave(64)[:n]  # blocks whose stored absmax did not underflow
    assert torch.equal(codes(qt2.qweight)[kept], codes(qt.qweight)[kept])
    assert (codes(qt2.qweight)[~kept] == 7).all()


def test_nf4_block_whose_fp16_absmax_underflows_dequantizes_to_zeros():
    """The case above, pinned: 1.06e-36 gets code 15 (as in bitsandbytes) but its fp16 absmax is 0."""
    qt = quantize_tensor(torch.tensor([[1.06e-36]]), get_scheme("nf4"))
    assert qt.qweight.tolist() == [0xF7] and qt.scales.tolist() == [0.0]
    assert qt.dequantize().tolist() == [[0.0]]
    qt2 = quantize_tensor(qt.dequantize(), get_scheme("nf4"))
    assert qt2.qweight.tolist() == [0x77] and torch.equal(qt2.dequantize(), qt.dequantize())


@pytest.mark.parametrize("name", SCHEMES)
@PROPS
@given(w=matrices(), sd=st.sampled_from(SCALE_DTYPES))
def test_zeros_give_exact_zeros_and_no_nan(name, w, sd):
    scheme = get_scheme(name, scale_dtype=sd)
    w_hat = quantize_tensor(w, scheme).dequantize()
    assert not torch.isnan(w_hat).any()
    assert (w_hat[w == 0] == 0).all()  # a zero weight is q = 0 / the NF4 level 0.0, whatever its unit
    z = quantize_tensor(torch.zeros_like(w), scheme)
    assert (z.scales == 0).all() and torch.equal(z.dequantize(), torch.zeros_like(w))


@pytest.mark.parametrize("name", ABSMAX_SCHEMES)
@PROPS
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 200),
    c=finite_values().filter(lambda v: abs(v) > 1e-3),
    sd=st.sampled_from(SCALE_DTYPES),
)
def test_constant_rows(name, rows, cols, c, sd):
    """Every unit of a constant matrix has absmax ``|c|``, so every weight gets ``q = sign(c) * qmax``
    and dequantizes to the same value ``sign(c) * qmax * s``, within half a step of ``c``."""
    scheme = get_scheme(name, scale_dtype=sd)
    qmax = 2 ** (scheme.bits - 1) - 1
    w = torch.full((rows, cols), c)
    qt = quantize_tensor(w, scheme)
    assert (absmax_codes(qt) == int(math.copysign(qmax, c))).all()
    s = element_scales(qt)
    assert torch.equal(qt.dequantize(), math.copysign(qmax, c) * s)
    assert ((qt.dequantize() - w).abs() <= s / 2 + EPS32 * 2 * abs(c)).all()


@PROPS
@given(n=st.integers(1, 300), c=finite_values().filter(lambda v: abs(v) > 1e-3), sd=st.sampled_from(SCALE_DTYPES))
def test_nf4_constant_blocks_dequantize_to_the_stored_absmax(n, c, sd):
    """``c * fl(1/|c|)`` is ``+-1`` within two ulps: code 15 (0 for c < 0), level ``+-1``, so every weight
    dequantizes to ``+-a_s``: exactly ``c`` with fp32 absmax, ``c`` rounded to fp16/bf16 otherwise."""
    scheme = get_scheme("nf4", scale_dtype=sd)
    qt = quantize_tensor(torch.full((n,), c), scheme)
    expected = torch.tensor(c).to(scheme.scale_dtype).float()
    assert torch.equal(qt.dequantize(), expected.expand(n))


@pytest.mark.parametrize("name", SCHEMES)
@PROPS
@given(w=matrices(), sd=st.sampled_from(SCALE_DTYPES))
def test_deterministic(name, w, sd):
    scheme = get_scheme(name, scale_dtype=sd)
    a = quantize_tensor(w, scheme)
    b = quantize_tensor(w.clone(), scheme)
    c = quantize_tensor(w.t().contiguous().t(), scheme)  # same values, column-major memory
    for other in (b, c):
        assert torch.equal(a.qweight, other.qweight) and torch.equal(a.scales, other.scales)


def test_deterministic_across_thread_counts():
    w = torch.randn(1536, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([quantize_tensor(w, get_scheme(n)) for n in SCHEMES])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("sd", SCALE_DTYPES)
def test_non_finite_weight_names_the_tensor(name, bad, sd):
    w = torch.randn(7, 130, generator=torch.Generator().manual_seed(1))
    w[5, 129] = bad
    with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*NaN or infinite"):
        quantize_tensor(w, get_scheme(name, scale_dtype=sd), name="model.layers.3.mlp.up_proj.weight")


@pytest.mark.parametrize("name", SCHEMES)
def test_fp16_scale_overflow_suggests_fp32(name):
    w = torch.randn(4, 130, generator=torch.Generator().manual_seed(2))
    w[1, 3] = 1e9  # absmax / qmax > 65504: the fp16 scale (or NF4 absmax) would be inf
    with pytest.raises(SchemeError, match=r"layer\.w: a scale overflows torch\.float16.*--scale-dtype fp32"):
        quantize_tensor(w, get_scheme(name), name="layer.w")
    for sd in ("fp32", "bf16"):  # bf16 has fp32's range
        qt = quantize_tensor(w, get_scheme(name, scale_dtype=sd), name="layer.w")
        assert torch.isfinite(qt.dequantize()).all()


def test_empty_and_integer_tensors_are_refused():
    with pytest.raises(SchemeError, match="empty"):
        quantize_tensor(torch.zeros(0, 4), get_scheme("int8-row"), name="e")
    with pytest.raises(SchemeError, match="floating-point"):
        quantize_tensor(torch.zeros(2, 4, dtype=torch.int32), get_scheme("nf4"), name="i")


@pytest.mark.parametrize("name", sorted({*scheme_names(), *SCHEMES}))
def test_a_weight_that_requires_grad_quantizes_like_its_detached_copy(name):
    """A model parameter passed as it is (``requires_grad=True``): same parts, none of them tracking grad
    (encoders with ``out=`` operations and the compiled kernels' numpy views both refused it before)."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(1), requires_grad=True)
    scheme = get_scheme(name)
    kw = importance_for(scheme, 256)
    a = quantize_tensor(w, scheme, name="model.layers.0.self_attn.q_proj.weight", **kw)
    b = quantize_tensor(w.detach().clone(), scheme, name="model.layers.0.self_attn.q_proj.weight", **kw)
    for key, part in a.parts.items():
        assert not part.requires_grad, key
        assert torch.equal(part, b.parts[key]), key
