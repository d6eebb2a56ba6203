"""WARN, ERROR and ABORT messages: which failure each one reports (``error_class``) and its details.

Classifiers are tried in order, first match wins. Those in :data:`SPECIFIC` recognise a
whole message format (an IB completion error, a proxy failure, ...), only in messages that
contain their literal, and build all of its fields; the others (:data:`BY_PHRASE`) classify
by a phrase and share the peer address found anywhere in the message. A WARN line none of
them claims is category ``warn``.
"""

from __future__ import annotations

from typing import Any, Callable

from probes.nccl_log.patterns import (
    ADDR_RE,
    CALL_TRACE_RE,
    CUDA_RE,
    IB_ASYNC_RE,
    IB_COMPL_NEW_RE,
    IB_COMPL_OLD_RE,
    IBV_RE,
    IBV_WC_STATUS,
    NCCL_RESULT,
    PROXY_RE,
    SIMPLE_CLASSES,
    SOCKET_RE,
    Prefix,
    text,
)
from probes.nccl_log.stream import StreamState
from ranksight.schema import NcclEvent


def ib_completion(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent | None:
    """``Got completion from peer 10.0.0.2<38745> with status=12 opcode=0 ...`` (2.19+, 2.1x) and
    ``Got completion with error 12, opcode 0, len 0, vendor err 129`` (2.5-2.7)."""
    f: dict[str, Any] = {"level": level}
    m = IB_COMPL_NEW_RE.search(msg)
    if m is not None:
        status = int(m.group(3))
        f.update({"peer_addr": f"{text(m.group(1))}<{text(m.group(2))}>", "status": status,
                  "status_name": IBV_WC_STATUS.get(status, ""), "opcode": int(m.group(4)),
                  "len": int(m.group(5)), "vendor_err": int(m.group(6))})
        for k, g in (("op", 7), ("local_gid", 8), ("remote_gid", 9), ("hca", 10)):
            if m.group(g):
                f[k] = text(m.group(g))
        return st.event(pre, "error", msg, error_class="ib_completion", transport="NET/IB", fields=f)
    m = IB_COMPL_OLD_RE.search(msg)
    if m is not None:
        status = int(m.group(1))
        f.update({"status": status, "status_name": IBV_WC_STATUS.get(status, ""), "opcode": int(m.group(2)),
                  "len": int(m.group(3)), "vendor_err": int(m.group(4))})
        return st.event(pre, "error", msg, error_class="ib_completion", transport="NET/IB", fields=f)
    return None


def proxy(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent | None:
    """``[Proxy Service 0] Failed to execute operation Connect from rank 5, retcode 6``."""
    m = PROXY_RE.search(msg)
    if m is None:
        return None
    code = int(m.group(4))
    f = {"level": level, "op": text(m.group(2)), "code": code, "result": NCCL_RESULT.get(code, "")}
    return st.event(pre, "error", msg, error_class="proxy", peer=int(m.group(3)), fields=f)


def ib_async(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent | None:
    """``NET/IB : Got async event : port error``."""
    m = IB_ASYNC_RE.search(msg)
    if m is None:
        return None
    f = {"level": level, "event": text(m.group(1)).strip()}
    return st.event(pre, "error", msg, error_class="ib_async", transport="NET/IB", fields=f)


def ibv_failure(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent | None:
    """``ibv_modify_qp failed``, ``Call to ibv_... failed with error ...``."""
    m = IBV_RE.search(msg)
    if m is None:
        return None
    f: dict[str, Any] = {"level": level, "call": text(m.group(1))}
    if m.group(2):
        f["errno"] = int(m.group(2))
    rest = text(m.group(3)).strip(" :")
    if rest:
        f["detail"] = rest
    return st.event(pre, "error", msg, error_class="ibv_failure", transport="NET/IB", fields=f)


def bootstrap(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """WARN lines starting ``Bootstrap``."""
    if not msg.startswith(b"Bootstrap"):
        return None
    return st.event(pre, "error", msg, error_class="bootstrap", fields=f)


def socket(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """``Connect to 10.0.0.2<43211> failed : Connection refused``, ``socketStartConnect: ...``, ..."""
    if not SOCKET_RE.search(msg):
        return None
    tail = msg.rsplit(b" : ", 1)
    if len(tail) == 2:
        f["reason"] = text(tail[1]).strip()
    return st.event(pre, "error", msg, error_class="socket", fields=f)


def cuda(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """``Cuda failure 'out of memory'``, ``Cuda failure 2 '...'``, ``cudaError...``, ``unhandled cuda error``."""
    m = CUDA_RE.search(msg)
    if m is None:
        return None
    err = m.group(2) or m.group(3) or m.group(4) or b"unhandled cuda error"
    f["cuda_error"] = text(err).strip()
    if m.group(1):
        f["cuda_code"] = int(m.group(1))
    return st.event(pre, "error", msg, error_class="cuda", fields=f)


def by_simple_phrase(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """system, remote, internal, invalid_usage, timeout, abort, bootstrap: a phrase of the message."""
    for rx, cls in SIMPLE_CLASSES:
        if rx.search(msg):
            return st.event(pre, "error", msg, error_class=cls, fields=f)
    return None


def call_trace(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """``transport/net.cc:1298 -> 6`` at WARN level: category ``trace``."""
    m = CALL_TRACE_RE.search(msg)
    if m is None:
        return None
    code = int(m.group(3))
    f.update({"file": text(m.group(1)), "src_line": int(m.group(2)), "code": code, "result": NCCL_RESULT.get(code, "")})
    return st.event(pre, "trace", msg, error_class="call_trace", fields=f)


# (literal the message must contain, classifier)
SPECIFIC: tuple[tuple[bytes, Callable[[StreamState, Prefix, str, bytes], NcclEvent | None]], ...] = (
    (b"Got completion ", ib_completion),
    (b"[Proxy Service ", proxy),
    (b"Got async ", ib_async),
    (b"ibv_", ibv_failure),
)
BY_PHRASE: tuple[Callable[[StreamState, Prefix, bytes, dict[str, Any]], NcclEvent | None], ...] = (
    bootstrap, socket, cuda, by_simple_phrase, call_trace)


def failure(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent:
    """A WARN, ERROR or ABORT message as an event: the first classifier that claims it, else ``warn``."""
    for literal, classify in SPECIFIC:
        if literal in msg:
            ev = classify(st, pre, level, msg)
            if ev is not None:
                return ev
    f: dict[str, Any] = {"level": level}
    a = ADDR_RE.search(msg) if b">" in msg else None
    if a is not None:
        f["peer_addr"] = f"{text(a.group(1))}<{text(a.group(2))}>"
    for classify in BY_PHRASE:
        ev = classify(st, pre, msg, f)
        if ev is not None:
            return ev
    return st.event(pre, "warn", msg, fields=f)
