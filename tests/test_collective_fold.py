"""Collective records folded per step at the node agent (ranksight/collective_fold.py, ``--collectives per-step``):
the means, totals and counts are right, what must stay single stays single, and the folded records reach the
head's store with their ``ops`` (packed on the wire), while every op stays in the rank's spool."""

from __future__ import annotations

import threading

import pytest

from agent_helpers import TOKEN
from conftest import free_port
from head.api import make_server
from head.service import Head
from node.agent import NodeAgent
from ranksight import schema
from ranksight.collective_fold import fold_per_step
from ranksight.layout import RunDir
from ranksight.tables import read_table

T0 = 1.8e9


def coll(rank, step, seq, op="all_reduce", group="tp", comm="c-tp", t=0.0, dur=2.0, nbytes=100, done=True, **kw):
    a = T0 + step + t
    return schema.CollectiveRecord(run_id="r", rank=rank, step=step, seq=seq, op=op, group=group, comm_id=comm,
                                   nbytes=nbytes, t_arrive=a, t_done=a + dur / 1000 if done else None,
                                   duration_ms=dur if done else None, **kw)


def test_fold_means_totals_and_what_stays_single():
    recs = [coll(0, 5, 10, t=0.010, dur=2.0), coll(0, 5, 11, t=0.020, dur=4.0), coll(0, 5, 12, t=0.030, dur=6.0),
            coll(0, 5, 13, op="all_gather", t=0.040),  # another op kind: its own record
            coll(0, 5, 0, group="dp", comm="c-dp", t=0.5, dur=30.0, nbytes=1 << 20),  # another communicator
            coll(0, 6, 14, t=0.010),  # another step
            coll(0, 5, 15, t=0.050, done=False),  # never completed: stays as it is, for the hang check
            coll(0, 5, 0, op="send", group="pp:0>1", comm="c-p2p", t=0.6),  # pipeline p2p: matched per transfer
            coll(0, 5, 1, op="send", group="pp:0>1", comm="c-p2p", t=0.7)]
    out = fold_per_step(recs)
    assert [(r.op, r.group, r.step, r.seq, r.ops) for r in out] == [
        ("all_reduce", "tp", 5, 10, 3), ("all_gather", "tp", 5, 13, 1), ("all_reduce", "dp", 5, 0, 1),
        ("all_reduce", "tp", 6, 14, 1), ("all_reduce", "tp", 5, 15, 1), ("send", "pp:0>1", 5, 0, 1),
        ("send", "pp:0>1", 5, 1, 1)]
    tp = out[0]
    assert tp.t_arrive == pytest.approx(T0 + 5.020, abs=1e-7)  # the mean of the three arrivals
    assert tp.duration_ms == pytest.approx(4.0)  # the mean duration
    assert tp.t_done == pytest.approx(T0 + 5.020 + 0.004, abs=1e-7)
    assert tp.nbytes == 300  # the total
    assert out[4].t_done is None
    # the folded record is folded once: a second pass changes nothing
    assert fold_per_step(out) == out
    # the older form (a member list, no comm_id): groups told apart by their members
    old = [coll(0, 1, 0, comm="", group_ranks=[0, 1]), coll(0, 1, 1, comm="", group_ranks=[0, 1]),
           coll(0, 1, 2, comm="", group_ranks=[0, 2])]
    assert [r.ops for r in fold_per_step(old)] == [2, 1]


def test_member_differences_survive_the_fold():
    """Across the members of a communicator, the folded times differ by the mean of the per-op differences: rank 1
    arrives 3 ms after rank 0 at every op, so its folded arrival is 3 ms later too."""
    r0 = fold_per_step([coll(0, 2, s, t=0.01 * s) for s in range(8)])
    r1 = fold_per_step([coll(1, 2, s, t=0.01 * s + 0.003) for s in range(8)])
    assert (r1[0].t_arrive - r0[0].t_arrive) * 1000 == pytest.approx(3.0, abs=1e-3)
    assert r0[0].seq == r1[0].seq == 0  # the same op instance on both members


def test_agent_ships_folded_records_and_the_spool_keeps_every_op(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "r")
    rd.spool_dir.mkdir(parents=True)
    ops_per_step, steps = 16, 5
    for rank in (0, 1):
        with open(rd.spool(rank), "wb") as f:
            for s in range(steps):
                for k in range(ops_per_step):
                    f.write(schema.encode(coll(rank, s, s * ops_per_step + k, t=0.001 * k)) + b"\n")
                f.write(schema.encode(schema.StepRecord(run_id="r", rank=rank, step=s, node=0, host="h", world_size=2,
                                                        t_start=T0 + s, t_end=T0 + s + 0.5, step_ms=500.0)) + b"\n")
    head = Head(store, TOKEN, analyzer=None, flush_interval=0.2)
    srv = make_server(head, "127.0.0.1", free_port())
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    agent = NodeAgent(rd, 0, f"http://127.0.0.1:{srv.server_address[1]}", TOKEN, sim_gpu="off", otlp_metrics=False,
                      collectives="per-step")
    try:
        agent.cycle()
        # what the head stored: one record per rank and step, standing for the step's 16 ops, packed on the wire
        head.store.flush_all()
        co = read_table(store, "r", "collectives")
        assert len(co) == 2 * steps
        assert set(co["ops"].astype(int)) == {ops_per_step}
        assert int(co["nbytes"].iloc[0]) == 100 * ops_per_step
        assert set(co["seq"].astype(int)) == {s * ops_per_step for s in range(steps)}
    finally:
        srv.shutdown()
        srv.server_close()
        head.close()
    # every op is still on the node's disk
    lines = rd.spool(0).read_bytes().count(b'"collective"')
    assert lines == ops_per_step * steps


def _spool_with_ops(rd, world: int, ops: int = 4) -> None:
    rd.spool_dir.mkdir(parents=True, exist_ok=True)
    with open(rd.spool(0), "wb") as f:
        for k in range(ops):
            f.write(schema.encode(coll(0, 0, k)) + b"\n")
        f.write(schema.encode(schema.StepRecord(run_id="r", rank=0, step=0, node=0, host="h", world_size=world,
                                                t_start=T0, t_end=T0 + 0.5, step_ms=500.0)) + b"\n")


@pytest.mark.parametrize("mode, world, shipped", [("auto", 8, 4), ("auto", 257, 1), ("per-op", 4096, 4),
                                                  ("per-step", 2, 1)])
def test_agent_folds_by_default_only_in_large_jobs(tmp_path, mode, world, shipped):
    rd = RunDir(tmp_path / "store", "r")
    _spool_with_ops(rd, world)
    agent = NodeAgent(rd, 0, "http://127.0.0.1:9", TOKEN, sim_gpu="off", otlp_metrics=False, collectives=mode)
    items = [i for i in agent.spool.collect() if i.kind == "collective"]
    assert [i.count for i in items] == [shipped]


def test_agent_refuses_an_unknown_mode(tmp_path):
    with pytest.raises(ValueError):
        NodeAgent(RunDir(tmp_path, "r"), 0, "http://127.0.0.1:9", TOKEN, sim_gpu="off", otlp_metrics=False,
                  collectives="sometimes")
