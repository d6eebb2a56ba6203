"""Streaming parser for NCCL_DEBUG=INFO logs (NCCL 2.5 .. 2.2x) and PyTorch's NCCL watchdog lines.

Input is whatever a user has: one file per process (``NCCL_DEBUG_FILE=nccl.%h.%p``), or a
job's stdout where NCCL lines are interleaved with the program's own output, possibly with
launcher prefixes (``[default3]:``, ``[rank3]:``) and NCCL >= 2.26 timestamps
(``[2025-03-12 10:11:12] host:pid:tid [dev] NCCL WARN ...``).

Every NCCL line has the prefix ``host:pid:tid [cudaDev] NCCL LEVEL message``. The message
grammar is undocumented and drifts between versions, so the parser is a set of small,
independent recognisers keyed by the message's first word; a line none of them claims is
kept as ``category="unclassified"``. Nothing here raises on input: binary garbage, broken
UTF-8 and truncated lines become unclassified events.

Incremental use (a tailer keeps the file offset)::

    p = NcclLogParser(source_file=path)
    for ev in p.feed(chunk):          # bytes; a partial last line is held back
        ...
    offset_done = offset_read - p.pending_bytes   # where to resume after a restart
    p.close()                         # at EOF: emits the held-back partial line

Whole log sets: :func:`summarize` (or :class:`NcclLogSummary` fed events).

Categories: version, init, info, net, plugin, channel, ring, tree, transport, collective,
warn, error, trace, watchdog, unclassified. ``error_class`` names the failure kind:
ib_completion, ib_async, ibv_failure, socket, cuda, system, remote, internal, invalid_usage,
timeout, abort, proxy, bootstrap, call_trace, nccl_error.
"""

from __future__ import annotations

import os
import re
import zlib
from collections import Counter, defaultdict
from datetime import datetime
from typing import Any, BinaryIO, Iterable, Iterator

from ranksight.schema import NcclEvent

# --------------------------------------------------------------------------
# Prefix
# --------------------------------------------------------------------------

# The prefix ends right before " NCCL LEVEL". Anchored at its end because whatever came
# before the host (launcher tags, timestamps) varies; host has no ':' or brackets.
_PREFIX_RE = re.compile(rb"([^\s:\[\]]+):(\d+):(\d+)\s+\[(-?\d+)\]\s*$")
# A date-time anywhere before the host: NCCL_DEBUG_TIMESTAMP_FORMAT (default "[%F %T] ")
# or a log shipper's ISO stamp.
_TS_RE = re.compile(rb"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(\.\d+)?")
def _from_host(lead: bytes) -> bytes:
    """``lead`` (everything before " NCCL INFO") from the host on: launcher tags and timestamps dropped."""
    m = _PREFIX_RE.search(lead)
    return lead[m.start():] if m is not None and m.start() > 0 else lead


_LEVELS = {b"INFO": "INFO", b"WARN": "WARN", b"TRACE": "TRACE", b"ABORT": "ABORT", b"ERROR": "ERROR"}

# Known NCCL versions: 2.5 .. 2.29. Anything else is parsed with the same rules plus a note.
_KNOWN_MINOR = range(5, 30)

# --------------------------------------------------------------------------
# Message recognisers (bytes regexes: decoding every line costs more than it buys)
# --------------------------------------------------------------------------

_VERSION_RE = re.compile(rb"NCCL version (\d+)\.(\d+)\.(\d+)(\S*)")
_COMM_RE = re.compile(rb"comm (0x[0-9a-fA-F]+) rank (\d+) n[Rr]anks (\d+)(.*)")
_KV_TAIL_RE = re.compile(rb"(cudaDev|nvmlDev|busId|commId|nNodes|localRanks|localRank|MNNVL) (\S+)")
_PHASE_RE = re.compile(rb"- (Init|Abort|Destroy) (START|COMPLETE)")
_INIT_TIME_RE = re.compile(rb"Init time ([\d.]+) ?s")
_INIT_TIMINGS_RE = re.compile(rb"Init timings(?: - (\w+))?: rank (\d+) nranks (\d+) total ([\d.]+)(?: \((.*)\))?")
# "Channel 00/32 :    0   1   2   3"  (ring order; 2.7+ adds "/nchannels")
_RING_ORDER_RE = re.compile(rb"Channel (\d+)(?:/(\d+))? :((?:\s+-?\d+)+)\s*$")
# "Channel 00/0 : 0[7000] -> 1[f000] [send] via NET/IB/0/GDRDMA"
# "Ring 00 : 3[3] -> 0[0] [receive] via NET/IB/0" (2.5-2.6), "Ring 00 : 0 -> 1 via P2P/IPC"
_CONN_RE = re.compile(
    rb"(Channel|Ring) (\d+)(?:/(\d+))? : (\d+)(?:\[([0-9a-fA-F]+)\])? -> (\d+)(?:\[([0-9a-fA-F]+)\])?"
    rb"(?: \[(send|receive)\])? via (.+?)\s*$"
)
# "Ring 00 : 3 -> 0 -> 1"  (2.4/2.5 style: previous -> me -> next)
_RING_TRIPLE_RE = re.compile(rb"Ring (\d+) : (-?\d+) -> (-?\d+) -> (-?\d+)\s*$")
# "Trees [0] 1/-1/-1->0->-1 [1] -1/-1/-1->0->1"
_TREE_ITEM_RE = re.compile(rb"\[(\d+)\] (\S+)")
# "CollNet 00/0 : 0 [send] via COLLNET/SHARP/0/GDRDMA"
_COLLNET_RE = re.compile(rb"CollNet (\d+)(?:/(\d+))? : (\d+) \[(send|receive)\] via (.+?)\s*$")
_NVLS_COMM_RE = re.compile(rb"NVLS comm (0x[0-9a-fA-F]+) headRank (-?\d+) nHeads (\d+)")
# NCCL_DEBUG_SUBSYS=COLL: one line per collective call.
_COLL_RE = re.compile(
    rb"(\w+): opCount ([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) op (\d+) root (-?\d+) comm (0x[0-9a-fA-F]+)"
    rb"(?: \[nranks=(\d+)\])?"
)
_NET_USING_RE = re.compile(rb"NET/(\w+) ?: Using (.*)")
_USING_NETWORK_RE = re.compile(rb"Using network (.+?)\s*$")
_PLUGIN_RE = re.compile(rb"(NET|TUNER|PROFILER|ENV|COLLNET)/Plugin ?: ?(.*)")
_CALL_TRACE_RE = re.compile(rb"([\w./-]+\.(?:cc|cu|cpp|h|c)):(\d+) -> (\d+)")

# Failure recognisers, tried in order on WARN/ERROR lines (first match wins).
_IB_COMPL_NEW_RE = re.compile(
    rb"Got completion from peer (\S+?)<(\d+)> with (?:status=|error )(\d+),? opcode[= ](\d+),? len[= ](\d+),? vendor err (\d+)"
    rb"(?: \((\w+)\))?(?:.*?localGid (\S+))?(?:.*?remoteGids?:? ?(\S+))?(?:.*?hca (\S+))?"
)
_IB_COMPL_OLD_RE = re.compile(rb"Got completion with error (\d+), opcode (\d+), len (\d+), vendor err (\d+)")
_IB_ASYNC_RE = re.compile(rb"Got async (?:event|error) ?: ?(.*)")
_IBV_RE = re.compile(rb"(?:Call to )?(?:wrap_)?(ibv_\w+)(?:\(\))? failed(?: with(?: error)? (-?\d+))?(.*)")
_ADDR_RE = re.compile(rb"(\d{1,3}(?:\.\d{1,3}){3}|\[?[0-9a-fA-F:]*:[0-9a-fA-F:.]+\]?)<(\d+)>")
_SOCKET_RE = re.compile(
    rb"socket\w*|Connect to .*failed|Call to (?:accept|connect|recv|send)\w* failed|Connection (?:closed|refused|reset)|"
    rb"connection closed by|Net : ",
    re.I,
)
_CUDA_RE = re.compile(rb"Cuda failure (?:(\d+) )?'([^']*)'|(cudaError\w+)|CUDA error:? ?([^,]*)|unhandled cuda error", re.I)
_PROXY_RE = re.compile(rb"\[Proxy Service (\d+)\] Failed to execute operation (\w+) from rank (\d+), retcode (\d+)")

