"""What NCCL log lines look like: the line prefix, the message regexes, NCCL's code tables.

Every NCCL line is ``[launcher tag][timestamp] host:pid:tid [cudaDev] NCCL LEVEL message``.
The regexes work on bytes: decoding every line costs more than it buys, so only the parts
that end up in an event are decoded (:func:`text`).
"""

from __future__ import annotations

import os
import re
from datetime import datetime

# (host, pid, tid, cudaDev, t, launcher_rank): what the prefix of an NCCL line says; t is None without a date,
# launcher_rank the rank a launcher tag before it names ("[rank3]:", "[default3]:", "3: "), else None.
Prefix = tuple[str, int, int, int, float | None, int | None]

MAX_LINE = 64 * 1024  # longer "lines" (binary blobs) are cut, never buffered without bound

# Known NCCL versions: 2.5 .. 2.30. Anything else is parsed with the same rules plus a note.
KNOWN_MINOR = range(5, 31)


def text(b: bytes) -> str:
    """Decode log bytes; broken UTF-8 becomes U+FFFD, never an exception."""
    return b.decode("utf-8", "replace")


# --------------------------------------------------------------------------
# The line prefix
# --------------------------------------------------------------------------

# NVIDIA/nccl src/debug.cc (ncclDebugLog), every version since 2.3:
#   INFO   "%s:%d:%d [%d] NCCL INFO "                  host, pid, tid, cudaDev
#   WARN   "\n%s:%d:%d [%d] %s:%d NCCL WARN "           ... , __FILE__, __LINE__
#          "%s:%d:%d [%d] %s:%d (%s) NCCL WARN "        2.27+: ... , file, line, func
#   TRACE  "%s:%d:%d [%d] %f %s:%d NCCL TRACE "         ... , ms since init, func, line
#   CALL   "%s:%d:%d NCCL CALL "                        2.19+
# NCCL_DEBUG_TIMESTAMP_FORMAT (2.26+, default "[%F %T] ", WARN lines only by default) goes before the host;
# the host may be empty (":pid:tid", a container without a hostname). The prefix ends right before " NCCL LEVEL";
# anchored at its end because whatever came before the host (launcher tags, timestamps, quoting) varies.
PREFIX_RE = re.compile(
    rb"(?:([^\s:\[\]]*):(\d+):(\d+)(?:\s+|$))?"  # host:pid:tid (host may be empty; absent in legacy lines)
    rb"(?:\[(-?\d+)\])?"  # [cudaDev] (absent in NCCL CALL lines)
    rb"(?:\s*(?:\d+\.\d+\s+)?([^\s\[\]()]+):(\d+)(?:\s+\([^()]*\))?)?"  # WARN: file:line (func); TRACE: ms func:line
    rb"\s*$"
)
# A date-time anywhere before the host: NCCL_DEBUG_TIMESTAMP_FORMAT (default "[%F %T] ")
# or a log shipper's ISO stamp.
TS_RE = re.compile(rb"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(\.\d+)?")
# What a launcher writes before a process's line: torchrun --tee "[default3]:", torch's "[rank3]:", srun --label /
# mpirun "3: ", Ray "(RayTrainWorker pid=123, ip=10.0.0.1)", markdown "> " quoting, ANSI colour codes (with or
# without their ESC byte), timestamps. LAUNCHER_ONLY_RE: a lead made only of those (a legacy line without
# host:pid:tid); LAUNCHER_RANK_RE: the rank the tag names.
LAUNCHER_ONLY_RE = re.compile(
    rb"(?:\s+|>|\x1b?\[[\d;]*m|\[(?:rank|default)?\d+\]:?|\d+:|\((?:\w+ )?pid=\d+[^)]*\)|\[[\d\-T:., +Z]+\]"
    rb"|\d{4}-\d{2}-\d{2}[ T][\d:.,+Z]+)*$")
