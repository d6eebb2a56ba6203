"""Sparklines of step time (max over ranks) and loss (mean over ranks reporting one)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline

from tui.model import RunView


def _label(name: str, series: list[float], unit: str) -> str:
    if not series:
        return f"{name}: no data"
    return f"{name}: last {series[-1]:.4g}{unit}  min {min(series):.4g}  max {max(series):.4g}  ({len(series)} steps)"


class Trends(Vertical):
    view: reactive[RunView | None] = reactive(None, always_update=True)  # bound to the app's

    def watch_view(self, v: RunView | None) -> None:
        if v is not None and self.query("#step-spark"):  # composed
            self.show_series(v.step_ms_series, v.loss_series)

    def compose(self) -> ComposeResult:
        yield Label("step time: no data", id="step-label")
        yield Sparkline([], id="step-spark")
        yield Label("loss: no data", id="loss-label")
        yield Sparkline([], id="loss-spark")

    def show_series(self, step_ms: list[float], loss: list[float]) -> None:
        self.query_one("#step-label", Label).update(_label("step time", step_ms, " ms"))
        self.query_one("#step-spark", Sparkline).data = list(step_ms)
        self.query_one("#loss-label", Label).update(_label("loss", loss, ""))
        self.query_one("#loss-spark", Sparkline).data = list(loss)
