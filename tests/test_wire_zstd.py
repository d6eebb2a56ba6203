"""zstd on the wire (``Content-Encoding: zstd``): the head takes it (a frame with its size in the header, a streamed
frame without, several frames), refuses truncated or garbage bodies with a 400 and a bomb with a 413 after a bounded
amount of work (nothing left reserved), and the agent sends zstd to a head that takes it and deflate, for good, to a
head that answers 415 (one older than zstd)."""

import gzip
import os
import urllib.request

import pyarrow as pa
import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs

from agent_helpers import TOKEN, http_status, serving
from head import receiver
from head.receiver import HttpError
from head.service import Head
from node import shipping
from node.otlp_session import CompressingSession
from node.outbox import Item
from node.prom import AgentMetrics
from ranksight import wire
from test_wire_bundle import RUN, bundle_record, sections

HDR = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}


def zstd_one_shot(raw: bytes) -> bytes:
    return pa.Codec("zstd").compress(raw, asbytes=True)


def zstd_streamed(raw: bytes) -> bytes:
    """A frame whose header does not say its size (what a streaming compressor writes)."""
    buf = pa.BufferOutputStream()
    with pa.CompressedOutputStream(buf, "zstd") as s:
        s.write(raw)
    return buf.getvalue().to_pybytes()


def export_body(node=0, step=1) -> bytes:
    return encode_logs([bundle_record(wire.pack_bundle(sections(node, step)), node)]).SerializeToString()


@pytest.mark.parametrize("make", [zstd_one_shot, zstd_streamed, lambda raw: zstd_one_shot(raw[:100])
                                  + zstd_streamed(raw[100:])])
def test_zstd_round_trip(make):
    raw = os.urandom(5000) * 40
    z = make(raw)
    assert receiver.decompress(z, "zstd") == raw
    assert receiver.decompress(z, " ZSTD ") == raw
    declared = receiver.zstd_content_size(z)
    assert declared in (None, len(raw), 100)


def test_zstd_size_header_is_read_as_rfc_8878_says():
    for n in (0, 1, 255, 256, 300, 65_791, 65_792, 1 << 20, (1 << 32) + 5):
        frame = zstd_one_shot(b"\0" * n) if n < (1 << 24) else None
        if frame is not None:
            assert receiver.zstd_content_size(frame) == n, n
    assert receiver.zstd_content_size(zstd_streamed(b"abc" * 100)) is None
    assert receiver.zstd_content_size(b"not zstd at all") is None
    assert receiver.zstd_content_size(b"\x28\xb5\x2f\xfd") is None  # cut inside the header


# (bytes flipped inside a frame are not among them: a frame without a checksum may decode to other bytes of the
# declared size, as a stored deflate block would; the protobuf parse after it refuses what does not parse)
@pytest.mark.parametrize("bad", [lambda z: z[:-7], lambda z: z[:5], lambda z: b"garbage, not a frame at all",
                                 lambda z: z + b"trailing garbage", lambda z: b""])
@pytest.mark.parametrize("make", [zstd_one_shot, zstd_streamed])
def test_truncated_or_garbage_zstd_is_a_400(bad, make):
    data = bad(make(os.urandom(3000) * 30))
    with pytest.raises(HttpError) as e:
        with receiver.inflated(data, "zstd"):
            pass
    assert e.value.status == 400 and "zstd" in e.value.reason
    assert receiver.INFLIGHT.used == 0


def test_a_head_whose_pyarrow_has_no_zstd_answers_415(monkeypatch):
    """The answer an agent falls back to deflate on, not a server error."""
    from ranksight import zstd

    monkeypatch.setattr(zstd, "_CODEC", [None])
    with pytest.raises(HttpError) as e:
        receiver.decompress(zstd_one_shot(b"x" * 1000), "zstd")
    assert e.value.status == 415 and "zstd" in e.value.reason
    assert receiver.INFLIGHT.used == 0
    assert not CompressingSession(object()).zstd  # an agent without zstd sends deflate from the start


def test_a_zstd_bomb_is_refused_after_bounded_work(monkeypatch):
    monkeypatch.setattr(receiver, "MAX_DECOMPRESSED_BYTES", 8 * 1024 * 1024)
    big = b"\0" * (64 * 1024 * 1024)
    declared = zstd_one_shot(big)  # ~2 KB that declare 64 MiB: refused from the header, nothing decompressed
    assert len(declared) < 64 * 1024
    with pytest.raises(HttpError) as e:
        with receiver.inflated(declared, "zstd"):
            pass
    assert e.value.status == 413 and "declares" in e.value.reason
    streamed = zstd_streamed(big)  # no size in the header: read in bounded chunks, stopped past the limit
    with pytest.raises(HttpError) as e:
        with receiver.inflated(streamed, "zstd"):
            pass
    assert e.value.status == 413
    assert receiver.INFLIGHT.used == 0  # every reserved byte given back
    # in flight together past the budget: a 503 (retry), not the head's memory
    small = zstd_one_shot(b"\1" * (4 * 1024 * 1024))
    monkeypatch.setattr(receiver, "INFLIGHT", receiver.InflightBudget(6 * 1024 * 1024))
    with receiver.inflated(small, "zstd") as first:
        assert len(first) == 4 * 1024 * 1024
        with pytest.raises(HttpError) as e:
            with receiver.inflated(small, "zstd"):
                pass
        assert e.value.status == 503
    assert receiver.INFLIGHT.used == 0


