"""The head's side of ranksight's OTLP wire format (``ranksight.wire`` says what travels; this module reads it).

``iter_indexed`` walks an ``ExportLogsServiceRequest``: each ranksight log record becomes a ``Batch`` (JSON records,
a ``PackedBatch``, a manifest, a heartbeat), or, for the head's ingest, a ``bundle-v1`` record one ``Bundle`` whose
sections are scanned at fleet rate (``_scan_bundle``: one regex match per section header, the step-by-step parser
of ``ranksight.wire`` as its fallback and for every refusal). A record that does not decode is named with the reason
(``WireError``), never raised past the walk; a JSON batch with some bad rows keeps the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator

import msgspec

from ranksight import schema
from ranksight.wire import (A_ENCODING, A_KIND, A_LAYOUT, A_MTIME, A_RUN, BATCH_KINDS, ENC_BUNDLE, ENC_PACKED,
                            KIND_BUNDLE, MAX_BUNDLE_SECTIONS, Heartbeat, PackedBatch, PackedLayout, WireError,
                            join_array, packed_count, packed_layout_of, raw_sections, section_kind)

_batch_decoders = {k: msgspec.json.Decoder(list[t]) for k, (t, _) in BATCH_KINDS.items()}
_row_decoders = {k: msgspec.json.Decoder(t) for k, (t, _) in BATCH_KINDS.items()}
_raw_array = msgspec.json.Decoder(list[msgspec.Raw])
_manifest_decoder = msgspec.json.Decoder(schema.Manifest)
_heartbeat_decoder = msgspec.json.Decoder(Heartbeat)


@dataclass(slots=True)
class Batch:
    run_id: str
    kind: str
    items: Any  # list of records, a PackedBatch, a Manifest, or a Heartbeat
    attrs: dict[str, Any]  # the ranksight.* attributes only
    body: bytes | str = b""  # the body as received: the head logs it as is when nothing was a duplicate
    # rows of the body the head refused (index in the body's array, why); ``items`` holds the others (a shared
    # empty tuple by default: no list made per batch)
    refused: list[tuple[int, str]] | tuple = ()


@dataclass(slots=True)
class Bundle:
    """A ``bundle-v1`` log record as the head's ingest takes it (``iter_indexed(..., bundles=True)``): its packed
    sections as plain tuples and its heartbeats decoded, so the volume path makes no object per section; any other
    section (a JSON table batch, a manifest, acks) as a ``Batch``, in ``others``."""

    run_id: str
    attrs: dict[str, Any]
    packed: list  # (kind, PackedLayout, payload, record count) per packed section, in body order
    heartbeats: list  # Heartbeat
    others: list  # Batch


def any_value(v) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def attributes(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def decode_body(kind: str, body: bytes | str) -> Any:
    """Decode one log record body of ``kind``; raises WireError on anything wrong."""
    try:
        if kind in _batch_decoders:
            return _batch_decoders[kind].decode(body)
        if kind == "manifest":
            return _manifest_decoder.decode(body)
        if kind == "heartbeat":
            return _heartbeat_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"{kind} body does not decode: {e}") from None
    raise WireError(f"unknown ranksight.kind {kind!r}")


_STR, _BYTES = "string_value", "bytes_value"
_good_runs: set[str] = set()  # run ids already checked (a bounded cache: this runs per log record)


def iter_batches(request) -> Iterator[tuple[Batch | None, str | None]]:
    """``iter_indexed`` without the indices."""
    for _, batch, reason in iter_indexed(request):
        yield batch, reason


def iter_indexed(request, bundles: bool = False) -> Iterator[tuple[int, Batch | Bundle | None, str | None]]:
    """Walk an ExportLogsServiceRequest: (i, batch, None) per ranksight log record,
    (i, None, reason) per record that is not decodable; ``i`` is the log record's position in the
    request (resource_logs, then scope_logs, then log_records, in order), the index a rejection
    names (``rejections_message``). Foreign log records (no ranksight.kind attribute) are skipped
    silently: a Collector may mix streams. A JSON batch with rows that do not decode keeps the
    others: the bad ones are in ``Batch.refused``. ``bundles``: a bundle comes as one ``Bundle`` (the head's
    ingest), not as one ``Batch`` per section."""
    i = -1
    for rl in request.resource_logs:
        for sl in rl.scope_logs:
            for lr in sl.log_records:
                i += 1
                # Only the attributes the head uses, read directly: this runs per log record at fleet rate.
                kind = run_id = enc = layout = mtime = None
                for kv in lr.attributes:
                    k = kv.key
                    # string_value is "" when the value is not a string: refused below (bad run id,
                    # unknown kind or encoding), never silently taken for something else
                    if k == A_RUN:
                        run_id = kv.value.string_value
                    elif k == A_KIND:
                        kind = kv.value.string_value
                    elif k == A_ENCODING:
                        enc = kv.value.string_value
                        if enc == ENC_BUNDLE and kind is not None and run_id is not None:
                            break  # a bundle: its sections say the rest
                    elif k == A_LAYOUT:
                        layout = kv.value.string_value
                        if kind is not None and run_id is not None and enc is not None:
                            break  # a packed batch from a current agent: the rest is not needed
                    elif k == A_MTIME:
                        mtime = any_value(kv.value)
                if kind is None:
                    continue
                if not run_id or run_id not in _good_runs:
                    if not run_id or "/" in run_id or run_id.startswith("."):
                        yield i, None, f"bad run id {run_id!r}"
                        continue
                    if len(_good_runs) < 4096:
                        _good_runs.add(run_id)
                attrs = {A_RUN: run_id, A_KIND: kind}
                if mtime is not None:
                    attrs[A_MTIME] = mtime
                body_v = lr.body
                which = body_v.WhichOneof("value")
                if enc == ENC_BUNDLE:
                    if kind != KIND_BUNDLE or which != _BYTES:
                        yield i, None, f"{kind}: encoding {enc!r} with a {which} body (expected kind bundle, bytes)"
                        continue
                    try:
                        got = (_scan_bundle(run_id, attrs, body_v.bytes_value) if bundles
                               else _bundle_batches(run_id, attrs, body_v.bytes_value))
                    except WireError as e:
                        yield i, None, str(e) if str(e).startswith("bundle") else f"bundle: {e}"
                        continue
                    if bundles:
                        yield i, got, None
                        continue
                    for b in got:
                        yield i, b, None
                    continue
                if enc is not None:
                    if enc != ENC_PACKED or which != _BYTES:
                        yield i, None, f"{kind}: encoding {enc!r} with a {which} body (expected {ENC_PACKED} bytes)"
                        continue
                    try:
                        lay = packed_layout_of(kind, layout)
                        payload = body_v.bytes_value
                        size = lay.dtype.itemsize
                        n = len(payload) // size
                        if not payload or n * size != len(payload):
                            n = packed_count(lay, payload)  # raises with the reason
                    except WireError as e:
                        yield i, None, str(e)
                        continue
                    yield i, Batch(run_id=run_id, kind=kind, items=PackedBatch(lay, payload, n), attrs=attrs), None
                    continue
                if which == _STR:
                    body: bytes | str = body_v.string_value
                elif which == _BYTES:
                    body = body_v.bytes_value
                else:
                    yield i, None, f"{kind}: body is {which}, expected a JSON string"
                    continue
                try:
                    items = decode_body(kind, body)
                except WireError as e:
                    salvaged = _salvage_rows(kind, body)  # one poison record costs itself, not its batch
                    if salvaged is None:
                        yield i, None, str(e)
                    else:
                        items, kept, refused = salvaged
                        yield i, Batch(run_id=run_id, kind=kind, items=items, attrs=attrs, body=join_array(kept),
                                       refused=refused), None
                    continue
                yield i, Batch(run_id=run_id, kind=kind, items=items, attrs=attrs, body=body), None


def _bundle_batches(run_id: str, attrs: dict[str, Any], body: bytes) -> list[Batch]:
    """The batches of a bundle's sections, in body order; raises WireError when any section is wrong (the bundle is
    refused whole, so the rejection names one log record and the sender keeps aside all of it)."""
    try:
        return _sections_to_batches(run_id, attrs, body)
    except WireError as e:
        raise WireError(str(e) if str(e).startswith("bundle") else f"bundle: {e}") from None


def _checked_section(key: bytes, count: int, payload: bytes) -> tuple[str, PackedLayout | None]:
    """A bundle section's kind and packed layout (None for a JSON section), refused when it is a bundle itself or
    its payload is not ``count`` whole records of its layout."""
    kind, layout = section_kind(key)
    if kind == KIND_BUNDLE:
        raise WireError("bundle: a bundle inside a bundle")
    if not layout:
        return kind, None
    lay = packed_layout_of(kind, layout)
    if not payload or count * lay.dtype.itemsize != len(payload):
        k = packed_count(lay, payload)  # raises with the reason when it is not whole records
        raise WireError(f"bundle: {kind} section holds {k} records, its header says {count}")
    return kind, lay


def _sections_to_batches(run_id: str, attrs: dict[str, Any], body: bytes) -> list[Batch]:
    """The batches of a bundle's sections (``raw_sections``)."""
    out = []
    for key, count, payload in raw_sections(body):
        kind, lay = _checked_section(key, count, payload)
        if lay is not None:
            out.append(Batch(run_id, kind, PackedBatch(lay, payload, count), attrs))
        else:
            out.append(Batch(run_id, kind, decode_body(kind, payload), attrs, payload))
    return out


