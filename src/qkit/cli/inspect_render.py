"""The tables and notes of ``qkit inspect``: plain reports in, ``qkit.console`` calls out."""

from __future__ import annotations

from qkit import console
from qkit.inspect import outliers as _iout
from qkit.inspect.method_errors import OUTPUT_ERROR_NOTE


def _g(x: float) -> str:
    """A magnitude with thousands separators and 3-4 significant digits."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def errors(r, per_matrix: bool) -> None:
    console.table(
        ["scheme", "matrices", "parameters", "bits/w", "mean", "median", "worst", "worst matrix"],
        [[s.scheme, f"{s.matrices}", f"{s.parameters:,}", f"{s.bits_per_weight:.3f}", f"{s.mean:.4f}",
          f"{s.median:.4f}", f"{s.worst:.4f}", s.worst_matrix] for s in r.summaries()],
        title=f"qkit inspect errors: {r.model}",
        caption=f"relative error ||W - W_hat||_F / ||W||_F per matrix (float64 norms), the transform qkit quantize writes; "
                f"bits/w include the scales. {r.seconds:.1f} s.",
        right=range(1, 7),
    )
    if per_matrix:
        names = list(r.stats)
        by = {(m.name, m.scheme): m.rel_error for m in r.matrices}
        console.table(
            ["matrix", "shape", "max/std", *r.schemes],
            [[n, "x".join(map(str, r.stats[n].shape)), f"{r.stats[n].max_over_std:.1f}",
              *[f"{by[(n, s)]:.4f}" for s in r.schemes]] for n in names],
        )
    sentence = r.ratio_sentence()
    if sentence:
        console.note(sentence)


def method_errors(m) -> None:
    """Output-side error per matrix, RTN against a calibrated method (``qkit.inspect.method_errors.MethodErrors``)."""
    rows = [[n, f"{v['rtn']:.5f}", f"{v[m.method]:.5f}", f"{v[m.method] / v['rtn']:.2f}" if v["rtn"] > 0 else ""]
            for n, v in m.layers.items()]
    mean_rtn = sum(v["rtn"] for v in m.layers.values()) / len(m.layers)
    mean_m = sum(v[m.method] for v in m.layers.values()) / len(m.layers)
    rows.append(["mean", f"{mean_rtn:.5f}", f"{mean_m:.5f}", f"{mean_m / mean_rtn:.2f}" if mean_rtn > 0 else ""])
    cal = m.calibration
    console.table(["matrix", "rtn", m.method, f"{m.method} / rtn"], rows,
                  title=f"output error per matrix, {m.scheme}: rtn vs {m.method}",
                  caption=f"calibration: {cal.get('name')} ({cal.get('samples')} x {cal.get('seqlen')} tokens)", right=range(1, 4))
    console.note(OUTPUT_ERROR_NOTE)


def top_matrices(stats) -> None:
    console.table(
        ["matrix", "shape", "mean |w|", "std", "max |w|", "max/std", "> 6 sigma"],
        [[s.name, "x".join(map(str, s.shape)), f"{s.mean_abs:.4f}", f"{s.std:.4f}", f"{s.max_abs:.4f}",
          f"{s.max_over_std:.1f}", f"{s.beyond_6sigma:,} ({100 * s.share_beyond_6sigma:.3f}%)"] for s in stats],
        title=f"qkit inspect matrix: top {len(stats)} projection matrices by max|w| / std",
        caption="std: population standard deviation; > 6 sigma: weights with |w - mean| > 6 std. "
                "Pass a NAME for one matrix's errors and level usage.",
    )


def matrix(r) -> None:
    s, lv = r.stats, r.int4_tensor
    console.table(
        ["", ""],
        [["shape", "x".join(map(str, s.shape))], ["mean |w|", f"{s.mean_abs:.5f}"], ["std", f"{s.std:.5f}"],
         ["max |w|", f"{s.max_abs:.5f}"], ["max/std", f"{s.max_over_std:.2f}"],
         ["> 6 sigma", f"{s.beyond_6sigma:,} of {s.numel:,} ({100 * s.share_beyond_6sigma:.4f}%)"]]
        + [[f"rel. error {k}", f"{v:.4f}"] for k, v in r.errors.items()],
        title=f"qkit inspect matrix: {s.name}",
        show_header=False,
    )
    console.note(
        f"int4-tensor: step {lv['scale']:.4g} (max|w| / 7); the typical weights (|w - mean| <= 3 std, "
        f"{100 * lv['typical_share']:.2f}% of them) use {lv['typical_levels_used']} of the 16 levels; all weights use "
        f"{lv['levels_used']}; {100 * lv['zero_share']:.1f}% of the weights round to 0."
    )


def outliers(r) -> None:
    console.table(
        ["layer", "max |h|", "median dim max", "largest dimensions (dim: max |h|)", "outliers"],
        [[f"{p['layer']}", _g(p["max"]), _g(p["median_dim_max"]),
          "  ".join(f"{t['dim']}: {_g(t['value'])}" for t in p["top"]), ",".join(map(str, p["outliers"])) or "-"]
         for p in r.per_layer],
        title=f"qkit inspect outliers: {r.model}",
        caption=f"{r.tokens} tokens ({r.source}); h = residual stream after model.layers.N; max over tokens of |h| per "
                f"dimension; outlier: at least {r.threshold:g}x the median dimension's max.",
        right=[1, 2],
    )
    if r.outlier_dims:
        console.table(
            ["dim", "outlier in", "layers", "first", "peak", "last", f"within {100 * _iout.PLATEAU:.0f}% of peak"],
            [[f"{d['dim']}", f"{d['n_layers']} of {len(r.per_layer)}", d["layer_ranges"],
              f"{_g(d['value_first'])} (layer {d['first_layer']})", f"{_g(d['peak'])} (layer {d['peak_layer']})",
              f"{_g(d['value_last'])} (layer {d['last_layer']})", f"layers {d['near_peak_layers']}"]
             for d in r.outlier_dims],
            title="outlier dimensions: do they persist across layers, with the same value?",
        )
        d = r.outlier_dims[0]
        near = [l for l, v in enumerate(d["values"]) if v >= (1 - _iout.PLATEAU) * d["peak"]]
        console.note(
            f"dim {d['dim']} is an outlier in {d['n_layers']} of {len(r.per_layer)} layers; its max |h| stays within "
            f"{100 * _iout.PLATEAU:.0f}% of {_g(d['peak'])} in {len(near)} layer(s) ({d['near_peak_layers']})."
        )
    bins = r.histogram
    console.histogram(
        [f"{_g(b['lo'])}-{_g(b['hi'])}" for b in bins], [int(b["count"]) for b in bins],
        title=f"layer {r.layer}: per-dimension max |h|, {r.hidden} dimensions in octave bins "
              f"(largest {_g(r.per_layer[r.layer]['max'])})",
    )
    q = r.int8
    a, b = q["all"], q["without_top"]
    names = ("quartile", "median", "quartile")
    console.table(
        ["INT8, one scale per tensor", f"all {r.hidden} dimensions",
         f"without the top {len(q['excluded_dims'])} ({', '.join(map(str, q['excluded_dims']))})"],
        [["scale (max |h| / 127)", f"{a['scale']:.4g}", f"{b['scale']:.4g}"],
         ["levels used (of 256)", f"{a['levels_used']}", f"{b['levels_used']}"]]
        + [[f"levels of dim {ta['dim']} ({n}, max {_g(ta['max_abs'])})", f"{ta['levels']}", f"{tb['levels']}"]
           for n, ta, tb in zip(names, a["typical"], b["typical"])]
        + [["median |h| in steps", f"{q['median_in_steps']:.3g}", f"{q['median_in_steps_without_top']:.3g}"],
           ["99th percentile |h| in steps", f"{q['p99_in_steps']:.3g}", f"{q['p99_in_steps_without_top']:.3g}"]],
        title=f"layer {r.layer}: what tensor-wide INT8 does to the residual stream",
    )
    console.note(
        f"leaving out {len(q['excluded_dims'])} dimension(s) shrinks the INT8 step {q['scale_shrink']:.1f}x; "
        f"|h| at layer {r.layer}: median {q['abs_median']:.3g}, 99th percentile {q['abs_p99']:.3g} "
        f"(one step with all dimensions: {q['all']['scale']:.4g})."
    )
    if r.linear_inputs:
        linear_inputs(r)


def _linears_cell(x: dict) -> str:
    """``gate/up (post_attention_layernorm)``; an expert's ``mlp.experts.3.gate/up (post_attention_layernorm, 57
    routed tokens)``: the linears' common prefix once, ``_proj`` dropped."""
    head, _, _ = x["linears"][0].rpartition(".")
    same = bool(head) and all(n.rpartition(".")[0] == head for n in x["linears"])
    names = "/".join((n.rpartition(".")[2] if same else n).removesuffix("_proj") for n in x["linears"])
    source = x["input"].removesuffix(" input").rpartition(".")[2] if same else x["input"].removesuffix(" input")
    routed = f", {x['tokens']} routed tokens" if "expert" in x else ""
    return f"{head + '.' if same else ''}{names} ({source}{routed})"


