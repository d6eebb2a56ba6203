"""The ranksight webhook signature: HMAC-SHA256 over timestamp and body (standard library only).

Scheme (version ``sha256``), for a request body ``body`` (the exact bytes sent) and a
shared secret ``secret``:

    timestamp = str(int(unix_seconds_now))                       # X-Ranksight-Timestamp
    mac       = HMAC_SHA256(key=secret, msg=timestamp + "." + body)
    header    = "sha256=" + lowercase_hex(mac)                    # X-Ranksight-Signature

A receiver recomputes ``mac`` from the raw body it read (before any JSON parsing) and the
timestamp header, compares it in constant time, and refuses the request when the timestamp
is further than ``tolerance`` seconds (default 300) from its own clock: a captured request
cannot be replayed later. Within the tolerance window, ``X-Ranksight-Delivery`` (a unique
id per delivery, kept across retries) lets the receiver drop duplicates and replays.

During a secret rotation the signature header may carry several comma-separated
``sha256=<hex>`` values (one per secret); a receiver accepts the request when any of its
secrets matches any of them.

This file imports nothing outside the standard library so it can be copied into a
receiver as is.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Iterable, Mapping

HDR_TIMESTAMP = "X-Ranksight-Timestamp"
HDR_SIGNATURE = "X-Ranksight-Signature"
HDR_DELIVERY = "X-Ranksight-Delivery"
HDR_EVENT = "X-Ranksight-Event"
SCHEME = "sha256"
DEFAULT_TOLERANCE_S = 300


class SignatureError(ValueError):
    """A request whose signature is missing, malformed, wrong or too old. ``str(e)`` says which."""


def _key(secret: str | bytes) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise ValueError("the webhook secret must not be empty")
    return secret


def compute(secret: str | bytes, timestamp: str, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``timestamp + "." + body``."""
    return hmac.new(_key(secret), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def sign(secret: str | bytes | Iterable[str | bytes], body: bytes, now: float | None = None) -> dict[str, str]:
    """Headers (timestamp, signature) for ``body``. Several secrets: one ``sha256=`` value each."""
    ts = str(int(time.time() if now is None else now))
    secrets = [secret] if isinstance(secret, (str, bytes)) else list(secret)
    if not secrets:
        raise ValueError("no webhook secret to sign with")
    sig = ",".join(f"{SCHEME}={compute(s, ts, body)}" for s in secrets)
    return {HDR_TIMESTAMP: ts, HDR_SIGNATURE: sig}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    v = headers.get(name)
    if v is None:  # plain dicts are case-sensitive; http.client's message objects are not
        low = name.lower()
        for k, val in headers.items():
            if k.lower() == low:
                return val
    return v


def verify(secret: str | bytes | Iterable[str | bytes], body: bytes, timestamp: str | None, signature: str | None, *,
           tolerance: float = DEFAULT_TOLERANCE_S, now: float | None = None) -> int:
    """Check one request; returns its timestamp, raises SignatureError with the reason otherwise."""
    if not timestamp:
        raise SignatureError(f"missing {HDR_TIMESTAMP} header")
    if not signature:
        raise SignatureError(f"missing {HDR_SIGNATURE} header")
    ts_s = timestamp.strip()
    if not ts_s.isascii() or not ts_s.isdigit() or len(ts_s) > 12:
        raise SignatureError(f"{HDR_TIMESTAMP} must be integer Unix seconds, got {timestamp[:40]!r}")
    ts = int(ts_s)
    now = time.time() if now is None else now
    if abs(now - ts) > tolerance:
        raise SignatureError(f"timestamp {ts} is {now - ts:+.0f}s from now (tolerance {tolerance:.0f}s): "
                             "stale or replayed request, or a clock out of sync")
    candidates = []
    for part in signature.split(","):
        scheme, sep, value = part.strip().partition("=")
        if sep and scheme == SCHEME and value:
            candidates.append(value.strip().lower())
    if not candidates:
        raise SignatureError(f"{HDR_SIGNATURE} has no {SCHEME}=<hex> value")
    secrets = [secret] if isinstance(secret, (str, bytes)) else list(secret)
    if not secrets:
        raise ValueError("no webhook secret to verify with")
    ok = False
    for s in secrets:
        expected = compute(s, ts_s, body)
        for c in candidates:
            # compare_digest on every pair: no early exit that would leak which one matched
            ok |= hmac.compare_digest(expected.encode(), c.encode())
    if not ok:
        raise SignatureError("signature does not match (wrong secret, or the body was altered)")
    return ts


def verify_headers(secret, body: bytes, headers: Mapping[str, str], *, tolerance: float = DEFAULT_TOLERANCE_S,
                   now: float | None = None) -> int:
    """``verify`` with the timestamp and signature taken from a request's headers."""
    return verify(secret, body, _header(headers, HDR_TIMESTAMP), _header(headers, HDR_SIGNATURE),
                  tolerance=tolerance, now=now)
