"""A restarted head shows a stored run as it did before (head/history.py): the live window is filled from the store's
newest part files, each rank's last steps and the run's recent samples and events, with liveness from the records'
own times; and the live analysis does not judge that history (a dead run's silence is no hang) until new records
arrive or the run's agents have been heartbeating for a while."""

from __future__ import annotations

import time

from agent_helpers import TOKEN
from head import history
from head.analysis import resolve_analyzers
from head.live import RunLive
from head.service import Head
from ranksight import schema, wire

RUN = "r"
T0 = 1_700_000_000.0  # the records' own clock: long before the test runs


def _step(rank: int, s: int) -> schema.StepRecord:
    t_end = T0 + s * 0.5
    return schema.StepRecord(run_id=RUN, rank=rank, step=s, node=rank // 2, host=f"h{rank // 2}", world_size=4,
                             t_start=t_end - 0.5, t_end=t_end, step_ms=500.0, compute_ms=400.0, comm_ms=90.0,
                             sync_wait_ms=5.0)


def _gpu(node: int, gpu: int, t: float) -> schema.GpuSample:
    return schema.GpuSample(node=node, host=f"h{node}", gpu=gpu, t=t, source="simulated-nvml", simulated=True,
                            name="sim", util_pct=90.0, sm_clock_mhz=1400.0, max_sm_clock_mhz=1410.0)


def _feed(h: Head, steps: range, ranks=range(4), exit_ranks=()) -> None:
    rs, live = h.store.run(RUN), h.live.run(RUN)
    for s in steps:
        rows = [_step(rank, s) for rank in ranks]
        live.add("steps", rs.add("steps", rows), now=T0 + s * 0.5)
    last = steps[-1]
    gpus = [_gpu(n, g, T0 + last * 0.5 - k) for k in range(5) for n in range(2) for g in range(2)]
    live.add("gpu", rs.add("gpu", gpus), now=T0 + last * 0.5)
    ev = [schema.EventRecord(run_id=RUN, rank=r, step=last, t=T0 + last * 0.5 + 0.1, event="exit",
                             detail={"reason": "finished"}) for r in exit_ranks]
    if ev:
        live.add("events", rs.add("events", ev), now=T0 + last * 0.5)


def _head(store, window: int = 16, analyzer="auto") -> Head:
    return Head(store, TOKEN, window=window, analyzer=resolve_analyzers() if analyzer == "auto" else analyzer)


def _restarted(tmp_path, steps: range, **feed) -> Head:
    """A head that stored ``steps`` of the run and stopped, and a new head on the same store (the caller closes it)."""
    h = _head(tmp_path / "store")
    try:
        _feed(h, steps, **feed)
    finally:
        h.close()
    return _head(tmp_path / "store")


def test_a_restarted_head_serves_the_stored_run_s_last_steps_per_rank(tmp_path):
    h = _restarted(tmp_path, range(1, 41))
    try:
        live = h.live.run(RUN)
        steps = live.steps_since(-1, limit=10_000)
        by_rank: dict[int, list[int]] = {}
        for r in steps:
            by_rank.setdefault(r["rank"] if isinstance(r, dict) else r.rank, []).append(
                r["step"] if isinstance(r, dict) else r.step)
        assert sorted(by_rank) == [0, 1, 2, 3]
        for got in by_rank.values():  # the window's 16 newest steps of each rank, nothing older
            assert sorted(got) == list(range(25, 41))
        states = {s["rank"]: s for s in live.rank_states(now=T0 + 20 + 3600)}
        assert {s["step"] for s in states.values()} == {40}
        # last seen when its last step ended (T0 + 20 s), not when the head read it back
        assert all(abs(s["last_seen"] - (T0 + 20.0)) < 1e-6 for s in states.values())
        assert {s["state"] for s in states.values()} == {"stalled"}
        summary = {r["run_id"]: r for r in h.live.summary()}[RUN]
        assert summary["last_step"] == 40 and summary["ranks_live"] == 4
        assert summary["status"] == "stopped"
        assert len(live.gpu_latest()) == 4  # each GPU's newest sample is back
    finally:
        h.close()


