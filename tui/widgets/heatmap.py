"""Rank × step heat map of compute time (the rank's own work, excluding blocked communication).

Each cell is one block coloured by the ratio of that rank's compute time to the median
over all ranks and steps in view: a straggler is a hot row, a bad step a hot column.
On a large job (``tui.nodes.aggregated``) a row is a node, coloured by its slowest rank; zoomed into a node, its
ranks. The widget's height follows its rows (CSS ``height: auto``): 4 ranks take 4 rows, not the panel's height.
"""

from __future__ import annotations

import statistics

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from tui.model import RunView
from tui.nodes import aggregated, node_heat, node_rows

# (upper bound of compute / median, colour)
SCALE = ((0.9, "#3a6ea5"), (1.1, "#2e8b57"), (1.25, "#c8b400"), (1.6, "#e07b00"), (float("inf"), "#d0021b"))
BLOCK = "█"
LABEL_W = 6  # "r4095 " / "n511  "


def colour(ratio: float) -> str:
    for bound, c in SCALE:
        if ratio < bound:
            return c
    return SCALE[-1][1]


def render_heat(v: RunView, max_cols: int = 60, max_rows: int = 64, by_node: bool = False,
                zoom_node: int | None = None) -> Text:
    """``by_node``: one row per node (its slowest rank's compute); ``zoom_node``: only that node's ranks."""
    vals = [x for row in v.heat.values() for x in row if x is not None]
    t = Text()
    if not vals:
        t.append("no step records in the window yet", style="dim")
        return t
    med = statistics.median(vals) or 1e-9
    steps = v.steps[-max_cols:]
    off = len(v.steps) - len(steps)
    if by_node:
        heat = node_heat(v)  # in the rank table's order: problem nodes first
        rows = [(f"n{n.node}", heat[n.node], n.culprit) for n in node_rows(v.rows)]
    else:
        keep = None if zoom_node is None else {r.rank for r in v.rows if r.node == zoom_node}
        rows = [(f"r{rank}", row, rank in v.culprits) for rank, row in sorted(v.heat.items())
                if keep is None or rank in keep]
    for label, row, hot in rows[:max_rows]:
        t.append(f"{label:<{LABEL_W}}"[:LABEL_W], style="bold red" if hot else "")
        # One span per run of equal colour: far fewer segments to render than one per block.
        cells = [("·", "dim") if x is None else (BLOCK, colour(x / med)) for x in row[off:]]
        j = 0
        while j < len(cells):
            k = j
            while k < len(cells) and cells[k] == cells[j]:
                k += 1
            t.append(cells[j][0] * (k - j), style=cells[j][1])
            j = k
        t.append("\n")
    if len(rows) > max_rows:
        t.append(f"… {len(rows) - max_rows} more {'nodes' if by_node else 'ranks'}\n", style="dim")
    t.rstrip()
    return t


def scale_note(v: RunView, by_node: bool) -> str:
    """What a block means (for the panel's top border): the median it is compared to, and the steps in view."""
    vals = [x for row in v.heat.values() for x in row if x is not None]
    if not vals or not v.steps:
        return ""
    return (f"median {statistics.median(vals):.1f} ms, steps {v.steps[0]}–{v.steps[-1]}"
            + (", a node = its slowest rank, problems first" if by_node else ""))


def legend_markup() -> str:
    """The colour scale, for the panel's bottom border."""
    return " ".join(f"[{c}]{BLOCK}[/]{label}" for (_, c), label in zip(SCALE, ("<0.9×", "≈1×", "<1.25×", "<1.6×",
                                                                               "≥1.6×")))


class HeatMap(Static):
    view: reactive[RunView | None] = reactive(None, always_update=True)
    zoom_node: reactive[int | None] = reactive(None)

    def watch_view(self) -> None:
        self._redraw()

    def watch_zoom_node(self) -> None:
        self._redraw()

    def on_resize(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        v = self.view
        if v is None:
            self.update("")
            return
        by_node = aggregated(v) and self.zoom_node is None
        width = max(10, (self.content_region.width or 64) - LABEL_W)
        self.update(render_heat(v, max_cols=width, max_rows=256, by_node=by_node, zoom_node=self.zoom_node))
        what = ("node × step" if by_node else f"node {self.zoom_node}: rank × step" if self.zoom_node is not None
                else "rank × step")
        note = scale_note(v, by_node)
        self.border_title = f"compute heat map ({what})" + (f" {note}" if note else "")
        self.border_subtitle = legend_markup()
