"""Issue 14: kernel time from the stored trace summaries reaches straggler detection (analyzers/checks/kernel_time.py),
post-mortem and on the head's live window; one cause stays one finding (analyzers.merge_corroborating)."""

import sys
import threading
from pathlib import Path

from analyzer_fixtures import build, with_records
from agent_helpers import TOKEN

from analyzers import run_all
from analyzers.builder import build_frame
from analyzers.checks import kernel_time
from head.api import make_server
from head.service import Head
from probes.profiler import summarize_trace
from ranksight import schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kineto_synth  # noqa: E402


def summary(rank, compute_ms, comm_ms, s0=10, s1=11, device="cuda", run_id="r", truncated=False, overlap_ms=0.0):
    return schema.TraceSummary(run_id=run_id, rank=rank, step_start=s0, step_end=s1, trace_file=f"/x/rank-{rank}.json",
                               wall_ms=200.0, compute_ms=compute_ms, comm_ms=comm_ms, overlap_ms=overlap_ms,
                               idle_ms=5.0, device=device, truncated=truncated)


def window(kernel, nccl, **kw):
    """Summaries of one 2-step window: ``kernel``/``nccl`` are ms per step per rank."""
    return [summary(r, 2 * k, 2 * n, **kw) for r, (k, n) in enumerate(zip(kernel, nccl))]


def judge(records, **spec):
    data = with_records(build(world=len({r.rank for r in records if hasattr(r, "rank")}) or 4, steps=20, **spec),
                        records)
    return kernel_time.analyze(build_frame(data)), data


def test_the_rank_with_more_kernel_time_whose_peers_wait_in_nccl_is_the_straggler():
    # rank 2: 12 ms of kernels per step against 10; the others wait ~2 ms more in NCCL kernels
    found, _ = judge(window([10.0, 10.1, 12.0, 9.9], [6.0, 5.9, 4.0, 6.1]))
    assert [(f.kind, f.ranks, f.severity) for f in found] == [("straggler", [2], "warning")]
    f = found[0]
    ev = f.evidence
    assert ev["kernel_ms_per_step"] == 12.0 and ev["peers_kernel_ms_median"] == 10.0 and ev["excess_pct"] == 20.0
    assert ev["nccl_ms_per_step"] == 4.0 and ev["peers_nccl_ms_median"] == 6.0 and ev["peers_wait_more_ms"] == 2.0
    assert ev["victims_nccl_ms_per_step"] == {0: 6.0, 1: 5.9, 3: 6.1}
    assert (f.step_start, f.step_end, f.inputs) == (10, 11, ["rank-2.json"])
    assert "12.00 ms of compute kernels per step in steps 10-11, 20% over" in f.summary and "wait 2.00 ms" in f.summary


def test_more_kernel_time_nobody_waits_for_is_info_and_twice_the_peers_is_critical():
    found, _ = judge(window([10.0, 10.0, 12.0, 10.0], [6.0, 6.0, 6.0, 6.0]))
    assert [(f.ranks, f.severity) for f in found] == [([2], "info")] and "do not wait" in found[0].summary
    found, _ = judge(window([10.0, 10.0, 21.0, 10.0], [16.0, 16.0, 5.0, 16.0]))
    assert [(f.ranks, f.severity) for f in found] == [([2], "critical")]


def test_even_ranks_cpu_traces_truncated_traces_and_lone_ranks_give_nothing():
    assert judge(window([10.0, 10.2, 9.9, 10.3], [6.0, 5.8, 6.1, 5.9]))[0] == []  # within 5 %
    cpu, data = judge(window([10.0, 10.0, 20.0, 10.0], [16.0, 16.0, 5.0, 16.0], device="cpu"))
    assert cpu == [] and kernel_time.coverage(build_frame(data)).status == "not_applicable"
    cut = window([10.0, 10.0, 20.0, 10.0], [16.0, 16.0, 5.0, 16.0])
    cut[2] = summary(2, 40.0, 10.0, truncated=True)  # a trace cut short covers less than its window
    assert judge(cut)[0] == []
    assert judge([summary(0, 20.0, 5.0), summary(1, 40.0, 5.0, s0=12, s1=13)])[0] == []  # no common window
    assert kernel_time.coverage(build_frame(build(world=4, steps=5))).status == "not_applicable"


def test_pipeline_stages_are_compared_within_their_stage():
    # pp=2: stage 1 (ranks 2, 3) runs more kernels than stage 0 by design; nobody straggles within a stage
    found, _ = judge(window([10.0, 10.0, 15.0, 15.1], [6.0, 6.0, 6.0, 6.0]), pp=2)
    assert found == []


def test_windows_of_one_rank_make_one_finding():
    recs = window([10.0, 10.0, 12.0, 10.0], [6.0, 6.0, 4.0, 6.0]) + \
        window([10.0, 10.0, 13.0, 10.0], [7.0, 7.0, 4.0, 7.0], s0=30, s1=31)
    found, _ = judge(recs)
    assert len(found) == 1 and (found[0].step_start, found[0].step_end) == (10, 31)
    assert found[0].evidence["windows_confirmed"] == 2 and found[0].evidence["ratio"] == 1.3


