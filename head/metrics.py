"""The head's own Prometheus metrics, served on ``GET /metrics`` (token required, like every endpoint but
``/api/health``; Prometheus sends it with the scrape config's ``authorization`` block, docs/dashboards-alerts.md).

Read at scrape time from the head's parts, so each value is what the head holds then, never a second book:

- findings: ``ranksight_head_findings_open{run_id, kind, severity}`` (the live analysis' open episodes);
- ingest: ``ranksight_head_ingest_records_total`` (records received, ``result="new"`` or ``"duplicate"``),
  ``ranksight_head_ingest_batches_total`` (OTLP export requests, ``signal="logs"|"metrics"``),
  ``ranksight_head_ingest_rejected_records_total``, ``ranksight_head_http_client_errors_total``;
- lag: ``ranksight_head_ingest_lag_seconds{run_id}``: over the run's ranks, the largest delay between the end of a
  rank's newest step (its ``t_end``, the rank's clock) and the head receiving it; and
  ``ranksight_head_run_last_record_age_seconds{run_id}``: time since the head last received anything of the run;
- runs: ``ranksight_head_runs{state}`` (``running``, ``stopped``, ``finished``, ``failed``);
- CPU: ``ranksight_head_cpu_seconds_total{part}``: ``http`` (the request handlers: HTTP, decoding, the write-ahead
  log), ``flush`` (the store's flusher: dedupe, Arrow, Parquet, the live windows), ``analyze`` (the live analysis
  loop), ``other`` (the rest of the process);
- analysis: ``ranksight_head_analysis_round_seconds`` (histogram of the analyzers' time per round),
  ``ranksight_head_analysis_rounds_total``, ``ranksight_head_analysis_errors_total``.

The findings and lag series are per run, so they grow with runs the head holds, not with ranks.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("ranksight.head.metrics")

ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
RUN_STATES = ("running", "stopped", "finished", "failed")


class HeadMetrics:
    """The head's registry (``registry``): a collector over ``head`` and the analysis-round histogram that
    ``timed`` feeds."""

    def __init__(self, head):
        self.head = head
        self.registry = CollectorRegistry()
        self.round_seconds = Histogram("ranksight_head_analysis_round_seconds",
                                       "Time the analyzers took for one live analysis round", buckets=ROUND_BUCKETS,
                                       registry=self.registry)
        self.registry.register(_HeadCollector(head))

    def timed(self, analyzer: Callable[[Any], Any] | None):
        """``analyzer`` wrapped to observe each call's duration (None stays None: no live analysis)."""
        if analyzer is None:
            return None
        hist = self.round_seconds

        def timed_analyzer(data):
            t0 = time.perf_counter()
            try:
                return analyzer(data)
            finally:
                hist.observe(time.perf_counter() - t0)

        return timed_analyzer


class _HeadCollector:
    def __init__(self, head):
        self.head = head

    def collect(self):
        st = dict(self.head.stats)
        rec = CounterMetricFamily("ranksight_head_ingest_records", "Records received from the agents",
                                  labels=("result",))
        rec.add_metric(["new"], st.get("records_new", 0))
        rec.add_metric(["duplicate"], st.get("duplicates", 0))
        yield rec
        batches = CounterMetricFamily("ranksight_head_ingest_batches", "OTLP export requests received",
                                      labels=("signal",))
        batches.add_metric(["logs"], st.get("log_requests", 0))
        batches.add_metric(["metrics"], st.get("metric_requests", 0))
        yield batches
        yield CounterMetricFamily("ranksight_head_ingest_rejected_records",
                                  "Records refused at ingest (undecodable or invalid)", value=st.get("rejected", 0))
        yield CounterMetricFamily("ranksight_head_http_client_errors", "Requests answered with a 4xx",
                                  value=st.get("http_4xx", 0))
        yield CounterMetricFamily("ranksight_head_analysis_rounds", "Live analysis rounds run",
                                  value=st.get("analysis_rounds", 0))
        yield CounterMetricFamily("ranksight_head_analysis_errors", "Live analysis rounds whose analyzers failed",
                                  value=st.get("analyzer_errors", 0))
        yield self._cpu()
        yield from self._findings()
        yield from self._runs()

    def _cpu(self):
        """The process's CPU by part (``Head.cpu``); ``other``: what no part claims (the main thread, the pushers)."""
        fam = CounterMetricFamily("ranksight_head_cpu_seconds", "CPU seconds the head spent, by part of the head",
                                  labels=("part",))
        parts = self.head.cpu.seconds()
        for part, sec in sorted(parts.items()):
            fam.add_metric([part], sec)
        fam.add_metric(["other"], max(0.0, time.process_time() - sum(parts.values())))
        return fam

    def _findings(self):
        fam = GaugeMetricFamily("ranksight_head_findings_open", "Open finding episodes of the live analysis",
                                labels=("run_id", "kind", "severity"))
        counts: dict[tuple[str, str, str], int] = {}
        for run_id, book in list(self.head.analysis.findings.items()):
            for f in book.current():
                if f.status != "closed":
                    k = (run_id, f.kind, f.severity)
                    counts[k] = counts.get(k, 0) + 1
        for k, n in sorted(counts.items()):
            fam.add_metric(list(k), n)
        yield fam

    def _runs(self):
        from head.runs import run_status

        now = time.time()
        states = GaugeMetricFamily("ranksight_head_runs", "Runs the head holds live, by state", labels=("state",))
        lag = GaugeMetricFamily("ranksight_head_ingest_lag_seconds",
                                "The largest delay, over the run's ranks, between the end of a rank's newest step "
                                "and the head receiving it", labels=("run_id",))
        age = GaugeMetricFamily("ranksight_head_run_last_record_age_seconds",
                                "Seconds since the head last received a record of the run", labels=("run_id",))
        by_state = dict.fromkeys(RUN_STATES, 0)
        for run_id, live in list(self.head.live.runs.items()):
            sync = getattr(live, "sync", None)
            if callable(sync):
                try:
                    sync()
                except Exception:  # serve what is there
                    log.exception("metrics: processing queued batches of %s failed", run_id)
            with live.lock:
                rs = live.state
                present = rs.has_step[:rs.n] & (rs.last_seen[:rs.n] > 0)
                delay = (rs.last_seen[:rs.n][present] - rs.t_end[:rs.n][present]) if present.any() else None
                last_seen = live.last_seen
            status = run_status(live.manifest, live, now)
            by_state[status] = by_state.get(status, 0) + 1
            if delay is not None and len(delay):
                lag.add_metric([run_id], max(0.0, float(np.max(delay))))
            if last_seen:
                age.add_metric([run_id], max(0.0, now - last_seen))
        for s, n in by_state.items():
            states.add_metric([s], n)
        yield states
        yield lag
        yield age
        yield self._stale_gpu()

    def _stale_gpu(self):
        """GPU samples older than their GPU's newest by more than the dedupe horizon (``GpuIndex``): taken for resends
        and not stored. They are also in the duplicate count; a rise here with no agent resending means a node's
        clock stepped back (its samples are the ones dropped)."""
        fam = CounterMetricFamily("ranksight_head_gpu_samples_stale",
                                  "GPU samples older than their GPU's newest by more than the dedupe horizon: "
                                  "taken for resends, not stored", labels=("run_id",))
        for run_id, rs in list(self.head.store.runs.items()):
            stale = getattr(rs.indexes.get("gpu"), "stale", None)
            if stale is not None:
                fam.add_metric([run_id], stale)
        return fam
