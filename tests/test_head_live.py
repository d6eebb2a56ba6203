"""The head's live side: liveness states, the analyzers hook (custom and the real analyzers.run_all), findings API."""

import threading
import time

from head.api import make_server
from head.service import Head, resolve_analyzers
from analyzers.loader import RunData
from head.live import RunLive
from ranksight.tables import read_table
from agent_helpers import TOKEN, http_json
from ranksight import schema


def step(rank, s, t_end, step_ms=100.0, run_id="r1", comm_ms=10.0, compute_ms=None):
    return schema.StepRecord(run_id=run_id, rank=rank, step=s, node=rank // 2, host=f"n{rank // 2}", world_size=4,
                             t_start=t_end - step_ms / 1000, t_end=t_end, step_ms=step_ms, comm_ms=comm_ms,
                             compute_ms=step_ms - comm_ms if compute_ms is None else compute_ms, tokens=100)


def test_rank_liveness_states():
    live = RunLive("r1")
    now = 1000.0
    live.manifest = schema.Manifest(run_id="r1", created=0, start_time=0, ranks=[
        schema.RankPlacement(rank=r, node=r // 2, host="h", local_rank=r % 2, pp_stage=0, dp_rank=r, tp_rank=0)
        for r in range(4)])
    live.add("steps", [step(0, s, 900 + s) for s in range(10)], now=now - 1)  # fresh
    live.add("steps", [step(1, s, 900 + s) for s in range(5)], now=now - 60)  # silent for a minute
    live.add("events", [schema.EventRecord(run_id="r1", rank=2, step=3, t=990, event="exit")], now=now - 60)
    states = {r["rank"]: r for r in live.rank_states(now=now)}
    assert states[0]["state"] == "running" and states[0]["step"] == 9
    assert states[1]["state"] == "stalled" and states[1]["age_s"] == 60
    assert states[2]["state"] == "finished"
    assert states[3]["state"] == "waiting" and states[3]["step"] is None
    assert [s.step for s in live.steps_since(7, rank=0)] == [8, 9]


def test_analyzer_hook_stores_new_findings_once_and_serves_them(tmp_path):
    calls = []

    def analyzer(data):
        calls.append(data)
        st = data.steps
        slow = sorted(int(r) for r in st[st["step_ms"] > 150]["rank"].unique())
        return [schema.Finding(analyzer="test", kind="straggler", severity="warning", ranks=slow,
                               evidence={"n": len(st)}, summary=f"ranks {slow} slow")] if slow else []

    h = Head(tmp_path / "store", TOKEN, analyzer=analyzer)
    srv = make_server(h, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        rs = h.store.run("r1")
        rows = [step(r, s, 100 + s, step_ms=300.0 if r == 3 else 100.0) for s in range(5) for r in range(4)]
        h.live.run("r1").add("steps", rs.add("steps", rows))
        got = h.analysis.analyze_once("r1")
        assert [(f.kind, f.ranks, f.run_id) for f in got] == [("straggler", [3], "r1")]
        assert h.analysis.analyze_once("r1") == []  # the same finding is not stored twice
        heard = []
        h.analysis.finding_listeners += [lambda fs: 1 / 0, heard.extend]  # a failing listener does not stop the others
        h.live.run("r1").add("steps", rs.add("steps", [step(1, 9, 200, step_ms=400.0)]))
        assert [f.ranks for f in h.analysis.analyze_once("r1")] == [[1, 3]] and [f.ranks for f in heard] == [[1, 3]]
        assert isinstance(calls[0], RunData) and calls[0].source == "live" and calls[0].now is not None
        assert len(calls[0].steps) == 20 and calls[0].run_id == "r1"
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert [f["summary"] for f in http_json(url + "/api/runs/r1/findings")[1]] == ["ranks [3] slow", "ranks [1, 3] slow"]
        h.store.flush_all()
        df = read_table(h.store.root, "r1", "findings")
        assert list(df["kind"]) == ["straggler"] * 2 and list(df["ranks"].iloc[0]) == [3]
        # a broken analyzer is counted and logged; ingestion is not affected
        h.analysis.analyzer = lambda data: 1 / 0
        assert h.analysis.analyze_once("r1") == [] and h.stats["analyzer_errors"] == 1
    finally:
        srv.shutdown()
        srv.server_close()
        h.close()


def test_real_analyzers_run_on_the_live_window(tmp_path):
    fn = resolve_analyzers()
    assert fn is not None, "analyzers.run_all should be importable"
    h = Head(tmp_path / "store", TOKEN, analyzer=fn)
    try:
        t0 = time.time() - 100
        rows = []
        for s in range(60):
            for r in range(4):
                # rank 2 computes 1.6x longer; the others wait for it in the gradient sync
                compute = 160.0 if r == 2 else 100.0
                comm = 5.0 if r == 2 else 65.0
                rows.append(schema.StepRecord(
                    run_id="r1", rank=r, step=s, node=r // 2, host=f"n{r // 2}", world_size=4, dp_rank=r,
                    t_start=t0 + s * 0.2, t_end=t0 + s * 0.2 + 0.17, step_ms=170.0, compute_ms=compute, comm_ms=comm,
                    forward_ms=compute / 3, backward_ms=2 * compute / 3, sync_arrival=t0 + s * 0.2 + compute / 1000,
                    sync_wait_ms=comm, tokens=1000))
        h.live.run("r1").add("steps", h.store.run("r1").add("steps", rows))
        found = h.analysis.analyze_once("r1")
        assert h.stats["analyzer_errors"] == 0
        assert any(f.kind == "straggler" and 2 in f.ranks for f in found), [(f.kind, f.ranks, f.summary) for f in found]
    finally:
        h.close()


def test_a_live_finding_grows_and_closes_as_one_episode(tmp_path):
    # the analyzer reports rank 3 slow from step 2 up to the newest slow step it sees, each round
    def analyzer(data):
        st = data.steps
        slow = st[(st["rank"] == 3) & (st["step_ms"] > 150)]
        if slow.empty:
            return []
        return [schema.Finding(analyzer="test", kind="straggler", severity="critical" if slow["step"].max() >= 6 else "warning",
                               ranks=[3], nodes=[0], step_start=2, step_end=int(slow["step"].max()), summary="rank 3 slow")]

    h = Head(tmp_path / "store", TOKEN, analyzer=analyzer)
    heard = []
    h.analysis.finding_listeners.append(heard.extend)
    try:
        rs, live = h.store.run("r1"), h.live.run("r1")

        def steps(s0, s1, slow):
            live.add("steps", rs.add("steps", [step(r, s, 100 + s, step_ms=300.0 if (r == 3 and slow) else 100.0)
                                               for s in range(s0, s1) for r in range(4)]))

        steps(0, 2, False)
        steps(2, 4, True)
        (first,) = h.analysis.analyze_once("r1")
        assert (first.step_end, first.status) == (3, "open") and first.id
        steps(4, 7, True)
        assert h.analysis.analyze_once("r1") == []  # not new: the same episode, grown and escalated
        (cur,) = h.analysis.findings_of("r1")
        assert (cur["id"], cur["step_end"], cur["severity"], cur["status"]) == (first.id, 6, "critical", "open")
        assert [f.severity for f in heard] == ["warning", "critical"]  # the escalation is alerted once more
        steps(7, 15, False)  # rank 3 recovered; the run goes on
        h.analysis.analyze_once("r1")
        (cur,) = h.analysis.findings_of("r1")
        assert cur["status"] == "closed" and cur["step_end"] == 6
        h.store.flush_all()
        df = read_table(h.store.root, "r1", "findings")
        assert set(df["id"]) == {first.id} and len(df) >= 3  # append-only: each state of the episode
        h.analysis.findings.clear()  # a restarted head reads the current state back from the store
        (back,) = h.analysis.findings_of("r1")
        assert (back["id"], back["status"], back["severity"]) == (first.id, "closed", "critical")
    finally:
        h.close()
