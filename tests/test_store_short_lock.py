"""Ingest does not wait out a flush: while a flush processes and writes the rows queued before (held here at its
part write), a request's batches are logged and queued and the request returns. Nothing is lost or stored twice,
the live window gets the rows in arrival order, a view waits for the rows in flight, and the rows logged during the
flush survive a crash (they are in the WAL's new generation, not in the one the flush deletes)."""

import threading

import numpy as np

from head.store import run_store
from head.store.run_store import RunStore
from ranksight import schema, wire
from ranksight.tables import read_table

RUN = "r1"


def packed_steps(ranks, step):
    recs = [schema.StepRecord(run_id=RUN, rank=r, step=step, node=0, host="h", world_size=64, t_start=float(step),
                              t_end=step + 0.5, step_ms=500.0) for r in ranks]
    layout, body = wire.pack_records("step", RUN, recs)
    return wire.PackedBatch(wire.packed_layout_of("step", layout), body, len(recs))


class HeldWrite:
    """``RunStore._write_part`` held until ``go`` is set; ``writing`` is set once a flush is inside it."""

    def __init__(self, monkeypatch):
        self.writing, self.go = threading.Event(), threading.Event()
        orig = run_store.RunStore._write_part

        def held(store, table, chunks):
            self.writing.set()
            assert self.go.wait(60), "the test never let the flush go on"
            return orig(store, table, chunks)

        monkeypatch.setattr(run_store.RunStore, "_write_part", held)


def test_a_request_is_queued_while_a_flush_writes(tmp_path, monkeypatch):
    rs = RunStore(tmp_path / RUN, RUN, flush_rows=10**9)
    fed: list[np.ndarray] = []
    rs.on_new = lambda table, t, rows, n, k: fed.append(t.column("step").to_numpy()) if t is not None else None
    ranks = range(64)
    rs.enqueue_packed("steps", [packed_steps(ranks, 0)])
    held = HeldWrite(monkeypatch)
    flusher = threading.Thread(target=rs.flush, daemon=True)
    flusher.start()
    assert held.writing.wait(30)  # the flush has taken the queue and is writing
    done = threading.Event()

    def ingest():
        rs.enqueue_packed("steps", [packed_steps(ranks, 1)])
        rs.enqueue_packed("steps", [packed_steps(ranks, 0)])  # a resend of what the flush is writing
        done.set()

    threading.Thread(target=ingest, daemon=True).start()
    assert done.wait(30), "ingest waited for the flush (the store's lock was held through the part write)"
    viewer = threading.Thread(target=rs.process, daemon=True)  # a view: waits for the rows in flight
    viewer.start()
    viewer.join(0.5)
    assert viewer.is_alive() and rs.pending_rows == 128
    held.go.set()
    flusher.join(30)
    viewer.join(30)
    assert not flusher.is_alive() and not viewer.is_alive()
    assert [int(a[0]) for a in fed] == [0, 1]  # arrival order; the resend deduplicated against the flushed rows
    assert rs.duplicates == 64
    rs.flush()
    assert read_table(tmp_path, RUN, "steps").groupby("step").size().to_dict() == {0: 64, 1: 64}


def test_rows_logged_during_a_flush_survive_a_crash(tmp_path, monkeypatch):
    rs = RunStore(tmp_path / RUN, RUN, flush_rows=10**9)
    rs.enqueue_packed("steps", [packed_steps(range(8), 0)])
    held = HeldWrite(monkeypatch)
    flusher = threading.Thread(target=rs.flush, daemon=True)
    flusher.start()
    assert held.writing.wait(30)
    rs.enqueue_packed("steps", [packed_steps(range(8), 1)])  # acknowledged while the flush writes step 0
    held.go.set()
    flusher.join(30)
    monkeypatch.undo()
    # a kill -9 now: no close, no flush of step 1; a new head on the same directory replays its WAL
    again = RunStore(tmp_path / RUN, RUN)
    again.close()
    got = read_table(tmp_path, RUN, "steps").groupby("step").size().to_dict()
    assert got == {0: 8, 1: 8}
