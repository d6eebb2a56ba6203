"""The head's live analysis: the analyzers on each run's live window, findings kept as episodes.

Every round (``LiveAnalysis.run_every``: each ``--analyze-interval`` seconds, for each run with new
data) the run's live window becomes an ``analyzers.loader.RunData`` (``RunLive.run_data``), the
analyzer hook turns it into findings, the round hooks (the evict policy) see them all, the run's
``FindingsBook`` matches them to the episodes already open, and what is new or changed is logged,
stored in the ``findings`` table and handed to the finding listeners (alerts).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import msgspec

from head.findings_book import FindingsBook, latest_per_id
from head.forked_round import RoundLost
from head.history import analysis_due
from head.runs import LiveRuns
from head.store import Store
from ranksight import schema
from ranksight.allocator import keep_freed_memory
from ranksight.tables import SPECS, read_table

if TYPE_CHECKING:
    from analyzers.loader import RunData

log = logging.getLogger("ranksight.head")

AnalyzerFn = Callable[["RunData"], list[schema.Finding]]
# Steps per rank the live analysis looks at (``ranksight head --analyze-window``): a round's cost is
# bounded by ranks x this, however large the API's window (``--window``). Findings are episodes
# (head/findings_book.py) that keep the earliest onset seen, so an episode older than this window
# keeps its step_start.
DEFAULT_ANALYZE_WINDOW = 256
# ... and at most this many step rows a round (ranks x steps): a larger job's round looks at fewer of each rank's
# last steps (4,096 ranks and fewer: the whole --analyze-window; 8,192: 128 steps; 16,384: 64), so a round costs
# about the same at any scale. Never fewer than MIN_ANALYZE_WINDOW steps: the checks confirm within 3-12 steps
# (persistence windows of 5-10 steps, baselines of 5, a CUSUM at 1.08x its peers over a few tens) and an episode
# keeps the earliest onset any round saw (head/findings_book.py), so the window bounds how far back a round looks,
# not what it can find. What a shorter window does change: a finding judged over the window as a whole is seen
# later or for less long: memory growth must reach memory_pressure's growth_min_bytes (512 MiB) within the window
# (at 64 steps a leak of 8 MiB a step, at 256 steps 2 MiB; a slower one is still reported as it nears capacity), and
# a stage's drift from the window's first steps is seen for fewer steps after its onset.
ROUND_STEP_ROWS = 1 << 20
MIN_ANALYZE_WINDOW = 64
# With nothing new (no step, collective, event or XID since the last round) a round is skipped, but
# one runs at least this often while the run is not finished: the live hang check judges silence
# against the clock (60 s at least), so it must still look at a run that went quiet.
IDLE_RECHECK_S = 15.0


def round_window(window: int | None, ranks: int, max_rows: int = ROUND_STEP_ROWS) -> int | None:
    """The steps per rank a round looks at: ``window`` (None: the whole live window), cut to ``max_rows`` //
    ``ranks`` but not below MIN_ANALYZE_WINDOW (nor above ``window``)."""
    if window is None or ranks <= 0 or max_rows <= 0:
        return window
    return min(window, max(MIN_ANALYZE_WINDOW, max_rows // ranks))


def resolve_analyzers() -> AnalyzerFn | None:
    """The live analysis hook: the live window (``RunData(source="live")``) -> findings.

    EXTENSION POINT: the head calls this once at start; ``Head(analyzer=fn)`` replaces it.
    It is ``analyzers.run_all``, the same code ``diagnose`` runs post-mortem, on the head's
    sliding window, with its errors logged. Without the analyzers package the head runs without
    live analysis (and says so).
    """
    try:
        from analyzers import run_all
    except ImportError:
        return None

    def live_analysis(data: RunData) -> list[schema.Finding]:
        errors: list[str] = []
        found = run_all(data, errors=errors)
        for e in errors:
            log.error("head: analyzer error on run %s: %s", data.run_id, e.splitlines()[0])
        return found

    return live_analysis


class LiveAnalysis:
    """Analysis rounds over the runs' live windows, and each run's findings (episodes across rounds)."""

    def __init__(self, live: LiveRuns, store: Store, stats: dict[str, int], analyzer: AnalyzerFn | None,
                 window: int | None = DEFAULT_ANALYZE_WINDOW, idle_recheck: float = IDLE_RECHECK_S,
                 round_rows: int = ROUND_STEP_ROWS, keep_freed: bool = True):
        self.live = live
        self.store = store
        self.stats = stats
        self.analyzer = analyzer
        self.window = window  # steps per rank each round looks at; None: the whole live window
        self.round_rows = round_rows  # ... fewer at scale: at most this many step rows (round_window; 0: no cap)
        self.idle_recheck = idle_recheck
        self.clock: Callable[[], float] = time.time  # the wall clock a round's RunData carries (``now``)
        self.findings: dict[str, FindingsBook] = {}  # live findings per run: episodes across analysis rounds
        # Called with each round's new and escalated findings (alerts: dashboards.webhook.WebhookSender.send_findings).
        self.finding_listeners: list[Callable[[list[schema.Finding]], Any]] = []
        # Called with every round's full list of current findings (head.policy_runner.PolicyRunner).
        self.round_hooks: list[Callable[[str, list[schema.Finding], schema.Manifest | None], Any]] = []
        self._marks: dict[str, tuple[tuple, float]] = {}  # run id -> (RunLive.data_mark(), monotonic time)
        if analyzer is not None and keep_freed:  # process-wide: ``ranksight head --return-freed-memory`` leaves it
            keep_freed_memory()

    def analyze_once(self, run_id: str) -> list[schema.Finding]:
        """One round on the run's live window. Returns the episodes it opened."""
        if self.analyzer is None:
            return []
        live = self.live.run(run_id)
        data = live.run_data(round_window(self.window if self.window is not None else live.window, live.n_ranks(),
                                          self.round_rows), now=self.clock())
        try:
            found = list(self.analyzer(data) or [])
        except RoundLost as e:  # a forked round's child died or hung: a gap in the rounds, the episodes stay as they are
            self.stats["analysis_lost"] = self.stats.get("analysis_lost", 0) + 1
            log.warning("head: analysis round on run %s lost: %s", run_id, e)
            return []
        except Exception:
            self.stats["analyzer_errors"] += 1
            log.exception("head: analyzer failed on run %s", run_id)
            return []
        for hook in self.round_hooks:
            try:
                hook(run_id, found, live.manifest)
            except Exception:  # a failing policy must not stop analysis or ingestion
                log.exception("head: round hook %r failed", hook)
        # the newest step in the data the analyzers just saw (not the live window now, which has moved on while they ran)
        last_step = int(data.steps["step"].max()) if len(data.steps) else live.max_step()
        return self._book(run_id, found, last_step)

    def _book(self, run_id: str, found: list[schema.Finding], last_step: int | None) -> list[schema.Finding]:
        """Match a round's findings to the run's episodes; log, store and announce what changed. Returns the new."""
        book = self.findings.get(run_id)
        if book is None:  # first sight of the run: carry on from its stored episodes (this head may have restarted)
            book = self.findings[run_id] = FindingsBook(run_id)
            book.restore(self.stored_findings(run_id))
        res = book.observe(found, last_step)
        for f in res.new:
            log.warning("finding [%s] %s/%s ranks=%s: %s", f.severity, f.analyzer, f.kind, f.ranks, f.summary)
        for f in res.escalated:
            log.warning("finding escalated to %s: %s/%s ranks=%s: %s", f.severity, f.analyzer, f.kind, f.ranks, f.summary)
        for f in res.changed:
            if f.status == "closed":
                log.info("finding closed: %s/%s ranks=%s, steps %s-%s", f.analyzer, f.kind, f.ranks, f.step_start, f.step_end)
        if res.new or res.changed:
            # append-only: the row with the latest ``updated`` per id is an episode's current state
            self.store.run(run_id).add("findings", res.new + res.changed)
        notify = res.new + res.escalated
        if notify:
            for listener in self.finding_listeners:
                try:
                    listener(notify)
                except Exception:  # an alert channel failing must not stop analysis or ingestion
                    log.exception("head: finding listener %r failed", listener)
        return res.new

    def stored_findings(self, run_id: str) -> list[schema.Finding]:
        """The current state of each of the run's stored episodes (latest row per id of its ``findings`` table,
        rows the write-ahead log replayed included); a row that does not read back is skipped and logged."""
        try:
            self.store.run(run_id).flush()  # rows replayed from the write-ahead log into part files
            df = read_table(self.store.root, run_id, "findings")
        except Exception:  # noqa: BLE001 - a damaged store must not stop analysis: the book starts empty
            log.exception("head: cannot read the stored findings of run %s", run_id)
            return []
        if not len(df):
            return []
        json_cols = {n for n, _, as_json in SPECS["findings"].fields if as_json}
        out = []
        for row in latest_per_id(json.loads(df.to_json(orient="records"))):
            row = {k: (json.loads(v) if k in json_cols and isinstance(v, str) else v) for k, v in row.items()
                   if v is not None}
            try:
                out.append(msgspec.convert(row, schema.Finding, strict=False))
            except (msgspec.ValidationError, ValueError) as e:
                log.warning("head: a stored finding of run %s does not read back: %s", run_id, e)
        return [f for f in out if f.id]

    def analyze_if_due(self, run_id: str, now: float | None = None) -> bool:
        """One scheduled round for ``run_id``, unless nothing changed: skipped when no step, collective,
        event, XID or manifest reached the live window since the last round, except that a run not yet
        ended (manifest or every rank's exit event) is looked at again every ``idle_recheck`` seconds (the hang
        check needs the clock).
        ``now``: the monotonic clock. Returns whether the analyzers ran."""
        live = self.live.runs.get(run_id)
        if live is None or self.analyzer is None:
            return False
        now = time.monotonic() if now is None else now
        if not analysis_due(live, now):
            return False  # only the stored history of a run (head/history.py): no live verdict on it yet
        mark = live.data_mark()
        if all(m is None for m in mark[:4]):
            return False  # nothing to analyze yet
        prev = self._marks.get(run_id)
        if prev is not None and all(a is b for a, b in zip(mark, prev[0])):
            # ended: its manifest says so, or every rank wrote its exit event (a run instrumented by a user has no
            # manifest to mark); the hang check has nothing left to watch the clock for
            ended = (live.manifest is not None and live.manifest.finished is not None) or live.ended() is not None
            if ended or now - prev[1] < self.idle_recheck:
                self.stats["analysis_skipped"] += 1
                return False
        self._marks[run_id] = (mark, now)
        self.stats["analysis_rounds"] += 1
        self.analyze_once(run_id)
        return True

    def run_every(self, interval: float, stop: threading.Event) -> None:
        """The analysis thread: every ``interval`` seconds a round for each live run that is due, until ``stop``."""
        while not stop.wait(interval):
            for run_id in list(self.live.runs):
                try:
                    self.analyze_if_due(run_id)
                except Exception:  # never let one run stop the loop
                    log.exception("head: analysis round failed on run %s", run_id)

    def findings_of(self, run_id: str) -> list[dict[str, Any]]:
        """The current state of each of the run's findings (``GET /api/runs/<id>/findings``): this head's episodes,
        or, for a run it has not analyzed, the latest row per id of the stored ``findings`` table."""
        if run_id in self.findings:
            return [schema.to_dict(f) for f in self.findings[run_id].current()]
        df = read_table(self.store.root, run_id, "findings")
        return latest_per_id(json.loads(df.to_json(orient="records"))) if len(df) else []
