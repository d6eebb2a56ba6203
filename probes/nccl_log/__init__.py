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

The modules, in the order a line meets them:

- ``patterns``: the line prefix (host, pid, thread, device, timestamp), every regex, NCCL's code tables.
- ``parser``: :class:`NcclLogParser`: splits bytes into lines, folds per-call COLL lines and
  per-channel repeats, sends every other line to its recogniser by kind (``LEVELS``: the NCCL
  level; ``OTHER_LINES``: lines without an NCCL prefix); ``parse_stream``, ``parse_file``.
- ``stream``: :class:`StreamState`, what the stream has established (ranks, the communicator
  each thread initialises, channel dedupe), and the event builder the recognisers use.
- ``info``: INFO/TRACE messages: the table of first words -> recognisers, then the generic ones.
- ``topology``: communicator, ring, tree and transport lines.
- ``failures``: WARN/ERROR/ABORT messages -> ``error_class``.
- ``torch_lines``: PyTorch ProcessGroupNCCL lines (watchdog, NCCL error).
- ``summary``: :class:`NcclLogSummary`, :func:`summarize`.
- ``cli``: ``ranksight nccl-log`` (imported only by the command; it needs typer and rich).
"""

from probes.nccl_log.parser import NcclLogParser, parse_file, parse_stream
from probes.nccl_log.patterns import IBV_WC_STATUS, NCCL_RESULT, host_pid_from_filename
from probes.nccl_log.summary import NcclLogSummary, summarize

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
