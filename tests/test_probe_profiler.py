"""probes.profiler: per-rank compute/comm/idle from Kineto traces, streamed."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from probes.profiler import IntervalUnion, TraceError, summarize_trace, summarize_traces
from conftest import free_port

FIX = Path(__file__).parent / "fixtures" / "traces"
ROOT = Path(__file__).resolve().parent.parent


def _x(name, cat, tid, ts, dur, args=None, pid=100):
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args is not None:
        ev["args"] = args
    return ev


def _thread(tid, name, pid=100):
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}}


# ---------------------------------------------------------------------------
# Hand-built traces whose numbers are computed by hand
# ---------------------------------------------------------------------------


def test_hand_built_cpu_trace_exact():
    # Window: ProfilerStep#5 [1000,2000) + #6 [2000,3000) -> 2000 us.
    # Compute (cpu_ops on tid 1, not c10d, not on the gloo thread):
    #   [1050,1080] 30 (arrives out of order) + [1100,1400] 300 (aten::add nested inside adds 0)
    #   + [1500,1800] 300 + [2100,2600] 500 + [2950,3000] 50 (relu clipped at the window) = 1180
    # Comm: c10d::allreduce_ [1800,1850] U gloo:all_reduce [1850,2300] = [1800,2300] = 500
    # Overlap: [2100,2300] = 200.  Idle: 2000 - (1180 + 500 - 200) = 520.
    trace = json.loads((FIX / "hand_cpu.json").read_text())
    assert trace["distributedInfo"]["rank"] == 3
    s = summarize_trace(str(FIX / "hand_cpu.json"), run_id="r1")
    assert s.rank == 3 and s.run_id == "r1" and s.device == "cpu"
    assert (s.step_start, s.step_end) == (5, 6)
    assert s.wall_ms == pytest.approx(2.0)
    assert s.compute_ms == pytest.approx(1.18)
    assert s.comm_ms == pytest.approx(0.5)
    assert s.overlap_ms == pytest.approx(0.2)
    assert s.idle_ms == pytest.approx(0.52)
    assert s.wall_ms == pytest.approx(s.compute_ms + s.comm_ms - s.overlap_ms + s.idle_ms)
    assert not s.truncated
    names = [c["name"] for c in s.collectives]
    assert names == ["c10d::allreduce_", "gloo:all_reduce"]
    gl = s.collectives[1]
    assert gl["dur_ms"] == pytest.approx(0.45) and gl["bytes"] == 4096 and gl["kind"] == "exec"
    top = {o["name"]: o for o in s.top_ops}
    assert top["aten::mm"]["count"] == 4 and top["aten::mm"]["total_ms"] == pytest.approx(0.03 + 0.3 + 0.3 + 0.5)


def test_hand_built_gpu_trace_exact():
    # Window: first kernel start 100 .. last kernel end 1000 -> 900 us.
    # Compute kernels: [100,400] 300 + [450,500] 50 + [850,1000] 150 = 500
    # NCCL kernels:    [300,700] 400 + [800,900] 100 = 500
    # Overlap: [300,400] 100 + [450,500] 50 + [850,900] 50 = 200. A memcpy [700,740] in the gap: busy (copy 40), so
    # idle is 900 - 800 - 40 = 60.
    s = summarize_trace(str(FIX / "hand_gpu_rank5.json"))
    assert s.device == "gpu"
    assert s.rank == 5  # no distributedInfo: from the file name, with a note
    assert any("file name" in n for n in s.notes)
    assert (s.wall_ms, s.compute_ms, s.comm_ms, s.overlap_ms, s.idle_ms, s.copy_ms) == pytest.approx(
        (0.9, 0.5, 0.5, 0.2, 0.06, 0.04))
    assert [c["name"].split("(")[0] for c in s.collectives] == ["ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                                                               "ncclKernel_AllGather_RING_LL_Sum_int8_t"]
    assert s.collectives[0]["bytes"] == 1048576 * 4 and s.collectives[0]["dur_ms"] == pytest.approx(0.4)
    assert s.collectives[1]["bytes"] == 2048
    assert s.top_ops[0]["kind"] == "kernel"


def test_union_handles_out_of_order_and_nesting():
    u = IntervalUnion()
    for a, b in [(10, 20), (12, 15), (30, 40), (5, 8), (19, 31), (50, 60), (45, 46)]:
        u.add(a, b)
    s, e = u.intervals()
    assert list(zip(s.tolist(), e.tolist())) == [(5, 8), (10, 40), (45, 46), (50, 60)]


# ---------------------------------------------------------------------------
# A real trace from torch.profiler (gloo, world_size=1, in this process)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory) -> Path:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    out = tmp_path_factory.mktemp("trace") / "rank0.json"
    started = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        started = True
    try:
        a = torch.randn(192, 192)
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2),
                     record_shapes=True, on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
            for _ in range(3):
                for _ in range(4):
                    a = torch.tanh(a @ a)
                t = torch.ones(2048)
                dist.all_reduce(t)
                prof.step()
    finally:
        if started:
            dist.destroy_process_group()
    return out


def test_real_gloo_trace(real_trace: Path):
    data = json.loads(real_trace.read_text())
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    s = summarize_trace(str(real_trace))
    assert s.rank == 0 and s.device == "cpu" and not s.truncated
    assert s.step_end - s.step_start + 1 == len(steps) == 2
    lo = min(e["ts"] for e in steps)
    hi = max(e["ts"] + e["dur"] for e in steps)
    assert s.wall_ms == pytest.approx((hi - lo) / 1000.0, rel=1e-6)
    assert s.compute_ms > 0 and s.comm_ms > 0
    assert s.wall_ms == pytest.approx(s.compute_ms + s.comm_ms - s.overlap_ms + s.idle_ms, rel=1e-6)
    gloo = [c for c in s.collectives if c["name"] == "gloo:all_reduce"]
    issued = [c for c in s.collectives if c["name"] == "c10d::allreduce_"]
    assert len(gloo) == 2 and len(issued) == 2
    assert all(c["bytes"] == 2048 * 4 for c in gloo)  # record_shapes: Input Dims x float
    assert any(o["name"] == "aten::mm" for o in s.top_ops)
    # Matmul time is compute: the summed top-level aten::matmul time bounds compute from below.
    mm = next(o for o in s.top_ops if o["name"] == "aten::matmul")
    assert s.compute_ms >= mm["total_ms"] * 0.999


def test_gzip_gives_the_same_summary(real_trace: Path, tmp_path: Path):
    gz = tmp_path / "rank0.json.gz"
    with open(real_trace, "rb") as f, gzip.open(gz, "wb") as g:
        shutil.copyfileobj(f, g)
    a = summarize_trace(str(real_trace))
    b = summarize_trace(str(gz))
    assert (a.compute_ms, a.comm_ms, a.idle_ms, a.overlap_ms, len(a.collectives)) == (
        b.compute_ms, b.comm_ms, b.idle_ms, b.overlap_ms, len(b.collectives))


def test_truncated_trace_is_summarized_and_marked(tmp_path: Path):
    raw = (FIX / "hand_cpu.json").read_bytes()
    cut = tmp_path / "cut.json"
    cut.write_bytes(raw[: int(len(raw) * 0.7)])
    s = summarize_trace(str(cut))
    assert s.truncated is True
    assert s.notes and s.notes[0].startswith("truncated")
    full = summarize_trace(str(FIX / "hand_cpu.json"))
    assert 0 < s.compute_ms <= full.compute_ms
    # A gzip cut short is the same story.
    gz = tmp_path / "cut.json.gz"
    gz.write_bytes(gzip.compress(raw)[:-40])
    s2 = summarize_trace(str(gz))
    assert s2.truncated is True


def test_bare_event_array_form_is_read(tmp_path: Path):
    # The trace format's other form: a bare array of events, whose closing "]" may be left out.
    events = json.loads((FIX / "hand_cpu.json").read_text())["traceEvents"]
    full = summarize_trace(str(FIX / "hand_cpu.json"))
    closed = tmp_path / "closed.json"
    closed.write_text(json.dumps(events))
    unclosed = tmp_path / "unclosed.json"
    unclosed.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",\n")
    for p in (closed, unclosed):
        s = summarize_trace(str(p))
        assert (s.compute_ms, s.comm_ms, s.overlap_ms, s.idle_ms) == pytest.approx(
            (full.compute_ms, full.comm_ms, full.overlap_ms, full.idle_ms)), p.name
        assert not s.truncated
    assert any("closing ']'" in n for n in summarize_trace(str(unclosed)).notes)
    # cut inside an event: that one is truncated
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(events)[:-30])
    assert summarize_trace(str(cut)).truncated is True


def test_bad_inputs_raise_clear_errors_not_crashes(tmp_path: Path):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\xff not json at all \x13")
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    noevents = tmp_path / "noevents.json"
    noevents.write_text('{"schemaVersion": 1, "traceEvents": []}')
    for p in (garbage, empty, noevents):
        with pytest.raises(TraceError):
            summarize_trace(str(p))
    out, errors = summarize_traces([str(garbage), str(tmp_path / "missing.json"), str(FIX / "hand_cpu.json")])
    assert [s.rank for s in out] == [3]
    assert set(errors) == {str(garbage), str(tmp_path / "missing.json")}


def test_loosely_typed_events_are_coerced_or_skipped_and_the_rest_is_read(tmp_path):
    """Events whose fields have other types than Kineto writes are decoded one by one: a string ts or a list pid
    is coerced as before, a numeric name or non-object args is counted and skipped, and an event with invalid
    UTF-8 is skipped too, not the end of the trace (the ijson loop stopped there and lost the events after it)."""
    good = [_x("ProfilerStep#1", "user_annotation", 1, 0, 1000), _x("aten::mm", "cpu_op", 1, 100, 200),
            _x("aten::mm", "cpu_op", 1, 600, 100)]
    odd = [_x("aten::add", "cpu_op", 1, "300", 50), _x("aten::add", "cpu_op", 1, 400, 50, pid=[1, 2]),
           _x(7, "cpu_op", 1, 0, 900), _x("aten::bad", "cpu_op", 1, 0, 900, args=[1])]
    body = ",".join(json.dumps(e) for e in good[:2] + odd).encode()
    bad_utf8 = b'{"ph": "X", "cat": "cpu_op", "name": "a\xc0\xafb", "pid": 100, "tid": 1, "ts": 0, "dur": 900}'
    p = tmp_path / "rank-0.json"
    p.write_bytes(b'{"traceEvents": [' + body + b"," + bad_utf8 + b"," + json.dumps(good[2]).encode() + b"]}")
    s = summarize_trace(str(p))
    assert not s.truncated
    # compute: mm [100,300] + add [300,350] + add [400,450] (its pid a list) + mm [600,700] = 400 us
    assert s.compute_ms == pytest.approx(0.4) and s.wall_ms == pytest.approx(1.0)
    assert {o["name"]: o["count"] for o in s.top_ops} == {"aten::mm": 2, "aten::add": 2}
    assert any(n.startswith("3 event(s) with fields of the wrong type") for n in s.notes), s.notes


# ---------------------------------------------------------------------------
# A synthetic ~500 MB trace streamed in bounded memory (one test, run once)
# ---------------------------------------------------------------------------

# Indentation-like whitespace inside each event: real traces are pretty-printed, and padding
# with whitespace (skipped by the C parser) keeps the test quick while the file is 500 MB.
_PAD = "\n" + " " * 3000


def _write_big_trace(path: Path, target_bytes: int) -> int:
    """Per step k (1000 us): compute [100,400]+[600,900] on tid 1, comm c10d [400,450] + gloo
    [450,700] on tid 2 -> compute 600, comm 300, overlap 100, idle 200 per step."""
    head = ('{"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": 2, "world_size": 4},\n'
            ' "traceEvents": [\n'
            '  {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "thread 1 (python)"}},\n'
            '  {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "thread 2 (pt_gloo_runloop)"}}')
    step = (',\n  {{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#{k}", "pid": 1, "tid": 1, "ts": {t0}, "dur": 1000}}'
            ',\n  {{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": {t1}, "dur": 300, "args": {{"Sequence number": {k}}}{pad}}}'
            ',\n  {{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": {t2}, "dur": 50, "args": {{"Sequence number": {k}}}{pad}}}'
            ',\n  {{"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2, "ts": {t3}, "dur": 250, "args": {{"Input Dims": [[1024]], "Input type": ["float"]}}{pad}}}'
            ',\n  {{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": {t4}, "dur": 300, "args": {{"Sequence number": {k}}}{pad}}}')
    n = 0
    with open(path, "w") as f:
        f.write(head)
        written = len(head)
        while written < target_bytes:
            parts = []
            for _ in range(200):
                t0 = 1_000_000 + n * 1000
                parts.append(step.format(k=n, t0=t0, t1=t0 + 100, t2=t0 + 400, t3=t0 + 450, t4=t0 + 600, pad=_PAD))
                n += 1
            block = "".join(parts)
            f.write(block)
            written += len(block)
        f.write("\n ]\n}\n")
    return n


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy
    from probes.profiler import summarize_trace
    def vm(key):
        # VmHWM is this address space's peak RSS; ru_maxrss would carry the parent's peak
        # across fork+exec (a pytest process that imported torch), so it is not used.
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise RuntimeError(key)
    before = vm("VmRSS:")
    s = summarize_trace(sys.argv[1])
    peak = vm("VmHWM:")
    print(json.dumps({"growth": peak - before, "wall_ms": s.wall_ms, "compute_ms": s.compute_ms,
                      "comm_ms": s.comm_ms, "overlap_ms": s.overlap_ms, "idle_ms": s.idle_ms,
                      "steps": [s.step_start, s.step_end], "ncoll": len(s.collectives), "notes": s.notes,
                      "rank": s.rank, "truncated": s.truncated}))
""")


