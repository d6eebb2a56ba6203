"""The head service: receives OTLP from node agents, deduplicates, stores, watches, acts.

    agents --OTLP/HTTP logs+metrics--> head.ingest --> head.store (WAL, Parquet) --> head.runs (live windows)
                                                                  head.analysis --> findings table, listeners, policy
    API clients --HTTP JSON--> head.api --> views (runs, actions, analysis) / head.actions --> agent /control

``Head`` puts the parts together and runs their threads: the HTTP server (one thread per
connection, ``head.api``), a flusher (buffers to Parquet every ``flush_interval``) and the analysis
loop, and a compactor (a closed hour's part files merged into one file). Shared state is guarded by the per-run locks in the store and the live windows.
"""

from __future__ import annotations

import logging
import ssl
import threading

from head.actions import ActionsBook
from head.analysis import DEFAULT_ANALYZE_WINDOW, IDLE_RECHECK_S, AnalyzerFn, LiveAnalysis, resolve_analyzers
from head.forked_round import FORK_MIN_ROWS, can_fork, forked_analyzer
from head.ingest import Ingest
from head.metrics import HeadMetrics
from head.live import DEFAULT_WINDOW
from head.runs import LiveRuns
from head.store import Store
from ranksight.thread_cpu import ThreadParts

log = logging.getLogger("ranksight.head")


def tune_gc() -> None:
    """Fewer, cheaper garbage collections for an ingest process.

    The head allocates many short-lived records per request and keeps many long-lived ones
    (dedupe keys, live windows). With the default thresholds the young generation is scanned
    every 700 allocations and the old one far too often; records hold no reference cycles, so
    collecting rarely is safe (bench/ingest.py measures the effect).
    """
    import gc

    gc.freeze()  # everything alive at start-up (modules, ...) is never scanned again
    gc.set_threshold(50_000, 20, 100)


ANALYZE_IN = ("auto", "child", "thread")


def round_in_child(analyze_in: str, default_analyzers: bool) -> bool:
    """Where a live round's analyzers run: ``child``, a process forked from the head for each round
    (head/forked_round.py: the round no longer shares the GIL with ingest); ``thread``, the head's analysis thread;
    ``auto``, a child for the analyzers the head resolves itself (``analyzers.run_all``) where ``os.fork`` exists and
    the round is large (``forked_round.FORK_MIN_ROWS``; a small round stays in the thread), the thread for a hook
    given to ``Head(analyzer=...)`` (it may keep state in the head's memory)."""
    if analyze_in not in ANALYZE_IN:
        raise ValueError(f"analyze_in must be one of {', '.join(ANALYZE_IN)}, not {analyze_in!r}")
    if analyze_in == "thread" or not can_fork():
        return False
    return analyze_in == "child" or default_analyzers