LAUNCHER_RANK_RE = re.compile(rb"\[(?:rank|default)(\d+)\]:|^\s*(?:>\s*)?(\d{1,5}):\s")
ANSI_HOST_RE = re.compile(rb"\d[\d;]*m")


def from_host(lead: bytes) -> bytes:
    """``lead`` (everything before " NCCL INFO") from the host on: launcher tags and timestamps dropped."""
    m = PREFIX_RE.search(lead)
    return lead[m.start():] if m is not None and m.start() > 0 else lead


def parse_timestamp(lead: bytes) -> float | None:
    """The date-time written before the host, as a Unix time; None when there is none."""
    m = TS_RE.search(lead)
    if not m:
        return None
    try:
        # NCCL formats its stamp with strftime(localtime()); read it back the same way.
        dt = datetime.strptime(text(m.group(1) + b" " + m.group(2)), "%Y-%m-%d %H:%M:%S")
        frac = float(m.group(3)) if m.group(3) else 0.0
        return dt.timestamp() + frac
    except (ValueError, OverflowError):
        return None


def launcher_rank(lead: bytes) -> int | None:
    """The rank a launcher tag in ``lead`` names ("[rank3]:", "[default3]:", "3: "), else None."""
    if not lead:
        return None
    m = LAUNCHER_RANK_RE.search(lead)
    if m is None:
        return None
    return int(m.group(1) or m.group(2))


def parse_prefix(lead: bytes) -> Prefix | None:
    """(host, pid, tid, cudaDev, t, launcher rank) of the bytes before " NCCL LEVEL"; None if they are no NCCL
    prefix. A legacy line (no host:pid:tid, at most launcher tags before "NCCL") gives host "" and pid 0: the stream
    fills in what the file name says."""
    m = PREFIX_RE.search(lead)
    if m is None or (m.group(2) is None and m.group(4) is None):
        if LAUNCHER_ONLY_RE.match(lead):
            return ("", 0, 0, -1, parse_timestamp(lead) if lead else None, launcher_rank(lead))
        return None
    before = lead[: m.start()]
    host = m.group(1) or b""
    if host and m.start(1) > 0 and lead[m.start(1) - 1] == 91:  # "\x1b[32mnode1:..." read as host "32mnode1"
        a = ANSI_HOST_RE.match(host)
        if a is not None:
            host = host[a.end():]
    t = parse_timestamp(before) if before else None
    return (text(host), int(m.group(2) or 0), int(m.group(3) or 0), int(m.group(4) if m.group(4) is not None else -1),
            t, launcher_rank(before) if before else None)


# NCCL_DEBUG_FILE=nccl.%h.%p -> the file name carries host and pid; lines without an NCCL
# prefix (PyTorch's watchdog) inherit them.
FILE_HOST_PID_RE = re.compile(r"(?:^|\.)([A-Za-z0-9][\w-]*)[._](\d+)(?:\.(?:log|txt|out))?$")


def host_pid_from_filename(path: str) -> tuple[str, int]:
    """Best guess of (host, pid) from an NCCL_DEBUG_FILE name such as ``nccl.node01.12345``."""
    name = os.path.basename(path)
    if name.startswith("nccl."):
        name = name[5:]
    m = FILE_HOST_PID_RE.search(name)
    if not m:
        return "", 0
    return m.group(1), int(m.group(2))


# --------------------------------------------------------------------------
# INFO messages
# --------------------------------------------------------------------------

