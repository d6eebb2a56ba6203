"""Honest failure modes: checks that could not run say so, a finished run is finished (never a hang), a run without
a manifest still gets its world size, nodes and peak, a single-node job is never told to evict its node, and
diagnose's exit codes cannot be taken for a usage error."""

from __future__ import annotations

import json

import pytest
from analyzer_fixtures import T0, build, gpu_samples, step_time, with_records, write_run
from typer.testing import CliRunner

import analyzers
from analyzers.builder import build_frame
from analyzers.checks import gpu_health, hang
from cli.diagnose import diagnose_command
from analyzers.loader import RunData
from analyzers.policy import EvictPolicy, PolicyConfig
from analyzers.report.model import (EXIT_CRITICAL, EXIT_HEALTHY, EXIT_INCOMPLETE, EXIT_LOAD_ERROR, EXIT_WARNING,
                                    build_report)
from head.live import RunLive
from head.policy_runner import PolicyRunner
from head.service import Head
from ranksight.schema import (CollectiveRecord, EventRecord, Finding, Manifest, RankPlacement, StepRecord, XidEvent,
                               encode)

EXIT_CODES = (EXIT_HEALTHY, EXIT_INCOMPLETE, EXIT_WARNING, EXIT_CRITICAL, EXIT_LOAD_ERROR)


def diagnose(store, run_id, *extra):
    r = CliRunner().invoke(diagnose_command, [run_id, "--store", str(store), *extra])
    return r.exit_code, r.output


def step_ms_only_run(store, run_id="plain", sleeper=2, world=4, steps=30):
    """The README's old route: each rank writes StepRecord lines with step_ms and nothing else. Rank ``sleeper``
    sleeps 50 ms per step; under synchronous training the others wait for it inside the gradient all-reduce, so
    every rank's step takes the same 150 ms."""
    spool = store / run_id / "spool"
    spool.mkdir(parents=True)
    t = T0
    lines: dict[int, list[bytes]] = {r: [] for r in range(world)}
    for s in range(steps):
        step_ms = 100.0 + 50.0
        for r in range(world):
            lines[r].append(encode(StepRecord(run_id=run_id, rank=r, step=s, node=0, host="h", world_size=world,
                                              t_start=t, t_end=t + step_ms / 1000, step_ms=step_ms)))
        t += step_ms / 1000
    for r, ls in lines.items():
        (spool / f"rank-{r}.jsonl").write_bytes(b"\n".join(ls) + b"\n")


def coverage_of(obj: dict) -> dict[str, dict]:
    return {c["check"]: c for c in obj["coverage"]}


# --------------------------------------------------------------------------
# Checks that could not run
# --------------------------------------------------------------------------


def test_step_ms_only_records_are_incomplete_not_healthy(tmp_path):
    step_ms_only_run(tmp_path)
    code, out = diagnose(tmp_path, "plain", "--json")
    obj = json.loads(out)
    assert code == EXIT_INCOMPLETE and obj["exit_code"] == EXIT_INCOMPLETE
    assert obj["verdict"].startswith("INCOMPLETE") and "HEALTHY" not in obj["verdict"]
    cov = coverage_of(obj)
    assert set(cov) == set(analyzers.ANALYZERS)
    st = cov["stragglers"]
    assert (st["ran"], st["status"]) == (False, "not_run")
    assert "no sync arrival or compute split" in st["reason"] and "ranksight.init" in st["reason"]
    for name in ("stragglers", "comm", "data_stall", "memory_pressure", "fp16", "gpu_health"):
        assert name in obj["checks_not_run"], name
    assert f"{len(obj['checks_not_run'])} of {len(cov)} checks could not run" in obj["verdict"]
    assert cov["mfu"]["status"] == "limited" and "no flops" in cov["mfu"]["reason"]
    assert cov["pipeline"]["status"] == "not_applicable"
    # the text report lists them, with the reason, and says what to do
    code, text = diagnose(tmp_path, "plain")
    assert code == EXIT_INCOMPLETE
    assert "Checks that could not run" in text and "stragglers: could not run" in " ".join(text.split())
    assert "Nothing to fix" not in text