@pytest.mark.timeout(240)
def test_synthetic_500mb_trace_streams_in_bounded_memory(tmp_path: Path):
    path = tmp_path / "big_rank2.json"
    try:
        nsteps = _write_big_trace(path, 500 * 1000 * 1000)
        size = path.stat().st_size
        assert size >= 500e6
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True, text=True,
                             env=env, cwd=str(ROOT), timeout=230)
        assert out.returncode == 0, out.stderr[-2000:]
        r = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        path.unlink(missing_ok=True)
    print(f"500 MB trace: {size / 1e6:.0f} MB, {nsteps * 5} events, peak RSS growth {r['growth'] / 2**20:.1f} MiB")
    # Memory: the peak RSS growth while summarizing 500 MB stays far below the file size.
    assert r["growth"] < 200 * 1024 * 1024, r["growth"]
    # And the numbers are exact, step by step.
    assert r["rank"] == 2 and not r["truncated"]
    assert r["steps"] == [0, nsteps - 1]
    assert r["wall_ms"] == pytest.approx(nsteps * 1.0)
    assert r["compute_ms"] == pytest.approx(nsteps * 0.6)
    assert r["comm_ms"] == pytest.approx(nsteps * 0.3)
    assert r["overlap_ms"] == pytest.approx(nsteps * 0.1)
    assert r["idle_ms"] == pytest.approx(nsteps * 0.2)
    assert r["ncoll"] == 10_000 and any(n.startswith("listed 10000 of ") for n in r["notes"])


