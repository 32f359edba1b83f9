"""The page: one self-contained HTML file, every figure an inline SVG, every style inline, no script, no link.

``render(inputs)`` returns ``(html, figures)``. Every section is always on the page, under a fixed id
(``SECTIONS``): with its data, the figure beside its table; without, a note naming the command whose
JSON would fill it. Nothing is fetched when the page opens (no CDN, font or image URL), so it opens offline.
"""

from __future__ import annotations

import html
from collections.abc import Callable

from qkit.console import printable
from qkit.evaluation.columns import frontier_panels
from qkit.evaluation.measures import FrontierPanel
from qkit.report import data, figures
from qkit.report.inputs import COMMANDS, Inputs
from qkit.version import __version__

# (id, title, the kinds whose JSON fills it): the page's order.
SECTIONS = (
    ("quality", "Quality table", ("eval",)),
    ("frontier", "Size against quality: the frontier", ("eval",)),
    ("errors", "Per-matrix weight error by layer", ("errors",)),
    ("sensitivity", "Per-layer sensitivity", ("sensitivity",)),
    ("outliers", "Residual-stream outliers", ("outliers",)),
    ("plan", "The plan: each tensor's type", ("plan",)),
    ("memory", "KV cache and the memory budget per card", ("kv", "budget")),
    ("engines", "Engines against simulation", ("eval",)),
    ("provenance", "Provenance", ()),
)
SECTION_IDS = tuple(s[0] for s in SECTIONS)

_CSS = """
body{font-family:"DejaVu Sans",Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1500px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
h3{font-size:1em}section.absent h2{color:#888}
.pair{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start}
.fig{flex:2 1 700px;max-width:100%;overflow-x:auto}.fig svg{max-width:100%;height:auto}
.tab{flex:1 1 380px;overflow-x:auto}
table{border-collapse:collapse;font-size:.8em}th,td{border:1px solid #ddd;padding:.2em .45em;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.note{color:#555;font-size:.9em}.absent .note{font-style:italic}code{background:#f3f3f3;padding:0 .2em}
details{margin:.5em 0}summary{cursor:pointer;color:#335}
"""


def _count(x: object) -> str:
    """An integer with thousands separators; anything else (absent: None) as it is."""
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else str(x)


def _esc(x: object) -> str:
    """``x`` as page text: control characters shown escaped (``qkit.console.printable``), then HTML-escaped."""
    return html.escape(printable(x), quote=True)


