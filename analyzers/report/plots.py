"""The report's plots as inline SVG, drawn with matplotlib (Agg, no display, no files, no network).

Each ``*_svg`` function returns one ``<svg>`` element whose ids all start with the plot's id (``plot-<name>-...``),
so several plots live in one page without id clashes. Time axes are steps (integer ticks, gridlines) and carry the
report's events as numbered vertical marks whose groups are named ``plot-<name>-event-<kind>-<n>``; the page lists
the numbers under the plots. Text stays text (``svg.fonttype none``): it is searchable and follows the page's font.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot: never look for a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from analyzers.report.series import FOCUS_K, Event, PlotData, band, bubble_share, focus, schedule  # noqa: E402

WIDTH_IN = 10.5  # ~1000 px wide at the page's 96 px/in: fits 1280 px with margins, and a printed A4/Letter page
EVENT_STYLE = {  # kind -> (colour, line style)
    "fault": ("#d32f2f", (0, (5, 3))),
    "finding": ("#ef6c00", (0, (2, 2))),
    "evict": ("#6a1b9a", "solid"),
    "restart": ("#6a1b9a", (0, (6, 2, 1, 2))),
    "checkpoint": ("#607d8b", (0, (1, 2))),
    "profile": ("#607d8b", (0, (1, 2))),
    "action": ("#607d8b", (0, (1, 2))),
}
MANY = 12  # more series than this: the few that matter in colour, the rest as one band
RANK_BARS = 24
FOCUS_HALF = 3  # of the coloured GPU lines, at most this many from the nodes the findings name  # more ranks than this: the time split of the ranks that matter, and three that stand for the rest
RC = {"svg.fonttype": "none", "svg.hashsalt": "ranksight", "font.size": 9, "axes.spines.top": False,
      "axes.spines.right": False, "axes.grid": False, "axes.prop_cycle": matplotlib.cycler(color=plt.get_cmap("tab10").colors)}


def to_svg(fig: plt.Figure, plot_id: str, tight: bool = False) -> str:
    """The figure as one ``<svg>`` element (no XML prolog, no DOCTYPE), every id prefixed with ``plot_id``. Time plots
    keep the fixed margins of ``_fig`` (not ``tight``) so their step axes line up one above the other on the page."""
    buf = io.StringIO()
    with plt.rc_context(RC):  # svg.fonttype is read when saving
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight" if tight else None)
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    # inline in HTML the parser knows the xlink prefix; the declaration would be the page's only other URL
    svg = svg.replace(' xmlns:xlink="http://www.w3.org/1999/xlink"', "")
    # matplotlib's <style>*{stroke-linejoin...}</style>: inline in HTML a style element applies to the whole page;
    # the page's CSS gives the plots the same rule, scoped (.plot-svg *)
    svg = re.sub(r"\s*<style[^>]*>.*?</style>", "", svg, flags=re.S)
    svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, count=1, flags=re.S)  # RDF boilerplate with namespace URLs
    # every plotted value lies inside its axes (autoscaled, or the run's step range), so the clip paths are dropped:
    # the page then holds no url(...) at all, the simplest proof that it loads nothing
    svg = re.sub(r'\s*clip-path="url\(#[^)"]*\)"', "", svg)
    svg = re.sub(r"\s*<clipPath .*?</clipPath>", "", svg, flags=re.S)
    ids = set(re.findall(r'\bid="([^"]+)"', svg))
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{plot_id}-{m.group(1)}"', svg)
    svg = re.sub(r'(url\(#|href="#)([^")]+)', lambda m: m.group(1) + (f"{plot_id}-{m.group(2)}" if m.group(2) in ids else m.group(2)), svg)
    # scale with the page (the viewBox keeps the aspect ratio); the fixed pt size would overflow a narrow window
    svg = re.sub(r'<svg ([^>]*?)width="[^"]+" height="[^"]+"', r'<svg \1', svg, count=1)
    return svg.replace("<svg ", f'<svg class="plot-svg" data-plot="{plot_id}" role="img" ', 1)


def _fig(rows: int, height_per_row: float = 2.2, sharex: bool = True) -> tuple[plt.Figure, list[Axes]]:
    """A figure of ``rows`` axes one above the other, with the same left and right margins in every plot (the right
    one holds the legends)."""
    height = height_per_row * rows + 0.7
    with plt.rc_context(RC):
        fig, axes = plt.subplots(rows, 1, figsize=(WIDTH_IN, height), sharex=sharex, squeeze=False)
    fig.subplots_adjust(left=0.085, right=0.8, top=1 - 0.3 / height, bottom=0.5 / height, hspace=0.25)
    return fig, list(axes[:, 0])


def _step_axis(ax: Axes, label: bool, steps: tuple[int, int] | None = None) -> None:
    """Integer step ticks, gridlines, and the run's whole step range (so every time plot spans the same steps)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=20))
    if steps is not None:
        pad = max(0.5, (steps[1] - steps[0]) * 0.01)
        ax.set_xlim(steps[0] - pad, steps[1] + pad)
    ax.grid(True, which="major", color="#b0b0b0", linewidth=0.6, alpha=0.6)
    ax.set_axisbelow(True)
    if label:
        ax.set_xlabel("step")
        ax.tick_params(axis="x", labelbottom=True)


