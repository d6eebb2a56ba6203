"""How ranksight records travel inside OTLP logs (see docs/otlp-mapping.md).

One OTLP LogRecord carries a *batch* of records of one kind (one agent's records
of one ship cycle). Two body encodings:

- JSON (the default, and what older agents send): the body is a string holding a
  JSON array of ranksight.schema records exactly as msgspec encodes them (spool
  lines are forwarded byte for byte, never re-encoded). The head decodes it with
  one msgspec call per batch.
- ``packed-v1`` (attribute ``ranksight.encoding``; the volume kinds: step records,
  collective records, GPU samples): the body is bytes holding the records as a
  little-endian numpy structured array whose fields the attribute ``ranksight.layout``
  names (``name:code,...``; codes ``i8`` int64, ``n8`` int64 or null (null is
  -2**63), ``f8`` float64 with NaN for null, ``b1`` bool byte, ``S<n>`` UTF-8 padded
  with NULs). A field derived from another (a GPU sample's ``throttle_names``, the
  names of its ``throttle_reasons`` bits) is left out and made again by the head. The run id travels only as the attribute. The head
  checks the layout and the length, logs the bytes and queues them; all batches
  of a flush become one array with one ``np.frombuffer`` call and go to Arrow
  column by column: no Python object per record anywhere on the head.

- ``bundle-v1`` (kind ``bundle``): one log record holding an agent's batches of one ship cycle (its packed
  step, collective and GPU batches and its heartbeat), so the head reads one log record's attributes per agent
  and cycle, not one per kind. The body is a sequence of sections, each
  ``<kind> TAB <layout> TAB <count> TAB <bytes> LF <payload>``: a packed-v1 payload when ``layout`` is
  given, else the kind's JSON body. The head takes a bundle whole or refuses it whole (one rejection for the log
  record); an older head refuses the unknown encoding, and the agent then sends the batches one log record each
  (``node.shipping``).

Attributes say what is inside (run, kind, rank, count, step range) so a
Collector can route or filter without parsing the body.

This module is the contract both ends share: the attributes, the three encodings, the layouts and the bundle's
sections, with the agent's encoders; it knows nothing of HTTP. The head reads log records with
``ranksight.wire_decode`` (``iter_indexed``), and what it answers about refused records is
``ranksight.wire_rejections``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ranksight import schema
from ranksight.simgpu import throttle_names

# Log record event names and attribute keys (the public mapping).
EVENT_NAME = "ranksight.records"
A_RUN = "ranksight.run_id"
A_KIND = "ranksight.kind"
A_RANK = "ranksight.rank"
A_NODE = "ranksight.node"
A_COUNT = "ranksight.count"
A_STEP_MIN = "ranksight.step_min"
A_STEP_MAX = "ranksight.step_max"
A_SCHEMA = "ranksight.schema_version"
A_MTIME = "ranksight.manifest_mtime"
A_ENCODING = "ranksight.encoding"
A_LAYOUT = "ranksight.layout"
ENC_PACKED = "packed-v1"
ENC_BUNDLE = "bundle-v1"
KIND_BUNDLE = "bundle"  # one log record holding several batches (``pack_bundle``)
# Resource attributes of an agent.
R_NODE = "ranksight.node"
R_HOST = "host.name"
R_AGENT_URL = "ranksight.agent.url"
R_AGENT_ID = "ranksight.agent.id"
R_RUN = "ranksight.run_id"

# kind -> the type of each element of the body array, and the store table it lands in.
# "manifest" and "heartbeat" bodies are one JSON object, not an array.
BATCH_KINDS: dict[str, tuple[Any, str | None]] = {
    "step": (schema.StepRecord, "steps"),
    "collective": (schema.CollectiveRecord, "collectives"),
    "communicator": (schema.CommunicatorRecord, "communicators"),
    "event": (schema.EventRecord, "events"),
    "gpu": (schema.GpuSample, "gpu"),
    "host": (schema.HostSample, "host"),
    "xid": (schema.XidEvent, "xid"),
    "nccl": (schema.NcclEvent, "nccl_events"),
    "trace_summary": (schema.TraceSummary, "trace_summaries"),
    "ack": (schema.ControlAck, None),  # the trainer's control acks: become action status updates (not a table)
}



class Heartbeat(msgspec.Struct, kw_only=True):
    """Agent liveness and self-metrics, sent every ship cycle."""

    node: int
    host: str
    url: str = ""  # where the agent's control endpoint listens
    t: float
    ranks: list[int] = []
    lag_s: float = 0.0
    spooled_records: int = 0
    dropped_records: int = 0
    ship_errors: int = 0
    garbage_lines: int = 0
    rejected_records: int = 0  # records the head refused, kept aside by the agent




# ---------------------------------------------------------------------------
# packed-v1: records as a numpy structured array (both ends)
# ---------------------------------------------------------------------------

PACKED_STR_BYTES = 64  # width of string fields an agent packs (longer strings: the batch goes as JSON)
_MAX_STR_BYTES = 1024  # widest string field the head accepts
KIND_OF_TABLE = {table: kind for kind, (_, table) in BATCH_KINDS.items() if table}
_NP = {"i8": "<i8", "n8": "<i8", "f8": "<f8", "b1": "u1"}
NULL_INT = -(1 << 63)  # an ``n8`` field's null (a record holding this very value is not packed)
# Fields a packed body leaves out because they follow from another field: kind -> {field: (source field, function)}.
# The agent packs a record only when the field equals function(source); the head makes the column from the source.
DERIVED: dict[str, dict[str, tuple[str, Any]]] = {"gpu": {"throttle_names": ("throttle_reasons", throttle_names)}}


def _field_codes(typ) -> dict[str, tuple[str | None, Any]]:
    """name -> (packed code or None when the field cannot be packed, default or NODEFAULT)."""
    mi = msgspec.inspect
    out = {}
    for f in mi.type_info(typ).fields:
        t = f.type
        if isinstance(t, mi.UnionType):
            rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
            one = rest[0] if len(rest) == 1 else None
            code = "f8" if isinstance(one, mi.FloatType) else "n8" if isinstance(one, mi.IntType) else None
        elif isinstance(t, mi.IntType):
            code = "i8"
        elif isinstance(t, mi.FloatType):
            code = "f8"
        elif isinstance(t, mi.BoolType):
            code = "b1"
        elif isinstance(t, mi.StrType):
            code = "S"
        else:
            code = None
        default = f.default
        if default is msgspec.NODEFAULT and f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()  # e.g. an empty member list
        out[f.name] = (code, default)
    return out


class PackedLayout:
    """A validated ``ranksight.layout``: the numpy dtype of one packed record and how to read it."""

    encoding = ENC_PACKED

    def __init__(self, kind: str, text: str):
        typ = BATCH_KINDS[kind][0]
        fields = _field_codes(typ)
        self.kind, self.text = kind, text
        self.codes: dict[str, str] = {}
        np_fields = []
        for part in text.split(","):
            name, _, code = part.partition(":")
            want = fields.get(name, (None, None))[0]
            if name == "run_id" or want is None or name in self.codes:
                raise WireError(f"{kind}: layout field {name!r} is not a packable field of {typ.__name__}")
            if want == "S":
                if not (code[:1] == "S" and code[1:].isdigit() and 1 <= int(code[1:]) <= _MAX_STR_BYTES):
                    raise WireError(f"{kind}: layout field {name!r} must be S<1..{_MAX_STR_BYTES}>, not {code!r}")
                np_fields.append((name, code))
            elif code != want:
                raise WireError(f"{kind}: layout field {name!r} must be {want}, not {code!r}")
            else:
                np_fields.append((name, _NP[code]))
            self.codes[name] = code
        # Fields the layout leaves out take their default; a field without a default must be there.
        self.defaults: dict[str, Any] = {}
        for name, (code, default) in fields.items():
            if name in self.codes or name == "run_id":
                continue
            if default is msgspec.NODEFAULT:
                raise WireError(f"{kind}: layout lacks the required field {name!r}")
            self.defaults[name] = default
        # derived fields left out (``DERIVED``) whose source is in the layout: the head makes them from the source
        self.derived = {n: (src, fn) for n, (src, fn) in DERIVED.get(kind, {}).items()
                        if n not in self.codes and src in self.codes}
        self.dtype = np.dtype(np_fields)

    def __repr__(self) -> str:
        return f"PackedLayout({self.kind!r}, {self.text!r})"


def _default_layout(kind: str) -> str | None:
    """Every packable field of ``kind``; a field that cannot be packed (a list) is left out when it has a default,
    and then only records holding that default are packed (``pack_records``)."""
    parts = []
    for name, (code, default) in _field_codes(BATCH_KINDS[kind][0]).items():
        if name == "run_id":
            continue
        if code is None:
            if default is msgspec.NODEFAULT:
                return None
            continue
        parts.append(f"{name}:S{PACKED_STR_BYTES}" if code == "S" else f"{name}:{code}")
    return ",".join(parts)


# What an agent packs: the volume kinds. Step records; collective records that name their group by comm_id
# (their member list, left out of the layout, empty: the communicators table holds it); GPU samples (one per GPU
# per second: at 16,384 GPUs as many as step records).
PACKED_LAYOUTS: dict[str, str] = {k: lay for k in ("step", "collective", "gpu") if (lay := _default_layout(k))}
_layouts: dict[tuple[str, str], PackedLayout] = {}


def packed_layout_of(kind: str, text: str) -> PackedLayout:
    """The (cached) layout of ``kind`` described by ``text``; raises WireError if it is not valid."""
    key = (kind, text)
    lay = _layouts.get(key)
    if lay is None:
        if kind not in BATCH_KINDS or kind == "ack" or not isinstance(text, str) or not text:
            raise WireError(f"{kind}: no packed encoding for this kind (or no layout)")
        lay = PackedLayout(kind, text)
        if len(_layouts) < 256:  # a client inventing layouts must not grow this without bound
            _layouts[key] = lay
    return lay


def packed_count(lay: PackedLayout, payload: bytes) -> int:
    size = lay.dtype.itemsize
    if not payload or len(payload) % size:
        raise WireError(f"{lay.kind}: packed body of {len(payload)} bytes is not a whole number of "
                        f"{size}-byte records")
    return len(payload) // size


_pack_plans: dict[str, tuple | None] = {}


def _pack_plan(kind: str, lay: PackedLayout) -> tuple | None:
    """Where each field of ``lay`` sits in ``msgspec.structs.astuple`` of a record (the layout lists the
    struct's fields in order, less run_id), and which of them are strings and nullable floats."""
    plan = _pack_plans.get(kind, False)
    if plan is False:
        names = [f.name for f in msgspec.structs.fields(BATCH_KINDS[kind][0])]
        derived = DERIVED.get(kind, {})
        keep = [i for i, n in enumerate(names) if n != "run_id" and n in lay.codes]
        # fields the layout leaves out: each packed record must hold the field's default
        left_out = [(i, lay.defaults[n]) for i, n in enumerate(names)
                    if n != "run_id" and n not in lay.codes and n not in derived]
        # derived fields: each packed record must hold function(source)
        derive = [(names.index(n), names.index(src), fn) for n, (src, fn) in derived.items()
                  if n not in lay.codes and src in lay.codes]
        plan = None
        if [names[i] for i in keep] == list(lay.dtype.names) and len(derive) == len(derived):
            plan = (names.index("run_id") if "run_id" in names else None, keep,
                    [j for j, i in enumerate(keep) if lay.codes[names[i]].startswith("S")],
                    [j for j, i in enumerate(keep) if lay.codes[names[i]] == "f8"], left_out,
                    [j for j, i in enumerate(keep) if lay.codes[names[i]] == "n8"], derive)
        _pack_plans[kind] = plan
    return plan


def pack_records(kind: str, run_id: str, records: list) -> tuple[str, bytes] | None:
    """(layout, body) for ``records`` of ``kind`` (agent side), or None when they cannot be packed
    exactly (a record of another run, a string longer than the field or holding NUL, an integer
    beyond int64, a nullable integer equal to ``NULL_INT``, a derived field that does not follow from its
    source): the caller then ships them as JSON. ``run_id`` is not checked for kinds without one (GPU samples)."""
    layout = PACKED_LAYOUTS.get(kind)
    if layout is None or not records:
        return None
    lay = packed_layout_of(kind, layout)
    names = lay.dtype.names
    plan = _pack_plan(kind, lay)
    if plan is None:
        return None
    run_idx, keep, str_pos, f8_pos, left_out, n8_pos, derive = plan
    rows = []
    width = [8] * len(str_pos)
    nan = float("nan")
    astuple = msgspec.structs.astuple
    try:
        for r in records:
            t = astuple(r)
            if run_idx is not None and t[run_idx] != run_id:
                return None
            for i, d in left_out:
                if t[i] != d:  # e.g. a collective record that carries its member list: JSON
                    return None
            for i, src, fn in derive:
                if t[i] != fn(t[src]):
                    return None
            row = [t[i] for i in keep]
            for k, j in enumerate(str_pos):
                v = row[j].encode()
                if len(v) > PACKED_STR_BYTES or b"\0" in v:
                    return None
                if len(v) > width[k]:
                    width[k] = len(v)
                row[j] = v
            for j in f8_pos:
                if row[j] is None:
                    row[j] = nan
            for j in n8_pos:
                if row[j] is None:
                    row[j] = NULL_INT
                elif row[j] == NULL_INT:
                    return None
            rows.append(tuple(row))
        if str_pos:  # string fields as wide as this batch needs (a multiple of 8), not PACKED_STR_BYTES
            w = {names[j]: width[k] for k, j in enumerate(str_pos)}
            layout = ",".join(f"{n}:S{-(-w[n] // 8) * 8}" if n in w else f"{n}:{lay.codes[n]}" for n in names)
            lay = packed_layout_of(kind, layout)
        arr = np.array(rows, dtype=lay.dtype)
        # fields every record of this batch leaves at their default (a timing the trainer does not measure, a GPU
        # figure the device does not report) are left out of the layout: the head fills the default
        out = [n for n in names if not _all_default(arr[n], lay.codes[n], _defaults_of(kind).get(n, _NO_DEFAULT))]
        if len(out) < len(names):
            layout = ",".join(f"{n}:{lay.codes[n]}" for n in out)
            lay = packed_layout_of(kind, layout)
            slim = np.empty(len(arr), dtype=lay.dtype)
            for n in out:
                slim[n] = arr[n]
            arr = slim
        return layout, arr.tobytes()
    except (OverflowError, TypeError, ValueError, AttributeError):
        return None


_NO_DEFAULT = object()
_kind_defaults: dict[str, dict[str, Any]] = {}


def _defaults_of(kind: str) -> dict[str, Any]:
    """field -> default of ``kind``'s record type, for the fields that have one."""
    d = _kind_defaults.get(kind)
    if d is None:
        d = _kind_defaults[kind] = {n: dflt for n, (_, dflt) in _field_codes(BATCH_KINDS[kind][0]).items()
                                    if dflt is not msgspec.NODEFAULT}
    return d


def _all_default(col: np.ndarray, code: str, default: Any) -> bool:
    """Whether every packed value of a column holds the field's default (so the layout can leave it out)."""
    if default is _NO_DEFAULT or isinstance(default, list):
        return False
    if default is None:
        if code == "f8":
            return bool(np.isnan(col).all())
        return code == "n8" and bool((col == NULL_INT).all())
    if code.startswith("S"):
        return isinstance(default, str) and bool((col == default.encode()).all())
    if code == "f8":  # a float default: equal, and not -0.0 for 0.0 (the head would store 0.0)
        return bool((col == default).all()) and not bool(np.signbit(col).any() and default == 0)
    if isinstance(default, bool) or code == "b1":
        return bool((col == int(default)).all())
    return bool((col == default).all())


@dataclass(slots=True)
class PackedBatch:
    """A packed body as the head keeps it until the store processes it."""

    layout: PackedLayout
    payload: bytes
    count: int

    def __len__(self) -> int:
        return self.count


def join_array(items: list[bytes]) -> bytes:
    """A JSON array from already-encoded JSON values (spool lines), without re-encoding."""
    return b"[" + b",".join(items) + b"]"


MAX_BUNDLE_SECTIONS = 4096  # sections one bundle may hold (the head refuses more)


def pack_bundle(sections: list[tuple[str, str | None, bytes, int]]) -> bytes:
    """A ``bundle-v1`` body from ``(kind, packed-v1 layout or None for JSON, body, record count)`` sections."""
    out = []
    for kind, layout, body, count in sections:
        if "\t" in kind or "\n" in kind or (layout and ("\t" in layout or "\n" in layout)):
            raise ValueError(f"{kind}: a tab or newline in a bundle section's kind or layout")
        out.append(b"%s\t%s\t%d\t%d\n" % (kind.encode(), (layout or "").encode(), count, len(body)))
        out.append(body)
    return b"".join(out)


def bundle_sections(body: bytes) -> list[tuple[str, str, int, bytes]]:
    """The sections of a ``bundle-v1`` body: ``(kind, layout ("" for JSON), count, payload)``; raises WireError on a
    truncated or malformed body (the head then refuses the whole log record)."""
    return [(*section_kind(key), count, payload) for key, count, payload in raw_sections(body)]


def raw_sections(body: bytes) -> list[tuple[bytes, int, bytes]]:
    """(``kind TAB layout`` as bytes, count, payload) of each section of a bundle body, each header checked step by
    step; raises WireError saying what is wrong (the head's fast scan, ``wire_decode``, falls back to this)."""
    if not isinstance(body, bytes) or not body:
        raise WireError("bundle: empty body")
    out = []
    pos, n = 0, len(body)
    find = body.find
    while pos < n:
        nl = find(b"\n", pos, pos + 8192)
        if nl < 0:
            raise WireError(f"bundle: section header at byte {pos} does not end (truncated or not a bundle)")
        parts = body[pos:nl].rsplit(b"\t", 2)
        try:
            if len(parts) != 3 or b"\t" not in parts[0]:
                raise ValueError
            count, size = int(parts[1]), int(parts[2])
        except ValueError:
            raise WireError(f"bundle: section header at byte {pos} does not parse") from None
        start = nl + 1
        if count < 0 or size < 0 or start + size > n:
            raise WireError(f"bundle: section at byte {pos} claims {size} bytes, {n - start} left (truncated)")
        out.append((parts[0], count, body[start:start + size]))
        if len(out) > MAX_BUNDLE_SECTIONS:
            raise WireError(f"bundle: more than {MAX_BUNDLE_SECTIONS} sections")
        pos = start + size
    return out


_section_kinds: dict[bytes, tuple[str, str]] = {}


def section_kind(key: bytes) -> tuple[str, str]:
    """(kind, layout text) of a section's ``kind TAB layout`` (cached: one agent sends the same few every cycle)."""
    got = _section_kinds.get(key)
    if got is None:
        kind, tab, layout = key.partition(b"\t")
        if not tab:
            raise WireError("bundle: section header without a layout field")
        try:
            got = (kind.decode(), layout.decode())
        except UnicodeDecodeError:
            raise WireError("bundle: a section's kind or layout is not UTF-8") from None
        if "\t" in got[1]:
            raise WireError("bundle: section header with a tab in its layout")
        if len(_section_kinds) < 256:
            _section_kinds[key] = got
    return got


def make_log_record(run_id: str, kind: str, body: bytes, *, rank: int | None = None, node: int | None = None,
                    count: int | None = None, step_min: int | None = None, step_max: int | None = None,
                    extra: dict[str, Any] | None = None, resource=None, scope=None, layout: str | None = None,
                    bundle: bool = False):
    """One SDK ReadableLogRecord for the OTLP exporter (agent side).

    ``layout``: the body is packed-v1 records of that layout (sent as bytes_value); ``bundle``: the body is a
    ``bundle-v1`` body (``pack_bundle``, sent as bytes_value, ``kind`` should be ``bundle``); otherwise it is JSON
    (sent as string_value)."""
    from opentelemetry._logs import LogRecord
    from opentelemetry.sdk._logs import ReadableLogRecord

    attrs: dict[str, Any] = {A_RUN: run_id, A_KIND: kind}
    if bundle:
        attrs[A_ENCODING] = ENC_BUNDLE  # third, so the head can stop reading attributes here (wire_decode.iter_indexed)
    elif layout is not None:
        # First, so the head can stop reading attributes once it has these four (wire_decode.iter_batches).
        attrs[A_ENCODING] = ENC_PACKED
        attrs[A_LAYOUT] = layout
    attrs[A_SCHEMA] = schema.SCHEMA_VERSION
    if rank is not None:
        attrs[A_RANK] = rank
    if node is not None:
        attrs[A_NODE] = node
    if count is not None:
        attrs[A_COUNT] = count
    if step_min is not None:
        attrs[A_STEP_MIN] = step_min
        attrs[A_STEP_MAX] = step_max
    if extra:
        attrs.update(extra)
    now = time.time_ns()
    binary = layout is not None or bundle
    rec = LogRecord(timestamp=now, observed_timestamp=now, body=bytes(body) if binary else body.decode("utf-8"),
                    attributes=attrs, event_name=EVENT_NAME)
    return ReadableLogRecord(log_record=rec, resource=resource, instrumentation_scope=scope)


# ---------------------------------------------------------------------------
# What both ends raise on a body that does not decode (the head side is ranksight.wire_decode)
# ---------------------------------------------------------------------------


class WireError(ValueError):
    """A log record that claims to be ranksight's but cannot be decoded."""