def test_kernel_time_confirms_the_stragglers_finding_as_one_finding():
    """Step records where rank 2 computes 1.3x (a stragglers warning) plus traces of the same steps: one finding,
    the kernel time in its evidence. An info-only stragglers episode (host noise could make it) is raised to a
    warning when the device's kernel time confirms it."""
    slow = dict(compute_factor=lambda r, s: 1.3 if r == 2 and s >= 5 else 1.0)
    data = with_records(build(world=4, steps=20, **slow), window([10.0, 10.0, 13.0, 10.0], [6.0, 6.0, 3.0, 6.0]))
    found = [f for f in run_all(data) if f.kind == "straggler"]
    assert [(f.analyzer, f.ranks) for f in found] == [("stragglers", [2])]
    assert found[0].evidence["kernel_time"]["excess_pct"] == 30.0 and found[0].inputs == ["rank-2.json"]
    assert "confirmed by device kernel time (30.0% over its peers in steps 10-11" in found[0].summary

    from analyzers import merge_corroborating

    info = schema.Finding(analyzer="stragglers", kind="straggler", severity="info", ranks=[2], step_start=5,
                          step_end=19, summary="rank 2 computes longer")
    kt = kernel_time.analyze(build_frame(data))
    merged = [info] + kt
    merge_corroborating(merged)
    assert merged == [info] and info.severity == "warning" and "kernel_time" in info.evidence
    other = schema.Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=[1], step_start=5,
                           step_end=19)
    kept = [other] + kernel_time.analyze(build_frame(data))
    merge_corroborating(kept)
    assert [f.analyzer for f in kept] == ["stragglers", "kernel_time"]  # another rank: two findings


def test_a_straggler_in_cuda_like_traces_is_named_from_kernel_time(tmp_path):
    """The path the agent takes: GPU-like Kineto traces (rank 1's kernels 1.4x longer) summarized by the probe, then
    judged by the check: rank 1 named, its peers the ones waiting in NCCL kernels."""
    kineto_synth.generate(str(tmp_path), ranks=4, steps=4, kernels=40, slow_rank=1, slow_factor=1.4, seed=7)
    recs = []
    for p in sorted(tmp_path.glob("rank-*.json")):
        s = summarize_trace(str(p), run_id="r")
        assert s.device != "cpu"
        recs.append(s)
    assert len({(s.step_start, s.step_end) for s in recs}) == 1
    found, _ = judge(recs)
    assert [(f.ranks, f.severity) for f in found] == [([1], "warning")], [f.summary for f in found]
    assert found[0].evidence["ratio"] >= 1.2


def test_the_head_finds_the_kernel_time_straggler_on_its_live_window(tmp_path):
    h = Head(tmp_path / "store", TOKEN)
    srv = make_server(h, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        data = build(world=4, steps=20)
        rs = h.store.run(data.run_id)
        live = h.live.run(data.run_id)
        live.manifest = data.manifest
        steps = [schema.StepRecord(**{k: v for k, v in row.items() if k in schema.StepRecord.__struct_fields__
                                      and v == v and v is not None})
                 for row in data.steps.to_dict("records")]
        live.add("steps", rs.add("steps", steps))
        assert not [f for f in h.analysis.analyze_once(data.run_id) if f.kind == "straggler"]
        traces = window([10.0, 10.0, 12.5, 10.0], [6.0, 6.0, 3.5, 6.0], run_id=data.run_id)
        live.add("trace_summaries", rs.add("trace_summaries", traces))
        assert [t.rank for t in live.trace_summaries()] == [0, 1, 2, 3]
        got = [f for f in h.analysis.analyze_once(data.run_id) if f.kind == "straggler"]
        assert [(f.analyzer, f.ranks, f.severity) for f in got] == [("kernel_time", [2], "warning")]
    finally:
        srv.shutdown()
        h.close()


def test_the_report_shows_each_capture_window_per_rank_per_step_and_says_what_cpu_time_is():
    import io

    from rich.console import Console

    from analyzers.report.model import build_report
    from analyzers.report.render_html import render_html
    from analyzers.report.render_text import render_text

    recs = window([10.0, 10.0, 12.0, 10.0], [6.0, 6.0, 4.0, 6.0], overlap_ms=2.0) + \
        window([5.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 1.0], s0=30, s1=30, device="cpu")
    data = with_records(build(world=4, steps=40), recs)
    report = build_report(data, run_all(data))
    tr = report.summary["traces"]
    assert [(w["step_start"], w["step_end"], w["cpu"]) for w in tr] == [(10, 11, False), (30, 30, True)]
    r2 = tr[0]["ranks"][2]
    # 2 ms of overlap over 2 steps: 1 ms per step hidden, 3 of rank 2's 4 NCCL ms per step exposed
    assert (r2["kernel_ms_per_step"], r2["nccl_ms_per_step"], r2["exposed_comm_ms_per_step"],
            r2["kernel_vs_median"]) == (12.0, 4.0, 3.0, 1.2)
    assert r2["idle_share"] == 0.025 and r2["trace_file"] == "rank-2.json" and r2["node"] == 0
    buf = io.StringIO()
    render_text(report, Console(file=buf, width=160))
    text = buf.getvalue()
    assert "profiler trace (periodic), steps 10-11 (cuda: device kernel time)" in text and "1.20x" in text
    assert "profiler trace (periodic), step 30 (CPU trace: op time is host time, not device kernel time)" in text
    assert " 2.5 " in text  # idle %
    page = render_html(report)
    assert "profiler trace (periodic), steps 10-11" in page and "<td>12.00</td>" in page
