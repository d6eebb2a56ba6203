"""Fuzzing (hypothesis, short and seeded) of the parsers that read what users and agents send: each keeps its
documented error contract on any input, and finishes (issue 16 item 7). The longer run is bench/fuzz.py.

- probes.profiler.summarize_trace: a TraceSummary, or TraceError/OSError;
- ranksight.spool.tail: never raises on any bytes (garbage becomes a recorded gap);
- probes.dcgm.DcgmProbe.sample: never raises (a bad scrape is a gap);
- the head's OTLP logs ingest: accepted or rejected record counts, never an exception.
"""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from probes.dcgm import DcgmProbe
from probes.profiler import TraceError, summarize_trace
from ranksight import schema, wire
from ranksight.spool import tail
from fuzz_settings import fuzz_settings

FUZZ = fuzz_settings(60)

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                      max_leaves=8)
event = st.fixed_dictionaries({}, optional={
    "ph": st.sampled_from(["X", "M", "i", "B", 5, None]), "cat": st.one_of(st.sampled_from(
        ["kernel", "cpu_op", "user_annotation", "gpu_memcpy", ""]), values),
    "name": st.one_of(st.sampled_from(["ncclKernel_AllReduce", "gloo:all_reduce", "ProfilerStep#3", "thread_name",
                                       "aten::mm"]), values),
    "pid": values, "tid": values, "ts": values, "dur": values,
    "args": st.one_of(values, st.dictionaries(st.sampled_from(["stream", "In msg nelems", "dtype", "name", "rank"]),
                                              values, max_size=4))})


def _json_safe(x):
    """JSON has no NaN/Infinity: the trace parser sees them as the invalid JSON they are only via raw bytes below."""
    if isinstance(x, float) and not math.isfinite(x):
        return 1e308 if x > 0 else -1e308 if x < 0 else 0.0
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    return x


@FUZZ
@given(events=st.lists(event, max_size=12), dist=values, cut=st.integers(0, 10_000))
def test_trace_summarizer_keeps_its_error_contract(tmp_path_factory, events, dist, cut):
    doc = {"distributedInfo": _json_safe(dist), "traceEvents": _json_safe(events)}
    raw = json.dumps(doc).encode()
    p = tmp_path_factory.mktemp("tr") / "rank-0.json"
    for data in (raw, raw[: cut % (len(raw) + 1)]):
        p.write_bytes(data)
        try:
            summarize_trace(str(p), run_id="r", rank=0)
        except (TraceError, OSError):
            pass


@FUZZ
@given(data=st.binary(max_size=400))
def test_trace_summarizer_on_random_bytes(tmp_path_factory, data):
    p = tmp_path_factory.mktemp("tb") / "rank-0.json"
    p.write_bytes(b'{"traceEvents": [' + data)
    try:
        summarize_trace(str(p), run_id="r", rank=0)
    except (TraceError, OSError):
        pass


@FUZZ
@given(lines=st.lists(st.one_of(st.binary(max_size=80), st.builds(lambda v: json.dumps(_json_safe(v)).encode(), values),
                                st.just(schema.encode(schema.StepRecord(run_id="r", rank=0, step=1, node=0, host="h",
                                                                        world_size=1, t_start=0.0, t_end=1.0,
                                                                        step_ms=1.0)))), max_size=10))
def test_spool_tail_never_raises(tmp_path_factory, lines):
    p = tmp_path_factory.mktemp("sp") / "rank-0.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    res = tail(p)
    assert res.position.offset <= p.stat().st_size


metric_line = st.builds(
    lambda name, gpu, extra, v: f'{name}{{gpu="{gpu}",UUID="GPU-{gpu}"{extra}}} {v}',
    st.sampled_from(["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                     "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                     "DCGM_FI_DEV_FB_USED", "DCGM_EXP_XID_ERRORS_COUNT"]),
    st.sampled_from(["0", "1", "x", "-1", ""]),
    st.sampled_from(["", ',err_code="79"', ',xid="1000000000"', ',GPU_I_ID="1"', ',err_msg="\\"q"']),
    st.sampled_from(["1", "-1", "+Inf", "-Inf", "NaN", "1e9", "1e30", "0.5", "abc", "18446744073709551615"]))


@FUZZ
@given(lines=st.lists(st.one_of(metric_line, st.text(max_size=40)), max_size=12))
def test_dcgm_probe_never_raises_and_finishes(lines):
    text = "\n".join(lines) + "\n"
    probe = DcgmProbe("http://dcgm.invalid/metrics", fetcher=lambda url, t: text)
    probe.sample()
    probe.poll_xids()
    probe.sample()  # a second scrape: counters and deltas against the first


def _request(attrs: list[tuple[str, object]], body: object) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    rec = req.resource_logs.add().scope_logs.add().log_records.add()
    for k, v in attrs:
        kv = rec.attributes.add()
        kv.key = k
        if isinstance(v, bool):
            kv.value.bool_value = v
        elif isinstance(v, int):
            kv.value.int_value = max(-2**63, min(2**63 - 1, v))
        elif isinstance(v, float):
            kv.value.double_value = v
        elif isinstance(v, bytes):
            kv.value.bytes_value = v
        else:
            kv.value.string_value = str(v)
    if isinstance(body, bytes):
        rec.body.bytes_value = body
    else:
        rec.body.string_value = str(body)
    return req


attr_value = st.one_of(st.integers(-2**64, 2**64), st.floats(), st.booleans(), st.text(max_size=20), st.binary(max_size=20),
                       st.sampled_from(["r1", "step", "collective", "packed-v1", "manifest", "heartbeat", "r\x00x"]))


@FUZZ
@given(attrs=st.lists(st.tuples(st.sampled_from([wire.A_RUN, wire.A_KIND, wire.A_RANK, wire.A_NODE, wire.A_COUNT,
                                                 wire.A_SCHEMA, wire.A_ENCODING, wire.A_LAYOUT, "x"]), attr_value),
                      max_size=8),
       body=st.one_of(st.binary(max_size=200), st.text(max_size=200), st.builds(
           lambda v: json.dumps(_json_safe(v)), st.lists(values, max_size=3))))
def test_head_ingest_counts_never_raises(tmp_path_factory, attrs, body):
    from head.service import Head

    h = Head(tmp_path_factory.mktemp("head") / "store", "tok", analyzer=None)
    try:
        accepted, rejected, _ = h.ingest.logs(_request(attrs, body))
        assert accepted >= 0 and rejected >= 0
    finally:
        h.close()
