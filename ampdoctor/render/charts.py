"""The report's charts: matplotlib figures of a command's data, and a figure as an inline ``<svg>``.
matplotlib is imported inside each function, when a chart is drawn, so that importing this module
(or ``import ampdoctor``) does not pay for it. Labels go through matplotlib's SVG writer, which
escapes text."""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .formatting import shorten

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BAR_ROWS = 30
HEATMAP_ROWS = 80
# Beyond the format's range, the heatmap colours say what happens to the value; neither colour
# occurs in viridis, and "no data" is a neutral grey.
OVER, UNDER, BAD = "#e41a1c", "#ff00ff", "#dddddd"


def _finite(x: Any) -> bool:
    """A finite number, numpy scalars included (reports built from pandas may hold them)."""
    if x is None or isinstance(x, (bool, str)):
        return False
    try:
        return math.isfinite(x)
    except TypeError:
        return False


def _labels(names: Sequence[str], width: int = 44) -> tuple[list[str], str]:
    """Chart labels for qualified names: the dotted prefix they all share (``model.encoder.``) is
    dropped and returned for the caption, so that the part that differs is what fits ``width``."""
    names = [str(n) for n in names]
    prefix = ""
    if len(names) > 1:
        common = names[0]
        for n in names[1:]:
            while not n.startswith(common):
                common = common[:-1]
        prefix = common[: common.rfind(".") + 1]
        if any(n == prefix for n in names):
            prefix = ""
    return [shorten(n[len(prefix):], width) for n in names], prefix


def _prefix_note(prefix: str) -> str:
    return f" Layer names omit their common prefix “{prefix}”." if prefix else ""


def _kinded(layers: Sequence[dict]) -> tuple[list[str], str]:
    """Bar labels: the names, and the kind where it is not a parameter gradient."""
    labels, prefix = _labels([layer.get("name", "") for layer in layers])
    return [lbl if layer.get("kind") in (None, "param_grad") else f"{lbl} ({layer['kind']})"
            for lbl, layer in zip(labels, layers)], prefix


def _mpl_text(s: str) -> str:
    # matplotlib treats text between two $ as mathtext; a name must render literally.
    return s.replace("$", r"\$")


# --- figures: each returns a Figure, or None when there is nothing to draw ---------------------------

def scale_figure(charts: dict) -> Figure | None:
    """The loss scale per step (a step curve on a log2 axis), skipped steps marked."""
    from matplotlib.figure import Figure

    steps, scale = charts.get("steps") or [], charts.get("scale") or []
    skipped = list(charts.get("skipped") or []) + [False] * len(steps)
    pts = [(s, v, bool(k)) for s, v, k in zip(steps, scale, skipped) if _finite(v) and v > 0]
    if not pts:
        return None
    # The scale is piecewise constant: its change points draw the same step curve in far less SVG.
    line = [p for i, p in enumerate(pts) if i == 0 or i == len(pts) - 1 or p[1] != pts[i - 1][1]]
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([p[0] for p in line], [p[1] for p in line], drawstyle="steps-post", color="#1f77b4",
            label="loss scale")
    skips = [p for p in pts if p[2]]
    if skips:
        ax.scatter([p[0] for p in skips], [p[1] for p in skips], marker="x", color="#d62728", s=22,
                   zorder=3, label=f"skipped step ({len(skips)})")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def _grid(rows: Any, n: int, m: int) -> Any:
    """An n × m float array (None → NaN), or None when the rows do not have that shape."""
    import numpy as np

    try:
        arr = np.array(rows, dtype=float)
    except (TypeError, ValueError):
        return None
    return arr if arr.shape == (n, m) else None


