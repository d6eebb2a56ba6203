"""Summaries of the local ranks' profiler traces (``RunDir.traces_dir``, ``rank-<R>.*.json[.gz]``), made by
``probes.profiler.summarize_trace`` once a file has been left alone for ``SETTLE_S``."""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgspec

from node.outbox import Item
from node.state import AgentState
from probes.profiler import TraceError, summarize_trace
from ranksight.layout import RunDir

log = logging.getLogger("ranksight.agent")

MAX_PER_CYCLE = 2  # traces can be large: a few per cycle keeps a cycle short
SETTLE_S = 2.0  # a trace modified more recently may still be being written


class TraceSource:
    """One ``trace_summary`` record per finished trace of a local rank (``local_ranks``: the spool source's). A
    trace that cannot be summarized is logged and marked done like the others, so a broken file is not retried
    every cycle. Done file names: ``AgentState.traces_done`` (the last 10,000)."""

    def __init__(self, rd: RunDir, state: AgentState, local_ranks: Callable[[], list[int]]):
        self.rd = rd
        self.state = state
        self.local_ranks = local_ranks
        self._pending: list[str] = []

    def collect(self) -> list[Item]:
        self._pending = []
        d = self.rd.traces_dir
        if not d.is_dir():
            return []
        done = set(self.state.traces_done)
        local = set(self.local_ranks())
        summaries = []
        now = time.time()
        for p in sorted(d.iterdir()):
            if len(self._pending) >= MAX_PER_CYCLE:
                break
            n = p.name
            if n in done or not n.startswith("rank-") or not (n.endswith(".json") or n.endswith(".json.gz")):
                continue
            try:
                rank = int(n[5:].split(".", 1)[0])
                if rank not in local or now - p.stat().st_mtime < SETTLE_S:
                    continue  # not ours, or still being written
            except (ValueError, OSError):
                continue
            try:
                s = summarize_trace(str(p), run_id=self.rd.run_id, rank=rank)
            except (TraceError, OSError) as e:
                log.warning("agent: trace %s not summarized: %s", p, e)
                self._pending.append(n)  # do not retry a broken file every cycle
                continue
            except Exception as e:  # a user's file outside the summarizer's contract (e.g. malformed UTF-8): same
                log.warning("agent: trace %s not summarized (%s: %s)", p, type(e).__name__, e)
                self._pending.append(n)  # do not retry a broken file every cycle
                continue
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