VERSION_RE = re.compile(rb"NCCL version (\d+)\.(\d+)\.(\d+)(\S*)")
COMM_RE = re.compile(rb"comm (0x[0-9a-fA-F]+) rank (\d+) n[Rr]anks (\d+)(.*)")
KV_TAIL_RE = re.compile(rb"(cudaDev|nvmlDev|busId|commId|nNodes|localRanks|localRank|MNNVL) (\S+)")
PHASE_RE = re.compile(rb"- (Init|Abort|Destroy) (START|COMPLETE)")
INIT_TIME_RE = re.compile(rb"Init time ([\d.]+) ?s")
INIT_TIMINGS_RE = re.compile(rb"Init timings(?: - (\w+))?: rank (\d+) nranks (\d+) total ([\d.]+)(?: \((.*)\))?")
# "Channel 00/32 :    0   1   2   3"  (ring order; 2.7+ adds "/nchannels")
RING_ORDER_RE = re.compile(rb"Channel (\d+)(?:/(\d+))? :((?:\s+-?\d+)+)\s*$")
# "Channel 00/0 : 0[7000] -> 1[f000] [send] via NET/IB/0/GDRDMA"
# "Ring 00 : 3[3] -> 0[0] [receive] via NET/IB/0" (2.5-2.6), "Ring 00 : 0 -> 1 via P2P/IPC"
CONN_RE = re.compile(
    rb"(Channel|Ring) (\d+)(?:/(\d+))? : (\d+)(?:\[([0-9a-fA-F]+)\])? -> (\d+)(?:\[([0-9a-fA-F]+)\])?"
    rb"(?: \[(send|receive)\])? via (.+?)\s*$"
)
# "Ring 00 : 3 -> 0 -> 1"  (2.4/2.5 style: previous -> me -> next)
RING_TRIPLE_RE = re.compile(rb"Ring (\d+) : (-?\d+) -> (-?\d+) -> (-?\d+)\s*$")
# "Trees [0] 1/-1/-1->0->-1 [1] -1/-1/-1->0->1"
TREE_ITEM_RE = re.compile(rb"\[(\d+)\] (\S+)")
# "CollNet 00/0 : 0 [send] via COLLNET/SHARP/0/GDRDMA"
COLLNET_RE = re.compile(rb"CollNet (\d+)(?:/(\d+))? : (\d+) \[(send|receive)\] via (.+?)\s*$")
NVLS_COMM_RE = re.compile(rb"NVLS comm (0x[0-9a-fA-F]+) headRank (-?\d+) nHeads (\d+)")
# NCCL_DEBUG_SUBSYS=COLL: one line per collective call.
COLL_RE = re.compile(
    rb"(\w+): opCount ([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) op (\d+) root (-?\d+) comm (0x[0-9a-fA-F]+)"
    rb"(?: \[nranks=(\d+)\])?"
)
NET_USING_RE = re.compile(rb"NET/(\w+) ?: Using (.*)")
USING_NETWORK_RE = re.compile(rb"Using network (.+?)\s*$")
PLUGIN_RE = re.compile(rb"(NET|TUNER|PROFILER|ENV|COLLNET)/Plugin ?: ?(.*)")
# NCCLCHECK's back trace, src/include/checks.h: "%s:%d -> %d" (file, line, ncclResult_t), "%s:%d -> %d (%s)"
# (strerror), 2.27+ via INFO_LOC: "%s:%d (%s) -> %d (%s)" (file, line, function, result, strerror).
CALL_TRACE_RE = re.compile(rb"([\w./-]+\.(?:cc|cu|cpp|h|c)):(\d+)(?: \((\w+)\))? -> (\d+)(?: \(([^)]*)\))?")
# src/misc/socket.cc (2.18+): "socketFinalizeAccept: wrong magic %lx != %lx" (received, expected)
WRONG_MAGIC_RE = re.compile(rb"wrong magic ([0-9a-fA-F]+) != ([0-9a-fA-F]+)")
# src/include/checks.h SYSCHECK: "Call to " name " failed: %s" (strerror); socket calls are classified as socket.
SYSCALL_RE = re.compile(rb"Call to (\w+) failed ?: ?(.*)")
# src/include/alloc.h: "Failed to CUDA malloc %ld bytes", "Failed to CUDA calloc (async) %ld bytes", "Failed to malloc"
ALLOC_RE = re.compile(rb"Failed to (CUDA )?(?:host )?\w+(?: async)? (\d+) bytes")
# The source location NCCL prints before " NCCL WARN" (src/debug.cc): "file:line" or "file:line (func)".
SRC_LOC_RE = re.compile(rb"([^\s\[\]()]+\.\w+):(\d+)(?: \((\w+)\))?\s*$")

