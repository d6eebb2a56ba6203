"""GPU samples packed on the wire (packed-v1 with the ``n8`` nullable int64 code and ``throttle_names`` derived from
``throttle_reasons``), and the ingest pieces made cheaper for 16,384 ranks: the GPU dedupe of packed rows, the
collective group names factorized by a verified hash, the WAL's one-writev append, the live window's lazy GPU
samples. Each test compares with the path that was there before (JSON bodies, ``np.unique``, ``os.write``)."""

import errno
import os

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk.resources import Resource

from head.service import Head
from head.store import dedupe
from head.store import wal as wal_mod
from head.store.dedupe import CollectiveIndex
from ranksight import schema, wire
from ranksight.simgpu import throttle_names
from ranksight.tables import read_table

TOKEN = "t"


def gpu(node, g, t, **kw):
    d = dict(node=node, host=f"node{node:03d}", gpu=g, t=t, source="nvml", simulated=False, name="NVIDIA H100 80GB HBM3",
             uuid=f"GPU-{node:04d}-{g:02d}", util_pct=97.0, mem_used_bytes=(70 << 30) + g, mem_total_bytes=80 << 30,
             power_w=640.0, temp_c=61.0, sm_clock_mhz=1980.0, throttle_reasons=0, throttle_names=[])
    d.update(kw)
    return schema.GpuSample(**d)


def request(batches, packed=True):
    """An ExportLogsServiceRequest of GPU sample batches (one log record each), packed as the agent packs them."""
    recs = []
    for rows in batches:
        p = wire.pack_records("gpu", "", rows) if packed else None
        if p is not None:
            recs.append(wire.make_log_record("r1", "gpu", p[1], node=rows[0].node, count=len(rows), layout=p[0],
                                             resource=Resource.create({})))
        else:
            recs.append(wire.make_log_record("r1", "gpu", wire.join_array([schema.encode(r) for r in rows]),
                                             node=rows[0].node, count=len(rows), resource=Resource.create({})))
    req = ExportLogsServiceRequest()
    req.ParseFromString(encode_logs(recs).SerializeToString())
    return req


def samples():
    """Samples as real probes make them: memory figures set or unknown (None), ECC counters, throttle reasons with
    their names, an unknown power reading."""
    out = []
    for node in range(3):
        for g in range(4):
            for s in range(5):
                mask = [0, 1, 5, 0x8000_0000_0000][(node + g + s) % 4]
                out.append(gpu(node, g, 1000.0 + s + g / 10, throttle_reasons=mask, throttle_names=throttle_names(mask),
                               ecc_sbe=None if g % 2 else s, mem_used_bytes=None if (g, s) == (3, 4) else (1 << 40) + s,
                               power_w=None if s == 2 else 600.0 + g))
    return out


def test_gpu_samples_pack_and_store_the_same_rows_as_json(tmp_path):
    rows = samples()
    p = wire.pack_records("gpu", "", rows)
    assert p is not None and "mem_used_bytes:n8" in p[0] and "throttle_names" not in p[0]
    for packed, where in ((True, "p"), (False, "j")):
        h = Head(tmp_path / where, TOKEN, analyzer=None)
        acc, rej, msg = h.ingest.logs(request([rows[:30], rows[30:]], packed=packed))
        assert (acc, rej) == (60, 0), msg
        h.close()
    key = ["node", "gpu", "t"]
    a = read_table(tmp_path / "p", "r1", "gpu").sort_values(key).reset_index(drop=True)
    b = read_table(tmp_path / "j", "r1", "gpu").sort_values(key).reset_index(drop=True)
    assert len(a) == 60 and a.drop(columns=["throttle_names"]).equals(b.drop(columns=["throttle_names"]))
    assert [list(x) for x in a["throttle_names"]] == [list(x) for x in b["throttle_names"]]
    assert a["mem_used_bytes"].isna().sum() == 3 and a["ecc_sbe"].isna().sum() == 30  # nulls stay nulls
    assert ["gpu_idle", "sw_power_cap"] in [list(x) for x in a["throttle_names"]]


def test_gpu_samples_that_cannot_be_packed_exactly_go_as_json():
    assert wire.pack_records("gpu", "", [gpu(0, 0, 1.0, throttle_reasons=1, throttle_names=[])]) is None  # not derived
    assert wire.pack_records("gpu", "", [gpu(0, 0, 1.0, mem_used_bytes=wire.NULL_INT)]) is None  # the null's value
    assert wire.pack_records("gpu", "", [gpu(0, 0, 1.0, mem_used_bytes=1 << 64)]) is None  # beyond int64
    assert wire.pack_records("gpu", "", [gpu(0, 0, 1.0, uuid="u" * 65)]) is None  # wider than a packed string
    assert wire.pack_records("gpu", "", [gpu(0, 0, 1.0)]) is not None