def linear_inputs(r) -> None:
    """The linears' inputs (the norms' outputs) under the activation quantizations of qkit eval's rows."""
    def lv(v):
        return "-" if v is None else f"{v:.0f}"

    rows = [[f"{x['layer']}", _linears_cell(x),
             _g(x["max"]), _g(x["median_dim_max"]), f"{x['max_over_median']:.0f}", lv(x["levels"]["per_tensor"]),
             lv(x["levels"]["per_token"]),
             f"{lv(x['levels']['smoothquant'])} ({x['max_over_median_smoothed']:.0f})" if x["smoothed"] else "= per token",
             f"{lv(x['levels']['llm_int8'])} ({x['llm_int8_columns']})"]
            for x in r.linear_inputs]
    console.table(
        ["layer", "linears (input from)", "max |x|", "median dim max", "max/median", "per tensor", "per token",
         "SmoothQuant (max/median)", "LLM.int8 (16-bit cols)"],
        rows,
        title="the linears' inputs: INT8 levels the typical dimension spans under each W8A8 row",
        caption=f"{r.tokens} tokens ({r.source}); x = what the linears read (a norm's output, or the input of o_proj and "
                "down_proj), not the residual stream; levels: median over dimensions of 2 max|code| + 1 (of 255); per tensor = "
                "w8a8-tensor, per token = w8a8-token, SmoothQuant = smoothquant-w8a8 (alpha 0.5, max|x| from these tokens; it "
                "smooths the norm groups only, so o and down stay per token), LLM.int8 = llm-int8 (columns with |x| >= 6 in "
                "16-bit, the rest per token).",
        right=[0, 2, 3, 4, 5, 6, 7, 8],
    )
    experts = [x for x in r.linear_inputs if "expert" in x]
    if experts:
        console.note(f"- {len(experts)} rows are an expert's own: its gate/up on the tokens the router sent it, its down on "
                     "act(gate) * up of those (an expert no token reached has no row).")
    med = {k: sorted(x["levels"][k] for x in r.linear_inputs if x["levels"][k] is not None) for k in r.linear_inputs[0]["levels"]}
    say = ", ".join(f"{name} {v[len(v) // 2]:.0f}" for name, v in (("per tensor", med["per_tensor"]), ("per token", med["per_token"]),
                    ("SmoothQuant", med["smoothquant"]), ("LLM.int8", med["llm_int8"])) if v)
    console.note(f"- median over the {len(r.linear_inputs)} inputs of the levels a typical dimension spans: {say}.")


