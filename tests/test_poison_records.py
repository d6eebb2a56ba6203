"""Records that once stopped a node's agent for good (issue 16, item 1): each is now read past, the rest of the data
still flows. Invalid UTF-8 in a spool string, a negative token/FLOP count, a profiler trace with malformed UTF-8."""

from __future__ import annotations

import os
import time

from prometheus_client.exposition import generate_latest

from node.prom import AgentMetrics
from node.sources.traces import TraceSource
from node.state import AgentState
from ranksight import schema
from ranksight.layout import RunDir
from ranksight.spool import tail


def _step(step: int, **kw) -> schema.StepRecord:
    return schema.StepRecord(run_id="r", rank=0, step=step, node=0, host="h", world_size=1, t_start=float(step),
                             t_end=step + 0.5, step_ms=500.0, **kw)


def test_invalid_utf8_in_a_spool_string_is_a_gap_and_the_next_records_are_read(tmp_path):
    p = tmp_path / "rank-0.jsonl"
    bad = b'{"kind":"event","run_id":"r\xff\xfe","rank":0,"step":1,"t":1.0,"event":"x"}\n'
    p.write_bytes(schema.encode(_step(1)) + b"\n" + bad + schema.encode(_step(2)) + b"\n")
    res = tail(p)
    assert [r.step for r in res.records] == [1, 2]
    assert len(res.gaps) == 1 and res.gaps[0].reason == "garbage" and res.position.offset == p.stat().st_size


def test_a_negative_count_does_not_stop_the_exporter():
    m = AgentMetrics()
    m.observe_steps([_step(1, tokens=100, flops=1e12), _step(2, tokens=-5, flops=-1.0), _step(3, tokens=50)])
    text = generate_latest(m.registry).decode()
    assert 'ranksight_tokens_total{node="0",run_id="r"} 150.0' in text
    assert 'ranksight_steps_total{node="0",run_id="r"} 3.0' in text


def test_a_trace_with_malformed_utf8_is_marked_done_not_retried(tmp_path):
    rd = RunDir(tmp_path, "r")
    rd.traces_dir.mkdir(parents=True)
    p = rd.traces_dir / "rank-0.json"
    # an overlong UTF-8 sequence (0xC0 0xAF) inside a string
    p.write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a\xc0\xafb", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}')
    old = time.time() - 60
    os.utime(p, (old, old))
    state = AgentState(node=0)
    src = TraceSource(rd, state, lambda: [0])
    src.collect(wait_s=30)  # summarized, or logged and set aside: never raises
    src.commit(True)
    assert "rank-0.json" in state.traces_done
    assert src.collect() == []  # not tried again


def test_throttle_names_of_a_negative_mask_end():
    from ranksight.simgpu import throttle_names

    names = throttle_names(-1)  # all 64 bits
    assert len(names) == 64 and names[-1] == hex(1 << 63)


def test_run_ids_outside_the_documented_charset_are_refused(tmp_path):
    import pytest

    for bad in ("", ".hidden", "a/b", "a\x00b", "a\nb", "x" * 129, "-lead", "run id"):
        with pytest.raises(ValueError, match="invalid run id"):
            RunDir(tmp_path, bad)
    for ok in ("r", "demo-20261124-090527", "det-dp4-slow_link-450-2n", "v1.2_run", "x" * 128):
        assert RunDir(tmp_path, ok).run_id == ok


def test_a_slow_trace_summary_does_not_hold_the_cycle(tmp_path, monkeypatch):
    """Issue 14: summarizing a large trace ran inline in the agent's cycle and held shipping for tens of seconds; it
    now runs on the source's worker thread and a later cycle ships it."""
    import node.sources.traces as traces_mod

    rd = RunDir(tmp_path, "r")
    rd.traces_dir.mkdir(parents=True)
    p = rd.traces_dir / "rank-0.json"
    p.write_bytes(b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 2, "pid": 1, "tid": 1}]}')
    old = time.time() - 60
    os.utime(p, (old, old))
    real = traces_mod.summarize_trace

    def slow(*a, **k):
        time.sleep(1.5)
        return real(*a, **k)

    monkeypatch.setattr(traces_mod, "summarize_trace", slow)
    src = TraceSource(rd, AgentState(node=0), lambda: [0])
    try:
        t0 = time.monotonic()
        assert src.collect() == []  # handed to the worker: the cycle goes on
        assert time.monotonic() - t0 < 0.5
        items = src.collect(wait_s=30)
        assert len(items) == 1 and items[0].count == 1
    finally:
        src.close()
