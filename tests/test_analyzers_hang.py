"""Hangs: missing ranks at a collective, silent ranks live, watchdog lines."""

from analyzer_fixtures import build, with_records

from analyzers.builder import build_frame
from analyzers.checks import hang
from analyzers.loader import RunData
from ranksight.schema import CollectiveRecord, EventRecord, NcclEvent


def test_missing_rank_named_like_the_flight_recorder():
    data = build(world=4, stop={3: 20}, finished=False)
    (f,) = hang.analyze(build_frame(data))
    assert f.kind == "hang" and f.severity == "critical"
    assert f.ranks == [3] and f.step_start == 20
    ev = f.evidence
    assert ev["cause"] == "missing_ranks" and ev["missing_ranks"] == [3] and ev["waiting_ranks"] == [0, 1, 2]
    assert ev["op"] == "all_reduce" and ev["seq"] == 21 and ev["group"] == "dp"
    assert f.summary.startswith("rank 3 never joined all_reduce seq 21 on group dp; ranks 0,1,2 waiting since")
    assert ev["last_completed_collective"][0] == "all_reduce seq 20 on dp"


def test_collective_joined_by_all_but_never_completed():
    data = build(world=2, steps=5)
    extra = [CollectiveRecord(run_id="synth", rank=r, step=5, seq=6, op="all_gather", group="dp", group_ranks=[0, 1],
                              t_arrive=float(data.steps["t_end"].max()) + 0.01 * r) for r in (0, 1)]
    (f,) = hang.analyze(build_frame(with_records(data, extra)))
    assert f.evidence["cause"] == "collective_stuck" and f.ranks == [0, 1]
    assert "never completed" in f.summary


def test_live_silent_rank():
    data = build(world=4, steps=20)
    # rank 1 stops reporting after step 9; the others carry on
    steps = data.steps[~((data.steps["rank"] == 1) & (data.steps["step"] >= 10))]
    live = RunData(run_id="synth", manifest=data.manifest, steps=steps, now=float(data.steps["t_end"].max()) + 1.0)
    assert hang.analyze(build_frame(live)) == []  # 1 s of silence is not a hang yet (stall threshold >= 60 s)
    live.now += 120.0
    fs = hang.analyze(build_frame(live))
    # everybody is silent now: the whole job is reported; rank 1 went first
    assert len(fs) == 1 and fs[0].severity == "critical"
    assert fs[0].ranks == [0, 1, 2, 3]
    live2 = RunData(run_id="synth", manifest=data.manifest, steps=steps, now=float(steps[steps["rank"] == 1]["t_end"].max()) + 90)
    live2.steps.loc[live2.steps["rank"] != 1, "t_end"] = live2.now - 0.5  # others reported just now
    (g,) = hang.analyze(build_frame(live2))
    assert g.ranks == [1] and "continue" in g.summary and g.evidence["cause"] == "silent"


def test_post_mortem_rank_behind_without_exit():
    data = build(world=4, steps=20)
    steps = data.steps[~((data.steps["rank"] == 2) & (data.steps["step"] >= 12))]
    (f,) = hang.analyze(build_frame(RunData(run_id="synth", manifest=data.manifest, steps=steps)))
    assert f.ranks == [2] and f.evidence["cause"] == "stopped_early" and f.step_start == 12
    # an evicted rank that said goodbye is not a hang
    ev = [EventRecord(run_id="synth", rank=2, step=11, t=0.0, event="evicted")]
    d = RunData.from_records("synth", ev, manifest=data.manifest)
    assert hang.analyze(build_frame(RunData(run_id="synth", manifest=data.manifest, steps=steps, events=d.events))) == []


def test_finished_run_is_clean_and_unfinished_short_run_is_a_warning():
    assert hang.analyze(build_frame(build(steps=20))) == []
    data = build(steps=20, finished=False)
    data.manifest.config["steps"] = 50
    (f,) = hang.analyze(build_frame(data))
    assert f.severity == "warning" and f.evidence["cause"] == "ended_early"


def test_watchdog_line():
    data = build(world=4, nodes=2)
    ev = [NcclEvent(host="node1", pid=7, t=None, category="watchdog", rank=3, error_class="timeout",
                    message="[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=57, OpType=ALLREDUCE) ran for 600000 ms")]
    (f,) = hang.analyze(build_frame(with_records(data, ev)))
    assert f.severity == "critical" and f.ranks == [3] and f.nodes == [1]
    assert f.evidence["cause"] == "watchdog_timeout" and "SeqNum=57" in f.evidence["example"]