# One well-formed section header (``kind TAB layout TAB count TAB size LF``), matched in one C call; anything else
# goes through ``raw_sections``, which takes the same bodies and refuses the rest saying why.
_SECTION_HEADER = re.compile(rb"([^\t\n]{1,64}\t[^\t\n]{0,4096})\t(\d{1,12})\t(\d{1,12})\n")
# header key (``kind TAB layout``) -> (kind, PackedLayout or None for JSON, record size): one agent sends the same
# few keys every cycle, so a bundle's sections are classified with one dict lookup each
_section_plans: dict[bytes, tuple[str, PackedLayout | None, int]] = {}


def _section_plan(key: bytes) -> tuple[str, PackedLayout | None, int]:
    kind, layout = section_kind(key)
    if kind == KIND_BUNDLE:
        raise WireError("bundle: a bundle inside a bundle")
    lay = (packed_layout_of(kind, layout)) if layout else None
    plan = (kind, lay, lay.dtype.itemsize if lay is not None else 0)
    if len(_section_plans) < 256:
        _section_plans[key] = plan
    return plan


# Bundle shapes seen before: an agent sends the same sections every cycle (the same kinds, layouts and record counts,
# so the same header bytes at the same offsets), its heartbeat last, whose size alone varies. Each shape is one
# alternative of ``_shapes_re`` (the exact header bytes, a fixed-length skip over each packed payload, then the
# heartbeat's header with its size in the alternative's one group), so a bundle of a known shape costs one regex
# match instead of one per section. Only shapes a full scan took are learnt, so a match reads the body exactly as
# that scan would (the same sections, sizes and counts, already checked); the heartbeat is decoded as before.
MAX_SHAPES = 64
_shapes: list[tuple[tuple, bytes]] = []  # (((kind, layout, start, end, count), ...), the alternative's pattern)
_shapes_re: re.Pattern | None = None


