"""The head's bounded analysis window (--analyze-window) and the rounds it skips when nothing new arrived."""

import time

import msgspec

from head.service import Head, resolve_analyzers
from head.live import RunLive
from agent_helpers import TOKEN
from ranksight import schema


def _step(rank, s, t0, compute=100.0, comm=65.0, run_id="r1"):
    t_end = t0 + s * 0.2 + 0.17
    return schema.StepRecord(
        run_id=run_id, rank=rank, step=s, node=rank // 2, host=f"n{rank // 2}", world_size=4, dp_rank=rank,
        t_start=t_end - 0.17, t_end=t_end, step_ms=170.0, compute_ms=compute, comm_ms=comm, forward_ms=compute / 3,
        backward_ms=2 * compute / 3, sync_arrival=t_end - 0.17 + compute / 1000, sync_wait_ms=comm, tokens=1000)


def _straggler_rows(s0, s1, t0, onset):
    rows = []
    for s in range(s0, s1):
        for r in range(4):
            slow = r == 2 and s >= onset  # rank 2 computes 1.6x longer from ``onset``; the others wait for it
            rows.append(_step(r, s, t0, compute=160.0 if slow else 100.0, comm=5.0 if slow else (65.0 if s >= onset else 5.0)))
    return rows


def test_run_data_cuts_each_rank_to_the_analysis_window():
    live = RunLive("r1", window=64)
    t0 = 1000.0
    live.add("steps", [_step(r, s, t0) for s in range(100) for r in range(3)])
    live.add("steps", [_step(3, s, t0) for s in range(10)])  # a rank that stopped early keeps its last rows
    st = live.run_data(16).steps
    per_rank = st.groupby("rank")["step"].agg(["min", "max", "count"])
    assert per_rank.loc[0].tolist() == [84, 99, 16] and per_rank.loc[3].tolist() == [0, 9, 10]
    assert live.run_data().steps.groupby("rank")["step"].count().loc[0] == 64  # default: the whole live window
    assert live.run_data(10_000).steps.groupby("rank")["step"].count().loc[0] == 64  # never more than it


def test_a_short_analysis_window_keeps_an_ongoing_episodes_onset(tmp_path):
    fn = resolve_analyzers()
    assert fn is not None
    seen = []

    def analyzer(data):
        seen.append(data.steps.groupby("rank")["step"].agg(["min", "max"]))
        return fn(data)

    h = Head(tmp_path / "store", TOKEN, analyzer=analyzer, window=512, analyze_window=48)
    try:
        rs, live = h.store.run("r1"), h.live.run("r1")
        t0 = time.time() - 100
        onset = 20
        firsts = []
        for s0 in range(0, 240, 24):
            live.add("steps", rs.add("steps", _straggler_rows(s0, s0 + 24, t0, onset)))
            h.analysis.analyze_once("r1")
            eps = [f for f in h.analysis.findings["r1"].current() if f.kind == "straggler" and f.ranks == [2]]
            if eps:
                firsts.append(eps[0].step_start)
        assert h.stats["analyzer_errors"] == 0
        # every round saw only the last 48 steps of each rank ...
        assert all((m["max"] - m["min"] + 1 <= 48).all() for m in seen)
        assert seen[-1]["min"].min() == 240 - 48
        # ... and the straggler stays one episode whose onset is the one first seen, near the injected step,
        # long after that step left the analysis window
        eps = [f for f in h.analysis.findings["r1"].current() if f.kind == "straggler" and 2 in f.ranks]
        assert len(eps) == 1, [(f.kind, f.ranks, f.step_start, f.step_end) for f in h.analysis.findings["r1"].current()]
        assert eps[0].step_start is not None and onset <= eps[0].step_start < onset + 24
        assert eps[0].step_end >= 230 and eps[0].status == "open"
        assert len(set(firsts)) == 1  # the onset never moved
    finally:
        h.close()


