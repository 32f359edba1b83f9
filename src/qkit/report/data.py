"""What each figure plots, as values: pure functions from a command's JSON to the numbers drawn and tabled.

No plotting here (``figures`` draws these values), so the tests check a figure's data against the JSON it
came from. Every function takes the parsed JSON of one kind (``qkit.report.inputs``) and returns plain
Python values: lists of dicts (one per point, row or bar) or a ``Grid`` for a heatmap. A number the JSON
could not compute (``null``) stays ``None`` and is not drawn.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from qkit.evaluation.columns import frontier_panels, page_cells, page_headers
from qkit.evaluation.measures import fixed

# Block projections in the order a layer runs them (the heatmaps' columns); names not listed follow, sorted.
MATRIX_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>[0-9]+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"(?:^|\.)(?P<column>experts\.(?P<expert>[0-9]+)\.[^.]+)$")  # one expert's matrix


def split_name(name: str) -> tuple[int, str] | None:
    """``model.layers.12.mlp.down_proj.weight`` -> ``(12, "down_proj")``; a mixture-of-experts model's expert
    matrix keeps its expert, ``model.layers.1.mlp.experts.3.gate_proj.weight`` -> ``(1, "experts.3.gate_proj")``
    (mixtral's ``block_sparse_moe.experts.3.w1`` -> ``"experts.3.w1"``), so each expert has its own column;
    None for a tensor outside the layers."""
    m = _LAYER.search(name)
    if m is None:
        return None
    rest = m.group("rest")
    rest = rest[: -len(".weight")] if rest.endswith(".weight") else rest
    expert = _EXPERT.search(rest)
    return int(m.group("layer")), expert.group("column") if expert else rest.rsplit(".", 1)[-1]


def _num(x: Any) -> float | None:
    """A finite float, or None (JSON ``null``, NaN, a missing key)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


# --------------------------------------------------------------------------- eval: the quality table, the frontier


def row_kind(row: dict) -> str:
    """How a row is drawn on the frontier: ``engine`` (measured in vLLM or llama.cpp), ``plan`` (a planned
    mix), ``simulation`` (activations or the KV cache quantized at run time, simulated in torch: the spec's
    ``simulation``; bits/w alone does not place it), else ``uniform`` (one scheme for every block projection).
    An eval JSON written before the spec's simulations had their own word names them ``spec["runtime"]``; it
    reads the same. (A row's ``runtime``, the engine that measured it, is another thing: ``engine``.)"""
    spec = row.get("spec") or {}
    if (row.get("runtime") or "torch") != "torch":
        return "engine"
    if spec.get("plan"):
        return "plan"
    if spec.get("simulation", spec.get("runtime")) or row.get("act_bits") or row.get("kv_bits"):
        return "simulation"
    return "uniform"


def frontier_points(eval_doc: dict) -> list[dict]:
    """One point per measured row (the reference, rows[0], and refused rows excluded), in the JSON's order:

    ``{"name", "kind", "runtime", "bits" (bits_per_weight)}`` and, for each panel of the frontier
    (``columns.frontier_panels``: ``kld`` and ``kld_se``, ``perplexity_change_pct`` and its paired SE
    ``perplexity_change_se_pct``, %), the measure's value and SE under its JSON key (None where absent); the
    figure's bars are ``± 2 * se``. Values are the JSON's own."""
    keys = [k for key, se_key, _ in frontier_panels() for k in (key, se_key) if k is not None]
    out = []
    for row in (eval_doc.get("rows") or [])[1:]:
        if row.get("refused"):
            continue
        bits = _num(row.get("bits_per_weight"))
        if bits is None:
            continue
        out.append({"name": row.get("scheme"), "kind": row_kind(row), "runtime": row.get("runtime") or "torch",
                    "bits": bits, **{k: _num(row.get(k)) for k in keys}})
    return out


def quality_table(eval_doc: dict) -> tuple[list[str], list[list[str]]]:
    """``(headers, rows)`` of ``qkit eval``'s table: every row, the reference first, refused rows with their
    reason; the measures' columns from their registry (``evaluation.columns``)."""
    headers = ["row", "runtime", "bits/w", "size (MB)", *page_headers()]
    rows = []
    for i, r in enumerate(eval_doc.get("rows") or []):
        if r.get("refused"):
            rows.append([str(r.get("scheme")), str(r.get("runtime") or "torch"), "refused: " + str(r["refused"]),
                         *[""] * (len(headers) - 3)])
            continue
        bits, size = _num(r.get("bits_per_weight")), _num(r.get("size_bytes"))
        rows.append([
            str(r.get("scheme")), str(r.get("runtime") or "torch"),
            f"{bits:.3f}" if bits is not None else "-",
            fixed(size / 1e6, 1) if size is not None else "-",
            *page_cells(r, i == 0),
        ])
    return headers, rows


def engine_rows(eval_doc: dict) -> list[dict]:
    """Rows measured in an engine (``runtime`` not torch), each against the torch row of the same spec:
    ``{"name", "runtime", "refused", "perplexity", "dppl_vs_torch", "dppl_vs_torch_se", "kld_vs_torch",
    "kld_vs_torch_se", "against", "version"}`` (from ``versus_torch`` and ``engine``; None where absent)."""
    out = []
    for r in eval_doc.get("rows") or []:
        if (r.get("runtime") or "torch") == "torch":
            continue
        v, e = r.get("versus_torch") or {}, r.get("engine") or {}
        out.append({"name": r.get("scheme"), "runtime": r.get("runtime"), "refused": r.get("refused"),
                    "perplexity": None if r.get("refused") else _num(r.get("perplexity")),
                    "dppl_vs_torch": _num(v.get("perplexity_change_pct")),
                    "dppl_vs_torch_se": _num(v.get("perplexity_change_se_pct")),
                    "kld_vs_torch": _num(v.get("kld_change")), "kld_vs_torch_se": _num(v.get("kld_change_se")),
                    "against": v.get("against"), "version": e.get("version")})
    return out


# --------------------------------------------------------------------------- heatmaps: layer x matrix


@dataclass
class Grid:
    """A layer x matrix heatmap: ``cells[i][j]`` is the value of matrix ``columns[j]`` in layer ``layers[i]``
    (None: no such tensor); ``labels`` the same shape, text for a cell (e.g. a planned type), or None."""

    layers: list[int]
    columns: list[str]
    cells: list[list[float | None]]
    labels: list[list[str | None]] | None = None

    def values(self) -> list[float]:
        return [v for row in self.cells for v in row if v is not None]


def _column_key(name: str) -> tuple:
    """The layer's own matrices in ``MATRIX_ORDER``, then each expert's (by expert number, then in
    ``MATRIX_ORDER``), then the rest by name."""
    if name in MATRIX_ORDER:
        return 0, MATRIX_ORDER.index(name), 0, name
    expert = _EXPERT.search(name)
    if expert is None:
        return 2, 0, 0, name
    matrix = name.rsplit(".", 1)[-1]
    return 1, int(expert.group("expert")), MATRIX_ORDER.index(matrix) if matrix in MATRIX_ORDER else len(MATRIX_ORDER), name


def _columns(names: list[str]) -> list[str]:
    return sorted(set(names), key=_column_key)


def grid(values: dict[str, float | None], labels: dict[str, str] | None = None) -> Grid:
    """``{tensor name: value}`` -> a ``Grid`` (tensors outside ``layers.N`` are left out)."""
    placed = {}
    for name, v in values.items():
        where = split_name(name)
        if where is not None:
            placed[where] = (v, (labels or {}).get(name))
    layers = sorted({layer for layer, _ in placed})
    columns = _columns(sorted({m for _, m in placed}))
    cells = [[_num(placed[(layer, c)][0]) if (layer, c) in placed else None for c in columns] for layer in layers]
    text = None
    if labels is not None:
        text = [[placed[(layer, c)][1] if (layer, c) in placed else None for c in columns] for layer in layers]
    return Grid(layers, columns, cells, text)


def error_schemes(errors_doc: dict) -> list[str]:
    """The schemes ``inspect errors`` measured, in its order."""
    return [s["scheme"] for s in errors_doc.get("schemes") or [] if isinstance(s, dict) and "scheme" in s]


def error_grid(errors_doc: dict, scheme: str) -> Grid:
    """Relative error ||W - Ŵ||_F / ||W||_F of each block projection under ``scheme`` (the JSON's ``rel_error``)."""
    return grid({m["name"]: m.get("rel_error") for m in errors_doc.get("matrices") or [] if m.get("scheme") == scheme})


def error_summary(errors_doc: dict) -> tuple[list[str], list[list[str]]]:
    """Per scheme: bits/w, mean, median and worst relative error and the worst matrix."""
    rows = []
    for s in errors_doc.get("schemes") or []:
        rows.append([str(s.get("scheme")), f"{_num(s.get('bits_per_weight')) or 0:.3f}", f"{s.get('matrices')}",
                     fixed(_num(s.get('mean')) or 0, 4), fixed(_num(s.get('median')) or 0, 4),
                     fixed(_num(s.get('worst')) or 0, 4), str(s.get("worst_matrix"))])
    return ["scheme", "bits/w", "matrices", "mean", "median", "worst", "worst matrix"], rows


# --------------------------------------------------------------------------- sensitivity


def sensitivity_units(sens_doc: dict) -> list[dict]:
    """Per unit (a layer, or a matrix with ``--by matrix``), in layer order: ``{"name", "layer", "matrix",
    "kl", "rel_error", "outlier_dims"}``; ``kl`` is the KL (nats/token) from the reference with only
    this unit quantized (the JSON's ``kl``)."""
    out = []
    for u in sens_doc.get("units") or []:
        name = str(u.get("name"))
        where = split_name(name + ".weight") if sens_doc.get("by") == "matrix" else None
        m = re.search(r"layers\.([0-9]+)$", name)
        layer = where[0] if where else (int(m.group(1)) if m else None)
        out.append({"name": name, "layer": layer, "matrix": where[1] if where else None, "kl": _num(u.get("kl")),
                    "rel_error": _num(u.get("rel_error")), "outlier_dims": list(u.get("input_outlier_dims") or [])})
    return sorted(out, key=lambda u: (u["layer"] if u["layer"] is not None else 1 << 30, u["matrix"] or "", u["name"]))


def sensitivity_grid(sens_doc: dict) -> Grid:
    """With ``--by matrix``: each matrix's KL as a layer x matrix grid."""
    return grid({f"{u.get('name')}": u.get("kl") for u in sens_doc.get("units") or []})


# --------------------------------------------------------------------------- outliers


def outlier_histogram(out_doc: dict) -> list[dict]:
    """The histogram of per-dimension max |h| at ``out_doc["layer"]``: ``{"lo", "hi", "count"}`` per octave bin."""
    return [{"lo": float(b["lo"]), "hi": float(b["hi"]), "count": int(b["count"])} for b in out_doc.get("histogram") or []]


def outlier_persistence(out_doc: dict) -> dict:
    """Each outlier dimension's max |h| at every layer, and the median dimension's max for scale:

    ``{"layers": [0..L-1], "median": [median_dim_max per layer], "dims": [{"dim", "values", "outlier_layers",
    "n_layers"}]}`` (``values[i]`` at ``layers[i]``, the JSON's ``outlier_dims[*].values``)."""
    per_layer = sorted(out_doc.get("per_layer") or [], key=lambda p: p["layer"])
    dims = [{"dim": int(d["dim"]), "values": [float(v) for v in d.get("values") or []],
             "outlier_layers": list(d.get("layers") or []), "n_layers": int(d.get("n_layers") or 0)}
            for d in out_doc.get("outlier_dims") or []]
    return {"layers": [int(p["layer"]) for p in per_layer], "median": [float(p["median_dim_max"]) for p in per_layer],
            "dims": dims}


def persistence_table(out_doc: dict) -> tuple[list[str], list[list[str]]]:
    rows = []
    n = len(out_doc.get("per_layer") or [])
    for d in out_doc.get("outlier_dims") or []:
        rows.append([str(d["dim"]), f"{d.get('n_layers')} of {n}", str(d.get("layer_ranges")),
                     f"{fixed(_num(d.get('peak')) or 0, 0)} (layer {d.get('peak_layer')})", str(d.get("near_peak_layers"))])
    return ["dim", "outlier in", "layers", "peak max |h|", "within 5% of peak"], rows


def int8_levels(out_doc: dict) -> tuple[list[str], list[list[str]]]:
    """The INT8 table of ``inspect outliers``: one tensor-wide scale over all dimensions against one with the
    top dimensions left out: scale, levels used of 256, and the levels a few typical dimensions span."""
    i8 = out_doc.get("int8") or {}
    rows = []
    for key, label in (("all", "all dimensions"), ("without_top", f"without {', '.join(map(str, i8.get('excluded_dims') or []))}")):
        part = i8.get(key) or {}
        typical = ", ".join(f"dim {t['dim']}: {t['levels']}" for t in part.get("typical") or [])
        rows.append([label, f"{_num(part.get('scale')) or 0:.4g}", f"{part.get('levels_used')} of {part.get('levels_total')}",
                     typical])
    return ["scale over", "scale (|h| per step)", "levels used", "levels a typical dimension spans"], rows


# --------------------------------------------------------------------------- plan


def plan_grid(plan_doc: dict) -> Grid:
    """Each planned tensor's bits per weight, 8 * bytes / weights (scales included), labelled with its type."""
    values, labels = {}, {}
    for name, t in (plan_doc.get("tensors") or {}).items():
        n = math.prod(t.get("shape") or [0])
        values[name] = 8 * t["bytes"] / n if n else None
        labels[name] = str(t.get("type"))
    return grid(values, labels)


def plan_types(plan_doc: dict) -> tuple[list[str], list[list[str]]]:
    """Tensors and bytes per chosen type, and the plan's totals."""
    by: dict[str, list[int]] = {}
    for t in (plan_doc.get("tensors") or {}).values():
        c = by.setdefault(str(t.get("type")), [0, 0, 0])
        c[0] += 1
        c[1] += int(t.get("bytes") or 0)
        c[2] += math.prod(t.get("shape") or [0])
    rows = [[k, str(c[0]), f"{c[1]:,}", f"{8 * c[1] / c[2]:.3f}" if c[2] else "-"] for k, c in sorted(by.items())]
    tot = plan_doc.get("totals") or {}
    rows.append(["total", str(len(plan_doc.get("tensors") or {})), f"{tot.get('bytes') or 0:,}",
                 f"{_num(tot.get('bits_per_weight')) or 0:.3f}"])
    return ["type", "tensors", "bytes", "bits/w"], rows


# --------------------------------------------------------------------------- memory: kv, budget


def kv_variants(kv_doc: dict) -> list[dict]:
    """KV bytes per token of this model and of the same model with full multi-head and multi-query attention."""
    return [{"attention": v["attention"], "kv_heads": int(v["kv_heads"]), "bytes_per_token": int(v["bytes_per_token"]),
             "total_bytes": int(v["total_bytes"])} for v in kv_doc.get("variants") or []]


def budget_bars(budget_doc: dict, model: str | None = None) -> list[dict]:
    """Per card size and format: the resident tokens that fit (``max_tokens``) and the row's status, for the
    model labelled or named ``model`` (default: the first model in the budget)."""
    models = budget_doc.get("models") or []
    label = None
    for m in models:
        if model is None or (m.get("architecture") or {}).get("name") == model or m.get("label") == model:
            label = m.get("label")
            break
    out = []
    for t in budget_doc.get("tables") or []:
        for r in t.get("rows") or []:
            if label is None or r.get("model") == label:
                out.append({"gpu_gib": float(t["gpu_gib"]), "format": str(r["format"]), "max_tokens": int(r["max_tokens"]),
                            "weight_bytes": int(r["weight_bytes"]), "conversations": int(r["conversations"]),
                            "status": str(r["status"])})
    return out


# --------------------------------------------------------------------------- provenance


def provenance_rows(docs: dict[str, dict], paths: dict[str, str | None], seconds: dict[str, float]) -> list[list[str]]:
    """One row per input: kind, file (or "computed by this run"), model, qkit and torch versions, the
    model's and the corpus's sha256, seconds the command took."""
    rows = []
    for kind, doc in docs.items():
        prov = doc.get("provenance") if kind == "eval" else None
        arch = doc.get("architecture") if isinstance(doc.get("architecture"), dict) else {}
        model = (prov or {}).get("model") or doc.get("model") or arch.get("name") or ""
        if kind == "budget":
            model = ", ".join(str((m.get("architecture") or {}).get("name") or m.get("label")) for m in doc.get("models") or [])
        source = (prov or {}).get("model_source") or {}
        model_sha = source.get("sha256") or doc.get("model_fingerprint") or ""
        corpus_sha = ((prov or {}).get("corpus") or {}).get("sha256", "")
        version = (prov or {}).get("qkit_version") or doc.get("qkit_version") or "not recorded"
        secs = seconds.get(kind)
        if secs is None:
            secs = _num((prov or {}).get("seconds_total")) if prov else _num(doc.get("seconds"))
        rows.append([kind, paths.get(kind) or "computed by this run", str(model), str(version),
                     str((prov or {}).get("torch_version") or ""), str(model_sha), str(corpus_sha),
                     fixed(secs, 1) if secs is not None else "not recorded"])
    return rows


PROVENANCE_HEADERS = ["kind", "file", "model", "qkit", "torch", "model sha256 / fingerprint", "corpus sha256", "seconds"]

__all__ = ["MATRIX_ORDER", "PROVENANCE_HEADERS", "Grid", "budget_bars", "engine_rows", "error_grid", "error_schemes",
           "error_summary", "fixed", "frontier_points", "grid", "int8_levels", "kv_variants", "outlier_histogram",
           "outlier_persistence", "persistence_table", "plan_grid", "plan_types", "provenance_rows", "quality_table",
           "row_kind", "sensitivity_grid", "sensitivity_units", "split_name"]
