"""llama.cpp's KL-divergence statistics, from qkit's per-token scores.

``llama-perplexity --kl-divergence`` (llama.cpp ``tools/perplexity/perplexity.cpp``, function
``kl_divergence()``, with ``log_softmax(..., base_log_prob, tok, kld)`` filling the running sums of
``struct kl_divergence_result`` per scored position) ends with three blocks of statistics. Here they are
computed from a row's :class:`~qkit.evaluation.token_scores.TokenScores` against the reference's own
scores: per scored position ``t`` (``n`` of them)::

    nll_t   = row.nll[t]                 (-ln q(x_t), the quantized model: llama.cpp's "Q")
    base_t  = reference.nll[t]           (-ln p(x_t), the reference: llama.cpp's "base")
    kld_t   = row.kl[t]                  (KL(base || Q) in nats at position t)
    dp_t    = exp(-nll_t) - exp(-base_t) (Δp: the row's probability of the right token minus the base's)
    top_t   = row.top1[t]                (argmax Q == argmax base)

**Means and their uncertainties** (``mean_and_uncertainty`` in ``kl_divergence()``): ``mean = sum/n`` and
``SE = sqrt(var/(n - 1))`` with the population variance ``var = sum2/n - mean**2``; that is the unbiased
SD over ``sqrt(n)``. llama.cpp sets the SE to 0 when ``var <= 0`` or ``n <= 10``; for ``n <= 10`` it is
``None`` here (llama.cpp's 0 would read as "no uncertainty"; it prints no final block below 100 positions
anyway). The variances are computed two-pass here (same value, no cancellation).

- ``ppl = exp(mean nll)``, ``ppl_se = ppl * SE(nll)``; the same for ``ppl_base`` from ``base``.
- ``cov = (mean(nll*base) - mean(nll)*mean(base)) / (n - 1)`` (``covariance``; needs ``n > 10`` here,
  llama.cpp ``n >= 10``), the covariance of the two means. ``ln_ppl_cor = 100 * cov / (SE(nll)*SE(base))``
  in percent, as printed.
- ``ln_ppl_ratio = mean(nll) - mean(base)``, SE ``sqrt(SE(nll)^2 + SE(base)^2 - 2 cov)``: computed here as
  the SE of the mean of ``nll - base`` (the same number; never a negative square root);
  ``ppl_ratio = exp(ln_ppl_ratio)``, SE ``ppl_ratio * SE(ln_ppl_ratio)``;
  ``ppl_diff = ppl - ppl_base``, SE ``sqrt(ppl_se^2 + ppl_base_se^2 - 2 ppl ppl_base cov)`` (the same as the
  SE of the mean of ``ppl*nll - ppl_base*base``, computed so).
- ``kld_mean``, ``kld_mean_se``: mean and SE of ``kld``.
- ``dp_mean``, ``dp_mean_se``: of ``dp``; ``dp_rms = sqrt(mean(dp^2))`` with
  ``dp_rms_se = SE(dp^2) / (2 dp_rms)`` (delta method; ``SE(dp^2)`` from ``sum_p_diff4``).
- ``same_top_p = k/n`` with binomial SE ``sqrt(p (1 - p) / (n - 1))`` (``n - 1``, as llama.cpp; defined
  for ``n >= 2``).

**Order statistics** over the sorted values (``std::sort`` of ``kld_values`` / ``p_diff_values``):
``*_max`` the last, ``*_min`` the first, ``*_median`` the middle value (the mean of the two middle ones
for even ``n``), and the lambda ``percentile(values, fraction)``::

    p  = fraction * (n - 1)        (in float32: fraction is a float literal such as 0.999f)
    ip = floor(p);  w = p - ip
    value = (1 - w) * v[ip] + w * v[min(ip + 1, n - 1)]

KLD percentiles printed: 99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1 (keys ``kld_p99_9`` ... ``kld_p0_1``);
Δp adds 75.0 and 25.0. The index ``p`` is formed in float32 exactly as llama.cpp forms it; the values and
the interpolation are float64 here (llama.cpp keeps per-token values as float32).

**Units**, as printed: KLD in nats; every Δp statistic, ``same_top_p`` and ``ln_ppl_cor`` in percent
(``100 *`` the fraction); perplexities plain.

**Negative KL.** llama.cpp does not clamp ``kld_t``: its per-token sum ``sum_{i: ln p_i > -16}
p_i (ln p_i - ln q_i)`` runs over the base's 16-bit-rounded log-probabilities (not exactly normalised)
and drops base tokens under ``-16`` nats, so a row almost equal to the base gets per-token values of
either sign: the default model's F32 GGUF against its own base file (``-c 128``, 4 chunks) prints
``Mean KLD -0.000001``, ``Median -0.000000``, ``Minimum KLD -0.000041``. qkit's
``CorpusReference.score`` clamps its KL at 0. These functions use ``row.kl`` as given, so the clamp
matters only through qkit's values: fed llama.cpp's own per-token values they reproduce its negatives;
fed qkit's clamped ones, ``kld_min`` and the low percentiles are >= 0 where an unclamped value would be
slightly negative, and the mean and its SE move by at most the largest clamped magnitude. qkit's KL is
float32 over the full, exactly normalised vocabulary, so its negatives are rounding (about 1e-7 nats):
no printed digit of a real quantization row changes. The definitions are llama.cpp's; the per-token
inputs are qkit's own (torch, full vocabulary), not llama.cpp's 16-bit base file and kernels.

:func:`llama_kl_stats` returns ``float`` values (``inf`` for an overflowing perplexity), ``None`` for an
undefined one (an SE with ``n <= 10``, a correlation or ``dp_rms_se`` dividing by zero), never NaN.
:func:`format_llama_kl_stats` prints them line for line as llama-perplexity does (``None`` as ``nan``,
what C's printf shows for those cases).
"""