def test_html_lists_the_checks_that_could_not_run(tmp_path):
    step_ms_only_run(tmp_path)
    page = tmp_path / "r.html"
    code, _ = diagnose(tmp_path, "plain", "--html", str(page))
    text = page.read_text()
    assert code == EXIT_INCOMPLETE
    assert "Checks that could not run" in text and "no sync arrival or compute split" in text


def test_a_fully_instrumented_clean_run_is_healthy():
    data = build(world=4, steps=30, device_time=True)
    cov: list = []
    findings = analyzers.run_all(data, coverage=cov)
    report = build_report(data, findings, [], cov)
    s = report.summary
    assert s["verdict"].startswith("HEALTHY") and s["exit_code"] == EXIT_HEALTHY and s["checks_not_run"] == []
    by = {c["check"]: c for c in s["coverage"]}
    assert by["stragglers"]["status"] == "ran" and by["comm"]["status"] == "ran" and by["mfu"]["status"] == "ran"
    assert by["gpu_health"]["status"] == "not_applicable"  # a CPU run without GPU samples
    assert by["pipeline"]["status"] == "not_applicable"


def test_compute_without_arrival_runs_with_a_limit():
    data = build(world=4, steps=30, device_time=True, compute_factor=lambda r, s: 1.5 if (r == 1 and s >= 10) else 1.0)
    st = data.steps.assign(sync_arrival=float("nan"))
    data = RunData(run_id="synth", manifest=data.manifest, steps=st)  # no collectives either
    (cov,) = [c for c in analyzers.check_coverage(data) if c.check == "stragglers"]
    assert cov.status == "limited" and "no sync arrival timing" in cov.reason
    assert [f.ranks for f in analyzers.run_all(data) if f.kind == "straggler" and f.severity != "info"] == [[1]]


def test_a_warning_verdict_still_says_which_checks_could_not_run():
    data = build(world=4, steps=30, compute_factor=lambda r, s: 1.5 if (r == 1 and s >= 10) else 1.0)
    data = RunData(run_id="synth", manifest=data.manifest, steps=data.steps.assign(data_ms=0.0),
                   collectives=data.collectives)
    cov: list = []
    report = build_report(data, analyzers.run_all(data, coverage=cov), [], cov)
    s = report.summary
    assert s["exit_code"] == EXIT_WARNING and s["verdict"].startswith("WARNING")
    assert s["checks_not_run"] == ["data_stall"] and "1 of 10 checks could not run (data_stall)" in s["verdict"]


def test_a_check_that_raises_could_not_run(monkeypatch):
    from analyzers.checks import CHECKS

    def boom(frame, cfg=None):
        raise RuntimeError("broken")

    monkeypatch.setattr(CHECKS["comm"], "analyze", boom)
    data = build(world=4, steps=30, device_time=True)
    cov, errors = [], []
    report = build_report(data, analyzers.run_all(data, errors=errors, coverage=cov), errors, cov)
    (c,) = [c for c in cov if c.check == "comm"]
    assert c.status == "error" and "broken" in c.reason and not c.ran
    assert report.summary["exit_code"] == EXIT_INCOMPLETE and report.summary["checks_not_run"] == ["comm"]


# --------------------------------------------------------------------------
# Exit codes
# --------------------------------------------------------------------------


def test_exit_codes_are_distinct_from_click_and_documented(tmp_path):
    assert len(set(EXIT_CODES)) == len(EXIT_CODES)
    assert not {1, 2} & set(EXIT_CODES)  # click: 1 an uncaught exception or abort, 2 a usage error
    r = CliRunner().invoke(diagnose_command, ["--help"])
    assert r.exit_code == 0
    helptext = " ".join(r.output.split())
    for code, word in ((EXIT_INCOMPLETE, "incomplete"), (EXIT_WARNING, "warnings"), (EXIT_CRITICAL, "critical"),
                       (EXIT_LOAD_ERROR, "the input could not be read")):
        assert f"{code} {word}" in helptext, (code, helptext)
    usage = CliRunner().invoke(diagnose_command, ["x", "--no-such-option"])
    assert usage.exit_code == 2 and usage.exit_code not in EXIT_CODES
    assert diagnose(tmp_path, "missing")[0] == EXIT_LOAD_ERROR