def test_gpu_samples_are_stored_once_across_resends_and_restarts(tmp_path):
    rows = samples()
    h = Head(tmp_path, TOKEN, analyzer=None)
    h.ingest.logs(request([rows[:40]]))
    h.ingest.logs(request([rows[20:], rows[20:]]))  # an overlapping resend, and a batch twice in one request
    h.ingest.logs(request([rows[50:]], packed=False))  # an older agent's JSON
    h.store.flush_all()
    assert h.stats["duplicates"] == 20 + 40 + 10
    h.close()
    h2 = Head(tmp_path, TOKEN, analyzer=None)  # keys come back from the part files
    h2.ingest.logs(request([rows]))
    assert h2.stats["duplicates"] == 0  # counted when the queue is processed
    h2.store.flush_all()
    assert h2.stats["duplicates"] == 60
    h2.close()
    df = read_table(tmp_path, "r1", "gpu")
    assert len(df) == 60 and not df.duplicated(["node", "gpu", "t"]).any()


def test_malformed_packed_gpu_bodies_are_rejected_with_a_reason(tmp_path):
    """A truncated or garbage body, or a layout that lies about a field's type: refused (a recorded rejection in the
    partial success), the head goes on, and a good batch in the same request is stored."""
    from tests.test_ingest_columnar import raw_request

    h = Head(tmp_path, TOKEN, analyzer=None)
    layout, body = wire.pack_records("gpu", "", [gpu(0, g, 1.0) for g in range(2)])
    base = {wire.A_RUN: "r1", wire.A_KIND: "gpu", wire.A_ENCODING: wire.ENC_PACKED, wire.A_LAYOUT: layout}
    bad = [
        (base, body[:-5]),  # truncated
        (base, b"\x00garbage"),
        ({**base, wire.A_LAYOUT: layout.replace("mem_used_bytes:n8", "mem_used_bytes:i8")}, body),
        ({**base, wire.A_LAYOUT: layout.replace("util_pct:f8", "util_pct:n8")}, body),  # n8 for a float
        ({**base, wire.A_LAYOUT: layout + ",throttle_names:S8"}, body),  # a list is not packable
    ]
    for attrs, b in bad:
        acc, rej, msg = h.ingest.logs(raw_request(attrs, b))
        assert (acc, rej) == (0, 1) and msg and msg[0].why, (attrs, msg)
    req = raw_request(base, body[:-1])
    req.resource_logs.extend(request([[gpu(1, 0, 5.0)]]).resource_logs)
    assert h.ingest.logs(req)[:2] == (1, 1)
    assert h.stats["rejected"] == len(bad) + 1
    h.close()
    assert read_table(tmp_path, "r1", "gpu")["node"].tolist() == [1]


