"""Keyboard help (``?``): every binding of every screen, with what it does.

The keys shown are read from the screens' own ``BINDINGS`` (so they cannot drift from what the keys do); what each
does comes from ``HELP``, keyed by the binding's action. A binding without a text here is listed as such, and a
test fails on it.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = {
    "toggle_pause": "pause / resume the refresh (the status line says PAUSED)",
    "refresh_now": "refresh now",
    "focus_findings": "focus the findings list: ↑/↓ select, the detail pane shows the whole finding",
    "request_action": "request an action (profile, checkpoint, evict) for the selected rank's node; asks to confirm",
    "pick_run": "the run picker: the runs the head knows",
    "show_traces": "the traces screen: the newest profiler capture per rank (or per node)",
    "drill": "drill down into the selected rank: its history, node, findings and GPUs (also Enter on a rank row)",
    "zoom": "on a large job (rows are nodes): zoom into the selected node's ranks (also Enter); again: back out",
    "unzoom": "back out of a zoomed node to all nodes",
    "ops": "the selected rank's raw collective records over its last steps, read from its node's spool on demand",
    "shift(-1)": "raw ops: the steps before",
    "shift(1)": "raw ops: the steps after",
    "width(1)": "raw ops: one step more",
    "width(-1)": "raw ops: one step fewer",
    "reload": "raw ops: read the range again",
    "help": "this help",
    "quit": "quit",
    "back": "back to the previous screen",
    "step(-1)": "the previous rank",
    "step(1)": "the next rank",
    "choose": "open the selected run",
    "pick('profile')": "choose: profile N steps on the node",
    "pick('checkpoint')": "choose: checkpoint the job",
    "pick('evict')": "choose: evict the node (checkpoint, its ranks leave, the job re-forms and resumes)",
    "steps(1)": "profile one more step",
    "steps(-1)": "profile one step fewer",
    "toggle_dry": "toggle dry-run (recorded in the audit trail, nothing sent)",
    "toggle_force": "force an evict past the head's policy (cooldown, budget, last node): type why, Enter confirms",
    "confirm": "confirm: send the request to the head",
    "cancel": "cancel: send nothing",
}
# Keys that are not bindings but matter: the tables' own.
TABLE_KEYS = (("↑ ↓ PgUp PgDn", "move in the focused table"), ("Tab", "focus the next panel"),
              ("Enter", "on a rank row: the drill-down; on a node row: zoom into it"))
KEY_NAMES = {"question_mark": "?", "left_square_bracket": "[", "right_square_bracket": "]", "escape": "Esc",
             "enter": "Enter", "plus": "+", "equals_sign": "=", "minus": "-"}


def key_label(keys: str) -> str:
    return " / ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in keys.split(","))


def action_name(action: str) -> str:
    return action.split(".", 1)[1] if action.startswith(("app.", "screen.")) else action


def help_lines(sections: list[tuple[str, list[Binding]]]) -> list[tuple[str, str, str]]:
    """(section, keys, what it does) for every binding of every section."""
    out = []
    for title, bindings in sections:
        for b in bindings:
            out.append((title, key_label(b.key), HELP.get(action_name(b.action), f"(no help for {b.action})")))
    return out


def help_text(sections: list[tuple[str, list[Binding]]]) -> Text:
    t = Text()
    last = None
    for title, keys, what in help_lines(sections) + [("tables", k, w) for k, w in TABLE_KEYS]:
        if title != last:
            t.append(("\n" if last else "") + title + "\n", style="bold underline")
            last = title
        t.append(f"  {keys:<14}", style="bold cyan")
        t.append(what + "\n")
    return t


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "back", "Close")]

    def __init__(self, sections: list[tuple[str, list[Binding]]]) -> None:
        super().__init__()
        self.sections = sections

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(help_text(self.sections), id="help-text")

    def on_mount(self) -> None:
        box = self.query_one("#help-box")
        box.border_title = "keys (Esc or ? closes)"
        box.focus()

    def action_back(self) -> None:
        self.dismiss(None)