# --------------------------------------------------------------------------
# Lifecycle: a finished run is finished
# --------------------------------------------------------------------------


def exits(data: RunData, reason: str = "finished", ranks=None) -> list[EventRecord]:
    last = data.steps.groupby("rank").agg(step=("step", "max"), t=("t_end", "max"))
    return [EventRecord(run_id=data.run_id, rank=int(r), step=int(row["step"]), t=float(row["t"]) + 0.5, event="exit",
                        detail={"reason": reason, "step": int(row["step"])})
            for r, row in last.iterrows() if ranks is None or int(r) in ranks]


def test_a_run_whose_ranks_exited_finished_is_not_a_hang_post_mortem():
    # the manifest was never marked finished (rank 0's last write lost), but every rank said goodbye
    data = build(world=4, steps=12, finished=False)
    data.manifest.config["steps"] = 100  # planned longer than it ran: without the exits, "ended early"
    assert [f.evidence["cause"] for f in hang.analyze(build_frame(data))] == ["ended_early"]
    done = with_records(data, exits(data))
    assert hang.finished_run(done)
    assert hang.analyze(build_frame(done)) == []
    # an op the ranks never waited on before their clean exit (an async op recorded at arrival) is not stuck
    t = float(data.steps["t_end"].max())
    unwaited = [CollectiveRecord(run_id="synth", rank=r, step=11, seq=99, op="all_reduce", group="dp",
                                 group_ranks=[0, 1, 2, 3], t_arrive=t + 0.1) for r in (0, 1)]
    assert hang.analyze(build_frame(with_records(done, unwaited))) == []
    assert hang.analyze(build_frame(with_records(data, unwaited)))[0].evidence["missing_ranks"] == [2, 3]


def test_a_finished_run_is_never_a_live_hang():
    data = build(world=4, steps=12, finished=False)
    done = with_records(data, exits(data))
    later = float(data.steps["t_end"].max()) + 600.0
    live = RunData(run_id="synth", manifest=data.manifest, steps=done.steps, collectives=done.collectives,
                   events=done.events, now=later)
    assert [f for f in analyzers.run_all(live) if f.kind == "hang"] == []
    # without the exits the whole job is silent, and the finding says how a run records its end
    quiet = RunData(run_id="synth", manifest=data.manifest, steps=data.steps, collectives=data.collectives, now=later)
    (f,) = [f for f in analyzers.run_all(quiet) if f.kind == "hang"]
    assert "whole job is silent" in f.summary and "rs.finish()" in f.summary
    # a rank that finished early is not silent; the one still running but quiet is
    three = with_records(data, exits(data, ranks=[0, 1, 2])).events
    part = RunData(run_id="synth", manifest=data.manifest, steps=data.steps, events=three, now=later)
    (f,) = [f for f in hang.analyze(build_frame(part))]
    assert f.ranks == [3]


def test_an_exit_before_the_ranks_later_steps_is_an_earlier_attempts():
    data = build(world=2, steps=12, finished=False)
    t_mid = step_time(data, 5)[1]
    crash = [EventRecord(run_id="synth", rank=r, step=5, t=t_mid, event="exit", detail={"reason": "RuntimeError: x"})
             for r in (0, 1)]
    d = with_records(data, crash)
    assert hang.ended_ranks(d) == {}  # both ran steps 6-11 after it: a restarted job
    assert not hang.finished_run(d)


def live_run(run_id="r1", world=4, steps=10, t0=1000.0, node_of=lambda r: 0):
    live = RunLive(run_id)
    for s in range(steps):
        live.add("steps", [StepRecord(run_id=run_id, rank=r, step=s, node=node_of(r), host=f"n{node_of(r)}",
                                      world_size=world, t_start=t0 + s, t_end=t0 + s + 0.9, step_ms=900.0,
                                      compute_ms=800.0, comm_ms=100.0) for r in range(world)], now=t0 + s + 1)
    return live


