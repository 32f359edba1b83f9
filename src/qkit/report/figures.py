"""The figures, drawn with matplotlib (the optional ``report`` extra) from ``qkit.report.data``'s values.

matplotlib is imported on first use (``require_matplotlib``): ``import qkit.report`` and ``qkit --help`` stay
light, and without it ``qkit report`` refuses in one line. The Agg backend only (no display). Output is
deterministic: SVG ids come from a fixed ``svg.hashsalt`` (one per figure, so two figures inline in one page
never share an id), text stays text (``svg.fonttype = none``: small, and the browser's sans-serif draws it)
and the file records no date; the same values give byte-identical SVG.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from qkit.errors import InputError
from qkit.evaluation.measures import FrontierPanel
from qkit.report.data import Grid

INSTALL = 'pip install "qkit[report]"'
# Colours and markers of the frontier's kinds of row (matplotlib's tab10, colour-blind distinguishable by marker too).
KIND_STYLE = {
    "uniform": ("tab:blue", "o", "uniform scheme"),
    "plan": ("tab:orange", "*", "planned mix (plan:)"),
    "engine": ("tab:green", "s", "measured in an engine"),
    "simulation": ("tab:gray", "^", "run-time simulation (activations / KV)"),
}
_RC = {
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
    "font.size": 9,
    "axes.titlesize": 10,
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "path.simplify": True,
    "text.parse_math": False,  # a name from a JSON ("$\\foo$", "a$b$") is text, never mathtext to parse
}
PNG_DPI = 150
# The smallest value a log axis or colour scale takes: a denormal (5e-324) made LogNorm's inverse fail
# ("Invalid vmin or vmax"); below it the scale is linear. The inputs' checks bound every value by 1e30.
LOG_MIN = 1e-30


def _with_runtime(point: dict) -> str:
    """A row's label with its runtime, unless its name already carries it (``q4_k_m [llama.cpp]``)."""
    name, runtime = str(point["name"]), point.get("runtime")
    return name if not runtime or f"[{runtime}]" in name else f"{name} ({runtime})"

def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or one ``InputError`` line saying how to install it."""
    try:
        import matplotlib  # optional: the report extra, imported only when a report is drawn
    except ImportError:
        raise InputError(f"qkit report draws its figures with matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after use("Agg"): no display is ever opened

    return plt


class Figure:
    """One drawn figure: ``svg()`` (the markup to inline) and ``png(path)``; ``name`` is its id in the page."""

    def __init__(self, name: str, fig: Any):
        self.name, self.fig = name, fig

    def svg(self) -> str:
        import matplotlib  # already imported by require_matplotlib

        buf = io.StringIO()
        with matplotlib.rc_context({**_RC, "svg.hashsalt": f"qkit-report-{self.name}"}), _quiet():
            self.fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
        text = buf.getvalue()
        start = text.find("<svg")  # drop the XML prolog and DOCTYPE: the SVG is inlined in HTML
        return _prefix_ids(text[start:] if start >= 0 else text, f"{self.name}-")

    def png(self, path: str | Path) -> None:
        import matplotlib

        with matplotlib.rc_context(_RC), _quiet():
            self.fig.savefig(path, format="png", dpi=PNG_DPI, metadata={"Software": None}, bbox_inches="tight")

    def close(self) -> None:
        import matplotlib.pyplot as plt

        plt.close(self.fig)


_ID = re.compile(r'\bid="([^"]+)"')
_REF = re.compile(r'(href="#|url\(#)([^")]+)')


def _prefix_ids(svg: str, prefix: str) -> str:
    """Every element id of one SVG (and every reference to one) prefixed: matplotlib numbers its ids per
    figure (``figure_1``, ``patch_1``), so two figures inline in one page would otherwise share them."""
    ids = set(_ID.findall(svg))
    svg = _ID.sub(lambda m: f'id="{prefix}{m.group(1)}"', svg)
    return _REF.sub(lambda m: m.group(1) + prefix + m.group(2) if m.group(2) in ids else m.group(0), svg)


def _new(plt: Any, name: str, w: float, h: float, ncols: int = 1, **kw: Any) -> tuple[Figure, Any]:
    import matplotlib

    with matplotlib.rc_context(_RC):
        fig, axes = plt.subplots(1, ncols, figsize=(w, h), squeeze=False, **kw)
    return Figure(name, fig), axes[0]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """matplotlib's and numpy's warnings kept off stderr while a figure is drawn or saved (see ``_drawn``)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        yield


def _drawn(draw: Callable[..., Figure]) -> Callable[..., Figure]:
    """Draw under the report's rc settings (fonts, sizes) so every figure looks alike, with matplotlib's and
    numpy's warnings kept off stderr: the inputs were range-checked (``qkit.report.inputs``), so what is
    left is about drawing (a degenerate axis, an overflow in a tick computation), not about the numbers,
    and a command's stderr holds qkit's own lines only."""

    def wrapper(*args: Any, **kwargs: Any) -> Figure:
        import matplotlib

        with matplotlib.rc_context(_RC), _quiet():
            return draw(*args, **kwargs)

    wrapper.__name__, wrapper.__doc__ = draw.__name__, draw.__doc__
    return wrapper


