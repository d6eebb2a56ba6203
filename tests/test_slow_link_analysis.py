"""A slow link as a rate-limited node egress (``ranksight launch``'s namespaces + trainer.netfault) is found by who
finishes first and by the floor under a p2p link's transfers: synthetic records shaped like the measured ones."""

import numpy as np
import pandas as pd
from analyzer_fixtures import build, with_records

from analyzers.builder import build_frame
from analyzers.checks import comm, links
from analyzers.score import score
from ranksight.schema import CollectiveRecord, FaultSpec


def with_egress_ops(data, groups, slow_sender, extra_ms, ops=8, seed=0):
    """Symmetric collectives on ``groups`` ({name: [members, ...]}), ``ops`` per communicator a step. Every member is
    done when the data of the others has reached it: ``slow_sender(rank, step)`` says whose outgoing data is
    ``extra_ms`` late, so the members waiting for it finish that much after it (the sender itself does not wait)."""
    rng = np.random.default_rng(seed)
    recs = []
    st = data.steps
    for s in sorted(int(x) for x in st["step"].unique()):
        t0 = float(st.loc[st["step"] == s, "t_start"].min())
        for name, comms in groups.items():
            for i in range(ops):
                for members in comms:
                    arrive = {r: t0 + 0.01 * i + rng.uniform(0, 0.002) for r in members}
                    ready = max(arrive.values()) + (3.0 + 0.3 * rng.standard_normal()) / 1000
                    late = [r for r in members if slow_sender(r, s, members)]
                    for r in members:
                        waits = any(q != r for q in late)
                        done = ready + (extra_ms if waits else 0.0) / 1000 + rng.uniform(0, 0.0005)
                        recs.append(CollectiveRecord(run_id="synth", rank=r, step=s, seq=s * ops + i, op="all_reduce",
                                                     group=name, group_ranks=list(members), nbytes=1 << 20,
                                                     t_arrive=arrive[r], t_done=done, duration_ms=(done - arrive[r]) * 1000))
    return with_records(data, recs)


CROSS = {"tp": [(0, 1), (2, 3)], "dp": [(0, 2), (1, 3)]}  # 2 nodes x 2 ranks: TP inside a node, DP across


def warnings(data):
    return [f for f in comm.analyze(build_frame(data)) if f.severity != "info"]


def test_a_node_whose_egress_is_slow_is_named_by_its_ranks_finishing_first():
    # node 1 (ranks 2, 3) sends slowly from step 10: in each cross-node DP pair its rank is done 6 ms before its peer,
    # who waits for its data; inside the nodes (TP) nothing changes
    def slow(r, s, members):
        return r in (2, 3) and s >= 10 and members in CROSS["dp"]

    data = with_egress_ops(build(world=4, nodes=2, steps=26), CROSS, slow, 6.0)
    fs = warnings(data)
    assert [(f.ranks, f.nodes, f.evidence["scope"]) for f in fs] == [([2, 3], [1], "node")]
    f = fs[0]
    assert 8 <= f.step_start <= 11 and f.evidence["detected_at_step"] <= 10 + 9
    assert {r["method"] for r in f.evidence["ranks"]} == {"completion_lead"}
    assert all(5.0 <= r["own"] <= 7.0 for r in f.evidence["ranks"])
    assert "finishes its collectives" in f.summary and "node 1" in f.summary
    fault = FaultSpec(kind="slow_link", node=1, rate_mbit=100.0, start=10)
    s = score(comm.analyze(build_frame(data)), [fault], manifest=data.manifest)
    assert s.recall == 1.0 and s.precision == 1.0
    # the same run without the slow egress: nothing
    assert warnings(with_egress_ops(build(world=4, nodes=2, steps=26), CROSS, lambda r, s, m: False, 6.0)) == []


def test_in_a_ring_the_sender_of_the_slow_hop_is_named_not_its_node_mate_or_victims():
    # a ring 0 -> 1 -> 2 -> 3 -> 0 over two nodes: only rank 3 sends across node 1's link; the last chunk every other
    # rank receives has crossed that hop, so they all finish after rank 3
    ring = {"dp": [(0, 1, 2, 3)]}
    data = with_egress_ops(build(world=4, nodes=2, steps=26), ring, lambda r, s, m: r == 3 and s >= 10, 8.0, ops=4)
    fs = warnings(data)
    assert [(f.ranks, f.evidence.get("method")) for f in fs] == [([3], "completion_lead")]
    assert fs[0].evidence["communicators"] == ["dp[0,1,2,3]"]


def test_a_short_spell_of_one_rank_finishing_early_is_not_a_slow_link():
    # a core taken from rank 0 for 4 steps makes its DP peer finish early for as long: on a shared host that comes and
    # goes, a slow link stays
    def spell(r, s, members):
        return r == 2 and 12 <= s < 16 and members in CROSS["dp"]

    assert warnings(with_egress_ops(build(world=4, nodes=2, steps=26), CROSS, spell, 6.0)) == []


