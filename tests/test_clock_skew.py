"""A node whose clock is off from the head's (issue 16, item 2): liveness is judged on the head's receive clock, so
the node is not "silent" for the difference; the skew itself is one finding naming the node."""

from __future__ import annotations

import msgspec
from agent_helpers import TOKEN
from analyzers import run_all
from analyzers.builder import build_frame
from head.service import Head
from ranksight import schema, wire

SKEW_S = -120.0  # node 1's clock is 120 s behind the head's


def _step(rank: int, s: int, t_end: float) -> schema.StepRecord:
    return schema.StepRecord(run_id="r", rank=rank, step=s, node=rank // 2, host=f"h{rank // 2}", world_size=4,
                             t_start=t_end - 0.5, t_end=t_end, step_ms=500.0, compute_ms=400.0, comm_ms=90.0,
                             sync_wait_ms=5.0)


def test_a_skewed_node_is_not_silent_and_its_skew_is_reported(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    try:
        rs, live = h.store.run("r"), h.live.run("r")
        t0 = 1_800_000_000.0
        for s in range(1, 31):
            head_now = t0 + s * 0.5
            for node in range(2):
                node_now = head_now + (SKEW_S if node == 1 else 0.0)
                for rank in (2 * node, 2 * node + 1):
                    live.add("steps", rs.add("steps", [_step(rank, s, node_now)]), now=head_now + 0.3)
                # the agent's heartbeat, stamped with its node's clock, arrives 0.3 s later (at the head's clock)
                live.heartbeat(wire.Heartbeat(node=node, host=f"h{node}", t=node_now), now=head_now + 0.3)
        data = live.run_data(now=t0 + 30 * 0.5 + 1.0)
        assert abs(data.clock_offset_s[2] - (0.3 - SKEW_S)) < 1e-6 and abs(data.clock_offset_s[0] - 0.3) < 1e-6
        found = run_all(data)
        assert not [f for f in found if f.kind == "hang"], [f.summary for f in found]
        (skew,) = [f for f in found if f.kind == "clock_skew"]
        assert skew.nodes == [1] and skew.ranks == [2, 3] and skew.severity == "warning"
        assert "node 1's clock is 120.3 s behind the head's" in skew.summary
        # the same node going quiet is still seen, after the stall on the head's clock
        later = run_all(live.run_data(now=t0 + 15.0 + 200.0))
        assert [f.ranks for f in later if f.kind == "hang"] == [[0, 1, 2, 3]]
    finally:
        h.close()


def test_a_backlog_delivered_late_is_not_clock_skew(tmp_path):
    """Steps that arrive long after they ran (an outbox drained after the head came back) say nothing of clocks: only
    heartbeats, made just before their own export, do."""
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    try:
        rs, live = h.store.run("r"), h.live.run("r")
        t0 = 1_800_000_000.0
        for s in range(1, 31):
            for rank in range(4):
                live.add("steps", rs.add("steps", [_step(rank, s, t0 + s * 0.5)]), now=t0 + 300.0)  # 5 min late
        for node in range(2):
            live.heartbeat(wire.Heartbeat(node=node, host=f"h{node}", t=t0 + 300.0), now=t0 + 300.2)
        found = run_all(live.run_data(now=t0 + 301.0))
        assert not [f for f in found if f.kind == "clock_skew"], [f.summary for f in found]
    finally:
        h.close()


def test_a_skewed_nodes_arrival_times_are_not_compared_with_other_nodes(tmp_path):
    """Arrival at the gradient sync is a wall-clock time: node 1 at -120 s "arrived 120 s early yet its peers waited
    for it", a slow link the evict policy acted on (bench/fault_injection.py). The live window leaves its arrivals out."""
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    try:
        rs, live = h.store.run("r"), h.live.run("r")
        t0 = 1_800_000_000.0
        for s in range(1, 31):
            head_now = t0 + s * 0.5
            for node in range(2):
                node_now = head_now + (SKEW_S if node == 1 else 0.0)
                recs = [schema.StepRecord(**{**msgspec.structs.asdict(_step(rank, s, node_now)),
                                             "sync_arrival": node_now - 0.1})
                        for rank in (2 * node, 2 * node + 1)]
                live.add("steps", rs.add("steps", recs), now=head_now + 0.3)
                live.heartbeat(wire.Heartbeat(node=node, host=f"h{node}", t=node_now), now=head_now + 0.3)
        data = live.run_data(now=t0 + 30 * 0.5 + 1.0)
        judged = build_frame(data).data.steps
        by_rank = judged.groupby("rank")["sync_arrival"].apply(lambda c: c.notna().all())
        assert by_rank.to_dict() == {0: True, 1: True, 2: False, 3: False}
        found = run_all(data)
        assert [f.kind for f in found if f.severity != "info"] == ["clock_skew"], [f.summary for f in found]
    finally:
        h.close()


def test_post_mortem_a_node_whose_step_ends_sit_120_s_away_has_its_arrivals_left_out():
    """diagnose has no heartbeats: the skew shows in the steps themselves (a step ends on every rank within about a
    step time). Node 1's wall-clock compute is stretched 1.3x by its host, so its peers wait for it; at -120 s its
    arrival "on time" once left that wait unexplained: a false slow link."""
    import dataclasses

    from analyzer_fixtures import build

    data = build(world=4, nodes=2, steps=30, device_time=True, host_factor=lambda r, s: 1.3 if (r >= 2 and s >= 5) else 1.0)
    st = data.steps.copy()
    for c in ("t_start", "t_end", "sync_arrival"):
        st.loc[st["node"] == 1, c] += SKEW_S
    skewed = dataclasses.replace(data, steps=st)
    assert [f.kind for f in run_all(data) if f.severity != "info"] == []
    assert [f.summary for f in run_all(skewed) if f.severity != "info"] == []
    judged = build_frame(skewed).data.steps
    assert judged.loc[judged["node"] == 1, "sync_arrival"].isna().all()
    assert judged.loc[judged["node"] == 0, "sync_arrival"].notna().all()
    assert build_frame(data).data.steps["sync_arrival"].notna().all()  # an unskewed run keeps every arrival
