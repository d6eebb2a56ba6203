"""OTLP/HTTP request decoding for the head (protobuf, optionally gzip).

Only the transport concerns live here: authentication, size limits, gzip,
protobuf parsing and the OTLP response. Every failure is an ``HttpError``
with a 4xx status and a short reason; the caller logs it and answers, and the
head keeps running.
"""

from __future__ import annotations

import hmac
import threading
import zlib
from contextlib import contextmanager

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

from ranksight import wire

# Bounds on what one request may cost the head: compressed bytes on the wire and
# bytes after gunzip (a small gzip bomb must not take the head's memory).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024
MAX_INFLIGHT_DECOMPRESSED_BYTES = 1024 * 1024 * 1024  # all requests together


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
_INFLATE_CHUNK = 4 * 1024 * 1024


@contextmanager
def inflated(body: bytes, encoding: str | None):
    """The request body decompressed, its bytes counted against ``INFLIGHT`` while the request is handled; 503 when
    the budget is spent (the sender retries), 413 past the per-request cap."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        yield body
        return
    out = decompress(body, encoding)  # its bytes are now reserved in INFLIGHT
    try:
        yield out
    finally:
        INFLIGHT.give(len(out))


def decompress(body: bytes, encoding: str | None, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    """The body decompressed, at most ``limit`` bytes. Its output is reserved from ``INFLIGHT`` chunk by chunk as it
    grows (and given back here on error); a caller other than ``inflated`` gives it back itself."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        return body
    if enc not in ("gzip", "deflate"):
        raise HttpError(415, f"unsupported Content-Encoding {encoding!r}")
    # wbits 16+MAX: gzip wrapper; MAX (zlib) for deflate. Bounded output.
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
    parts: list[bytes] = []
    reserved = 0
    try:
        buf = body
        while True:
            want = min(_INFLATE_CHUNK, limit + 1 - reserved)
            if not INFLIGHT.take(want):
                raise HttpError(503, "too much decompressed data in flight: retry shortly")
            reserved += want
            chunk = d.decompress(buf, want)
            INFLIGHT.give(want - len(chunk))
            reserved -= want - len(chunk)
            parts.append(chunk)
            if reserved > limit:
                raise HttpError(413, f"decompressed body exceeds {limit} bytes")
            buf = d.unconsumed_tail
            if not buf:
                break
        tail = d.flush()
        if tail:
            if not INFLIGHT.take(len(tail)):
                raise HttpError(503, "too much decompressed data in flight: retry shortly")
            reserved += len(tail)
            parts.append(tail)
    except zlib.error as e:
        INFLIGHT.give(reserved)
        raise HttpError(400, f"bad {enc} data: {e}") from None
    except HttpError:
        INFLIGHT.give(reserved)
        raise
    if not d.eof:
        INFLIGHT.give(reserved)
        raise HttpError(400, f"truncated {enc} data")
    return b"".join(parts)


def parse(kind: str, payload: bytes, content_type: str | None):
    """Parse an OTLP request for ``kind`` ('logs' | 'metrics')."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    if ctype == "application/json":
        raise HttpError(415, "OTLP/JSON is not supported: send application/x-protobuf")
    if ctype not in ("application/x-protobuf", "application/protobuf", ""):
        raise HttpError(415, f"unsupported Content-Type {content_type!r}")
    req = ExportLogsServiceRequest() if kind == "logs" else ExportMetricsServiceRequest()
    try:
        req.ParseFromString(payload)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise HttpError(400, f"malformed OTLP protobuf: {e}") from None
    return req


def logs_response(rejected: int = 0, message: str = "") -> bytes:
    """The OTLP logs response; with ``rejected`` log records, a partial success whose ``error_message`` says which
    and why (``ranksight.wire.rejections_message``: JSON, bounded in size)."""
    resp = ExportLogsServiceResponse()
    if rejected:
        resp.partial_success.CopyFrom(ExportLogsPartialSuccess(rejected_log_records=rejected,
                                                               error_message=message[:wire.MAX_REJECTION_MESSAGE]))
    return resp.SerializeToString()


def metrics_response() -> bytes:
    return ExportMetricsServiceResponse().SerializeToString()
