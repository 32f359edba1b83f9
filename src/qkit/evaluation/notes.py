"""What an eval's numbers do and do not support, in words: the notes under the table.

Layer 6 (``evaluation``): reads the rows of an ``EvalReport`` (``report``); the runner calls it last.
"""

from __future__ import annotations

import math

from qkit.evaluation.domains import worst
from qkit.evaluation.report import Row
from qkit.pinned_models import PinnedModel

COLLAPSE_FACTOR = 10.0  # a row whose perplexity is this many times the reference's has collapsed


def interpret(rows: list[Row], scored_tokens: int | None = None, *, model: PinnedModel | None = None) -> list[str]:
    """What the numbers do and do not support, in words. A statistic that could not be computed (NaN or
    infinite: no standard error, a model that produced NaN log-probabilities) is said to be missing, never
    called a difference or a match. ``model``: the reference is this pinned model, whose history (the default
    model's Q4_1, Gemma 3 270M's Q4_K_M) a row that reproduces its weights is explained by (any other model's
    notes name only the row's own grid)."""
    ref = rows[0]
    notes: list[str] = []
    refused = [r for r in rows[1:] if r.refused is not None]
    others = [r for r in rows[1:] if r.refused is None]  # a row an engine did not run has no numbers to read
    for r in refused:
        notes.append(f"{r.scheme}: not run: {r.refused}.")
    if not others:
        return notes
    finite = math.isfinite
    # A non-finite perplexity (NaN or inf log-probabilities) has collapsed as surely as a 10x one.
    collapsed = [r for r in others if not finite(r.perplexity) or r.perplexity >= COLLAPSE_FACTOR * ref.perplexity]
    history = f" ({model.history})" if model is not None else ""
    for r in others:
        if r.weights_changed == 0 and r.matrices:
            notes.append(f"{r.scheme} reproduces the reference's weights bit for bit: they already lie on {r.scheme}'s "
                         f"grid{history}, so this row measures nothing about the scheme or method; do not compare it "
                         "with the others.")
        elif r.weights_changed is not None and r.matrices and r.weights_changed < r.matrices:
            kept = r.matrices - r.weights_changed
            searched = f"; {model.searched}" if model is not None and model.searched else ""
            notes.append(f"{r.scheme} reproduces {kept} of its {r.matrices} quantized tensors bit for bit: their weights "
                         f"already lie on the grid {r.scheme} stores them in{history}{searched}, so that share of "
                         "the row measures the model's provenance, not the scheme or method: do not expect it on "
                         "other models.")
    for r in collapsed:
        if not finite(r.perplexity):
            notes.append(f"{r.scheme} collapsed: its perplexity is {r.perplexity} (the model's log-probabilities are not "
                         "finite); none of its corpus statistics can be compared.")
        else:
            notes.append(f"{r.scheme} collapsed: perplexity {r.perplexity:,.0f} is {r.perplexity / ref.perplexity:,.0f}x the reference's {ref.perplexity:.2f}.")
    on = f" on {scored_tokens:,} scored tokens" if scored_tokens is not None else ""
    for r in others:
        if r in collapsed:
            continue
        if r.domains:  # an eval suite: stated per domain, the worst named
            notes.append(domain_note(r))
            continue
        if not (finite(r.perplexity_change_pct) and finite(r.perplexity_change_se_pct)):
            notes.append(f"{r.scheme}: perplexity change {r.perplexity_change_pct:+.2f}% has no standard error{on}; "
                         "it is neither a difference nor a match: score more tokens (--tokens).")
            continue
        lo = r.perplexity_change_pct - 2 * r.perplexity_change_se_pct
        hi = r.perplexity_change_pct + 2 * r.perplexity_change_se_pct
        if lo <= 0 <= hi:
            notes.append(f"{r.scheme}: perplexity change {r.perplexity_change_pct:+.2f}% (±{2 * r.perplexity_change_se_pct:.2f}%, 2 paired SE) is indistinguishable from the reference on these tokens.")
        else:
            notes.append(f"{r.scheme}: perplexity {r.perplexity_change_pct:+.2f}% (±{2 * r.perplexity_change_se_pct:.2f}%, 2 paired SE) against the reference, a real difference on these tokens.")
    for runtime in dict.fromkeys(r.runtime for r in others):  # ranked within each runtime: like with like
        survivors = sorted((r for r in others if r.runtime == runtime and r not in collapsed and r.bits_per_weight < 6),
                           key=lambda r: worst(r.domains, "kld")["kld"] if r.domains else r.perplexity)
        where = "" if runtime == "torch" else f" in {runtime}"
        if len(survivors) > 1 and survivors[0].domains:
            notes.append(f"rows below 6 bits per weight{where} from best to worst KL on their worst domain (bits/w): "
                         + " < ".join(f"{r.scheme} ({worst(r.domains, 'kld')['kld']:.4f} {worst(r.domains, 'kld')['name']}, "
                                      f"{r.bits_per_weight:.2f})" for r in survivors) + ".")
        elif len(survivors) > 1 and all(r.bits_per_weight < 5 for r in survivors):
            notes.append(f"4-bit rows{where} from best to worst perplexity: "
                         + " < ".join(f"{r.scheme} ({r.perplexity:.2f})" for r in survivors) + ".")
        elif len(survivors) > 1:  # a mixed recipe (q4_k_m on 576-wide rows: mostly Q5_0) is not a 4-bit row: say its bits
            notes.append(f"rows below 6 bits per weight{where} from best to worst perplexity (bits/w): " + " < ".join(
                f"{r.scheme} ({r.perplexity:.2f}, {r.bits_per_weight:.2f})" for r in survivors) + ".")
    if ref.battery_total:  # McNemar needs paired answers; no questions, no test
        distinct = [r for r in others if finite(r.mcnemar_p) and r.mcnemar_p < 0.05]
        if distinct:
            notes.append("battery differences distinguishable from the reference (exact McNemar p < 0.05): "
                         + ", ".join(f"{r.scheme} ({r.battery_correct}/{r.battery_total}, {_p(r.mcnemar_p)})" for r in distinct) + ".")
        same = [r.scheme for r in others if finite(r.mcnemar_p) and r.mcnemar_p >= 0.05]
        if same:
            notes.append(f"battery differences of {', '.join(same)} against the reference are not distinguishable "
                         f"(exact McNemar p >= 0.05): with {ref.battery_total} questions, a difference needs at least "
                         f"{_min_discordant(0.05)} answers changing in one direction to count.")
    for r in others:  # a calibrated row against the same scheme with rtn (Row.versus): what the method bought
        v = r.versus
        if not v or r in collapsed:
            continue
        kl, se = v["kld_change"], v["kld_change_se"]
        if not (finite(kl) and finite(se)):
            notes.append(f"{r.scheme} against {v['against']}: KL change {kl:+.4f} has no standard error; neither a gain nor a loss.")
            continue
        verdict = ("a real gain" if kl + 2 * se < 0 else "a real loss" if kl - 2 * se > 0
                   else "within two paired SE: not distinguishable")
        if r.weights_changed is not None and r.matrices and r.weights_changed < r.matrices:
            verdict += (f", but {r.matrices - r.weights_changed} of its tensors reproduce the reference's weights "
                        "exactly (above): on this model that share of the gain is the grid, not the method")
        notes.append(f"{r.scheme} against {v['against']}: KL {kl:+.4f} (±{2 * se:.4f}, 2 paired SE), perplexity "
                     f"{v['perplexity_change_pct']:+.2f}% (±{2 * v['perplexity_change_se_pct']:.2f}%): {verdict}"
                     + per_domain(v.get("domains") or {}) + ".")
    notes.extend(engine_notes(others))
    measured = [r for r in others if r.agreement_total]
    if measured:
        best = max(measured, key=lambda r: r.agreement / r.agreement_total)
        notes.append(f"greedy agreement is the acceptance rate of a quantized draft in speculative decoding: best {best.scheme} "
                     f"{best.agreement}/{best.agreement_total} ({100 * best.agreement / best.agreement_total:.0f}%).")
    return notes


