"""Per-record rejection (issue 16, item 5): the head says which log records, and which rows of them, it refused and
why; the agent keeps each refused record aside in ``<run>/agent/node-N.rejected.jsonl`` (bounded), counts it in its
metrics and exit report, and never sends it again. One poison row costs itself, not its batch."""

from __future__ import annotations

import json

import msgspec
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from prometheus_client.exposition import generate_latest

from agent_helpers import TOKEN
from conftest import free_port
from node.agent import NodeAgent
from node.outbox import Item
from ranksight import schema, wire, wire_rejections
from ranksight.layout import RunDir
from ranksight.tables import read_table
from test_agent_node import HeadThread


def _step(run_id: str, s: int, rank: int = 0) -> schema.StepRecord:
    return schema.StepRecord(run_id=run_id, rank=rank, step=s, node=0, host="h", world_size=1, t_start=float(s),
                             t_end=s + 0.2, step_ms=200.0)


POISON = b'{"kind":"step","run_id":"r","rank":"zero","step":9,"node":0,"host":"h","world_size":1}'


def _add(req, run_id: str, kind: str, body: str) -> None:
    lr = req.resource_logs[0].scope_logs[0].log_records.add()
    for k, v in ((wire.A_RUN, run_id), (wire.A_KIND, kind)):
        kv = lr.attributes.add()
        kv.key, kv.value.string_value = k, v
    lr.body.string_value = body


def test_the_head_names_each_refused_record_and_keeps_the_rest(tmp_path):
    import urllib.request

    port = free_port()
    h = HeadThread(tmp_path / "store", port)
    try:
        req = ExportLogsServiceRequest()
        req.resource_logs.add().scope_logs.add()
        enc = lambda recs: wire.join_array([schema.encode(r) for r in recs]).decode()  # noqa: E731
        _add(req, "r", "step", enc([_step("r", 0), _step("r", 1)]))  # 0: fine
        _add(req, "r", "step", wire.join_array([schema.encode(_step("r", 2)), POISON,
                                                schema.encode(_step("r", 3))]).decode())  # 1: row 1 is poison
        _add(req, "r", "step", enc([_step("r", 4), _step("other", 5), _step("r", 6), _step("other", 7)]))  # 2: foreign
        _add(req, "r", "step", "not json at all")  # 3: refused whole
        lr = req.resource_logs[0].scope_logs[0].log_records.add()  # 4: not ranksight's: skipped, still counted
        lr.body.string_value = "someone else's log line"
        _add(req, "r", "step", enc([_step("r", 8)]))  # 5: fine
        r = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/logs", data=req.SerializeToString(), method="POST",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf"}), timeout=10)
        resp = ExportLogsServiceResponse()
        resp.ParseFromString(r.read())
        assert r.status == 200 and resp.partial_success.rejected_log_records == 3
        got = json.loads(resp.partial_success.error_message)
        by_i = {e["i"]: e for e in got["rejected"]}
        assert sorted(by_i) == [1, 2, 3] and "more" not in got
        assert by_i[1]["rows"] == [1] and "does not decode" in by_i[1]["why"]
        assert by_i[2]["rows"] == [1, 3] and "of run 'other'" in by_i[2]["why"]
        assert "rows" not in by_i[3]
        h.head.store.flush_all()
        assert sorted(read_table(h.head.store.root, "r", "steps")["step"]) == [0, 1, 2, 3, 4, 6, 8]
    finally:
        h.close()


def test_the_rejection_message_is_bounded_valid_json():
    entries = [wire_rejections.Rejection(i=i, why="x" * 1000, rows=list(range(1000))) for i in range(5000)]
    msg = wire_rejections.rejections_message(entries)
    assert len(msg.encode()) <= wire_rejections.MAX_REJECTION_MESSAGE
    got = wire_rejections.parse_rejections(msg)
    assert got is not None and got.rejected and got.more == 5000 - len(got.rejected)
    first = got.rejected[0]
    assert len(first.why) == wire_rejections.MAX_WHY and len(first.rows) == wire_rejections.MAX_ROWS_LISTED
    assert first.rows_more == 1000 - wire_rejections.MAX_ROWS_LISTED
    assert wire_rejections.parse_rejections("bad run id 'x'") is None  # an older head's plain message