def test_live_window_knows_how_the_run_ended():
    live = live_run()
    assert live.ended() is None
    live.add("events", [EventRecord(run_id="r1", rank=r, step=9, t=1010.0, event="exit", detail={"reason": "finished"})
                        for r in range(3)], now=1011.0)
    assert live.ended() is None  # rank 3 has not exited
    live.add("events", [EventRecord(run_id="r1", rank=3, step=9, t=1010.0, event="exit",
                                    detail={"reason": "ValueError: bad batch"})], now=1011.0)
    assert live.ended() == "failed"
    states = {s["rank"]: s for s in live.rank_states(now=1100.0)}
    assert states[3]["state"] == "finished" and states[3]["exit_reason"] == "ValueError: bad batch"
    # the job restarts: rank 3's new steps come after its exit, so it runs again
    live.add("steps", [StepRecord(run_id="r1", rank=3, step=10, node=0, host="n0", world_size=4, attempt=1,
                                  t_start=1020.0, t_end=1020.9, step_ms=900.0)], now=1021.0)
    assert live.ended() is None
    # an exit event older than the rank's last step (an earlier attempt's, shipped late) is not its end
    late = EventRecord(run_id="r1", rank=3, step=9, t=1012.0, event="exit", detail={"reason": "finished"})
    live.add("events", [late])
    assert live.ended() is None


def test_runs_summary_finished_from_exit_events_and_world_without_manifest(tmp_path):
    h = Head(tmp_path / "store", "tok", analyzer=None)
    try:
        live = h.live.run("r1")
        src = live_run(world=4, node_of=lambda r: r // 2)
        for t in src._steps:
            live.add_arrow("steps", t)
        samples = gpu_samples(build(world=2, steps=3), simulated=False)[:2]
        for g in samples:
            g.name = "NVIDIA H100 80GB HBM3"
        live.add("gpu", samples)
        (run,) = h.live.summary()
        assert run["status"] == "running"
        assert (run["world_size"], run["nodes"]) == (4, 2)
        assert run["peak_flops"] == 989e12 and "H100" in run["peak_source"] and run["device"] == "cuda"
        live.add("events", [EventRecord(run_id="r1", rank=r, step=9, t=2000.0, event="exit",
                                        detail={"reason": "finished"}) for r in range(4)])
        assert h.live.summary()[0]["status"] == "finished"
    finally:
        h.close()


# --------------------------------------------------------------------------
# A run without a manifest
# --------------------------------------------------------------------------


def no_manifest(data: RunData, records: list | None = None) -> RunData:
    d = with_records(data, records or [])
    return RunData(run_id=d.run_id, steps=d.steps, collectives=d.collectives, gpu=d.gpu, xid=d.xid)


def test_without_a_manifest_world_nodes_and_peak_come_from_the_records():
    data = build(world=4, nodes=2, steps=20, device_time=True)
    samples = gpu_samples(data, simulated=False)
    for g in samples:
        g.name = "NVIDIA A100-SXM4-80GB"
    d = no_manifest(data, samples)
    report = build_report(d, analyzers.run_all(d))
    s = report.summary
    assert s["world_size"] == 4 and s["nodes"] == [0, 1] and s["layout"]["world"] == 4 and s["layout"]["dp"] == 4
    assert "A100" in s["peak"]
    assert s["mfu_median"] == pytest.approx(float(report.over_time["tflops"].median()) / 312, rel=1e-3)
    assert report.compute_label == "device time"  # a real GPU: not the simulated device's CPU time


@pytest.mark.parametrize("simulated,name,why", [(True, "Simulated H100", "simulated"),
                                                (False, "Mystery Accelerator 9000", "not in the peak table"),
                                                (None, "", "no manifest")])
def test_without_a_peak_the_report_says_why_mfu_is_na(simulated, name, why):
    data = build(world=2, steps=20)
    samples = []
    if simulated is not None:
        samples = gpu_samples(data, simulated=simulated)
        for g in samples:
            g.name = name
    s = build_report(no_manifest(data, samples), []).summary
    assert s["peak"].startswith("no peak FLOPs") and "MFU n/a" in s["peak"] and why in s["peak"]
    assert "peak_flops" in s["peak"]  # how to give it
    assert s["mfu_median"] is None


# --------------------------------------------------------------------------
# Evictions respect the job's node count
# --------------------------------------------------------------------------


def straggler_rec(nodes: int) -> str:
    data = build(world=4, nodes=nodes, steps=30, compute_factor=lambda r, s: 1.5 if (r == 3 and s >= 10) else 1.0)
    (f,) = [f for f in analyzers.run_all(data) if f.kind == "straggler" and f.severity != "info"]
    return f.recommendation


def test_a_single_node_job_is_never_told_to_evict_its_node():
    one = straggler_rec(nodes=1)
    assert "evict node" not in one and "no node to evict" in one
    assert "checkpoint and evict node 1" in straggler_rec(nodes=2)
    data = build(world=2, steps=20)
    t = step_time(data, 5)[0]
    d = with_records(data, [XidEvent(node=0, host="node0", gpu=0, t=t, code=79, source="nvml", simulated=False)])
    (f,) = gpu_health.analyze(build_frame(d))
    assert f.severity == "critical" and "evict" not in f.recommendation.replace("no node to evict", "")


def finding(node: int, ranks: list[int]) -> Finding:
    return Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=ranks, nodes=[node],
                   confidence=0.9, summary=f"node {node} slow", evidence={"cause": "x"})


