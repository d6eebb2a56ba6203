"""The per-rank table: one row per rank, culprit rows highlighted; one row per node on a large job.

Its state is reactive, bound to the app's (``data_bind``): ``view`` (the run), ``zoom_node`` (the node zoomed into,
or None) and ``stale_since`` (when the head became unreachable). Any change re-renders it: ranks, or nodes when the
job is too large to show rank by rank (``tui.nodes.aggregated``) and no node is zoomed into.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from tui.model import RankRow, RunView, fmt_age, fmt_ms
from tui.nodes import NodeRow, aggregated, node_rows, zoomed_rows
from tui.widgets.header import clock

# Times are milliseconds of the rank's latest step; "seen" is how long ago the head last heard from it.
COLUMNS = (("", "mark"), ("rank", "rank"), ("node", "node"), ("stage", "stage"), ("step", "step"),
           ("step ms", "step_ms"), ("compute", "compute_ms"), ("comm", "comm_ms"), ("data", "data_ms"),
           ("seen", "seen"), ("state", "state"))
# A node row: its ranks, the span of their last steps, and its worst rank's figures (named in "worst").
NODE_COLUMNS = (("", "mark"), ("node", "node"), ("ranks", "ranks"), ("step", "step"), ("worst", "rank"),
                ("step ms", "step_ms"), ("compute", "compute_ms"), ("comm", "comm_ms"), ("data", "data_ms"),
                ("seen", "seen"), ("state", "state"))
STATE_STYLE = {"ok": "green", "slow": "bold yellow", "stale": "bold magenta", "evicted": "bold red",
               "failed": "bold red", "done": "dim", "waiting": "dim", "ended": "dim", "unknown": "dim"}
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


def node_cells(n: NodeRow) -> list[Text]:
    w = n.worst
    span = "—" if n.step_lo is None else str(n.step_hi) if n.step_lo == n.step_hi else f"{n.step_lo}–{n.step_hi}"
    vals = [CULPRIT_MARK if n.culprit else "", "—" if n.node is None else str(n.node), str(len(n.ranks)), span,
            str(w.rank), fmt_ms(w.step_ms), fmt_ms(w.compute_ms), fmt_ms(w.comm_ms), fmt_ms(w.data_ms),
            fmt_age(w.age_s)]
    style = CULPRIT_STYLE if n.culprit else ""
    cells = [Text(v, style=style, justify="right" if i > 0 else "left") for i, v in enumerate(vals)]
    cells.append(Text(n.state_label, style=STATE_STYLE.get(n.state, "") + (" reverse" if n.culprit else "")))
    return cells


class RankTable(DataTable):
    view: reactive[RunView | None] = reactive(None, always_update=True)
    zoom_node: reactive[int | None] = reactive(None)
    stale_since: reactive[float | None] = reactive(None)

    def __init__(self, **kw) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.by_node = False  # rows are nodes (a large job, not zoomed)
        self._shape: bool | None = None
        self._node_rows: dict[str, NodeRow] = {}
        self._ready = False

    def on_mount(self) -> None:
        self._ready = True
        self._redraw()

    def watch_view(self) -> None:
        self._redraw()

    def watch_zoom_node(self) -> None:
        self._redraw()

    def watch_stale_since(self) -> None:
        self._redraw()

    def selected_key(self) -> str | None:
        if self.row_count == 0:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except Exception:
            return None

    def selected_rank(self) -> int | None:
        """The selected rank (a node row: the rank it stands for, its worst)."""
        key = self.selected_key()
        if key is None:
            return None
        if key in self._node_rows:
            return self._node_rows[key].worst.rank
        return int(key) if key.lstrip("-").isdigit() else None

    def selected_node_row(self) -> NodeRow | None:
        key = self.selected_key()
        return self._node_rows.get(key) if key is not None else None

    def _redraw(self) -> None:
        if not self._ready:
            return
        v = self.view
        if v is None:
            self.border_title = "ranks"
            return
        self.by_node = aggregated(v) and self.zoom_node is None
        shown = zoomed_rows(v, self.zoom_node) if self.zoom_node is not None else v.rows
        if self._shape != self.by_node:
            self.clear(columns=True)
            for label, key in NODE_COLUMNS if self.by_node else COLUMNS:
                self.add_column(label, key=key)
            self._shape = self.by_node
        if self.by_node:
            nodes = node_rows(v.rows)
            self._node_rows = {f"n{n.node}": n for n in nodes}
            self._fill(list(self._node_rows), [node_cells(n) for n in nodes], NODE_COLUMNS)
        else:
            self._node_rows = {}
            self._fill([str(r.rank) for r in shown], [row_cells(r) for r in shown], COLUMNS)
        n_culprit = sum(1 for r in v.rows if r.culprit)
        what = (f"nodes ({len(self._node_rows)} nodes, {len(v.rows)} ranks, problems first): Enter zooms" if self.by_node
                else f"node {self.zoom_node}: ranks {len(shown)} of {len(v.rows)} (esc: all nodes)"
                if self.zoom_node is not None else f"ranks ({len(v.rows)})")
        culprits = f", {n_culprit} culprit" if n_culprit else ""
        self.border_title = (f"{what} — STALE: head unreachable since {clock(self.stale_since)}"
                             if self.stale_since is not None else f"{what}{culprits} — ms of the last step")

    def _fill(self, keys: list[str], cells: list[list[Text]], columns: tuple) -> None:
        # the same rows: update the cells in place (the cursor and scroll stay put). Each update_cell re-measures its
        # column over every row, so on hundreds of rows a rebuild is the cheaper way (the cursor is restored below).
        if len(keys) <= 64 and keys == [k.value for k in self.rows]:
            for key, row in zip(keys, cells):
                for (_, col), cell in zip(columns, row):
                    self.update_cell(key, col, cell, update_width=True)
            return
        keep = self.selected_key()
        self.clear()
        for key, row in zip(keys, cells):
            self.add_row(*row, key=key)
        if keep is not None and keep in keys:
            self.move_cursor(row=keys.index(keep))