def test_the_live_window_shows_packed_gpu_samples_in_order_and_bounded(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    live = h.live.run("r1")
    cap = live.gpu.maxlen
    n = cap + 500
    rows = [gpu(i // 8, i % 8, 1000.0 + i) for i in range(n)]
    for k in range(0, n, 1000):
        h.ingest.logs(request([rows[k:k + 1000]]))
        h.store.runs["r1"].process()
    h.ingest.logs(request([[gpu(9999, 0, 5e6)]], packed=False))  # a JSON batch after the packed ones
    h.store.runs["r1"].process()
    g = list(live.gpu)
    assert len(g) == cap and g[-1].node == 9999  # arrival order kept, the oldest evicted as before
    assert [x.t for x in g[:-1]] == [r.t for r in rows[-(cap - 1):]]
    assert g[0].mem_used_bytes == rows[-(cap - 1)].mem_used_bytes and isinstance(g[0], schema.GpuSample)
    h.close()


def test_group_names_factorized_by_hash_agree_with_np_unique():
    rng = np.random.default_rng(1)
    names = np.array([b"tp", b"dp", b""] + [f"pp:{i}>{i + 8}".encode() for i in range(3000)] + [b"x" * 21] * 5,
                     dtype="S24")
    names = names[rng.integers(0, len(names), 20000)]
    for arr in (names, names.astype("S21"), names.astype("S40"), names[:1]):
        codes, uniq = dedupe._factorize_bytes(arr)
        assert (uniq[codes] == arr).all()
        assert sorted(uniq.tolist()) == np.unique(arr).tolist()


def test_a_hash_collision_falls_back_to_the_exact_path(monkeypatch):
    """With a mixing constant of 0 every name hashes to its last 8 bytes: names alike there collide, the check
    catches it, and the index still tells them apart."""
    monkeypatch.setattr(dedupe, "_MIX", np.uint64(0))
    arr = np.array([b"aaaaaaaa-same-tail", b"bbbbbbbb-same-tail"] * 3, dtype="S24")
    assert dedupe._factorize_bytes(arr) is None
    idx = CollectiveIndex()
    b = idx._b(np.zeros(len(arr), np.int64), arr)
    assert len(set(b[:2].tolist())) == 2 and (b[:2] == b[2:4]).all()


def test_the_wal_takes_packed_bodies_in_one_writev_whole_or_not_at_all(tmp_path, monkeypatch):
    w = wal_mod.WriteAheadLog(tmp_path)
    w.open()
    lay = wire.packed_layout_of("gpu", wire.pack_records("gpu", "", [gpu(0, 0, 1.0)])[0])
    batches = [wire.PackedBatch(lay, wire.pack_records("gpu", "", [gpu(0, g, 1.0)])[1], 1) for g in range(3)]
    calls = []
    real_writev = os.writev
    monkeypatch.setattr(wal_mod.os, "writev", lambda fd, bufs: calls.append(len(bufs)) or real_writev(fd, bufs))
    w.append_parts(w.packed_parts("gpu", batches))
    assert calls == [1 + 3 * 3]  # the layout's definition, then header, body, newline per batch: one system call
    path = tmp_path / wal_mod.WAL_CURRENT
    good = path.stat().st_size

    def short_then_full(fd, bufs):  # half of it lands, then the disk is full
        data = b"".join(bufs)
        return os.write(fd, data[: len(data) // 2])

    def no_space(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wal_mod.os, "writev", short_then_full)
    monkeypatch.setattr(wal_mod.os, "write", no_space)
    with pytest.raises(wal_mod.WalFull, match="No space left"):
        w.append_parts(w.packed_parts("gpu", batches))
    assert path.stat().st_size == good  # no torn entry left behind
    w.close()
    got = list(wal_mod.read_batches(path))
    assert [b.count for b in got] == [1, 1, 1] and [b.payload for b in got] == [b.payload for b in batches]


def test_the_agent_ships_its_gpu_samples_packed(tmp_path):
    import threading

    from node.sources.samples import SampleSource

    src = SampleSource.__new__(SampleSource)  # only collect(): no probes, no thread
    src._buffer = [("gpu", gpu(0, g, 1.0 + g)) for g in range(8)] + [("gpu", gpu(0, 0, 9.0, name="n\0ul"))]
    src._lock = threading.Lock()
    items = src.collect()
    assert [i.kind for i in items] == ["gpu"] and items[0].layout is None  # one sample cannot be packed: JSON
    src._buffer = [("gpu", gpu(0, g, 1.0 + g)) for g in range(8)]
    (item,) = src.collect()
    assert item.layout is not None and item.count == 8
    lay = wire.packed_layout_of("gpu", item.layout)
    assert wire.packed_count(lay, item.body) == 8


def test_a_layout_defined_by_a_refused_write_is_defined_again(tmp_path, monkeypatch):
    """The first batch of a layout carries the layout's definition into the WAL. When the disk refuses that write,
    the next batch must define it again: an entry naming a layout id the file never defined is unreadable at replay,
    and its acknowledged rows were lost (the head remembered the id as written)."""
    from head.store import Store
    from tests.test_ingest_columnar import step

    st = Store(tmp_path)
    rs = st.run("r1")
    lay, body = wire.pack_records("step", "r1", [step(0, s) for s in range(4)])
    batch = wire.PackedBatch(wire.packed_layout_of("step", lay), body, 4)

    def no_space(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wal_mod.os, "writev", no_space)
    monkeypatch.setattr(wal_mod.os, "write", no_space)
    with pytest.raises(wal_mod.WalFull):
        rs.enqueue_packed("steps", [batch])
    monkeypatch.undo()
    rs.enqueue_packed("steps", [batch])  # acknowledged
    del rs, st  # kill -9: no flush
    st2 = Store(tmp_path)
    st2.open_existing()
    st2.close()
    assert sorted(read_table(tmp_path, "r1", "steps")["step"]) == [0, 1, 2, 3]


def test_one_request_is_one_wal_write(tmp_path, monkeypatch):
    """A request's steps, collectives and GPU samples of one run reach the WAL in one system call."""
    h = Head(tmp_path, TOKEN, analyzer=None)
    from tests.test_ingest_columnar import step

    reqs = request([[gpu(0, g, 1.0) for g in range(8)]])
    reqs.resource_logs.extend(_steps_request([step(r, 0) for r in range(8)]).resource_logs)
    calls = []
    real_writev, real_write = os.writev, os.write
    monkeypatch.setattr(wal_mod.os, "writev", lambda fd, b: calls.append("writev") or real_writev(fd, b))
    monkeypatch.setattr(wal_mod.os, "write", lambda fd, b: calls.append("write") or real_write(fd, b))
    assert h.ingest.logs(reqs)[:2] == (16, 0)
    assert calls == ["writev"]
    h.close()
    assert len(read_table(tmp_path, "r1", "gpu")) == 8 and len(read_table(tmp_path, "r1", "steps")) == 8


def _steps_request(rows):
    from tests.test_ingest_columnar import request as steps_request

    return steps_request([rows])


def test_acknowledged_packed_gpu_samples_survive_a_crash_before_flush(tmp_path):
    from head.store import Store

    rows = samples()
    h = Head(tmp_path, TOKEN, analyzer=None)
    assert h.ingest.logs(request([rows[:30], rows[30:]]))[:2] == (60, 0)
    del h  # kill -9: no flush, no close; the WAL holds the packed bodies and their n8 layout
    st = Store(tmp_path)
    st.open_existing()
    st.close()
    df = read_table(tmp_path, "r1", "gpu")
    assert len(df) == 60 and df["mem_used_bytes"].isna().sum() == 3
