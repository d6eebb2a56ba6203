"""NCCL RAS reports (2.24+): the text the ``ncclras`` client prints (``NCCL_RAS_ENABLE``, on by default).

The format comes from NVIDIA/nccl src/ras/client_support.cc (rasClientRunInit, rasClientRunComms,
rasClientBreakDownErrors): a "Job summary" table, a table of communicator groups, then "Errors" and "Warnings"
sections where each communicator with a problem has a header ``#<group>-<comm> (<hash>) MISMATCH|ERROR|INCOMPLETE``
followed by indented lines:

- ``Communicator ranks have different AllReduce operation counts``, then ``14 ranks have launched up to operation
  1234``, ``Rank 3 has launched up to operation 1200 -- GPU 3 managed by process 4242 on node 10.0.0.2`` and
  ``Rank 5 -- GPU 5 managed by process 4244 on node 10.0.0.2`` (a rank listed under the count line above it);
- ``Missing communicator data from 2 ranks``, ``1 job process is considered dead (unreachable via the RAS
  network)``, ``Process 4242 on node 10.0.0.2 managing GPU 3``;
- ``Asynchronous errors on 2 ranks``, ``2 ranks reported Remote process error``, ``Rank 3 reported System error --
  GPU ...``; ``Communicator ranks have different status``, ``Rank 3 has status ABORT -- GPU ...``.

The report is stateful (which communicator, which operation, which count a listed rank belongs to), so the
recogniser keeps its context in the stream state (``st.ras``); it is active from a RAS heading on.
"""

from __future__ import annotations

import re
from typing import Any

from probes.nccl_log.patterns import text
from ranksight.schema import NcclEvent

# Lines that start (or restart) a RAS report's context.
RAS_HEADS = (b"Job summary", b"Group     Comms", b"#", b"Errors", b"Warnings", b"INCOMPLETE", b"DEAD", b"TIMEOUT")

_GPU_TAIL = rb"(?: -- (?:GPU (\S+(?: \(NVML \d+\))?) managed by process (\d+) on node (\S+)|\[process information not found\]))?"
_LINES: tuple[tuple[str, re.Pattern[bytes]], ...] = (
    ("comm_header", re.compile(rb"#(\d+)-(\d+) \(([0-9a-fA-F]+)\) (MISMATCH|ERROR|INCOMPLETE)\s*$")),
    ("op_mismatch", re.compile(rb"Communicator ranks have different (\w+) operation counts")),
    ("status_mismatch", re.compile(rb"Communicator ranks have different status")),
    ("op_group", re.compile(rb"(\d+) ranks have (?:launched up to operation (\d+)|not launched any operations)")),
    ("op_rank", re.compile(rb"Rank (\d+) has (?:launched up to operation (\d+)|not launched any operations)" + _GPU_TAIL)),
    ("status_group", re.compile(rb"(\d+) ranks have status (\w+)")),
    ("status_rank", re.compile(rb"Rank (\d+) has status (\w+)" + _GPU_TAIL)),
    ("error_group", re.compile(rb"(\d+) ranks reported (.+?)\s*$")),
    ("error_rank", re.compile(rb"Rank (\d+) reported (.+?)" + _GPU_TAIL + rb"\s*$")),
    ("errors_on", re.compile(rb"(Initialization|Asynchronous) errors? on (\d+) ranks?")),
    ("rank_listed", re.compile(rb"Rank (\d+)" + _GPU_TAIL + rb"\s*$")),
    ("missing", re.compile(rb"Missing communicator data from (\d+) (rank|job process)")),
    ("dead", re.compile(rb"(\d+) job process(?:es are| is) considered dead")),
    ("process_listed", re.compile(rb"Process (\d+) on node (\S+) managing GPUs? (.+?)\s*$")),
    ("ras_timeout", re.compile(rb"Encountered (\d+) communication timeouts?")),
    # "  Nodes  Processes ..." tables: the job summary's (5 numbers) and the communicator groups' rows.
    ("comm_group", re.compile(rb"(\d+)\s+(\d+)\s+(\d+)\s+([\d-]+)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$")),
    ("job_summary", re.compile(rb"(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$")),
)
_HEADINGS = (b"Job summary", b"===", b"Errors", b"Warnings", b"Group     Comms", b"#  in group", b"Nodes  Processes",
             b"(total)", b"per node", b"Communicators", b"INCOMPLETE", b"DEAD", b"TIMEOUT", b"Processes", b"per process")


