"""Summaries of the local ranks' profiler traces (``RunDir.traces_dir``, ``rank-<R>.*.json[.gz]``), made by
``probes.profiler.summarize_trace`` once a file has been left alone for ``SETTLE_S``.

Summarizing a large trace takes seconds to tens of seconds of CPU: it runs on a worker thread of its own, so the
agent's cycle (and the shipping of every other record) never waits for it; a cycle ships the summaries finished
since the last one."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import msgspec

from node.outbox import Item
from node.state import AgentState
from probes.profiler import TraceError, summarize_trace
from ranksight.layout import RunDir
from ranksight.schema import TraceSummary

log = logging.getLogger("ranksight.agent")

MAX_IN_FLIGHT = 2  # traces handed to the worker at once (each can be hundreds of MB)
SETTLE_S = 2.0  # a trace modified more recently may still be being written


class TraceSource:
    """One ``trace_summary`` record per finished trace of a local rank (``local_ranks``: the spool source's). A
    trace that cannot be summarized is logged and marked done like the others, so a broken file is not retried
    every cycle. Done file names: ``AgentState.traces_done`` (the last 10,000)."""

    def __init__(self, rd: RunDir, state: AgentState, local_ranks: Callable[[], list[int]]):
        self.rd = rd
        self.state = state
        self.local_ranks = local_ranks
        self._pending: list[str] = []  # names collected this cycle: done once committed
        self._work: dict[str, Future] = {}  # name -> its summary being made
        self._pool: ThreadPoolExecutor | None = None

    def _summarize(self, path: str, rank: int) -> TraceSummary | None:
        try:
            return summarize_trace(path, run_id=self.rd.run_id, rank=rank)
        except (TraceError, OSError) as e:
            log.warning("agent: trace %s not summarized: %s", path, e)
        except Exception as e:  # a user's file outside the summarizer's contract (e.g. malformed UTF-8): same
            log.warning("agent: trace %s not summarized (%s: %s)", path, type(e).__name__, e)
        return None  # marked done all the same: a broken file is not retried every cycle

    def _submit_new(self) -> None:
        d = self.rd.traces_dir
        if not d.is_dir():
            return
        done = set(self.state.traces_done)
        local = set(self.local_ranks())
        now = time.time()
        for p in sorted(d.iterdir()):
            if len(self._work) >= MAX_IN_FLIGHT:
                break
            n = p.name
            if n in done or n in self._work or not n.startswith("rank-") or not (
                    n.endswith(".json") or n.endswith(".json.gz")):
                continue
            try:
                rank = int(n[5:].split(".", 1)[0])
                if rank not in local or now - p.stat().st_mtime < SETTLE_S:
                    continue  # not ours, or still being written
            except (ValueError, OSError):
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-traces")
            self._work[n] = self._pool.submit(self._summarize, str(p), rank)

    def collect(self, wait_s: float = 0.0) -> list[Item]:
        """The summaries finished since the last cycle (``wait_s``: wait that long for the ones in progress, as the
        final cycle does); new settled traces are handed to the worker."""
        self._pending = []
        self._submit_new()
        deadline = time.monotonic() + wait_s
        summaries = []
        for n, fut in list(self._work.items()):
            if not fut.done() and wait_s > 0:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except Exception:  # the summary's own errors are handled in _summarize; a timeout leaves it running
                    pass
            if fut.done():
                del self._work[n]
                s = fut.result()
                if s is not None:
                    summaries.append(s)
                self._pending.append(n)
        if not summaries:
            return []
        return [Item(kind="trace_summary", body=msgspec.json.encode(summaries), count=len(summaries),
                     step_min=min(s.step_start for s in summaries), step_max=max(s.step_end for s in summaries),
                     t_first=time.time())]

    def commit(self, acknowledged: bool) -> bool:
        had = bool(self._pending)
        if had:
            self.state.traces_done = (self.state.traces_done + self._pending)[-10_000:]
        self._pending = []
        return had

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
