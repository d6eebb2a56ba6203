"""Communication: exposed share, slow links, bus bandwidth against nccl-tests, transport anomalies."""

import pandas as pd
from analyzer_fixtures import build, with_records

from analyzers.builder import build_frame
from analyzers.checks import comm
from analyzers.checks.comm import busbw_gbs
from ranksight.schema import NcclEvent


def test_slow_link_rank_named_with_normal_compute():
    data = build(link_delay_ms=lambda r, s: 40.0 if (r == 3 and s >= 8) else 0.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.evidence.get("cause") == "slow_link"]
    assert len(fs) == 1
    f = fs[0]
    assert f.ranks == [3] and f.step_start == 8 and f.severity == "warning"
    assert 48.0 <= f.evidence["rank_transfer_ms"] <= 52.0
    assert 9.0 <= f.evidence["peers_transfer_ms"] <= 11.0
    assert f.evidence["compute_ratio"] < 1.05


def test_slow_link_by_wait_deficit():
    # rank 1 arrives on time, but its data leaves 60 ms late (delay inside the DDP hook): everybody waits for it
    data = build(send_delay_ms=lambda r, s: 60.0 if (r == 1 and s >= 8) else 0.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.severity != "info"]
    assert len(fs) == 1
    f = fs[0]
    assert f.ranks == [1] and f.evidence["method"] == "wait_deficit" and f.step_start == 8
    assert 55.0 <= f.evidence["unexplained_wait_ms"] <= 65.0 and abs(f.evidence["arrival_lag_ms"]) < 5
    # its compute looks longer (the delay runs on the backward thread) but it does not arrive late:
    # the straggler analyzer reports it as info only
    from analyzers.checks import stragglers

    assert [(g.ranks, g.severity) for g in stragglers.analyze(build_frame(data))] == [([1], "info")]


def test_straggler_is_not_a_slow_link():
    # the victims of a slow computer block longer in the all-reduce, but that is waiting, not transfer
    data = build(compute_factor=lambda r, s: 1.5 if (r == 1 and s >= 5) else 1.0)
    assert [f for f in comm.analyze(build_frame(data)) if f.severity != "info"] == []


def test_slow_link_that_also_costs_its_rank_some_compute_is_still_a_slow_link():
    # a fresh dp2tp2 run: the 10 ms-per-op delay made its rank's (CPU) device time 1.08x its peers' as well;
    # a compute ratio over 1.08 alone must not hand a rank whose transfers' excess dwarfs it to the straggler analyzer
    data = build(link_delay_ms=lambda r, s: 40.0 if (r == 3 and s >= 8) else 0.0,
                 compute_factor=lambda r, s: 1.1 if (r == 3 and s >= 8) else 1.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.evidence.get("cause") == "slow_link"]
    assert [(f.ranks, f.step_start) for f in fs] == [([3], 8)]
    assert fs[0].evidence["compute_ratio"] >= 1.08 and "while computing 1.1" in fs[0].summary
    # a slow computer whose transfers are normal stays the straggler analyzer's
    data = build(compute_factor=lambda r, s: 1.12 if (r == 3 and s >= 8) else 1.0)
    assert [f for f in comm.analyze(build_frame(data)) if f.evidence.get("cause") == "slow_link"] == []


def test_exposed_comm_share_is_info_on_a_clean_run():
    data = build(transfer_ms=30.0)
    fs = comm.analyze(build_frame(data))
    assert len(fs) == 1
    f = fs[0]
    assert f.severity == "info" and f.evidence["cause"] == "exposed_comm"
    assert 0.20 <= f.evidence["exposed_share"] <= 0.23  # 30 ms of ~132 ms


def test_comm_growth_against_baseline():
    data = build(transfer_ms=10.0, link_delay_ms=lambda r, s: 60.0 if s >= 12 else 0.0)  # every rank's link slows
    fs = [f for f in comm.analyze(build_frame(data)) if f.severity == "warning"]
    assert len(fs) == 1 and fs[0].evidence["cause"] == "comm_growth"
    assert fs[0].step_start == 12 and fs[0].ranks == [0, 1, 2, 3]


