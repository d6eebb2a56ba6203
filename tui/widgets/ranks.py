"""The per-rank table: one row per rank, culprit rows highlighted."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tui.model import RankRow, fmt_age, fmt_ms

# Times are milliseconds of the rank's latest step; "seen" is how long ago the head last heard from it.
COLUMNS = (("", "mark"), ("rank", "rank"), ("node", "node"), ("stage", "stage"), ("step", "step"),
           ("step ms", "step_ms"), ("compute", "compute_ms"), ("comm", "comm_ms"), ("data", "data_ms"),
           ("seen", "seen"), ("state", "state"))
STATE_STYLE = {"ok": "green", "slow": "bold yellow", "stale": "bold magenta", "evicted": "bold red",
               "done": "dim", "waiting": "dim", "unknown": "dim"}
CULPRIT_STYLE = "bold red"
CULPRIT_MARK = "▶"


def row_cells(r: RankRow) -> list[Text]:
    vals = [CULPRIT_MARK if r.culprit else "", str(r.rank), "—" if r.node is None else str(r.node),
            "—" if r.stage is None else str(r.stage), "—" if r.last_step is None else str(r.last_step),
            fmt_ms(r.step_ms), fmt_ms(r.compute_ms), fmt_ms(r.comm_ms), fmt_ms(r.data_ms), fmt_age(r.age_s)]
    style = CULPRIT_STYLE if r.culprit else ""
    cells = [Text(v, style=style, justify="right" if i > 0 else "left") for i, v in enumerate(vals)]
    cells.append(Text(r.state, style=STATE_STYLE.get(r.state, "") + (" reverse" if r.culprit else "")))
    return cells


class RankTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for label, key in COLUMNS:
            self.add_column(label, key=key)

    def selected_rank(self) -> int | None:
        if self.row_count == 0:
            return None
        try:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        except Exception:
            return None
        return int(key.value) if key.value is not None else None

    def show_rows(self, rows: list[RankRow]) -> None:
        keys = [str(r.rank) for r in rows]
        current = [k.value for k in self.rows]
        if keys == current:
            for r in rows:
                for (_, col), cell in zip(COLUMNS, row_cells(r)):
                    self.update_cell(str(r.rank), col, cell, update_width=True)
            return
        keep = self.selected_rank()
        self.clear()
        for r in rows:
            self.add_row(*row_cells(r), key=str(r.rank))
        if keep is not None and str(keep) in keys:
            self.move_cursor(row=keys.index(str(keep)))
