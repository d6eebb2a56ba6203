"""A request of bundles of many shapes (some the head knows, ``wire_decode._learn_shape``, some it cannot learn) is
stored, acknowledged and refused the same whether the head knows their shapes or not."""

import random

import msgspec
import pytest

from head.service import Head
from ranksight import schema, wire, wire_decode
from test_wire_bundle import RUN, TOKEN, bundle_record, heartbeat, request, sections


@pytest.fixture(autouse=True)
def no_shapes(monkeypatch):
    monkeypatch.setattr(wire_decode, "_shapes", [])
    monkeypatch.setattr(wire_decode, "_shapes_re", None)


def _colls(node, n):
    rows = [schema.CollectiveRecord(run_id=RUN, rank=node * 8 + r, step=1, seq=r, op="all_reduce", group="dp" * (1 + n % 3),
                                    nbytes=1 << 20, t_arrive=0.4, t_done=0.45, duration_ms=50.0, comm_id="c0ffee")
            for r in range(n)]
    layout, body = wire.pack_records("collective", RUN, rows)
    return ("collective", layout, body, n)


def _bundle_bodies(rng, n):
    """Bundles of several shapes (collective counts and group widths vary; some lack a section; some have two step
    sections; some put the heartbeat first, which no shape takes)."""
    out = []
    for node in range(n):
        secs = [s for s in sections(node, 1) if s[0] != "heartbeat"]
        secs[1] = _colls(node, rng.randrange(1, 5))
        if rng.random() < 0.2:
            secs = secs[:1] + secs[2:]
        if rng.random() < 0.1:
            secs = secs + [sections(node, 2)[0]]
        hb = ("heartbeat", None, msgspec.json.encode(heartbeat(node, t=100.0 + rng.random())), 1)
        out.append(wire.pack_bundle([hb] + secs if rng.random() < 0.15 else secs + [hb]))
    return out


def test_a_request_of_bundles_is_stored_acknowledged_and_refused_as_bundle_by_bundle(tmp_path):
    rng = random.Random(9)
    bodies = _bundle_bodies(rng, 40)
    bad = wire.pack_bundle(sections(77, 1)).replace(b"\t2\t", b"\t3\t", 1)  # a count that lies: refused whole
    recs = [bundle_record(b, n) for n, b in enumerate(bodies)]
    recs.insert(7, bundle_record(bad, 77))
    answers, stored = [], []
    for where, shapes in (("cold", False), ("warm", True)):
        wire_decode._shapes, wire_decode._shapes_re = [], None
        if shapes:  # every shape known before the request: the gather cuts them all
            for b in bodies:
                wire_decode._scan_bundle(RUN, {}, b)
            assert wire_decode._shapes
        h = Head(tmp_path / where, TOKEN, analyzer=None)
        try:
            acc, rej, why = h.ingest.logs(request(recs))
            answers.append((acc, rej, [(r.i, r.why) for r in why]))
            rs = h.store.run(RUN)
            rs.process()
            stored.append({t: rs.stored_and_buffered(t) for t in ("steps", "collectives", "gpu")})
            assert sorted(h.live.runs[RUN].agents) == list(range(40))
        finally:
            h.close()
    assert answers[0] == answers[1] and answers[0][1] == 1 and answers[0][2][0][0] == 7
    assert stored[0] == stored[1] and stored[0]["steps"] > 0