def test_rounds_are_skipped_when_nothing_new_arrived(tmp_path):
    calls = []
    h = Head(tmp_path / "store", TOKEN, analyzer=lambda data: calls.append(len(data.steps)) or [], idle_recheck=15.0)
    try:
        rs, live = h.store.run("r1"), h.live.run("r1")
        assert h.analysis.analyze_if_due("r1", now=0.0) is False and calls == []  # no data yet
        live.add("steps", rs.add("steps", [_step(r, 0, 1000.0) for r in range(4)]))
        assert h.analysis.analyze_if_due("r1", now=1.0) is True
        assert h.analysis.analyze_if_due("r1", now=6.0) is False  # nothing new
        # GPU/host samples and heartbeats alone do not make a round
        live.add("host", [schema.HostSample(node=0, host="n0", t=1001.0, cpu_pct=5.0, load1=0.1, mem_used_bytes=1,
                                            mem_total_bytes=2, net_rx_bytes=0, net_tx_bytes=0,
                                            disk_read_bytes=0, disk_write_bytes=0)])
        assert h.analysis.analyze_if_due("r1", now=11.0) is False
        # a quiet run is still looked at every idle_recheck seconds (the live hang check needs it)
        assert h.analysis.analyze_if_due("r1", now=16.5) is True
        assert h.analysis.analyze_if_due("r1", now=21.0) is False
        # each kind of new row makes a round due at once
        live.add("collectives", rs.add("collectives", [schema.CollectiveRecord(
            run_id="r1", rank=0, step=0, seq=0, op="all_reduce", group="dp", nbytes=8, t_arrive=1000.0,
            t_done=1000.1, duration_ms=100.0)]))
        assert h.analysis.analyze_if_due("r1", now=22.0) is True
        live.add("events", [schema.EventRecord(run_id="r1", rank=1, step=0, t=1000.2, event="exit")])
        assert h.analysis.analyze_if_due("r1", now=23.0) is True
        live.add("steps", rs.add("steps", [_step(r, 1, 1000.0) for r in range(4)]))
        assert h.analysis.analyze_if_due("r1", now=24.0) is True
        # a finished run with nothing new is not looked at again
        live.manifest = schema.Manifest(run_id="r1", created=0, start_time=0, finished=1001.0)
        assert h.analysis.analyze_if_due("r1", now=25.0) is True  # the manifest changed
        assert h.analysis.analyze_if_due("r1", now=100.0) is False
        assert len(calls) == 6 and calls[-1] == 8
        assert h.stats["analysis_rounds"] == 6 and h.stats["analysis_skipped"] == 4
        live.manifest = msgspec.structs.replace(live.manifest)  # re-read manifest object: a round again
        assert h.analysis.analyze_if_due("r1", now=101.0) is True
    finally:
        h.close()


def test_a_run_whose_ranks_all_exited_is_not_looked_at_again(tmp_path):
    """No manifest (a user's own loop): once every rank wrote its exit event, the clock alone makes no round."""
    calls = []
    h = Head(tmp_path / "store", TOKEN, analyzer=lambda data: calls.append(len(data.steps)) or [], idle_recheck=15.0)
    try:
        rs, live = h.store.run("r2"), h.live.run("r2")
        live.add("steps", rs.add("steps", [_step(r, 0, 1000.0) for r in range(2)]))
        assert h.analysis.analyze_if_due("r2", now=1.0) is True
        live.add("events", [schema.EventRecord(run_id="r2", rank=0, step=0, t=1000.2, event="exit", detail={"reason": "finished"})])
        assert h.analysis.analyze_if_due("r2", now=2.0) is True
        assert h.analysis.analyze_if_due("r2", now=30.0) is True  # rank 1 has not exited: the hang check looks again
        live.add("events", [schema.EventRecord(run_id="r2", rank=1, step=0, t=1000.3, event="exit", detail={"reason": "finished"})])
        assert h.analysis.analyze_if_due("r2", now=31.0) is True  # the exit event itself is new data
        assert live.ended() == "finished"
        assert h.analysis.analyze_if_due("r2", now=100.0) is False and len(calls) == 4
    finally:
        h.close()
