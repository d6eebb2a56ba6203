"""Rank × step heat map of compute time (the rank's own work, excluding blocked communication).

Each cell is one block coloured by the ratio of that rank's compute time to the median
over all ranks and steps in view: a straggler is a hot row, a bad step a hot column.
"""

from __future__ import annotations

import statistics

from rich.text import Text
from textual.widgets import Static

from tui.model import RunView

# (upper bound of compute / median, colour)
SCALE = ((0.9, "#3a6ea5"), (1.1, "#2e8b57"), (1.25, "#c8b400"), (1.6, "#e07b00"), (float("inf"), "#d0021b"))
BLOCK = "█"


def colour(ratio: float) -> str:
    for bound, c in SCALE:
        if ratio < bound:
            return c
    return SCALE[-1][1]


def render_heat(v: RunView, max_cols: int = 60, max_rows: int = 64) -> Text:
    vals = [x for row in v.heat.values() for x in row if x is not None]
    t = Text()
    if not vals:
        t.append("no step records in the window yet", style="dim")
        return t
    med = statistics.median(vals) or 1e-9
    steps = v.steps[-max_cols:]
    off = len(v.steps) - len(steps)
    t.append(f"compute ms / median {med:.1f} ms, steps {steps[0]}–{steps[-1]}\n", style="dim")
    for i, (rank, row) in enumerate(sorted(v.heat.items())[:max_rows]):
        t.append(f"r{rank:<3}", style="bold red" if rank in v.culprits else "")
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
    if len(v.heat) > max_rows:
        t.append(f"… {len(v.heat) - max_rows} more ranks\n", style="dim")
    t.append("    ")
    for (bound, c), label in zip(SCALE, ("<0.9×", "≈1×", "<1.25×", "<1.6×", "≥1.6×")):
        t.append(BLOCK, style=c)
        t.append(f"{label} ", style="dim")
    return t


class HeatMap(Static):
    def show_view(self, v: RunView | None) -> None:
        if v is None:
            self.update("")
            return
        width = max(10, (self.size.width or 64) - 6)
        self.update(render_heat(v, max_cols=width))
