"""GET /api/runs/<id>/traces: the profiler capture windows in the head's live window, per rank, per-step figures."""

from __future__ import annotations

from functools import partial
import time

import pytest

from agent_helpers import api_get, serving
from head.service import Head
from analyzers.trace_windows import MAX_WINDOWS
from ranksight import schema

RUN = "trace-run"
TOKEN = "traces-test-token"


def summary(rank: int, a: int, b: int, **kw) -> schema.TraceSummary:
    base = dict(run_id=RUN, rank=rank, step_start=a, step_end=b,
                trace_file=f"/secret/agent/path/{RUN}/traces/rank-{rank}.step{a}-{b}.json",
                wall_ms=1000.0, compute_ms=600.0, comm_ms=300.0, overlap_ms=100.0, idle_ms=150.0, copy_ms=50.0,
                top_ops=[{"name": f"op{i}", "total_ms": 100.0 - i, "count": i + 1} for i in range(5)],
                device="cuda")
    base.update(kw)
    return schema.TraceSummary(**base)


@pytest.fixture
def head(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    with serving(h):
        yield h


get = partial(api_get, token=TOKEN)  # (status, JSON body) with this file's token


def feed(h: Head) -> None:
    now = time.time()
    live = h.live.run(RUN)
    live.manifest = schema.Manifest(
        run_id=RUN, created=now, start_time=now, nodes=2,
        ranks=[schema.RankPlacement(rank=r, node=r // 2, host=f"node{r // 2}", local_rank=r % 2, pp_stage=0,
                                    dp_rank=r, tp_rank=0) for r in range(4)])
    # window 10..14 (5 steps) on 4 ranks; rank 3 computes twice as long, rank 1 arrives twice (a resend, newer last)
    recs = [summary(r, 10, 14) for r in range(4)]
    recs[3] = summary(3, 10, 14, compute_ms=1200.0, wall_ms=1500.0, idle_ms=50.0)
    recs.append(summary(1, 10, 14, compute_ms=650.0))
    live.add("trace_summaries", recs)
    # an older capture (steps 0..1) arriving later is still the older window: windows go by their steps
    live.add("trace_summaries", [summary(r, 0, 1, device="cpu", copy_ms=0.0) for r in range(2)])
    # a trace without ProfilerStep annotations: no step count; a rank the manifest does not place (no node)
    live.add("trace_summaries", [summary(9, -1, -1, trace_file="/x/rank-9.ondemand.json", truncated=True,
                                         notes=["truncated: cut"])])


def test_traces_need_the_token(head):
    feed(head)
    url = f"{head.url}/api/runs/{RUN}/traces"
    assert get(url, headers={})[0] == 401
    assert get(url, headers={"Authorization": "Bearer wrong"})[0] == 403
    assert get(url)[0] == 200


def test_per_step_figures_from_the_records(head):
    feed(head)
    status, rows = get(f"{head.url}/api/runs/{RUN}/traces")
    assert status == 200
    # three windows by their steps (no steps first), ranks sorted within a window; rank 1 once (its newer summary)
    assert [(r["step_start"], r["rank"]) for r in rows] == [(-1, 9), (0, 0), (0, 1), (10, 0), (10, 1), (10, 2), (10, 3)]
    nostep, r0, r1, r3 = rows[0], rows[3], rows[4], rows[6]
    assert r0["steps"] == 5 and r0["step_end"] == 14 and r0["device"] == "cuda" and r0["kind"] == "periodic"
    assert r0["kernel_ms_per_step"] == pytest.approx(600.0 / 5)
    assert r0["nccl_ms_per_step"] == pytest.approx(300.0 / 5)
    assert r0["exposed_comm_ms_per_step"] == pytest.approx((300.0 - 100.0) / 5)
    assert r0["copy_ms_per_step"] == pytest.approx(50.0 / 5)
    assert r0["idle_ms_per_step"] == pytest.approx(150.0 / 5)
    assert r0["idle_share"] == pytest.approx(0.15)
    assert r1["kernel_ms_per_step"] == pytest.approx(650.0 / 5)  # the resent summary, not the first one
    assert r3["kernel_ms_per_step"] == pytest.approx(1200.0 / 5) and r3["idle_share"] == pytest.approx(50 / 1500)
    # nodes from the manifest's placement; top 3 ops only; the file name without the agent's path
    assert [o["name"] for o in r0["top_ops"]] == ["op0", "op1", "op2"]
    assert r0["trace_file"] == "rank-0.step10-14.json"
    assert all("/" not in r["trace_file"] for r in rows)
    assert [r["node"] for r in rows[3:]] == [0, 0, 1, 1]
    assert rows[1]["device"] == "cpu" and rows[1]["steps"] == 2
    assert nostep["node"] is None and nostep["steps"] is None and nostep["kernel_ms_per_step"] is None
    assert nostep["kernel_ms"] == 600.0 and nostep["truncated"] is True and nostep["notes"] == ["truncated: cut"]
    assert nostep["kind"] == "ondemand"


def test_bounded_and_filtered(head):
    feed(head)
    base = f"{head.url}/api/runs/{RUN}/traces"
    status, rows = get(base + "?windows=1")
    assert status == 200 and [(r["rank"], r["step_start"]) for r in rows] == [(0, 10), (1, 10), (2, 10), (3, 10)]
    status, rows = get(base + "?rank=3")
    assert status == 200 and [(r["rank"], r["step_start"]) for r in rows] == [(3, 10)]
    assert get(base + "?windows=0")[0] == 400
    assert get(base + f"?windows={MAX_WINDOWS + 1}")[0] == 400
    assert get(base + "?rank=x")[0] == 400
    assert get(f"{head.url}/api/runs/nope/traces")[0] == 404
    # more windows than the bound: the newest MAX_WINDOWS
    head.live.run(RUN).add("trace_summaries", [summary(0, 100 + 5 * i, 104 + 5 * i) for i in range(MAX_WINDOWS + 3)])
    status, rows = get(base + f"?windows={MAX_WINDOWS}")
    assert status == 200 and len(rows) == MAX_WINDOWS and rows[-1]["step_start"] == 100 + 5 * (MAX_WINDOWS + 2)


def test_empty_run_has_no_windows(head):
    head.live.run(RUN).manifest = schema.Manifest(run_id=RUN, created=0.0, start_time=0.0)
    assert get(f"{head.url}/api/runs/{RUN}/traces") == (200, [])


def test_odd_figures_do_not_break_the_endpoint(head):
    """NaN from a broken trace becomes null; a zero wall time gives no idle share rather than a division error."""
    head.live.run(RUN).add("trace_summaries", [summary(0, 3, 3, compute_ms=float("nan"), wall_ms=0.0, idle_ms=0.0,
                                                       top_ops=["not a dict", {"name": "k", "total_ms": "x"}])])
    status, rows = get(f"{head.url}/api/runs/{RUN}/traces")
    assert status == 200 and len(rows) == 1
    r = rows[0]
    assert r["kernel_ms"] is None and r["kernel_ms_per_step"] is None and r["idle_share"] is None
    assert r["top_ops"] == [{"name": "k", "total_ms": None, "count": None}]


def test_a_late_rank_does_not_make_an_old_capture_the_newest(head):
    live = head.live.run(RUN)
    live.add("trace_summaries", [summary(r, 10, 14) for r in range(3)])
    live.add("trace_summaries", [summary(r, 30, 34) for r in range(3)])
    live.add("trace_summaries", [summary(3, 10, 14)])  # rank 3 ships its older capture late
    status, rows = get(f"{head.url}/api/runs/{RUN}/traces?windows=1")
    assert status == 200 and [(r["rank"], r["step_start"]) for r in rows] == [(0, 30), (1, 30), (2, 30)]
    status, rows = get(f"{head.url}/api/runs/{RUN}/traces?windows=2")
    assert [(r["rank"], r["step_start"]) for r in rows][:4] == [(0, 10), (1, 10), (2, 10), (3, 10)]