from __future__ import annotations

import math

import numpy as np

from qkit.errors import InputError
from qkit.evaluation.token_scores import TokenScores

# llama.cpp's mean_and_uncertainty gives an SE only for count > 10 (and covariance() for count >= 10)
MIN_FOR_SE = 11

KLD_PERCENTILES = (("p99_9", 0.999, "99.9%"), ("p99", 0.990, "99.0%"), ("p95", 0.950, "95.0%"),
                   ("p90", 0.900, "90.0%"), ("median", None, "Median"), ("p10", 0.100, "10.0%"),
                   ("p5", 0.050, " 5.0%"), ("p1", 0.010, " 1.0%"), ("p0_1", 0.001, " 0.1%"))
DP_PERCENTILES = (KLD_PERCENTILES[:4] + (("p75", 0.750, "75.0%"), KLD_PERCENTILES[4], ("p25", 0.250, "25.0%"))
                  + KLD_PERCENTILES[5:])

# (key, its SE's key or None, the label as printed, the printf format of the value(s)), in printed order;
# None for a blank line or a header. format_llama_kl_stats prints from it; bench_llama_cpp parses with it.
HEADER_PPL = "====== Perplexity statistics ======"
HEADER_KLD = "====== KL divergence statistics ======"
HEADER_DP = "====== Token probability statistics ======"
LINES: tuple = (
    (HEADER_PPL,),
    ("ppl", "ppl_se", "Mean PPL(Q)                   : ", "%10.6f ± %10.6f"),
    ("ppl_base", "ppl_base_se", "Mean PPL(base)                : ", "%10.6f ± %10.6f"),
    ("ln_ppl_cor", None, "Cor(ln(PPL(Q)), ln(PPL(base))): ", "%6.2f%%"),
    ("ln_ppl_ratio", "ln_ppl_ratio_se", "Mean ln(PPL(Q)/PPL(base))     : ", "%10.6f ± %10.6f"),
    ("ppl_ratio", "ppl_ratio_se", "Mean PPL(Q)/PPL(base)         : ", "%10.6f ± %10.6f"),
    ("ppl_diff", "ppl_diff_se", "Mean PPL(Q)-PPL(base)         : ", "%10.6f ± %10.6f"),
    ("",),
    (HEADER_KLD,),
    ("kld_mean", "kld_mean_se", "Mean    KLD: ", "%10.6f ± %10.6f"),
    ("kld_max", None, "Maximum KLD: ", "%10.6f"),
    *((f"kld_{k}", None, f"{label:<8}KLD: ", "%10.6f") for k, _, label in KLD_PERCENTILES),
    ("kld_min", None, "Minimum KLD: ", "%10.6f"),
    ("",),
    (HEADER_DP,),
    ("dp_mean", "dp_mean_se", "Mean    Δp: ", "%6.3f ± %5.3f %%"),
    ("dp_max", None, "Maximum Δp: ", "%6.3f%%"),
    *((f"dp_{k}", None, f"{label:<8}Δp: ", "%6.3f%%") for k, _, label in DP_PERCENTILES),
    ("dp_min", None, "Minimum Δp: ", "%6.3f%%"),
    ("dp_rms", "dp_rms_se", "RMS Δp    : ", "%6.3f ± %5.3f %%"),
    ("same_top_p", "same_top_p_se", "Same top p: ", "%6.3f ± %5.3f %%"),
)

