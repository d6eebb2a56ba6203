"""The GPU panel: one row per GPU (its latest sample from ``GET /api/runs/<id>/gpus``).

Rows with a problem come first (XID/ECC errors, then throttling), then by node and GPU, so the
panel's few visible rows show what matters on a large job.

A GPU with XID errors or double-bit ECC errors is highlighted red, a throttled one (a harmful
throttle reason: power cap, HW slowdown, thermal, power brake) yellow. When the samples come from
simulated GPUs the panel says SIMULATED, in its title and its summary line.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from tui.client import GpuState
from tui.model import fmt_age

COLUMNS = (("", "mark"), ("node", "node"), ("gpu", "gpu"), ("ranks", "ranks"), ("util %", "util"),
           ("mem GiB", "mem"), ("power W", "power"), ("temp °C", "temp"), ("SM MHz / max", "sm"),
           ("throttle reasons", "throttle"), ("ECC sbe/dbe", "ecc"), ("XID", "xid"), ("seen", "seen"))
XID_STYLE = "bold red"
THROTTLE_STYLE = "bold yellow"
SIM_BADGE = " SIMULATED "
SIM_STYLE = "bold black on magenta"
GiB = float(1 << 30)
MAX_ROWS = 256  # a 4,096-GPU job: the problem GPUs and the first of the rest (a rank's own: its drill-down, d)


def gpu_alert(g: GpuState) -> str:
    """"xid" (XID errors or uncorrectable ECC), "throttled" (a harmful throttle reason) or ""."""
    if g.xid_count > 0 or (g.ecc_dbe or 0) > 0:
        return "xid"
    if g.throttled:
        return "throttled"
    return ""


def order(g: GpuState) -> tuple:
    """GPUs with XID/ECC errors first, then throttled ones, then by (node, gpu): problems stay in view."""
    return ({"xid": 0, "throttled": 1}.get(gpu_alert(g), 2), g.node, g.gpu)


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "—" if v is None else fmt.format(v)


def gpu_cells(g: GpuState) -> list[Text]:
    alert = gpu_alert(g)
    style = XID_STYLE if alert == "xid" else THROTTLE_STYLE if alert == "throttled" else ""
    mark = "✖" if alert == "xid" else "▲" if alert == "throttled" else ""
    mem = ("—" if g.mem_used_bytes is None else f"{g.mem_used_bytes / GiB:.1f}") + "/" + \
        ("—" if g.mem_total_bytes is None else f"{g.mem_total_bytes / GiB:.0f}")
    sm = _num(g.sm_clock_mhz) + " / " + _num(g.max_sm_clock_mhz)
    if g.sm_clock_mhz is not None and g.max_sm_clock_mhz:
        sm += f" {g.sm_clock_mhz / g.max_sm_clock_mhz:.0%}"
    throttle = ",".join(g.throttle_names) or "—"
    ecc = f"{_num(g.ecc_sbe)}/{_num(g.ecc_dbe)}"
    xid = "0" if not g.xid_count else f"{g.xid_count} (last {g.last_xid})" if g.last_xid is not None else str(g.xid_count)
    ranks = ",".join(map(str, g.ranks[:4])) + ("…" if len(g.ranks) > 4 else "") if g.ranks else "—"
    vals = [mark, str(g.node), str(g.gpu), ranks, _num(g.util_pct), mem, _num(g.power_w), _num(g.temp_c), sm,
            throttle, ecc, xid, fmt_age(g.age_s)]
    left = {"mark", "ranks", "throttle"}
    cells = []
    for (_, key), v in zip(COLUMNS, vals):
        st = style
        if key == "throttle" and g.throttled:
            st = THROTTLE_STYLE + " reverse" if alert == "throttled" else THROTTLE_STYLE
        elif key == "xid" and g.xid_count:
            st = XID_STYLE + " reverse"
        cells.append(Text(v, style=st, justify="left" if key in left else "right"))
    return cells


def summary_text(gpus: list[GpuState] | None) -> Text:
    t = Text()
    if gpus is None:
        t.append("the head has no GPU endpoint (GET /api/runs/<id>/gpus): upgrade the head to see GPUs", style="dim")
        return t
    if not gpus:
        t.append("no GPU samples from the agents yet", style="dim")
        return t
    # the counts first: on a narrow terminal the line is cut at its end
    n_xid = sum(1 for g in gpus if gpu_alert(g) == "xid")
    n_thr = sum(1 for g in gpus if g.throttled)
    t.append(f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}  ")
    t.append(f"{n_thr} throttled", style=THROTTLE_STYLE if n_thr else "dim")
    t.append("  ")
    t.append(f"{n_xid} with XID/ECC errors", style=XID_STYLE if n_xid else "dim")
    if len(gpus) > MAX_ROWS:
        t.append(f"  (rows: the first {MAX_ROWS}, problems first)", style="dim")
    if any(g.simulated for g in gpus):
        t.append("  ")
        t.append(SIM_BADGE, style=SIM_STYLE)
        t.append(" no GPU on these hosts: each rank's GPU is simulated (activity and injected faults)", style="magenta")
    return t


def panel_title(gpus: list[GpuState] | None) -> str:
    if not gpus:
        return "GPUs"
    sim = " — SIMULATED" if any(g.simulated for g in gpus) else ""
    return f"GPUs ({len(gpus)}){sim} — latest sample per GPU"


class GpuTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for label, key in COLUMNS:
            self.add_column(label, key=key)

    def show_gpus(self, gpus: list[GpuState]) -> None:
        keep = self.cursor_row
        self.clear()
        for g in sorted(gpus, key=order)[:MAX_ROWS]:
            self.add_row(*gpu_cells(g), key=f"{g.node}/{g.gpu}")
        if gpus:
            self.move_cursor(row=min(keep, min(len(gpus), MAX_ROWS) - 1))


class GpuPanel(Vertical):
    """Summary line (SIMULATED badge, throttled and XID counts) over the per-GPU table."""

    def compose(self) -> ComposeResult:
        yield Static(summary_text([]), id="gpu-summary")
        yield GpuTable(id="gpu-table")

    def show_gpus(self, gpus: list[GpuState] | None) -> None:
        self.query_one("#gpu-summary", Static).update(summary_text(gpus))
        self.query_one(GpuTable).show_gpus(gpus or [])
        self.border_title = panel_title(gpus)
