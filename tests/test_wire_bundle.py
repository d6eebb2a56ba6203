"""bundle-v1: one log record per agent and cycle holding its packed batches and its heartbeat. The head stores the
same rows as from one log record per batch; a truncated or garbage bundle is refused whole (a recorded rejection, not
a crash) while the rest of the request is kept; the agent bundles, names each part of a refused bundle, and falls
back to one log record per batch when a head does not know bundles."""

import gzip

import msgspec
import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.sdk.resources import Resource

from agent_helpers import TOKEN, http_status, serving
from head.service import Head
from node import shipping
from node.outbox import Item
from node.prom import AgentMetrics
from node.sources import Snapshot
from ranksight import schema, wire, wire_rejections
from ranksight.tables import read_table

RUN = "r1"


def steps(node, step):
    return [schema.StepRecord(run_id=RUN, rank=node * 2 + r, step=step, node=node, host=f"n{node}", world_size=4,
                              t_start=step + 0.0, t_end=step + 0.5, step_ms=500.0 + r) for r in range(2)]


def colls(node, step):
    return [schema.CollectiveRecord(run_id=RUN, rank=node * 2 + r, step=step, seq=step, op="all_reduce", group="dp",
                                    nbytes=1 << 20, t_arrive=step + 0.4, t_done=step + 0.45, duration_ms=50.0,
                                    comm_id="c0ffee") for r in range(2)]


def gpus(node, step):
    return [schema.GpuSample(node=node, host=f"n{node}", gpu=g, t=step + 0.25, source="python-sim", simulated=True,
                             util_pct=90.0) for g in range(2)]


def heartbeat(node, t=100.0):
    return wire.Heartbeat(node=node, host=f"n{node}", t=t, ranks=[node * 2, node * 2 + 1])


def sections(node, step):
    out = []
    for kind, rows in (("step", steps(node, step)), ("collective", colls(node, step)), ("gpu", gpus(node, step))):
        layout, body = wire.pack_records(kind, RUN, rows)
        out.append((kind, layout, body, len(rows)))
    out.append(("heartbeat", None, msgspec.json.encode(heartbeat(node)), 1))
    return out


def request(records) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    req.ParseFromString(encode_logs(records).SerializeToString())
    return req


def bundle_record(body, node=0):
    return wire.make_log_record(RUN, wire.KIND_BUNDLE, body, node=node, resource=Resource.create({}), bundle=True)


def unbundled_records(node, step):
    return [wire.make_log_record(RUN, k, b, node=node, count=c, layout=lay, resource=Resource.create({}))
            for k, lay, b, c in sections(node, step)]


def test_bundle_sections_round_trip():
    secs = sections(0, 1)
    body = wire.pack_bundle(secs)
    assert [(k, lay or "", c, p) for k, lay, p, c in secs] == wire.bundle_sections(body)
    with pytest.raises(ValueError):
        wire.pack_bundle([("step", "a\tb", b"", 0)])


@pytest.mark.parametrize("cut", [1, 10, 40, -1])
def test_a_truncated_bundle_is_refused_whole(cut):
    body = wire.pack_bundle(sections(0, 1))
    with pytest.raises(wire.WireError):
        wire.bundle_sections(body[:cut] if cut > 0 else body[:cut])


def test_a_bundle_stores_what_one_record_per_batch_stores(tmp_path):
    for where, recs in (("b", [bundle_record(wire.pack_bundle(sections(n, s)), n) for n in range(2) for s in (1, 2)]),
                        ("u", [r for n in range(2) for s in (1, 2) for r in unbundled_records(n, s)])):
        h = Head(tmp_path / where, TOKEN, analyzer=None)
        acc, rej, why = h.ingest.logs(request(recs))
        assert (acc, rej) == (24, 0), why
        # the heartbeat inside the bundle reached the live view
        assert h.live.runs[RUN].agents[1].host == "n1" and h.live.runs[RUN].agents[1].heartbeat.ranks == [2, 3]
        h.close()
    for table, key in (("steps", ["rank", "step"]), ("collectives", ["rank", "seq"]), ("gpu", ["node", "gpu", "t"])):
        a = read_table(tmp_path / "b", RUN, table).sort_values(key).reset_index(drop=True)
        b = read_table(tmp_path / "u", RUN, table).sort_values(key).reset_index(drop=True)
        assert len(a) == 8 and a.equals(b), table