class Head:
    """The head process's parts: ``store`` (Parquet, WAL), ``live`` (the runs' live windows), ``ingest`` (what the
    receiver hands over), ``actions`` (requests to the agents and their acks), ``analysis`` (live analysis and
    findings); ``stats`` are the counters ``GET /api/stats`` serves."""

    def __init__(self, store_dir, token: str, *, window: int = DEFAULT_WINDOW, flush_interval: float = 1.0,
                 analyzer: AnalyzerFn | None | str = "auto", analyzer_interval: float = 5.0,
                 flush_rows: int = 250_000, fsync: bool = False, analyze_window: int | None = DEFAULT_ANALYZE_WINDOW,
                 idle_recheck: float = IDLE_RECHECK_S, public_read: bool = False,
                 agent_tls: ssl.SSLContext | None = None, compact_to: str | None = None,
                 compact_interval: float = 60.0, analyze_in: str = "auto", keep_freed_memory: bool = True):
        if not token:
            raise ValueError("the head needs a token")
        self.token = token
        self.public_read = public_read  # GETs without the token (only behind an authenticating proxy)
        self.stats = {"log_requests": 0, "metric_requests": 0, "records_in": 0, "records_new": 0,
                      "duplicates": 0, "rejected": 0, "http_4xx": 0, "metric_points": 0, "analyzer_errors": 0,
                      "analysis_rounds": 0, "analysis_skipped": 0, "analysis_lost": 0}
        self.store = Store(store_dir, flush_rows=flush_rows, fsync=fsync, compact_to=compact_to)
        self.compact_interval = compact_interval  # closed hours merged (head/store/compaction.py); 0: at stop only
        self.live = LiveRuns(self.store, self.stats, window)
        self.actions = ActionsBook(self.store, self.live, token, agent_tls)  # agent_tls: for https control URLs
        self.ingest = Ingest(self.live, self.actions, self.stats)
        self.metrics = HeadMetrics(self)  # GET /metrics; reads the parts at scrape time, times the analyzers
        self.cpu = ThreadParts()  # CPU per part (http, flush, compact, analysis): ranksight_head_cpu_seconds_total
        fn = resolve_analyzers() if analyzer == "auto" else analyzer
        self.rounds_forked = fn is not None and round_in_child(analyze_in, analyzer == "auto")
        if self.rounds_forked:
            fn = forked_analyzer(fn, on_child_cpu=lambda s: self.cpu.add("analyze-child", s),  # type: ignore[arg-type]
                                 min_rows=FORK_MIN_ROWS if analyze_in == "auto" else 0)
        self.analysis = LiveAnalysis(self.live, self.store, self.stats, self.metrics.timed(fn),  # type: ignore[arg-type]
                                     analyze_window, idle_recheck, keep_freed=keep_freed_memory)
        self.flush_interval = flush_interval
        self.analyzer_interval = analyzer_interval
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.alertmanager = None  # push_to_alertmanager
        self.store.open_existing()
        if self.analysis.analyzer is None:
            log.info("head: no analyzers wired (analyzers.run_all not found); live analysis is off")

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval):
            self.live.wire_replayed()  # a run replayed at start: its rows feed the live window too
            try:
                self.store.flush_all()
            except Exception:
                log.exception("head: flush failed (rows stay in the WAL and are retried)")

    def _compact_loop(self) -> None:
        # its own thread: a merge of an hour's parts takes seconds, and flushes must not wait for it
        while not self._stop.wait(self.compact_interval):
            try:
                self.store.compact_all()
            except Exception:
                log.exception("head: compaction failed (the parts stay and are read as they are)")

    def push_to_alertmanager(self, url: str, interval: float | None = None):
        """Findings to Alertmanager's ``/api/v2/alerts`` (head/alertmanager.py), from ``start_background`` on."""
        from head.alertmanager import DEFAULT_INTERVAL_S, AlertmanagerPusher

        self.alertmanager = AlertmanagerPusher(url, self.analysis, interval=interval or DEFAULT_INTERVAL_S)
        self.analysis.finding_listeners.append(self.alertmanager.notify)
        return self.alertmanager

    def start_background(self) -> None:
        """Start the flusher and (``analyzer_interval`` > 0) the analysis loop."""
        threads = [("flush", self._flush_loop, ())]
        if self.compact_interval > 0:
            threads.append(("compact", self._compact_loop, ()))
        if self.analyzer_interval > 0:  # 0: no live analysis (diagnose still analyzes the stored run)
            threads.append(("analyze", self.analysis.run_every, (self.analyzer_interval, self._stop)))
        for name, fn, args in threads:
            t = threading.Thread(target=self._counted, args=(name, fn, *args), name=f"head-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        if self.alertmanager is not None:
            self._threads.append(self.alertmanager.start(self._stop))

    def _counted(self, part: str, fn, *args) -> None:
        with self.cpu.running(part):
            fn(*args)

    def close(self) -> None:
        """Stop the threads, then flush every run to Parquet."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.store.close()