def test_a_rank_that_finishes_after_its_peers_is_not_blamed_by_the_wait_deficit():
    # rank 1's peers wait for it although it arrived on time (the wait-deficit signature) ...
    data = build(send_delay_ms=lambda r, s: 60.0 if (r == 1 and s >= 8) else 0.0)
    assert [f.ranks for f in warnings(data)] == [[1]]
    # ... but where its own collectives end after its peers', they were not waiting for its data: no slow link
    co = data.collectives.copy()
    late = (co["rank"] == 1) & (co["step"] >= 8)
    co.loc[late, "t_done"] += 0.005
    co.loc[late, "duration_ms"] += 5.0
    data.collectives = co
    assert links.latest_finish_ms(links.completion_leads(co, 8), 1, 8, 19) >= 4.5
    assert [f for f in warnings(data) if f.evidence.get("method") == "wait_deficit"] == []


def with_p2p_floor(data, floor_ms, jitter_ms, seed=0):
    """A 2-stage pipeline over 2 nodes (stage 0: ranks 0, 1 on node 0; stage 1: ranks 2, 3 on node 1), 4 micro-batches
    a step, each a forward send 0->2 / 1->3 and a backward send back. ``floor_ms(sender, step)``: every transfer out of
    that sender takes at least this (message size / rate), plus queueing of 0 to ``jitter_ms`` in *both* directions
    (the acknowledgements of the forward data queue behind the slow backward data)."""
    rng = np.random.default_rng(seed)
    recs = []
    st = data.steps
    for s in sorted(int(x) for x in st["step"].unique()):
        t = float(st.loc[st["step"] == s, "t_start"].min())
        for mb in range(4):
            for src, dst in ((0, 2), (1, 3), (2, 0), (3, 1)):
                seq = s * 4 + mb
                post = t + 0.02 * mb + rng.uniform(0, 0.001)
                wait = post + rng.uniform(0, 0.001)
                q = rng.uniform(0, jitter_ms(s)) / 1000
                done = max(post, wait) + max(0.3 / 1000 + q, floor_ms(src, s) / 1000 + q)
                group, members = f"pp:{src}>{dst}", [src, dst]
                recs.append(CollectiveRecord(run_id="synth", rank=src, step=s, seq=seq, op="send", group=group,
                                             group_ranks=members, nbytes=98304, t_arrive=post, t_done=post + 0.0002,
                                             duration_ms=0.2))
                recs.append(CollectiveRecord(run_id="synth", rank=dst, step=s, seq=seq, op="recv", group=group,
                                             group_ranks=members, nbytes=98304, t_arrive=wait, t_done=done,
                                             duration_ms=(done - wait) * 1000))
    return with_records(data, recs)


def test_the_floor_under_a_slow_nodes_p2p_transfers_names_the_node():
    # from step 10 node 1's sends take at least 8.6 ms each, and queueing of up to 14 ms comes and goes on both
    # directions: the links' medians jitter as much as they differ, the floor does not
    data = build(world=4, nodes=2, steps=26)
    slow = with_p2p_floor(data, lambda src, s: 8.6 if (src in (2, 3) and s >= 10) else 0.0,
                          lambda s: 14.0 if s >= 10 else 1.0)
    fs = warnings(slow)
    assert [(f.ranks, f.nodes) for f in fs] == [([2, 3], [1])]
    assert {r["method"] for r in fs[0].evidence["ranks"]} == {"communicators"}
    assert fs[0].step_start >= 8
    clean = with_p2p_floor(data, lambda src, s: 0.0, lambda s: 1.0)
    assert warnings(clean) == []


def test_noise_is_measured_without_the_level_shift():
    steps = list(range(2, 26))
    rng = np.random.default_rng(3)
    quiet = rng.normal(1.0, 0.2, size=(3, len(steps)))
    shifted = np.r_[rng.normal(1.0, 0.2, 10), rng.normal(20.0, 0.2, len(steps) - 10)]
    frame = pd.DataFrame(np.vstack([quiet, shifted]), index=["a", "b", "c", "slow"], columns=steps)
    sig = links.shift_robust_sigmas(frame, 3)
    assert sig.max() < 0.5  # the slow row's shift by 19 moves 3 of its 21 differences: not its noise
    ref = links.reference_sigma(frame, 3)
    assert set(ref.index) == set(frame.index) and (ref < 0.5).all()
    assert links.reference_sigma(frame.iloc[:1], 3).iloc[0] == sig.iloc[0]


def test_the_victims_of_a_straggler_finishing_first_are_not_a_slow_link():
    # 2 ranks, rank 1 computes 1.5x from step 10: it arrives last and, in every all-reduce, finishes a few ms after
    # rank 0 (its own share of the work still to do). Rank 0 "leads" because its peer is a straggler, not because
    # its link is slow: the straggler check names rank 1, the comm check names nobody.
    data = build(world=2, nodes=1, steps=26, device_time=True,
                 compute_factor=lambda r, s: 1.5 if (r == 1 and s >= 10) else 1.0)
    data = with_egress_ops(data, {"dp": [(0, 1)]}, lambda r, s, m: r == 0 and s >= 10, 5.0)
    assert warnings(data) == []