def heatmap_figure(charts: dict) -> tuple[Figure | None, str]:
    """Two panels (scaled amax, scaled 10th percentile) on one colour scale clipped at the format's
    overflow and underflow levels, so cells beyond them take the over/under colours."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator
    from matplotlib.figure import Figure

    hm, fmt = charts.get("heatmap") or {}, charts.get("format") or {}
    names, steps = list(hm.get("names") or []), list(hm.get("steps") or [])
    if not names or not steps:
        return None, ""
    high = _grid(hm.get("high") or [], len(names), len(steps))
    low = _grid(hm.get("low") or [], len(names), len(steps))
    if high is None or low is None:
        return None, ""
    note = ""
    if len(names) > HEATMAP_ROWS:
        note = f" The first {HEATMAP_ROWS} of {len(names)} layers are shown."
        names, high, low = names[:HEATMAP_ROWS], high[:HEATMAP_ROWS], low[:HEATMAP_ROWS]
    data = np.concatenate([high.ravel(), low.ravel()])
    data = data[np.isfinite(data)]
    if data.size == 0:
        return None, ""
    over, under = fmt.get("max_log2"), fmt.get("underflow_log2")
    lo = under if _finite(under) else math.floor(data.min()) - 1
    hi = over if _finite(over) else math.ceil(data.max()) + 1
    if hi - lo > 64:
        # bfloat16 spans ~260 binades: clip the colour range to the data (still never past the format's
        # limits) so that differences between layers stay visible.
        lo, hi = max(lo, math.floor(data.min()) - 2), min(hi, math.ceil(data.max()) + 2)
    # log2(0) = -inf is a bucket whose values all flushed to zero; Normalize would make it "bad".
    high, low = (np.clip(a, lo - 1, hi + 1) for a in (high, low))
    cmap = matplotlib.colormaps["viridis"].with_extremes(over=OVER, under=UNDER, bad=BAD)
    norm = Normalize(vmin=lo, vmax=hi)

    n = len(names)
    fig = Figure(figsize=(11, max(2.6, 0.17 * n + 1.6)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    size = 8 if n <= 40 else 6
    xt = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 7)).round().astype(int))
    for ax, arr, title in ((axes[0], high, "high: log2 scaled amax"),
                           (axes[1], low, "low: log2 scaled 10th percentile |g|")):
        im = ax.imshow(arr, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(xt, [str(steps[i]) for i in xt], fontsize=7)
        ax.set_xlabel("step", fontsize=8)
    labels, prefix = _labels(names, 40)
    note += _prefix_note(prefix)
    axes[0].set_yticks(range(n), [_mpl_text(lbl) for lbl in labels], fontsize=size)
    cbar = fig.colorbar(im, ax=axes, extend="both", pad=0.02, fraction=0.04)
    cbar.set_label("log2 |scaled gradient|", fontsize=8)
    # The format's levels become labelled ticks (with a line across the bar); plain ticks too close
    # to one would collide with its label.
    levels = [(lv, color, text) for lv, color, text in
              ((over, OVER, "overflow"), (fmt.get("normal_log2"), "#ffffff", "subnormal"),
               (under, UNDER, "flush to 0")) if _finite(lv) and lo <= lv <= hi]
    plain = [t for t in MaxNLocator(nbins=6, integer=True).tick_values(lo, hi)
             if lo <= t <= hi and all(abs(t - lv) > 0.06 * (hi - lo) for lv, _, _ in levels)]
    ticks = plain + [lv for lv, _, _ in levels]
    labels = [f"{t:g}" for t in plain] + [f"{text} ({lv:.0f})" for lv, _, text in levels]
    cbar.set_ticks(ticks, labels=labels)
    cbar.ax.tick_params(labelsize=7)
    for lv, color, _ in levels:
        cbar.ax.axhline(lv, color=color, lw=2, ls="--")
    return fig, note


def _bar_figure(labels: list[str], values: list[float], colors: list[str], xlabel: str,
                zero_line: bool = False) -> Figure:
    from matplotlib.figure import Figure

    n = len(labels)
    fig = Figure(figsize=(10, 0.24 * n + 1.1), layout="constrained")
    ax = fig.add_subplot()
    ax.barh(range(n), values, color=colors, height=0.7)
    ax.set_yticks(range(n), [_mpl_text(lbl) for lbl in labels], fontsize=8)
    ax.invert_yaxis()  # worst first, at the top
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    if zero_line:
        ax.axvline(0, color="#333", lw=1)
    return fig


def underflow_figure(layers: Sequence[dict]) -> tuple[Figure | None, str, str]:
    """Bars of the highest underflow rates; with the figure, why there is none when that is news
    (no layer underflowed), and the caption's note on the names."""
    rows = sorted((layer for layer in layers if _finite(layer.get("underflow_rate"))),
                  key=lambda layer: -layer["underflow_rate"])[:BAR_ROWS]
    if not rows:
        return None, "", ""
    if all(layer["underflow_rate"] == 0 for layer in rows):
        return None, "No recorded gradient underflowed: every layer's underflow rate is 0.", ""
    labels, prefix = _kinded(rows)
    fig = _bar_figure(labels, [100 * layer["underflow_rate"] for layer in rows],
                      ["#ff7f0e"] * len(rows), "underflow rate (% of elements observed)")
    return fig, "", _prefix_note(prefix)