_SIMPLE_CLASSES = (
    (re.compile(rb"unhandled system error", re.I), "system"),
    (re.compile(rb"remote process exited or there was a network error|ncclRemoteError|remote error", re.I), "remote"),
    (re.compile(rb"internal error|ncclInternalError", re.I), "internal"),
    (re.compile(rb"invalid usage|invalid argument|ncclInvalid\w+", re.I), "invalid_usage"),
    (re.compile(rb"time(?:d)? ?out", re.I), "timeout"),
    (re.compile(rb"abort", re.I), "abort"),
    (re.compile(rb"bootstrap", re.I), "bootstrap"),
)

# PyTorch ProcessGroupNCCL lines (no NCCL prefix).
_WATCHDOG_RE = re.compile(rb"Watchdog caught collective operation timeout: WorkNCCL\((.*?)\) ran for (\d+) milliseconds")
_WORK_KV_RE = re.compile(rb"(\w+(?:\(ms\))?)=([^,]+)")
_TORCH_RANK_RE = re.compile(rb"\[(?:PG (?:ID )?(\d+)[^\]]*?)?Rank (\d+)\]|\[rank(\d+)\]:")
_WORK_SEQ_RE = re.compile(rb"(?:Timeout|Exception \(either an error or timeout\) detected by watchdog|failure detected by watchdog) at (?:NCCL )?work(?: sequence id)?: (\d+)")
_LAST_ENQ_RE = re.compile(rb"last enqueued (?:NCCL )?work: (-?\d+)")
_LAST_DONE_RE = re.compile(rb"last completed (?:NCCL )?work: (-?\d+)")
_TORCH_NCCL_ERR_RE = re.compile(rb"NCCL error in: ([^,]+), (.*?)(?:, NCCL version ([\w.+-]+))?\s*$")
_TORCH_MARKERS = re.compile(
    rb"Watchdog|WorkNCCL|ProcessGroupNCCL|NCCL error|DistBackendError|ncclRemoteError|ncclUnhandled|ncclSystemError|"
    rb"ncclInternalError|^NCCL version|^Cuda failure|NCCL operations have failed"
)

# NCCL's ncclResult_t, for "file.cc:123 -> N" traces and "NCCL error" lines.
NCCL_RESULT = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}
# ibv_wc_status: what the IB completion "status" numbers mean.
IBV_WC_STATUS = {
    0: "IBV_WC_SUCCESS", 1: "IBV_WC_LOC_LEN_ERR", 2: "IBV_WC_LOC_QP_OP_ERR", 3: "IBV_WC_LOC_EEC_OP_ERR",
    4: "IBV_WC_LOC_PROT_ERR", 5: "IBV_WC_WR_FLUSH_ERR", 6: "IBV_WC_MW_BIND_ERR", 7: "IBV_WC_BAD_RESP_ERR",
    8: "IBV_WC_LOC_ACCESS_ERR", 9: "IBV_WC_REM_INV_REQ_ERR", 10: "IBV_WC_REM_ACCESS_ERR", 11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR", 13: "IBV_WC_RNR_RETRY_EXC_ERR", 14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR", 16: "IBV_WC_REM_ABORT_ERR", 17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR", 19: "IBV_WC_FATAL_ERR", 20: "IBV_WC_RESP_TIMEOUT_ERR", 21: "IBV_WC_GENERAL_ERR",
}

# First bytes of INFO messages that _nccl_message dispatches on.
_DISPATCH_FIRST = frozenset((b"C", b"c", b"T", b"R", b"N", b"U", b"P", b"E", b"I", b"n"))

# INFO lines known to be informational (setup, affinity, tuning): "info", not "unclassified".
_INFO_PREFIXES = (
    b"Bootstrap", b"Setting affinity", b"cudaDriverVersion", b"P2P Chunksize", b"threadThresholds",
    b"Launch mode", b"Comm config", b"NVLS multicast", b"Check P2P", b"[Proxy", b"[Service", b"RAS",
    b"Connected", b"Allocated", b"MNNVL", b"DMA-BUF", b"NCCL_", b"Enabled", b"Using non-device net plugin",
    b"GPU Direct", b"CC ", b"Assigned", b"Loaded", b"ncclCommInitRank", b"Graph", b"Pattern", b"NET/",
)

# NCCL_DEBUG_FILE=nccl.%h.%p -> the file name carries host and pid; lines without an NCCL
# prefix (PyTorch's watchdog) inherit them.
_FILE_HOST_PID_RE = re.compile(r"(?:^|\.)([A-Za-z0-9][\w-]*)[._](\d+)(?:\.(?:log|txt|out))?$")

_MAX_LINE = 64 * 1024  # longer "lines" (binary blobs) are cut, never buffered without bound


def host_pid_from_filename(path: str) -> tuple[str, int]:
    """Best guess of (host, pid) from an NCCL_DEBUG_FILE name such as ``nccl.node01.12345``."""
    name = os.path.basename(path)
    if name.startswith("nccl."):
        name = name[5:]
    m = _FILE_HOST_PID_RE.search(name)
    if not m:
        return "", 0
    return m.group(1), int(m.group(2))


def _append_channel(seen: list[int], head: bytes) -> None:
    """Append the channel number of "Channel 05/0" / "Ring 05" (``head``: the text before " : ")."""
    try:
        seen.append(int(head.split(b" ", 2)[1].split(b"/", 1)[0]))
    except (ValueError, IndexError):
        pass