def test_missing_rank_in_one_of_two_dp_groups():
    # dp2 x tp2: two communicators named "dp" ([0,2] and [1,3]) count their own sequence numbers
    recs = []
    for seq in range(1, 6):
        for grp in ([0, 2], [1, 3]):
            for r in grp:
                done = not (seq == 5 and grp == [1, 3])
                if seq == 5 and r == 3:
                    continue  # rank 3 never arrives at its group's 5th all_gather
                recs.append(CollectiveRecord(run_id="synth", rank=r, step=seq, seq=seq, op="all_gather", group="dp", group_ranks=grp,
                                             t_arrive=100.0 + seq, t_done=(100.5 + seq) if done else None))
    (f,) = hang.analyze(build_frame(RunData.from_records("synth", recs)))
    assert f.ranks == [3] and f.evidence["missing_ranks"] == [3] and f.evidence["waiting_ranks"] == [1]
    assert f.summary.startswith("rank 3 never joined all_gather seq 5 on group dp [1,3]; rank 1 waiting since")


def test_crash_names_the_first_failing_rank():
    data = build(world=4, steps=8, finished=False)
    data.manifest.config["steps"] = 20
    t = float(data.steps["t_end"].max())
    ev = [EventRecord(run_id="synth", rank=2, step=8, t=t + 0.1, event="exit", detail={"reason": "RuntimeError: CUDA error: an illegal memory access"}),
          EventRecord(run_id="synth", rank=0, step=8, t=t + 0.3, event="exit", detail={"reason": "RuntimeError: Connection closed by peer"}),
          EventRecord(run_id="synth", rank=1, step=8, t=t + 0.3, event="exit", detail={"reason": "RuntimeError: Connection closed by peer"})]
    (f,) = hang.analyze(build_frame(with_records(data, ev)))
    assert f.severity == "critical" and f.ranks == [2] and f.evidence["cause"] == "crashed"
    assert f.evidence["followers"] == [0, 1] and "illegal memory access" in f.summary


def test_unwaited_op_of_a_rank_that_moved_on_is_not_a_hang():
    # an async TP all-reduce recorded by rank 3 only (no completion seen, its partner has no such seq) early in a run
    # that went on: rank 3 completed later collectives on the same communicator, so nobody was stuck there
    data = build(world=4, steps=10)
    t0 = float(data.steps["t_start"].min())
    extra = [CollectiveRecord(run_id="synth", rank=3, step=1, seq=500, op="all_reduce", group="tp", group_ranks=[2, 3],
                              t_arrive=t0 + 0.01)]
    extra += [CollectiveRecord(run_id="synth", rank=r, step=s, seq=600 + s, op="all_reduce", group="tp", group_ranks=[2, 3],
                               t_arrive=t0 + s, t_done=t0 + s + 0.002, duration_ms=2.0) for r in (2, 3) for s in (2, 3)]
    assert hang.analyze(build_frame(with_records(data, extra))) == []
    # the same op as the last thing rank 3 did on that communicator is a hang (rank 2 never joined it)
    late = [CollectiveRecord(run_id="synth", rank=3, step=9, seq=900, op="all_reduce", group="tp", group_ranks=[2, 3],
                             t_arrive=t0 + 100.0)]
    fs = hang.analyze(build_frame(with_records(data, extra + late)))
    assert [(f.ranks, f.evidence["cause"]) for f in fs] == [([2], "missing_ranks")]


def test_last_completed_collective_per_rank_as_a_sort_per_rank():
    import numpy as np
    import pandas as pd

    _last_completed = hang._last_completed
    rng = np.random.default_rng(2)
    n = 3000
    co = pd.DataFrame({"rank": rng.integers(0, 40, n), "seq": np.arange(n), "op": rng.choice(["all_reduce", "broadcast"], n),
                       "group": rng.choice(["dp", "tp"], n), "t_arrive": rng.random(n),
                       "t_done": np.where(rng.random(n) < 0.1, np.nan, 1.0)})
    co.loc[co.index[:5], "t_arrive"] = np.nan  # an unknown arrival sorts last
    done = co["t_done"].notna().to_numpy()
    want = {}
    for r, sub in co[done].groupby("rank"):
        row = sub.sort_values("t_arrive").iloc[-1]
        want[int(r)] = f"{row['op']} seq {int(row['seq'])} on {row['group']}"
    assert _last_completed(co, done) == want and len(want) == 40
