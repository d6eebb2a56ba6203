"""The traces screen (key ``t``): the newest profiler capture window per rank, over the app's status line.

It holds no data of its own: the app reads ``GET /api/runs/<id>/traces`` in its refresh cycle while this screen is
open and hands the result to ``show`` (a failed read leaves the last data, marked stale).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer

from tui.trace_model import TraceView
from tui.widgets.header import StatusBar
from tui.widgets.traces import TracePanel


class TraceScreen(Screen):
    BINDINGS = [Binding("escape,t", "back", "Back"), Binding("a", "app.request_action", "Action"),
                Binding("r", "app.refresh_now", "Refresh"), Binding("p", "app.toggle_pause", "Pause"),
                Binding("q", "app.quit", "Quit")]

    def compose(self) -> ComposeResult:
        yield StatusBar(id="trace-status")
        yield TracePanel(id="traces")
        yield Footer()

    def __init__(self) -> None:
        super().__init__()
        self._pending: tuple | None = None  # what ``show`` was given before the screen was composed
        self._status: Text | None = None

    def on_mount(self) -> None:
        if self._pending is not None:
            self.show(*self._pending[:1], **self._pending[1])
        if self._status is not None:
            self.show_status(self._status)

    def show(self, view: TraceView | None, *, stale: str = "", missing: bool = False,
             gpu_simulated: bool = False) -> None:
        if not self.is_mounted:
            self._pending = (view, {"stale": stale, "missing": missing, "gpu_simulated": gpu_simulated})
            return
        panel = self.query_one(TracePanel)
        # set quietly, then one re-render through ``view`` (it always updates)
        panel.set_reactive(TracePanel.stale, stale)
        panel.set_reactive(TracePanel.missing, missing)
        panel.set_reactive(TracePanel.gpu_simulated, gpu_simulated)
        panel.view = view

    def show_status(self, renderable: Text) -> None:
        if not self.is_mounted:
            self._status = renderable
            return
        self.query_one(StatusBar).update(renderable)

    def selected_rank(self) -> int | None:
        return self.query_one(TracePanel).selected_rank()

    def action_back(self) -> None:
        self.dismiss(None)
