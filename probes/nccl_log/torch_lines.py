"""Lines without an NCCL prefix that PyTorch's ProcessGroupNCCL (or NCCL on stdout) writes.

Watchdog timeouts (``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..)``),
work-sequence progress (``Timeout at NCCL work: N, last enqueued NCCL work: M, ...``),
``NCCL error in: <file>, <reason>`` and bare ``NCCL version`` / ``Cuda failure`` lines. They
carry no host or pid: both come from the file name (``nccl.<host>.<pid>``); the rank comes
from a ``[Rank N]`` / ``[rankN]:`` tag, else from the process's communicator lines.
"""

from __future__ import annotations

from typing import Any

from probes.nccl_log.info import version
from probes.nccl_log.patterns import (
    CUDA_RE,
    LAST_DONE_RE,
    LAST_ENQ_RE,
    SIMPLE_CLASSES,
    TORCH_MARKERS,
    TORCH_NCCL_ERR_RE,
    LAGGING_RE,
    TORCH_PG_RE,
    TORCH_RANK_RE,
    WATCHDOG_RE,
    WATCHDOG_STUCK_RE,
    WORK_KV_RE,
    WORK_SEQ_RE,
    Prefix,
    text,
)
from probes.nccl_log.stream import StreamState
from ranksight.schema import NcclEvent

# Cheap test a line must pass before torch_line looks at it.
might_be_torch_line = TORCH_MARKERS.search

# Phrases naming the failure in lines that match nothing more specific.
_RESULT_PHRASES = ((b"ncclUnhandledCudaError", "cuda"), (b"ncclSystemError", "system"), (b"ncclInternalError", "internal"))


def torch_line(st: StreamState, line: bytes) -> NcclEvent | None:
    """The event of a PyTorch / bare NCCL line; None if it is none of the known kinds."""
    host, pid = st.default_host, st.default_pid
    rank: int | None = None
    rm = TORCH_RANK_RE.search(line)
    f: dict[str, Any] = {}
    if rm is not None:
        if rm.group(2) is not None:
            rank = int(rm.group(2))
            if rm.group(1) is not None:
                f["pg"] = int(rm.group(1))
        elif rm.group(3) is not None:
            rank = int(rm.group(3))
    pg = TORCH_PG_RE.search(line) if b"[PG " in line else None
    if pg is not None:
        f["pg"] = int(pg.group(1))
        if pg.group(3):
            f["pg_name"] = text(pg.group(3))
        if rank is None:
            rank = int(pg.group(4))
    if rank is None:
        pr = st.proc_rank.get((host, pid))
        rank = pr[0] if pr else None
    pre = (host, pid, 0, -1, None, None)
    if line.startswith(b"NCCL version"):  # NCCL 2.5 also prints its version bare on stdout
        return version(st, pre, line)
    if line.startswith(b"Cuda failure"):  # continuation of a "Last error:" block
        m = CUDA_RE.search(line)
        f["cuda_error"] = text(m.group(2) if m and m.group(2) else line)
        return _event(st, pre, "error", line, rank, "cuda", f)
    if b"NCCL operations have failed or timed out" in line:
        return _event(st, pre, "error", line, rank, "timeout", f)
    m = WATCHDOG_RE.search(line)
    if m is not None:
        for k, v in WORK_KV_RE.findall(m.group(1)):
            key, val = text(k), text(v).strip()
            try:
                f[key] = int(val)
            except ValueError:
                f[key] = val
        f["ran_for_ms"] = int(m.group(2))
        seq = f.get("SeqNum")
        _add_progress(line, f)
        if seq is not None:
            f["seq"] = seq
        f["kind"] = "collective_timeout"
        return _event(st, pre, "watchdog", line, rank, "timeout", f)
    m = WATCHDOG_STUCK_RE.search(line)
    if m is not None:
        f["stuck_s"] = int(m.group(1))
        f["kind"] = "watchdog_stuck"
        return _event(st, pre, "watchdog", line, rank, "timeout", f)
    m = LAGGING_RE.search(line)
    if m is not None:
        f["lagging_ranks"] = [int(x) for x in m.group(1).replace(b",", b" ").split() if x.isdigit()]
        f["kind"] = "desync_report"
        return _event(st, pre, "watchdog", line, rank, "timeout", f)
    m = WORK_SEQ_RE.search(line)
    if m is not None or LAST_ENQ_RE.search(line):
        if m is not None:
            f["seq"] = int(m.group(1))
        _add_progress(line, f)
        f["kind"] = "progress"
        return _event(st, pre, "watchdog", line, rank, "timeout" if b"imeout" in line else "", f)
    m = TORCH_NCCL_ERR_RE.search(line)
    if m is not None:
        f["where"] = text(m.group(1))
        reason = m.group(2)
        if m.group(3):
            f["nccl_version"] = text(m.group(3))
        cls = "nccl_error"
        if CUDA_RE.search(reason):
            cls = "cuda"
        else:
            for rx, c in SIMPLE_CLASSES:
                if rx.search(reason):
                    cls = c
                    break
        f["reason"] = text(reason)
        return _event(st, pre, "error", line, rank, cls, f)
    if b"ncclRemoteError" in line or b"remote process exited" in line:
        return _event(st, pre, "error", line, rank, "remote", f)
    for phrase, cls in _RESULT_PHRASES:
        if phrase in line:
            return _event(st, pre, "error", line, rank, cls, f)
    if b"Watchdog" in line or b"watchdog" in line:
        return _event(st, pre, "watchdog", line, rank, "timeout" if b"imeout" in line else "", f)
    return None


def _add_progress(line: bytes, f: dict[str, Any]) -> None:
    """``last enqueued (NCCL) work: M``, ``last completed (NCCL) work: K``."""
    for rx, key in ((LAST_ENQ_RE, "last_enqueued"), (LAST_DONE_RE, "last_completed")):
        mm = rx.search(line)
        if mm:
            f[key] = int(mm.group(1))


def _event(st: StreamState, pre: Prefix, category: str, line: bytes, rank: int | None, cls: str,
           f: dict[str, Any]) -> NcclEvent:
    f["source"] = "torch"
    return NcclEvent(host=pre[0], pid=pre[1], t=None, category=category, rank=rank, error_class=cls,
                     message=text(line).strip(), fields=f, source_file=st.source_file, line_no=st.line_no)
