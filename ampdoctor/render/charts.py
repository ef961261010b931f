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
from .sections import layer_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

def unavailable() -> str | None:
    """Why no chart can be drawn here, or None: matplotlib not installed, or installed but failing
    to import (a build older than 3.8.4 under numpy 2, say), which are different fixes. A known
    broken pair is named without importing it (its import prints numpy's banner and traceback)."""
    from ..dependencies import conflicts, import_problem, installed

    if installed("matplotlib") is None:
        return "Charts need matplotlib, which is not installed (pip install matplotlib)"
    known = conflicts(("matplotlib",))
    if known:
        return f"Charts need matplotlib, which fails to import here: {'; '.join(known)}"
    try:
        import matplotlib.figure  # noqa: F401  (the import that fails on a broken build)
    except Exception as exc:  # noqa: BLE001 - a broken build raises ImportError, AttributeError, ...
        return f"Charts need matplotlib: {import_problem(exc, 'matplotlib')}"
    return None


BAR_ROWS = 30
HEATMAP_ROWS = 80
# Beyond the format's range, the heatmap colours say what happens to the value; neither colour
# occurs in viridis, and "no data" is a neutral grey. A bucket whose gradients were all zero
# (amax 0: every element flushed, log2 = -inf in the series) is black: nothing was left of it.
OVER, UNDER, BAD, FLUSHED = "#e41a1c", "#ff00ff", "#dddddd", "#000000"
# The legend of those colours, below the heatmap.
HEATMAP_LEGEND = ((OVER, "beyond the format's max (overflows to inf)"),
                  (UNDER, "below half its smallest subnormal (flushes to 0)"),
                  (FLUSHED, "flushed to zero (every element 0)"), (BAD, "not recorded"))


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
    """Bar labels: the names (with their module's class where the name is only an index), and the
    kind where it is not a parameter gradient."""
    labels, prefix = _labels([layer_label(layer) for layer in layers])
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
    """An n × m float array (None → NaN; -inf, a bucket flushed to zero, stays), or None when the
    rows do not have that shape."""
    import numpy as np

    try:
        arr = np.array([[math.nan if v is None else v for v in row] for row in rows], dtype=float)
    except (TypeError, ValueError):
        return None
    return arr if arr.shape == (n, m) else None


def _step_ticks(ax: Any, first: int, last: int) -> None:
    """Ticks at round step numbers (0, 50, 100, not 0, 25, 50, 74, 99) on an axis in step units."""
    from matplotlib.ticker import MaxNLocator

    ticks = [int(t) for t in MaxNLocator(nbins=6, integer=True, steps=[1, 2, 2.5, 5, 10]).tick_values(first, last)
             if first <= t <= last]
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)


