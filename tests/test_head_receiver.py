"""The head's OTLP/HTTP receiver: real SDK exporter in, dedupe, and every kind of bad request -> 4xx, head stays up."""

import gzip
import json
import threading

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from ranksight import wire
from head.service import Head
from ranksight.tables import read_table
from ranksight import schema
from agent_helpers import TOKEN, http_json, http_status, serving


@pytest.fixture
def head(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None, flush_interval=0.2)
    with serving(h, poll=0.1, background=True):
        yield h


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def steps(run_id, rank, rng):
    return [schema.StepRecord(run_id=run_id, rank=rank, step=s, node=0, host="h", world_size=2, t_start=float(s),
                              t_end=s + 0.1, step_ms=100.0) for s in rng]


def log_records(run_id, recs, kind="step", rank=0):
    body = wire.join_array([schema.encode(r) for r in recs])
    return [wire.make_log_record(run_id, kind, body, rank=rank, count=len(recs), resource=Resource.create({}))]


def exporter(head, token=TOKEN, gzip_on=True):
    return OTLPLogExporter(endpoint=head.url + "/v1/logs", headers={"Authorization": f"Bearer {token}"}, timeout=5,
                           compression=Compression.Gzip if gzip_on else Compression.NoCompression)


def test_sdk_exporter_to_store_exactly_once(head):
    exp = exporter(head)
    assert exp.export(log_records("runA", steps("runA", 0, range(0, 50)))) == LogRecordExportResult.SUCCESS
    # an at-least-once resend overlapping the first batch
    assert exp.export(log_records("runA", steps("runA", 0, range(40, 60)))) == LogRecordExportResult.SUCCESS
    assert exporter(head, gzip_on=False).export(log_records("runA", steps("runA", 1, range(0, 60)), rank=1)) \
        == LogRecordExportResult.SUCCESS
    head.store.flush_all()
    df = read_table(head.store.root, "runA", "steps")
    assert len(df) == 120 and not df.duplicated(["rank", "step"]).any()
    assert head.stats["duplicates"] == 10
    ranks = http_json(head.url + "/api/runs/runA/ranks")[1]
    assert [(r["rank"], r["step"], r["state"]) for r in ranks] == [(0, 59, "running"), (1, 59, "running")]
    series = http_json(head.url + "/api/runs/runA/steps?since=55&rank=1")[1]
    assert [s["step"] for s in series] == [56, 57, 58, 59]
    assert http_status(head.url + "/api/runs/nope/ranks", None, AUTH, method="GET") == 404
    runs = http_json(head.url + "/api/runs")[1]
    assert runs[0]["run_id"] == "runA" and runs[0]["steps_stored"] == 120
    assert runs[0]["gpu_simulated"] is None  # no GPU samples yet: unknown, not "real"
    gpu = schema.GpuSample(node=0, host="h", gpu=0, t=1.0, source="simulated-nvml", simulated=True)
    assert exp.export(log_records("runA", [gpu], kind="gpu")) == LogRecordExportResult.SUCCESS
    runs = http_json(head.url + "/api/runs")[1]
    assert runs[0]["gpu_simulated"] is True


