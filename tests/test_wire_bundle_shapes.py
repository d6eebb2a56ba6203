"""The head's bundle-shape fast path (``wire_decode._learn_shape``: a bundle of a shape seen before costs one regex
match) reads every body exactly as the section-by-section scan and the step-by-step parser (``wire.raw_sections``)
do: the same sections of well-formed bundles of each shape, the same refusals of every truncation and mangling of a
bundle whose shape it knows, and no shape learnt from a bundle it could misread (a heartbeat not last, two
heartbeats, a JSON section)."""

import msgspec
import pytest

from ranksight import schema, wire, wire_decode
from test_wire_bundle import RUN, heartbeat, sections
from test_wire_bundle_scan import _as_sections


@pytest.fixture(autouse=True)
def no_shapes(monkeypatch):
    """Each test starts with no shape known, and leaves none behind."""
    monkeypatch.setattr(wire_decode, "_shapes", [])
    monkeypatch.setattr(wire_decode, "_shapes_re", None)


def _answer(fn, body):
    try:
        return _as_sections(fn(RUN, {}, body))
    except wire.WireError as e:
        return type(e), str(e)


def _three(body):
    """(the scan with the shapes known now, the scan with none known, the step-by-step parser): results or errors."""
    shaped = _answer(wire_decode._scan_bundle, body)
    known, pattern = wire_decode._shapes, wire_decode._shapes_re
    wire_decode._shapes, wire_decode._shapes_re = [], None
    try:
        plain = _answer(wire_decode._scan_bundle, body)
        wire_decode._shapes, wire_decode._shapes_re = [], None
    finally:
        wire_decode._shapes, wire_decode._shapes_re = known, pattern
    slow = _answer(wire_decode._bundle_batches, body)
    if isinstance(slow, tuple) and isinstance(plain, tuple):  # the two scans word the same refusal alike
        slow = plain
    return shaped, plain, slow


def _shape_variants():
    """Bundles of four shapes (as one fleet's pipeline stages send: another count of collectives, a section missing)
    and, for each, one of the same shape with another heartbeat size."""
    base = sections(0, 1)
    more = [s if s[0] != "collective" else _colls(3) for s in base]
    no_gpu = [s for s in base if s[0] != "gpu"]
    only_hb = [base[-1]]
    out = []
    for secs in (base, more, no_gpu, only_hb):
        out.append(wire.pack_bundle(secs))
        hb = wire.Heartbeat(node=12345, host="a-much-longer-host-name", t=1e9, ranks=[1, 2, 3, 4, 5])
        out.append(wire.pack_bundle(secs[:-1] + [("heartbeat", None, msgspec.json.encode(hb), 1)]))
    return out


def _colls(n):
    rows = [schema.CollectiveRecord(run_id=RUN, rank=r, step=1, seq=1, op="all_reduce", group="dp", nbytes=1 << 20,
                                    t_arrive=0.4, t_done=0.45, duration_ms=50.0, comm_id="c0ffee") for r in range(n)]
    layout, body = wire.pack_records("collective", RUN, rows)
    return ("collective", layout, body, n)


def test_a_shape_is_learnt_and_its_bundles_read_as_the_full_scan_reads_them():
    bodies = _shape_variants()
    for body in bodies:
        wire_decode._scan_bundle(RUN, {}, body)
    assert len(wire_decode._shapes) == 3  # the bundle of a heartbeat alone has no packed section: not learnt
    for body in bodies[:6]:
        assert wire_decode._shapes_re.match(body) is not None
    for body in bodies:
        shaped, plain, slow = _three(body)
        assert shaped == plain == slow and not isinstance(shaped, tuple)


def test_every_truncation_and_extension_of_a_known_shape_gets_the_same_answer():
    body = wire.pack_bundle(sections(0, 1))
    wire_decode._scan_bundle(RUN, {}, body)
    assert wire_decode._shapes
    for cut in range(len(body)):
        shaped, plain, slow = _three(body[:cut])
        assert shaped == plain == slow, cut
    for extra in (b"\x00", b"\n", b"}", b"step\t\t1\t2\n[]", body):
        shaped, plain, slow = _three(body + extra)
        assert shaped == plain == slow, extra


@pytest.mark.parametrize("mangle", [
    lambda b: b.replace(b"\t2\t", b"\t3\t", 1),  # a count that does not match the payload's size
    lambda b: b.replace(b"heartbeat\t\t1\t", b"heartbeat\t\t2\t", 1),
    lambda b: b.replace(b"heartbeat\t\t1\t", b"heartbeat\t\t1\t0", 1),  # a size with a leading zero: another size
    lambda b: b[: b.index(b"{")] + b"{not json}",  # a heartbeat that does not decode
    lambda b: b[:-1] + b" ",  # a heartbeat of the same size that does not decode
    lambda b: b.replace(b"rank:i8", b"rank:f8", 1),  # a layout the head refuses
])
def test_a_mangled_bundle_of_a_known_shape_gets_the_same_answer(mangle):
    whole = wire.pack_bundle(sections(0, 1))
    wire_decode._scan_bundle(RUN, {}, whole)
    body = mangle(whole)
    assert body != whole
    shaped, plain, slow = _three(body)
    assert shaped == plain == slow


def test_no_shape_is_learnt_from_bundles_it_could_misread():
    base = sections(0, 1)
    hb = base[-1]
    for secs in ([hb] + base[:-1],  # the heartbeat first
                 base + [hb],  # two heartbeats
                 base[:1] + [hb] + base[1:-1],  # the heartbeat between packed sections
                 base[:-1] + [("ack", None, b"[]", 0), hb]):  # a JSON section
        body = wire.pack_bundle(secs)
        wire_decode._scan_bundle(RUN, {}, body)
        assert not wire_decode._shapes, [s[0] for s in secs]
        shaped, plain, slow = _three(body)
        assert shaped == plain == slow


def test_the_shapes_are_bounded():
    for n in range(1, wire_decode.MAX_SHAPES + 10):
        wire_decode._scan_bundle(RUN, {}, wire.pack_bundle([_colls(n), ("heartbeat", None,
                                                                         msgspec.json.encode(heartbeat(0)), 1)]))
    assert len(wire_decode._shapes) == wire_decode.MAX_SHAPES
