"""Packed (columnar) step batches: wire encoding, head queue + vectorized dedupe, bounded step keys,
restart attempts, WAL replay, malformed payloads, and the live window fed without per-record objects."""

import random

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk.resources import Resource

from ranksight import wire
from head.service import Head
from node.outbox import Item, Outbox
from head.store import Store
from head.store.dedupe import SeqIndex
from ranksight.tables import read_table
from ranksight import schema

TOKEN = "t"


def step(rank, s, attempt=0, **kw):
    d = dict(run_id="r1", rank=rank, step=s, node=rank // 4, host=f"hôst-{rank // 4}", world_size=8, attempt=attempt,
             t_start=1000.0 + s, t_end=1000.5 + s, step_ms=500.0 + rank, loss=2.5, grad_norm=None,
             overflow=bool(s % 2), tokens=128)
    d.update(kw)
    return schema.StepRecord(**d)


def request(batches, run_id="r1", packed=True):
    """An ExportLogsServiceRequest as agents build it: one log record per batch of step records."""
    recs = []
    for rows in batches:
        p = wire.pack_records("step", run_id, rows) if packed else None
        if p is not None:
            recs.append(wire.make_log_record(run_id, "step", p[1], node=0, count=len(rows), layout=p[0],
                                             resource=Resource.create({})))
        else:
            body = wire.join_array([schema.encode(r) for r in rows])
            recs.append(wire.make_log_record(run_id, "step", body, node=0, count=len(rows),
                                             resource=Resource.create({})))
    req = ExportLogsServiceRequest()
    req.ParseFromString(encode_logs(recs).SerializeToString())
    return req


def raw_request(attrs, body):
    req = ExportLogsServiceRequest()
    lr = req.resource_logs.add().scope_logs.add().log_records.add()
    for k, v in attrs.items():
        kv = lr.attributes.add()
        kv.key = k
        if isinstance(v, str):
            kv.value.string_value = v
        else:
            kv.value.int_value = v
    if isinstance(body, bytes):
        lr.body.bytes_value = body
    else:
        lr.body.string_value = body
    return req


def stored(root, table="steps"):
    df = read_table(root, "r1", table)
    return df.sort_values(["rank", "attempt", "step"]).reset_index(drop=True)


def test_packed_and_json_bodies_store_the_same_rows(tmp_path):
    rows = [step(r, s, loss=None if s == 3 else 1.0 / (s + 1), sync_wait_ms=None if r else 4.0)
            for s in range(6) for r in range(8)]
    a = wire.pack_records("step", "r1", rows)
    assert a is not None and "host:S8," in a[0]  # as wide as the batch needs
    for packed, where in ((True, "p"), (False, "j")):
        h = Head(tmp_path / where, TOKEN, analyzer=None)
        acc, rej, msg = h.ingest.logs(request([rows[:24], rows[24:]], packed=packed))
        assert (acc, rej) == (48, 0), msg
        h.close()
    p, j = stored(tmp_path / "p"), stored(tmp_path / "j")
    assert len(p) == 48 and p.equals(j)
    assert p["loss"].isna().sum() == 8 and p["host"].iloc[0] == "hôst-0"