def test_busbw_formula_matches_nccl_tests():
    # all_reduce of 1 GB in 100 ms on 8 ranks: algbw 10 GB/s, busbw 10 * 2*7/8 = 17.5
    assert abs(busbw_gbs("all_reduce", 1e9, 100.0, 8) - 17.5) < 1e-9
    assert abs(busbw_gbs("all_gather", 1e9, 100.0, 4) - 7.5) < 1e-9
    assert busbw_gbs("send", 1e9, 1000.0, 2) == 1.0
    assert busbw_gbs("unknown_op", 1e9, 1.0, 2) is None


def test_busbw_below_nccl_tests_baseline():
    data = build(nbytes=64 * 1024 * 1024, transfer_ms=10.0)
    # the all-reduce's true time is the last arriver's: 10 ms for 64 MiB on 4 ranks
    achieved = busbw_gbs("all_reduce", 64 * 1024 * 1024, 10.0, 4)
    data.nccl_tests = pd.DataFrame({"op": ["all_reduce", "all_reduce"], "size_bytes": [8 * 1024 * 1024, 64 * 1024 * 1024],
                                    "busbw": [5.0, achieved * 4], "nranks": [4, 4]})
    fs = [f for f in comm.analyze(build_frame(data)) if f.evidence.get("cause") == "busbw"]
    assert len(fs) == 1
    f = fs[0]
    assert f.severity == "warning"
    assert abs(f.evidence["fraction_of_baseline"] - 0.25) < 0.02
    assert abs(f.evidence["achieved_busbw_gbs"] - achieved) / achieved < 0.02


def test_transport_anomalies():
    data = build(world=4, nodes=2)
    ev = [
        NcclEvent(host="node0", pid=1, t=None, category="transport", transport="NET/IB", message="via NET/IB/0"),
        NcclEvent(host="node1", pid=2, t=None, category="transport", transport="NET/Socket", message="via NET/Socket/0"),
        NcclEvent(host="node1", pid=2, t=None, category="init", message="NCCL_P2P_DISABLE=1 set, P2P disabled"),
        NcclEvent(host="node0", pid=1, t=None, category="error", error_class="ib_completion",
                  message="NET/IB : Got completion from peer with error 12"),
        NcclEvent(host="node1", pid=2, t=None, category="error", error_class="cuda",
                  message="Cuda failure 'out of memory'"),
    ]
    fs = comm.analyze(build_frame(with_records(data, ev)))
    by = {f.evidence.get("cause"): f for f in fs}
    other = by["nccl_error"]
    assert (other.severity, other.nodes, other.evidence["lines"], other.evidence["error_classes"]) == ("warning", [1], 1, ["cuda"])
    assert other.summary == "NCCL reported 1 error line(s) on node1"
    assert by["ib_error"].summary == "InfiniBand errors on node0 (1 lines)"
    assert by["socket_fallback"].nodes == [1] and by["socket_fallback"].ranks == [2, 3]
    assert by["socket_fallback"].severity == "warning"
    assert by["p2p_disabled"].nodes == [1]
    assert by["ib_error"].severity == "critical" and by["ib_error"].nodes == [0]


def test_socket_without_ib_anywhere_is_fine():
    data = build(world=4, nodes=2)
    ev = [NcclEvent(host=f"node{i}", pid=i, t=None, category="transport", transport="NET/Socket") for i in range(2)]
    assert [f for f in comm.analyze(build_frame(with_records(data, ev))) if f.evidence.get("scope") == "transport"] == []


def _with_tp_ops(data, delay_ms, ops=12, seed=0):
    """TP all-reduces (groups [0,1], [2,3]), ``ops`` a step, random arrival order; ``delay_ms(rank, step)`` is the time
    a rank holds its data after arriving (a slow link): the op starts when the last member's data is there."""
    import numpy as np

    from ranksight.schema import CollectiveRecord

    rng = np.random.default_rng(seed)
    recs = []
    st = data.steps
    for s in sorted(int(x) for x in st["step"].unique()):
        t0 = float(st.loc[st["step"] == s, "t_start"].min())
        for i in range(ops):
            for pair in ((0, 1), (2, 3)):
                arrive = {r: t0 + 0.005 * i + rng.uniform(0, 0.002) for r in pair}
                ready = max(arrive[r] + delay_ms(r, s) / 1000 for r in pair)
                done = ready + (1.0 + 0.1 * rng.standard_normal()) / 1000
                for r in pair:
                    recs.append(CollectiveRecord(run_id="synth", rank=r, step=s, seq=s * ops + i, op="all_reduce", group="tp",
                                                 group_ranks=list(pair), nbytes=1 << 16, t_arrive=arrive[r], t_done=done,
                                                 duration_ms=(done - arrive[r]) * 1000))
    return with_records(data, recs)


