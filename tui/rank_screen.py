"""The rank drill-down screen (Enter on a rank row, or ``d``): one rank over the live window.

A sparkline per series (step time, compute, exposed comm, data wait, sync wait; pipeline wait when there is any),
each labelled with the rank's last, min and max and its peers' median; its node, host, stage and state; the findings
that name it (or its node); its GPU samples. Like the traces screen it holds no data: the app hands it each refresh's
view (the reactive ``view``), and ``rank`` (``[``/``]`` step through the ranks) picks what it shows.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Sparkline, Static

from tui.model import RunView, fmt_age, fmt_ms
from tui.rank_model import SERIES, RankDetail, Series, neighbour, rank_detail
from tui.widgets.findings import SEV_STYLE, fmt_steps
from tui.widgets.gpus import COLUMNS as GPU_COLUMNS, gpu_cells
from tui.widgets.header import StatusBar
from tui.widgets.ranks import STATE_STYLE


def series_label(s: Series, width: int = 0) -> Text:
    t = Text()
    t.append(f"{s.label:<15}", style="bold")
    if not s.values:
        t.append("not measured" if s.missing else "no data", style="dim")
        return t
    t.append(f"last {fmt_ms(s.last)}", style="bold")
    t.append(f"  min {fmt_ms(min(s.values))}  max {fmt_ms(max(s.values))} ms", style="dim")
    if s.peers is not None:
        ratio = f" ({s.last / s.peers:.2f}×)" if s.peers > 0 and s.last is not None else ""
        t.append(f"   peers' median {fmt_ms(s.peers)}{ratio}", style="dim")
    if s.missing:
        t.append(f"   {s.missing} step{'s' if s.missing != 1 else ''} not measured", style="dim")
    return t


def head_text(d: RankDetail, run_id: str) -> Text:
    t = Text()
    r = d.row
    t.append("rank ", style="dim")
    t.append(str(d.rank), style="bold red" if r is not None and r.culprit else "bold")
    if r is None:
        t.append("  not in this run's ranks (any more)", style="yellow")
        return t
    t.append(f"  node {'—' if r.node is None else r.node}" + (f" ({r.host})" if r.host else ""))
    t.append(f"  stage {'—' if r.stage is None else r.stage}  last step {'—' if r.last_step is None else r.last_step}")
    t.append(f"  seen {fmt_age(r.age_s)} ago  ", style="dim")
    t.append(f" {r.state} ", style=STATE_STYLE.get(r.state, "") + " reverse")
    if r.culprit:
        t.append("  ▶ culprit of the worst findings", style="bold red")
    if r.exit_reason:
        t.append(f"  exit: {r.exit_reason}", style="dim")
    t.append(f"\nrun {run_id}  ", style="dim")
    if d.steps:
        t.append(f"window steps {d.steps[0]}–{d.steps[-1]} ({len(d.steps)} reported)", style="dim")
    else:
        t.append("no step records of this rank in the window", style="dim")
    return t


def findings_text(d: RankDetail) -> Text:
    t = Text()
    if not d.findings:
        t.append("no findings name this rank or its node", style="dim")
        return t
    for i, f in enumerate(d.findings):
        if i:
            t.append("\n")
        t.append(f" {f.severity} ", style=SEV_STYLE.get(f.severity, ""))
        t.append(f" {f.kind} ", style="bold")
        t.append(f"steps {fmt_steps(f)}  ", style="dim")
        t.append(f.summary or f.analyzer)
    return t


class RankScreen(Screen):
    BINDINGS = [Binding("escape,d", "back", "Back"), Binding("left_square_bracket", "step(-1)", "Prev rank"),
                Binding("right_square_bracket", "step(1)", "Next rank"),
                Binding("a", "app.request_action", "Action"), Binding("o", "app.ops", "Raw ops"),
                Binding("r", "app.refresh_now", "Refresh"),
                Binding("p", "app.toggle_pause", "Pause"), Binding("question_mark", "app.help", "Help"),
                Binding("q", "app.quit", "Quit")]

    view: reactive[RunView | None] = reactive(None, always_update=True)
    rank: reactive[int] = reactive(0)

    def __init__(self, rank: int, view: RunView | None = None) -> None:
        super().__init__()
        self.set_reactive(RankScreen.rank, rank)
        self.set_reactive(RankScreen.view, view)
        self._ready = False
        self._status: Text | None = None

    def compose(self) -> ComposeResult:
        yield StatusBar(id="rank-status")
        yield Static("", id="rank-head")
        with VerticalScroll(id="rank-body"):
            with Vertical(id="rank-series"):
                for label, key in SERIES:
                    yield Label("", id=f"lbl-{key}", classes="series-label")
                    yield Sparkline([], id=f"spark-{key}", classes="series-spark")
            yield Static("", id="rank-findings")
            yield DataTable(id="rank-gpus", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#rank-series").border_title = "history over the live window (one block per step)"
        self.query_one("#rank-findings").border_title = "findings"
        gt = self.query_one("#rank-gpus", DataTable)
        gt.border_title = "GPU samples"
        for label, key in GPU_COLUMNS:
            gt.add_column(label, key=key)
        self._ready = True
        if self._status is not None:
            self.query_one(StatusBar).update(self._status)
        self._redraw()

    def watch_view(self) -> None:
        self._redraw()

    def watch_rank(self) -> None:
        self._redraw()

    def show_status(self, renderable: Text) -> None:
        self._status = renderable
        if self._ready:
            self.query_one(StatusBar).update(renderable)

    def selected_rank(self) -> int:
        return self.rank

    def detail(self) -> RankDetail | None:
        return None if self.view is None else rank_detail(self.view, self.rank)

    def _redraw(self) -> None:
        if not self._ready:  # before on_mount the widgets are not there yet
            return
        v = self.view
        d = self.detail()
        if v is None or d is None:
            self.query_one("#rank-head", Static).update(Text(f"rank {self.rank}: reading the head…", style="dim"))
            return
        self.query_one("#rank-head", Static).update(head_text(d, v.run_id))
        shown = {s.key: s for s in d.series}
        for _, key in SERIES:
            s = shown.get(key)
            lbl, spark = self.query_one(f"#lbl-{key}", Label), self.query_one(f"#spark-{key}", Sparkline)
            lbl.display = spark.display = s is not None
            if s is not None:
                lbl.update(series_label(s))
                spark.data = list(s.values)
        self.query_one("#rank-findings", Static).update(findings_text(d))
        gt = self.query_one("#rank-gpus", DataTable)
        gt.clear()
        for g in d.gpus:
            gt.add_row(*gpu_cells(g), key=f"{g.node}/{g.gpu}")
        gt.border_title = f"GPU samples ({len(d.gpus)})" if d.gpus else "GPU samples: none name this rank"

    def action_step(self, n: int) -> None:
        if self.view is not None:
            self.rank = neighbour(self.view, self.rank, n)

    def action_back(self) -> None:
        self.dismiss(None)
