"""The connection status line and the run header (id, layout, step, throughput, MFU, badges)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from tui.model import RunView, fmt_flops, fmt_rate


# The run's lifecycle as the head tells it (head/runs.py run_status): running, then finished / failed / stopped.
STATUS_STYLE = {"running": "bold green", "finished": "bold cyan", "failed": "bold red", "stopped": "bold yellow"}
ENDED_WORD = {"finished": "at", "failed": "at", "stopped": "no record since"}


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def status_text(head_url: str, *, unreachable_since: float | None, error: str, last_ok: float | None,
                paused: bool, skipped: dict[str, int] | None = None) -> Text:
    """Where the data comes from and whether it is fresh: reachable / UNREACHABLE since … / PAUSED."""
    t = Text()
    if unreachable_since is not None:
        t.append(" HEAD UNREACHABLE ", style="bold white on red")
        t.append(f" {head_url} unreachable since {clock(unreachable_since)}", style="bold red")
        if error:
            t.append(f" ({error})", style="red")
        t.append(" — showing data from " + (clock(last_ok) if last_ok else "never"), style="italic")
    elif error:
        t.append(" HEAD ERROR ", style="bold black on yellow")
        t.append(f" {head_url}: {error}", style="yellow")
    else:
        t.append(" ● ", style="bold green")
        t.append(f"head {head_url}")
        if last_ok:
            t.append(f"  refreshed {clock(last_ok)}", style="dim")
    if skipped:
        t.append("  malformed items skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())),
                 style="bold yellow")
    if paused:
        t.append("  ")
        t.append(" PAUSED ", style="bold black on yellow")
    return t


class StatusBar(Static):
    pass


def header_text(v: RunView) -> Text:
    """Run id, layout (dp×tp×pp, world, nodes), step, SIMULATED GPU badge; tokens/s, MFU and its peak."""
    r = v.run
    lay = r.layout if r else {}
    line1 = Text()
    line1.append("run ", style="dim")
    line1.append(v.run_id, style="bold")
    if r:
        line1.append(f"  [{r.status}", style=STATUS_STYLE.get(r.status, "yellow"))
        if v.ended and r.last_seen:  # the run is over: say since when (the head's last record of it)
            line1.append(f" {ENDED_WORD.get(r.status, 'ended')} {clock(r.last_seen)}", style=STATUS_STYLE.get(r.status, "yellow"))
        line1.append("]", style=STATUS_STYLE.get(r.status, "yellow"))
    else:
        line1.append("  [not in the head's run list]", style="bold yellow")
    if lay:
        line1.append(f"  dp{lay.get('dp', '?')}×tp{lay.get('tp', '?')}×pp{lay.get('pp', '?')}")
    world = (r.world_size if r and r.world_size else None) or len(v.rows)
    line1.append(f"  world {world}")
    line1.append(f"  nodes {r.nodes if r and r.nodes is not None else len({x.node for x in v.rows})}")
    line1.append("  step ", style="dim")
    line1.append(str(v.step) if v.step is not None else "—", style="bold")
    if v.gpu_simulated:
        line1.append("  ")
        line1.append(" SIMULATED GPU ", style="bold black on magenta")
    line2 = Text()
    line2.append("tokens/s ", style="dim")
    line2.append(fmt_rate(v.tokens_per_s), style="bold")
    line2.append("  achieved ", style="dim")
    line2.append("—" if v.tflops_per_rank is None else f"{fmt_flops(v.tflops_per_rank * 1e12)}/rank")
    line2.append("  MFU ", style="dim")
    line2.append("—" if v.mfu is None else f"{v.mfu:.1%}", style="bold")
    line2.append(f"  {v.peak_label}", style="magenta" if v.peak_simulated else "dim")
    return Text("\n").join([line1, line2])


class RunHeader(Static):
    """Bound to the app's ``view`` and ``run_id`` (``data_bind``): re-rendered on every change."""

    view: reactive[RunView | None] = reactive(None, always_update=True)
    run_id: reactive[str | None] = reactive(None)

    def watch_view(self) -> None:
        self._redraw()

    def watch_run_id(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        v = self.view
        if v is None or v.run_id != self.run_id:
            self.update(Text(f"run {self.run_id or '—'}: no data yet", style="dim"))
            return
        self.update(header_text(v))