def sensitivity(r, by: str, rows: int, threshold: float, model: str | None) -> None:
    shown = r.units[: max(rows, 0)]
    console.table(
        ["rank", by, "KL (nats/token)", "rel. weight error", "max/std", "input outlier dims (residual)"],
        [[f"{i}", u.name, f"{u.kl:.5f}", f"{u.rel_error:.4f}", f"{u.max_over_std:.1f}",
          (", ".join(f"{d}{'*' if d in u.residual_outlier_dims else ''}" for d in u.input_outlier_dims) or "-")]
         for i, u in enumerate(shown, start=1)],
        title=f"qkit inspect sensitivity: {r.model}, {r.scheme} one {by} at a time",
        caption=f"KL(reference || one {by} at {r.scheme}) over {r.tokens} tokens ({r.source}); rel. weight error and "
                f"max/std as in qkit inspect errors; input outlier dims: channels of a hidden-sized input at least "
                f"{threshold:g}x the median channel, * = an outlier dimension of the residual stream "
                f"({', '.join(map(str, r.residual_outlier_dims)) or 'none'})."
                + (f" {len(r.units) - len(shown)} more in --json." if len(shown) < len(r.units) else ""),
        right=[0, 2, 3, 4],
    )
    console.note(r.sentence())
    if r.kept:
        console.note(r.command(model))


def next_token(r) -> None:
    first = r.rows[0]["tokens"]
    console.table(
        ["rank", "token", *[f"p at T={row['temperature']:g}" for row in r.rows]],
        [[f"{i + 1}", repr(t["token"]), *[f"{row['tokens'][i]['prob']:.4f}" for row in r.rows]] for i, t in enumerate(first)],
        title=f"qkit inspect next-token: {r.model}",
        caption=f"after {r.text!r}; p = softmax(logits / T).",
        right=[0, *range(2, 2 + len(r.rows))],
    )
    console.note("first / third: " + ", ".join(f"{row['ratio_first_third']:.3g} at T={row['temperature']:g}" for row in r.rows)
                 + " (at temperature T the ratio is the T=1 ratio to the power 1/T)")
