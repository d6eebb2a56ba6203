"""The traces panel: a header that says which capture window and which device, over a per-rank (or per-node) table.

Its state is three reactive attributes the screen sets (``view``, ``stale``, ``missing``); every change, and
every resize (which decides ranks or nodes), re-renders it.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import DataTable, Static

from tui.trace_model import (CPU_NOTE, EMPTY_NOTE, TraceLine, TraceView, fmt_num, fmt_ratio, fmt_share)

SLOWEST_STYLE = "bold red"
SLOWEST_MARK = "▶"
TRUNCATED_MARK = "!"
CPU_STYLE = "bold black on magenta"
RANK_COLUMNS = (("", "mark"), ("rank", "rank"), ("node", "node"), ("kernel", "kernel"), ("NCCL", "nccl"),
                ("exposed", "exposed"), ("idle", "idle"), ("×median", "ratio"))
NODE_COLUMNS = (("", "mark"), ("node", "node"), ("ranks", "ranks"), ("slowest", "rank"), ("kernel", "kernel"),
                ("NCCL", "nccl"), ("exposed", "exposed"), ("idle", "idle"), ("×median", "ratio"))
CPU_LABELS = {"kernel": "host op", "nccl": "comm"}  # a CPU trace has no kernels and no NCCL
CHROME_ROWS = 3  # the table's border (2) and its header row


def line_cells(line: TraceLine, by_node: bool) -> list[Text]:
    style = SLOWEST_STYLE if line.slowest else ""
    mark = SLOWEST_MARK if line.slowest else ""
    if line.truncated:
        mark += TRUNCATED_MARK
    node = "?" if line.node is None else str(line.node)
    figures = [fmt_num(line.kernel), fmt_num(line.nccl), fmt_num(line.exposed), fmt_share(line.idle_share)]
    vals = [mark] + ([node, str(line.ranks), str(line.rank)] if by_node else [str(line.rank), node]) + figures
    cells = [Text(v, style=style, justify="left" if i == 0 else "right") for i, v in enumerate(vals)]
    cells.append(Text(fmt_ratio(line.ratio), style=SLOWEST_STYLE + " reverse" if line.slowest else "",
                      justify="right"))
    return cells


def header_text(v: TraceView | None, *, by_node: bool, stale: str = "", missing: bool = False,
                gpu_simulated: bool = False) -> Text:
    """Which steps, which device (and the CPU caveat), how many ranks, the median and the slowest; or why none."""
    t = Text()
    if stale:
        t.append(" STALE ", style="bold white on red")
        t.append(f" {stale}\n", style="bold red")
    if missing:
        t.append("the head has no traces endpoint (GET /api/runs/<id>/traces): upgrade the head to see traces",
                 style="dim")
        return t
    if v is None:
        t.append("reading the head…", style="dim")
        return t
    if v.empty:
        t.append(EMPTY_NOTE, style="bold")
        return t
    unit = "ms per step" if v.per_step else "ms over the whole capture (no ProfilerStep marks: no step count)"
    steps = (f"steps {v.step_start}–{v.step_end} ({v.steps} step{'s' if v.steps != 1 else ''})" if v.per_step
             else "steps unknown")
    t.append("capture ", style="dim")
    t.append(steps, style="bold")
    t.append(f" {'on demand' if v.kind == 'ondemand' else 'periodic'}", style="dim")
    t.append("  device ", style="dim")
    t.append(", ".join(v.devices) or "?", style="bold")
    n = len(v.ranks)
    t.append(f"  {n}{f' of {v.world}' if v.world and v.world != n else ''} rank{'s' if n != 1 else ''}")
    if gpu_simulated:
        t.append("  ")
        t.append(" SIMULATED GPU ", style=CPU_STYLE)
    t.append("\n")
    if v.cpu:
        t.append(f" {CPU_NOTE} ", style=CPU_STYLE)
        t.append("\n")
    t.append(f"{unit}; median kernel ", style="dim")
    t.append(fmt_num(v.median_kernel), style="bold")
    if v.slowest is not None:
        t.append("  slowest ", style="dim")
        t.append(f"rank {v.slowest.rank}" + (f" (node {v.slowest.node})" if v.slowest.node is not None else "")
                 + f" {fmt_ratio(v.slowest.ratio)}", style=SLOWEST_STYLE)
    if by_node:
        t.append("\none row per node (its slowest rank's figures): more ranks than rows", style="dim")
    if v.truncated:
        t.append(f"\n{TRUNCATED_MARK} {v.truncated} trace{'s' if v.truncated != 1 else ''} cut short: "
                 "figures cover what was read", style="yellow")
    return t


class TracePanel(Vertical):
    """The newest capture window, ranks or nodes."""

    view: reactive[TraceView | None] = reactive(None, always_update=True)
    stale: reactive[str] = reactive("")  # why the data is old ("" when fresh)
    missing: reactive[bool] = reactive(False)  # the head has no traces endpoint
    gpu_simulated: reactive[bool] = reactive(False)

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.by_node = False
        self._keys: dict[str, int] = {}  # row key -> the rank it stands for (a node row: its slowest rank)
        self._shape: tuple | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="trace-header")
        yield DataTable(id="trace-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        self.query_one("#trace-table").border_title = "profiler trace: newest capture"
        self._redraw()

    def watch_view(self) -> None:
        self._redraw()

    def watch_stale(self) -> None:
        self._redraw()

    def watch_missing(self) -> None:
        self._redraw()

    def watch_gpu_simulated(self) -> None:
        self._redraw()

    def on_resize(self) -> None:
        self._redraw()

    def rows_that_fit(self, header_lines: int) -> int:
        return self.size.height - header_lines - CHROME_ROWS

    def selected_rank(self) -> int | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except Exception:
            return None
        return self._keys.get(str(key.value))

    def _redraw(self) -> None:
        if not self.is_mounted:
            return
        v = self.view
        lines = v.ranks if v is not None else []
        # nodes when the ranks do not fit (the height is 0 before the first layout: ranks until then)
        probe = header_text(v, by_node=False, stale=self.stale, missing=self.missing,
                            gpu_simulated=self.gpu_simulated)
        fit = self.rows_that_fit(len(probe.plain.splitlines()) + 1)
        self.by_node = bool(lines) and self.size.height > 0 and len(lines) > fit
        head = header_text(v, by_node=self.by_node, stale=self.stale, missing=self.missing,
                           gpu_simulated=self.gpu_simulated)
        self.query_one("#trace-header", Static).update(head)
        table = self.query_one(DataTable)
        shown = v.nodes() if (v is not None and self.by_node) else lines
        columns = NODE_COLUMNS if self.by_node else RANK_COLUMNS
        keep = self.selected_rank()
        cpu = v is not None and v.cpu
        if self._shape != (self.by_node, cpu):
            table.clear(columns=True)
            for label, key in columns:
                table.add_column(CPU_LABELS.get(key, label) if cpu else label, key=key)
            self._shape = (self.by_node, cpu)
        else:
            table.clear()
        self._keys = {}
        for line in shown:
            key = f"n{line.node}" if self.by_node else f"r{line.rank}"
            self._keys[key] = line.rank
            table.add_row(*line_cells(line, self.by_node), key=key)
        if keep is not None:
            for i, line in enumerate(shown):
                if line.rank == keep:
                    table.move_cursor(row=i)
                    break
        table.border_title = ("profiler trace: newest capture, by node" if self.by_node
                              else "profiler trace: newest capture, by rank")
        self.set_class(bool(self.stale), "stale")
