"""OTLP/HTTP request decoding for the head (protobuf or OTLP/JSON, optionally zstd, gzip or deflate).

Only the transport concerns live here: authentication, size limits, decompression,
protobuf / JSON parsing and the OTLP response (in the request's encoding). Every failure is an ``HttpError``
with a 4xx status and a short reason; the caller logs it and answers, and the
head keeps running.
"""

from __future__ import annotations

import binascii
import hmac
import threading
import zlib
from contextlib import contextmanager

import msgspec
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsPartialSuccess,
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from ranksight import wire_rejections
from ranksight.zstd import zstd_codec

# Bounds on what one request may cost the head: compressed bytes on the wire and
# bytes after decompression (a small zstd or gzip bomb must not take the head's memory).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
MAX_INFLIGHT_DECOMPRESSED_BYTES = 1024 * 1024 * 1024  # all requests together
# OTLP/JSON is decoded into Python objects before json_format fills the message: up to ~24 bytes of objects per byte
# of a body of tiny values (`[{},{},...]`), so a JSON body is capped lower and its decoding reserves that much more of
# the in-flight budget while it runs. Volume senders use protobuf (the agent always does).
MAX_JSON_BYTES = 32 * 1024 * 1024
JSON_EXPANSION = 16


class HttpError(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def check_token(headers, token: str) -> None:
    """Bearer-token check in constant time. 401 without a token, 403 with a wrong one."""
    auth = headers.get("Authorization") or ""
    if not auth.startswith("Bearer "):
        raise HttpError(401, "missing bearer token")
    if not hmac.compare_digest(auth[7:].strip().encode(), token.encode()):
        raise HttpError(403, "wrong token")


def read_body(rfile, headers, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    length = headers.get("Content-Length")
    if length is None:
        if (headers.get("Transfer-Encoding") or "").lower() == "chunked":
            raise HttpError(411, "chunked bodies are not accepted: send Content-Length")
        raise HttpError(411, "Content-Length required")
    try:
        n = int(length)
    except ValueError:
        raise HttpError(400, "bad Content-Length") from None
    if n < 0:
        raise HttpError(400, "bad Content-Length")
    if n > max_bytes:
        raise HttpError(413, f"body of {n} bytes exceeds {max_bytes}")
    data = rfile.read(n)
    if len(data) != n:
        raise HttpError(400, "body shorter than Content-Length")
    return data


class InflightBudget:
    """Bytes of decompressed request bodies held at once, across every request: each request's own cap
    (``MAX_DECOMPRESSED_BYTES``) does not bound many of them together (concurrent gzip bombs once reached 2.7 GB)."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.total:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used = max(0, self.used - n)


INFLIGHT = InflightBudget(MAX_INFLIGHT_DECOMPRESSED_BYTES)
_NO_BUDGET = InflightBudget(1 << 62)  # decompress() outside a request: bounded by its limit alone
_INFLATE_CHUNK = 4 * 1024 * 1024


@contextmanager
def inflated(body: bytes, encoding: str | None):
    """The request body decompressed, its bytes counted against ``INFLIGHT`` while the request is handled; 503 when
    the budget is spent (the sender retries), 413 past the per-request cap."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        yield body
        return
    out = decompress(body, encoding, budget=INFLIGHT)  # its bytes are now reserved in INFLIGHT
    try:
        yield out
    finally:
        INFLIGHT.give(len(out))


def decompress(body: bytes, encoding: str | None, limit: int | None = None,
               budget: InflightBudget | None = None) -> bytes:
    """The body decompressed, at most ``limit`` bytes (default ``MAX_DECOMPRESSED_BYTES``). With a ``budget`` (the server's ``INFLIGHT``, through
    ``inflated``), its output is reserved from it chunk by chunk as it grows (given back here on error, by the caller
    after use); without, nothing is reserved (a benchmark or a tool decompressing a body it holds)."""
    limit = MAX_DECOMPRESSED_BYTES if limit is None else limit  # read at call time (a test may lower it)
    budget = budget if budget is not None else _NO_BUDGET
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        return body
    if enc == "zstd":
        return _unzstd(body, limit, budget)
    if enc not in ("gzip", "deflate"):
        raise HttpError(415, f"unsupported Content-Encoding {encoding!r}: send zstd, gzip or deflate")
    # wbits 16+MAX: gzip wrapper; MAX (zlib) for deflate. Bounded output.
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
    parts: list[bytes] = []
    reserved = 0
    try:
        buf = body
        while True:
            want = min(_INFLATE_CHUNK, limit + 1 - reserved)
            if not budget.take(want):
                raise HttpError(503, "too much decompressed data in flight: retry shortly")
            reserved += want
            chunk = d.decompress(buf, want)
            budget.give(want - len(chunk))
            reserved -= want - len(chunk)
            parts.append(chunk)
            if reserved > limit:
                raise HttpError(413, f"decompressed body exceeds {limit} bytes")
            buf = d.unconsumed_tail
            if not buf:
                break
        tail = d.flush()
        if tail:
            if not budget.take(len(tail)):
                raise HttpError(503, "too much decompressed data in flight: retry shortly")
            reserved += len(tail)
            parts.append(tail)
    except zlib.error as e:
        budget.give(reserved)
        raise HttpError(400, f"bad {enc} data: {e}") from None
    except HttpError:
        budget.give(reserved)
        raise
    if not d.eof:
        budget.give(reserved)
        raise HttpError(400, f"truncated {enc} data")
    return b"".join(parts)


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def zstd_content_size(body: bytes) -> int | None:
    """The decompressed size a zstd frame's header declares (``Frame_Content_Size``, RFC 8878 3.1.1.1), None when
    the body is not a zstd frame or its header leaves the size out (a streaming compressor's frame)."""
    if len(body) < 6 or body[:4] != _ZSTD_MAGIC:
        return None
    fhd = body[4]
    single = (fhd >> 5) & 1
    fcs_bytes = (0, 2, 4, 8)[fhd >> 6] or (1 if single else 0)
    if not fcs_bytes:
        return None
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    if pos + fcs_bytes > len(body):
        return None
    size = int.from_bytes(body[pos:pos + fcs_bytes], "little")
    return size + 256 if fcs_bytes == 2 else size


def _unzstd(body: bytes, limit: int, budget: InflightBudget) -> bytes:
    """A zstd body (``Content-Encoding: zstd``, RFC 8878) decompressed with pyarrow's zstd codec (the head's pyarrow:
    no other dependency), at most ``limit`` bytes, reserved from ``budget``. A frame whose header declares its size
    (what one-shot compressors write: the agent, the zstd tool, Go's ``EncodeAll``) is checked against the limit
    before anything is decompressed and then decompressed into a buffer of exactly that size in one call (the codec
    refuses a frame whose content does not match it); other bodies (streamed frames, several frames) are read
    through pyarrow's decompressing stream in bounded chunks, as deflate is. The decoder's window is capped by
    zstd's default (128 MiB), so a frame cannot ask for more memory than that either."""
    import pyarrow as pa

    codec = zstd_codec()
    if codec is None:  # this head's pyarrow was built without zstd: an agent falls back to deflate on the 415
        raise HttpError(415, "unsupported Content-Encoding 'zstd' (this head's pyarrow has no zstd): "
                             "send gzip or deflate")
    if not body:
        raise HttpError(400, "truncated zstd data: an empty body")
    declared = zstd_content_size(body)
    if declared is not None:
        if declared > limit:
            raise HttpError(413, f"decompressed body exceeds {limit} bytes (its zstd frame declares {declared})")
        if not budget.take(declared):
            raise HttpError(503, "too much decompressed data in flight: retry shortly")
        try:
            return codec.decompress(body, decompressed_size=declared, asbytes=True)
        except (OSError, pa.ArrowException):
            budget.give(declared)  # several frames, or a damaged one: the stream below reads or refuses it
    parts: list[bytes] = []
    reserved = 0
    try:
        stream = pa.input_stream(pa.py_buffer(body), compression="zstd")
        while True:
            want = min(_INFLATE_CHUNK, limit + 1 - reserved)
            if not budget.take(want):
                raise HttpError(503, "too much decompressed data in flight: retry shortly")
            reserved += want
            chunk = stream.read(want)
            budget.give(want - len(chunk))
            reserved -= want - len(chunk)
            if reserved > limit:
                raise HttpError(413, f"decompressed body exceeds {limit} bytes")
            if not chunk:
                break
            parts.append(chunk)
    except (OSError, pa.ArrowException) as e:
        budget.give(reserved)
        raise HttpError(400, f"bad zstd data: {e}") from None
    except HttpError:
        budget.give(reserved)
        raise
    return b"".join(parts)


JSON_TYPES = ("application/json",)
PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf", "")


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def is_json(content_type: str | None) -> bool:
    """Whether the request is OTLP/JSON (then the response is JSON too, as the OTLP/HTTP spec asks)."""
    return _media_type(content_type) in JSON_TYPES


def parse(kind: str, payload: bytes, content_type: str | None):
    """Parse an OTLP request for ``kind`` ('logs' | 'metrics'): protobuf, or OTLP/JSON into the same message."""
    ctype = _media_type(content_type)
    if ctype in JSON_TYPES:
        return parse_json(kind, payload)
    if ctype not in PROTOBUF_TYPES:
        raise HttpError(415, f"unsupported Content-Type {content_type!r}: send application/x-protobuf or "
                             "application/json")
    req = ExportLogsServiceRequest() if kind == "logs" else ExportMetricsServiceRequest()
    try:
        req.ParseFromString(payload)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise HttpError(400, f"malformed OTLP protobuf: {e}") from None
    return req


# Where OTLP/JSON puts trace and span ids (bytes fields that OTLP encodes as hex, where proto3's JSON mapping, and so
# json_format, expects base64): log records, and metric exemplars. Both spellings of each key, because json_format
# accepts the proto field names too and would read a hex id under them as base64 (a wrong id, silently).
_ID_KEYS = {("traceId", "trace_id"): 16, ("spanId", "span_id"): 8}
_POINT_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "exponential_histogram", "summary")


def _items(obj, *keys) -> list:
    """``obj[key]`` for the first of ``keys`` present, when it is a list (anything else is left to json_format,
    which reports the wrong type)."""
    if isinstance(obj, dict):
        for k in keys:
            v = obj.get(k)
            if isinstance(v, list):
                return v
    return []


def _hex_ids_to_base64(obj, where: str) -> None:
    if not isinstance(obj, dict):
        return
    for keys, size in _ID_KEYS.items():
        for k in keys:
            v = obj.get(k)
            if v is None or v == "":
                continue
            try:
                raw = bytes.fromhex(v) if isinstance(v, str) else None
            except ValueError:
                raw = None
            if raw is None or len(raw) != size:
                raise HttpError(400, f"malformed OTLP/JSON: {where}.{k} must be {2 * size} hex digits, "
                                     f"got {str(v)[:80]!r}")
            obj[k] = binascii.b2a_base64(raw, newline=False).decode()


def _fix_ids(kind: str, doc) -> None:
    """OTLP/JSON's hex trace/span ids turned into the base64 that ``json_format`` decodes, in place."""
    if kind == "logs":
        for i, rl in enumerate(_items(doc, "resourceLogs", "resource_logs")):
            for j, sl in enumerate(_items(rl, "scopeLogs", "scope_logs")):
                for n, lr in enumerate(_items(sl, "logRecords", "log_records")):
                    _hex_ids_to_base64(lr, f"resourceLogs[{i}].scopeLogs[{j}].logRecords[{n}]")
        return
    for i, rm in enumerate(_items(doc, "resourceMetrics", "resource_metrics")):
        for j, sm in enumerate(_items(rm, "scopeMetrics", "scope_metrics")):
            for n, m in enumerate(_items(sm, "metrics")):
                for pk in _POINT_KINDS:
                    data = m.get(pk) if isinstance(m, dict) else None
                    for p, dp in enumerate(_items(data, "dataPoints", "data_points")):
                        for e, ex in enumerate(_items(dp, "exemplars")):
                            _hex_ids_to_base64(ex, f"resourceMetrics[{i}].scopeMetrics[{j}].metrics[{n}].{pk}"
                                                   f".dataPoints[{p}].exemplars[{e}]")


def parse_json(kind: str, payload: bytes):
    """An OTLP/JSON request (the OTLP/HTTP spec's JSON encoding) into the same message the protobuf path parses.

    ``json_format`` does proto3's JSON mapping, which OTLP/JSON follows except for trace/span ids (hex, converted
    first: ``_fix_ids``); it also takes int64 as strings or numbers, enums as integers or names, bytes (a packed
    step body's ``bytesValue``) as base64, and ignores unknown fields, as the spec asks of receivers. Any failure is
    a 400 that says what was wrong, never a 500.
    """
    if len(payload) > MAX_JSON_BYTES:
        raise HttpError(413, f"OTLP/JSON body of {len(payload)} bytes exceeds {MAX_JSON_BYTES}: send smaller batches "
                             "or protobuf")
    objects = JSON_EXPANSION * len(payload)  # the Python objects of the decoded document, while they live
    if not INFLIGHT.take(objects):
        raise HttpError(503, "too much decompressed data in flight: retry shortly")
    try:
        return _parse_json(kind, payload)
    finally:
        INFLIGHT.give(objects)


def _parse_json(kind: str, payload: bytes):
    try:
        doc = msgspec.json.decode(payload)
    except (msgspec.MsgspecError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"malformed OTLP/JSON: {e}") from None
    if not isinstance(doc, dict):
        raise HttpError(400, f"malformed OTLP/JSON: the body must be a JSON object, not {type(doc).__name__}")
    _fix_ids(kind, doc)
    req = ExportLogsServiceRequest() if kind == "logs" else ExportMetricsServiceRequest()
    try:
        json_format.ParseDict(doc, req, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise HttpError(400, f"malformed OTLP/JSON: {str(e)[:500]}") from None
    except Exception as e:  # a shape ParseDict did not expect (its own Parse wraps every exception the same way)
        raise HttpError(400, f"malformed OTLP/JSON: {type(e).__name__}: {str(e)[:500]}") from None
    return req


def logs_response(rejected: int = 0, message: str = "", as_json: bool = False) -> bytes:
    """The OTLP logs response; with ``rejected`` log records, a partial success whose ``error_message`` says which
    and why (``ranksight.wire_rejections.rejections_message``: JSON, bounded in size). ``as_json``: OTLP/JSON, for
    a JSON request."""
    if not rejected and not as_json:
        return b""  # a full success: the empty message, whose protobuf encoding is no bytes at all
    resp = ExportLogsServiceResponse()
    if rejected:
        resp.partial_success.CopyFrom(ExportLogsPartialSuccess(rejected_log_records=rejected,
                                                               error_message=message[:wire_rejections.MAX_REJECTION_MESSAGE]))
    return _serialize(resp, as_json)


def metrics_response(as_json: bool = False) -> bytes:
    return _serialize(ExportMetricsServiceResponse(), as_json)


def _serialize(msg, as_json: bool) -> bytes:
    return json_format.MessageToJson(msg, indent=None).encode() if as_json else msg.SerializeToString()