def _name_grid(fig: plt.Figure, axes: list[Axes]) -> None:
    """Name the gridlines (after a draw fixes the ticks) so the page and its tests can tell them apart."""
    fig.canvas.draw()
    for a, ax in enumerate(axes):
        for i, ln in enumerate(ax.get_xgridlines()):
            ln.set_gid(f"gridx-{a}-{i}")
        for i, ln in enumerate(ax.get_ygridlines()):
            ln.set_gid(f"gridy-{a}-{i}")


def event_numbers(events: list[Event]) -> dict[int, int]:
    """Each event's number in the page's legend (1-based, in step order): index in ``events`` -> number."""
    return {i: i + 1 for i in range(len(events))}


def mark_events(axes: list[Axes], events: list[Event], xlim: tuple[float, float] | None = None) -> None:
    """Vertical marks at each event's step on every axis, numbered once at the top axis (events at one step share a
    label: "1,2")."""
    if not events:
        return
    lo, hi = xlim if xlim is not None else axes[0].get_xlim()
    by_step: dict[int, list[int]] = defaultdict(list)
    for i, ev in enumerate(events):
        by_step[ev.step].append(i)
    for ax_i, ax in enumerate(axes):
        for i, ev in enumerate(events):
            color, style = EVENT_STYLE.get(ev.kind, EVENT_STYLE["action"])
            line = ax.axvline(ev.step, color=color, linestyle=style, linewidth=1.3, alpha=0.9, zorder=3)
            line.set_gid(f"event-{ev.kind}-{ax_i}-{i}")
    top = axes[0]
    for step, idx in by_step.items():
        if not (lo - 0.5 <= step <= hi + 0.5):
            continue
        color, _ = EVENT_STYLE.get(events[idx[0]].kind, EVENT_STYLE["action"])
        txt = top.annotate(",".join(str(i + 1) for i in idx), xy=(step, 1.0), xycoords=("data", "axes fraction"),
                           xytext=(2, 2), textcoords="offset points", fontsize=8, color=color, fontweight="bold",
                           annotation_clip=False)
        txt.set_gid(f"eventlabel-{step}")


def _lines(ax: Axes, frame: pd.DataFrame, label_fmt: Callable[[object], str] = str, prefer: Sequence[object] = (),
           worst: str = "high", what: str = "series", axis: int = 0) -> None:
    """One line per column. With more than ``MANY`` columns (a job of thousands of ranks): ``FOCUS_K`` lines in colour,
    the columns in ``prefer`` first, then those whose median is the most extreme (``worst``: "high" or "low"), and the
    other columns as one grey band (p5 to p95 per step) with their median: the SVG's size does not grow with the job.
    Element ids: ``line-<axis>-<label>``, ``band-<axis>``, ``band-median-<axis>`` (``axis``: the axes' number in
    the figure)."""
    cols = list(frame.columns)
    if len(cols) <= MANY:
        top = cols
    else:
        med = frame.median()
        top = focus(med if worst == "high" else -med, prefer)
        q = band(frame, top)
        others = len(cols) - len(top)
        ax.fill_between(q.index, q["p5"], q["p95"], color="#9e9e9e", alpha=0.35, linewidth=0,
                        label=f"p5–p95 of {others} others").set_gid(f"band-{axis}")
        ax.plot(q.index, q["median"], color="#616161", linewidth=1.0,
                label="median of the others")[0].set_gid(f"band-median-{axis}")
    for c in top:
        y = frame[c].dropna()  # a series sampled more sparsely than steps (GPU samples): join its points
        line, = ax.plot(y.index, y, linewidth=1.4, marker="." if len(y) < 60 else None, markersize=3, label=label_fmt(c))
        line.set_gid(f"line-{axis}-{_gid(label_fmt(c))}")
    if cols:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
                  title=f"{len(top)} of {len(cols)} {what}" if len(cols) > MANY else None)


