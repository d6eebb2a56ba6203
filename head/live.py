"""The head's in-memory view of running jobs: a bounded live window per rank and liveness.

Analyzers look at recent steps (last K per rank), collectives, GPU samples and
events without touching Parquet; the API serves the same window to the TUI.
Liveness (when each rank's and each agent's last record arrived) is the input of
hang detection: a rank whose records stop while its agent keeps reporting is
stuck, an agent that stops reporting is a lost node.

Steps and collectives, the volume signals, are kept columnar: a deque of Arrow
tables (one per processed batch, trimmed to about ``window`` steps per rank), and
each rank's latest state in numpy arrays indexed by rank, updated with a few
vectorized operations per batch. No Python object per record is made at ingest;
the views (``rank_states``, ``steps_since``, ``frames``) build what they return
when asked. Before a view reads, ``sync`` (set by the head) lets the store process
its queued batches, so a view never misses an acknowledged record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import numpy as np
import pyarrow as pa

from ranksight import schema

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("ranksight.live")

DEFAULT_WINDOW = 512  # steps per rank kept in memory
_MAX_RANK = 1 << 22  # ranks above this are kept in the windows but get no per-rank state


@dataclass
class RankLive:
    """A snapshot of one rank's latest state (built on demand from the columnar state)."""

    rank: int
    node: int | None = None
    host: str = ""
    last_step: int = -1
    last_t_end: float = 0.0
    last_step_ms: float = 0.0
    last_seen: float = 0.0  # head clock when its last record arrived
    attempt: int = 0
    exited: bool = False
    steps: deque = field(default_factory=deque)
    collectives: deque = field(default_factory=deque)


@dataclass
class AgentLive:
    node: int
    host: str = ""
    url: str = ""
    last_seen: float = 0.0
    heartbeat: Any = None


class _RankState:
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
        self.exited = grow(g("exited"), False, np.bool_)
        self.n = n

    def ensure(self, max_rank: int) -> None:
        if max_rank >= self.n:
            self._alloc(max(max_rank + 1, 2 * self.n, 64))

    def ranks(self) -> np.ndarray:
        return np.nonzero(self.present)[0]


def _np(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False)