def per_domain(domains: dict) -> str:
    """A paired comparison per domain of an eval suite (``Row.versus["domains"]``): each domain's KL change and
    whether it is a gain, a loss or within two paired SE; "" for one text."""
    def word(d: dict) -> str:
        kl, se = d["kld_change"], d["kld_change_se"]
        if not (math.isfinite(kl) and math.isfinite(se)):
            return "no SE"
        return "gain" if kl + 2 * se < 0 else "loss" if kl - 2 * se > 0 else "same"

    return ("; per domain, KL " + ", ".join(f"{name} {d['kld_change']:+.4f} ({word(d)})" for name, d in domains.items())
            if domains else "")


def domain_note(r: Row) -> str:
    """A row over an eval suite: its worst domain's KL, and on how many domains its perplexity change is
    beyond two paired SE (each named with its change)."""
    real = [d for d in r.domains if math.isfinite(d["perplexity_change_pct"]) and math.isfinite(d["perplexity_change_se_pct"])
            and abs(d["perplexity_change_pct"]) > 2 * d["perplexity_change_se_pct"]]
    unknown = [d["name"] for d in r.domains if not math.isfinite(d["perplexity_change_se_pct"])]
    w = worst(r.domains, "kld")
    text = (f"{r.scheme}: KL worst on {w['name']} ({w['kld']:.4f} ± {w['kld_se']:.4f}); perplexity change beyond two "
            f"paired SE on {len(real)} of {len(r.domains)} domains")
    if real:
        text += " (" + ", ".join(f"{d['name']} {d['perplexity_change_pct']:+.1f}% ± {2 * d['perplexity_change_se_pct']:.1f}%"
                                 for d in real) + ")"
    if unknown:
        text += f"; no standard error on {', '.join(unknown)}"
    return text + "."