KEYS: tuple[str, ...] = ("n",) + tuple(k for line in LINES if len(line) == 4 for k in line[:2] if k)


def llama_percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's ``percentile`` lambda on ascending ``sorted_values`` (float [n], n >= 1): the position
    ``p = fraction*(n-1)`` formed in float32 as llama.cpp forms it (``0.999f * float(n - 1)``), then linear
    interpolation between ``v[floor(p)]`` and the next value (float64 here)."""
    n = sorted_values.size
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = np.float32(fraction) * np.float32(n - 1)  # float32 * float32 -> float32, as in the C
    ip = int(p)
    w = float(p - np.float32(ip))  # exact: p's fractional part is representable
    return (1 - w) * float(sorted_values[ip]) + w * float(sorted_values[min(ip + 1, n - 1)])


def llama_median(sorted_values: np.ndarray) -> float:
    """The middle of ascending ``sorted_values``; for even ``n`` the mean of the two middle values."""
    n = sorted_values.size
    if n % 2 == 0:
        return 0.5 * (float(sorted_values[n // 2]) + float(sorted_values[n // 2 - 1]))
    return float(sorted_values[n // 2])


def _mean_se(x: np.ndarray) -> tuple[float, float | None]:
    """Mean and llama.cpp's SE: sqrt(population variance / (n - 1)), None for n <= 10."""
    mean = float(x.mean())
    if x.size < MIN_FOR_SE:
        return mean, None
    var = float(np.mean((x - mean) ** 2))
    return mean, math.sqrt(var / (x.size - 1))


def _cov(a: np.ndarray, b: np.ndarray) -> float | None:
    """llama.cpp's ``covariance``: the population covariance over (n - 1), None for n <= 10."""
    if a.size < MIN_FOR_SE:
        return None
    return float(np.mean((a - a.mean()) * (b - b.mean()))) / (a.size - 1)


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else math.inf  # a collapsed row's mean NLL overflows math.exp


