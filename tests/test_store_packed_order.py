"""Packed bodies of several layouts in one flush: the store makes one array of them in arrival order (the live
window keeps rows in arrival order), and agents leave fields that a whole batch holds at their default out of the
layout; the stored rows are the same as from the JSON path."""

from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk.resources import Resource

from head.service import Head
from head.store.arrow import merge_packed
from ranksight import schema, wire
from ranksight.simgpu import throttle_names
from ranksight.tables import read_table

TOKEN = "t"


def step(rank, s, **kw):
    d = dict(run_id="r1", rank=rank, step=s, node=0, host="h", world_size=4, t_start=1000.0 + s, t_end=1000.5 + s,
             step_ms=500.0 + rank)
    d.update(kw)
    return schema.StepRecord(**d)


def request(batches, kind="step", packed=True):
    recs = []
    for rows in batches:
        p = wire.pack_records(kind, "r1", rows) if packed else None
        if p is not None:
            recs.append(wire.make_log_record("r1", kind, p[1], node=0, count=len(rows), layout=p[0],
                                             resource=Resource.create({})))
        else:
            recs.append(wire.make_log_record("r1", kind, wire.join_array([schema.encode(r) for r in rows]), node=0,
                                             count=len(rows), resource=Resource.create({})))
    req = ExportLogsServiceRequest()
    req.ParseFromString(encode_logs(recs).SerializeToString())
    return req


def test_a_flush_of_several_layouts_keeps_arrival_order_in_the_live_window(tmp_path):
    # hosts of two widths (S8, S16): two layouts, alternating request by request, all processed in one go
    h = Head(tmp_path, TOKEN, analyzer=None, window=4)
    for s in range(10):
        host = "h" if s % 2 else "a-longer-host"
        h.ingest.logs(request([[step(r, s, host=host) for r in range(2)]]))
    live = h.live.run("r1")
    assert [x.step for x in live.steps_since(-1, rank=1)] == [6, 7, 8, 9]  # the last four, not the last of a layout
    assert [(x.step, x.host) for x in live.steps_since(7, rank=0)] == [(8, "a-longer-host"), (9, "h")]
    h.close()


def test_fields_a_batch_leaves_at_their_default_are_left_out_and_stored_the_same(tmp_path):
    rows = [step(r, s, loss=2.5 if s % 2 else None, overflow=bool(s == 3), grad_norm=None) for s in range(6)
            for r in range(2)]
    layout, body = wire.pack_records("step", "r1", rows[:2])
    assert "grad_norm" not in layout and "overflow" not in layout and "loss" not in layout and "attempt" not in layout
    assert len(body) < 2 * wire.packed_layout_of("step", wire.PACKED_LAYOUTS["step"]).dtype.itemsize
    for where, packed in (("p", True), ("j", False)):
        h = Head(tmp_path / where, TOKEN, analyzer=None)
        acc, rej, why = h.ingest.logs(request([rows[i:i + 2] for i in range(0, 12, 2)], packed=packed))
        assert (acc, rej) == (12, 0), why
        h.close()
    a = read_table(tmp_path / "p", "r1", "steps").sort_values(["rank", "step"]).reset_index(drop=True)
    b = read_table(tmp_path / "j", "r1", "steps").sort_values(["rank", "step"]).reset_index(drop=True)
    assert a.equals(b)
    assert a["overflow"].sum() == 2 and a["loss"].isna().sum() == 6  # step 3 of both ranks; even steps


def test_gpu_samples_with_and_without_throttle_reasons_merge():
    g = [schema.GpuSample(node=0, host="n", gpu=i, t=1.0, source="nvml", simulated=False, throttle_reasons=m,
                          throttle_names=throttle_names(m))
         for i, m in enumerate((0, 4))]
    chunks = []
    for rows in ([g[0]], [g[1]]):
        layout, body = wire.pack_records("gpu", "", rows)
        chunks.append((wire.packed_layout_of("gpu", layout), body))
    assert "throttle_reasons" not in chunks[0][0].codes and "throttle_reasons" in chunks[1][0].codes
    arr, lay = merge_packed("gpu", chunks)
    assert arr["throttle_reasons"].tolist() == [0, 4] and arr["gpu"].tolist() == [0, 1]
    assert "util_pct" not in lay.codes and "throttle_names" in lay.derived  # None in both: left out of both