def engine_notes(rows: list[Row]) -> list[str]:
    """Engine minus torch for each engine row with the torch row of its spec (``Row.versus_torch``): where
    the simulation does not predict the engine; then what each engine said, once per engine."""
    finite = math.isfinite
    notes = []
    for r in rows:
        v = r.versus_torch
        if not v:
            continue
        pct, se = v["perplexity_change_pct"], v["perplexity_change_se_pct"]
        if not (finite(pct) and finite(se)):
            notes.append(f"{r.scheme} minus {v['against']} (torch): perplexity {pct:+.2f}% has no standard error.")
            continue
        verdict = ("beyond two paired SE: the torch row does not predict the engine's perplexity here" if abs(pct) > 2 * se
                   else "within two paired SE: the torch row predicts the engine's perplexity")
        text = (f"{r.scheme} minus {v['against']} (torch), paired on the same tokens: perplexity {pct:+.2f}% "
                f"(±{2 * se:.2f}%, 2 SE), {verdict}")
        if "kld_change" in v and finite(v["kld_change"]) and finite(v["kld_change_se"]):
            kl, kl_se = v["kld_change"], v["kld_change_se"]
            # KL is never negative, so any engine noise adds to it: the sign says which side is further off
            text += (f"; KL {kl:+.4f} (±{2 * kl_se:.4f}): the engine's distribution is "
                     + ("further from" if kl - 2 * kl_se > 0 else "closer to" if kl + 2 * kl_se < 0 else "as far from")
                     + " the reference's than torch's")
        else:
            text += "; KL not computable (the engine gives no full distribution)"
        notes.append(f"{text}.")
    said: set[str] = set()
    for r in rows:
        for line in r.engine.get("notes", []):
            if line not in said:
                said.add(line)
                notes.append(line if line.endswith(".") else f"{line}.")
    return notes


def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def _min_discordant(alpha: float) -> int:
    """Smallest n such that n discordant pairs all in one direction reach exact McNemar p < alpha."""
    n = 1
    while 2 * 0.5**n >= alpha:
        n += 1
    return n


__all__ = ["domain_note", "engine_notes", "interpret", "per_domain"]
