"""OTLP/JSON on the head's receiver (issue 15): the same batch as protobuf and as JSON stores the same rows, packed
step bodies travel as base64, the SDK exporter's own output converted to OTLP/JSON (hex ids, integer enums) is
accepted, answers are JSON, and malformed JSON is a counted 400, never a 500, on any body (seeded fuzz)."""

from __future__ import annotations

import base64
import gzip
import http.client
import http.server
import json
import threading
import zlib

import pytest
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from agent_helpers import TOKEN
from fuzz_settings import fuzz_settings
from head import receiver as rx
from head.api import make_server
from head.service import Head
from ranksight import schema, wire, wire_rejections
from ranksight.tables import read_table

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PB = "application/x-protobuf"
JS = "application/json"


def start_head(root):
    h = Head(root, TOKEN, analyzer=None, flush_interval=0.2)
    srv = make_server(h, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    h.start_background()
    h.port = srv.server_address[1]
    h.url = f"http://127.0.0.1:{h.port}"
    h.srv = srv
    return h


def stop_head(h):
    h.srv.shutdown()
    h.srv.server_close()
    h.close()


@pytest.fixture
def heads(tmp_path):
    made = []

    def make(name="store"):
        made.append(start_head(tmp_path / name))
        return made[-1]

    yield make
    for h in made:
        stop_head(h)


def post(h, path: str, body: bytes, ctype: str | None, encoding: str | None = None, auth=True):
    """(status, content type, body) of one POST to the head."""
    headers = {**(AUTH if auth else {}), "Content-Length": str(len(body))}
    if ctype is not None:
        headers["Content-Type"] = ctype
    if encoding:
        headers["Content-Encoding"] = encoding
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type"), r.read()
    finally:
        conn.close()


def steps(run_id, rank, rng, host="h"):
    return [schema.StepRecord(run_id=run_id, rank=rank, step=s, node=0, host=host, world_size=2, t_start=float(s),
                              t_end=s + 0.1, step_ms=100.0 + s) for s in rng]


def agent_log_records(run_id: str, res: Resource):
    """Log records as the agent builds them: a packed step batch, a JSON step batch, a GPU batch."""
    layout, packed = wire.pack_records("step", run_id, steps(run_id, 0, range(0, 30)))
    body1 = wire.join_array([schema.encode(r) for r in steps(run_id, 1, range(0, 30))])
    gpu = [schema.GpuSample(node=0, host="h", gpu=g, t=1.0 + g, util_pct=50.0 + g, source="simulated-nvml",
                            simulated=True) for g in range(4)]
    gbody = wire.join_array([schema.encode(r) for r in gpu])
    return [wire.make_log_record(run_id, "step", packed, rank=0, node=0, count=30, layout=layout, resource=res),
            wire.make_log_record(run_id, "step", body1, rank=1, node=0, count=30, resource=res),
            wire.make_log_record(run_id, "gpu", gbody, node=0, count=4, resource=res)]


class _Capture(http.server.BaseHTTPRequestHandler):
    """Stands in for the head to catch the exact bytes the SDK exporter posts."""
    bodies: list = []

    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if (self.headers.get("Content-Encoding") or "") == "gzip":
            data = gzip.decompress(data)
        type(self).bodies.append((self.path, data))
        self.send_response(200)
        self.send_header("Content-Type", PB)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def capture():
    handler = type("Cap", (_Capture,), {"bodies": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        yield srv, handler.bodies
    finally:
        srv.shutdown()
        srv.server_close()


def b64_to_hex(doc) -> None:
    """MessageToDict writes trace/span ids as base64 (proto3 JSON); OTLP/JSON wants hex: what a JSON exporter sends."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k in ("traceId", "spanId") and isinstance(v, str):
                doc[k] = base64.b64decode(v).hex()
            else:
                b64_to_hex(v)
    elif isinstance(doc, list):
        for v in doc:
            b64_to_hex(v)


def otlp_json(msg) -> bytes:
    """An OTLP/JSON body for a protobuf request, as the spec encodes it: lowerCamelCase keys, integer enums, hex ids."""
    doc = json_format.MessageToDict(msg, use_integers_for_enums=True)
    b64_to_hex(doc)
    return json.dumps(doc).encode()


def stored(h, run_id, table):
    h.store.flush_all()
    df = read_table(h.store.root, run_id, table)
    keys = [c for c in ("rank", "step", "node", "gpu", "t") if c in df.columns]
    return df.sort_values(keys).reset_index(drop=True)


def test_the_sdk_exporters_batch_as_protobuf_and_as_json_stores_the_same_rows(heads, capture):
    srv, bodies = capture
    exp = OTLPLogExporter(endpoint=srv.url + "/v1/logs", headers=AUTH, timeout=5, compression=Compression.Gzip)
    res = Resource.create({wire.R_NODE: 0, "service.name": "ranksight-agent"})
    assert exp.export(agent_log_records("runJ", res)) == LogRecordExportResult.SUCCESS
    (path, pb_body), = bodies
    req = ExportLogsServiceRequest.FromString(pb_body)
    packed = [lr for lr in req.resource_logs[0].scope_logs[0].log_records if lr.body.WhichOneof("value") == "bytes_value"]
    assert len(packed) == 1  # the packed step body travels as bytesValue, base64 in JSON
    js_body = otlp_json(req)
    assert b'"bytesValue"' in js_body and b'"intValue"' in js_body

    a, b = heads("a"), heads("b")
    st_pb, ct_pb, out_pb = post(a, "/v1/logs", pb_body, PB)
    st_js, ct_js, out_js = post(b, "/v1/logs", gzip.compress(js_body), JS, "gzip")
    assert (st_pb, ct_pb) == (200, PB)
    assert (st_js, ct_js) == (200, JS)
    assert json.loads(out_js) == {}  # an empty ExportLogsServiceResponse, as JSON
    for table, n in (("steps", 60), ("gpu", 4)):
        rows_pb, rows_js = stored(a, "runJ", table), stored(b, "runJ", table)
        assert len(rows_pb) == len(rows_js) == n
        assert rows_pb.equals(rows_js), table
    assert sorted(stored(b, "runJ", "steps")["step_ms"].tolist())[:3] == [100.0, 100.0, 101.0]
    assert a.stats["records_new"] == b.stats["records_new"] == 64
    # the same JSON again (an at-least-once resend) is deduplicated like protobuf
    assert post(b, "/v1/logs", js_body, "application/json; charset=utf-8")[0] == 200
    assert len(stored(b, "runJ", "steps")) == 60 and b.stats["duplicates"] == 64


def hand_written_request(run_id: str, packed: bytes, layout: str, trace_hex: str = "") -> dict:
    """OTLP/JSON as a non-SDK client writes it: int64 as strings and as numbers, the packed body as base64."""
    kv = [{"key": wire.A_RUN, "value": {"stringValue": run_id}},
          {"key": wire.A_KIND, "value": {"stringValue": "step"}},
          {"key": wire.A_ENCODING, "value": {"stringValue": wire.ENC_PACKED}},
          {"key": wire.A_LAYOUT, "value": {"stringValue": layout}},
          {"key": wire.A_SCHEMA, "value": {"intValue": str(schema.SCHEMA_VERSION)}},
          {"key": wire.A_COUNT, "value": {"intValue": 5}}]
    rec = {"timeUnixNano": "1700000000000000000", "severityNumber": 9, "eventName": wire.EVENT_NAME,
           "body": {"bytesValue": base64.b64encode(packed).decode()}, "attributes": kv}
    if trace_hex:
        rec["traceId"], rec["spanId"] = trace_hex, trace_hex[:16]
    return {"resourceLogs": [{"resource": {"attributes": [{"key": "host.name", "value": {"stringValue": "n0"}}]},
                              "scopeLogs": [{"scope": {"name": "x"}, "logRecords": [rec]}]}]}


def test_a_packed_step_body_as_base64_bytes_value_is_stored(heads):
    h = heads()
    layout, packed = wire.pack_records("step", "runP", steps("runP", 7, range(10, 15), host="node-seven"))
    doc = hand_written_request("runP", packed, layout, trace_hex="0af7651916cd43dd8448eb211c80319c")
    st_, ct, out = post(h, "/v1/logs", zlib.compress(json.dumps(doc).encode()), JS, "deflate")
    assert (st_, ct, json.loads(out)) == (200, JS, {})
    rows = stored(h, "runP", "steps")
    assert rows["step"].tolist() == [10, 11, 12, 13, 14]
    assert set(rows["rank"]) == {7} and set(rows["host"]) == {"node-seven"}
    assert rows["step_ms"].tolist() == [110.0, 111.0, 112.0, 113.0, 114.0]


def test_hex_ids_are_read_as_hex_not_as_base64():
    """OTLP/JSON ids are hex; proto3 JSON (json_format alone) would read them as base64 and store other bytes."""
    trace = "5b8efff798038103d269b633813fc60c"
    doc = hand_written_request("r", b"", "step:i8", trace_hex=trace)
    req = rx.parse_json("logs", json.dumps(doc).encode())
    lr = req.resource_logs[0].scope_logs[0].log_records[0]
    assert lr.trace_id.hex() == trace and lr.span_id.hex() == trace[:16]
    assert lr.severity_number == 9 and lr.time_unix_nano == 1_700_000_000_000_000_000
    naive = ExportLogsServiceRequest()
    json_format.ParseDict(json.loads(json.dumps(doc)), naive)
    assert naive.resource_logs[0].scope_logs[0].log_records[0].trace_id.hex() != trace  # what the fix-up prevents


def test_the_metric_exporters_output_as_json_is_accepted(heads, capture):
    srv, bodies = capture
    exp = OTLPMetricExporter(endpoint=srv.url + "/v1/metrics", headers=AUTH, timeout=5)
    reader = PeriodicExportingMetricReader(exp, export_interval_millis=60_000)
    mp = MeterProvider(resource=Resource.create({wire.R_NODE: 3}), metric_readers=[reader])
    mp.get_meter("t").create_gauge("hw.gpu.utilization", unit="1").set(0.87, {"gpu": 0})
    mp.get_meter("t").create_histogram("ranksight.step.duration", unit="s").record(0.25, {"rank": 1})
    mp.get_meter("t").create_counter("c").add(5, {"k": "v"})
    assert mp.force_flush(5000)
    mp.shutdown()
    (_, pb_body), = [b for b in bodies if b[0] == "/v1/metrics"][:1]
    req = ExportMetricsServiceRequest.FromString(pb_body)
    # an exemplar with ids, so the metrics path's hex fix-up is exercised too
    dp = req.resource_metrics[0].scope_metrics[0].metrics[0]
    points = getattr(dp, dp.WhichOneof("data")).data_points
    ex = points[0].exemplars.add(time_unix_nano=5, as_double=1.0)
    ex.trace_id, ex.span_id = bytes(range(16)), bytes(range(8))
    js_body = otlp_json(req)
    assert rx.parse_json("metrics", js_body) == req  # the very message the protobuf path parses
    h = heads()
    st_, ct, out = post(h, "/v1/metrics", js_body, JS)
    assert (st_, ct, json.loads(out)) == (200, JS, {})
    assert h.ingest.metrics_latest[(3, "hw.gpu.utilization", (("gpu", "0"),))] == 0.87
    assert h.ingest.metrics_latest[(3, "ranksight.step.duration", (("rank", "1"),))] == 0.25
    assert h.ingest.metrics_latest[(3, "c", (("k", "v"),))] == 5.0


def test_partial_success_is_answered_as_json(heads):
    h = heads()
    recs = steps("runQ", 0, range(3)) + steps("other", 0, range(3, 4))
    body = wire.join_array([schema.encode(r) for r in recs])
    req = ExportLogsServiceRequest()
    sl = req.resource_logs.add().scope_logs.add()
    lr = sl.log_records.add(event_name=wire.EVENT_NAME)
    lr.body.string_value = body.decode()
    for k, v in ((wire.A_RUN, "runQ"), (wire.A_KIND, "step")):
        lr.attributes.add(key=k).value.string_value = v
    st_, ct, out = post(h, "/v1/logs", otlp_json(req), JS)
    assert (st_, ct) == (200, JS)
    ps = json.loads(out)["partialSuccess"]
    assert int(ps["rejectedLogRecords"]) == 1  # int64 as a string, as the JSON mapping writes it
    rej = wire_rejections.parse_rejections(ps["errorMessage"])
    assert rej.rejected[0].i == 0 and rej.rejected[0].rows == [3]
    assert stored(h, "runQ", "steps")["step"].tolist() == [0, 1, 2]


MALFORMED = [
    (b'{"resourceLogs": [', "truncated"),
    (b"[]", "not an object"),
    (b'"resourceLogs"', "a string"),
    (b'{"resourceLogs": 5}', "wrong type"),
    (b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"body": {"bytesValue": 7}}]}]}]}', "bytes as a number"),
    (b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"timeUnixNano": "soon"}]}]}]}', "bad int64"),
    (b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"timeUnixNano": "1e40"}]}]}]}', "int64 overflow"),
    (b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"traceId": "zz"}]}]}]}', "trace id not hex"),
    (b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"spanId": "0af7"}]}]}]}', "span id too short"),
    (b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"severityNumber": [9]}]}]}]}', "enum as a list"),
    (b'{"resourceLogs": [], "resourceLogs": ' + b"\xff" + b"}", "invalid UTF-8"),
    (b"[" * 5000 + b"]" * 5000, "deep nesting"),
    (b'{"resourceLogs": [{"resource": {"attributes": [{"key": "a", "value": ' + b'{"arrayValue": {"values": [' * 200
     + b"]}}" * 200 + b"}]}}]}", "deep AnyValue"),
]


def test_malformed_json_is_a_counted_400_with_a_clear_message(heads):
    h = heads()
    for body, what in MALFORMED:
        for enc, data in ((None, body), ("gzip", gzip.compress(body))):
            before = h.stats["http_4xx"]
            st_, ct, out = post(h, "/v1/logs", data, JS, enc)
            assert st_ == 400, (what, enc, st_, out)
            assert json.loads(out)["error"].startswith("malformed OTLP/JSON"), (what, out)
            assert h.stats["http_4xx"] == before + 1
    assert post(h, "/v1/metrics", b'{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"gauge": {"dataPoints": '
                                  b'[{"exemplars": [{"traceId": "nothex"}]}]}}]}]}]}', JS)[0] == 400
    st_, _, out = post(h, "/v1/logs", b"not gzip", JS, "gzip")
    assert st_ == 400 and b"gzip" in out
    assert post(h, "/v1/logs", b"{}", "text/plain")[0] == 415
    assert post(h, "/v1/logs", b"{}", JS, auth=False)[0] == 401
    # the documented ignores: unknown fields, and log records without ranksight attributes (a Collector's other
    # streams), are accepted and store nothing
    assert post(h, "/v1/logs", b'{"resourceLogs": [{"future": 1, "scopeLogs": [{"logRecords": [{"body": '
                               b'{"stringValue": "hello"}}]}]}]}', JS)[:2] == (200, JS)
    assert post(h, "/v1/logs", b"{}", JS)[0] == 200
    assert http_ok(h)


def test_json_bodies_keep_the_size_and_decompression_bounds(heads, monkeypatch):
    h = heads()
    bomb = gzip.compress(b'{"resourceLogs": [' + b" " * (4 * 1024 * 1024) + b"]}")
    monkeypatch.setattr(rx, "MAX_DECOMPRESSED_BYTES", 1024 * 1024)
    assert post(h, "/v1/logs", bomb, JS, "gzip")[0] == 413
    monkeypatch.setattr(rx, "MAX_BODY_BYTES", 64)
    monkeypatch.setattr(rx.read_body, "__defaults__", (64,))
    assert post(h, "/v1/logs", b'{"resourceLogs": []' + b" " * 100 + b"}", JS)[0] == 413
    # past the JSON cap (decoded JSON is Python objects, many times its bytes): 413 before any decoding
    monkeypatch.setattr(rx, "MAX_BODY_BYTES", 32 * 1024 * 1024)
    monkeypatch.setattr(rx.read_body, "__defaults__", (32 * 1024 * 1024,))
    monkeypatch.setattr(rx, "MAX_JSON_BYTES", 1000)
    st_, _, out = post(h, "/v1/logs", b'{"resourceLogs": []' + b" " * 1000 + b"}", JS)
    assert st_ == 413 and b"protobuf" in out
    big_pb = ExportLogsServiceRequest()
    big_pb.resource_logs.add().scope_logs.add().log_records.add().body.string_value = "x" * 2000
    assert post(h, "/v1/logs", big_pb.SerializeToString(), PB)[0] == 200  # the JSON cap is JSON's only
    # the decoded document's objects are reserved from the in-flight budget: 503 (retry) when it is spent
    monkeypatch.setattr(rx, "MAX_JSON_BYTES", 1024 * 1024)
    held = rx.INFLIGHT.used  # the budget is the process's: what other requests of this process hold
    monkeypatch.setattr(rx.INFLIGHT, "total", held + rx.JSON_EXPANSION * 500)
    assert post(h, "/v1/logs", b'{"resourceLogs": []' + b" " * 600 + b"}", JS)[0] == 503
    assert post(h, "/v1/logs", b'{"resourceLogs": []' + b" " * 400 + b"}", JS)[0] == 200
    assert rx.INFLIGHT.used == held  # every reservation given back


def http_ok(h) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
    try:
        conn.request("GET", "/api/health")
        return conn.getresponse().status == 200
    finally:
        conn.close()


# -- fuzz: any JSON body answers 200, 400, 413 or 415, never 500, and the head stays up ---------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.sampled_from(["", "0af7651916cd43dd8448eb211c80319c", "AAAA", "NaN", "1e5", "-1"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["resourceLogs", "scopeLogs", "logRecords", "body", "bytesValue", "stringValue", "intValue",
                         "attributes", "key", "value", "traceId", "spanId", "timeUnixNano", "severityNumber",
                         "kvlistValue", "arrayValue", "values", "resource", "scope", "x"]) | st.text(max_size=8),
        kids, max_size=4),
    max_leaves=25)


def _valid_doc() -> dict:
    layout, packed = wire.pack_records("step", "runF", steps("runF", 0, range(2)))
    return hand_written_request("runF", packed, layout)


def _replace_at(doc, path: list[int], value):
    """``doc`` with the node reached by walking ``path`` (indices into each container) replaced by ``value``."""
    node, parent, key = doc, None, None
    for p in path:
        if isinstance(node, dict) and node:
            parent, key = node, sorted(node)[p % len(node)]
        elif isinstance(node, list) and node:
            parent, key = node, p % len(node)
        else:
            break
        node = parent[key]
    if parent is None:
        return value
    parent[key] = value
    return doc


_bodies = st.one_of(
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda path, v: json.dumps(_replace_at(_valid_doc(), path, v)).encode(),
              st.lists(st.integers(min_value=0, max_value=10), max_size=12), _json_values),
    st.binary(max_size=200),
)


@pytest.fixture(scope="module")
def fuzz_head(tmp_path_factory):
    h = start_head(tmp_path_factory.mktemp("fuzz") / "store")
    yield h
    stop_head(h)


@fuzz_settings(120)
@given(body=_bodies, path=st.sampled_from(["/v1/logs", "/v1/metrics"]), gz=st.booleans())
def test_fuzzed_json_bodies_only_get_200_400_413_or_415(fuzz_head, body, path, gz):
    st_, ct, out = post(fuzz_head, path, gzip.compress(body) if gz else body, JS, "gzip" if gz else None)
    assert st_ in (200, 400, 413, 415), (st_, out[:300])
    if st_ == 200:
        assert ct == JS and isinstance(json.loads(out), dict)
    else:
        assert json.loads(out)["error"]