# INFO lines known to be informational (setup, affinity, tuning): "info", not "unclassified".
INFO_PREFIXES = (
    b"Bootstrap", b"Setting affinity", b"cudaDriverVersion", b"P2P Chunksize", b"threadThresholds",
    b"Launch mode", b"Comm config", b"NVLS multicast", b"Check P2P", b"[Proxy", b"[Service", b"RAS",
    b"Connected", b"Allocated", b"MNNVL", b"DMA-BUF", b"NCCL_", b"Enabled", b"Using non-device net plugin",
    b"GPU Direct", b"CC ", b"Assigned", b"Loaded", b"ncclCommInitRank", b"Graph", b"Pattern", b"NET/",
)

# --------------------------------------------------------------------------
# WARN / ERROR messages
# --------------------------------------------------------------------------

# NVIDIA/nccl src/transport/net_ib.cc (2.12-2.2x) and src/transport/net_ib/p2p.cc (2.28+), WARN formats over time:
#   "NET/IB : Got completion from peer %s with error %d, opcode %d, len %d, vendor err %d (%s)%s%s%s%s"  (2.12-2.19)
#   "NET/IB : Got completion from peer %s with status=%d opcode=%d len=%d vendor err %d (%s)%s%s%s%s"   (2.20-2.22)
#   "NET/IB: Got completion from peer %s with status=%d opcode=%d len=%u vendor err %u (%s)... hca %s"  (2.23-2.27)
#   "NET/IB: Got completion from peer %s with status=%s(%d) opcode=%s(%d) vendor_err=%u %s%s%s%s hca %s" (2.28+)
IB_COMPL_NEW_RE = re.compile(
    rb"Got completion from peer (\S+?)<(\d+)> with (?:status=|error )(?:(\w+)\()?(\d+)\)?,? opcode[= ](?:(\w+)\()?(\d+)\)?,?"
    rb"(?: len[= ](\d+),?)? vendor[ _]err[= ]?(\d+)(?: \((\w+)\))?(?:.*?localGid (\S+))?(?:.*?remoteGids?:? ?(\S+))?"
    rb"(?:.*?hca (\S+))?"
)
IB_COMPL_OLD_RE = re.compile(rb"Got completion with error (\d+), opcode (\d+), len (\d+), vendor err (\d+)")
# "NET/IB : Got async event : port error" (2.5-2.2x); src/transport/net_ib/common.cc (2.28+):
# "NET/IB : %s:%d async fatal event: %s", "... async fatal event on QP (%p) ...: %s", "... Got non-fatal async event: %s(%d)"
IB_ASYNC_RE = re.compile(rb"(?:(\w+):\d+ )?(?:Got (?:non-fatal )?async (?:event|error) ?: ?|async fatal event(?: on [^:]*)?: ?)(.*)")
IBV_RE = re.compile(rb"(?:Call to )?(?:wrap_)?(ibv_\w+)(?:\(\))? failed(?: with(?: error)? (-?\d+))?(.*)")
ADDR_RE = re.compile(rb"(\d{1,3}(?:\.\d{1,3}){3}|\[?[0-9a-fA-F:]*:[0-9a-fA-F:.]+\]?)<(\d+)>")
SOCKET_RE = re.compile(
    rb"socket\w*|Connect to .*failed|Call to (?:accept|connect|recv|send)\w* failed|Connection (?:closed|refused|reset)|"
    rb"connection closed by|Net : ",
    re.I,
)
CUDA_RE = re.compile(rb"Cuda failure (?:(\d+) )?'([^']*)'|(cudaError\w+)|CUDA error:? ?([^,]*)|unhandled cuda error", re.I)
PROXY_RE = re.compile(rb"\[Proxy Service (\d+)\] Failed to execute operation (\w+) from rank (\d+), retcode (\d+)")