def _order_stats(values: np.ndarray, prefix: str, table: tuple, scale: float) -> dict[str, float]:
    v = np.sort(values)
    out = {f"{prefix}_max": scale * float(v[-1]), f"{prefix}_min": scale * float(v[0])}
    for key, fraction, _ in table:
        out[f"{prefix}_{key}"] = scale * (llama_median(v) if fraction is None else llama_percentile(v, fraction))
    return out


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def llama_kl_stats(row: TokenScores, reference: TokenScores) -> dict[str, float | None]:
    """Every statistic ``llama-perplexity --kl-divergence`` prints, by its definition (module docstring),
    from ``row``'s per-token scores against ``reference``'s own (same positions, same order).

    Inputs: ``row.nll``, ``row.kl`` float [n], ``row.top1`` bool [n]; ``reference.nll`` float [n] (its
    ``kl``/``top1`` are not used). Returns ``{key: float or None}`` with the keys :data:`KEYS`, in that
    order: ``n`` (int, the positions); ``ppl``, ``ppl_se``, ``ppl_base``, ``ppl_base_se``, ``ln_ppl_cor`` (%), ``ln_ppl_ratio``,
    ``ln_ppl_ratio_se``, ``ppl_ratio``, ``ppl_ratio_se``, ``ppl_diff``, ``ppl_diff_se``; ``kld_mean``,
    ``kld_mean_se``, ``kld_max``, ``kld_p99_9``, ``kld_p99``, ``kld_p95``, ``kld_p90``, ``kld_median``,
    ``kld_p10``, ``kld_p5``, ``kld_p1``, ``kld_p0_1``, ``kld_min`` (nats); ``dp_mean``, ``dp_mean_se``,
    ``dp_max``, ``dp_p99_9`` ... ``dp_p75``, ``dp_median``, ``dp_p25`` ... ``dp_p0_1``, ``dp_min``,
    ``dp_rms``, ``dp_rms_se``, ``same_top_p``, ``same_top_p_se`` (all %).
    """
    n = row.n
    if n < 1:
        raise InputError("llama_kl_stats needs at least one scored position; score a longer text")
    shapes = {"row.nll": row.nll.numel(), "row.kl": row.kl.numel(), "row.top1": row.top1.numel(),
              "reference.nll": reference.nll.numel()}
    if set(shapes.values()) != {n}:
        raise InputError(f"llama_kl_stats needs scores of the same positions, got lengths {shapes}: score the row "
                         "and the reference on the same corpus and windows")
    nll = row.nll.detach().cpu().double().numpy()
    base = reference.nll.detach().cpu().double().numpy()
    kld = row.kl.detach().cpu().double().numpy()
    top = row.top1.detach().cpu().bool().numpy()
    dp = np.exp(-nll) - np.exp(-base)

    s: dict[str, float | None] = {"n": n}
    m, se = _mean_se(nll)
    mb, seb = _mean_se(base)
    cov = _cov(nll, base)
    ppl, ppl_base = _exp(m), _exp(mb)
    s["ppl"], s["ppl_se"] = ppl, None if se is None else ppl * se
    s["ppl_base"], s["ppl_base_se"] = ppl_base, None if seb is None else ppl_base * seb
    s["ln_ppl_cor"] = None if cov is None or not se or not seb else 100 * cov / (se * seb)
    ratio, ratio_se = _mean_se(nll - base)  # = mean - mean_base, SE = sqrt(se^2 + seb^2 - 2 cov)
    s["ln_ppl_ratio"], s["ln_ppl_ratio_se"] = ratio, ratio_se
    s["ppl_ratio"] = _exp(ratio)
    s["ppl_ratio_se"] = None if ratio_se is None else s["ppl_ratio"] * ratio_se
    s["ppl_diff"] = ppl - ppl_base
    with np.errstate(invalid="ignore", over="ignore"):  # an infinite perplexity: no SE (None below)
        diff_se = _mean_se(ppl * nll - ppl_base * base)[1]  # = sqrt(ppl_se^2 + ppl_base_se^2 - 2 ppl ppl_base cov)
    s["ppl_diff_se"] = diff_se

    s["kld_mean"], s["kld_mean_se"] = _mean_se(kld)
    s.update(_order_stats(kld, "kld", KLD_PERCENTILES, 1.0))

    dp_mean, dp_se = _mean_se(dp)
    s["dp_mean"], s["dp_mean_se"] = 100 * dp_mean, None if dp_se is None else 100 * dp_se
    s.update(_order_stats(dp, "dp", DP_PERCENTILES, 100.0))
    mse, mse_se = _mean_se(dp * dp)
    rms = math.sqrt(mse)
    s["dp_rms"] = 100 * rms
    s["dp_rms_se"] = None if mse_se is None or rms == 0 else 100 * 0.5 / rms * mse_se
    p_top = float(top.mean())
    s["same_top_p"] = 100 * p_top
    s["same_top_p_se"] = 100 * math.sqrt(p_top * (1 - p_top) / (n - 1)) if n >= 2 else None
    return {k: _finite_or_none(s[k]) for k in KEYS}


def format_llama_kl_stats(stats: dict[str, float | None]) -> list[str]:
    """The three blocks as ``llama-perplexity --kl-divergence`` prints them at the end (same labels, same
    printf formats, blank lines between blocks; ``None`` shows as ``nan``), from :func:`llama_kl_stats`."""
    missing = [k for k in KEYS if k not in stats]
    if missing:
        raise InputError(f"not a llama_kl_stats result: missing {', '.join(missing[:5])}; pass what llama_kl_stats returns")
    out = []
    for line in LINES:
        if len(line) == 1:
            out.append(line[0])
            continue
        key, se_key, label, fmt = line
        values = tuple(math.nan if stats[k] is None else stats[k] for k in (key, se_key) if k)
        out.append(label + fmt % values)
    return out