# --------------------------------------------------------------------------- the frontier


@_drawn
def frontier(points: list[dict], panels: list[tuple[str, str | None, FrontierPanel]]) -> Figure:
    """Bits/w against each panel's measure (``columns.frontier_panels``, left to right: KL, Δ perplexity), each
    point with ± 2 SE bars, one marker per kind of row (``KIND_STYLE``). A ``log`` panel is on a log axis (where
    every value is at least ``LOG_MIN``), a ``symlog`` one on a symmetric log axis (linear within ±1)."""
    plt = require_matplotlib()
    f, axes = _new(plt, "frontier", 5 * len(panels), 4.2, ncols=len(panels))
    for ax, (key, se_key, panel) in zip(axes, panels):
        for kind, (colour, marker, legend) in KIND_STYLE.items():
            pts = [p for p in points if p["kind"] == kind and p[key] is not None]
            if not pts:
                continue
            x = [p["bits"] for p in pts]
            y = [p[key] for p in pts]
            se = [2 * ((p[se_key] if se_key else None) or 0.0) for p in pts]
            if panel.scale == "log":  # a log axis: a lower bar below zero is drawn down to a tenth of the value
                lo = [min(s, 0.9 * v) if v > 0 else 0.0 for s, v in zip(se, y)]
                yerr = [lo, se]
            else:
                yerr = [se, se]
            ax.errorbar(x, y, yerr=yerr, fmt=marker, color=colour, ms=9 if marker == "*" else 6, capsize=3,
                        elinewidth=1, label=legend, linestyle="none")
            for p in pts:
                text = _with_runtime(p) if kind == "engine" else str(p["name"])
                ax.annotate(text, (p["bits"], p[key]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("bits per weight (block projections, scales included)")
        ax.set_ylabel(panel.label)
        ax.grid(True, alpha=0.3, which="both")
        values = [p[key] for p in points if p[key] is not None]
        if panel.scale == "log" and values and min(values) >= LOG_MIN:
            ax.set_yscale("log")
        elif panel.scale == "symlog" and values:
            ax.set_yscale("symlog", linthresh=1.0)
        ax.set_title(panel.title)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(handles, labels, fontsize=7, loc="best")
    f.fig.tight_layout()
    return f


# --------------------------------------------------------------------------- heatmaps


@_drawn
def heatmaps(name: str, grids: list[tuple[str, Grid]], colorbar: str, log: bool = True) -> Figure:
    """One layer x matrix heatmap per ``(title, grid)``, side by side on one colour scale (log where every
    value is positive); an empty cell (no such tensor) is white."""
    plt = require_matplotlib()
    import matplotlib.colors as mcolors  # the optional extra: after require_matplotlib

    n = max(1, len(grids))
    height = max(3.0, 0.14 * max((len(g.layers) for _, g in grids), default=10) + 1.5)
    f, axes = _new(plt, name, min(2.2 * n + 1.2, 16), height, ncols=n)
    values = [v for _, g in grids for v in g.values()]
    positive = [v for v in values if v > 0]
    if log and positive and len(positive) == len(values) and min(positive) >= LOG_MIN:
        norm = mcolors.LogNorm(vmin=min(positive), vmax=max(positive))
    else:
        norm = mcolors.Normalize(vmin=min(values, default=0.0), vmax=max(values, default=1.0))
    image = None
    for ax, (title, g) in zip(axes, grids):
        arr = np.array([[math.nan if v is None else v for v in row] for row in g.cells] or [[math.nan]], dtype=float)
        image = ax.imshow(arr, aspect="auto", interpolation="nearest", norm=norm, cmap="viridis")
        ax.set_xticks(range(len(g.columns)), [c.replace("_proj", "") for c in g.columns], rotation=90, fontsize=7)
        step = max(1, len(g.layers) // 15)
        ax.set_yticks(range(0, len(g.layers), step), [str(g.layers[i]) for i in range(0, len(g.layers), step)], fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("layer")
    if image is not None:
        f.fig.colorbar(image, ax=list(axes), label=colorbar, shrink=0.9)
    return f


# --------------------------------------------------------------------------- sensitivity


@_drawn
def sensitivity_bars(units: list[dict], scheme: str) -> Figure:
    """KL (nats/token) with one layer at ``scheme`` and the rest unquantized, one bar per layer."""
    plt = require_matplotlib()
    f, (ax,) = _new(plt, "sensitivity", 8, 3.2)
    pts = [u for u in units if u["kl"] is not None]
    ax.bar([str(u["layer"] if u["layer"] is not None else u["name"]) for u in pts], [u["kl"] for u in pts],
           color=["tab:red" if u["outlier_dims"] else "tab:blue" for u in pts])
    ax.set_xlabel("layer (red: its inputs carry an outlier channel)")
    ax.set_ylabel(f"KL, nats/token (only this layer at {scheme})")
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    f.fig.tight_layout()
    return f


# --------------------------------------------------------------------------- outliers


@_drawn
def outlier_histogram(bins: list[dict], layer: int) -> Figure:
    """Counts of dimensions per octave of their max |h| over the tokens, at one layer."""
    plt = require_matplotlib()
    f, (ax,) = _new(plt, "outlier-histogram", 6, 3.2)
    labels = [f"{b['lo']:g}-{b['hi']:g}" for b in bins]
    counts = [b["count"] for b in bins]
    ax.bar(range(len(bins)), counts, color="tab:blue")
    for i, c in enumerate(counts):
        if c:
            ax.annotate(str(c), (i, c), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    ax.set_xticks(range(len(bins)), labels, rotation=60, fontsize=7)
    ax.set_xlabel("max |h| over the tokens (octave bins)")
    ax.set_ylabel("dimensions")
    ax.set_title(f"residual stream after layer {layer}: per-dimension maxima")
    f.fig.tight_layout()
    return f


@_drawn
def outlier_persistence(p: dict) -> Figure:
    """Each outlier dimension's max |h| per layer (log axis) against the median dimension's (dashed)."""
    plt = require_matplotlib()
    f, (ax,) = _new(plt, "outlier-persistence", 7, 3.6)
    for d in p["dims"]:
        n = min(len(p["layers"]), len(d["values"]))  # a dimension's values per layer, as many as both have
        ax.plot(p["layers"][:n], d["values"][:n], marker=".", label=f"dim {d['dim']} ({d['n_layers']} layer{'s' if d['n_layers'] != 1 else ''})")
    ax.plot(p["layers"], p["median"], linestyle="--", color="black", label="median dimension")
    ax.set_yscale("log")
    ax.set_xlabel("layer (residual stream after it)")
    ax.set_ylabel("max |h| over the tokens")
    ax.set_title("outlier dimensions across layers")
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7)
    f.fig.tight_layout()
    return f


# --------------------------------------------------------------------------- memory


@_drawn
def kv_bars(variants: list[dict]) -> Figure:
    plt = require_matplotlib()
    f, (ax,) = _new(plt, "kv", 5, 2.6)
    ax.barh([f"{v['attention']} ({v['kv_heads']} kv heads)" for v in variants], [v["bytes_per_token"] for v in variants],
            color="tab:purple")
    ax.invert_yaxis()
    ax.set_xlabel("KV-cache bytes per token")
    ax.tick_params(axis="y", labelsize=7)
    f.fig.tight_layout()
    return f


@_drawn
def budget_bars(bars: list[dict]) -> Figure:
    """Resident tokens that fit per card size, one bar per weight format."""
    plt = require_matplotlib()
    f, (ax,) = _new(plt, "budget", 6.5, 3.2)
    cards = sorted({b["gpu_gib"] for b in bars})
    formats = list(dict.fromkeys(b["format"] for b in bars))
    width = 0.8 / max(1, len(formats))
    by = {(b["gpu_gib"], b["format"]): b for b in bars}
    for j, fmt in enumerate(formats):
        xs = [i + j * width for i, c in enumerate(cards) if (c, fmt) in by]
        ys = [by[(c, fmt)]["max_tokens"] for c in cards if (c, fmt) in by]
        ax.bar(xs, ys, width=width, label=fmt)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cards))], [f"{c:g} GiB" for c in cards])
    ax.set_ylabel("resident tokens that fit")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    f.fig.tight_layout()
    return f


# --------------------------------------------------------------------------- engines


@_drawn
def engine_versus(rows: list[dict]) -> Figure:
    """Each engine row's perplexity change against the torch row of the same spec, ± 2 paired SE."""
    plt = require_matplotlib()
    f, (ax,) = _new(plt, "engines", 6.5, 0.45 * max(2, len(rows)) + 1.2)
    pts = [r for r in rows if r["dppl_vs_torch"] is not None]
    ax.errorbar([r["dppl_vs_torch"] for r in pts], range(len(pts)),
                xerr=[2 * (r["dppl_vs_torch_se"] or 0.0) for r in pts], fmt="s", color="tab:green", capsize=3)
    ax.set_yticks(range(len(pts)), [_with_runtime(r) for r in pts], fontsize=7)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("perplexity: engine against qkit's simulation, % (± 2 paired SE)")
    f.fig.tight_layout()
    return f


__all__ = ["INSTALL", "KIND_STYLE", "PNG_DPI", "Figure", "budget_bars", "engine_versus", "frontier", "heatmaps",
           "kv_bars", "outlier_histogram", "outlier_persistence", "require_matplotlib", "sensitivity_bars"]
