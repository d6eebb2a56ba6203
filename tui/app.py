"""The ranksight TUI: a live view of one run, fed by the head's HTTP API.

Every ``interval`` seconds (unless paused) a worker thread reads the head
(``HeadClient.fetch``); the main thread turns the result into a ``RunView`` and
hands each widget its part. A failed read never raises into Textual: it turns
into the status line ("head unreachable since …", "head error: …") and the
panels keep the last good data, marked stale.
"""

from __future__ import annotations

import asyncio
import getpass
import time
from typing import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.reactive import reactive
from textual.widgets import DataTable, Footer

from tui.client import ClientError, HeadClient, HeadError, HeadUnreachable, RunSummary, StepWindow, TraceRow
from tui.model import RunView, build_view
from tui.help import HelpScreen
from tui.nodes import aggregated
from tui.ops_screen import OpsScreen
from tui.rank_screen import RankScreen
from tui.screens import ActionModal, ActionRequest, RunPicker
from tui.trace_model import build_trace_view
from tui.trace_screen import TraceScreen
from tui.widgets.actions import ActionsTable
from tui.widgets.findings import FindingDetail, FindingsTable
from tui.widgets.gpus import GpuPanel
from tui.widgets.header import RunHeader, StatusBar, clock, status_text
from tui.widgets.heatmap import HeatMap
from tui.widgets.ranks import RankTable
from tui.widgets.trends import Trends