# Failure kinds named by a phrase of the message, tried in order (first match wins).
SIMPLE_CLASSES = (
    (re.compile(rb"unhandled system error", re.I), "system"),
    (re.compile(rb"remote process exited or there was a network error|ncclRemoteError|remote error", re.I), "remote"),
    (re.compile(rb"internal error|ncclInternalError", re.I), "internal"),
    (re.compile(rb"invalid usage|invalid argument|ncclInvalid\w+", re.I), "invalid_usage"),
    (re.compile(rb"time(?:d)? ?out", re.I), "timeout"),
    (re.compile(rb"abort", re.I), "abort"),
    (re.compile(rb"bootstrap", re.I), "bootstrap"),
)

# --------------------------------------------------------------------------
# PyTorch ProcessGroupNCCL lines (no NCCL prefix)
# --------------------------------------------------------------------------

# pytorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, across releases:
#   "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, Timeout(ms)=1800000)
#    ran for 1800472 milliseconds before timing out."  (1.x; 2.0+ adds NumelIn=, NumelOut=)
#   log prefixes: "[Rank 3] " (<= 2.2), "[PG 0 Rank 3] " (2.3), "[PG ID 0 PG GUID 0(default_pg) Rank 3] " (2.4+)
#   "Timeout at NCCL work: 12, last enqueued NCCL work: 12, last completed NCCL work: 11."  (2.1-2.3)
#   "Exception (either an error or timeout) detected by watchdog at work: 12, last enqueued NCCL work: 12, last
#    completed NCCL work: 11."  (2.4+), "... Last enqueued NCCL work: 12, last completed NCCL work: 11." (dump signal)
#   "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued
#    collectives." (heartbeat monitor, 2.3+)
#   TORCH_NCCL_DESYNC_DEBUG's report: "ranks [1, 2] are the lagging ranks that caused this timeout"
WATCHDOG_RE = re.compile(rb"Watchdog caught collective operation timeout: WorkNCCL\((.*?)\) ran for (\d+) milliseconds")
WORK_KV_RE = re.compile(rb"(\w+(?:\(ms\))?)=([^,]+)")
TORCH_RANK_RE = re.compile(rb"\[(?:PG (?:ID )?(\d+)[^\]]*?)?Rank (\d+)\]|\[rank(\d+)\]:")
# "[PG ID 0 PG GUID 0(default_pg) Rank 3]", "[PG 1 (tp_group) Rank 3]", "[PG 0 Rank 3]"
TORCH_PG_RE = re.compile(rb"\[PG (?:ID )?(\d+)(?: PG GUID (\w+))?\s*(?:\(([^)]*)\))? Rank (\d+)\]")
WORK_SEQ_RE = re.compile(rb"(?:Timeout|Exception \(either an error or timeout\) detected by watchdog|failure detected by watchdog) at (?:NCCL )?work(?: sequence id)?: (\d+)")
LAST_ENQ_RE = re.compile(rb"[Ll]ast enqueued (?:NCCL )?work: (-?\d+)")
LAST_DONE_RE = re.compile(rb"[Ll]ast completed (?:NCCL )?work: (-?\d+)")
WATCHDOG_STUCK_RE = re.compile(rb"watchdog got stuck for (\d+) seconds")
LAGGING_RE = re.compile(rb"ranks \[([\d,\s]*)\] are the lagging ranks")
TORCH_NCCL_ERR_RE = re.compile(rb"NCCL error in: ([^,]+), (.*?)(?:, NCCL version ([\w.+-]+))?\s*$")
TORCH_MARKERS = re.compile(
    rb"Watchdog|WorkNCCL|ProcessGroupNCCL|NCCL error|DistBackendError|ncclRemoteError|ncclUnhandled|ncclSystemError|"
    rb"ncclInternalError|^NCCL version|^Cuda failure|NCCL operations have failed|lagging ranks|enqueued NCCL work"
)

# --------------------------------------------------------------------------
# Code tables
# --------------------------------------------------------------------------

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
