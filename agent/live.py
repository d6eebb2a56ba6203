"""The head's in-memory view of running jobs: a bounded live window per rank and liveness.

Analyzers look at recent steps (last K per rank), collectives, GPU samples and
events without touching Parquet; the API serves the same window to the TUI.
Liveness (when each rank's and each agent's last record arrived) is the input of
hang detection: a rank whose records stop while its agent keeps reporting is
stuck, an agent that stops reporting is a lost node.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ranksight import schema

DEFAULT_WINDOW = 512  # steps per rank kept in memory


@dataclass
class RankLive:
    rank: int
    node: int | None = None
    host: str = ""
    last_step: int = -1
    last_t_end: float = 0.0
    last_step_ms: float = 0.0
    last_seen: float = 0.0  # head clock when its last record arrived
    attempt: int = 0
    exited: bool = False
    steps: deque = field(default_factory=lambda: deque(maxlen=DEFAULT_WINDOW))
    collectives: deque = field(default_factory=lambda: deque(maxlen=4 * DEFAULT_WINDOW))


@dataclass
class AgentLive:
    node: int
    host: str = ""
    url: str = ""
    last_seen: float = 0.0
    heartbeat: Any = None


class RunLive:
    def __init__(self, run_id: str, window: int = DEFAULT_WINDOW):
        self.run_id = run_id
        self.window = window
        self.lock = threading.Lock()
        self.ranks: dict[int, RankLive] = {}
        self.agents: dict[int, AgentLive] = {}
        self.gpu: deque = deque(maxlen=64 * 120)
        self.host: deque = deque(maxlen=16 * 120)
        self.events: deque = deque(maxlen=2000)
        self.xid: deque = deque(maxlen=2000)
        self.manifest: schema.Manifest | None = None
        self.first_seen = time.time()
        self.last_seen = 0.0

    def _rank(self, r: int) -> RankLive:
        rl = self.ranks.get(r)
        if rl is None:
            rl = self.ranks[r] = RankLive(r, steps=deque(maxlen=self.window), collectives=deque(maxlen=4 * self.window))
        return rl

    def add(self, table: str, rows: list, now: float | None = None) -> None:
        now = now or time.time()
        with self.lock:
            self.last_seen = now
            ranks = self.ranks
            if table == "steps":
                # Append everything; update each rank's "latest" once per batch (its newest record).
                newest: dict[int, Any] = {}
                for r in rows:
                    rl = ranks.get(r.rank) or self._rank(r.rank)
                    rl.steps.append(r)
                    n = newest.get(r.rank)
                    if n is None or (r.attempt, r.step) >= (n.attempt, n.step):
                        newest[r.rank] = r
                for rank, r in newest.items():
                    rl = ranks[rank]
                    rl.last_seen = now
                    if r.step >= rl.last_step or r.attempt > rl.attempt:
                        rl.node, rl.host = r.node, r.host
                        rl.last_step, rl.last_t_end, rl.last_step_ms, rl.attempt = r.step, r.t_end, r.step_ms, r.attempt
            elif table == "collectives":
                seen = set()
                for r in rows:
                    rl = ranks.get(r.rank) or self._rank(r.rank)
                    rl.collectives.append(r)
                    seen.add(r.rank)
                for rank in seen:
                    ranks[rank].last_seen = now
            elif table == "events":
                for r in rows:
                    self.events.append(r)
                    if r.rank >= 0:
                        rl = self._rank(r.rank)
                        rl.last_seen = now
                        if r.event in ("exit", "evicted"):
                            rl.exited = True
            elif table == "gpu":
                self.gpu.extend(rows)
            elif table == "host":
                self.host.extend(rows)
            elif table == "xid":
                self.xid.extend(rows)

    def heartbeat(self, hb, now: float | None = None) -> None:
        now = now or time.time()
        with self.lock:
            a = self.agents.get(hb.node) or AgentLive(hb.node)
            a.host, a.url, a.last_seen, a.heartbeat = hb.host, hb.url, now, hb
            self.agents[hb.node] = a
            self.last_seen = max(self.last_seen, now)

    # -- views ------------------------------------------------------------------
    def rank_states(self, now: float | None = None) -> list[dict[str, Any]]:
        now = now or time.time()
        out = []
        with self.lock:
            placement = {p.rank: p for p in (self.manifest.ranks if self.manifest else [])}
            all_ranks = sorted(set(self.ranks) | set(placement))
            finished = self.manifest is not None and self.manifest.finished is not None
            for r in all_ranks:
                rl = self.ranks.get(r)
                p = placement.get(r)
                if rl is None:
                    out.append({"rank": r, "node": p.node if p else None, "host": p.host if p else "", "step": None,
                                "t_end": None, "step_ms": None, "last_seen": None, "age_s": None, "state": "waiting"})
                    continue
                age = now - rl.last_seen if rl.last_seen else None
                # "stalled": nothing for much longer than this rank's own recent step time (and > 10 s).
                recent = [s.step_ms for s in list(rl.steps)[-20:]]
                typical = sorted(recent)[len(recent) // 2] / 1000.0 if recent else 1.0
                if rl.exited or finished:
                    state = "finished"
                elif age is not None and age > max(10.0, 10 * typical):
                    state = "stalled"
                else:
                    state = "running"
                out.append({"rank": r, "node": rl.node if rl.node is not None else (p.node if p else None),
                            "host": rl.host, "step": rl.last_step, "attempt": rl.attempt, "t_end": rl.last_t_end,
                            "step_ms": rl.last_step_ms, "last_seen": rl.last_seen, "age_s": age, "state": state})
        return out

    def steps_since(self, since: int = -1, rank: int | None = None, limit: int = 10_000) -> list:
        with self.lock:
            ranks = [self.ranks[rank]] if rank is not None and rank in self.ranks else (
                [] if rank is not None else list(self.ranks.values()))
            out = [s for rl in ranks for s in rl.steps if s.step > since]
        out.sort(key=lambda s: (s.step, s.rank))
        return out[-limit:]

    def agent_states(self, now: float | None = None) -> list[dict[str, Any]]:
        now = now or time.time()
        with self.lock:
            out = []
            for a in sorted(self.agents.values(), key=lambda a: a.node):
                hb = a.heartbeat
                out.append({"node": a.node, "host": a.host, "url": a.url, "last_seen": a.last_seen,
                            "age_s": now - a.last_seen, "ranks": hb.ranks if hb else [],
                            "lag_s": hb.lag_s if hb else None, "spooled_records": hb.spooled_records if hb else 0,
                            "dropped_records": hb.dropped_records if hb else 0})
            return out

    def frames(self) -> dict[str, Any]:
        """The live window as pandas DataFrames, the analyzers' input."""
        import pandas as pd

        with self.lock:
            steps = [s for rl in self.ranks.values() for s in rl.steps]
            colls = [c for rl in self.ranks.values() for c in rl.collectives]
            gpu, host, events, xid = list(self.gpu), list(self.host), list(self.events), list(self.xid)
            manifest = self.manifest
        from agent.store import SPECS

        def df(table, rows):
            if not rows:
                return pd.DataFrame({n: [] for n in SPECS[table].schema.names})
            return SPECS[table].to_table(self.run_id, rows).to_pandas()

        return {
            "run_id": self.run_id,
            "manifest": manifest,
            "steps": df("steps", steps),
            "collectives": df("collectives", colls),
            "gpu": df("gpu", gpu),
            "host": df("host", host),
            "events": df("events", events),
            "xid": df("xid", xid),
            "liveness": pd.DataFrame(self.rank_states()),
            "now": time.time(),
        }