def test_the_head_takes_zstd_over_http_and_refuses_bad_bodies(tmp_path):
    h = Head(tmp_path / "store", TOKEN, analyzer=None, flush_interval=0.2)
    with serving(h, poll=0.1, background=True):
        url = h.url + "/v1/logs"
        for enc, data in (("zstd", zstd_one_shot(export_body(0))), ("zstd", zstd_streamed(export_body(1))),
                          ("gzip", gzip.compress(export_body(2)))):
            req = urllib.request.Request(url, data=data, headers={**HDR, "Content-Encoding": enc}, method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200 and r.read() == b""  # a full success
        before = h.stats["http_4xx"]
        assert http_status(url, zstd_one_shot(export_body(3))[:-9], HDR) == 400  # truncated
        assert http_status(url, b"\x28\xb5\x2f\xfd garbage after the magic", HDR) == 400
        assert http_status(url, export_body(3), {**HDR, "Content-Encoding": "br"}) == 415
        assert h.stats["http_4xx"] == before + 3  # recorded, and the head is still up
        assert http_status(h.url + "/api/health", None, {}, method="GET") == 200
        rs = h.store.run(RUN)
        rs.process()
        assert rs.stored_and_buffered("steps") == 6 and rs.duplicates == 0
        assert sorted(h.live.runs[RUN].agents) == [0, 1, 2]


class Inner:
    """A session that records what it was sent and answers 415 to zstd when ``old`` (a head before zstd)."""

    def __init__(self, old: bool):
        self.old, self.sent = old, []

    def request(self, method, url, headers=None, data=None, **kw):
        enc = headers.get("Content-Encoding")
        self.sent.append((enc, data))
        status = 415 if self.old and enc == "zstd" else 200
        return type("R", (), {"status_code": status, "text": "unsupported Content-Encoding 'zstd'", "content": b""})()


def test_the_session_sends_zstd_and_falls_back_to_deflate_for_good_on_415():
    raw = export_body()
    new = CompressingSession(Inner(old=False))
    assert new.request("POST", "http://h/v1/logs", headers={}, data=raw).status_code == 200
    assert new.inner.sent[0][0] == "zstd" and receiver.decompress(new.inner.sent[0][1], "zstd") == raw
    old = CompressingSession(Inner(old=True))
    assert old.request("POST", "http://h/v1/logs", headers={}, data=raw).status_code == 200
    assert [e for e, _ in old.inner.sent] == ["zstd", "deflate"]  # refused, then the same export as deflate
    assert receiver.decompress(old.inner.sent[1][1], "deflate") == raw
    old.request("POST", "http://h/v1/logs", headers={}, data=raw)
    assert [e for e, _ in old.inner.sent] == ["zstd", "deflate", "deflate"] and old.fell_back
    # a body the exporter compressed itself goes as it is
    new.request("POST", "http://h/v1/logs", headers={"Content-Encoding": "gzip"}, data=b"x")
    assert new.inner.sent[-1] == ("gzip", b"x")


def _ship(h, node):
    sh = shipping.Shipper(h.url, TOKEN, run_id=RUN, node=node, host=f"n{node}", agent_id="a", timeout=10,
                          metrics=AgentMetrics())
    its = [Item(kind=k, body=b, count=c, layout=lay) for k, lay, b, c in sections(node, 1)[:3]]
    try:
        assert sh.export(its, []).ok
        return sh
    finally:
        sh.close()


def test_the_agent_ships_zstd_to_a_head_that_takes_it_and_deflate_to_an_older_one(tmp_path, monkeypatch):
    h = Head(tmp_path / "store", TOKEN, analyzer=None, flush_interval=0.2)
    with serving(h, poll=0.1, background=True):
        sh = _ship(h, 0)
        assert sh.compressing.zstd and not sh.compressing.fell_back
        orig = receiver.decompress

        def older(body, encoding, *a, **k):  # what a head before zstd answers
            if (encoding or "").strip().lower() == "zstd":
                raise HttpError(415, f"unsupported Content-Encoding {encoding!r}")
            return orig(body, encoding, *a, **k)

        monkeypatch.setattr(receiver, "decompress", older)
        sh = _ship(h, 1)
        assert sh.compressing.fell_back and not sh.compressing.zstd
        rs = h.store.run(RUN)
        rs.process()
        assert rs.stored_and_buffered("steps") == 4 and rs.duplicates == 0  # both agents' records, once each