def test_otlp_metrics_from_the_sdk_are_accepted(head):
    exp = OTLPMetricExporter(endpoint=head.url + "/v1/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    reader = PeriodicExportingMetricReader(exp, export_interval_millis=60_000)
    mp = MeterProvider(resource=Resource.create({wire.R_NODE: 3}), metric_readers=[reader])
    g = mp.get_meter("t").create_gauge("gpu.utilization")
    g.set(87.0, {"gpu": 0})
    mp.get_meter("t").create_histogram("ranksight.step.duration").record(0.25, {"rank": 1})
    assert mp.force_flush(5000)
    mp.shutdown()
    assert head.stats["metric_points"] >= 2
    assert head.ingest.metrics_latest[(3, "gpu.utilization", (("gpu", "0"),))] == 87.0


def test_bad_requests_get_4xx_and_the_head_stays_up(head):
    url = head.url + "/v1/logs"
    good = ExportLogsServiceRequest().SerializeToString()
    pb = {"Content-Type": "application/x-protobuf"}
    auth = {"Authorization": f"Bearer {TOKEN}", **pb}
    assert http_status(url, good, pb) == 401  # no token
    assert http_status(url, good, {"Authorization": "Bearer wrong", **pb}) == 403
    assert http_status(url, b"\x0a\xff\xff\xff\xff\x0f garbage", auth) == 400  # malformed protobuf
    assert http_status(url, b"not gzip at all", {**auth, "Content-Encoding": "gzip"}) == 400
    assert http_status(url, gzip.compress(good)[:-6], {**auth, "Content-Encoding": "gzip"}) == 400  # truncated gzip
    assert http_status(url, good, {**auth, "Content-Encoding": "br"}) == 415
    assert http_status(url, b"{}", {**auth, "Content-Type": "text/plain"}) == 415  # OTLP/JSON: tests/test_otlp_json.py
    # a gzip bomb is refused after a bounded amount of work
    from head import receiver as otlp_receiver

    old = otlp_receiver.MAX_DECOMPRESSED_BYTES
    bomb = gzip.compress(b"\0" * (4 * 1024 * 1024))
    try:
        otlp_receiver.MAX_DECOMPRESSED_BYTES = 1024 * 1024  # read by decompress() at each call
        assert http_status(url, bomb, {**auth, "Content-Encoding": "gzip"}) == 413
    finally:
        otlp_receiver.MAX_DECOMPRESSED_BYTES = old
    assert http_status(head.url + "/v1/traces", good, auth) == 404
    assert http_status(head.url + "/api/runs/..%2Fetc/ranks", None, AUTH, method="GET") in (400, 404)
    # a well-formed request whose ranksight body is garbage: accepted records kept, the bad one
    # reported through OTLP partial success (never a retry loop for the agent)
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    lr = rl.scope_logs.add().log_records.add()
    for k, v in ((wire.A_RUN, "runB"), (wire.A_KIND, "step")):
        kv = lr.attributes.add()
        kv.key = k
        kv.value.string_value = v
    lr.body.string_value = '[{"kind":"step","rank":"not a number"}]'
    import urllib.request

    r = urllib.request.urlopen(urllib.request.Request(url, data=req.SerializeToString(), headers=auth, method="POST"))
    resp = ExportLogsServiceResponse()
    resp.ParseFromString(r.read())
    assert r.status == 200 and resp.partial_success.rejected_log_records == 1
    assert "does not decode" in resp.partial_success.error_message
    # records shipped under another run's id are refused, not stored under the wrong run
    recs = log_records("runC", steps("runOTHER", 0, range(3)))
    assert exporter(head).export(recs) == LogRecordExportResult.SUCCESS
    assert head.stats["rejected"] >= 2
    # still alive and still ingesting
    assert http_json(head.url + "/api/health")[1]["ok"]
    assert exporter(head).export(log_records("runB", steps("runB", 0, range(3)))) == LogRecordExportResult.SUCCESS
    assert head.stats["http_4xx"] >= 8


def test_writes_to_the_api_need_the_token(head):
    url = head.url + "/api/runs/runA/actions"
    body = b'{"action": "checkpoint"}'
    assert http_status(url, body, {"Content-Type": "application/json"}) == 401
    assert http_status(url, body, {"Authorization": "Bearer nope"}) == 403
    assert http_status(url, b'{"action": "reboot"}', {"Authorization": f"Bearer {TOKEN}"}) == 400
    assert http_status(url, b"[1,2", {"Authorization": f"Bearer {TOKEN}"}) == 400


def test_analyze_interval_zero_turns_live_analysis_off(tmp_path):
    # --analyze-interval 0: the head receives and stores but starts no analysis thread (bench/overhead.py's agent
    # job runs it so, live analysis being head-node work)
    h = Head(tmp_path / "runs", TOKEN, flush_interval=0.2, analyzer_interval=0)
    h.start_background()
    try:
        names = {t.name for t in h._threads}
        assert names == {"head-flush", "head-compact"}  # no head-analyze; the compactor merges closed hours
    finally:
        h.close()


def test_the_receiver_answers_503_when_the_wal_refuses(head, monkeypatch):
    """What the head cannot keep it does not acknowledge (issue 16 item 3): the exporter sees a failure and keeps the
    batch; once the disk takes writes again the same batch is stored, once."""
    import errno

    from head.store import wal as wal_mod

    real_write, real_writev = wal_mod.os.write, wal_mod.os.writev

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    exp = exporter(head)
    recs = log_records("full", steps("full", 0, range(5)))
    monkeypatch.setattr(wal_mod.os, "write", no_space)
    monkeypatch.setattr(wal_mod.os, "writev", no_space)  # packed bodies go to the WAL in one writev
    assert exp.export(recs) == LogRecordExportResult.FAILURE
    monkeypatch.setattr(wal_mod.os, "write", real_write)
    monkeypatch.setattr(wal_mod.os, "writev", real_writev)
    assert exp.export(recs) == LogRecordExportResult.SUCCESS
    exp.shutdown()
    head.store.flush_all()
    assert sorted(read_table(head.store.root, "full", "steps")["step"]) == [0, 1, 2, 3, 4]


def test_every_read_but_health_needs_the_token(head):
    """Issue 16 item 6: run data, the agents' control URLs and the counters are not open to whoever reaches the port."""
    exp = exporter(head)
    assert exp.export(log_records("sec", steps("sec", 0, range(3)))) == LogRecordExportResult.SUCCESS
    exp.shutdown()
    assert http_json(head.url + "/api/health", token="") == (200, {"ok": True})  # liveness only, nothing else
    for path in ("/api/stats", "/api/runs", "/api/runs/sec/ranks", "/api/runs/sec/agents", "/api/runs/sec/steps",
                 "/api/runs/sec/gpus", "/api/runs/sec/findings", "/api/runs/sec/coverage", "/api/runs/sec/actions"):
        assert http_status(head.url + path, None, method="GET") == 401, path
        assert http_status(head.url + path, None, {"Authorization": "Bearer wrong"}, method="GET") == 403, path
        assert http_status(head.url + path, None, AUTH, method="GET") == 200, path
    head.public_read = True  # `ranksight head --public-read`: behind an authenticating proxy
    assert http_status(head.url + "/api/runs", None, method="GET") == 200


def test_idle_and_surplus_connections_do_not_hold_threads(head, monkeypatch):
    """Issue 16 item 6: a half-sent request is dropped after the read timeout, and connections beyond the handler
    bound are answered 503 at once instead of each costing a thread."""
    import socket
    import time

    from head.api import make_server
    from ranksight import http_server
    from ranksight.http_server import serve_in_thread, shutdown_server

    monkeypatch.setattr(http_server.NoDelayHandler, "timeout", 0.5)
    srv = make_server(head, "127.0.0.1", 0)
    srv._slots = threading.BoundedSemaphore(4)  # a bound of 4 handlers for this test
    serve_in_thread(srv, "bounded-test")
    port = srv.server_address[1]
    try:
        held = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/logs HTTP/1.1\r\nContent-Length: 100\r\n")  # never finished
            held.append(s)
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert extra.recv(100).startswith(b"HTTP/1.1 503")  # over the bound: refused at once
        extra.close()
        assert srv.refused_busy == 1
        for s in held:  # the read timeout ends each half-sent request: the server closes the connection
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
            s.close()
        assert http_status(f"http://127.0.0.1:{port}/api/health", None, method="GET") == 200  # slots free again
    finally:
        shutdown_server(srv)
        srv.server_close()


def test_decompressed_bytes_in_flight_are_bounded_across_requests(head, monkeypatch):
    """Issue 16 item 5: each request's cap does not bound many together; the total in flight is bounded too (503:
    retry), and every byte is given back afterwards, whatever the outcome."""
    from head import receiver as rx

    url = head.url + "/v1/logs"
    auth = {**AUTH, "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
    monkeypatch.setattr(rx, "INFLIGHT", rx.InflightBudget(8 * 1024 * 1024))
    ok = gzip.compress(ExportLogsServiceRequest().SerializeToString())
    assert http_status(url, ok, auth) == 200 and rx.INFLIGHT.used == 0
    assert rx.INFLIGHT.take(7 * 1024 * 1024)  # other requests hold most of the budget
    big = gzip.compress(b"\0" * (6 * 1024 * 1024))
    assert http_status(url, big, auth) == 503
    rx.INFLIGHT.give(7 * 1024 * 1024)
    assert rx.INFLIGHT.used == 0  # the refused request gave back what it had reserved
    assert http_status(url, big, auth) == 400  # within budget now: decompressed, then not a valid protobuf
    assert rx.INFLIGHT.used == 0
    assert http_status(url, b"\x1f\x8b garbage", auth) == 400 and rx.INFLIGHT.used == 0


def test_a_foreign_record_is_refused_alone_and_the_rest_of_its_batch_kept(head):
    """Issue 16 item 5: one record of another run inside a batch no longer costs the whole batch."""
    recs = steps("mine", 0, range(5))
    recs[2] = schema.StepRecord(run_id="other", rank=0, step=2, node=0, host="h", world_size=2, t_start=2.0,
                                t_end=2.1, step_ms=100.0)
    exp = exporter(head)
    assert exp.export(log_records("mine", recs)) == LogRecordExportResult.SUCCESS  # partial success, not a retry
    exp.shutdown()
    assert head.stats["rejected"] == 1
    head.store.flush_all()
    assert sorted(read_table(head.store.root, "mine", "steps")["step"]) == [0, 1, 3, 4]


def test_actions_with_bad_fields_are_refused_not_accepted_and_lost(head):
    """Issue 16 item 5: every action the API accepts reaches the audit table; a field the table or the trainer cannot
    hold is a 400 at the boundary."""
    url = head.url + "/api/runs/acts/actions"
    bad = [{"action": "profile", "steps": 2**63}, {"action": "profile", "steps": 0}, {"action": "evict", "node": -1},
           {"action": "evict", "node": "1"}, {"action": "checkpoint", "ranks": ["x"]}, {"action": "checkpoint", "ranks": [2**40]},
           {"action": "checkpoint", "id": "a/../b"}, {"action": "checkpoint", "reason": "x" * 5000},
           {"action": "checkpoint", "dry_run": "yes"}, {"action": "explode"}]
    for body in bad:
        assert http_status(url, json.dumps(body).encode(), {**AUTH, "Content-Type": "application/json"}) == 400, body
    good = [{"action": "checkpoint", "dry_run": True}, {"action": "profile", "steps": 3, "dry_run": True},
            {"action": "evict", "node": 1, "ranks": [2, 3], "dry_run": True, "id": "ev-1", "reason": "test"}]
    for body in good:
        st, _ = http_json(url, body)
        assert st == 202 or st == 200
    head.store.flush_all()
    listed = http_json(url)[1]
    stored = read_table(head.store.root, "acts", "actions")
    assert len(listed) == 3 and sorted(stored["id"]) == sorted(a["id"] for a in listed)


def test_an_agent_connection_each_for_a_16384_rank_job(head):
    """Each node agent keeps one connection alive: 2,048 at 16,384 ranks on 8-GPU nodes. 600 of them (past the
    earlier bound of 512, which answered the rest 503 for as long as the others stayed connected) are all served."""
    import http.client

    conns = [http.client.HTTPConnection("127.0.0.1", int(head.url.rsplit(":", 1)[1]), timeout=60) for _ in range(600)]
    try:
        for c in conns:
            c.request("GET", "/api/runs", headers=AUTH)
        statuses = []
        for c in conns:
            r = c.getresponse()
            r.read()
            statuses.append(r.status)
        assert statuses == [200] * 600
        conns[0].request("GET", "/api/runs")  # the token is still asked on a kept-alive connection
        r = conns[0].getresponse()
        r.read()
        assert r.status == 401
    finally:
        for c in conns:
            c.close()


def test_the_head_raises_a_low_open_files_limit_to_hold_its_connections(tmp_path):
    """Many systems start a process with 1,024 open files, fewer than the head's connections: the head raises its
    soft limit (within the hard one) when it starts serving."""
    import subprocess
    import sys

    code = (
        "import resource, sys\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from head.api import HeadServer, make_server\n"
        "from head.service import Head\n"
        f"h = Head({str(tmp_path / 'store')!r}, 'tok', analyzer=None)\n"
        "srv = make_server(h, '127.0.0.1', 0)\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "want = HeadServer.max_handlers + 256\n"
        "print(now, want, hard)\n"
        "srv.server_close(); h.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    now, want, hard = (int(x) for x in out.stdout.split())
    assert now == (want if hard < 0 or hard >= want else hard)