class RunLive:
    def __init__(self, run_id: str, window: int = DEFAULT_WINDOW):
        self.run_id = run_id
        self.window = window
        self.lock = threading.RLock()
        self.state = _RankState()
        self._steps: deque = deque()  # Arrow tables, oldest first
        self._steps_rows = 0
        self._colls: deque = deque()
        self._colls_rows = 0
        self.agents: dict[int, AgentLive] = {}
        self.gpu: deque = deque(maxlen=64 * 120)
        self.host: deque = deque(maxlen=16 * 120)
        self.events: deque = deque(maxlen=2000)
        self.xid: deque = deque(maxlen=2000)
        self.manifest: schema.Manifest | None = None
        self.first_seen = time.time()
        self.last_seen = 0.0
        self.sync: Callable[[], None] | None = None  # set by the head: process queued batches first
        # frames(): the GPU and host sample deques as Arrow, each sample converted once (see _ConvertedWindow)
        self._converted = {"gpu": _ConvertedWindow(run_id, "gpu"), "host": _ConvertedWindow(run_id, "host")}

    def _pull(self) -> None:
        if self.sync is not None:
            try:
                self.sync()
            except Exception:  # a view must still answer with what is there
                log.exception("live %s: processing queued batches failed", self.run_id)

    # -- updates ------------------------------------------------------------------
    def touch(self, now: float | None = None) -> None:
        self.last_seen = now or time.time()

    def add(self, table: str, rows: list, now: float | None = None) -> None:
        """Decoded records (msgspec Structs) of ``table``."""
        if not rows:
            return
        if table in ("steps", "collectives"):
            from ranksight.tables import SPECS

            self.add_arrow(table, SPECS[table].to_table(self.run_id, rows), now)
            return
        now = now or time.time()
        with self.lock:
            self.last_seen = now
            if table == "events":
                st = self.state
                for r in rows:
                    self.events.append(r)
                    if 0 <= r.rank < _MAX_RANK:
                        st.ensure(r.rank)
                        st.last_seen[r.rank] = now
                        if r.event in ("exit", "evicted"):
                            st.exited[r.rank] = True
            elif table == "gpu":
                self.gpu.extend(rows)
            elif table == "host":
                self.host.extend(rows)
            elif table == "xid":
                self.xid.extend(rows)

    def add_new(self, table: str, t: pa.Table | None, rows: list | None, now: float | None = None) -> None:
        """New rows from the store's processing: as Arrow (always, when any), and as structs when
        they were decoded ones. Steps and collectives are kept columnar, the rest as structs."""
        if table in ("steps", "collectives") or rows is None:
            if t is not None:
                self.add_arrow(table, t, now)
        elif rows:
            self.add(table, rows, now)

    def add_arrow(self, table: str, t: pa.Table, now: float | None = None) -> None:
        """New rows of ``table`` as an Arrow table in the store's schema (vectorized updates)."""
        if t is None or t.num_rows == 0:
            return
        now = now or time.time()
        if table not in ("steps", "collectives"):
            from ranksight.tables import TABLE_TYPES

            try:
                rows = msgspec.convert(t.to_pylist(), list[TABLE_TYPES[table]], strict=False)
            except (msgspec.ValidationError, TypeError) as e:
                log.error("live %s: %s rows not shown live: %s", self.run_id, table, e)
                return
            self.add(table, rows, now)
            return
        rank = _np(t, "rank").astype(np.int64)
        ok = (rank >= 0) & (rank < _MAX_RANK)
        with self.lock:
            self.last_seen = now
            st = self.state
            if ok.any():
                st.ensure(int(rank[ok].max()))
            if table == "steps":
                self._steps.append(t)
                self._steps_rows += t.num_rows
                step, attempt = _np(t, "step").astype(np.int64), _np(t, "attempt").astype(np.int64)
                # each rank's newest (attempt, step) in this batch
                order = np.lexsort((step, attempt, rank))
                rs = rank[order]
                last = np.ones(len(rs), np.bool_)
                last[:-1] = rs[1:] != rs[:-1]
                sel = order[last]
                sel = sel[ok[sel]]
                r = rank[sel]
                fresh = ~st.has_step[r] | (attempt[sel] > st.attempt[r]) | (
                    (attempt[sel] == st.attempt[r]) & (step[sel] >= st.last_step[r]))
                s, r = sel[fresh], r[fresh]
                if len(s):
                    take = pa.array(s)
                    node = t.column("node").take(take).to_numpy(zero_copy_only=False)
                    st.node[r] = np.where(np.isnan(node.astype(np.float64)), -1, node).astype(np.int64)
                    st.host[r] = t.column("host").take(take).to_numpy(zero_copy_only=False)
                    st.last_step[r] = step[s]
                    st.attempt[r] = attempt[s]
                    st.t_end[r] = _np(t, "t_end")[s]
                    st.step_ms[r] = _np(t, "step_ms")[s]
                    st.has_step[r] = True
                self._trim_steps()
            else:
                self._colls.append(t)
                self._colls_rows += t.num_rows
                while self._colls_rows > 4 * self.window * max(1, int(st.present.sum())) and len(self._colls) > 1:
                    self._colls_rows -= self._colls.popleft().num_rows
            rr = rank[ok]
            st.present[rr] = True
            st.last_seen[rr] = now

    def _trim_steps(self) -> None:
        # about ``window`` rows per rank; frames()/steps_since() cut exactly per rank
        cap = self.window * max(1, int(self.state.has_step.sum()))
        while self._steps_rows - self._steps[0].num_rows >= cap and len(self._steps) > 1:
            self._steps_rows -= self._steps.popleft().num_rows

    def heartbeat(self, hb, now: float | None = None) -> None:
        now = now or time.time()
        with self.lock:
            a = self.agents.get(hb.node) or AgentLive(hb.node)
            a.host, a.url, a.last_seen, a.heartbeat = hb.host, hb.url, now, hb
            self.agents[hb.node] = a
            self.last_seen = max(self.last_seen, now)

    # -- views ------------------------------------------------------------------
    def _steps_table(self) -> pa.Table | None:
        with self.lock:
            chunks = list(self._steps)
        return pa.concat_tables(chunks) if chunks else None

    @property
    def ranks(self) -> dict[int, RankLive]:
        """Each rank's latest state (a snapshot)."""
        self._pull()
        with self.lock:
            st = self.state
            return {int(r): RankLive(rank=int(r), node=int(st.node[r]) if st.node[r] >= 0 else None, host=st.host[r],
                                     last_step=int(st.last_step[r]), last_t_end=float(st.t_end[r]),
                                     last_step_ms=float(st.step_ms[r]), last_seen=float(st.last_seen[r]),
                                     attempt=int(st.attempt[r]), exited=bool(st.exited[r]))
                    for r in st.ranks()}

    def max_step(self) -> int | None:
        self._pull()
        with self.lock:
            st = self.state
            return int(st.last_step[st.has_step].max()) if st.has_step.any() else None

    def n_ranks(self) -> int:
        self._pull()
        with self.lock:
            return int(self.state.present.sum())

    def rank_node(self, rank: int) -> int | None:
        with self.lock:
            st = self.state
            if 0 <= rank < st.n and st.has_step[rank] and st.node[rank] >= 0:
                return int(st.node[rank])
        return None

    def rank_states(self, now: float | None = None) -> list[dict[str, Any]]:
        self._pull()
        now = now or time.time()
        t = self._steps_table()
        typical: dict[int, float] = {}
        if t is not None and t.num_rows:
            import pandas as pd

            df = pd.DataFrame({"rank": _np(t, "rank"), "step_ms": _np(t, "step_ms")})
            typical = df.groupby("rank").tail(20).groupby("rank")["step_ms"].median().to_dict()
        out = []
        with self.lock:
            st = self.state
            placement = {p.rank: p for p in (self.manifest.ranks if self.manifest else [])}
            known = {int(r) for r in st.ranks()} | {int(r) for r in np.nonzero(st.exited | (st.last_seen > 0))[0]}
            all_ranks = sorted(known | set(placement))
            finished = self.manifest is not None and self.manifest.finished is not None
            for r in all_ranks:
                p = placement.get(r)
                if r >= st.n or not (st.present[r] or st.last_seen[r] > 0):
                    out.append({"rank": r, "node": p.node if p else None, "host": p.host if p else "", "step": None,
                                "t_end": None, "step_ms": None, "last_seen": None, "age_s": None, "state": "waiting"})
                    continue
                last_seen = float(st.last_seen[r])
                age = now - last_seen if last_seen else None
                # "stalled": nothing for much longer than this rank's own recent step time (and > 10 s).
                typ = typical.get(r)
                typ = typ / 1000.0 if typ is not None and typ == typ else 1.0
                if st.exited[r] or finished:
                    state = "finished"
                elif age is not None and age > max(10.0, 10 * typ):
                    state = "stalled"
                else:
                    state = "running"
                node = int(st.node[r]) if st.node[r] >= 0 else (p.node if p else None)
                out.append({"rank": r, "node": node, "host": st.host[r], "step": int(st.last_step[r]),
                            "attempt": int(st.attempt[r]), "t_end": float(st.t_end[r]),
                            "step_ms": float(st.step_ms[r]), "last_seen": last_seen, "age_s": age, "state": state})
        return out

    def steps_since(self, since: int = -1, rank: int | None = None, limit: int = 10_000) -> list:
        self._pull()
        t = self._steps_table()
        if t is None:
            return []
        import pyarrow.compute as pc

        mask = pc.greater(t.column("step"), since)
        if rank is not None:
            mask = pc.and_(mask, pc.equal(t.column("rank"), rank))
        t = t.filter(mask)
        t = _tail_per_rank(t, self.window)
        t = t.sort_by([("step", "ascending"), ("rank", "ascending")])
        if t.num_rows > limit:
            t = t.slice(t.num_rows - limit)
        return msgspec.convert(t.to_pylist(), list[schema.StepRecord], strict=False)

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

    def data_mark(self) -> tuple:
        """What the analyzers' inputs last received: the newest step and collective batch, event and XID
        (the objects themselves, compared with ``is``), and the manifest. Two marks differ exactly when
        new rows of those kinds (or a new manifest) reached the window in between; GPU/host samples and
        heartbeats are not part of it."""
        self._pull()
        with self.lock:
            return (self._steps[-1] if self._steps else None, self._colls[-1] if self._colls else None,
                    self.events[-1] if self.events else None, self.xid[-1] if self.xid else None, self.manifest)

    def frames(self, window: int | None = None) -> dict[str, Any]:
        """The live window as pandas DataFrames, the analyzers' input.

        ``window``: the last ``window`` steps per rank (and 4x as many collectives) instead of the whole
        live window (``self.window``), e.g. the head's bounded analysis window. Each rank keeps its own
        last rows, so a rank that went silent long ago still appears with its last steps."""
        import pandas as pd

        from ranksight.tables import SPECS

        k = self.window if window is None else max(1, min(int(window), self.window))
        self._pull()
        with self.lock:
            steps, colls = list(self._steps), list(self._colls)
            gpu, host, events, xid = list(self.gpu), list(self.host), list(self.events), list(self.xid)
            manifest = self.manifest

        def empty(table):
            return pd.DataFrame({n: [] for n in SPECS[table].schema.names})

        def df(table, rows):
            if not rows:
                return empty(table)
            if table in self._converted:  # the telemetry deques: convert only what arrived since the last round
                return self._converted[table].table(rows).to_pandas()
            return SPECS[table].to_table(self.run_id, rows).to_pandas()

        def cols(table, chunks, k, steps_k=None):
            if not chunks:
                return empty(table)
            # the window's rows, cut from the rank/step columns in one filter; then one contiguous table: the
            # window is many small batches, and converting a table of hundreds of chunks costs several times
            # more than copying it once
            t = _window_rows(pa.concat_tables(chunks), k, steps_k).combine_chunks()
            return _to_pandas_shared_lists(t, "group_ranks") if table == "collectives" else t.to_pandas()

        return {
            "run_id": self.run_id,
            "manifest": manifest,
            "steps": cols("steps", steps, k),
            # the collectives of the same steps (at most 4x as many rows as steps, as before)
            "collectives": cols("collectives", colls, 4 * k, k if k < self.window else None),
            "gpu": df("gpu", gpu),
            "host": df("host", host),
            "events": df("events", events),
            "xid": df("xid", xid),
            "liveness": pd.DataFrame(self.rank_states()),
            "now": time.time(),
        }