def test_a_resent_bundle_is_deduplicated(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    rec = bundle_record(wire.pack_bundle(sections(0, 1)))
    assert h.ingest.logs(request([rec]))[:2] == (6, 0)
    assert h.ingest.logs(request([rec]))[:2] == (6, 0)
    h.close()
    assert len(read_table(tmp_path, RUN, "steps")) == 2 and len(read_table(tmp_path, RUN, "collectives")) == 2


@pytest.mark.parametrize("bad", ["truncated", "garbage", "count", "kind", "layout", "json", "nested"])
def test_a_bad_bundle_is_one_recorded_rejection_and_the_rest_is_kept(tmp_path, bad):
    good = wire.pack_bundle(sections(0, 1))
    body = {
        "truncated": good[:-7],
        "garbage": b"\x00\xff not a bundle at all",
        "count": wire.pack_bundle([(k, lay, b, c + 1 if k == "step" else c) for k, lay, b, c in sections(0, 1)]),
        "kind": wire.pack_bundle([("nonsense", None, b"[]", 0)]),
        "layout": wire.pack_bundle([("step", "rank:i8,bogus:f8", b"\0" * 16, 1)]),
        "json": wire.pack_bundle([("heartbeat", None, b"{not json", 1)]),
        "nested": wire.pack_bundle([("bundle", None, good, 1)]),
    }[bad]
    h = Head(tmp_path, TOKEN, analyzer=None)
    before = h.stats["rejected"]
    acc, rej, refused = h.ingest.logs(request([bundle_record(good, 0), bundle_record(body, 1)]))
    assert rej == 1 and [r.i for r in refused] == [1] and refused[0].why.startswith("bundle: ")
    assert acc == 6 and h.stats["rejected"] == before + 1
    h.close()
    assert sorted(read_table(tmp_path, RUN, "steps")["rank"]) == [0, 1]  # node 0's bundle was kept


def test_a_bad_bundle_over_http_is_a_partial_success_and_garbage_a_400(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None, flush_interval=0.2)
    with serving(h, poll=0.1, background=True):
        url = h.url + "/v1/logs"
        hdr = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}
        body = encode_logs([bundle_record(wire.pack_bundle(sections(0, 1))[:-3])]).SerializeToString()
        import urllib.request

        req = urllib.request.Request(url, data=gzip.compress(body), headers=hdr, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            resp = ExportLogsServiceResponse()
            resp.ParseFromString(r.read())
        assert resp.partial_success.rejected_log_records == 1
        assert wire_rejections.parse_rejections(resp.partial_success.error_message).rejected[0].why.startswith("bundle")
        assert http_status(url, gzip.compress(body[: len(body) // 2]), hdr) == 400  # the protobuf itself cut short
        assert http_status(h.url + "/api/health", None, {}, method="GET") == 200  # the head stays up


class FakeShipper(shipping.Shipper):
    """A Shipper whose export goes to ``answer(records) -> Exported`` instead of HTTP."""

    def __init__(self, answer):
        super().__init__("http://127.0.0.1:9", "t", run_id=RUN, node=0, host="n0", agent_id="a", timeout=1,
                         metrics=AgentMetrics())
        self.answer = answer
        self.sent: list[list] = []

    def _export(self, recs):
        self.sent.append(recs)
        return self.answer(recs)


def items():
    out = []
    for k, lay, b, c in sections(0, 1)[:3]:
        out.append(Item(kind=k, body=b, count=c, layout=lay))
    out.append(Item(kind="event", body=b"[]", count=0))  # a JSON batch: its own log record
    return out


def kinds(recs):
    return [r.log_record.attributes[wire.A_KIND] for r in recs]


def test_the_agent_bundles_packed_batches_and_the_heartbeat():
    sh = FakeShipper(lambda recs: shipping.Exported(ok=True))
    hb = Snapshot(kind="heartbeat", body=msgspec.json.encode(heartbeat(0)))
    assert sh.export(items(), [hb]).ok
    assert kinds(sh.sent[0]) == ["bundle", "event"]
    secs = wire.bundle_sections(bytes(sh.sent[0][0].log_record.body))
    assert [s[0] for s in secs] == ["step", "collective", "gpu", "heartbeat"]


def test_a_refused_bundle_names_each_of_its_parts():
    sh = FakeShipper(lambda recs: shipping.Exported(ok=True, refused=[wire_rejections.Rejection(i=0, why="bundle: truncated"),
                                                                       wire_rejections.Rejection(i=1, why="bad event")]))
    hb = Snapshot(kind="heartbeat", body=msgspec.json.encode(heartbeat(0)))
    res = sh.export(items(), [hb])
    assert sorted((r.i, r.why) for r in res.refused) == [(0, "bundle: truncated"), (1, "bundle: truncated"),
                                                         (2, "bundle: truncated"), (3, "bad event"),
                                                         (4, "bundle: truncated")]
    assert sh.bundle  # a new head's refusal: bundles stay on


def test_the_agent_falls_back_to_one_record_per_batch_for_an_older_head():
    def older_head(recs):  # what a head before bundle-v1 answers (ranksight.wire.iter_indexed of then)
        refused = [wire_rejections.Rejection(i=i, why=f"{k}: encoding 'bundle-v1' with a bytes_value body (expected packed-v1 "
                                               "bytes)") for i, k in enumerate(kinds(recs)) if k == "bundle"]
        return shipping.Exported(ok=True, refused=refused)

    sh = FakeShipper(older_head)
    hb = Snapshot(kind="heartbeat", body=msgspec.json.encode(heartbeat(0)))
    res = sh.export(items(), [hb])
    assert res.ok and res.refused == [] and not sh.bundle
    assert kinds(sh.sent[0]) == ["bundle", "event"]
    assert kinds(sh.sent[1]) == ["step", "collective", "gpu", "heartbeat"]  # the bundle's parts, again, one each
    sh.export(items(), [hb])
    assert kinds(sh.sent[2]) == ["step", "collective", "gpu", "event", "heartbeat"]  # no more bundles