def _rejected_lines(rd: RunDir, node: int = 0) -> list[dict]:
    p = rd.agent_rejected(node)
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_the_agent_keeps_refused_records_aside_and_never_resends_them(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "r")
    port = free_port()
    h = HeadThread(store, port)
    rd.spool_dir.mkdir(parents=True)
    foreign = schema.encode(_step("other", 2))
    with open(rd.spool(0), "wb") as f:  # a spool line of another run among this run's (it travels as JSON)
        f.write(b"".join(schema.encode(_step("r", s)) + b"\n" if s != 2 else foreign + b"\n" for s in range(5)))
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", ship_timeout=5, otlp_metrics=False)
    sent = []
    real_export = a.shipper.export

    def counting_export(items, snapshots=None):
        sent.extend(items)
        return real_export(items, snapshots)

    a.shipper.export = counting_export
    try:
        # an outbox segment from before (head was away) with a poison row among good ones
        a.outbox.append([Item(kind="step", body=wire.join_array([schema.encode(_step("r", 10)), POISON,
                                                                 schema.encode(_step("r", 11))]), rank=0, count=3)])
        a.cycle()
        lines = _rejected_lines(rd)
        assert sorted(x["raw"] for x in lines) == sorted([POISON.decode(), foreign.decode()])
        assert all(x["kind"] == "step" and x["why"] and x["t"] > 0 for x in lines)
        assert a.rejected.kept == 2 and a.rejected.not_kept == 0 and len(a.outbox) == 0
        text = generate_latest(a.metrics.registry).decode()
        assert 'ranksight_agent_rejected_records_total{node="0"} 2.0' in text
        assert 'ranksight_agent_records_shipped_total{node="0"} 6.0' in text  # 4 of the spool's 5, 2 of the outbox's 3
        n_sent = len(sent)
        for _ in range(3):
            a.cycle()  # nothing new: the refused records are not sent again
        assert len(sent) == n_sent and len(_rejected_lines(rd)) == 2
        h.head.store.flush_all()
        assert sorted(read_table(store, "r", "steps")["step"]) == [0, 1, 3, 4, 10, 11]
    finally:
        report = a.close()
        h.close()
    assert report.rejected_records == 2 and report.rejected_not_kept == 0
    on_disk = json.loads(rd.agent_exit_report(0).read_bytes())
    assert on_disk["rejected_records"] == 2 and on_disk["rejected_file"].endswith("node-0.rejected.jsonl")


def test_the_rejected_file_is_bounded_and_counts_what_it_could_not_keep(tmp_path):
    from node.rejected import RejectedLog

    log = RejectedLog(tmp_path / "node-0.rejected.jsonl", max_bytes=1000)
    body = wire.join_array([schema.encode(_step("other", s)) for s in range(40)])
    n = log.keep(Item(kind="step", body=body, count=40), wire_rejections.Rejection(i=0, why="of run 'other'"))
    assert n == 40 and log.kept + log.not_kept == 40 and 0 < log.kept < 40
    assert (tmp_path / "node-0.rejected.jsonl").stat().st_size <= 1000
    log.not_itemized(3)  # an older head's plain message: refused, not named
    assert log.total == 43
    # a packed body is kept as bytes, with its layout
    packed = wire.pack_records("step", "r", [_step("r", 1)])
    assert packed is not None
    log2 = RejectedLog(tmp_path / "b.jsonl")
    assert log2.keep(Item(kind="step", body=packed[1], count=1, layout=packed[0]), wire_rejections.Rejection(i=0, why="w")) == 1
    (line,) = [msgspec.json.decode(x) for x in (tmp_path / "b.jsonl").read_bytes().splitlines()]
    assert line["layout"] == packed[0] and line["raw_b64"]
