"""The head's runs: each run's live window, wired to the run's store, and the runs list the API serves."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pyarrow as pa

from head.history import has_history, restore_window, stored_progress
from head.live import DEFAULT_WINDOW, RunLive
from head.store import RunStore, Store
from ranksight import schema
from ranksight.peaks import gpu_peak

log = logging.getLogger("ranksight.head")


def _recent_gpu(live: RunLive | None) -> list[dict] | None:
    """The run's newest 64 GPU samples' ``simulated`` and ``name`` (oldest first), read from the live window's Arrow
    batches (no record made per call); None when there are none."""
    t = live.gpu_recent(64) if live is not None else None
    if t is None or t.num_rows == 0:
        return None
    return t.select(["simulated", "name"]).to_pylist()


def _gpu_simulated(recent: list[dict] | None) -> bool | None:
    """True when the run's recent GPU samples (``_recent_gpu``) come from the simulator, None when there are none."""
    if not recent:
        return None
    return any(bool(g["simulated"]) for g in recent)


def _sampled_peak(recent: list[dict] | None) -> tuple[float, str] | None:
    """(peak FLOP/s, source) of the real GPU the run's recent samples (``_recent_gpu``) name (``ranksight.peaks``),
    for a run whose manifest gives none."""
    for g in reversed(recent or []):
        if not g["simulated"] and g["name"]:
            return gpu_peak(g["name"])
    return None


def run_status(m: schema.Manifest | None, live: RunLive | None, now: float) -> str:
    """finished (the manifest says so, or every rank's ``exit`` event says ``finished``), failed (every rank exited,
    some with an error), running (records in the last 30 s), else stopped."""
    if m is not None and m.finished:
        return "finished"
    ended = live.ended() if live is not None else None
    if ended is not None:
        return ended
    if live is not None and now - live.last_seen < 30:
        return "running"
    return "stopped"


class LiveRuns:
    """The live window (``RunLive``) of every run the head has seen, each wired to its run's store: the rows the
    store keeps after dedupe reach the window (and the ingest counters in ``stats``), and a view of the window
    first lets the store process its queued batches."""

    def __init__(self, store: Store, stats: dict[str, int], window: int = DEFAULT_WINDOW):
        self.store = store
        self.stats = stats
        self.window = window
        self.runs: dict[str, RunLive] = {}
        self._wired: dict[str, RunStore] = {}  # run id -> its RunStore, feeding the live window (RunStore.on_new)
        self._lock = threading.Lock()

    def run(self, run_id: str) -> RunLive:
        """The run's live window, created on first use: with the stored manifest, if any, and the run's stored
        recent history (head/history.py: a restarted head shows what it showed before)."""
        rl = self.runs.get(run_id)
        if rl is not None:
            return rl
        with self._lock:
            rl = self.runs.get(run_id)
            if rl is not None:
                return rl
            rl = RunLive(run_id, self.window)
            # Views of the live window first process the run's queued packed batches (after any history: they wait
            # for the lock below, and are newer).
            rl.sync = lambda run_id=run_id: self._sync(run_id)
            rl.manifest = schema.read_manifest(self.store.root / run_id / "run.json")
            restore = has_history(self.store.root, run_id)
            if restore:
                # held while the history is read, so nothing (a view, a new batch) sees or adds to a half-filled
                # window; other runs only wait for the moment it is published
                rl.lock.acquire()
            self.runs[run_id] = rl
        try:
            if restore:
                try:
                    restore_window(rl, self.store.root, run_id)
                except Exception:  # noqa: BLE001 - a store that cannot be read leaves an empty window, not a dead head
                    log.exception("live %s: the stored history was not restored", run_id)
        finally:
            if restore:
                rl.lock.release()
        return rl

    def store_of(self, run_id: str) -> RunStore:
        """The run's store, wired to its live window (queued rows reach it when the store processes them)."""
        rs = self._wired.get(run_id)
        if rs is None:
            live = self.run(run_id)
            rs = self.store.run(run_id)
            if rs.on_new is None:
                rs.on_new = _feeder(live, self.stats)
            self._wired[run_id] = rs
        return rs

    def wire_replayed(self) -> None:
        """Wire the runs whose store has queued rows but no live window yet (a WAL replayed at start), so those rows
        feed the live window too."""
        for run_id, rs in list(self.store.runs.items()):
            if rs.on_new is None and rs.pending_rows:
                self.store_of(run_id)

    def _sync(self, run_id: str) -> None:
        rs = self.store.runs.get(run_id)
        if rs is not None and rs.pending_rows:
            self.store_of(run_id).process()

    def summary(self) -> list[dict[str, Any]]:
        """Every run stored or live: status, layout, progress, and what MFU is measured against (``GET /api/runs``)."""
        now = time.time()
        out = []
        for run_id in sorted(set(self.store.run_ids()) | set(self.runs)):
            live = self.runs.get(run_id)
            m = live.manifest if live else None
            if m is None:
                m = schema.read_manifest(self.store.root / run_id / "run.json")
            if live is not None:
                last_step = live.max_step()  # processes the queue first: before last_seen is read
                steps_stored = None
            else:  # a stored run nothing has opened yet (e.g. after a restart): what its part files' footers say
                last_step, steps_stored = stored_progress(self.store.root, run_id)
            status = run_status(m, live, now)
            rs = self.store.runs.get(run_id)
            # without a manifest (or without these in it): what the step records and the GPU samples say
            world, nodes = live.world() if live is not None else (None, None)
            peak = (m.peak_flops, m.peak_source, m.peak_simulated) if m is not None and m.peak_flops else None
            recent = _recent_gpu(live)
            simulated = _gpu_simulated(recent)
            if peak is None and (sampled := _sampled_peak(recent)) is not None:
                peak = (sampled[0], sampled[1], False)
            out.append({"run_id": run_id, "status": status,
                        "start_time": m.start_time if m else None,
                        "world_size": ((m.layout.get("world") or len(m.ranks)) if m else None) or world,
                        "layout": m.layout if m else {}, "nodes": (m.nodes if m else None) or nodes,
                        "last_step": last_step, "last_seen": live.last_seen if live else None,
                        "ranks_live": live.n_ranks() if live else 0,
                        "steps_stored": rs.stored_and_buffered("steps") if rs else steps_stored,
                        # What MFU is measured against, and whether GPU data is simulated: surfaces must say so.
                        "peak_flops": peak[0] if peak else None,
                        "peak_source": peak[1] if peak else "",
                        "peak_simulated": peak[2] if peak else None,
                        "device": m.device if m else ("cuda" if simulated is False else ""),
                        "gpu_simulated": simulated})
        return out


def _feeder(live: RunLive, stats: dict[str, int]):
    """The ``RunStore.on_new`` callback of a run: counts the rows in and new, and hands the new ones to its window."""

    def on_new(table: str, new_table: pa.Table | None, new_rows: list | None, n_in: int, n_new: int) -> None:
        stats["records_in"] += n_in
        stats["records_new"] += n_new
        stats["duplicates"] += n_in - n_new
        live.add_new(table, new_table, new_rows)

    return on_new