def _gpu(f: dict[str, Any], m: re.Match, first: int) -> None:
    if m.group(first):
        f.update({"gpu": text(m.group(first)), "pid": int(m.group(first + 1)), "node": text(m.group(first + 2))})


def ras_line(st: Any, line: bytes) -> NcclEvent | None:
    """The event of one line of a RAS report; None when it is none (the context ends at a line no rule knows)."""
    body = line.lstrip(b"> ").strip()
    if st.ras is None:
        if not body.startswith(RAS_HEADS) or (body.startswith(b"#") and not _LINES[0][1].match(body)):
            return None
        st.ras = {}
    ctx = st.ras
    if not body or body.startswith(_HEADINGS):
        return _event(st, line, "heading", {}) if body else None
    for kind, rx in _LINES:
        m = rx.match(body)
        if m is None:
            continue
        f: dict[str, Any] = {}
        if kind == "comm_header":
            ctx.clear()
            ctx.update(comm_hash="0x" + text(m.group(3)).lower(), section=text(m.group(4)))
        elif kind == "op_mismatch":
            ctx.update(op=text(m.group(1)), what="op")
        elif kind == "status_mismatch":
            ctx.update(what="status")
        elif kind == "op_group":
            ctx["value"] = int(m.group(2) or 0)
            f.update(count=int(m.group(1)), opcount=ctx["value"])
        elif kind == "op_rank":
            f.update(rank=int(m.group(1)), opcount=int(m.group(2) or 0))
            _gpu(f, m, 3)
        elif kind == "status_group":
            ctx["value"] = text(m.group(2))
            f.update(count=int(m.group(1)), status=ctx["value"])
        elif kind == "status_rank":
            f.update(rank=int(m.group(1)), status=text(m.group(2)))
            _gpu(f, m, 3)
        elif kind == "error_group":
            ctx["value"] = text(m.group(2))
            f.update(count=int(m.group(1)), error=ctx["value"])
        elif kind == "error_rank":
            f.update(rank=int(m.group(1)), error=text(m.group(2)))
            _gpu(f, m, 3)
        elif kind == "errors_on":
            ctx.update(what="error", phase=text(m.group(1)).lower())
            f.update(count=int(m.group(2)), phase=ctx["phase"])
        elif kind == "rank_listed":
            f["rank"] = int(m.group(1))
            _gpu(f, m, 2)
            what = ctx.get("what") or ("missing" if ctx.get("section") == "INCOMPLETE" else "")
            key = {"op": "opcount", "status": "status", "error": "error"}.get(what)
            if key and "value" in ctx:
                f[key] = ctx["value"]
            kind = {"op": "op_rank", "status": "status_rank", "error": "error_rank"}.get(what, "missing_rank")
        elif kind == "missing":
            ctx.update(what="missing")
            f.update(count=int(m.group(1)), of=text(m.group(2)))
        elif kind == "dead":
            ctx.clear()
            ctx.update(what="dead")
            f["count"] = int(m.group(1))
        elif kind == "process_listed":
            f.update(pid=int(m.group(1)), node=text(m.group(2)), gpu=text(m.group(3)),
                     state="dead" if ctx.get("what") == "dead" else "missing")
        elif kind == "ras_timeout":
            f["count"] = int(m.group(1))
        elif kind == "comm_group":
            f.update(group=int(m.group(1)), comms=int(m.group(2)), nodes=int(m.group(3)),
                     ranks_per_node=text(m.group(4)), ranks_per_comm=int(m.group(5)), ranks_in_group=int(m.group(6)),
                     status=text(m.group(7)), errors=text(m.group(8)))
        elif kind == "job_summary":
            f.update(nodes=int(m.group(1)), processes_per_node=int(m.group(2)), gpus_per_process=int(m.group(3)),
                     processes=int(m.group(4)), gpus=int(m.group(5)))
        for k in ("comm_hash", "section", "op", "phase"):
            if k in ctx and k not in f:
                f[k] = ctx[k]
        return _event(st, line, kind, f)
    st.ras = None  # a line no rule knows: the report is over
    return None


def _event(st: Any, line: bytes, kind: str, f: dict[str, Any]) -> NcclEvent:
    f["kind"] = kind
    f["source"] = "ras"
    return NcclEvent(host=st.default_host, pid=st.default_pid, t=None, category="ras", rank=f.get("rank"),
                     error_class="ras", message=text(line).strip()[:300], fields=f, source_file=st.source_file,
                     line_no=st.line_no)
