"""probes.trace_events: the one chunked reader of Kineto/Chrome trace files (issue 14), checked against json."""

from __future__ import annotations

import gzip
import json
import random

import msgspec
import pytest

from probes.trace_events import TraceEvents, base_time_ns, distributed_info

_DEC = msgspec.json.Decoder(list)


def _read(path, chunk):
    r = TraceEvents(str(path), chunk)
    out = []
    for evs in r.chunks(_DEC.decode):
        out += evs
    return out, r


def _events(n=1500):
    # cut points inside strings ('},{' in names) and nested values (lists of objects in args), some events with
    # more of them than the reader tries before it walks event by event
    return [{"ph": "X", "name": 'k},{"x": [1]}' if i % 3 == 0 else "a", "ts": i,
             "args": {"nested": [{"a": 1}, {"b": "]},{"}] * (30 if i % 50 == 0 else 1)}} for i in range(n)]


def _ends(text: str) -> list[int]:
    """Byte offsets just past each event of the events array (the array starting at its first '[' + 1)."""
    dec = json.JSONDecoder()
    i = text.index("[", text.index("traceEvents") if "traceEvents" in text else 0) + 1
    ends = []
    while True:
        while text[i] in " \n,":
            i += 1
        if text[i] == "]":
            return ends
        _, i = dec.raw_decode(text, i)
        ends.append(i)


FORMS = {
    "object": lambda evs: json.dumps({"distributedInfo": {"rank": 3, "world_size": 8}, "traceEvents": evs,
                                      "deviceProperties": [{"id": i} for i in range(40)],
                                      "baseTimeNanoseconds": 1700000000000000000}),
    "array": lambda evs: json.dumps(evs),
    "open-array": lambda evs: "[\n" + ",\n".join(json.dumps(e) for e in evs) + ",\n",
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("chunk", [100, 4096, 1 << 20])
def test_every_event_read_in_order_whatever_the_chunk(tmp_path, form, chunk):
    evs = _events()
    p = tmp_path / "t.json"
    p.write_text(FORMS[form](evs))
    out, r = _read(p, chunk)
    assert out == evs
    assert not r.truncated and r.closed == (form != "open-array")
    if form == "object":
        assert distributed_info(r.header, r.trailer) == {"rank": 3, "world_size": 8}
        assert base_time_ns(r.header, r.trailer) == 1700000000000000000
    if form == "open-array":
        assert any("closing ']'" in n for n in r.notes)


@pytest.mark.parametrize("form", ["object", "array"])
def test_a_cut_file_gives_exactly_its_complete_events(tmp_path, form):
    evs = _events(600)
    text = FORMS[form](evs)
    ends = _ends(text)
    raw = text.encode()
    rng = random.Random(4)
    p = tmp_path / "c.json"
    for cut in rng.sample(range(ends[0], ends[-1]), 25) + [ends[10], ends[10] + 1]:
        p.write_bytes(raw[:cut])
        for chunk in (100, 5000):
            out, r = _read(p, chunk)
            n = sum(1 for e in ends if e <= cut)
            assert out == evs[:n], (cut, chunk)
            if form == "array" and n and raw[ends[n - 1]:cut].strip() in (b"", b","):
                assert not r.truncated  # a bare array may leave out its "]": cut at an event's end, it is whole
            else:
                assert r.truncated and r.notes and "cut short" in r.notes[-1]


def test_gzip_torn_concatenated_and_corrupt(tmp_path):
    evs = _events(800)
    raw = json.dumps(evs).encode()
    h = len(raw) // 2
    cc = tmp_path / "cc.json"  # gzip by its magic bytes, whatever the name; two members
    cc.write_bytes(gzip.compress(raw[:h]) + gzip.compress(raw[h:]))
    out, r = _read(cc, 5000)
    assert out == evs and not r.truncated
    gz = gzip.compress(raw)
    torn = tmp_path / "torn.json.gz"
    torn.write_bytes(gz[: len(gz) * 2 // 3])
    out, r = _read(torn, 5000)
    assert 0 < len(out) < len(evs) and out == evs[: len(out)]
    assert r.truncated and any("torn gzip" in n for n in r.notes)
    # bytes that are not JSON inside event 500: the 500 events before it are read, then reading stops
    i = raw.index(b'"ts": 500,')
    bad = tmp_path / "bad.json"
    bad.write_bytes(raw[:i] + b'"ts": \x01,' + raw[i + 10:])
    out, r = _read(bad, 5000)
    assert out == evs[:500]
    assert r.truncated and "unreadable data" in r.notes[-1]


@pytest.mark.parametrize("data,events,truncated", [
    (b"", 0, True), (b"hello", 0, True), (b'{"a": 1}', 0, True), (b'{"traceEvents": []}', 0, False),
    (b"[]", 0, False), (b"[", 0, True), (b'{"traceEvents": [', 0, True), (b'{"traceEvents": [{"a": 1}, {"b', 1, True),
])
def test_small_and_junk_inputs(tmp_path, data, events, truncated):
    p = tmp_path / "j.json"
    p.write_bytes(data)
    out, r = _read(p, 100)
    assert len(out) == events and r.truncated is truncated
    assert bool(r.notes) is truncated
