"""The raw-ops screen (``o`` on a rank): the rank's raw collective records over a few steps, read on demand from the
spool on its node (``GET /api/runs/<id>/ops``, forwarded by the head to the node's agent; ``ranksight ops`` prints
the same). Above 256 ranks the head holds one folded record per step, kind and communicator; this is where the
single op that made a fold slow is found: the ``vs mean`` column is each op's duration less its fold's mean.

It starts at the rank's last steps in the live window; ``[``/``]`` move the range by its width, ``+``/``-`` widen
or narrow it, ``r`` reads again. It reads only when asked (a node's first query indexes the rank's spool, which can
take seconds), in a worker, so the screen stays responsive; a failed read says which part failed.
"""

from __future__ import annotations

import asyncio

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from ranksight.ops_query import decode_answer
from tui.client import ClientError, HeadClient, HeadError
from tui.ops_model import OpsTable, fmt_bytes, ops_model

DEFAULT_STEPS = 2  # steps shown at first: a step of a large job has tens to hundreds of ops per rank
MAX_STEPS = 50
# a node's first query indexes the rank's spool (seconds for a GB); the refresh's own timeout is much shorter
OPS_TIMEOUT_S = 60.0
COLUMNS = (("step", "step"), ("seq", "seq"), ("op", "op"), ("comm", "comm"), ("bytes", "nbytes"),
           ("arrive ms", "arrive"), ("done ms", "done"), ("dur ms", "dur"), ("vs mean", "vs"))


def _ms(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


class OpsScreen(Screen):
    BINDINGS = [Binding("escape,o", "back", "Back"), Binding("left_square_bracket", "shift(-1)", "Earlier"),
                Binding("right_square_bracket", "shift(1)", "Later"),
                Binding("plus,equals_sign", "width(1)", "+step"), Binding("minus", "width(-1)", "-step"),
                Binding("r", "reload", "Read again"), Binding("q", "app.quit", "Quit")]

    def __init__(self, client: HeadClient, run_id: str, rank: int, last_step: int | None,
                 steps: int = DEFAULT_STEPS) -> None:
        super().__init__()
        self.client, self.run_id, self.rank = client, run_id, rank
        self.width = max(1, min(MAX_STEPS, steps))
        self.step_to = max(0, last_step if last_step is not None else 0)
        self.model: OpsTable | None = None
        self.error = ""

    @property
    def step_from(self) -> int:
        return max(0, self.step_to - self.width + 1)

    def compose(self) -> ComposeResult:
        yield Static("", id="ops-head")
        yield DataTable(id="ops-table", cursor_type="row", zebra_stripes=True)
        yield Static("", id="ops-notes")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.border_title = "raw collective records, from the rank's node"
        for label, key in COLUMNS:
            table.add_column(label, key=key)
        self.action_reload()

    def selected_rank(self) -> int:
        return self.rank

    # -- reading ----------------------------------------------------------------------
    def action_reload(self) -> None:
        self._say(Text(f"rank {self.rank}: reading steps {self.step_from}-{self.step_to} from its node…", style="dim"))
        self.run_worker(self._load(self.step_from, self.step_to), group="ops", exclusive=True, exit_on_error=False)

    async def _load(self, step_from: int, step_to: int) -> None:
        params = {"rank": str(self.rank), "steps": f"{step_from}-{step_to}"}
        try:
            body = await asyncio.to_thread(self.client.ops, self.run_id, params, OPS_TIMEOUT_S)
            answer = decode_answer(body)
        except HeadError as e:  # the head's or the agent's refusal, with the reason (which node, what failed)
            self.show(None, f"refused ({e.status}): {e.message}")
            return
        except (ClientError, ValueError) as e:
            self.show(None, f"not read: {e}")
            return
        self.show(ops_model(answer, cut_hint="narrow the range with -"))

    # -- showing ------------------------------------------------------------------------
    def _say(self, text: Text) -> None:
        if self.is_mounted:
            self.query_one("#ops-head", Static).update(text)

    def show(self, model: OpsTable | None, error: str = "") -> None:
        """Show a read's rows, or why there are none (the last rows stay, marked, when a read fails)."""
        self.error = error
        if model is not None:
            self.model = model
        if not self.is_mounted:
            return
        head = Text()
        if error:
            head.append(error, style="bold red")
            head.append(f"\nrank {self.rank}, steps {self.step_from}-{self.step_to}", style="dim")
            if self.model is not None:
                head.append("; the rows below are from the last read", style="dim")
            self._say(head)
            return
        m = self.model
        head.append(m.title, style="bold")
        if m.rows:
            head.append(f"\n{len(m.rows)} op(s); times in ms after the first arrival", style="dim")
            if len(m.attempts) > 1:
                head.append(f"; steps run more than once (attempts {', '.join(map(str, m.attempts))})", style="yellow")
        else:
            head.append("\nno collective records in this range", style="dim")
        self._say(head)
        table = self.query_one(DataTable)
        table.clear()
        for i, r in enumerate(m.rows):
            vs = Text(_ms(r.vs_mean_ms, "{:+.2f}"))
            if r.vs_mean_ms is not None and r.dur_ms and r.vs_mean_ms > 0.5 * (r.dur_ms - r.vs_mean_ms):
                vs.stylize("bold red")  # 1.5x its fold's mean or more: the op that made the fold slow
            table.add_row(str(r.step), str(r.seq), r.op, r.group, fmt_bytes(r.nbytes), _ms(r.arrive_ms),
                          _ms(r.done_ms), _ms(r.dur_ms), vs, key=str(i))
        notes = list(m.notes) + [f"communicator {g}: {c}" for g, c in m.comms]
        self.query_one("#ops-notes", Static).update(Text("\n".join(notes), style="dim"))

    # -- keys -----------------------------------------------------------------------------
    def action_shift(self, n: int) -> None:
        self.step_to = max(self.width - 1, self.step_to + n * self.width)
        self.action_reload()

    def action_width(self, n: int) -> None:
        self.width = max(1, min(MAX_STEPS, self.width + n))
        self.action_reload()

    def action_back(self) -> None:
        self.dismiss(None)