def _s(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _transport_of(via: str) -> tuple[str, dict[str, Any]]:
    """Normalise a 'via ...' string to a transport name plus details (GDRDMA, NET device, PXN)."""
    extra: dict[str, Any] = {"via": via}
    parts = via.split("/")
    head = parts[0].upper()
    if head == "P2P":
        kind = parts[1] if len(parts) > 1 else ""
        if kind.upper() == "IPC":
            t = "P2P/IPC"
        elif kind.upper() == "CUMEM":
            t = "P2P/CUMEM"
        elif kind.startswith("direct"):
            t = "P2P/direct"
        else:
            t = "P2P"
        if parts[-1] == "read":
            extra["read"] = True
        return t, extra
    if head == "SHM":
        return "SHM", extra
    if head in ("NET", "COLLNET"):
        name = parts[1] if len(parts) > 1 else ""
        if len(parts) > 2:
            m = re.match(r"(\d+)(?:\((\d+)\))?", parts[2])
            if m:
                extra["net_dev"] = int(m.group(1))
                if m.group(2) is not None:  # NET/IB/0(1): routed through local rank 1's NIC = PXN
                    extra["pxn"] = True
                    extra["proxy_rank"] = int(m.group(2))
        extra["gdrdma"] = "GDRDMA" in parts
        if "Shared" in parts:
            extra["shared"] = True
        if head == "COLLNET":
            extra["net"] = name
            return "CollNet", extra
        low = name.lower()
        if low == "ib":
            return "NET/IB", extra
        if low == "socket":
            return "NET/Socket", extra
        return f"NET/{name}", extra
    if head == "NVLS":
        return "NVLS", extra
    return parts[0], extra


def _parse_ts(lead: bytes) -> float | None:
    m = _TS_RE.search(lead)
    if not m:
        return None
    try:
        # NCCL formats its stamp with strftime(localtime()); read it back the same way.
        dt = datetime.strptime(_s(m.group(1) + b" " + m.group(2)), "%Y-%m-%d %H:%M:%S")
        frac = float(m.group(3)) if m.group(3) else 0.0
        return dt.timestamp() + frac
    except (ValueError, OverflowError):
        return None


class NcclLogParser:
    """Incremental parser for one log stream (one file). Feed bytes or lines, get NcclEvents.

    NCCL_DEBUG_SUBSYS=COLL writes one line per collective call, which can dwarf everything
    else; by default those lines are counted per (process, communicator) and only the last
    call is kept (:attr:`last_collective`, :attr:`collective_counts`: the hang-relevant
    facts). ``emit_collectives=True`` makes each one an event.

    Transport and ring-order lines repeat per channel; the first one per (process,
    communicator, peer/transport or ring order) becomes an event and later channels are
    appended to that event's ``fields["channels"]`` list (the same list object).
    """

    def __init__(
        self,
        source_file: str = "",
        host: str = "",
        pid: int = 0,
        *,
        emit_collectives: bool = False,
        keep_unclassified: bool = True,
    ) -> None:
        self.source_file = source_file
        fh, fp = host_pid_from_filename(source_file) if source_file else ("", 0)
        self.default_host = host or fh
        self.default_pid = pid or fp
        self.emit_collectives = emit_collectives
        self.keep_unclassified = keep_unclassified
        self.line_no = 0
        self.bytes_parsed = 0  # bytes of complete lines consumed (excludes pending partial line)
        self._pending = b""
        self._prefix_cache: dict[bytes, tuple[str, int, int, int, float | None]] = {}
        # (host, pid) -> (rank, nranks) of the largest communicator seen: the process's world rank.
        self.proc_rank: dict[tuple[str, int], tuple[int, int]] = {}
        # (host, pid, tid) -> comm pointer of the communicator being initialised on that thread:
        # topology lines (rings, trees, transports) carry no comm id, but init runs on one thread.
        self._thread_comm: dict[tuple[str, int, int], str] = {}
        self._comm_rank: dict[tuple[str, int, str], int] = {}
        self._ptr_comm: dict[tuple[str, int, str], str] = {}
        self._last_collective: dict[tuple[str, int, str], dict[str, Any]] = {}
        self._collective_lines = 0
        # (prefix bytes, comm) -> [count, prefix, last line]: COLL lines folded by the fast path.
        self._coll_stats: dict[bytes, list] = {}  # prefix + ' comm 0x.. ...' -> [count, last line]
        # (prefix bytes, comm, text after " : ") -> the channel list of the event already emitted.
        self._dedupe: dict[tuple[bytes, str | None, bytes], list[int]] = {}
        # (prefix bytes, text after " : ") -> the same channel list, skipping the thread -> comm
        # lookup; emptied whenever a thread's communicator or the dedupe table changes.
        self._chan_fast: dict[tuple[bytes, bytes], list[int]] = {}
        # The COLL run being folded: lines that start with this prefix + " NCCL INFO " and end
        # with this " comm 0x.. " tail share one counter (see feed()).
        self._run: tuple[bytes, bytes, int, list] = (b"\n", b"\n", 0, [0, b""])
        self._lead = b""
        self.notes: list[str] = []
        self.unclassified = 0

    # ---- state a tailer can read -----------------------------------------

    @property
    def collective_lines(self) -> int:
        return self._collective_lines + sum(st[0] for st in self._coll_stats.values())

    @property
    def collective_counts(self) -> dict[tuple[str, int, str], int]:
        """(host, pid, comm pointer) -> number of COLL lines seen."""
        out: dict[tuple[str, int, str], int] = {}
        for key_b, (n, line) in self._coll_stats.items():
            k = key_b.rfind(b" comm 0x")
            pre = self._prefix(key_b[:k]) or ("", 0)
            key = (pre[0], pre[1], _s(key_b[k + 6 :].split(b" ", 1)[0]))
            out[key] = out.get(key, 0) + n
        return out

    @property
    def last_collective(self) -> dict[tuple[str, int, str], dict[str, Any]]:
        """(host, pid, comm pointer) -> the last collective call seen (op, opCount, count, ...)."""
        out = dict(self._last_collective)
        for key_b, (_n, msg) in self._coll_stats.items():
            pre = self._prefix(key_b[: key_b.rfind(b" comm 0x")]) or ("", 0)
            j = msg.find(b" NCCL INFO ")
            m = _COLL_RE.match(msg, j + 11 if j >= 0 else 0)
            if m is None:
                continue
            info = {"op": _s(m.group(1)), "opCount": int(m.group(2), 16), "count": int(m.group(3)),
                    "datatype": int(m.group(4)), "redop": int(m.group(5)), "root": int(m.group(6)),
                    "comm": _s(m.group(7))}
            key = (pre[0], pre[1], info["comm"])
            prev = out.get(key)
            if prev is None or prev["opCount"] <= info["opCount"]:
                out[key] = info
        return out

    # ---- input -----------------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete last line held back; subtract from the read offset to resume."""
        return len(self._pending)

    def feed(self, data: bytes) -> list[NcclEvent]:
        """Parse a chunk of raw bytes. A trailing partial line waits for the next chunk."""
        if not data:
            return []
        if self._pending:
            data = self._pending + data
        lines = data.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > _MAX_LINE:  # no newline for 64 KiB: binary; don't grow forever
            lines.append(self._pending)
            self._pending = b""
        out: list[NcclEvent] = []
        append = out.append
        parse = self._parse_line
        cache_get = self._prefix_cache.get
        dedupe_get = self._dedupe.get
        chan_fast = self._chan_fast
        chan_get = chan_fast.get
        thread_comm = self._thread_comm
        ln = ln0 = self.line_no
        # Fast paths, no event: the bulk of big logs is per-call COLL lines and the same peer
        # connection repeated on every channel. Both are recognised with a few C-level byte
        # operations and folded into parser state instead of becoming events.
        fast_coll = not self.emit_collectives
        coll_match = _COLL_RE.match
        colls = self._coll_stats
        colls_get = colls.get
        # COLL lines come in runs from one thread and communicator: a line that starts with
        # the run's "prefix NCCL INFO " and ends with its " comm 0x.. [nranks=N] stream 0x.."
        # tail has the same folding key as the line that started the run (the first
        # " NCCL INFO " and the last " comm 0x" are where they were in that line), so it is
        # counted with a startswith and an endswith. A sentinel head (b"\n") never matches.
        run_head, run_tail, run_min, run_st = self._run if fast_coll else (b"\n", b"\n", 0, None)
        run_hlen = len(run_head)
        for ln, line in enumerate(lines, ln + 1):
            if line.startswith(run_head) and line.endswith(run_tail) and len(line) > run_min \
                    and line.find(b": opCount ", run_hlen) >= 0:
                run_st[0] += 1
                run_st[1] = line
                continue
            i = line.find(b" NCCL INFO ")
            if i > 0:
                # A repeat of a connection/ring already emitted: only its channel number is new.
                chan = line.startswith(b"Channel ", i + 11)
                if chan:
                    c = line.find(b" : ", i + 19)
                    if c > 0:
                        seen = chan_get((line[:i], line[c:]))
                        # No ':' between "Channel " and " : ": no ": opCount " (see below).
                        if seen is not None and line.find(b":", i + 19, c) < 0:
                            nb = line[i + 19 : i + 21]
                            if line[i + 21] == 47 and nb.isdigit():  # "Channel 05/..."
                                seen.append(int(nb))
                            else:
                                _append_channel(seen, line[i + 11 : c])
                            continue
                    else:
                        chan = False
                if b": opCount " not in line:
                    pass
                elif fast_coll:
                    k = line.rfind(b" comm 0x")
                    if k > i:
                        tail = line[k:]
                        key = line[:i] + tail  # prefix + " comm 0x.. [nranks=N] stream 0x.."
                        st = colls_get(key)
                        if st is None:
                            # Keyed from the host on: a timestamp or launcher tag before it (NCCL >= 2.26
                            # stamps every line) would make a counter per distinct time, growing forever
                            # in a long tail.
                            key = _from_host(line[:i]) + tail
                            st = colls_get(key)
                        if st is None:
                            st = colls[key] = [1, line]
                        else:
                            st[0] += 1
                            st[1] = line
                        head = line[: i + 11]
                        if b": opCount " not in head and b": opCount " not in tail:
                            # The rest of this run: ": opCount " can only be between the two.
                            run_head, run_tail, run_st = head, tail, st
                            run_hlen, run_min = i + 11, i + len(tail)
                        continue
                # emit_collectives: what _parse_line -> _nccl_message -> _collective would do, for
                # lines that no other recogniser of _nccl_message claims first
                elif line.find(b" NCCL ", 0, i + 6) == i and len(line) <= _MAX_LINE and not line.endswith(b"\r") and (
                        line[i + 11 : i + 12] not in _DISPATCH_FIRST or line.startswith(b"Reduce", i + 11)):
                    pre = cache_get(line[:i])
                    if pre is not None:
                        m = coll_match(line, i + 11)
                        if m is not None:
                            self.line_no = ln
                            append(self._collective(pre, line[i + 11 :], m))
                            continue
                if chan:
                    lead = line[:i]
                    pre = cache_get(lead)
                    if pre is not None:
                        tail = line[c:]
                        seen = dedupe_get((lead, thread_comm.get(pre[:3]), tail))
                        if seen is not None:
                            if b": opCount " not in tail and b": opCount " not in line[: i + 11]:
                                chan_fast[(lead, tail)] = seen
                            _append_channel(seen, line[i + 11 : c])
                            continue
            self.line_no = ln
            ev = parse(line)
            if ev is not None:
                append(ev)
        if fast_coll:
            self._run = (run_head, run_tail, run_min, run_st)
        self.line_no = ln0 + len(lines)
        self.bytes_parsed += len(data) - len(self._pending)
        return out

    def prime(self, data: bytes) -> None:
        """Rebuild per-process state (ranks, communicators) from lines already shipped, e.g.
        the file up to a tailer's saved offset after a restart, without emitting events or
        moving ``line_no``/``bytes_parsed``. Later error lines then carry their rank again."""
        saved = (self.line_no, self.bytes_parsed, self._pending, self.unclassified)
        self._pending = b""
        self.feed(data if data.endswith(b"\n") else data[: data.rfind(b"\n") + 1])
        self.line_no, self.bytes_parsed, self._pending, self.unclassified = saved
        self._dedupe.clear()  # repeats of connections already shipped become events again
        self._chan_fast.clear()
        self._coll_stats.clear()
        self._run = (b"\n", b"\n", 0, [0, b""])
        self._last_collective.clear()
        self._collective_lines = 0

    def feed_line(self, line: bytes | str) -> NcclEvent | None:
        """Parse one complete line (without or with its newline)."""
        if isinstance(line, str):
            line = line.encode("utf-8", "surrogateescape")
        self.bytes_parsed += len(line) + (0 if line.endswith(b"\n") else 1)
        return self.feed_line_internal(line.rstrip(b"\n"))

    def close(self) -> list[NcclEvent]:
        """End of input: the held-back partial line (a truncated file's last line) is parsed too."""
        if not self._pending:
            return []
        line, self._pending = self._pending, b""
        self.bytes_parsed += len(line)
        ev = self.feed_line_internal(line)
        return [ev] if ev is not None else []

    # ---- the hot path ----------------------------------------------------

    def feed_line_internal(self, line: bytes) -> NcclEvent | None:
        self.line_no += 1
        return self._parse_line(line)

    def _parse_line(self, line: bytes) -> NcclEvent | None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(line) > _MAX_LINE:
            line = line[:_MAX_LINE]
        i = line.find(b" NCCL ")
        if i >= 0:
            j = line.find(b" ", i + 6)
            level = _LEVELS.get(line[i + 6 : j]) if j > 0 else None
            if level is not None:
                self._lead = lead = line[:i]
                pre = self._prefix_cache.get(lead) or self._prefix(lead)
                if pre is not None:
                    return self._nccl_message(pre, level, line[j + 1 :], line)
        if not line.strip():
            return None
        if _TORCH_MARKERS.search(line):
            ev = self._torch_line(line)
            if ev is not None:
                return ev
        return self._unclassified(line)

    def _prefix(self, lead: bytes) -> tuple[str, int, int, int, float | None] | None:
        hit = self._prefix_cache.get(lead)
        if hit is not None:
            return hit
        m = _PREFIX_RE.search(lead)
        if m is None:
            return None
        host = _s(m.group(1))
        before = lead[: m.start()]
        t = _parse_ts(before) if before else None
        val = (host, int(m.group(2)), int(m.group(3)), int(m.group(4)), t)
        if t is None:  # stamped prefixes differ every line: caching them only costs memory
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            self._prefix_cache[lead] = val
        return val

    def _ev(self, pre, category: str, msg: bytes, fields: dict[str, Any] | None = None, **kw: Any) -> NcclEvent:
        host, pid, tid, dev, t = pre
        if "rank" not in kw:
            pr = self.proc_rank.get((host, pid))
            if pr is not None:
                kw["rank"] = pr[0]
                if "nranks" not in kw:
                    kw["nranks"] = pr[1]
        if not fields:
            fields = {}
        fields["tid"] = tid
        fields["cudaDev"] = dev
        return NcclEvent(
            host=host, pid=pid, t=t, category=category, message=msg.decode("utf-8", "replace"), fields=fields,
            source_file=self.source_file, line_no=self.line_no, **kw,
        )

    def _nccl_message(self, pre, level: str, msg: bytes, line: bytes) -> NcclEvent | None:
        if level != "INFO" and level != "TRACE":
            return self._failure(pre, level, msg)
        c = msg[:1]
        # Dispatch on the first bytes: each recogniser runs only where it can match.
        if c not in _DISPATCH_FIRST:
            pass
        elif c == b"C":
            if msg.startswith(b"Channel"):
                return self._channel(pre, msg)
            if msg.startswith(b"CollNet"):
                return self._collnet(pre, msg)
            if msg.startswith(b"Connected"):
                return self._ev(pre, "info", msg, comm_id=self._thread_comm.get(pre[:3], ""))
        elif c == b"c":
            if msg.startswith(b"comm "):
                return self._comm(pre, msg)
        elif c == b"T":
            if msg.startswith(b"Trees"):
                return self._trees(pre, msg)
            if msg.startswith(b"TUNER/"):
                return self._plugin(pre, msg)
        elif c == b"R":
            if msg.startswith(b"Ring"):
                return self._ring_line(pre, msg)
        elif c == b"N":
            if msg.startswith(b"NCCL version"):
                return self._version(pre, msg)
            if msg.startswith(b"NET/"):
                if msg.startswith(b"NET/Plugin"):
                    return self._plugin(pre, msg)
                m = _NET_USING_RE.match(msg)
                if m:
                    return self._ev(pre, "net", msg, transport="NET/" + _s(m.group(1)),
                                    fields={"net": _s(m.group(1)), "devices": _s(m.group(2))})
            if msg.startswith(b"NVLS"):
                m = _NVLS_COMM_RE.match(msg)
                if m:
                    f = {"comm": _s(m.group(1)), "headRank": int(m.group(2)), "nHeads": int(m.group(3))}
                    return self._ev(pre, "transport", msg, transport="NVLS", fields=f,
                                    comm_id=self._thread_comm.get(pre[:3], ""))
        elif c == b"U":
            if msg.startswith(b"Using network"):
                m = _USING_NETWORK_RE.match(msg)
                net = _s(m.group(1)) if m else ""
                return self._ev(pre, "net", msg, transport="NET/" + net if net else "", fields={"net": net})
        elif c == b"P" or c == b"E":
            if msg.startswith((b"PROFILER/", b"ENV/")):
                return self._plugin(pre, msg)
        elif c == b"I":
            if msg.startswith(b"Init timings"):
                return self._init_timings(pre, msg)
        elif c == b"n":
            # NCCL >= 2.19 prefixes the comm line with the API: "ncclCommInitRankConfig comm 0x..."
            k = msg.find(b" comm 0x")
            if 0 < k < 40:
                ev = self._comm(pre, msg[k + 1 :])
                if ev is not None:
                    ev.message = _s(msg)
                    ev.fields["api"] = _s(msg[:k])
                return ev
        if b": opCount " in msg:  # the literal _COLL_RE needs
            m = _COLL_RE.match(msg)
            if m is not None:
                return self._collective(pre, msg, m)
        if b" -> " in msg:
            m = _CALL_TRACE_RE.search(msg)
            if m is not None:
                code = int(m.group(3))
                return self._ev(pre, "trace", msg, error_class="call_trace",
                                fields={"file": _s(m.group(1)), "src_line": int(m.group(2)), "code": code,
                                        "result": NCCL_RESULT.get(code, "")})
        if msg.find(b"Plugin", 0, 24) >= 0:
            return self._plugin(pre, msg)
        if msg.startswith(_INFO_PREFIXES) or msg[:1].isdigit():
            return self._ev(pre, "info", msg, fields={"level": level})
        if not self.keep_unclassified:
            self.unclassified += 1
            return None
        return self._ev(pre, "unclassified", msg, fields={"level": level})

    # ---- recognisers -----------------------------------------------------

    def _version(self, pre, msg: bytes) -> NcclEvent:
        m = _VERSION_RE.match(msg)
        if not m:
            return self._ev(pre, "version", msg)
        major, minor, patch = int(m.group(1)), int(m.group(2)), int(m.group(3))
        suffix = _s(m.group(4))
        f: dict[str, Any] = {"version": f"{major}.{minor}.{patch}", "full": f"{major}.{minor}.{patch}{suffix}"}
        if suffix.startswith("+cuda"):
            f["cuda"] = suffix[5:]
        if major != 2 or minor not in _KNOWN_MINOR:
            note = f"NCCL version {f['full']} is outside the formats this parser was written for (2.5-2.29); parsed with the same rules"
            f["note"] = note
            if note not in self.notes:
                self.notes.append(note)
        return self._ev(pre, "version", msg, fields=f)

    def _comm(self, pre, msg: bytes) -> NcclEvent | None:
        m = _COMM_RE.match(msg)
        if m is None:
            return self._ev(pre, "unclassified", msg)
        host, pid, tid = pre[0], pre[1], pre[2]
        comm = _s(m.group(1))
        rank, nranks = int(m.group(2)), int(m.group(3))
        tail = m.group(4)
        f: dict[str, Any] = {"comm": comm}
        for k, v in _KV_TAIL_RE.findall(tail):
            key = _s(k)
            val = _s(v)
            if key in ("cudaDev", "nvmlDev", "nNodes", "localRanks", "localRank", "MNNVL"):
                try:
                    f[key] = int(val)
                except ValueError:
                    f[key] = val
            else:
                f[key] = val
        ph = _PHASE_RE.search(tail)
        category = "init"
        error_class = ""
        if ph:
            f["phase"] = f"{_s(ph.group(1))} {_s(ph.group(2))}"
            if ph.group(1) == b"Abort":
                category, error_class = "error", "abort"
        it = _INIT_TIME_RE.search(tail)
        if it:
            f["init_time_s"] = float(it.group(1))
        # The commId hash is the same in every rank of a communicator; the pointer is per process.
        # Lines without commId (2.5-2.7, or 2.19+'s "comm 0x.. rank 0 nRanks 8 nNodes 1 ...")
        # reuse the hash an earlier line gave the same pointer.
        if "commId" in f:
            self._ptr_comm[(host, pid, comm)] = f["commId"]
            comm_id = f["commId"]
        else:
            comm_id = self._ptr_comm.get((host, pid, comm), comm)
        if self._thread_comm.get((host, pid, tid)) != comm_id:
            self._thread_comm[(host, pid, tid)] = comm_id
            self._chan_fast.clear()  # its keys assumed the old thread -> comm mapping
        self._comm_rank[(host, pid, comm_id)] = rank
        cur = self.proc_rank.get((host, pid))
        if cur is None or nranks > cur[1]:
            self.proc_rank[(host, pid)] = (rank, nranks)
        pre_ev = (host, pid, tid, pre[3] if "cudaDev" not in f else f["cudaDev"], pre[4])
        ev = self._ev(pre_ev, category, msg, rank=rank, nranks=nranks, comm_id=comm_id,
                      error_class=error_class, fields=f)
        return ev

    def _init_timings(self, pre, msg: bytes) -> NcclEvent:
        m = _INIT_TIMINGS_RE.match(msg)
        if not m:
            return self._ev(pre, "init", msg)
        f: dict[str, Any] = {"init_time_s": float(m.group(4)), "phase": "Init timings"}
        if m.group(1):
            f["api"] = _s(m.group(1))
        if m.group(5):
            for part in _s(m.group(5)).split(","):
                k, _, v = part.strip().partition(" ")
                try:
                    f[f"t_{k}"] = float(v)
                except ValueError:
                    pass
        return self._ev(pre, "init", msg, rank=int(m.group(2)), nranks=int(m.group(3)),
                        comm_id=self._thread_comm.get(pre[:3], ""), fields=f)

    def _comm_ctx(self, pre) -> tuple[str, int | None]:
        cid = self._thread_comm.get(pre[:3], "")
        return cid, self._comm_rank.get((pre[0], pre[1], cid)) if cid else None

    def _channel(self, pre, msg: bytes) -> NcclEvent | None:
        return self._deduped(pre, msg, self._channel_event)

    def _deduped(self, pre, msg: bytes, build) -> NcclEvent | None:
        """Per-channel repeats of the same connection or ring: one event, channels appended."""
        c = msg.find(b" : ")
        if c < 0:
            cid, _ = self._comm_ctx(pre)
            return self._ev(pre, "channel", msg, comm_id=cid)
        key = (self._lead, self._thread_comm.get(pre[:3]), msg[c:])
        seen = self._dedupe.get(key)
        if seen is not None:
            _append_channel(seen, msg[:c])
            return None
        ev = build(pre, msg)
        if ev is not None and "channel" in ev.fields:
            ev.fields["channels"] = self._dedupe[key] = [ev.fields["channel"]]
            if len(self._dedupe) > 100_000:  # bounded: a later duplicate becomes an event again
                self._dedupe.clear()
                self._chan_fast.clear()
        return ev

    def _channel_event(self, pre, msg: bytes) -> NcclEvent | None:
        m = _CONN_RE.match(msg)
        if m is not None:
            return self._conn(pre, msg, m)
        m = _RING_ORDER_RE.match(msg)
        if m is not None:
            cid, crank = self._comm_ctx(pre)
            order = [int(x) for x in m.group(3).split()]
            f = {"channel": int(m.group(1)), "order": order}
            if m.group(2) is not None:
                f["nchannels"] = int(m.group(2))
            kw: dict[str, Any] = {"rank": crank} if crank is not None else {}
            return self._ev(pre, "ring", msg, comm_id=cid, fields=f, **kw)
        cid, _ = self._comm_ctx(pre)
        return self._ev(pre, "channel", msg, comm_id=cid)

    def _conn(self, pre, msg: bytes, m: re.Match) -> NcclEvent:
        src, dst = int(m.group(4)), int(m.group(6))
        direction = _s(m.group(8)) if m.group(8) else ""
        via = _s(m.group(9))
        transport, f = _transport_of(via)
        f["channel"] = int(m.group(2))
        if m.group(3) is not None:
            f["conn_index"] = int(m.group(3))
        f["src"] = src
        f["dst"] = dst
        if m.group(5):
            f["src_bus"] = _s(m.group(5))
        if m.group(7):
            f["dst_bus"] = _s(m.group(7))
        if direction:
            f["direction"] = direction
        # The logging process is the sender unless the line says [receive].
        me, peer = (dst, src) if direction == "receive" else (src, dst)
        cid, _ = self._comm_ctx(pre)
        return self._ev(pre, "transport", msg, rank=me, peer=peer, transport=transport, comm_id=cid, fields=f)

    def _ring_line(self, pre, msg: bytes) -> NcclEvent | None:
        return self._deduped(pre, msg, self._ring_event)

    def _ring_event(self, pre, msg: bytes) -> NcclEvent:
        m = _CONN_RE.match(msg)
        if m is not None:
            return self._conn(pre, msg, m)
        m = _RING_TRIPLE_RE.match(msg)
        cid, crank = self._comm_ctx(pre)
        if m is not None:
            prev, me, nxt = int(m.group(2)), int(m.group(3)), int(m.group(4))
            return self._ev(pre, "ring", msg, rank=me, comm_id=cid,
                            fields={"channel": int(m.group(1)), "prev": prev, "next": nxt})
        m = _RING_ORDER_RE.match(msg.replace(b"Ring", b"Channel", 1))
        if m is not None:
            kw: dict[str, Any] = {"rank": crank} if crank is not None else {}
            return self._ev(pre, "ring", msg, comm_id=cid,
                            fields={"channel": int(m.group(1)), "order": [int(x) for x in m.group(3).split()]}, **kw)
        return self._ev(pre, "ring", msg, comm_id=cid)

    def _trees(self, pre, msg: bytes) -> NcclEvent:
        cid, crank = self._comm_ctx(pre)
        trees: dict[str, Any] = {}
        me = crank
        for ch, spec in _TREE_ITEM_RE.findall(msg):
            s = _s(spec)
            # "c1/c2/c3->me->parent" (2.7+), possibly "|"-joined up/down halves (2.4 double tree)
            node: dict[str, Any] = {"spec": s}
            first = s.split("|")[0]
            parts = first.split("->")
            try:
                if len(parts) == 3:
                    node["children"] = [int(x) for x in parts[0].split("/") if x != "-1"]
                    node["rank"] = int(parts[1])
                    node["parent"] = int(parts[2])
                    me = node["rank"]
            except ValueError:
                pass
            trees[_s(ch)] = node
        kw: dict[str, Any] = {"rank": me} if me is not None else {}
        return self._ev(pre, "tree", msg, comm_id=cid, fields={"trees": trees}, **kw)

    def _collnet(self, pre, msg: bytes) -> NcclEvent:
        m = _COLLNET_RE.match(msg)
        cid, _ = self._comm_ctx(pre)
        if m is None:
            return self._ev(pre, "transport", msg, transport="CollNet", comm_id=cid)
        _, f = _transport_of(_s(m.group(5)))
        f.update({"channel": int(m.group(1)), "direction": _s(m.group(4))})
        return self._ev(pre, "transport", msg, rank=int(m.group(3)), transport="CollNet", comm_id=cid, fields=f)

    def _plugin(self, pre, msg: bytes) -> NcclEvent:
        m = _PLUGIN_RE.match(msg)
        f: dict[str, Any] = {}
        if m:
            f = {"plugin": _s(m.group(1)).lower(), "detail": _s(m.group(2)).strip()}
        elif msg.startswith(b"TUNER/"):
            f = {"plugin": "tuner", "detail": _s(msg)}
        return self._ev(pre, "plugin", msg, fields=f)

    def _collective(self, pre, msg: bytes, m: re.Match) -> NcclEvent | None:
        self._collective_lines += 1
        op, opc, count, dt, redop, root, comm_b, nr = m.groups()
        comm = comm_b.decode("utf-8", "replace")
        info = {
            "op": op.decode("utf-8", "replace"), "opCount": int(opc, 16), "count": int(count),
            "datatype": int(dt), "redop": int(redop), "root": int(root), "comm": comm,
        }
        if nr:
            info["nranks"] = int(nr)
        self._last_collective[(pre[0], pre[1], comm)] = info
        if not self.emit_collectives:
            return None
        return self._ev(pre, "collective", msg, fields=info)

    def _failure(self, pre, level: str, msg: bytes) -> NcclEvent:
        cat = "error"
        f: dict[str, Any] = {"level": level}
        kw: dict[str, Any] = {}
        compl = b"Got completion " in msg
        m = _IB_COMPL_NEW_RE.search(msg) if compl else None
        if m is not None:
            status = int(m.group(3))
            f.update({"peer_addr": f"{_s(m.group(1))}<{_s(m.group(2))}>", "status": status,
                      "status_name": IBV_WC_STATUS.get(status, ""), "opcode": int(m.group(4)),
                      "len": int(m.group(5)), "vendor_err": int(m.group(6))})
            for k, g in (("op", 7), ("local_gid", 8), ("remote_gid", 9), ("hca", 10)):
                if m.group(g):
                    f[k] = _s(m.group(g))
            return self._ev(pre, cat, msg, error_class="ib_completion", transport="NET/IB", fields=f)
        m = _IB_COMPL_OLD_RE.search(msg) if compl else None
        if m is not None:
            status = int(m.group(1))
            f.update({"status": status, "status_name": IBV_WC_STATUS.get(status, ""), "opcode": int(m.group(2)),
                      "len": int(m.group(3)), "vendor_err": int(m.group(4))})
            return self._ev(pre, cat, msg, error_class="ib_completion", transport="NET/IB", fields=f)
        m = _PROXY_RE.search(msg) if b"[Proxy Service " in msg else None
        if m is not None:
            code = int(m.group(4))
            f.update({"op": _s(m.group(2)), "code": code, "result": NCCL_RESULT.get(code, "")})
            return self._ev(pre, cat, msg, error_class="proxy", peer=int(m.group(3)), fields=f)
        m = _IB_ASYNC_RE.search(msg) if b"Got async " in msg else None
        if m is not None:
            f["event"] = _s(m.group(1)).strip()
            return self._ev(pre, cat, msg, error_class="ib_async", transport="NET/IB", fields=f)
        m = _IBV_RE.search(msg) if b"ibv_" in msg else None
        if m is not None:
            f["call"] = _s(m.group(1))
            if m.group(2):
                f["errno"] = int(m.group(2))
            rest = _s(m.group(3)).strip(" :")
            if rest:
                f["detail"] = rest
            return self._ev(pre, cat, msg, error_class="ibv_failure", transport="NET/IB", fields=f)
        a = _ADDR_RE.search(msg) if b">" in msg else None
        if a is not None:
            f["peer_addr"] = f"{_s(a.group(1))}<{_s(a.group(2))}>"
        if msg.startswith(b"Bootstrap"):
            return self._ev(pre, cat, msg, error_class="bootstrap", fields=f)
        if _SOCKET_RE.search(msg):
            tail = msg.rsplit(b" : ", 1)
            if len(tail) == 2:
                f["reason"] = _s(tail[1]).strip()
            return self._ev(pre, cat, msg, error_class="socket", fields=f)
        m = _CUDA_RE.search(msg)
        if m is not None:
            err = m.group(2) or m.group(3) or m.group(4) or b"unhandled cuda error"
            f["cuda_error"] = _s(err).strip()
            if m.group(1):
                f["cuda_code"] = int(m.group(1))
            return self._ev(pre, cat, msg, error_class="cuda", fields=f)
        for rx, cls in _SIMPLE_CLASSES:
            if rx.search(msg):
                return self._ev(pre, cat, msg, error_class=cls, fields=f)
        m = _CALL_TRACE_RE.search(msg)
        if m is not None:
            code = int(m.group(3))
            f.update({"file": _s(m.group(1)), "src_line": int(m.group(2)), "code": code, "result": NCCL_RESULT.get(code, "")})
            return self._ev(pre, "trace", msg, error_class="call_trace", fields=f)
        return self._ev(pre, "warn", msg, fields=f, **kw)

    # ---- lines without an NCCL prefix -----------------------------------

    def _torch_line(self, line: bytes) -> NcclEvent | None:
        host, pid = self.default_host, self.default_pid
        rank: int | None = None
        rm = _TORCH_RANK_RE.search(line)
        f: dict[str, Any] = {}
        if rm is not None:
            if rm.group(2) is not None:
                rank = int(rm.group(2))
                if rm.group(1) is not None:
                    f["pg"] = int(rm.group(1))
            elif rm.group(3) is not None:
                rank = int(rm.group(3))
        if rank is None:
            pr = self.proc_rank.get((host, pid))
            rank = pr[0] if pr else None
        pre = (host, pid, 0, -1, None)
        if line.startswith(b"NCCL version"):  # NCCL 2.5 also prints its version bare on stdout
            return self._version(pre, line)
        if line.startswith(b"Cuda failure"):  # continuation of a "Last error:" block
            m = _CUDA_RE.search(line)
            f["cuda_error"] = _s(m.group(2) if m and m.group(2) else line)
            return self._tev(pre, "error", line, rank, "cuda", f)
        if b"NCCL operations have failed or timed out" in line:
            return self._tev(pre, "error", line, rank, "timeout", f)
        m = _WATCHDOG_RE.search(line)
        if m is not None:
            for k, v in _WORK_KV_RE.findall(m.group(1)):
                key, val = _s(k), _s(v).strip()
                try:
                    f[key] = int(val)
                except ValueError:
                    f[key] = val
            f["ran_for_ms"] = int(m.group(2))
            seq = f.get("SeqNum")
            for rx, key in ((_LAST_ENQ_RE, "last_enqueued"), (_LAST_DONE_RE, "last_completed")):
                mm = rx.search(line)
                if mm:
                    f[key] = int(mm.group(1))
            if seq is not None:
                f["seq"] = seq
            return self._tev(pre, "watchdog", line, rank, "timeout", f)
        m = _WORK_SEQ_RE.search(line)
        if m is not None or _LAST_ENQ_RE.search(line):
            if m is not None:
                f["seq"] = int(m.group(1))
            for rx, key in ((_LAST_ENQ_RE, "last_enqueued"), (_LAST_DONE_RE, "last_completed")):
                mm = rx.search(line)
                if mm:
                    f[key] = int(mm.group(1))
            return self._tev(pre, "watchdog", line, rank, "timeout" if b"imeout" in line else "", f)
        m = _TORCH_NCCL_ERR_RE.search(line)
        if m is not None:
            f["where"] = _s(m.group(1))
            text = m.group(2)
            if m.group(3):
                f["nccl_version"] = _s(m.group(3))
            cls = "nccl_error"
            if _CUDA_RE.search(text):
                cls = "cuda"
            else:
                for rx, c in _SIMPLE_CLASSES:
                    if rx.search(text):
                        cls = c
                        break
            f["reason"] = _s(text)
            return self._tev(pre, "error", line, rank, cls, f)
        if b"ncclRemoteError" in line or b"remote process exited" in line:
            return self._tev(pre, "error", line, rank, "remote", f)
        if b"ncclUnhandledCudaError" in line:
            return self._tev(pre, "error", line, rank, "cuda", f)
        if b"ncclSystemError" in line:
            return self._tev(pre, "error", line, rank, "system", f)
        if b"ncclInternalError" in line:
            return self._tev(pre, "error", line, rank, "internal", f)
        if b"Watchdog" in line or b"watchdog" in line:
            return self._tev(pre, "watchdog", line, rank, "timeout" if b"imeout" in line else "", f)
        return None

    def _tev(self, pre, category: str, line: bytes, rank: int | None, cls: str, f: dict[str, Any]) -> NcclEvent:
        f["source"] = "torch"
        return NcclEvent(host=pre[0], pid=pre[1], t=None, category=category, rank=rank, error_class=cls,
                         message=_s(line).strip(), fields=f, source_file=self.source_file, line_no=self.line_no)

    def _unclassified(self, line: bytes) -> NcclEvent | None:
        self.unclassified += 1
        if not self.keep_unclassified:
            return None
        return NcclEvent(host=self.default_host, pid=self.default_pid, t=None, category="unclassified",
                         message=_s(line[:512]), source_file=self.source_file, line_no=self.line_no)


# --------------------------------------------------------------------------
# Whole files and log sets
# --------------------------------------------------------------------------

_CHUNK = 1 << 20


def parse_stream(f: BinaryIO, source_file: str = "", **kw: Any) -> Iterator[NcclEvent]:
    """Yield every event of one binary stream, reading 1 MiB at a time."""
    p = NcclLogParser(source_file=source_file, **kw)
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        yield from p.feed(chunk)
    yield from p.close()


def parse_file(path: str, **kw: Any) -> Iterator[NcclEvent]:
    """Yield every event of one log file (plain or .gz). Raises OSError if it cannot be opened."""
    if path.endswith(".gz"):
        import gzip

        with gzip.open(path, "rb") as f:
            yield from parse_stream(f, source_file=path, **kw)
    else:
        with open(path, "rb") as f:
            yield from parse_stream(f, source_file=path, **kw)


_MAX_LISTED = 500  # errors/warnings kept verbatim per class; the counts stay exact


class NcclLogSummary:
    """Aggregates events from any number of files into one picture of the job."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.file_errors: dict[str, str] = {}
        self.lines = 0
        self.events = 0
        self.categories: Counter[str] = Counter()
        self.versions: dict[str, set[str]] = defaultdict(set)  # version -> {"host:pid"}
        self.procs: dict[tuple[str, int], dict[str, Any]] = {}
        self.comms: dict[str, dict[str, Any]] = {}
        self.transports: dict[tuple, dict[str, Any]] = {}
        self.plugins: list[dict[str, Any]] = []
        self.nets: dict[str, set[str]] = defaultdict(set)
        self.errors: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []
        self.watchdog: list[dict[str, Any]] = []
        self.error_classes: Counter[str] = Counter()
        self.unclassified_samples: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.collectives: dict[str, dict[str, Any]] = {}
        self._pending_topo: dict[tuple[str, int, int], list[NcclEvent]] = defaultdict(list)

    def _proc(self, host: str, pid: int) -> dict[str, Any]:
        p = self.procs.get((host, pid))
        if p is None:
            p = self.procs[(host, pid)] = {"host": host, "pid": pid, "rank": None, "nranks": None,
                                           "cudaDev": None, "busId": None, "version": None, "files": set()}
        return p

    def _comm(self, cid: str) -> dict[str, Any]:
        c = self.comms.get(cid)
        if c is None:
            c = self.comms[cid] = {"comm_id": cid, "nranks": None, "ranks": {}, "rings": {}, "trees": {},
                                   "ring_neighbors": {}, "ring_fields": [], "nbr_fields": [],
                                   "nchannels": None, "init_time_s": {}, "complete": set()}
        return c

    def add(self, ev: NcclEvent) -> None:
        self.events += 1
        cat = ev.category
        self.categories[cat] += 1
        f = ev.fields
        proc = self._proc(ev.host, ev.pid) if (ev.host or ev.pid) else None
        if proc is not None and ev.source_file:
            proc["files"].add(ev.source_file)
        if cat == "version":
            v = f.get("full")
            if v:
                self.versions[v].add(f"{ev.host}:{ev.pid}" if ev.host else ev.source_file)
                if proc is not None:
                    proc["version"] = v
            if f.get("note") and f["note"] not in self.notes:
                self.notes.append(f["note"])
        elif cat == "init" and "comm" in f:
            c = self._comm(ev.comm_id)
            c["nranks"] = ev.nranks
            r = c["ranks"].setdefault(ev.rank, {})
            r.update({"host": ev.host, "pid": ev.pid, "cudaDev": f.get("cudaDev"), "busId": f.get("busId"),
                      "comm": f.get("comm")})
            if str(f.get("phase", "")).endswith("COMPLETE") or "phase" not in f:
                if f.get("phase", "Init COMPLETE") == "Init COMPLETE":
                    c["complete"].add(ev.rank)
            if "init_time_s" in f:
                c["init_time_s"][ev.rank] = f["init_time_s"]
            if proc is not None and (proc["nranks"] is None or (ev.nranks or 0) > proc["nranks"]):
                proc.update(rank=ev.rank, nranks=ev.nranks, cudaDev=f.get("cudaDev"), busId=f.get("busId"))
            # Topology lines printed before this comm line on the same thread belong to it (old
            # NCCL prints "comm ... Init COMPLETE" only after the rings and transports).
            key = (ev.host, ev.pid, f.get("tid", 0))
            for tev in self._pending_topo.pop(key, []):
                tev.comm_id = ev.comm_id
                self._topology(tev, ev.rank)
        elif cat == "init" and "init_time_s" in f and ev.comm_id:
            self._comm(ev.comm_id)["init_time_s"][ev.rank] = f["init_time_s"]
        elif cat in ("ring", "tree", "transport"):
            if not ev.comm_id:
                self._pending_topo[(ev.host, ev.pid, f.get("tid", 0))].append(ev)
            else:
                self._topology(ev, None)
        elif cat == "plugin":
            if len(self.plugins) < _MAX_LISTED:
                item = {"host": ev.host, "plugin": f.get("plugin", ""), "detail": f.get("detail", ev.message)}
                if item not in self.plugins:
                    self.plugins.append(item)
        elif cat == "net":
            if f.get("net"):
                self.nets[f["net"]].add(f.get("devices", ""))
        elif cat == "collective":
            c = self.collectives.setdefault(f"{ev.host}:{ev.pid}:{f.get('comm')}", {"count": 0})
            c["count"] += 1
            c.update(last_op=f.get("op"), last_opCount=f.get("opCount"), rank=ev.rank)
        elif cat in ("error", "warn", "trace", "watchdog"):
            self.error_classes[ev.error_class or cat] += 1
            item = {"category": cat, "error_class": ev.error_class, "host": ev.host, "pid": ev.pid,
                    "rank": ev.rank, "peer": ev.peer, "peer_addr": f.get("peer_addr"), "message": ev.message,
                    "file": ev.source_file, "line": ev.line_no}
            for k in ("status", "status_name", "cuda_error", "call", "SeqNum", "OpType", "NumelIn",
                      "Timeout(ms)", "ran_for_ms", "reason", "hca"):
                if k in f:
                    item[k] = f[k]
            target = self.watchdog if cat == "watchdog" else self.warnings if cat in ("warn", "trace") else self.errors
            if len(target) < _MAX_LISTED:
                target.append(item)
        elif cat == "unclassified":
            if len(self.unclassified_samples) < 20:
                self.unclassified_samples.append({"file": ev.source_file, "line": ev.line_no, "text": ev.message[:200]})

    def _topology(self, ev: NcclEvent, rank_hint: int | None) -> None:
        c = self._comm(ev.comm_id)
        f = ev.fields
        rank = ev.rank if ev.rank is not None else rank_hint
        if ev.category == "ring":
            ch = f.get("channel")
            if "order" in f:
                c["ring_fields"].append(f)  # channels may still grow (shared list): expand in to_dict
                if f.get("nchannels"):
                    c["nchannels"] = f["nchannels"]
            elif "prev" in f:
                c["nbr_fields"].append((rank, f))
        elif ev.category == "tree":
            for ch, node in f.get("trees", {}).items():
                c["trees"].setdefault(ch, {})[node.get("rank", rank)] = {
                    k: node[k] for k in ("parent", "children", "spec") if k in node}
        elif ev.category == "transport" and "src" in f:
            key = (ev.comm_id, f["src"], f["dst"], ev.transport, f.get("direction", ""))
            t = self.transports.get(key)
            if t is None:
                t = self.transports[key] = {
                    "comm_id": ev.comm_id, "src": f["src"], "dst": f["dst"], "transport": ev.transport,
                    "direction": f.get("direction", ""), "via": f.get("via", ""), "gdrdma": f.get("gdrdma"),
                    "net_dev": f.get("net_dev"), "pxn": bool(f.get("pxn")), "_lists": [], "host": ev.host}
            t["_lists"].append(f.get("channels") or [f.get("channel")])

    def transports_lists(self, t: dict[str, Any]) -> list[list[int]]:
        key = (t["comm_id"], t["src"], t["dst"], t["transport"], t["direction"])
        return self.transports[key]["_lists"]

    def add_collectives(self, parser: "NcclLogParser") -> None:
        """Fold a parser's COLL-line counters (lines that became no events) into the summary."""
        counts = parser.collective_counts
        for (host, pid, comm), info in parser.last_collective.items():
            key = f"{host}:{pid}:{comm}"
            c = self.collectives.setdefault(key, {"count": 0})
            c["count"] += counts.get((host, pid, comm), 0)
            c.update(last_op=info.get("op"), last_opCount=info.get("opCount"),
                     rank=parser.proc_rank.get((host, pid), (None,))[0])

    def finish(self) -> None:
        # Topology lines whose comm never announced itself still count, under "unknown".
        for key, evs in self._pending_topo.items():
            for tev in evs:
                tev.comm_id = f"unknown@{key[0]}:{key[1]}"
                self._topology(tev, None)
        self._pending_topo.clear()
        # Errors printed before the process's first "comm ... rank" line get its rank now.
        for lst in (self.errors, self.warnings, self.watchdog):
            for item in lst:
                if item["rank"] is None:
                    p = self.procs.get((item["host"], item["pid"]))
                    if p and p["rank"] is not None:
                        item["rank"] = p["rank"]

    def to_dict(self) -> dict[str, Any]:
        self.finish()
        # A process's rank is its rank in the largest communicator it joined (the world, usually).
        procs: list[dict[str, Any]] = []
        hosts: dict[str, dict[str, Any]] = {}
        for (host, pid), p in sorted(self.procs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if not host and not pid:
                continue
            h = hosts.setdefault(host, {"pids": [], "ranks": []})
            h["pids"].append(pid)
            if p["rank"] is not None:
                h["ranks"].append(p["rank"])
            procs.append({"host": host, "pid": pid, "rank": p["rank"], "nranks": p["nranks"], "cudaDev": p["cudaDev"],
                          "busId": p["busId"], "version": p["version"], "files": sorted(p["files"])})
        comms = {}
        for cid, c in self.comms.items():
            for f in c["ring_fields"]:
                for ch in f.get("channels") or [f.get("channel")]:
                    c["rings"].setdefault(ch, f["order"])
            for rank, f in c["nbr_fields"]:
                for ch in f.get("channels") or [f.get("channel")]:
                    c["ring_neighbors"].setdefault(ch, {})[rank] = {"prev": f["prev"], "next": f["next"]}
            comms[cid] = {
                "nranks": c["nranks"], "ranks_seen": sorted(r for r in c["ranks"] if r is not None),
                "ranks": {str(r): v for r, v in sorted(c["ranks"].items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
                "init_complete": sorted(c["complete"]), "nchannels": c["nchannels"],
                "init_time_s": {str(k): v for k, v in c["init_time_s"].items()},
                "rings": {str(k): v for k, v in c["rings"].items()},
                "ring_neighbors": {str(k): {str(r): n for r, n in v.items()} for k, v in c["ring_neighbors"].items()},
                "trees": {str(k): {str(r): n for r, n in v.items()} for k, v in c["trees"].items()},
            }
        transports = []
        for t in sorted(self.transports.values(), key=lambda t: (t["comm_id"], t["src"], t["dst"], t["transport"])):
            t = {k: v for k, v in t.items() if k != "_lists"}
            t["channels"] = sorted({ch for lst in self.transports_lists(t) for ch in lst if ch is not None})
            transports.append(t)
        tcount = Counter(t["transport"] for t in transports)
        return {
            "files": self.files,
            "file_errors": self.file_errors,
            "lines": self.lines,
            "events": self.events,
            "categories": dict(self.categories),
            "versions": {v: sorted(s) for v, s in self.versions.items()},
            "ranks": sorted({p["rank"] for p in procs if p["rank"] is not None}),
            "processes": procs,
            "hosts": hosts,
            "comms": comms,
            "transports": transports,
            "transport_counts": dict(tcount),
            "networks": {k: sorted(v) for k, v in self.nets.items()},
            "plugins": self.plugins,
            "errors": self.errors,
            "warnings": self.warnings,
            "watchdog": self.watchdog,
            "error_classes": dict(self.error_classes),
            "collectives": self.collectives,
            "unclassified_samples": self.unclassified_samples,
            "notes": self.notes,
        }


def summarize(paths: Iterable[str], **kw: Any) -> dict[str, Any]:
    """Parse a set of log files and aggregate them. Unreadable files are listed in
    ``file_errors`` (path -> reason), never raised."""
    s = NcclLogSummary()
    for path in paths:
        p = NcclLogParser(source_file=path, **kw)
        try:
            opener = _open(path)
            with opener as f:
                # read1: a truncated .gz hands out what it could decompress before EOFError
                read = getattr(f, "read1", f.read)
                while True:
                    chunk = read(_CHUNK)
                    if not chunk:
                        break
                    for ev in p.feed(chunk):
                        s.add(ev)
                for ev in p.close():
                    s.add(ev)
        except (OSError, EOFError, zlib.error) as e:  # EOFError: truncated .gz; what was read still counts
            s.file_errors[path] = f"{type(e).__name__}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            if p.line_no == 0:
                continue
        s.files.append(path)
        s.lines += p.line_no
        s.add_collectives(p)
        for n in p.notes:
            if n not in s.notes:
                s.notes.append(n)
    return s.to_dict()


def _open(path: str):
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory", path)
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


__all__ = [
    "NcclLogParser",
    "NcclLogSummary",
    "parse_file",
    "parse_stream",
    "summarize",
    "host_pid_from_filename",
    "IBV_WC_STATUS",
    "NCCL_RESULT",
]