class RanksightApp(App):
    """The app: its layout, the refresh cycle, and one action per key binding (with the callback of the modal it
    opens). That is more than ~15 methods, kept in one class because Textual binds keys to ``action_*`` methods of
    the app and splitting them apart would scatter the key map."""

    CSS_PATH = "ranksight.tcss"
    TITLE = "ranksight"
    BINDINGS = [
        Binding("p", "toggle_pause", "Pause"),
        # show=False: not in the footer (80 columns hold the rest); ? lists every key
        Binding("r", "refresh_now", "Refresh", show=False),
        Binding("f", "focus_findings", "Findings"),
        Binding("d", "drill", "Rank", show=False),
        Binding("z", "zoom", "Zoom", show=False),
        Binding("escape", "unzoom", "All nodes", show=False),
        Binding("a", "request_action", "Action"),
        Binding("g", "pick_run", "Runs"),
        Binding("t", "show_traces", "Traces"),
        Binding("o", "ops", "Raw ops", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]
    # The screen gets -narrow below 120 columns (panels stack and the body scrolls) and -short below 40 rows.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]

    # The state the panels show, bound to them (``data_bind``): setting one re-renders what depends on it.
    view: reactive[RunView | None] = reactive(None, always_update=True)
    run_id: reactive[str | None] = reactive(None)
    zoom_node: reactive[int | None] = reactive(None)  # the node zoomed into on a large job
    stale_since: reactive[float | None] = reactive(None)  # the head unreachable since (the panels say STALE)

    def __init__(self, client: HeadClient, run_id: str | None = None, interval: float = 1.0, window: int = 60,
                 clock_fn: Callable[[], float] = time.time, head_label: str | None = None):
        super().__init__()
        self.client = client
        self.head_label = head_label  # how the status line names the head (default: its URL)
        self.set_reactive(RanksightApp.run_id, run_id)
        self.interval = interval
        self.window = window
        self.now = clock_fn
        self.paused = False
        self.runs: list[RunSummary] = []
        self.last_ok: float | None = None
        self.unreachable_since: float | None = None
        self.error = ""
        self.skipped: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._steps = StepWindow(window)
        self._picker: RunPicker | None = None
        # the traces screen's data: read only while it is open; None until the first read for this run
        self.trace_rows: list[TraceRow] | None = None
        self.traces_missing = False  # the head has no traces endpoint
        self.traces_ok_at: float | None = None
        self._traces: TraceScreen | None = None
        self._rank_screen: RankScreen | None = None
        self.timer = None

    # -- layout ---------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        cls = RanksightApp
        yield StatusBar(id="status")
        yield RunHeader(id="header").data_bind(cls.view, cls.run_id)
        # A grid when wide (ranks and heat map over the trends, left; findings, detail and actions, right), one
        # scrolled column when narrow: ranks, heat map, findings, detail, actions, trends (the CSS decides).
        with Container(id="body"):
            with Vertical(id="left"):
                yield RankTable(id="ranks").data_bind(cls.view, cls.zoom_node, cls.stale_since)
                yield HeatMap(id="heatmap").data_bind(cls.view, cls.zoom_node)
            with Vertical(id="right"):
                yield FindingsTable(id="findings")
                yield FindingDetail(id="detail")
                yield ActionsTable(id="actions")
            yield Trends(id="trends").data_bind(cls.view)
        yield GpuPanel(id="gpus")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#trends").border_title = "trends"
        self.query_one("#findings").border_title = "findings"
        self.query_one("#detail").border_title = "finding detail"
        self.query_one("#actions").border_title = "actions"
        self.query_one("#gpus").border_title = "GPUs"
        self._show_status()
        self.timer = self.set_interval(self.interval, self._tick, name="refresh")
        if self.run_id is None:
            self.action_pick_run()
        self._tick()

    # -- refresh ----------------------------------------------------------------------
    def _tick(self) -> None:
        if not self._lock.locked():  # a slow head: skip this tick rather than pile up requests
            self.run_worker(self.refresh_now(), group="fetch", exit_on_error=False)

    async def refresh_now(self) -> None:
        """Read the head once and update every panel (waits for a read already in flight first)."""
        async with self._lock:
            await self._refresh_locked()
        try:
            self._apply()
        except Exception as e:  # odd data a widget cannot show: say so, keep running
            self.error = f"display error {type(e).__name__}: {e}"
            self._show_status()

    async def _refresh_locked(self) -> None:
        try:
            if self.run_id is None:
                skipped: dict[str, int] = {}
                runs = await asyncio.to_thread(self.client.runs, skipped)
                self.runs, self.skipped = runs, skipped
            else:
                run_id = self.run_id
                with_traces = self._traces_open()
                data = await asyncio.to_thread(self.client.fetch, run_id, self.window, self._steps, with_traces)
                if run_id != self.run_id:  # the user switched runs meanwhile
                    return
                self.runs = data.runs
                self.view = build_view(run_id, data, self.window)
                self.skipped = self.view.skipped
                if with_traces:
                    self.trace_rows, self.traces_missing = data.traces, data.traces_missing
                    self.traces_ok_at = self.now()
            self.last_ok = self.now()
            self.unreachable_since = None
            self.error = ""
        except HeadUnreachable as e:
            if self.unreachable_since is None:
                self.unreachable_since = self.now()
            self.error = str(e)
        except ClientError as e:
            self.unreachable_since = None
            self.error = str(e)
        except Exception as e:  # a bug in parsing/model code must not take the screen down
            self.error = f"unexpected {type(e).__name__}: {e}"

    def _traces_open(self) -> bool:
        return self._traces is not None

    def _apply(self) -> None:
        self._show_status()
        if self._picker is not None and self._picker.is_attached:
            self._picker.show_runs(self.runs)
        if self._traces_open():
            self._apply_traces()
        v = self.view
        if v is None or v.run_id != self.run_id:
            return
        if self._rank_screen is not None:
            self._rank_screen.view = v
        stale = self.unreachable_since is not None
        self.stale_since = self.unreachable_since
        self.query_one("#body").set_class(stale, "stale")
        ft = self.query_one(FindingsTable)
        ft.show_findings(v.findings)
        ft.border_title = f"findings ({len(v.findings)})"
        self.query_one(FindingDetail).show_finding(ft.selected())
        self.query_one(ActionsTable).show_actions(v.actions)
        gp = self.query_one(GpuPanel)
        gp.show_gpus(v.gpus)
        gp.set_class(stale, "stale")
        if stale:
            gp.border_title = f"{gp.border_title} — STALE"

    def _apply_traces(self) -> None:
        v = self.view if self.view is not None and self.view.run_id == self.run_id else None
        world = v.run.world_size if v is not None and v.run is not None else None
        stale = ""
        if self.error and self.trace_rows is not None:
            read = clock(self.traces_ok_at) if self.traces_ok_at else "never"
            why = (f"head unreachable since {clock(self.unreachable_since)}" if self.unreachable_since is not None
                   else "the last read failed")
            stale = f"{why}: showing the capture read at {read}"
        self._traces.show(None if self.trace_rows is None else build_trace_view(self.trace_rows, world),
                          stale=stale, missing=self.traces_missing, gpu_simulated=bool(v and v.gpu_simulated))

    def _show_status(self) -> None:
        t = status_text(self.head_label or self.client.base_url, unreachable_since=self.unreachable_since, error=self.error,
                        last_ok=self.last_ok, paused=self.paused, skipped=self.skipped)
        self.query_one(StatusBar).update(t)
        if self._picker is not None and self._picker.is_attached:
            self._picker.show_status(t)
        if self._traces_open():
            self._traces.show_status(t)
        if self._rank_screen is not None:
            self._rank_screen.show_status(t)

    # -- events -------------------------------------------------------------------------
    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if isinstance(event.data_table, FindingsTable):
            self.query_one(FindingDetail).show_finding(event.data_table.selected())

    # -- actions (key bindings) --------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Over the run picker or the action dialog only quit, pause and refresh apply.
        # Over the traces screen, also the action dialog (its empty state says "press a").
        if action in ("request_action", "help", "ops") and isinstance(self.screen, (TraceScreen, RankScreen)):
            return True
        if action in ("request_action", "focus_findings", "pick_run", "show_traces", "drill", "zoom", "unzoom",
                      "help", "ops") and self.screen is not self.screen_stack[0]:
            return False
        if action == "unzoom":
            return self.zoom_node is not None
        return True

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if self.timer is not None:
            (self.timer.pause if self.paused else self.timer.resume)()
        self._show_status()

    def action_refresh_now(self) -> None:
        self._tick()

    def action_focus_findings(self) -> None:
        self.query_one(FindingsTable).focus()

    def action_pick_run(self) -> None:
        if self._picker is not None and self._picker.is_attached:
            return
        self._picker = RunPicker(self.runs)
        self.push_screen(self._picker, self._picked)

    def action_show_traces(self) -> None:
        if self.run_id is None:
            self.notify("no run open: pick one with g", severity="warning")
            return
        if self._traces_open():
            return
        self._traces = TraceScreen()
        self.push_screen(self._traces, self._traces_closed)
        self._apply_traces()  # the screen shows it once composed
        self._show_status()
        self._tick()  # the traces are read only while the screen is open: read them now

    def _traces_closed(self, _result: None) -> None:
        self._traces = None

    def action_drill(self, rank: int | None = None) -> None:
        """The drill-down screen of the selected rank (a node row: the rank it stands for)."""
        if rank is None:
            rank = self.query_one(RankTable).selected_rank()
        if self.view is None or rank is None:
            self.notify("no rank selected", severity="warning")
            return
        self._rank_screen = RankScreen(rank, self.view)
        self.push_screen(self._rank_screen, self._rank_closed)
        self._show_status()

    def _rank_closed(self, _result: None) -> None:
        self._rank_screen = None

    def action_ops(self) -> None:
        """The raw-ops screen of the selected rank (the drill-down's rank, the traces screen's row, the table's):
        its raw collective records over its last steps, read from its node on demand."""
        screen = self.screen
        rank = screen.selected_rank() if isinstance(screen, (TraceScreen, RankScreen)) else None
        if rank is None:
            rank = self.query_one(RankTable).selected_rank()
        v = self.view
        if v is None or rank is None:
            self.notify("no rank selected", severity="warning")
            return
        row = next((r for r in v.rows if r.rank == rank), None)
        last = row.last_step if row is not None else None
        if last is None:
            self.notify(f"rank {rank} has no step in the live window yet", severity="warning")
            return
        self.push_screen(OpsScreen(self.client, v.run_id, rank, last))

    def action_zoom(self) -> None:
        """Into the selected node's ranks (a large job's node rows); zoomed already: back out."""
        if self.zoom_node is not None:
            self.action_unzoom()
            return
        row = self.query_one(RankTable).selected_node_row()
        if row is None:
            self.notify("zoom applies to node rows: this job is shown rank by rank" if not aggregated(self.view)
                        else "no node selected", severity="warning")
            return
        self.zoom_node = row.node

    def action_unzoom(self) -> None:
        self.zoom_node = None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if isinstance(event.data_table, RankTable):  # Enter: a node row zooms, a rank row drills down
            event.stop()
            if event.data_table.selected_node_row() is not None:
                self.action_zoom()
            else:
                self.action_drill()

    def action_help(self) -> None:
        screen = self.screen
        sections = [("this screen", list(type(screen).BINDINGS))] if screen is not self.screen_stack[0] else []
        sections.append(("main view", list(self.BINDINGS)))
        sections += [(name, list(cls.BINDINGS)) for name, cls in
                     (("rank drill-down (d / Enter)", RankScreen), ("traces screen (t)", TraceScreen),
                      ("raw ops (o)", OpsScreen),
                      ("run picker (g)", RunPicker), ("action dialog (a)", ActionModal))
                     if cls is not type(screen)]
        self.push_screen(HelpScreen(sections))

    def _picked(self, run_id: str | None) -> None:
        self._picker = None
        if run_id and run_id != self.run_id:
            self.run_id = run_id
            self.view = None
            self.zoom_node = None
            self.trace_rows, self.traces_missing, self.traces_ok_at = None, False, None
        self._tick()

    def action_request_action(self) -> None:
        v = self.view
        rank = self.screen.selected_rank() if isinstance(self.screen, (TraceScreen, RankScreen)) else None
        if rank is None:
            rank = self.query_one(RankTable).selected_rank()
        if v is None or rank is None:
            self.notify("no rank selected", severity="warning")
            return
        row = next((r for r in v.rows if r.rank == rank), None)
        node = row.node if row else None
        ranks = sorted(r.rank for r in v.rows if node is not None and r.node == node) or [rank]
        self.push_screen(ActionModal(v.run_id, node, ranks, v.dry_run_head), self._confirmed)

    def _confirmed(self, req: ActionRequest | None) -> None:
        if req is None:
            self.notify("action cancelled")
            return
        self.run_worker(self._post_action(self.run_id, req), group="post", exit_on_error=False)

    async def _post_action(self, run_id: str | None, req: ActionRequest) -> None:
        if run_id is None:
            return
        try:
            a = await asyncio.to_thread(self.client.request_action, run_id, req.action, node=req.node,
                                        steps=req.steps, ranks=req.ranks,
                                        reason=req.reason or "requested from the TUI", dry_run=req.dry_run,
                                        force=req.force, by=_tui_user() if req.force else "")
        except HeadError as e:
            if e.status == 409:  # the evict policy's limits: say why, and how to go past them
                self.notify(f"{req.action} refused by the head's evict policy: {e.message}. To override, request "
                            "it again and press f to force it with a reason.", severity="error", timeout=12)
            else:
                self.notify(f"{req.action} not requested: {e}", severity="error", timeout=8)
            return
        except ClientError as e:
            self.notify(f"{req.action} not requested: {e}", severity="error", timeout=8)
            return
        except Exception as e:
            self.notify(f"{req.action} not requested: unexpected {type(e).__name__}: {e}", severity="error", timeout=8)
            return
        self.notify(f"{a.action} {a.id}: {a.status}{' (dry-run)' if a.dry_run else ''}",
                    severity="error" if a.status in ("failed", "refused") else "information")
        await self.refresh_now()


def _tui_user() -> str:
    """Who forced an evict, for the audit trail: the local login (a container may have none)."""
    try:
        return f"tui:{getpass.getuser()}"
    except Exception:  # getpass raises when neither the environment nor the password database names the user
        return "tui"