def test_the_policy_never_evicts_the_last_node_or_an_unknown_one():
    cfg = PolicyConfig(confirm_rounds=1, dry_run=False, min_nodes=0, cooldown_s=0, max_evictions=5)
    one = EvictPolicy("r", {0: [0, 1, 2, 3]}, cfg)
    d = one.observe([finding(0, [3])], now=1.0)
    assert d.actions == [] and d.audit == []
    two = EvictPolicy("r", {0: [0, 1], 1: [2, 3]}, cfg)
    assert len(two.observe([finding(1, [3])], now=1.0).actions) == 1  # leaves node 0
    d = two.observe([finding(0, [1])], now=2.0)  # node 0 is the last one now (min_nodes 0 does not matter)
    assert d.actions == [] and two.node_ranks == {0: [0, 1]}
    unknown = EvictPolicy("r", {-1: [0, 1], 1: [2, 3]}, cfg)  # ranks whose node was not known (-1)
    assert unknown.observe([finding(-1, [0])], now=1.0).actions == []
    assert unknown.observe([finding(1, [2])], now=2.0).actions == []  # one known node: nothing to go on with


def test_the_policy_runner_follows_the_manifests_placement(tmp_path):
    def placed(n_nodes: int) -> Manifest:
        return Manifest(run_id="p", created=0.0, start_time=0.0, nodes=n_nodes, ranks=[
            RankPlacement(rank=r, node=r // (4 // n_nodes), host="h", local_rank=0, pp_stage=0, dp_rank=r, tp_rank=0)
            for r in range(4)])

    h = Head(tmp_path / "s", "tok", analyzer=None)
    try:
        runner = PolicyRunner(h.actions, "dry-run", PolicyConfig(confirm_rounds=1))
        assert runner("p", [finding(0, [3])], placed(1)) == []  # one node: nothing to evict
        (a,) = runner("p", [finding(1, [3])], placed(2))  # the manifest now places the ranks on two nodes
        assert a.node == 1 and a.dry_run
    finally:
        h.close()


def test_write_run_roundtrip_of_a_single_node_straggler(tmp_path):
    # diagnose end to end: the single-node recommendation, and a warning exit code that is not click's
    data = build(world=4, steps=30, compute_factor=lambda r, s: 1.5 if (r == 1 and s >= 10) else 1.0)
    write_run(data, tmp_path, "one")
    code, out = diagnose(tmp_path, "one", "--json")
    obj = json.loads(out)
    assert code == EXIT_WARNING
    (f,) = [f for f in obj["findings"] if f["kind"] == "straggler"]
    assert "evict node" not in f["recommendation"]


def test_the_head_serves_the_live_windows_coverage(tmp_path):
    import threading

    from agent_helpers import TOKEN, http_json

    from head.api import make_server

    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    srv = make_server(h, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/api/runs/r1/coverage"
        h.live.run("r1")
        assert http_json(url)[1] == {"checks": [], "checks_not_run": []}
        src = live_run(world=4)  # step_ms, compute_ms and comm_ms: no data_ms, mem_bytes, loss
        for t in src._steps:
            h.live.run("r1").add_arrow("steps", t)
        status, body = http_json(url)
        assert status == 200
        by = {c["check"]: c for c in body["checks"]}
        assert by["stragglers"]["ran"] and by["data_stall"]["status"] == "not_run"
        assert "data_stall" in body["checks_not_run"] and "stragglers" not in body["checks_not_run"]
    finally:
        srv.shutdown()
        srv.server_close()
        h.close()


def test_exit_reasons_are_read_from_the_stores_json_details():
    # the store's tables and the head's live window keep an event's detail as JSON text
    data = build(world=2, steps=12, finished=False)
    ev = exits(data)
    as_json = RunData.from_records("synth", ev).events.assign(detail=[json.dumps(e.detail) for e in ev])
    done = RunData(run_id="synth", manifest=data.manifest, steps=data.steps, events=as_json)
    assert hang.ended_ranks(done) == {0: "finished", 1: "finished"} and hang.finished_run(done)
    crashed = as_json.assign(detail=[json.dumps({"reason": "RuntimeError: NCCL error"})] * 2)
    d = RunData(run_id="synth", manifest=data.manifest, steps=data.steps, events=crashed)
    (f,) = hang.analyze(build_frame(d))
    assert f.evidence["cause"] == "crashed" and "NCCL error" in f.summary


@pytest.mark.parametrize("exited", [True, False])
def test_a_run_that_ends_normally_is_not_a_live_hang_a_minute_later(tmp_path, exited):
    """Through the head: steps, an op the ranks never waited on before they finished, and (or not) their exit
    events; two minutes later, the live analysis."""
    import time

    from head.service import resolve_analyzers

    h = Head(tmp_path / "store", "tok", analyzer=resolve_analyzers())
    try:
        t0 = time.time() - 300
        rows = []
        for s in range(30):
            for r in range(4):
                rows.append(StepRecord(run_id="r1", rank=r, step=s, node=0, host="n0", world_size=4, dp_rank=r,
                                       t_start=t0 + s * 0.2, t_end=t0 + s * 0.2 + 0.17, step_ms=170.0, compute_ms=100.0,
                                       comm_ms=70.0, sync_arrival=t0 + s * 0.2 + 0.1, sync_wait_ms=60.0, tokens=1000))
        end = t0 + 29 * 0.2 + 0.17
        colls = [CollectiveRecord(run_id="r1", rank=r, step=29, seq=1, op="all_reduce", group="dp",
                                  group_ranks=[0, 1, 2, 3], t_arrive=end - 0.01) for r in (0, 1)]
        store, live = h.store.run("r1"), h.live.run("r1")
        live.add("steps", store.add("steps", rows))
        live.add("collectives", store.add("collectives", colls))
        if exited:
            ev = [EventRecord(run_id="r1", rank=r, step=29, t=end + 0.5, event="exit",
                              detail={"reason": "finished", "step": 29}) for r in range(4)]
            live.add("events", store.add("events", ev))
        h.analysis.clock = lambda: end + 120.0
        hangs = [f for f in h.analysis.analyze_once("r1") if f.kind == "hang"]
        status = h.live.summary()[0]["status"]
        if exited:
            assert hangs == [] and status == "finished"
        else:
            assert hangs and {f.severity for f in hangs} == {"critical"} and status != "finished"
    finally:
        h.close()