def _learn_shape(body: bytes, packed_at: list, heartbeat_at: int) -> None:
    """Remember the shape of a bundle the full scan took: packed sections ``(kind, layout, header start, payload
    start, payload end, count)``, in body order, then one heartbeat whose header starts at ``heartbeat_at``."""
    global _shapes_re
    if len(_shapes) >= MAX_SHAPES:
        return
    pattern, pos, shape = [], 0, []
    for kind, lay, head, start, end, count in packed_at:
        if head != pos:
            return
        pattern.append(re.escape(body[head:start]) + b".{%d}" % (end - start))
        shape.append((kind, lay, start, end, count))
        pos = end
    if heartbeat_at != pos:
        return
    pattern.append(rb"heartbeat\t\t1\t(\d{1,12})\n")
    alt = b"".join(pattern)
    if any(p == alt for _, p in _shapes):
        return
    _shapes.append((tuple(shape), alt))
    _shapes_re = re.compile(b"|".join(b"(?:%s)" % p for _, p in _shapes), re.DOTALL)


def _scan_bundle(run_id: str, attrs: dict[str, Any], body: bytes) -> Bundle:
    """A bundle's sections. This runs per agent and ship cycle at fleet rate: a bundle of a shape seen before
    (``_learn_shape``) costs one regex match; otherwise a well-formed section costs one regex match, one dict lookup
    and one tuple; a body neither fast path takes is parsed by ``raw_sections`` (``_scan_bundle_slow``), which raises
    with the reason."""
    n = len(body) if isinstance(body, bytes) else 0
    if _shapes_re is not None and n:
        m = _shapes_re.match(body)
        if m is not None:
            k = m.lastindex
            start = m.end()
            if start + int(m.group(k)) == n:
                return Bundle(run_id, attrs,
                              [(kind, lay, body[a:b], count) for kind, lay, a, b, count in _shapes[k - 1][0]],
                              [decode_body("heartbeat", body[start:])], [])
    packed: list = []
    heartbeats: list = []
    others: list = []
    packed_at: list = []  # where each packed section is, and where the heartbeat's header starts: a shape to learn
    heartbeat_at = -1
    pos = 0
    match = _SECTION_HEADER.match
    plans = _section_plans
    sections = 0
    while pos < n:
        m = match(body, pos)
        if m is None:
            return _scan_bundle_slow(run_id, attrs, body)
        key, count, size = m.group(1, 2, 3)
        start = m.end()
        end = start + int(size)
        if end > n:
            return _scan_bundle_slow(run_id, attrs, body)
        sections += 1
        if sections > MAX_BUNDLE_SECTIONS:
            raise WireError(f"bundle: more than {MAX_BUNDLE_SECTIONS} sections")
        kind, lay, size = plans.get(key) or _section_plan(key)
        if lay is not None:
            count = int(count)
            if not count or count * size != end - start:
                return _scan_bundle_slow(run_id, attrs, body)
            packed.append((kind, lay, body[start:end], count))
            packed_at.append((kind, lay, pos, start, end, count))
        elif kind == "heartbeat":
            heartbeats.append(decode_body(kind, body[start:end]))
            heartbeat_at = pos if not heartbeats[1:] and count == b"1" else -2
        else:
            payload = body[start:end]
            others.append(Batch(run_id, kind, decode_body(kind, payload), attrs, payload))
        pos = end
    if not sections:
        raise WireError("bundle: empty body")
    if heartbeat_at >= 0 and not others and packed and len(_shapes) < MAX_SHAPES:
        _learn_shape(body, packed_at, heartbeat_at)
    return Bundle(run_id, attrs, packed, heartbeats, others)


