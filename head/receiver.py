"""OTLP/HTTP request decoding for the head (protobuf, optionally gzip).

Only the transport concerns live here: authentication, size limits, gzip,
protobuf parsing and the OTLP response. Every failure is an ``HttpError``
with a 4xx status and a short reason; the caller logs it and answers, and the
head keeps running.
"""

from __future__ import annotations

import hmac
import zlib

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

# Bounds on what one request may cost the head: compressed bytes on the wire and
# bytes after gunzip (a small gzip bomb must not take the head's memory).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_DECOMPRESSED_BYTES = 256 * 1024 * 1024


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


def decompress(body: bytes, encoding: str | None, limit: int = MAX_DECOMPRESSED_BYTES) -> bytes:
    enc = (encoding or "identity").strip().lower()
    if enc in ("identity", ""):
        return body
    if enc not in ("gzip", "deflate"):
        raise HttpError(415, f"unsupported Content-Encoding {encoding!r}")
    # wbits 16+MAX: gzip wrapper; MAX (zlib) for deflate. Bounded output.
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit)
        if d.unconsumed_tail:
            raise HttpError(413, f"decompressed body exceeds {limit} bytes")
        out += d.flush()
    except zlib.error as e:
        raise HttpError(400, f"bad {enc} data: {e}") from None
    if not d.eof:
        raise HttpError(400, f"truncated {enc} data")
    return out


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
    resp = ExportLogsServiceResponse()
    if rejected:
        resp.partial_success.CopyFrom(ExportLogsPartialSuccess(rejected_log_records=rejected, error_message=message[:500]))
    return resp.SerializeToString()


def metrics_response() -> bytes:
    return ExportMetricsServiceResponse().SerializeToString()