def test_slow_link_by_self_delay_on_tp_ops():
    # rank 1 holds each TP all-reduce 5 ms from step 10: when it is the last to arrive the op still takes 6 ms, not 1 ms
    data = _with_tp_ops(build(world=4, steps=24), lambda r, s: 5.0 if (r == 1 and s >= 10) else 0.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.severity != "info"]
    assert [(f.ranks, f.evidence["method"]) for f in fs] == [([1], "self_delay")]
    ev = fs[0].evidence
    assert 8 <= fs[0].step_start <= 10 and ev["detected_at_step"] <= 13
    assert 4.5 <= ev["extra_ms_per_op"] <= 5.5 and "tp" in ev["groups"]
    # the same ops without the delay: nothing; 3 ms is under the 4 ms floor per op
    clean = _with_tp_ops(build(world=4, steps=24), lambda r, s: 0.0)
    assert [f for f in comm.analyze(build_frame(clean)) if f.severity != "info"] == []
    small = _with_tp_ops(build(world=4, steps=24), lambda r, s: 3.0 if (r == 1 and s >= 10) else 0.0)
    assert [f for f in comm.analyze(build_frame(small)) if f.severity != "info"] == []
    assert [f.ranks for f in comm.analyze(build_frame(small), comm.CommConfig(last_min_extra_ms=2.0)) if f.severity != "info"] == [[1]]


def test_self_delay_ignores_rooted_ops():
    # rank 0 is the root of a broadcast every step and is slower there (it sends to everyone): not a slow link
    from analyzers.checks import links
    from ranksight.schema import CollectiveRecord

    data = build(world=4, steps=24)
    recs = []
    for s in range(24):
        t0 = float(data.steps.loc[data.steps["step"] == s, "t_start"].min())
        for i in range(8):
            for r in range(4):
                dur = 9.0 if r == 0 else 1.0 + 0.2 * ((r + i) % 3)
                recs.append(CollectiveRecord(run_id="synth", rank=r, step=s, seq=s * 8 + i, op="broadcast", group="world",
                                             group_ranks=[0, 1, 2, 3], t_arrive=t0 + 0.01 * i + (0.003 if r == 0 else 0.0),
                                             t_done=t0 + 0.01 * i + 0.004, duration_ms=dur))
    assert links.last_arriver_ops(with_records(data, recs).collectives).query("group == 'world'").empty
    assert [f for f in comm.analyze(build_frame(with_records(data, recs))) if f.severity != "info"] == []


def test_comm_growth_explained_by_a_named_slow_link_is_info():
    # node 1 (ranks 2, 3) transfers 80 ms more a step from step 8: the job's exposed communication grows 5 % -> 24 %
    data = build(nodes=2, link_delay_ms=lambda r, s: 80.0 if (r >= 2 and s >= 8) else 0.0, transfer_ms=5.0)
    fs = comm.analyze(build_frame(data))
    growth = [f for f in fs if f.evidence.get("cause") == "comm_growth"]
    links = [f for f in fs if f.evidence.get("cause") == "slow_link"]
    assert [f.ranks for f in links] == [[2, 3]] and links[0].severity == "warning"
    assert len(growth) == 1 and growth[0].severity == "info" and growth[0].step_start == 8
    assert growth[0].evidence["explained_by"] == ["slow link of rank(s) 2,3"]
    # without the slow link finding (too small a node share for it) the growth would stand as a warning
    assert comm.analyze(build_frame(data), comm.CommConfig(rank_ratio=1e9, deficit_k=1e9, last_k=1e9))[0].severity == "warning"


def test_tp_partner_of_a_slow_link_is_not_blamed_by_wait_deficit():
    # rank 1 holds its TP ops 5 ms from step 10; its TP partner 0, held up there, reaches its gradient sync late,
    # which its data-parallel peers see as rank 0's data arriving late (a wait deficit of rank 0)
    base = build(world=4, steps=24, send_delay_ms=lambda r, s: 60.0 if (r == 0 and s >= 10) else 0.0)
    assert [f.ranks for f in comm.analyze(build_frame(base)) if f.severity != "info"] == [[0]]  # alone, rank 0 would be named
    data = _with_tp_ops(base, lambda r, s: 5.0 if (r == 1 and s >= 10) else 0.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.severity != "info"]
    assert [(f.ranks, f.evidence["method"]) for f in fs] == [([1], "self_delay")]


