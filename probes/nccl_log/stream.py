"""What one log stream has established so far: the context the recognisers read and write.

NCCL lines carry host, pid, thread and device, but rarely the communicator or the rank. Both
are learnt from earlier lines and filled into later events: a thread's communicator from the
``comm 0x.. rank R nranks N ...`` line of the init it runs (rings, trees and transports are
printed by that thread), a process's rank from the largest communicator it joined.
"""

from __future__ import annotations

from typing import Any, Callable

from probes.nccl_log.patterns import Prefix, host_pid_from_filename
from ranksight.schema import NcclEvent

# What a recogniser returns for a line its first word promised but that it does not know:
# the generic recognisers (COLL lines, call traces, plugins, known INFO) get the line instead.
DECLINED: Any = object()


def append_channel(seen: list[int], head: bytes) -> None:
    """Append the channel number of "Channel 05/0" / "Ring 05" (``head``: the text before " : ")."""
    try:
        seen.append(int(head.split(b" ", 2)[1].split(b"/", 1)[0]))
    except (ValueError, IndexError):
        pass


class StreamState:
    """Per-stream facts shared by the recognisers, and the event builder that applies them.

    :class:`~probes.nccl_log.parser.NcclLogParser` is a StreamState that also reads bytes;
    the recognisers take the state only.
    """

    def __init__(self, source_file: str, host: str, pid: int, emit_collectives: bool, keep_unclassified: bool) -> None:
        self.source_file = source_file
        fh, fp = host_pid_from_filename(source_file) if source_file else ("", 0)
        self.default_host = host or fh
        self.default_pid = pid or fp
        self.emit_collectives = emit_collectives
        self.keep_unclassified = keep_unclassified
        self.line_no = 0
        self.lead = b""  # the bytes before " NCCL " of the line being parsed
        # (host, pid) -> (rank, nranks) of the largest communicator seen: the process's world rank.
        self.proc_rank: dict[tuple[str, int], tuple[int, int]] = {}
        # (host, pid, tid) -> comm id of the communicator being initialised on that thread:
        # topology lines (rings, trees, transports) carry no comm id, but init runs on one thread.
        self.thread_comm: dict[tuple[str, int, int], str] = {}
        self.comm_rank: dict[tuple[str, int, str], int] = {}  # (host, pid, comm id) -> rank in it
        self.ptr_comm: dict[tuple[str, int, str], str] = {}  # (host, pid, comm pointer) -> commId hash
        self.notes: list[str] = []
        self.unclassified = 0
        self.unclassified_lines: list[int] | None = None  # 1-based numbers of unclassified lines, when wanted
        self.ras: dict[str, Any] | None = None  # the context of an ncclras report being read (see ras.py)
        # COLL lines that reached the recogniser (the parser folds most before that):
        # (host, pid, comm pointer) -> the last call, and how many there were.
        self.recognised_last_collective: dict[tuple[str, int, str], dict[str, Any]] = {}
        self.recognised_collective_lines = 0
        # (prefix bytes, comm, text after " : ") -> the channel list of the event already emitted.
        self._dedupe: dict[tuple[bytes, str | None, bytes], list[int]] = {}
        # (prefix bytes, text after " : ") -> the same channel list, skipping the thread -> comm
        # lookup; emptied whenever a thread's communicator or the dedupe table changes.
        self._chan_fast: dict[tuple[bytes, bytes], list[int]] = {}

    def event(self, pre: Prefix, category: str, msg: bytes, fields: dict[str, Any] | None = None,
              **kw: Any) -> NcclEvent:
        """An event of the current line; rank and nranks default to the process's world rank."""
        host, pid, tid, dev, t, tag = pre
        if "rank" not in kw:
            pr = self.proc_rank.get((host, pid))
            if pr is not None:
                kw["rank"] = pr[0]
                if "nranks" not in kw:
                    kw["nranks"] = pr[1]
            elif tag is not None:
                kw["rank"] = tag
        if not fields:
            fields = {}
        fields["tid"] = tid
        fields["cudaDev"] = dev
        if tag is not None:
            fields["launcher_rank"] = tag
        return NcclEvent(
            host=host, pid=pid, t=t, category=category, message=msg.decode("utf-8", "replace"), fields=fields,
            source_file=self.source_file, line_no=self.line_no, **kw,
        )

    def count_unclassified(self) -> None:
        """One more line no recogniser understood (its number kept when ``unclassified_lines`` is a list)."""
        self.unclassified += 1
        if self.unclassified_lines is not None:
            self.unclassified_lines.append(self.line_no)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def comm_context(self, pre: Prefix) -> tuple[str, int | None]:
        """(comm id, this process's rank in it) of the communicator the line's thread initialises."""
        cid = self.thread_comm.get(pre[:3], "")
        return cid, self.comm_rank.get((pre[0], pre[1], cid)) if cid else None

    def enter_comm(self, pre: Prefix, comm: str, comm_hash: str | None, rank: int, nranks: int) -> str:
        """Record a ``comm 0x.. rank R nranks N`` line; returns the comm id (the commId hash when known).

        The commId hash is the same in every rank of a communicator; the pointer is per process.
        Lines without commId (2.5-2.7, or 2.19+'s "comm 0x.. rank 0 nRanks 8 nNodes 1 ...")
        reuse the hash an earlier line gave the same pointer.
        """
        host, pid, tid = pre[0], pre[1], pre[2]
        if comm_hash is not None:
            self.ptr_comm[(host, pid, comm)] = comm_hash
            comm_id = comm_hash
        else:
            comm_id = self.ptr_comm.get((host, pid, comm), comm)
        if self.thread_comm.get((host, pid, tid)) != comm_id:
            self.thread_comm[(host, pid, tid)] = comm_id
            self._chan_fast.clear()  # its keys assumed the old thread -> comm mapping
        self.comm_rank[(host, pid, comm_id)] = rank
        cur = self.proc_rank.get((host, pid))
        if cur is None or nranks > cur[1]:
            self.proc_rank[(host, pid)] = (rank, nranks)
        return comm_id

    def first_of_channels(self, pre: Prefix, msg: bytes,
                          build: Callable[[StreamState, Prefix, bytes], NcclEvent | None]) -> NcclEvent | None:
        """Per-channel repeats of the same connection or ring: one event, later channels appended
        to its ``fields["channels"]`` (the same list object); a repeat returns None."""
        c = msg.find(b" : ")
        if c < 0:
            cid, _ = self.comm_context(pre)
            return self.event(pre, "channel", msg, comm_id=cid)
        key = (self.lead, self.thread_comm.get(pre[:3]), msg[c:])
        seen = self._dedupe.get(key)
        if seen is not None:
            append_channel(seen, msg[:c])
            return None
        ev = build(self, pre, msg)
        if ev is not None and "channel" in ev.fields:
            ev.fields["channels"] = self._dedupe[key] = [ev.fields["channel"]]
            if len(self._dedupe) > 100_000:  # bounded: a later duplicate becomes an event again
                self._dedupe.clear()
                self._chan_fast.clear()
        return ev