def headroom_figure(layers: Sequence[dict]) -> tuple[Figure | None, str]:
    """Bars of the smallest headrooms (negative: overflow), and the caption's note on the names."""
    rows = sorted((layer for layer in layers if _finite(layer.get("headroom_log2"))),
                  key=lambda layer: layer["headroom_log2"])[:BAR_ROWS]
    if not rows:
        return None, ""
    values = [layer["headroom_log2"] for layer in rows]
    labels, prefix = _kinded(rows)
    fig = _bar_figure(labels, values, ["#d62728" if v < 0 else "#1f77b4" for v in values],
                      "headroom (binades below the format's max; negative = overflow)", zero_line=True)
    return fig, _prefix_note(prefix)


def timeline_figure(timeline: Sequence[dict]) -> Figure | None:
    """Loss, gradient norm and loss scale over the steps before the event (log2 y axes)."""
    points = [r for r in timeline
              if isinstance(r.get("loss"), (int, float)) or isinstance(r.get("grad_norm"), (int, float))]
    if len(points) < 2:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    for key, label, color in (("loss", "loss", "#1f77b4"), ("grad_norm", "gradient norm", "#ff7f0e"),
                              ("scale", "loss scale", "#2ca02c")):
        xs = [r["step"] for r in timeline if isinstance(r.get(key), (int, float)) and r[key] > 0]
        ys = [r[key] for r in timeline if isinstance(r.get(key), (int, float)) and r[key] > 0]
        if xs:
            ax.plot(xs, ys, marker="o", label=label, color=color)
    bad = [r["step"] for r in timeline if isinstance(r.get("loss"), str)]
    skipped = [r["step"] for r in timeline if r.get("skipped")]
    for x in skipped:
        ax.axvline(x, color="#d62728", alpha=0.25)
    for x in bad:
        ax.axvline(x, color="#d62728", linewidth=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def to_svg(fig: Figure, salt: str, label: str) -> str:
    """The figure as an ``<svg>`` element to inline: no XML declaration or DOCTYPE, no metadata,
    text kept as text (escaped by matplotlib), deterministic, and every id (and reference to one)
    prefixed per chart: matplotlib numbers its groups ``figure_1``, ``axes_1``... in every figure,
    and ids must be unique in the page that holds them all."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"ampdoctor-{salt}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None,
                                                  "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r'\bid="', f'id="{salt}-', svg)
    svg = re.sub(r'((?:xlink:)?href="#|url\(#)', rf"\g<1>{salt}-", svg)
    return svg.replace("<svg ", f'<svg role="img" aria-label="{html.escape(label, quote=True)}" ', 1)