def test_long_transfers_spent_waiting_for_a_late_peer_are_not_a_slow_link():
    # FSDP-like: rank 1's all-gathers with rank 3 wait 80 ms a step from step 8 for rank 3 (stalled), outside the
    # gradient sync, so its comm_ms grows while its sync wait does not: without the per-op arrivals this reads as
    # rank 1's slow transfers
    from ranksight.schema import CollectiveRecord

    data = build(world=4, steps=24)
    st = data.steps
    st.loc[(st["rank"] == 1) & (st["step"] >= 8), "comm_ms"] += 80.0
    assert {tuple(f.ranks) for f in comm.analyze(build_frame(data)) if f.evidence.get("cause") == "slow_link"} == {(1,)}
    recs = []
    for s in range(24):
        t0 = float(st.loc[st["step"] == s, "t_start"].min())
        late = 0.080 if s >= 8 else 0.0
        for r in (1, 3):
            arrive = t0 + 0.01 + (late if r == 3 else 0.0)
            done = t0 + 0.012 + late
            recs.append(CollectiveRecord(run_id="synth", rank=r, step=s, seq=1000 + s, op="all_gather", group="dp_shard",
                                         group_ranks=[1, 3], t_arrive=arrive, t_done=done, duration_ms=(done - arrive) * 1000))
    with_ops = with_records(data, recs)
    assert comm.collective_wait_ms(with_ops.collectives).loc[1, 10] > 75
    assert [f for f in comm.analyze(build_frame(with_ops)) if f.evidence.get("cause") == "slow_link"] == []


def _with_ops(data, groups, delay_ms, ops=8, seed=0):
    """Symmetric collectives on the given communicators ({name: [members, ...]}), ``ops`` per communicator a step in
    random arrival order; ``delay_ms(rank, step)`` is the time a rank holds its data after arriving (a slow link)."""
    import numpy as np

    from ranksight.schema import CollectiveRecord

    rng = np.random.default_rng(seed)
    recs = []
    st = data.steps
    for s in sorted(int(x) for x in st["step"].unique()):
        t0 = float(st.loc[st["step"] == s, "t_start"].min())
        for name, comms in groups.items():
            for i in range(ops):
                for members in comms:
                    arrive = {r: t0 + 0.005 * i + rng.uniform(0, 0.002) for r in members}
                    ready = max(arrive[r] + delay_ms(r, s) / 1000 for r in members)
                    done = ready + (1.0 + 0.1 * rng.standard_normal()) / 1000
                    for r in members:
                        recs.append(CollectiveRecord(run_id="synth", rank=r, step=s, seq=s * ops + i, op="all_reduce", group=name,
                                                     group_ranks=list(members), nbytes=1 << 16, t_arrive=arrive[r], t_done=done,
                                                     duration_ms=(done - arrive[r]) * 1000))
    return with_records(data, recs)


TP_DP = {"tp": [(0, 1), (2, 3)], "dp": [(0, 2), (1, 3)]}


def test_slow_link_named_by_its_communicators():
    # rank 1 holds its data 3 ms in every op from step 10: under the self-delay floor per op, but its TP group *and*
    # its DP group are slower than the other TP / DP group, while its partners are slow only in the one they share
    data = _with_ops(build(world=4, steps=24), TP_DP, lambda r, s: 3.0 if (r == 1 and s >= 10) else 0.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.severity != "info"]
    assert [(f.ranks, f.evidence["method"]) for f in fs] == [([1], "communicators")]
    ev = fs[0].evidence
    # confirmed once slow in 8 of 10 steps (a rank's transfers on a shared host slow down for up to 6 steps at a time)
    assert 8 <= fs[0].step_start <= 10 and ev["detected_at_step"] <= 10 + 8
    slow = {e["communicator"] for e in ev["slow_communicators"]} | set(ev["corroborating_communicators"])
    assert slow == {"tp[0,1]", "dp[1,3]"}
    assert all(3.5 <= e["transfer_ms"] <= 4.5 and 0.8 <= e["kind_transfer_ms"] <= 1.2 for e in ev["slow_communicators"])
    assert "tp[0,1]" in fs[0].summary or "dp[1,3]" in fs[0].summary
    # no delay: nothing
    clean = _with_ops(build(world=4, steps=24), TP_DP, lambda r, s: 0.0)
    assert [f for f in comm.analyze(build_frame(clean)) if f.severity != "info"] == []