class _ConvertedWindow:
    """A deque of records (appended at the right, evicted at the left) as an Arrow table, converting each record
    once. The head's analysis round turns the GPU and host sample deques into DataFrames every 5 s; they hold
    minutes of samples (up to 7680 GPU samples), so converting all of them every round cost ~60 ms at 64 GPUs,
    almost all of it spent on samples converted the round before.

    ``table(rows)``: ``rows`` is the deque's snapshot now. The previous snapshot's records still in it are found
    by identity (its first record's position in the previous snapshot, then every one checked), their rows
    sliced from the previous table, and only the records after them converted. Anything else (the deque
    replaced, records inserted elsewhere) converts the whole snapshot, as before."""

    def __init__(self, run_id: str, table: str):
        self.run_id, self.name = run_id, table
        self.rows: list = []
        self.tbl: pa.Table | None = None
        self.lock = threading.Lock()  # frames() may run on more than one thread

    def table(self, rows: list) -> pa.Table:
        with self.lock:
            return self._table(rows)

    def _table(self, rows: list) -> pa.Table:
        from ranksight.tables import SPECS

        spec = SPECS[self.name]
        prev, tbl = self.rows, self.tbl
        kept = _kept_prefix(prev, rows) if tbl is not None else 0
        if kept:
            new = rows[kept:]
            parts = [tbl.slice(len(prev) - kept)] + ([spec.to_table(self.run_id, new)] if new else [])
            out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        else:
            out = spec.to_table(self.run_id, rows)
        self.rows, self.tbl = rows, out
        return out


