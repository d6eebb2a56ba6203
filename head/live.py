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
the views (``rank_states``, ``steps_since``, ``run_data``) build what they return
when asked. Before a view reads, ``sync`` (set by the head) lets the store process
its queued batches, so a view never misses an acknowledged record.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from head.live_frames import (ConvertedWindow, SharedDictionaries, analysis_frame, numpy_column, plain_strings,
                              samples_frame_of, tail_per_rank, to_pandas_shared_lists, window_chunks, window_rows)
from head.live_gpu import GPU_DICT_COLUMNS, concat_gpu, dense_gpu_keys, gpu_codes, gpu_records
from head.live_ranks import MAX_RANK, AgentLive, RankState
from ranksight import schema
from ranksight.tables import SPECS, TABLE_TYPES

if TYPE_CHECKING:
    import pandas as pd

    from analyzers.loader import RunData

log = logging.getLogger("ranksight.live")

DEFAULT_WINDOW = 512  # steps per rank kept in memory
MAX_COMMUNICATORS = 1 << 20  # process groups kept (a 16,384-rank job with its pipeline links has ~50,000)
TRACES_KEPT = 8192  # trace summaries kept: the last few captures of a large job
# GPU samples kept per (node, gpu): the GPU checks (analyzers/checks/gpu_health.py: a share of throttled samples, at
# least 3; memory_pressure: each GPU's capacity) judge each GPU on its own recent samples, so the bound is per GPU
# (a minute at the agents' 1 s sampling), not global (a global one holds under a second of a 16,384-GPU fleet)
GPU_SAMPLES_PER_GPU = 60
# the memory cap over all GPUs (~128 per GPU of a 16,384-GPU fleet); over it the oldest batches go, logged and counted
MAX_GPU_ROWS = 1 << 21
GPU_RECORDS_VIEW = 64 * 120  # the newest samples ``RunLive.gpu`` shows as records (the API and run summary read it)
# The window's string columns, kept dictionary-encoded against dictionaries its batches share (live_frames.
# SharedDictionaries): the run id, a rank's host, a collective's op, group and communicator id, a GPU's host, source,
# device name and uuid are the same in row after row (a 16,384-rank window holds 8 M steps, 16 M collectives, a
# million GPU samples)
DICT_COLUMNS = {"steps": ("run_id", "host"), "collectives": ("run_id", "op", "group", "comm_id"),
                "gpu": GPU_DICT_COLUMNS}


