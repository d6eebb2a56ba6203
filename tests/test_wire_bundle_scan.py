"""The head's fast bundle scan (``wire_decode._scan_bundle``: one regex match per section header) takes exactly the bodies
the step-by-step parser (``wire.raw_sections``) takes, with the same sections, and refuses the others whole: every
truncation of a bundle, headers the fast pattern does not match, wrong counts, garbage. And the head's ingest of a
request of many bundles stores what it stored one batch at a time, heartbeats included."""

import msgspec
import pytest

from head.service import Head
from ranksight import wire, wire_decode
from test_wire_bundle import RUN, TOKEN, bundle_record, request, sections


def _as_sections(got):
    """A scanned bundle or a list of batches, as comparable (kind, layout text or None, payload/items) tuples."""
    if isinstance(got, wire_decode.Bundle):
        out = [(k, lay.text, bytes(p), c) for k, lay, p, c in got.packed]
        out += [("heartbeat", None, msgspec.json.encode(hb), 1) for hb in got.heartbeats]
        out += [(b.kind, None, bytes(b.body), len(b.items)) for b in got.others]
        return sorted(out, key=repr)
    out = []
    for b in got:
        if isinstance(b.items, wire.PackedBatch):
            out.append((b.kind, b.items.layout.text, bytes(b.items.payload), b.items.count))
        elif b.kind == "heartbeat":
            out.append(("heartbeat", None, msgspec.json.encode(b.items), 1))
        else:
            out.append((b.kind, None, bytes(b.body), len(b.items)))
    return sorted(out, key=repr)


def _both(body):
    """(fast result or the error, step-by-step result or the error)."""
    res = []
    for fn in (wire_decode._scan_bundle, wire_decode._bundle_batches):
        try:
            res.append(_as_sections(fn(RUN, {}, body)))
        except wire.WireError as e:
            res.append(type(e))
    return res


def test_every_truncation_is_refused_by_both():
    body = wire.pack_bundle(sections(0, 1))
    assert _both(body)[0] == _both(body)[1] and _both(body)[0] != wire.WireError
    for cut in range(0, len(body)):
        fast, slow = _both(body[:cut])
        assert fast == slow, cut
    # a truncated body ending exactly at a section boundary is a shorter, whole bundle: both take it the same way


@pytest.mark.parametrize("mangle", [
    lambda b: b.replace(b"\t2\t", b"\t+2\t", 1),  # a count int() reads but the pattern does not take
    lambda b: b.replace(b"\t2\t", b"\t3\t", 1),  # a count that does not match the payload's size
    lambda b: b.replace(b"step\t", b"bundle\t", 1),  # a bundle inside a bundle
    lambda b: b.replace(b"step\t", b"nosuchkind\t", 1),
    lambda b: b.replace(b"rank:i8", b"rank:f8", 1),  # a layout the head refuses
    lambda b: b"garbage" + b,
    lambda b: b + b"\x00",
    lambda b: b[: b.index(b"{")] + b"{not json}",  # a heartbeat that does not decode
    lambda b: b"",
])
def test_mangled_bundles_get_the_same_answer(mangle):
    whole = wire.pack_bundle(sections(0, 1))
    body = mangle(whole)
    assert body != whole
    fast, slow = _both(body)
    assert fast == slow


def test_many_bundles_in_one_request_are_stored_and_their_heartbeats_seen(tmp_path):
    recs = [bundle_record(wire.pack_bundle(sections(n, s)), n) for s in (1, 2) for n in range(8)]
    # one bundle refused whole (a count that lies), the others kept
    bad = wire.pack_bundle(sections(9, 1)).replace(b"\t2\t", b"\t3\t", 1)
    recs.append(bundle_record(bad, 9))
    h = Head(tmp_path / "s", TOKEN, analyzer=None)
    try:
        acc, rej, why = h.ingest.logs(request(recs))
        assert (acc, rej) == (16 * 6, 1), why
        assert why[0].i == 16 and "bundle" in why[0].why
        live = h.live.runs[RUN]
        assert sorted(live.agents) == list(range(8))  # node 9's heartbeat went with its refused bundle
        assert live.agents[7].heartbeat.ranks == [14, 15]
        rs = h.store.run(RUN)
        assert rs.stored_and_buffered("steps") == 8 * 2 * 2
        assert rs.stored_and_buffered("collectives") == 8 * 2 * 2
        assert rs.stored_and_buffered("gpu") == 8 * 2 * 2
        # the same request again: acknowledged, nothing stored twice
        acc2, rej2, _ = h.ingest.logs(request(recs[:-1]))
        assert (acc2, rej2) == (16 * 6, 0)
        rs.process()
        assert rs.stored_and_buffered("steps") == 32 and rs.duplicates == 16 * 6
    finally:
        h.close()