def test_gpu_copies_are_busy_not_idle_and_cpu_comm_does_not_crowd_out_nccl_kernels(tmp_path):
    """Issue 14: memcpy/memset keep the device busy (they were counted as idle), and a GPU trace's list of NCCL
    kernels is not filled up by CPU-side communication events that are then dropped."""
    import json

    from probes.profiler import summarize_trace

    ev = [{"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 0, "dur": 100, "args": {"stream": 7}},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": 7, "ts": 100, "dur": 50},
          {"ph": "X", "cat": "gpu_memset", "name": "Memset", "pid": 0, "tid": 7, "ts": 150, "dur": 10},
          {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "pid": 0, "tid": 20, "ts": 200, "dur": 40,
           "args": {"stream": 20}},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "pid": 0, "tid": 9, "ts": 210, "dur": 10}]  # under NCCL
    ev += [{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": i, "dur": 1}
           for i in range(30)]
    p = tmp_path / "rank-0.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    s = summarize_trace(str(p), max_collectives=5)
    assert (s.wall_ms, s.compute_ms, s.comm_ms) == (0.24, 0.1, 0.04)
    assert abs(s.copy_ms - 0.06) < 1e-9 and abs(s.idle_ms - 0.04) < 1e-9  # 160-200 us is the only idle time
    assert [c["name"] for c in s.collectives] == ["ncclDevKernel_AllReduce"]