def _kept_prefix(prev: list, cur: list) -> int:
    """How many records at the start of ``cur`` are the last ones of ``prev`` (the same objects, in order); 0 when
    ``cur`` does not continue ``prev`` that way."""
    if not prev or not cur:
        return 0
    first = cur[0]
    try:
        d = next(i for i, r in enumerate(prev) if r is first)
    except StopIteration:
        return 0
    kept = len(prev) - d
    if kept > len(cur) or not all(a is b for a, b in zip(prev[d:], cur)):
        return 0
    return kept


def _to_pandas_shared_lists(t: pa.Table, col: str) -> pd.DataFrame:
    """``t.to_pandas()``, with the rows of ``col`` (a list column) that hold equal lists sharing one numpy array.

    A collective record carries its communicator's member ranks, so the window holds the same list once per op
    and rank (at 1024 ranks, half a million of them). ``to_pandas`` makes an array per row; the analyzers'
    loader then derives a communicator key from each. Equal lists are found here in bulk (each list's raw bytes
    as one Arrow binary value, dictionary-encoded), and each distinct list is one array object, which the loader
    recognises by identity. Other list types convert as usual."""
    import pyarrow.compute as pc

    if col not in t.column_names or t.num_rows == 0:
        return t.to_pandas()
    lists = t.column(col).combine_chunks()
    if not (pa.types.is_list(lists.type) and pa.types.is_integer(lists.type.value_type)) or lists.flatten().null_count:
        return t.to_pandas()
    flat = lists.flatten().to_numpy()
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy().astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    raw = np.ascontiguousarray(flat).view(np.uint8)
    as_bytes = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(lengths), [None, pa.py_buffer(offsets * flat.dtype.itemsize), pa.py_buffer(raw)])
    code = pc.dictionary_encode(as_bytes).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    _, first = np.unique(code, return_index=True)
    shared = np.empty(len(first) + 1, dtype=object)  # the last slot: None, for a null list
    for j, i in enumerate(first):
        shared[j] = flat[offsets[i]:offsets[i + 1]].copy()
    null = lists.is_null().to_numpy(zero_copy_only=False)
    code[null] = len(first)
    df = t.drop_columns([col]).to_pandas()
    df.insert(t.column_names.index(col), col, shared[code])
    return df


