"""WARN, ERROR and ABORT messages: which failure each one reports (``error_class``) and its details.

Classifiers are tried in order, first match wins. Those in :data:`SPECIFIC` recognise a
whole message format (an IB completion error, a proxy failure, ...), only in messages that
contain their literal, and build all of its fields; the others (:data:`BY_PHRASE`) classify
by a phrase and share the peer address found anywhere in the message. A WARN line none of
them claims is category ``warn``.
"""

from __future__ import annotations

from typing import Any, Callable

from probes.nccl_log.info import trace_fields
from probes.nccl_log.patterns import (
    ADDR_RE,
    ALLOC_RE,
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
    SRC_LOC_RE,
    SYSCALL_RE,
    WRONG_MAGIC_RE,
    Prefix,
    text,
)
from probes.nccl_log.stream import StreamState
from ranksight.schema import NcclEvent


def ib_completion(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent | None:
    """``Got completion from peer 10.0.0.2<38745> with status=12 opcode=0 ...`` (2.12+, every variant in
    patterns.IB_COMPL_NEW_RE) and ``Got completion with error 12, opcode 0, len 0, vendor err 129`` (2.5-2.11)."""
    f: dict[str, Any] = {"level": level}
    m = IB_COMPL_NEW_RE.search(msg)
    if m is not None:
        status = int(m.group(4))
        f.update({"peer_addr": f"{text(m.group(1))}<{text(m.group(2))}>", "status": status,
                  "status_name": IBV_WC_STATUS.get(status, text(m.group(3) or b"")), "opcode": int(m.group(6)),
                  "vendor_err": int(m.group(8))})
        if m.group(7):
            f["len"] = int(m.group(7))
        if m.group(5):
            f["opcode_name"] = text(m.group(5))
        for k, g in (("op", 9), ("local_gid", 10), ("remote_gid", 11), ("hca", 12)):
            if m.group(g):
                f[k] = text(m.group(g))
        f["kind"] = f["status_name"] or f"status {status}"
        return st.event(pre, "error", msg, error_class="ib_completion", transport="NET/IB", fields=f)
    m = IB_COMPL_OLD_RE.search(msg)
    if m is not None:
        status = int(m.group(1))
        f.update({"status": status, "status_name": IBV_WC_STATUS.get(status, ""), "opcode": int(m.group(2)),
                  "len": int(m.group(3)), "vendor_err": int(m.group(4))})
        f["kind"] = f["status_name"] or f"status {status}"
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
    f = {"level": level, "event": text(m.group(2)).strip(), "kind": "fatal" if b"fatal" in msg else "event"}
    if m.group(1):
        f["hca"] = text(m.group(1))
    if b"non-fatal" in msg:
        f["kind"] = "non_fatal"
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
    f["kind"] = ibv_kind(f["call"])
    return st.event(pre, "error", msg, error_class="ibv_failure", transport="NET/IB", fields=f)


def ibv_kind(call: str) -> str:
    """Which setup step an ibv_* call is: queue pair, memory registration, device, completion queue."""
    if "_qp" in call:
        return "qp_setup"
    if "reg_mr" in call or "reg_dmabuf" in call or "dereg" in call:
        return "mr_registration"
    if "_cq" in call:
        return "cq_setup"
    if "device" in call or "query" in call or "alloc_pd" in call:
        return "device"
    return "other"


def bootstrap(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """WARN lines starting ``Bootstrap``."""
    if not msg.startswith(b"Bootstrap"):
        return None
    return st.event(pre, "error", msg, error_class="bootstrap", fields=f)


def socket(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """``socketStartConnect: Connect to 10.0.0.2<43211> failed : Connection refused``, ``socketProgress: Connection
    closed by remote peer ...``, ``socketFinalizeAccept: wrong magic 474554202f204854 != 564ab9f2fc4b9d6c``, ..."""
    m = WRONG_MAGIC_RE.search(msg)
    if m is not None:
        got = int(m.group(1), 16)
        f.update({"kind": "wrong_magic", "magic": f"0x{got:x}", "expected_magic": f"0x{int(m.group(2), 16):x}",
                  "magic_ascii": magic_ascii(got)})
        return st.event(pre, "error", msg, error_class="socket", fields=f)
    if not SOCKET_RE.search(msg):
        return None
    tail = msg.rsplit(b" : ", 1)
    if len(tail) == 2:
        f["reason"] = text(tail[1]).strip()
    low = msg.lower()
    f["kind"] = ("connection_closed" if b"closed" in low else "connect_failed" if b"connect" in low and b"fail" in low
                 else "retries_exceeded" if b"exceeded" in low else "recv_failed" if b"recv" in low
                 else "send_failed" if b"send" in low else "accept_failed" if b"accept" in low else "other")
    return st.event(pre, "error", msg, error_class="socket", fields=f)


def magic_ascii(value: int) -> str:
    """The bytes of a 64-bit socket magic as they came off the wire (x86: little-endian), printable ASCII or '.':
    what connected to NCCL's port instead of a peer ("GET / HT": an HTTP client, a scanner)."""
    raw = value.to_bytes(8, "little", signed=False) if 0 <= value < 1 << 64 else b""
    return "".join(chr(b) if 32 <= b < 127 else "." for b in raw)


def cuda(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """``Cuda failure 'out of memory'``, ``Cuda failure 2 '...'``, ``cudaError...``, ``unhandled cuda error``."""
    m = CUDA_RE.search(msg)
    if m is None:
        a = ALLOC_RE.search(msg)
        if a is None:
            return None
        f["bytes"] = int(a.group(2))
        if not a.group(1):  # "Failed to malloc N bytes": host memory
            f["kind"] = "host_out_of_memory"
            return st.event(pre, "error", msg, error_class="system", fields=f)
        f["cuda_error"] = "out of memory"
        f["kind"] = "out_of_memory"
        return st.event(pre, "error", msg, error_class="cuda", fields=f)
    err = m.group(2) or m.group(3) or m.group(4) or b"unhandled cuda error"
    f["cuda_error"] = text(err).strip()
    if m.group(1):
        f["cuda_code"] = int(m.group(1))
    low = f["cuda_error"].lower()
    f["kind"] = ("out_of_memory" if "out of memory" in low or "memoryallocation" in low or f.get("cuda_code") == 2
                 else f["cuda_error"][:60] or "cuda")
    return st.event(pre, "error", msg, error_class="cuda", fields=f)


def syscall(st: StreamState, pre: Prefix, msg: bytes, f: dict[str, Any]) -> NcclEvent | None:
    """``Call to posix_fallocate failed : No space left on device`` (SYSCHECK, src/include/checks.h)."""
    m = SYSCALL_RE.search(msg)
    if m is None:
        return None
    f.update({"call": text(m.group(1)), "reason": text(m.group(2)).strip(), "kind": text(m.group(1))})
    return st.event(pre, "error", msg, error_class="system", fields=f)


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
    f.update(trace_fields(m))
    return st.event(pre, "trace", msg, error_class="call_trace", fields=f)


# (literal the message must contain, classifier)
SPECIFIC: tuple[tuple[bytes, Callable[[StreamState, Prefix, str, bytes], NcclEvent | None]], ...] = (
    (b"Got completion ", ib_completion),
    (b"[Proxy Service ", proxy),
    (b"Got async ", ib_async),
    (b"ibv_", ibv_failure),
)
BY_PHRASE: tuple[Callable[[StreamState, Prefix, bytes, dict[str, Any]], NcclEvent | None], ...] = (
    bootstrap, socket, cuda, syscall, by_simple_phrase, call_trace)


def failure(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent:
    """A WARN, ERROR or ABORT message as an event: the first classifier that claims it, else ``warn``."""
    for literal, classify in SPECIFIC:
        if literal in msg:
            ev = classify(st, pre, level, msg)
            if ev is not None:
                loc = SRC_LOC_RE.search(st.lead) if st.lead else None
                if loc is not None:
                    ev.fields["src"] = f"{text(loc.group(1))}:{text(loc.group(2))}"
                return ev
    f: dict[str, Any] = {"level": level}
    loc = SRC_LOC_RE.search(st.lead) if st.lead else None
    if loc is not None:  # where NCCL raised it (src/debug.cc prints it before " NCCL WARN")
        f["src"] = f"{text(loc.group(1))}:{text(loc.group(2))}"
        if loc.group(3):
            f["func"] = text(loc.group(3))
    a = ADDR_RE.search(msg) if b">" in msg else None
    if a is not None:
        f["peer_addr"] = f"{text(a.group(1))}<{text(a.group(2))}>"
    for classify in BY_PHRASE:
        ev = classify(st, pre, msg, f)
        if ev is not None:
            return ev
    return st.event(pre, "warn", msg, fields=f)