def test_one_slow_communicator_does_not_name_a_member():
    # only the TP link between ranks 0 and 1 is slow (both hold their TP data 3 ms; their DP groups are fine): which
    # end is at fault cannot be told from communicators, so no rank is named for it
    from analyzers.checks import links

    data = _with_ops(build(world=4, steps=24), {"tp": TP_DP["tp"]}, lambda r, s: 3.0 if (r in (0, 1) and s >= 10) else 0.0)
    data = _with_ops(data, {"dp": TP_DP["dp"]}, lambda r, s: 0.0, seed=1)
    tr = links.op_transfers(data.collectives, 10)
    per = tr.groupby("gkey")["transfer_ms"].median()
    assert per["tp[0,1]"] > 3.5 and per["tp[2,3]"] < 1.5  # the TP link is slow ...
    assert [f for f in comm.analyze(build_frame(data)) if f.evidence.get("method") == "communicators"] == []  # ... but no rank is named


def _with_p2p(data, delay_ms, seed=0):
    """A 2-stage pipeline (stage 0: ranks 0, 1; stage 1: ranks 2, 3; links 0<->2 and 1<->3), 4 micro-batches a step:
    per micro-batch a forward send stage 0 -> 1 and a backward send back, recorded by the trainer's p2p hooks (a
    send's arrival when posted, a recv's when its rank starts waiting). ``delay_ms(rank, step)``: the sender's data
    leaves that much after it posted it (a slow link)."""
    import numpy as np

    from ranksight.schema import CollectiveRecord

    rng = np.random.default_rng(seed)
    recs, seq = [], {}
    st = data.steps
    for s in sorted(int(x) for x in st["step"].unique()):
        t0 = float(st.loc[st["step"] == s, "t_start"].min())
        for mb in range(4):
            for k, (src, dst) in enumerate([(0, 2), (1, 3), (2, 0), (3, 1)]):
                key = f"pp:{src}>{dst}"
                n = seq.get(key, 0)
                seq[key] = n + 1
                t_send = t0 + 0.01 * mb + 0.004 * (k >= 2) + rng.uniform(0, 0.001)
                t_wait = t_send + rng.uniform(-0.001, 0.001)
                done = max(t_send + delay_ms(src, s) / 1000, t_wait) + (0.3 + 0.05 * rng.standard_normal()) / 1000
                for r, op, arr in ((src, "send", t_send), (dst, "recv", t_wait)):
                    recs.append(CollectiveRecord(run_id="synth", rank=r, step=s, seq=n, op=op, group=key, group_ranks=[src, dst],
                                                 nbytes=1 << 16, t_arrive=arr, t_done=done if op == "recv" else t_send + 1e-4,
                                                 duration_ms=None))
    return with_records(data, recs)


def test_p2p_transfers_pair_send_and_recv():
    from analyzers.checks import links

    data = _with_p2p(build(world=4, steps=6), lambda r, s: 2.0 if r == 1 else 0.0)
    tr = links.p2p_transfers(data.collectives)
    assert len(tr) == 6 * 4 * 4 and set(tr["cls"]) == {links.P2P_CLASS}
    per_link = tr.groupby("gkey")["transfer_ms"].median()
    assert set(per_link.index) == {"pp:0>2[0,2]", "pp:1>3[1,3]", "pp:2>0[0,2]", "pp:3>1[1,3]"}
    # the delayed link: its data arrives ~2 ms after the later of the two arrivals (the sender's, mostly)
    assert 1.6 <= per_link["pp:1>3[1,3]"] <= 2.6 and per_link.drop("pp:1>3[1,3]").max() < 0.6
    assert set(tr.loc[tr["gkey"] == "pp:1>3[1,3]", "suspects"]) == {(1,)}