def _tail_per_rank(t: pa.Table, k: int) -> pa.Table:
    """The last ``k`` rows (arrival order) of each rank."""
    if t.num_rows == 0:
        return t
    keep = _tail_mask(_np(t, "rank"), k)
    return t if keep.all() else t.filter(pa.array(keep))


def _last_steps_per_rank(t: pa.Table, k: int) -> pa.Table:
    """The rows of each rank's last ``k`` steps (step > that rank's newest step - k)."""
    if t.num_rows == 0:
        return t
    keep = _last_steps_mask(_np(t, "rank"), _np(t, "step"), k)
    return t if keep.all() else t.filter(pa.array(keep))


def _window_rows(t: pa.Table, k: int, steps_k: int | None = None) -> pa.Table:
    """``_last_steps_per_rank(_tail_per_rank(t, k), steps_k)`` (no step cut when ``steps_k`` is None) with one
    filter: the masks come from the rank and step columns alone, and the other columns (a collective's member
    list among them) are copied once, kept rows only."""
    if t.num_rows == 0:
        return t
    rank = _np(t, "rank")
    keep = _tail_mask(rank, k)
    if steps_k is not None:
        kept = np.flatnonzero(keep)
        keep[kept] = _last_steps_mask(rank[kept], _np(t, "step")[kept], steps_k)
    return t if keep.all() else t.filter(pa.array(keep))


def _tail_mask(rank: np.ndarray, k: int) -> np.ndarray:
    """Rows among the last ``k`` (arrival order) of their rank."""
    n = len(rank)
    # position from the end within each rank: stable sort by rank keeps arrival order
    order = np.argsort(rank, kind="stable")
    rs = rank[order]
    ends = np.ones(n, np.bool_)
    ends[:-1] = rs[1:] != rs[:-1]
    end_idx = np.nonzero(ends)[0]
    grp = np.searchsorted(end_idx, np.arange(n))
    from_end = end_idx[grp] - np.arange(n)
    keep = np.zeros(n, np.bool_)
    keep[order[from_end < k]] = True
    return keep


def _last_steps_mask(rank: np.ndarray, step: np.ndarray, k: int) -> np.ndarray:
    """Rows of their rank's last ``k`` steps (step > that rank's newest step - k)."""
    rank, step = rank.astype(np.int64), step.astype(np.int64)
    if len(rank) == 0:
        return np.zeros(0, np.bool_)
    order = np.argsort(rank, kind="stable")
    rs = rank[order]
    starts = np.ones(len(rs), np.bool_)
    starts[1:] = rs[1:] != rs[:-1]
    grp = np.cumsum(starts) - 1
    newest = np.maximum.reduceat(step[order], np.nonzero(starts)[0])
    keep = np.empty(len(rs), np.bool_)
    keep[order] = step[order] > newest[grp] - k
    return keep