def _panel(ax: Any, arr: Any, steps: list[int], cmap: Any, norm: Any, *, buckets: bool) -> Any:
    """One heatmap panel. With ``buckets``, the columns are the run's step buckets (each ``width``
    steps from its first step, evenly spaced): the axis is in steps, ticked at round numbers; else
    one column per listed step (the sampled steps), each labelled. Cells of -inf are drawn over in
    :data:`FLUSHED`."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    n = arr.shape[0]
    flushed = np.isneginf(arr)
    if buckets:
        width = steps[1] - steps[0] if len(steps) > 1 else 1
        extent = (steps[0] - 0.5, steps[-1] + width - 0.5, n - 0.5, -0.5)
    else:
        extent = (-0.5, len(steps) - 0.5, n - 0.5, -0.5)
    im = ax.imshow(np.where(flushed, np.nan, arr), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                   extent=extent)
    if flushed.any():
        ax.imshow(np.where(flushed, 1.0, np.nan), aspect="auto", interpolation="nearest", extent=extent,
                  cmap=ListedColormap([FLUSHED]).with_extremes(bad=(0, 0, 0, 0)), vmin=0, vmax=1)
    if buckets:
        _step_ticks(ax, steps[0], steps[-1])
    else:  # the sampled steps only: at most 7 of their numbers
        at = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 7)).round().astype(int))
        ax.set_xticks(at, [str(steps[i]) for i in at], fontsize=7)
    ax.set_xlabel("step", fontsize=8)
    return im


def heatmap_figure(charts: dict) -> tuple[Figure | None, str]:
    """Two panels (scaled amax, scaled 10th percentile) on one colour scale clipped at the format's
    overflow and underflow levels, so cells beyond them take the over/under colours. The "low"
    panel needs the full statistics of sampled steps: it shows only the steps that have them."""
    import matplotlib
    import numpy as np
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    hm, fmt = charts.get("heatmap") or {}, charts.get("format") or {}
    names, steps = list(hm.get("names") or []), [int(x) for x in hm.get("steps") or []]
    if not names or not steps:
        return None, ""
    high = _grid(hm.get("high") or [], len(names), len(steps))
    low = _grid(hm.get("low") or [], len(names), len(steps))
    if high is None or low is None:
        return None, ""
    types = list(hm.get("types") or [None] * len(names))
    note = ""
    if len(names) > HEATMAP_ROWS:
        note = f" The first {HEATMAP_ROWS} of {len(names)} layers are shown."
        names, types, high, low = names[:HEATMAP_ROWS], types[:HEATMAP_ROWS], high[:HEATMAP_ROWS], low[:HEATMAP_ROWS]
    data = np.concatenate([high.ravel(), low.ravel()])
    data = data[np.isfinite(data)]
    if data.size == 0 and not np.isneginf(high).any():
        return None, ""
    over, under = fmt.get("max_log2"), fmt.get("underflow_log2")
    data_lo, data_hi = (data.min(), data.max()) if data.size else (-24.0, 0.0)
    lo = under if _finite(under) else math.floor(data_lo) - 1
    hi = over if _finite(over) else math.ceil(data_hi) + 1
    if hi - lo > 64:
        # bfloat16 spans ~260 binades: clip the colour range to the data (still never past the format's
        # limits) so that differences between layers stay visible.
        lo, hi = max(lo, math.floor(data_lo) - 2), min(hi, math.ceil(data_hi) + 2)
    high, low = (np.where(np.isneginf(a), a, np.clip(a, lo - 1, hi + 1)) for a in (high, low))
    cmap = matplotlib.colormaps["viridis"].with_extremes(over=OVER, under=UNDER, bad=BAD)
    norm = Normalize(vmin=lo, vmax=hi)

    sampled = ~np.isnan(low).all(axis=0)  # columns with full statistics
    n = len(names)
    fig = Figure(figsize=(11, max(3.0, 0.17 * n + 2.0)), layout="constrained")
    axes = list(np.atleast_1d(fig.subplots(1, 2 if sampled.any() else 1, sharey=True)))
    im = _panel(axes[0], high, steps, cmap, norm, buckets=True)
    axes[0].set_title("high: log2 scaled amax", fontsize=9)
    if sampled.any():
        columns = [steps[i] for i in np.flatnonzero(sampled)]
        _panel(axes[1], low[:, sampled], columns, cmap, norm, buckets=bool(sampled.all()))
        every = sampled.all()
        axes[1].set_title("low: log2 scaled 10th percentile |g|" + ("" if every else
                          f"\n(the {len(columns)} steps with full statistics)"), fontsize=9)
        if not every:
            note += (f" The low panel shows only the {len(columns)} step bucket(s) with full statistics "
                     f"(sampled steps): the 10th percentile needs them.")
    else:
        note += " No step has full statistics (the 10th percentile needs them): only the high panel is drawn."
    labels, prefix = _labels([layer_label({"name": nm, "module_type": t}) for nm, t in zip(names, types)], 40)
    note += _prefix_note(prefix)
    size = 8 if n <= 40 else 6
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
    tick_labels = [f"{t:g}" for t in plain] + [f"{text} ({lv:.0f})" for lv, _, text in levels]
    cbar.set_ticks(ticks, labels=tick_labels)
    cbar.ax.tick_params(labelsize=7)
    for lv, color, _ in levels:
        cbar.ax.axhline(lv, color=color, lw=2, ls="--")
    fig.legend(handles=[Patch(facecolor=c, edgecolor="#999", label=t) for c, t in HEATMAP_LEGEND],
               loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    return fig, note


def _bar_figure(labels: list[str], values: list[float], colors: list[str], xlabel: str,
                zero_line: bool = False, behind: list[float] | None = None) -> Figure:
    """Horizontal bars, the first at the top; ``behind``: paler bars drawn under them (upper bounds)."""
    from matplotlib.figure import Figure

    n = len(labels)
    fig = Figure(figsize=(10, 0.24 * n + 1.1), layout="constrained")
    ax = fig.add_subplot()
    if behind is not None:
        ax.barh(range(n), behind, color=colors, alpha=0.3, height=0.7, label="at most (undecided zeros counted)")
    ax.barh(range(n), values, color=colors, height=0.7, label="estimate" if behind is not None else None)
    ax.set_yticks(range(n), [_mpl_text(lbl) for lbl in labels], fontsize=8)
    ax.invert_yaxis()  # worst first, at the top
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    if zero_line:
        ax.axvline(0, color="#333", lw=1)
    if behind is not None:
        ax.legend(loc="lower right", fontsize=8)
    return fig


def _rate(layer: dict, key: str) -> float | None:
    value = layer.get(key)
    return float(value) if _finite(value) else None


def underflow_figure(layers: Sequence[dict]) -> tuple[Figure | None, str, str]:
    """Bars of the layers that underflowed, the worst :data:`BAR_ROWS` (the estimate, and its upper
    bound paler behind it where zeros are undecided); with the figure, why there is none when that
    is news (no layer underflowed), and the caption's note: how many layers are left out, and why."""
    judged = [layer for layer in layers if layer.get("kind") != "output"
              and (_rate(layer, "underflow_rate") is not None or _rate(layer, "underflow_rate_max") is not None)]
    if not judged:
        return None, "", ""

    def bounds(layer: dict) -> tuple[float, float]:
        rate, most = _rate(layer, "underflow_rate"), _rate(layer, "underflow_rate_max")
        return (rate or 0.0), max(most if most is not None else 0.0, rate or 0.0)

    # Worst first as `ampdoctor layers` sorts: by the estimate, an unknown one by its upper bound.
    some = sorted((layer for layer in judged if bounds(layer)[1] > 0),
                  key=lambda layer: (-(_rate(layer, "underflow_rate") if _rate(layer, "underflow_rate") is not None
                                       else bounds(layer)[1]), -bounds(layer)[1]))
    if not some:
        return None, "No recorded gradient underflowed: every layer's underflow rate is 0.", ""
    rows = some[:BAR_ROWS]
    labels, prefix = _kinded(rows)
    lows, highs = zip(*(bounds(layer) for layer in rows))
    undecided = any(h > lo for lo, h in zip(lows, highs))
    fig = _bar_figure(labels, [100 * v for v in lows], ["#ff7f0e"] * len(rows),
                      "underflow rate (% of elements observed)",
                      behind=[100 * v for v in highs] if undecided else None)
    note = (f" The {len(rows)} highest of the {len(some)} layers that underflowed."
            if len(some) > len(rows) else f" Every layer that underflowed ({len(some)}).")
    rest = len(judged) - len(some)
    if rest:
        note += f" And {rest} more with no underflow."
    return fig, "", note + _prefix_note(prefix)


