"""Screens: the run picker and the action confirmation modal."""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Static

from tui.client import RunSummary

ACTIONS = ("profile", "checkpoint", "evict")


class RunPicker(Screen):
    """The runs the head knows; Enter opens one."""

    BINDINGS = [Binding("enter", "choose", "Open run"), Binding("escape", "back", "Back"),
                Binding("r", "app.refresh_now", "Refresh"), Binding("q", "app.quit", "Quit")]

    def __init__(self, runs: list[RunSummary] | None = None) -> None:
        super().__init__()
        self.runs: list[RunSummary] = list(runs or [])

    def compose(self) -> ComposeResult:
        yield Static("", id="picker-status")
        yield Label("Runs on the head — pick one with ↑/↓ and Enter", id="picker-title")
        yield DataTable(id="runs-table", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        t = self.query_one(DataTable)
        for label, key in (("run", "run"), ("status", "status"), ("world", "world"), ("layout", "layout"),
                           ("nodes", "nodes"), ("last step", "step"), ("last seen", "seen"), ("steps stored", "stored")):
            t.add_column(label, key=key)
        t.focus()
        self.show_runs(self.runs)

    def show_runs(self, runs: list[RunSummary]) -> None:
        t = self.query_one(DataTable)
        keep = t.cursor_row
        self.runs = runs
        t.clear()
        for r in runs:
            lay = r.layout
            t.add_row(r.run_id, r.status, "—" if r.world_size is None else str(r.world_size),
                      f"dp{lay.get('dp', '?')}×tp{lay.get('tp', '?')}×pp{lay.get('pp', '?')}" if lay else "—",
                      "—" if r.nodes is None else str(r.nodes), "—" if r.last_step is None else str(r.last_step),
                      time.strftime("%H:%M:%S", time.localtime(r.last_seen)) if r.last_seen else "—",
                      "—" if r.steps_stored is None else str(r.steps_stored), key=r.run_id)
        if runs:
            t.move_cursor(row=min(keep, len(runs) - 1))
        self.query_one("#picker-title", Label).update(
            "Runs on the head — pick one with ↑/↓ and Enter" if runs else "The head has no runs yet (refreshing…)")

    def show_status(self, renderable) -> None:
        self.query_one("#picker-status", Static).update(renderable)

    def action_choose(self) -> None:
        t = self.query_one(DataTable)
        if self.runs and 0 <= t.cursor_row < len(self.runs):
            self.dismiss(self.runs[t.cursor_row].run_id)

    def action_back(self) -> None:
        """Back to the run already open (if any); with none open there is nothing behind this screen."""
        if getattr(self.app, "run_id", None) is not None:
            self.dismiss(None)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_choose()


@dataclass
class ActionRequest:
    action: str
    node: int | None
    ranks: list[int]
    steps: int | None
    dry_run: bool
    force: bool = False  # an evict past the policy's limits (cooldown, budget, last node ...): audited with reason
    reason: str = ""


class ActionModal(ModalScreen[ActionRequest | None]):
    """Choose profile/checkpoint/evict for the selected rank's node, then confirm with y.

    An evict the head's policy refuses (409: cooldown, budget, the last node ...) can be forced: f asks for the
    reason, which the head stores with the action and who forced it; Enter in the reason field confirms."""

    BINDINGS = [Binding("p", "pick('profile')", "Profile"), Binding("c", "pick('checkpoint')", "Checkpoint"),
                Binding("e", "pick('evict')", "Evict"), Binding("plus,equals_sign", "steps(1)", "+steps"),
                Binding("minus", "steps(-1)", "-steps"), Binding("d", "toggle_dry", "Dry-run"),
                Binding("f", "toggle_force", "Force"),
                Binding("y", "confirm", "Confirm"), Binding("n,escape", "cancel", "Cancel")]

    def __init__(self, run_id: str, node: int | None, ranks: list[int], head_dry_run: bool | None,
                 default_steps: int = 5):
        super().__init__()
        self.run_id, self.node, self.ranks = run_id, node, ranks
        self.head_dry_run = head_dry_run
        self.choice: str | None = None
        self.steps = default_steps
        self.dry_run = bool(head_dry_run)
        self.force = False

    def compose(self) -> ComposeResult:
        with Vertical(id="action-box"):
            yield Label(f"Request an action on node {self.node if self.node is not None else '?'} "
                        f"(ranks {','.join(map(str, self.ranks)) or '?'}) of run {self.run_id}", id="action-title")
            yield Static("", id="action-text")
            # disabled while hidden: a focusable field would take the dialog's keys (p, c, e, y ...) as text
            yield Input(placeholder="why force this evict (stored with the action); Enter confirms",
                        id="force-reason", classes="-hidden", disabled=True)
            with Horizontal(id="action-buttons"):
                yield Button("Profile (p)", id="btn-profile")
                yield Button("Checkpoint (c)", id="btn-checkpoint")
                yield Button("Evict (e)", id="btn-evict", variant="error")
            with Horizontal(id="confirm-buttons"):
                yield Button("Confirm (y)", id="btn-confirm", variant="success", disabled=True)
                yield Button("Cancel (n)", id="btn-cancel")

    def on_mount(self) -> None:
        self._update_text()

    def describe(self) -> str:
        if self.choice is None:
            return ("Choose: p profile N steps · c checkpoint · e evict this node.   d toggles dry-run;"
                    " f forces an evict the policy refuses.")
        where = f"node {self.node}" if self.node is not None else "the job"
        if self.choice == "profile":
            what = f"PROFILE {self.steps} steps on {where} (+/- to change)"
        elif self.choice == "checkpoint":
            what = "CHECKPOINT the job at the next step boundary"
        else:
            what = (f"EVICT node {self.node}: checkpoint, its ranks {','.join(map(str, self.ranks))} leave, "
                    "the job re-forms without it and resumes")
            if self.force:
                what += ("\nFORCED past the evict policy's limits (cooldown, budget, last node): type why below,"
                         " Enter confirms, Esc cancels")
        if self.dry_run:
            mode = ("DRY-RUN (the head is in dry-run): recorded in the audit trail, nothing is sent to the job"
                    if self.head_dry_run else "DRY-RUN: recorded in the audit trail, nothing is sent to the job (d to change)")
        else:
            mode = "LIVE: the head forwards it to the node agent (d for dry-run)"
        return f"{what}\n{mode}\n\nPress y to confirm, n to cancel."

    def _update_text(self) -> None:
        self.query_one("#action-text", Static).update(self.describe())
        self.query_one("#btn-confirm", Button).disabled = self.choice is None or (self.force and not self.reason())
        field = self.query_one("#force-reason", Input)
        field.set_class(not self.force, "-hidden")
        field.disabled = not self.force

    def reason(self) -> str:
        return self.query_one("#force-reason", Input).value.strip()

    def action_pick(self, what: str) -> None:
        if what == "evict" and self.node is None:
            self.app.notify("no node known for this rank: cannot evict", severity="error")
            return
        self.choice = what
        if what != "evict":
            self.force = False
        self._update_text()

    def action_toggle_force(self) -> None:
        if self.choice != "evict":
            self.app.notify("only an evict can be forced: choose e first", severity="warning")
            return
        self.force = not self.force
        self._update_text()
        if self.force:
            self.query_one("#force-reason", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._update_text()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_confirm()

    def action_steps(self, delta: int) -> None:
        self.steps = max(1, min(1000, self.steps + delta))
        self._update_text()

    def action_toggle_dry(self) -> None:
        if self.head_dry_run:
            self.app.notify("the head is in dry-run: actions stay dry-run", severity="warning")
            return
        self.dry_run = not self.dry_run
        self._update_text()

    def action_confirm(self) -> None:
        if self.choice is None:
            return
        if self.force and not self.reason():
            self.app.notify("a forced evict needs a reason: type it in the field", severity="warning")
            return
        self.dismiss(ActionRequest(action=self.choice, node=self.node, ranks=list(self.ranks),
                                   steps=self.steps if self.choice == "profile" else None, dry_run=self.dry_run,
                                   force=self.force, reason=self.reason() if self.force else ""))

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        bid = event.button.id or ""
        if bid == "btn-confirm":
            self.action_confirm()
        elif bid == "btn-cancel":
            self.action_cancel()
        elif bid.startswith("btn-"):
            self.action_pick(bid[4:])