def test_exactly_once_across_resends_mixed_encodings_and_restarts(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    h.ingest.logs(request([[step(r, s) for r in range(4)] for s in range(10)]))
    h.ingest.logs(request([[step(r, s) for r in range(4)] for s in range(5, 15)]))  # overlapping resend
    h.ingest.logs(request([[step(r, s) for r in range(4)] for s in range(12, 16)], packed=False))  # an old agent
    h.store.flush_all()
    assert h.stats["duplicates"] == 4 * 5 + 4 * 3
    h.close()
    h2 = Head(tmp_path, TOKEN, analyzer=None)  # keys come back from the part files
    h2.ingest.logs(request([[step(r, s) for r in range(4)] for s in range(16)]))
    h2.close()
    df = stored(tmp_path)
    assert len(df) == 64 and not df.duplicated(["rank", "step", "attempt"]).any()


def test_steps_redone_after_a_restart_are_kept(tmp_path):
    """A crash-resume re-runs steps from the last checkpoint under a new attempt: both are real data."""
    h = Head(tmp_path, TOKEN, analyzer=None)
    h.ingest.logs(request([[step(r, s) for r in range(2)] for s in range(10)]))
    h.ingest.logs(request([[step(r, s, attempt=1) for r in range(2)] for s in range(6, 12)]))
    h.ingest.logs(request([[step(r, s, attempt=1) for r in range(2)] for s in range(6, 12)]))  # resend
    states = {x["rank"]: x for x in h.live.run("r1").rank_states()}
    assert states[0]["step"] == 11 and states[0]["attempt"] == 1
    h.close()
    df = stored(tmp_path)
    assert len(df) == 2 * 10 + 2 * 6
    assert sorted(df[(df["rank"] == 0) & (df["attempt"] == 1)]["step"]) == list(range(6, 12))


def test_acknowledged_packed_batches_survive_a_crash_before_flush(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    h.ingest.logs(request([[step(r, s) for r in range(4)] for s in range(5)]))
    # kill -9: no flush, no close (the WAL is written with os.write: it is in the page cache)
    st = Store(tmp_path)
    st.open_existing()
    rs = st.run("r1")
    assert rs.add("steps", [step(1, 3)]) == []  # a duplicate after the replay
    st.close()
    assert len(stored(tmp_path)) == 20


def test_malformed_packed_payloads_are_rejected_and_good_batches_kept(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    layout, body = wire.pack_records("step", "r1", [step(0, s) for s in range(3)])
    base = {wire.A_RUN: "r1", wire.A_KIND: "step", wire.A_ENCODING: wire.ENC_PACKED, wire.A_LAYOUT: layout}
    bad = [
        (base, body[:-1]),  # truncated
        (base, b""),  # empty
        (base, body.decode("latin-1")),  # string body with the packed encoding
        ({**base, wire.A_LAYOUT: layout.replace("rank:i8", "rank:f8")}, body),  # wrong type
        ({**base, wire.A_LAYOUT: layout + ",bogus:i8"}, body),  # unknown field
        ({**base, wire.A_LAYOUT: "run_id:S8," + layout}, body),  # run id inside the body
        ({**base, wire.A_LAYOUT: layout.replace("step:i8,", "")}, body),  # required field missing
        ({**base, wire.A_LAYOUT: layout.replace("host:S8", "host:S99999")}, body),  # absurd width
        ({**base, wire.A_ENCODING: "arrow"}, body),  # unknown encoding
        ({**base, wire.A_KIND: "collective"}, body),  # kind without a packed form of this layout
        ({k: v for k, v in base.items() if k != wire.A_LAYOUT}, body),  # no layout
    ]
    for attrs, b in bad:
        acc, rej, msg = h.ingest.logs(raw_request(attrs, b))
        assert (acc, rej) == (0, 1), (attrs, msg)
    # a request mixing a bad and a good batch: the good one is stored
    req = raw_request(base, body[:-3])
    req.resource_logs.extend(request([[step(1, s) for s in range(4)]]).resource_logs)
    assert h.ingest.logs(req)[:2] == (4, 1)
    h.close()
    assert sorted(stored(tmp_path)["step"]) == [0, 1, 2, 3]


def test_invalid_utf8_in_a_packed_string_is_stored_replaced(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None)
    layout, body = wire.pack_records("step", "r1", [step(0, 0, host="abcdefgh")])
    body = body.replace(b"abcdefgh", b"abc\xffdefg")
    assert h.ingest.logs(raw_request({wire.A_RUN: "r1", wire.A_KIND: "step", wire.A_ENCODING: wire.ENC_PACKED,
                                      wire.A_LAYOUT: layout}, body))[:2] == (1, 0)
    h.close()
    assert stored(tmp_path)["host"].tolist() == ["abc\ufffddefg"]


def test_pack_falls_back_to_json_when_records_cannot_be_packed_exactly():
    assert wire.pack_records("step", "r1", [step(0, 0, run_id="other")]) is None
    assert wire.pack_records("step", "r1", [step(0, 0, host="h" * 65)]) is None
    assert wire.pack_records("step", "r1", [step(0, 0, host="a\0")]) is None
    assert wire.pack_records("step", "r1", [step(0, 0, tokens=2**70)]) is None
    assert wire.pack_records("collective", "r1", []) is None  # only step records are packed


def test_live_window_is_fed_from_the_queue(tmp_path):
    h = Head(tmp_path, TOKEN, analyzer=None, window=4)
    for s in range(10):
        h.ingest.logs(request([[step(r, s) for r in range(3)]]))
    live = h.live.run("r1")
    states = live.rank_states()  # processes the queue first
    assert [(x["rank"], x["step"], x["host"]) for x in states] == [(0, 9, "hôst-0"), (1, 9, "hôst-0"),
                                                                     (2, 9, "hôst-0")]
    assert [s.step for s in live.steps_since(5, rank=1)] == [6, 7, 8, 9]
    steps = live.run_data().steps
    assert len(steps) == 12 and set(steps["rank"]) == {0, 1, 2}  # window=4 per rank
    assert h.live.summary()[0]["last_step"] == 9 and h.live.summary()[0]["steps_stored"] == 30
    h.close()


def _reference(keys):
    seen, out = set(), []
    for k in keys:
        out.append(k not in seen)
        seen.add(k)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_seq_index_agrees_with_a_set(seed):
    rnd = random.Random(seed)
    idx = SeqIndex()
    all_keys, all_new = [], []
    nxt = {}
    for _ in range(60):
        batch = []
        for _ in range(rnd.randint(0, 80)):
            r, a = rnd.choice([0, 1, 2, 7, 1000]), rnd.choice([0, 0, 0, 1, 2])
            roll = rnd.random()
            if roll < 0.7:  # in order
                s = nxt.get((r, a), rnd.randint(0, 5))
                nxt[(r, a)] = s + 1
            elif roll < 0.85:  # a resend
                s = rnd.randint(0, nxt.get((r, a), 3))
            elif roll < 0.95:  # a gap / out of order / below the range
                s = rnd.randint(-5, nxt.get((r, a), 0) + 20)
            else:  # outside the packed range: exact set
                r, s = rnd.choice([-1, 2**45]), rnd.randint(0, 5)
            batch.append((r, a, s))
        a_ = np.array([k[0] for k in batch], np.int64)
        b_ = np.array([k[1] for k in batch], np.int64)
        s_ = np.array([k[2] for k in batch], np.int64)
        all_new += idx.new_mask(a_, b_, s_).tolist()
        all_keys += batch
    assert all_new == _reference(all_keys)


def test_seq_index_memory_is_bounded_by_groups_not_rows():
    idx = SeqIndex()
    ranks = np.repeat(np.arange(1024, dtype=np.int64), 1)
    for s in range(300):  # 300 steps of 1,024 ranks, in order: 307,200 keys
        assert idx.new_mask(ranks, np.zeros(1024, np.int64), np.full(1024, s, np.int64)).all()
    assert len(idx) == 1024 and not idx.extra and idx.nbytes() < 1024 * 40  # five numbers per group
    # resends are duplicates; a restart adds one group per rank
    assert not idx.new_mask(ranks, np.zeros(1024, np.int64), np.full(1024, 7, np.int64)).any()
    assert idx.new_mask(ranks, np.ones(1024, np.int64), np.full(1024, 250, np.int64)).all()
    assert len(idx) == 2048


def test_outbox_segments_of_older_agents_still_decode(tmp_path):
    import msgspec

    ob = Outbox(tmp_path)
    old = msgspec.msgpack.encode([["step", b"[]", 0, 1, 3, 3, 12.5]])  # no layout field
    (tmp_path / "seg-000000000001-1.msgpack").write_bytes(old)
    items = ob.read(ob.oldest())
    assert items == [Item(kind="step", body=b"[]", rank=0, count=1, step_min=3, step_max=3, t_first=12.5)]
    assert items[0].layout is None


def test_wal_replay_across_generations_and_layouts(tmp_path):
    """Layout texts are written once per WAL file: every generation must replay on its own."""
    h = Head(tmp_path, TOKEN, analyzer=None)
    rs = h.store.run("r1")
    h.ingest.logs(request([[step(r, s) for r in range(2)] for s in range(3)]))
    rs.flush()  # a WAL rotation: the first generation is in Parquet, its WAL file gone
    h.ingest.logs(request([[step(r, s, host="a-much-longer-host-name") for r in range(2)] for s in range(3, 6)]))
    h.ingest.logs(request([[step(r, s) for r in range(2)] for s in range(6, 8)]))
    # kill -9 now: two layouts in the current WAL file, the first generation already in Parquet
    st = Store(tmp_path)
    st.open_existing()
    st.close()
    df = stored(tmp_path)
    assert len(df) == 16 and not df.duplicated(["rank", "step", "attempt"]).any()
    assert set(df[df["step"] == 4]["host"]) == {"a-much-longer-host-name"}


def test_a_wal_left_by_an_older_head_is_replayed(tmp_path):
    d = tmp_path / "r1" / ".head"
    d.mkdir(parents=True)
    lines = b"steps\t" + wire.join_array([schema.encode(step(0, s)) for s in range(3)]) + b"\n"
    (d / "wal-123.jsonl").write_bytes(lines + b'steps\t[{"kind":"step","run_id":"r1","ra')  # torn tail
    st = Store(tmp_path)
    st.open_existing()
    st.close()
    assert sorted(stored(tmp_path)["step"]) == [0, 1, 2]
    assert not [p for p in d.glob("wal-*") if p.stat().st_size]