def headroom_figure(layers: Sequence[dict]) -> tuple[Figure | None, str]:
    """Bars of the smallest headrooms (negative: overflow), and the caption's note on the layers
    left out and on the names."""
    known = sorted((layer for layer in layers if _finite(layer.get("headroom_log2"))),
                   key=lambda layer: layer["headroom_log2"])
    rows = known[:BAR_ROWS]
    if not rows:
        return None, ""
    values = [layer["headroom_log2"] for layer in rows]
    labels, prefix = _kinded(rows)
    fig = _bar_figure(labels, values, ["#d62728" if v < 0 else "#1f77b4" for v in values],
                      "headroom (binades below the format's max; negative = overflow)", zero_line=True)
    rest = len(known) - len(rows)
    note = f" And {rest} more with at least {rows[-1]['headroom_log2']:+.1f} binades." if rest else ""
    return fig, note + _prefix_note(prefix)


# The postmortem timeline's series: (key, axis label, colour). The scale gets a log2 axis (it moves
# in powers of two); the loss and gradient norm a log axis only when they span more than a factor
# of 100, else a linear one, which reads better.
TIMELINE_SERIES = (("loss", "loss", "#1f77b4"), ("grad_norm", "gradient norm", "#ff7f0e"),
                   ("scale", "loss scale", "#2ca02c"))


def timeline_figure(timeline: Sequence[dict]) -> Figure | None:
    """Loss, gradient norm and loss scale over the steps before the event, each on its own axis
    (one above the other, sharing the step axis), skipped steps and non-finite losses marked."""
    points = [r for r in timeline
              if isinstance(r.get("loss"), (int, float)) or isinstance(r.get("grad_norm"), (int, float))]
    if len(points) < 2:
        return None
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 5.4), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    bad = [r["step"] for r in timeline if isinstance(r.get("loss"), str)]
    skipped = [r["step"] for r in timeline if r.get("skipped")]
    for ax, (key, label, color) in zip(axes, TIMELINE_SERIES):
        pts = [(r["step"], r[key]) for r in timeline
               if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and _finite(r[key])]
        positive = [v for _, v in pts if v > 0]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=color)
        if key == "scale" and positive and len(positive) == len(pts):
            ax.set_yscale("log", base=2)
        elif positive and len(positive) == len(pts) and max(positive) > 100 * min(positive):
            ax.set_yscale("log")
        if not pts:
            ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", va="center", color="#777")
        for x in skipped:
            ax.axvline(x, color="#d62728", alpha=0.25)
        for x in bad:
            ax.axvline(x, color="#d62728", linewidth=2)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
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