def printable_strings(value: object) -> object:
    """A parsed JSON document with every string in it (keys too) made printable (``qkit.console.printable``):
    what the tables, the figures' labels and the SVG text are drawn from. An SVG holding a raw control
    character is not even well-formed XML."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k): printable_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_strings(v) for v in value]
    return value


def table(headers: list[str], rows: list[list[str]], caption: str | None = None) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    cap = f"<caption class=\"note\">{_esc(caption)}</caption>" if caption else ""
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def grid_table(g: data.Grid, digits: int = 4) -> str:
    headers = ["layer", *g.columns]
    rows = [[str(layer), *[("-" if v is None else f"{v:.{digits}g}") + (f" {g.labels[i][j]}" if g.labels and g.labels[i][j] else "")
                           for j, v in enumerate(row)]] for i, (layer, row) in enumerate(zip(g.layers, g.cells))]
    return table(headers, rows)


def note(text: str) -> str:
    return f"<p class=\"note\">{_esc(text)}</p>"


def pair(fig: figures.Figure | None, right: str) -> str:
    left = f"<div class=\"fig\">{fig.svg()}</div>" if fig is not None else ""
    return f"<div class=\"pair\">{left}<div class=\"tab\">{right}</div></div>"


class _Page:
    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        self.figures: list[figures.Figure] = []

    def fig(self, f: figures.Figure) -> figures.Figure:
        self.figures.append(f)
        return f

    # ------------------------------------------------------------------ sections

    def quality(self, doc: dict) -> str:
        headers, rows = data.quality_table(doc)
        p = doc.get("provenance") or {}
        corpus = (p.get("corpus") or {}).get("name", "the corpus")
        domains = [d.get("name") for d in p.get("domains") or [] if isinstance(d, dict)]
        if domains:  # an eval suite: the row's numbers pool its domains; qkit eval's table states the worst
            corpus = f"{corpus}, pooled over its {len(domains)} domains ({', '.join(map(str, domains))}; each in the JSON)"
        cap = (f"perplexity ± SE over {p.get('scored_tokens', '?'):,} scored tokens of {corpus} (window {p.get('window')}); "
               "Δ ppl ± paired SE against the reference (first row); KL(reference ‖ row) ± SE; battery and greedy agreement "
               "as qkit eval prints them.") if isinstance(p.get("scored_tokens"), int) else None
        notes = "".join(note(n) for n in doc.get("notes") or [])
        return table(headers, rows, cap) + notes

    def frontier(self, doc: dict) -> str:
        points = data.frontier_points(doc)
        if not points:
            return note("the eval JSON has no measured quantized row to place on the frontier")
        panels = frontier_panels()

        def cell(p: dict, key: str, se_key: str | None, panel: FrontierPanel) -> str:
            if p[key] is None:
                return "-"
            value = data.fixed(p[key], panel.digits, sign=panel.sign)
            return value if se_key is None else f"{value} ± {data.fixed(2 * (p[se_key] or 0), panel.digits)}"

        rows = [[p["name"], p["kind"], p["runtime"], f"{p['bits']:.3f}", *(cell(p, *panel) for panel in panels)]
                for p in points]
        names = [panel.name for _, _, panel in panels]
        drawn = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        t = table(["row", "kind", "runtime", "bits/w", *(panel.column for _, _, panel in panels)], rows,
                  f"the points drawn: each row's bits/w, {drawn} from the eval JSON, bars ± 2 standard errors")
        return pair(self.fig(figures.frontier(points, panels)), t)

    def errors(self, doc: dict) -> str:
        schemes = data.error_schemes(doc)
        grids = [(s, data.error_grid(doc, s)) for s in schemes]
        grids = [(s, g) for s, g in grids if g.values()]
        headers, rows = data.error_summary(doc)
        t = table(headers, rows, "relative error ||W - Ŵ||_F / ||W||_F of each block projection (qkit inspect errors)")
        if not grids:
            return t
        details = "".join(f"<details><summary>{_esc(s)}: every cell</summary>{grid_table(g)}</details>" for s, g in grids)
        f = self.fig(figures.heatmaps("errors", grids, "relative error ||W - Ŵ||_F / ||W||_F"))
        return pair(f, t + details)

    def sensitivity(self, doc: dict) -> str:
        units = data.sensitivity_units(doc)
        ranked = sorted((u for u in units if u["kl"] is not None), key=lambda u: -u["kl"])
        rows = [[u["name"], data.fixed(u['kl'], 4), "-" if u["rel_error"] is None else data.fixed(u['rel_error'], 4),
                 ", ".join(map(str, u["outlier_dims"])) or "-"] for u in ranked]
        sug = (doc.get("suggestion") or {}).get("sentence")
        cap = f"KL (nats/token) from the reference with only this {doc.get('by')} at {doc.get('scheme')}, on {doc.get('tokens')} tokens of {doc.get('source')}; ranked"
        t = table([doc.get("by", "unit"), "KL", "rel. error", "outlier input dims"], rows, cap)
        t += note(sug) if sug else ""
        t += note(doc["note"]) if doc.get("note") else ""
        if doc.get("by") == "matrix":
            f = self.fig(figures.heatmaps("sensitivity", [(str(doc.get("scheme")), data.sensitivity_grid(doc))],
                                          "KL, nats/token (this matrix alone quantized)"))
        else:
            f = self.fig(figures.sensitivity_bars(units, str(doc.get("scheme"))))
        return pair(f, t)

    def outliers(self, doc: dict) -> str:
        layer = doc.get("layer")
        bins = data.outlier_histogram(doc)
        hist = self.fig(figures.outlier_histogram(bins, layer))
        t1 = table(["max |h| bin", "dimensions"], [[f"{b['lo']:g}-{b['hi']:g}", str(b["count"])] for b in bins],
                   f"{doc.get('hidden')} dimensions at layer {layer}, {doc.get('tokens')} tokens of {doc.get('source')}")
        pers = self.fig(figures.outlier_persistence(data.outlier_persistence(doc)))
        h2, r2 = data.persistence_table(doc)
        t2 = table(h2, r2, f"an outlier: max |h| at least {doc.get('threshold')}x the median dimension's")
        h3, r3 = data.int8_levels(doc)
        t3 = table(h3, r3, f"one INT8 scale for the whole tensor at layer {layer}: levels used of 256")
        return (f"<h3>histogram at layer {_esc(layer)}</h3>" + pair(hist, t1) + "<h3>persistence across layers</h3>"
                + pair(pers, t2) + "<h3>INT8 levels</h3>" + t3)

    def plan(self, doc: dict) -> str:
        g = data.plan_grid(doc)
        headers, rows = data.plan_types(doc)
        target = doc.get("target") or {}
        cap = (f"{doc.get('target_format')} plan for {', '.join(f'{k} {v}' for k, v in sorted(target.items()))}; "
               f"predicted KL {data.fixed((doc.get('totals') or {}).get('predicted_kl') or 0, 4)} nats/token")
        t = table(headers, rows, cap) + f"<details><summary>every tensor</summary>{grid_table(g)}</details>"
        if not g.values():
            return t
        return pair(self.fig(figures.heatmaps("plan", [("bits per weight", g)], "bits per weight", log=False)), t)

    def memory(self, kv: dict | None, budget: dict | None) -> str:
        out = ""
        if kv is not None:
            v = data.kv_variants(kv)
            t = table(["attention", "kv heads", "bytes/token", f"{_count(kv.get('tokens'))} tokens x {kv.get('users')}"],
                      [[x["attention"], str(x["kv_heads"]), f"{x['bytes_per_token']:,}", f"{x['total_bytes']:,} B"] for x in v],
                      f"{kv.get('dtype')} cache (qkit kv)")
            out += "<h3>KV bytes</h3>" + pair(self.fig(figures.kv_bars(v)), t)
        else:
            out += _absent_note(("kv",))
        if budget is not None:
            bars = data.budget_bars(budget, self.inputs.model())
            t = table(["card", "format", "weights (B)", "max tokens", "conversations", "status"],
                      [[f"{b['gpu_gib']:g} GiB", b["format"], f"{b['weight_bytes']:,}", f"{b['max_tokens']:,}",
                        f"{b['conversations']:,}", b["status"]] for b in bars],
                      f"{budget.get('reserve_gib')} GiB reserve, {budget.get('kv_dtype')} cache, "
                      f"{_count(budget.get('conversation'))}-token conversations (qkit budget)")
            out += "<h3>memory budget per card</h3>" + pair(self.fig(figures.budget_bars(bars)), t)
        else:
            out += _absent_note(("budget",))
        return out

    def engines(self, doc: dict) -> str:
        rows = data.engine_rows(doc)
        if not rows:
            return note("no row of the eval JSON was measured in an engine (qkit eval --runtime vllm or llama.cpp adds them)")
        t = table(["row", "runtime", "engine version", "perplexity", "Δ ppl vs torch % ± 2 SE", "ΔKL vs torch ± 2 SE",
                   "refused"],
                  [[r["name"], r["runtime"], r["version"] or "-", "-" if r["perplexity"] is None else data.fixed(r['perplexity'], 3),
                    "-" if r["dppl_vs_torch"] is None else f"{data.fixed(r['dppl_vs_torch'], 2, sign=True)} ± {data.fixed(2 * (r['dppl_vs_torch_se'] or 0), 2)}",
                    "-" if r["kld_vs_torch"] is None else f"{data.fixed(r['kld_vs_torch'], 4, sign=True)} ± {data.fixed(2 * (r['kld_vs_torch_se'] or 0), 4)}",
                    r["refused"] or ""] for r in rows],
                  "each engine row against the torch row of the same spec (paired on the same positions)")
        f = self.fig(figures.engine_versus(rows)) if any(r["dppl_vs_torch"] is not None for r in rows) else None
        return pair(f, t)

    def provenance(self) -> str:
        i = self.inputs
        rows = data.provenance_rows(i.docs, i.paths, i.seconds)
        return table(data.PROVENANCE_HEADERS, rows) + note(f"this page: qkit report, qkit {__version__}")


def _absent_note(kinds: tuple[str, ...]) -> str:
    return note("absent: no " + " or ".join(f"{k} JSON" for k in kinds) + " was given; "
                + "; ".join(f"write it with {COMMANDS[k]} and pass it to qkit report" for k in kinds))


def render(inputs: Inputs) -> tuple[str, list[figures.Figure]]:
    """The page's HTML and the figures drawn in it (for ``--png``). Deterministic: the same inputs give the
    same bytes."""
    inputs = Inputs({k: printable_strings(d) for k, d in inputs.docs.items()}, dict(inputs.paths), dict(inputs.seconds))
    page = _Page(inputs)
    model = inputs.model() or "unknown model"
    builders: dict[str, Callable[[], str]] = {
        "quality": lambda: page.quality(inputs.docs["eval"]),
        "frontier": lambda: page.frontier(inputs.docs["eval"]),
        "errors": lambda: page.errors(inputs.docs["errors"]),
        "sensitivity": lambda: page.sensitivity(inputs.docs["sensitivity"]),
        "outliers": lambda: page.outliers(inputs.docs["outliers"]),
        "plan": lambda: page.plan(inputs.docs["plan"]),
        "memory": lambda: page.memory(inputs.docs.get("kv"), inputs.docs.get("budget")),
        "engines": lambda: page.engines(inputs.docs["eval"]),
        "provenance": page.provenance,
    }
    parts, toc = [], []
    for sid, title, kinds in SECTIONS:
        present = not kinds or any(k in inputs.docs for k in kinds)
        body = builders[sid]() if present else _absent_note(kinds)
        cls = "" if present else " class=\"absent\""
        parts.append(f"<section id=\"{sid}\"{cls}><h2>{_esc(title)}</h2>{body}</section>")
        toc.append(f"<a href=\"#{sid}\">{_esc(title)}</a>" if present else f"<span>{_esc(title)} (absent)</span>")
    doc = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"generator\" content=\"qkit report {__version__}\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
        f"<title>qkit report: {_esc(model)}</title><style>{_CSS}</style></head><body>"
        f"<h1>qkit report: {_esc(model)}</h1><nav class=\"note\">{' · '.join(toc)}</nav>"
        + "".join(parts) + "</body></html>\n"
    )
    return doc, page.figures


__all__ = ["SECTIONS", "SECTION_IDS", "render", "table"]
