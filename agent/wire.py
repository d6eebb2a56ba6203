"""How ranksight records travel inside OTLP logs (see docs/otlp-mapping.md).

One OTLP LogRecord carries a *batch* of records of one kind (usually one rank's
records of one ship cycle): its body is a string holding a JSON array of
ranksight.schema records exactly as msgspec encodes them (spool lines are
forwarded byte for byte, never re-encoded). Attributes say what is inside
(run, kind, rank, count, step range) so a Collector can route or filter without
parsing the body; the head decodes a whole batch with one msgspec call
(~1 µs per step record) instead of walking thousands of protobuf attributes.

This module is shared by the node agent (encode) and the head (decode); it
knows nothing of HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgspec

from ranksight import schema

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
    "event": (schema.EventRecord, "events"),
    "gpu": (schema.GpuSample, "gpu"),
    "host": (schema.HostSample, "host"),
    "xid": (schema.XidEvent, "xid"),
    "nccl": (schema.NcclEvent, "nccl_events"),
    "trace_summary": (schema.TraceSummary, "trace_summaries"),
    "ack": (schema.ControlAck, None),  # the trainer's control acks: become action status updates (not a table)
}
OBJECT_KINDS = ("manifest", "heartbeat")

_batch_decoders = {k: msgspec.json.Decoder(list[t]) for k, (t, _) in BATCH_KINDS.items()}
_manifest_decoder = msgspec.json.Decoder(schema.Manifest)


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


_heartbeat_decoder = msgspec.json.Decoder(Heartbeat)


def join_array(items: list[bytes]) -> bytes:
    """A JSON array from already-encoded JSON values (spool lines), without re-encoding."""
    return b"[" + b",".join(items) + b"]"


def make_log_record(run_id: str, kind: str, body: bytes, *, rank: int | None = None, node: int | None = None,
                    count: int | None = None, step_min: int | None = None, step_max: int | None = None,
                    extra: dict[str, Any] | None = None, resource=None, scope=None):
    """One SDK ReadableLogRecord for the OTLP exporter (agent side)."""
    from opentelemetry._logs import LogRecord
    from opentelemetry.sdk._logs import ReadableLogRecord

    attrs: dict[str, Any] = {A_RUN: run_id, A_KIND: kind, A_SCHEMA: schema.SCHEMA_VERSION}
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
    rec = LogRecord(timestamp=now, observed_timestamp=now, body=body.decode("utf-8"), attributes=attrs,
                    event_name=EVENT_NAME)
    return ReadableLogRecord(log_record=rec, resource=resource, instrumentation_scope=scope)


# ---------------------------------------------------------------------------
# Head side
# ---------------------------------------------------------------------------


class WireError(ValueError):
    """A log record that claims to be ranksight's but cannot be decoded."""


@dataclass
class Batch:
    run_id: str
    kind: str
    items: Any  # list of records, a Manifest, or a Heartbeat
    attrs: dict[str, Any]  # the ranksight.* attributes only
    body: bytes | str = b""  # the body as received: the head logs it as is when nothing was a duplicate


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


_HEAD_ATTRS = frozenset((A_RUN, A_KIND, A_MTIME))


def iter_batches(request) -> Iterator[tuple[Batch | None, str | None]]:
    """Walk an ExportLogsServiceRequest: (batch, None) per ranksight log record,
    (None, reason) per record that is not decodable. Foreign log records (no
    ranksight.kind attribute) are skipped silently: a Collector may mix streams."""
    for rl in request.resource_logs:
        for sl in rl.scope_logs:
            for lr in sl.log_records:
                # Only the attributes the head uses, read directly: this runs per log record at fleet rate.
                attrs = {}
                for kv in lr.attributes:
                    k = kv.key
                    if k in _HEAD_ATTRS:
                        attrs[k] = any_value(kv.value)
                kind = attrs.get(A_KIND)
                if kind is None:
                    continue
                run_id = attrs.get(A_RUN)
                if not isinstance(run_id, str) or not run_id or "/" in run_id or run_id.startswith("."):
                    yield None, f"bad run id {run_id!r}"
                    continue
                which = lr.body.WhichOneof("value")
                if which == "string_value":
                    body: bytes | str = lr.body.string_value
                elif which == "bytes_value":
                    body = lr.body.bytes_value
                else:
                    yield None, f"{kind}: body is {which}, expected a JSON string"
                    continue
                try:
                    items = decode_body(kind, body)
                except WireError as e:
                    yield None, str(e)
                    continue
                yield Batch(run_id=run_id, kind=kind, items=items, attrs=attrs, body=body), None