def test_the_restored_history_of_a_dead_run_raises_no_live_hang(tmp_path):
    h = _restarted(tmp_path, range(1, 31))
    try:
        live = h.live.run(RUN)
        h.analysis.clock = lambda: T0 + 15 + 3600.0  # an hour after the last step: silent by any threshold
        assert h.analysis.analyze_if_due(RUN) is False
        assert h.analysis.findings_of(RUN) == []
        # what would have happened: the same window judged live is a hang of the whole job
        found = h.analysis.analyzer(live.run_data(16, now=T0 + 15 + 3600.0))
        assert any(f.kind == "hang" for f in found)
    finally:
        h.close()


def test_new_records_make_a_restored_run_live_again(tmp_path):
    h = _restarted(tmp_path, range(1, 31))
    try:
        live = h.live.run(RUN)
        assert not history.analysis_due(live)
        _feed(h, range(31, 33))
        assert history.analysis_due(live) and live.restored_mark is None
        h.analysis.clock = lambda: T0 + 16.5
        assert h.analysis.analyze_if_due(RUN) is True
        assert not [f for f in h.analysis.findings_of(RUN) if f["kind"] == "hang"]
    finally:
        h.close()


def test_a_run_whose_agents_heartbeat_is_judged_after_the_grace(tmp_path):
    h = _restarted(tmp_path, range(1, 31))
    try:
        live = h.live.run(RUN)
        now = time.monotonic()
        assert not history.analysis_due(live, now + history.HISTORY_GRACE_S + 1)  # no agent: a dead run
        live.heartbeat(wire.Heartbeat(node=0, host="h0", t=time.time(), url=""))
        assert not history.analysis_due(live, now)  # the agents' backlog may still be on its way
        assert history.analysis_due(live, now + history.HISTORY_GRACE_S + 1)
    finally:
        h.close()


def test_exit_events_are_restored_so_a_finished_run_reads_finished(tmp_path):
    h = _restarted(tmp_path, range(1, 11), exit_ranks=range(4))
    try:
        assert h.live.run(RUN).ended() == "finished"
        assert {r["run_id"]: r for r in h.live.summary()}[RUN]["status"] == "finished"
    finally:
        h.close()


def test_a_damaged_part_file_is_skipped_and_counted(tmp_path):
    h = _head(tmp_path / "store")
    try:
        _feed(h, range(1, 21))
    finally:
        h.close()
    (part,) = sorted((tmp_path / "store" / RUN / "steps").rglob("*.parquet"))
    (part.parent / "zz-newest.parquet").write_bytes(b"PAR1 not a parquet file")  # read first: the newest name
    live = RunLive(RUN, 16)
    got = history.restore_window(live, tmp_path / "store", RUN)
    assert got.bad_files == 1
    assert live.max_step() == 20 and got.rows["steps"] == 4 * 16  # the good part's steps are all there
    h = _head(tmp_path / "store", analyzer=None)
    try:
        assert h.live.run(RUN).max_step() == 20  # and the head itself did not fail on it
    finally:
        h.close()


def test_a_new_run_reads_nothing_back(tmp_path):
    h = _head(tmp_path / "store", analyzer=None)
    try:
        live = h.live.run("fresh")
        assert live.restored_mark is None and live.max_step() is None
    finally:
        h.close()


def test_the_runs_list_shows_a_stored_run_s_progress_before_anything_opens_it(tmp_path):
    h = _restarted(tmp_path, range(1, 41))
    try:
        summary = {r["run_id"]: r for r in h.live.summary()}[RUN]
        # from the steps files' footers; the run's window is still not built (the restore stays lazy)
        assert summary["last_step"] == 40 and summary["steps_stored"] == 160
        assert RUN not in h.live.runs and summary["ranks_live"] == 0
        assert summary["status"] == "stopped"
    finally:
        h.close()


def test_a_damaged_steps_file_leaves_a_stored_run_s_progress_unknown(tmp_path):
    h = _restarted(tmp_path, range(1, 11))
    h.close()
    steps_dir = tmp_path / "store" / RUN / "steps"
    part = next(p for p in sorted(steps_dir.rglob("*.parquet")))
    part.write_bytes(b"PAR1 not a footer")
    h = _head(tmp_path / "store")
    try:
        summary = {r["run_id"]: r for r in h.live.summary()}[RUN]
        assert summary["last_step"] is None and summary["steps_stored"] is None  # unknown, never a guess
    finally:
        h.close()