def test_slow_p2p_link_names_its_sender():
    # rank 1's activations reach rank 3 2 ms late from step 10; rank 1 has no other communicator to compare, so the
    # slow link it sends on names it (its receiver, rank 3, sends its gradients back at normal speed)
    data = _with_p2p(build(world=4, steps=24), lambda r, s: 2.0 if (r == 1 and s >= 10) else 0.0)
    fs = [f for f in comm.analyze(build_frame(data)) if f.severity != "info"]
    assert [(f.ranks, f.evidence["method"]) for f in fs] == [([1], "communicators")]
    assert [e["communicator"] for e in fs[0].evidence["slow_communicators"]] == ["pp:1>3[1,3]"]
    assert 8 <= fs[0].step_start <= 10
    clean = _with_p2p(build(world=4, steps=24), lambda r, s: 0.0)
    assert [f for f in comm.analyze(build_frame(clean)) if f.severity != "info"] == []


def test_early_finishers_skip_the_leads_nobody_reads(monkeypatch):
    """With one op per communicator and step, no (rank, communicator) has ``link_min_ops`` ops in a window: the
    early-finisher signature works out no completion lead (at 1,024 ranks x 10,000 steps that was seconds and a
    GiB of leads nobody read)."""
    import numpy as np

    from analyzers.checks import completion_leads
    from analyzers.checks.links import ComputeCheck, early_finishers
    rng = np.random.default_rng(2)
    rows = []
    groups = [[0, 1], [2, 3]]
    for s in range(30):
        base = 1.7e9 + s
        for m in groups:
            arrive = {r: base + rng.uniform(0, 0.002) for r in m}
            done = max(arrive.values()) + 0.003
            for r in m:
                rows.append(dict(rank=r, step=s, seq=s, op="all_reduce", group="dp", gkey=f"dp{m}", group_ranks=np.array(m),
                                 t_arrive=arrive[r], t_done=done + rng.uniform(0, 1e-4), duration_ms=(done - arrive[r]) * 1e3))
    co = pd.DataFrame(rows)
    cfg = comm.CommConfig()
    called = []
    monkeypatch.setattr(completion_leads.CompletionLeads, "lead_ms", lambda self, sel=None: called.append(1))
    leads = completion_leads.CompletionLeads(co, 1)
    assert not leads.empty
    empty = pd.DataFrame()
    assert early_finishers(co, cfg, list(range(1, 30)), ComputeCheck(empty, empty, empty), leads) == []
    assert called == []


def test_slow_communicators_skipped_only_where_no_window_can_fill(monkeypatch):
    """``links.communicators_can_fill`` says no window of ``link_window`` steps can hold ``link_min_ops`` ops of one
    communicator only where none does (no level to compare); the signature then returns what it returns when it
    builds every transfer and finds nothing."""
    from analyzers.checks import links
    from analyzers.checks.comm import CommConfig

    class NoSlowComputer:
        def slow_computer(self, r, s0, s1):
            return False

        def compute_ratio(self, r, s0, s1):
            return float("nan")

    cfg = CommConfig()
    delay = lambda r, s: 3.0 if (r == 1 and s >= 10) else 0.0  # noqa: E731
    cases = [_with_ops(build(world=4, steps=24), TP_DP, delay, ops=1),  # one op a step: no window of 4 in 3 steps
             _with_ops(build(world=4, steps=24), TP_DP, delay, ops=2),
             _with_ops(build(world=4, steps=24), TP_DP, delay),
             _with_p2p(build(world=4, steps=24), lambda r, s: 2.0 if (r == 1 and s >= 10) else 0.0)]
    seen = set()
    for data in cases:
        co = data.collectives
        steps = sorted(int(s) for s in data.steps["step"].unique())[cfg.warmup_steps:]
        last = links.last_arriver_ops(co, steps[0], cfg.match_tol_ms)
        can = links.communicators_can_fill([last, links.p2p_transfers(co, steps[0])], cfg.link_window, cfg.link_min_ops)
        kinds = list(links.kind_windowed_medians(links.op_transfers(co, steps[0], cfg.match_tol_ms, last), steps, cfg))
        assert can or not kinds
        seen.add((can, bool(kinds)))
        got = links.slow_communicators(co, cfg, steps, NoSlowComputer(), last)
        with monkeypatch.context() as m:
            m.setattr(links, "communicators_can_fill", lambda *a: True)
            assert repr(got) == repr(links.slow_communicators(co, cfg, steps, NoSlowComputer(), last))  # (NaN fields)
    assert seen >= {(False, False), (True, True)}