def _scan_bundle_slow(run_id: str, attrs: dict[str, Any], body: bytes) -> Bundle:
    """``_scan_bundle`` with each header checked step by step (``raw_sections``): what a body the fast path does
    not take is, accepted or refused with the reason."""
    b = Bundle(run_id, attrs, [], [], [])
    for key, count, payload in raw_sections(body):
        kind, lay = _checked_section(key, count, payload)
        if lay is not None:
            b.packed.append((kind, lay, payload, count))
        elif kind == "heartbeat":
            b.heartbeats.append(decode_body(kind, payload))
        else:
            b.others.append(Batch(run_id, kind, decode_body(kind, payload), attrs, payload))
    return b


def _salvage_rows(kind: str, body: bytes | str) -> tuple[list, list[bytes], list[tuple[int, str]]] | None:
    """A JSON batch that did not decode whole, row by row: (records, their raw JSON, [(row, why)] of the rest);
    None when the body is not a JSON array of a batch kind or no row decodes."""
    dec = _row_decoders.get(kind)
    if dec is None:
        return None
    try:
        raws = _raw_array.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    items, kept, refused = [], [], []
    for j, raw in enumerate(raws):
        try:
            items.append(dec.decode(raw))
            kept.append(bytes(raw))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            refused.append((j, f"{kind} record does not decode: {e}"))
    return (items, kept, refused) if items else None
