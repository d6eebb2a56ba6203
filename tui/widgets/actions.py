"""The actions the head requested (or would have, in dry-run), newest first, and their fate."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from ranksight import schema

STATUS_STYLE = {"applied": "green", "requested": "yellow", "refused": "red", "failed": "bold red"}


class ActionsTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        for label, key in (("time", "t"), ("action", "action"), ("node", "node"), ("steps", "steps"),
                           ("status", "status"), ("at step", "applied"), ("by", "by"), ("reason", "reason")):
            self.add_column(label, key=key)

    def show_actions(self, actions: list[schema.Action]) -> None:
        self.clear()
        for i, a in enumerate(actions):
            status = Text(a.status + (" (dry-run)" if a.dry_run else ""), style=STATUS_STYLE.get(a.status, ""))
            self.add_row(time.strftime("%H:%M:%S", time.localtime(a.t)), a.action,
                         "—" if a.node is None else str(a.node), str(a.steps) if a.action == "profile" else "",
                         status, "—" if a.applied_step is None else str(a.applied_step), a.requested_by,
                         a.reason, key=f"{i}:{a.id}")