def _gid(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")


def throughput_svg(over_time: pd.DataFrame, events: list[Event], simulated_peak: bool, steps: tuple[int, int] | None = None) -> str:
    """MFU (or TFLOP/s without a peak) and step time per step."""
    fig, (a1, a2) = _fig(2)
    if over_time["mfu"].notna().any():
        a1.plot(over_time.index, over_time["mfu"] * 100.0, color="#1565c0", linewidth=1.4)
        a1.set_ylabel("MFU (%)" + (" (simulated peak)" if simulated_peak else ""))
    else:
        a1.plot(over_time.index, over_time["tflops"], color="#1565c0", linewidth=1.4)
        a1.set_ylabel("TFLOP/s per rank")
    a2.plot(over_time.index, over_time["step_ms"], color="#2e7d32", linewidth=1.4)
    a2.set_ylabel("step time (ms)")
    for ax in (a1, a2):
        _step_axis(ax, ax is a2, steps)
    mark_events([a1, a2], events)
    _name_grid(fig, [a1, a2])
    return to_svg(fig, "plot-throughput")


def rank_time_svg(stacked: pd.DataFrame, prefer: Sequence[int] = ()) -> str:
    """Per rank, the median step split into compute / comm / data / pipeline wait (stacked horizontal bars). Above
    ``RANK_BARS`` ranks: the ranks the findings name and those with the longest total first (``FOCUS_K`` + 4 bars),
    then the ranks at the p95, median and p5 of the others' totals, each labelled so."""
    labels = {r: f"rank {r}" for r in stacked.index}
    if len(stacked) > RANK_BARS:
        total = stacked.sum(axis=1)
        top = focus(total, prefer, FOCUS_K + 4)
        rest = total.drop(index=top).sort_values(kind="stable")
        picks = []
        for q, name in ((0.95, "p95"), (0.5, "median"), (0.05, "p5")):
            r = rest.index[min(len(rest) - 1, int(round(q * (len(rest) - 1))))]
            if r not in picks:
                picks.append(r)
                labels[r] = f"rank {r} (others' {name})"
        stacked = stacked.loc[top + picks]
    n = len(stacked)
    fig, (ax,) = _fig(1, height_per_row=min(max(1.2, 0.28 * n + 0.8), 9.0), sharex=False)
    left = np.zeros(n)
    colors = {"compute": "#1565c0", "comm (exposed)": "#ef6c00", "data": "#6d4c41", "pipeline wait": "#9e9e9e"}
    ys = np.arange(n)
    for col in stacked.columns:
        vals = stacked[col].to_numpy(dtype=float)
        bars = ax.barh(ys, vals, left=left, color=colors.get(col), label=col, height=0.7)
        for r, patch in zip(stacked.index, bars):
            patch.set_gid(f"bar-{col.split()[0]}-rank{r}")
        left += vals
    ax.set_yticks(ys, [labels[r] for r in stacked.index], fontsize=8 if n <= 32 else 6)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median over steps)")
    ax.grid(True, axis="x", color="#b0b0b0", linewidth=0.6, alpha=0.6)
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    _name_grid(fig, [ax])
    return to_svg(fig, "plot-ranktime", tight=True)


def arrival_svg(lag: pd.DataFrame, events: list[Event], steps: tuple[int, int] | None = None,
                prefer: Sequence[int] = ()) -> str:
    fig, (ax,) = _fig(1, height_per_row=2.8)
    _lines(ax, lag, label_fmt=lambda r: f"rank {r}", prefer=prefer, what="ranks")
    ax.set_ylabel("ms after the first rank")
    _step_axis(ax, True, steps)
    mark_events([ax], events)
    _name_grid(fig, [ax])
    return to_svg(fig, "plot-arrival")


