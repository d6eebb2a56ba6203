"""The live window's per-rank and per-agent state (``head.live.RunLive`` holds one of each per run).

``RankState``: each rank's latest step, host, node, liveness and exit as numpy arrays indexed by rank, updated with a
few vectorized operations per batch of steps. ``AgentLive``: one node agent's last heartbeat and clock offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from head.live_frames import numpy_column

MAX_RANK = 1 << 22  # ranks above this are kept in the windows but get no per-rank state


@dataclass
class AgentLive:
    node: int
    host: str = ""
    url: str = ""
    last_seen: float = 0.0
    heartbeat: Any = None
    # the head's clock minus the node's: the smallest (receive time - the heartbeat's own send time) seen, i.e. the
    # clock difference plus the quickest delivery (a heartbeat is made just before its export, so a backlog the agent
    # ships late does not count)
    clock_offset: float = float("inf")


class RankState:
    """Per-rank latest state as numpy arrays indexed by rank."""

    def __init__(self):
        self.n = 0
        self._alloc(0)

    def _alloc(self, n: int) -> None:
        def grow(old, fill, dtype):
            a = np.full(n, fill, dtype=dtype)
            if old is not None:
                a[:len(old)] = old
            return a

        g = self.__dict__.get
        self.present = grow(g("present"), False, np.bool_)  # has step or collective records
        self.has_step = grow(g("has_step"), False, np.bool_)
        self.node = grow(g("node"), -1, np.int64)
        self.host = grow(g("host"), "", object)
        self.last_step = grow(g("last_step"), -1, np.int64)
        self.attempt = grow(g("attempt"), 0, np.int64)
        self.t_end = grow(g("t_end"), 0.0, np.float64)
        self.step_ms = grow(g("step_ms"), 0.0, np.float64)
        self.last_seen = grow(g("last_seen"), 0.0, np.float64)
        self.world_size = grow(g("world_size"), 0, np.int64)
        # the rank ended: an ``exit`` or ``evicted`` event at or after its last step (a step after it clears it)
        self.exited = grow(g("exited"), False, np.bool_)
        self.exit_t = grow(g("exit_t"), 0.0, np.float64)
        self.exit_reason = grow(g("exit_reason"), "", object)
        self.n = n

    def ensure(self, max_rank: int) -> None:
        if max_rank >= self.n:
            self._alloc(max(max_rank + 1, 2 * self.n, 64))

    def ranks(self) -> np.ndarray:
        return np.nonzero(self.present)[0]

    def record_steps(self, t: pa.Table, rank: np.ndarray, ok: np.ndarray) -> None:
        """Each rank's newest step in ``t`` (rows of the steps table; ``rank`` its rank column, ``ok`` the rows whose
        rank gets per-rank state) becomes its latest, unless the rank already has a newer (attempt, step)."""
        step, attempt = numpy_column(t, "step").astype(np.int64), numpy_column(t, "attempt").astype(np.int64)
        # each rank's newest (attempt, step) in this batch
        order = np.lexsort((step, attempt, rank))
        rs = rank[order]
        last = np.ones(len(rs), np.bool_)
        last[:-1] = rs[1:] != rs[:-1]
        sel = order[last]
        sel = sel[ok[sel]]
        r = rank[sel]
        fresh = ~self.has_step[r] | (attempt[sel] > self.attempt[r]) | (
            (attempt[sel] == self.attempt[r]) & (step[sel] >= self.last_step[r]))
        s, r = sel[fresh], r[fresh]
        if len(s):
            take = pa.array(s)
            node = t.column("node").take(take).to_numpy(zero_copy_only=False)
            self.node[r] = np.where(np.isnan(node.astype(np.float64)), -1, node).astype(np.int64)
            self.host[r] = t.column("host").take(take).to_numpy(zero_copy_only=False)
            self.last_step[r] = step[s]
            self.attempt[r] = attempt[s]
            self.t_end[r] = numpy_column(t, "t_end")[s]
            self.step_ms[r] = numpy_column(t, "step_ms")[s]
            ws = numpy_column(t, "world_size")[s].astype(np.float64)
            self.world_size[r] = np.where(np.isnan(ws), 0, ws).astype(np.int64)
            self.has_step[r] = True
            # a step that ended after the rank's exit: it runs again (a restarted job)
            again = self.exited[r] & (self.t_end[r] > self.exit_t[r])
            self.exited[r[again]] = False
            self.exit_reason[r[again]] = ""

    def record_exit(self, rank: int, t: float, reason: str) -> None:
        """An ``exit`` (or ``evicted``) event of ``rank`` at ``t``; one older than the rank's last step is an earlier
        attempt's, and is not its end."""
        if self.has_step[rank] and 0 < t < self.t_end[rank]:
            return
        self.exited[rank] = True
        self.exit_t[rank] = t
        self.exit_reason[rank] = reason