class RunLive:
    """One run's live window (steps, collectives, samples, events, XIDs), per-rank and per-agent liveness, and its
    manifest."""

    def __init__(self, run_id: str, window: int = DEFAULT_WINDOW):
        self.run_id = run_id
        self.window = window
        self.lock = threading.RLock()
        self.state = RankState()
        self._steps: deque = deque()  # Arrow tables, oldest first
        self._steps_rows = 0
        self._colls: deque = deque()
        self._colls_rows = 0
        self.agents: dict[int, AgentLive] = {}
        # GPU samples as Arrow tables (one per batch, oldest first), trimmed to about ``GPU_SAMPLES_PER_GPU`` rows per
        # GPU seen (cut exactly per GPU when read) and at most ``MAX_GPU_ROWS``; records are made only for the views
        self._gpu_arrow: deque = deque()
        self._gpu_arrow_rows = 0
        self._gpu_keys: set[int] = set()  # the (node, gpu) pairs seen, as node << 20 | gpu
        self._dicts = {table: SharedDictionaries(cols) for table, cols in DICT_COLUMNS.items()}
        self.gpu_rows_cut = 0  # samples dropped by the memory cap before their GPU had its window
        self._gpu_view: tuple = (None, deque(maxlen=GPU_RECORDS_VIEW))  # (newest batch it was made from, records)
        self.host: deque = deque(maxlen=16 * 120)
        self.events: deque = deque(maxlen=2000)
        self.xid: deque = deque(maxlen=2000)
        # profiler trace summaries (a few per rank: captures are periodic or on demand, not per step); the kernel-time
        # check (analyzers/checks/kernel_time.py) compares ranks over the same capture window
        self.traces: deque = deque(maxlen=TRACES_KEPT)
        # each process group's members, once (collective records name their group by comm_id)
        self.comms: dict[str, schema.CommunicatorRecord] = {}
        self.manifest: schema.Manifest | None = None
        self.last_seen = 0.0
        self.sync: Callable[[], None] | None = None  # set by the head: process queued batches first
        # a window filled from the store's history (head/history.py): its data_mark() then, and when (monotonic);
        # None once new records arrived
        self.restored_mark: tuple | None = None
        self.restored_at = 0.0
        # run_data(): the host sample deque as Arrow, each sample converted once
        self._converted = {"host": ConvertedWindow(run_id, "host")}

    @property
    def gpu(self) -> deque:
        """The newest GPU samples of the live window as records (oldest first; at most ``GPU_RECORDS_VIEW``). The same
        objects until a new batch arrives."""
        with self.lock:
            newest = self._gpu_arrow[-1] if self._gpu_arrow else None
            if newest is not self._gpu_view[0]:
                self._gpu_view = (newest, self._gpu_records(GPU_RECORDS_VIEW))
            return self._gpu_view[1]

    def _gpu_records(self, limit: int) -> deque:
        out: deque = deque(maxlen=limit)
        t = self._newest_gpu(limit)  # only the newest ``limit`` rows are converted
        if t is None:
            return out
        out.extend(gpu_records(t, self.run_id))
        return out

    def gpu_latest(self) -> list:
        """The newest sample (largest ``t``; the later arrival on a tie) of each (node, gpu) in the live window, as
        records, in (node, gpu) order."""
        with self.lock:
            chunks = list(self._gpu_arrow)
        if not chunks:
            return []
        t = concat_gpu(chunks)
        code = gpu_codes(t)
        ts = np.nan_to_num(numpy_column(t, "t").astype(np.float64), nan=-np.inf)
        order = np.lexsort((np.arange(len(code)), ts, code))  # by GPU, then time, then arrival
        last = order[np.r_[code[order][1:] != code[order][:-1], True]]
        return gpu_records(t.take(pa.array(last)), self.run_id)

    def _gpu_per_gpu(self) -> int:
        """Samples kept per GPU: ``GPU_SAMPLES_PER_GPU``, more on a small fleet (the ``GPU_RECORDS_VIEW`` samples a
        global bound kept before are shared among its GPUs, so a small fleet keeps as much as it did)."""
        return max(GPU_SAMPLES_PER_GPU, -(-GPU_RECORDS_VIEW // max(1, len(self._gpu_keys))))

    def gpu_table(self, per_gpu: int | None = None) -> pa.Table | None:
        """The GPU samples of the live window as one Arrow table: the last ``per_gpu`` (arrival order; default
        ``_gpu_per_gpu()``) of each (node, gpu). None when there are none."""
        kept = self._gpu_window(per_gpu)
        return concat_gpu(kept) if kept else None

    def _gpu_window(self, per_gpu: int | None = None) -> list[pa.Table]:
        """The batches of the GPU window cut to the last ``per_gpu`` samples (arrival order; default
        ``_gpu_per_gpu()``) of each (node, gpu), without sorting the window (``window_chunks`` on a GPU key)."""
        with self.lock:
            chunks = list(self._gpu_arrow)
            per_gpu = self._gpu_per_gpu() if per_gpu is None else per_gpu
        if not chunks:
            return []
        return window_chunks(chunks, per_gpu, keys=dense_gpu_keys(chunks))

    def _add_gpu(self, t: pa.Table) -> None:
        """Append a batch of GPU samples (Arrow, the store's schema) and trim the window (under ``self.lock``)."""
        t = self._dicts["gpu"].encode(concat_gpu([t]))
        self._gpu_arrow.append(t)
        self._gpu_arrow_rows += t.num_rows
        self._gpu_keys.update(np.unique(gpu_codes(t)).tolist())
        want = self._gpu_per_gpu() * max(1, len(self._gpu_keys))
        cap = min(want, MAX_GPU_ROWS)
        while len(self._gpu_arrow) > 1 and self._gpu_arrow_rows - self._gpu_arrow[0].num_rows >= cap:
            n = self._gpu_arrow.popleft().num_rows
            self._gpu_arrow_rows -= n
            if want > MAX_GPU_ROWS:  # the per-GPU window does not fit the memory cap: say so
                if self.gpu_rows_cut == 0:
                    log.warning("live %s: %d GPUs x %d samples is over the live window's cap of %d GPU samples: "
                                "the oldest are dropped (counted in gpu_rows_cut)", self.run_id,
                                len(self._gpu_keys), self._gpu_per_gpu(), MAX_GPU_ROWS)
                self.gpu_rows_cut += n

    def gpu_recent(self, n: int) -> pa.Table | None:
        """The newest ``n`` GPU samples of the live window (arrival order) as an Arrow table; None when there are
        none. Nothing is converted to records (the runs list asks it on every call)."""
        self._pull()
        return self._newest_gpu(n)

    def _newest_gpu(self, n: int) -> pa.Table | None:
        with self.lock:
            chunks, rows = [], 0
            for t in reversed(self._gpu_arrow):
                chunks.append(t)
                rows += t.num_rows
                if rows >= n:
                    break
        if not chunks:
            return None
        t = concat_gpu(chunks[::-1])
        return t.slice(max(0, t.num_rows - n))

    def _pull(self) -> None:
        if self.sync is not None:
            try:
                self.sync()
            except Exception:  # a view must still answer with what is there
                log.exception("live %s: processing queued batches failed", self.run_id)

    # -- updates ------------------------------------------------------------------
    def add(self, table: str, rows: list, now: float | None = None) -> None:
        """Decoded records (msgspec Structs) of ``table``."""
        if not rows:
            return
        if table in ("steps", "collectives"):
            self.add_arrow(table, SPECS[table].to_table(self.run_id, rows), now)
            return
        now = now or time.time()
        with self.lock:
            self.last_seen = now
            if table == "events":
                st = self.state
                for r in rows:
                    self.events.append(r)
                    if 0 <= r.rank < MAX_RANK:
                        st.ensure(r.rank)
                        st.last_seen[r.rank] = now
                        if r.event in ("exit", "evicted"):
                            detail = r.detail if isinstance(r.detail, dict) else {}
                            reason = "evicted" if r.event == "evicted" else str(detail.get("reason", ""))
                            st.record_exit(r.rank, float(r.t), reason)
            elif table == "gpu":
                self._add_gpu(concat_gpu([SPECS["gpu"].to_table(self.run_id, rows)]))
            elif table == "host":
                self.host.extend(rows)
            elif table == "xid":
                self.xid.extend(rows)
            elif table == "trace_summaries":
                self.traces.extend(rows)
            elif table == "communicators":
                for r in rows:
                    if len(self.comms) < MAX_COMMUNICATORS or r.comm_id in self.comms:
                        self.comms[r.comm_id] = r

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
        if table == "gpu":
            with self.lock:
                self.last_seen = now
                self._add_gpu(t)
            return
        if table not in ("steps", "collectives"):
            try:
                rows = msgspec.convert(t.to_pylist(), list[TABLE_TYPES[table]], strict=False)
            except (msgspec.ValidationError, TypeError) as e:
                log.error("live %s: %s rows not shown live: %s", self.run_id, table, e)
                return
            self.add(table, rows, now)
            return
        rank = numpy_column(t, "rank").astype(np.int64)
        ok = (rank >= 0) & (rank < MAX_RANK)
        with self.lock:
            t = self._dicts[table].encode(t)  # strings held once per value, not per row
            self.last_seen = now
            st = self.state
            if ok.any():
                st.ensure(int(rank[ok].max()))
            if table == "steps":
                self._steps.append(t)
                self._steps_rows += t.num_rows
                st.record_steps(t, rank, ok)
                # about ``window`` rows per rank; run_data()/steps_since() cut exactly per rank
                cap = self.window * max(1, int(st.has_step.sum()))
                while self._steps_rows - self._steps[0].num_rows >= cap and len(self._steps) > 1:
                    self._steps_rows -= self._steps.popleft().num_rows
            else:
                self._colls.append(t)
                self._colls_rows += t.num_rows
                while self._colls_rows > 4 * self.window * max(1, int(st.present.sum())) and len(self._colls) > 1:
                    self._colls_rows -= self._colls.popleft().num_rows
            rr = rank[ok]
            st.present[rr] = True
            st.last_seen[rr] = now

    def trace_summaries(self, rank: int | None = None) -> list:
        """The trace summaries in the live window (oldest first), of one rank or all."""
        self._pull()
        with self.lock:
            return [t for t in self.traces if rank is None or t.rank == rank]

    def heartbeat(self, hb, now: float | None = None) -> None:
        self.heartbeats((hb,), now)

    def heartbeats(self, hbs, now: float | None = None) -> None:
        """Agents' heartbeats (one request's: a Collector's batch holds many agents'), under one lock."""
        now = now or time.time()
        agents = self.agents
        isfinite = math.isfinite
        with self.lock:
            for hb in hbs:
                a = agents.get(hb.node)
                if a is None:
                    a = agents[hb.node] = AgentLive(hb.node)
                a.host, a.url, a.last_seen, a.heartbeat = hb.host, hb.url, now, hb
                t = hb.t
                if isinstance(t, (int, float)) and isfinite(t) and t > 0:
                    off = now - float(t)
                    if off < a.clock_offset:
                        a.clock_offset = off
            if hbs and now > self.last_seen:
                self.last_seen = now

    def mark_restored(self, rank: np.ndarray, t_end: np.ndarray) -> None:
        """The window now holds restored history (head/history.py): each rank was last seen at its last stored
        step's end (``rank``/``t_end``: the restored step rows), the run at the newest."""
        with self.lock:
            st = self.state
            rank = np.asarray(rank, np.int64)
            ok = (rank >= 0) & (rank < MAX_RANK) & np.isfinite(t_end)
            if ok.any():
                st.ensure(int(rank[ok].max()))
                seen = np.zeros(st.n)
                np.maximum.at(seen, rank[ok], t_end[ok])
                has = seen > 0
                st.last_seen[has] = seen[has]
                self.last_seen = float(seen.max())
            self.restored_mark = self._mark()
            self.restored_at = time.monotonic()

    # -- views ------------------------------------------------------------------
    def _steps_table(self) -> pa.Table | None:
        with self.lock:
            chunks = list(self._steps)
        return pa.concat_tables(chunks) if chunks else None

    def max_step(self) -> int | None:
        self._pull()
        with self.lock:
            st = self.state
            return int(st.last_step[st.has_step].max()) if st.has_step.any() else None

    def n_ranks(self) -> int:
        self._pull()
        with self.lock:
            return int(self.state.present.sum())

    def ended(self) -> str | None:
        """How the run ended, seen from its ranks: "finished" when every rank that reported has an ``exit`` event
        after its last step and each says it ended as planned (``finished``; evicted ranks count as such),
        "failed" when every rank exited but some with an error; None while any rank has not exited."""
        from analyzers.checks.hang import clean_exit

        self._pull()
        with self.lock:
            st = self.state
            ranks = np.nonzero(st.present | st.exited)[0]
            if len(ranks) == 0 or not st.exited[ranks].all():
                return None
            reasons = [str(x) for x in st.exit_reason[ranks]]
        return "finished" if all(clean_exit(x) for x in reasons) else "failed"

    def world(self) -> tuple[int | None, int | None]:
        """(world size, nodes) as the step records say them (for a run without a manifest): the newest attempt's
        ``world_size``, and the distinct nodes of its ranks."""
        self._pull()
        with self.lock:
            st = self.state
            if not st.has_step.any():
                return None, None
            newest = st.has_step & (st.attempt == st.attempt[st.has_step].max())
            ws = int(st.world_size[newest].max()) or int(newest.sum())
            nodes = {int(n) for n in st.node[newest] if n >= 0}
            return ws, (len(nodes) or None)

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

            df = pd.DataFrame({"rank": numpy_column(t, "rank"), "step_ms": numpy_column(t, "step_ms")})
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
                                "t_end": None, "step_ms": None, "last_seen": None, "age_s": None, "state": "waiting",
                                "exit_reason": None})
                    continue
                last_seen = float(st.last_seen[r])
                age = now - last_seen if last_seen else None
                # "stalled": nothing for much longer than this rank's own recent step time (and > 10 s).
                typ = typical.get(r)
                typ = typ / 1000.0 if typ is not None and typ == typ else 1.0
                if st.exited[r] or finished:
                    state = "finished"  # the rank left: its exit reason says whether as planned
                elif age is not None and age > max(10.0, 10 * typ):
                    state = "stalled"
                else:
                    state = "running"
                node = int(st.node[r]) if st.node[r] >= 0 else (p.node if p else None)
                out.append({"rank": r, "node": node, "host": st.host[r], "step": int(st.last_step[r]),
                            "attempt": int(st.attempt[r]), "t_end": float(st.t_end[r]),
                            "step_ms": float(st.step_ms[r]), "last_seen": last_seen, "age_s": age, "state": state,
                            "exit_reason": str(st.exit_reason[r]) if st.exited[r] else None})
        return out

    def steps_since(self, since: int = -1, rank: int | None = None, limit: int = 10_000) -> list:
        self._pull()
        t = self._steps_table()
        if t is None:
            return []
        mask = pc.greater(t.column("step"), since)
        if rank is not None:
            mask = pc.and_(mask, pc.equal(t.column("rank"), rank))
        t = t.filter(mask)
        t = tail_per_rank(t, self.window)
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
        """What the analyzers' inputs last received: the newest step and collective batch, event, XID and trace
        summary (the objects themselves, compared with ``is``), and the manifest. Two marks differ exactly when
        new rows of those kinds (or a new manifest) reached the window in between; GPU/host samples and
        heartbeats are not part of it."""
        self._pull()
        with self.lock:
            return self._mark()

    def _mark(self) -> tuple:
        return (self._steps[-1] if self._steps else None, self._colls[-1] if self._colls else None,
                self.events[-1] if self.events else None, self.xid[-1] if self.xid else None,
                self.traces[-1] if self.traces else None, self.manifest)

    def _gpu_frame(self) -> pd.DataFrame | None:
        """The GPU window (each GPU's last samples) as the analyzers' frame: converted column by column as the
        store's columnar reader does (``samples_frame_of``), or row-wise by ``to_pandas`` (``RunData.normalize``
        after) when a batch lacks a column it reads. None when there are no samples."""
        kept = self._gpu_window()
        if not kept:
            return None
        df = samples_frame_of("gpu", kept)
        if df is not None:
            return df
        t = concat_gpu(kept)
        return t.to_pandas() if t.num_rows else None

    def run_data(self, window: int | None = None, now: float | None = None) -> RunData:
        """The live window as the analyzers' input: ``analyzers.loader.RunData(source="live", now=...)``.

        ``window``: the last ``window`` steps per rank (and 4x as many collectives) instead of the whole
        live window (``self.window``), e.g. the head's bounded analysis window. Each rank keeps its own
        last rows, so a rank that went silent long ago still appears with its last steps. ``now``: the
        round's wall clock (default: the time the data is handed over)."""
        from analyzers.loader import RunData

        k = self.window if window is None else max(1, min(int(window), self.window))
        self._pull()
        with self.lock:
            steps, colls = list(self._steps), list(self._colls)
            host, events, xid = list(self.host), list(self.events), list(self.xid)
            traces = list(self.traces)
            comms = list(self.comms.values())
            manifest = self.manifest
            # each rank's clock offset: its node agent's (ranks of one node share its clock)
            node_off = {n: a.clock_offset for n, a in self.agents.items() if math.isfinite(a.clock_offset)}
            st = self.state
            offsets = {int(r): float(node_off[int(st.node[r])]) for r in np.nonzero(st.has_step)[0]
                       if int(st.node[r]) in node_off}

        def records(table, rows):
            if not rows:
                return _empty_frame(table)
            if table in self._converted:  # the telemetry deques: convert only what arrived since the last round
                return self._converted[table].table(rows).to_pandas()
            return SPECS[table].to_table(self.run_id, rows).to_pandas()

        gpu_df = self._gpu_frame()
        prepared = set() if gpu_df is None else {"gpu"}
        communicators = records("communicators", comms)

        def columnar(table, chunks, k, steps_k=None):
            if not chunks:
                return _empty_frame(table)
            # the window's rows, converted column by column into the normalized frame (no per-row Python)
            df = analysis_frame(table, chunks, k, steps_k, communicators)
            if df is not None:
                prepared.add(table)
                return df
            # row-wise (an empty window, or batches without a column the columnar reader wants): the rows cut
            # in one filter, one contiguous table (converting a table of hundreds of chunks costs several times
            # more than copying it once), RunData.normalize after
            t = plain_strings(window_rows(pa.concat_tables(chunks), k, steps_k).combine_chunks())
            return to_pandas_shared_lists(t, "group_ranks") if table == "collectives" else t.to_pandas()

        steps_df = columnar("steps", steps, k)
        # the collectives of the same steps (at most 4x as many rows as steps)
        colls_df = columnar("collectives", colls, 4 * k, k if k < self.window else None)
        return RunData(
            run_id=self.run_id, manifest=manifest, steps=steps_df, collectives=colls_df,
            events=records("events", events),
            gpu=_empty_frame("gpu") if gpu_df is None else gpu_df, host=records("host", host),
            xid=records("xid", xid), trace_summaries=records("trace_summaries", traces),
            communicators=communicators, source="live",
            now=time.time() if now is None else now,
            clock_offset_s=offsets, prepared=frozenset(prepared))


def _empty_frame(table: str) -> pd.DataFrame:
    import pandas as pd

    return pd.DataFrame({n: [] for n in SPECS[table].schema.names})