def gpu_svg(gpu: dict[str, pd.DataFrame], events: list[Event], simulated: bool, steps: tuple[int, int] | None = None,
            nodes: Sequence[int] = ()) -> str:
    """SM clock (a low one is the problem) and temperature (a high one) per GPU; with many GPUs, the named nodes'
    most extreme GPUs and the most extreme others in colour, the rest as a band."""
    fig, axes = _fig(len(gpu), height_per_row=2.2)
    for i, (ax, (label, frame)) in enumerate(zip(axes, gpu.items())):
        worst = "low" if "clock" in label else "high"
        med = frame.median() if worst == "high" else -frame.median()
        named = [c for c in med.sort_values(ascending=False, kind="stable").index if _node_of(c) in set(nodes)]
        _lines(ax, frame, prefer=named[:FOCUS_HALF], worst=worst, what="GPUs", axis=i)
        ax.set_ylabel(label + (" SIMULATED" if simulated else ""))
    for ax in axes:
        _step_axis(ax, ax is axes[-1], steps)
    mark_events(axes, events)
    _name_grid(fig, axes)
    return to_svg(fig, "plot-gpu")


def _node_of(gpu_name: object) -> int | None:
    """The node of a GPU series' name ("node N GPU G", series.py)."""
    m = re.match(r"node (\d+) GPU", str(gpu_name))
    return int(m.group(1)) if m else None


def training_svg(training: pd.DataFrame, overflow_steps: list[int], events: list[Event], steps: tuple[int, int] | None = None) -> str:
    fig, axes = _fig(len(training.columns), height_per_row=1.9)
    colors = {"loss": "#1565c0", "grad norm": "#2e7d32", "loss scale": "#6a1b9a"}
    for ax, col in zip(axes, training.columns):
        y = training[col]
        ax.plot(training.index, y, color=colors.get(col), linewidth=1.3)
        ax.set_ylabel(col)
        if col == "loss scale":
            if (y.dropna() > 0).all() and y.max() / max(y.min(), 1e-30) > 8:
                ax.set_yscale("log", base=2)
            ov = [s for s in overflow_steps if s in y.index]
            if ov:
                ax.scatter(ov, y.loc[ov], marker="v", color="#d32f2f", s=14, zorder=4,
                           label="overflow (step skipped)").set_gid("overflow-marks")
                ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    for ax in axes:
        _step_axis(ax, ax is axes[-1], steps)
    mark_events(axes, events)
    _name_grid(fig, axes)
    return to_svg(fig, "plot-training")


def collectives_svg(coll: pd.DataFrame, events: list[Event], steps: tuple[int, int] | None = None) -> str:
    fig, (ax,) = _fig(1, height_per_row=2.6)
    _lines(ax, coll, what="communicators")
    ax.set_ylabel("ms from the last arrival\nto completion")
    _step_axis(ax, True, steps)
    mark_events([ax], events)
    _name_grid(fig, [ax])
    return to_svg(fig, "plot-collectives")


def pipeline_svg(pdata: PlotData) -> tuple[str, float]:
    """One step's pipeline, stages x micro-batches, replayed from the measured per-stage times; and its idle share."""
    kind = "gpipe" if pdata.pipeline_schedule.lower() == "gpipe" else "1f1b"
    ops = schedule(pdata.pipeline, pdata.microbatches, kind)
    p = len(pdata.pipeline)
    fig, (ax,) = _fig(1, height_per_row=max(1.2, 0.45 * p + 0.6), sharex=False)
    for stage, op, mb, t0, t1 in ops:
        row = [s.stage for s in pdata.pipeline].index(stage)
        color = "#1565c0" if op == "F" else "#2e7d32"
        ax.broken_barh([(t0, t1 - t0)], (row - 0.4, 0.8), facecolors=color, edgecolors="white",
                       linewidth=0.5).set_gid(f"mb-{op}-{stage}-{mb}")
        if t1 - t0 > 0 and pdata.microbatches <= 32:
            ax.text((t0 + t1) / 2, row, f"{op}{mb}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p), [f"stage {s.stage}" for s in pdata.pipeline])
    ax.invert_yaxis()
    ax.set_xlabel("ms into the step (replayed)")
    ax.grid(True, axis="x", color="#b0b0b0", linewidth=0.6, alpha=0.6)
    ax.set_axisbelow(True)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="#1565c0", label="forward"), Patch(color="#2e7d32", label="backward"),
                       Patch(facecolor="none", edgecolor="#9e9e9e", label="idle (bubble)")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    _name_grid(fig, [ax])
    return to_svg(fig, "plot-pipeline", tight=True), bubble_share(ops)
