"""NcclLogParser: bytes in, NcclEvents out, for one log stream; whole files with parse_file.

The parser splits chunks into lines, folds the two kinds of line that make up the bulk of
big logs without building an event (see :meth:`NcclLogParser.feed`), and hands every other
line to the recogniser of its kind: an NCCL line by its level (:data:`LEVELS`), a line
without an NCCL prefix to the first of :data:`OTHER_LINES` that takes it, else
``unclassified``.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Callable, Iterator

from probes.nccl_log.failures import failure
from probes.nccl_log.info import CLAIMED_BY_FIRST_BYTE, collective, info_message
from probes.nccl_log.patterns import COLL_RE, MAX_LINE, Prefix, from_host, parse_prefix, text
from probes.nccl_log.ras import RAS_HEADS, ras_line
from probes.nccl_log.stream import StreamState, append_channel
from probes.nccl_log.torch_lines import might_be_torch_line, torch_line
from ranksight.schema import NcclEvent

# "NCCL <LEVEL>" -> (level name, recogniser of the message after it).
LEVELS: dict[bytes, tuple[str, Callable[[StreamState, Prefix, str, bytes], NcclEvent | None]]] = {
    b"INFO": ("INFO", info_message),
    b"TRACE": ("TRACE", info_message),
    b"WARN": ("WARN", failure),
    b"ABORT": ("ABORT", failure),
    b"ERROR": ("ERROR", failure),
    b"CALL": ("CALL", info_message),  # 2.19+ "host:pid:tid NCCL CALL ncclAllReduce(...)" (NCCL_DEBUG=TRACE)
}

# Lines without an NCCL prefix: (cheap test, recogniser), tried in order; a recogniser
# returning None passes the line on.
OTHER_LINES: tuple[tuple[Callable[[bytes], Any], Callable[[StreamState, bytes], NcclEvent | None]], ...] = (
    (might_be_torch_line, torch_line),
)

_NO_RUN = (b"\n", b"\n", 0, [0, b""])  # a COLL run that no line matches (no line starts with "\n")
READ_CHUNK = 1 << 20


class NcclLogParser(StreamState):
    """Incremental parser for one log stream (one file). Feed bytes or lines, get NcclEvents.

    NCCL_DEBUG_SUBSYS=COLL writes one line per collective call, which can dwarf everything
    else; by default those lines are counted per (process, communicator) and only the last
    call is kept (:attr:`last_collective`, :attr:`collective_counts`: the hang-relevant
    facts). ``emit_collectives=True`` makes each one an event.

    Transport and ring-order lines repeat per channel; the first one per (process,
    communicator, peer/transport or ring order) becomes an event and later channels are
    appended to that event's ``fields["channels"]`` list (the same list object).

    The methods here read input; what the stream has established (ranks, communicators, the
    event builder) is the :class:`StreamState` the recognisers share.
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
        super().__init__(source_file, host, pid, emit_collectives, keep_unclassified)
        self.bytes_parsed = 0  # bytes of complete lines consumed (excludes pending partial line)
        self._pending = b""
        self._prefix_cache: dict[bytes, Prefix] = {}
        self._coll_alias: dict[bytes, list] = {}  # launcher-tagged key -> the counter of its host key
        self._host_key: dict[bytes, bytes] = {}  # lead -> the lead from the host on (launcher tags dropped)
        # prefix + " comm 0x.. [nranks=N] stream 0x.." -> [count, last line]: COLL lines folded.
        self._coll_stats: dict[bytes, list] = {}
        # The COLL run being folded: lines that start with this prefix + " NCCL INFO " and end
        # with this " comm 0x.. " tail share one counter (see _fold_collective).
        self._run: tuple[bytes, bytes, int, list] = _NO_RUN

    # ---- state a tailer can read -----------------------------------------

    @property
    def collective_lines(self) -> int:
        return self.recognised_collective_lines + sum(st[0] for st in self._coll_stats.values())

    @property
    def collective_counts(self) -> dict[tuple[str, int, str], int]:
        """(host, pid, comm pointer) -> number of COLL lines seen."""
        out: dict[tuple[str, int, str], int] = {}
        for key_b, (n, line) in self._coll_stats.items():
            k = key_b.rfind(b" comm 0x")
            pre = self._prefix(key_b[:k]) or ("", 0)
            key = (pre[0], pre[1], text(key_b[k + 6 :].split(b" ", 1)[0]))
            out[key] = out.get(key, 0) + n
        return out

    @property
    def last_collective(self) -> dict[tuple[str, int, str], dict[str, Any]]:
        """(host, pid, comm pointer) -> the last collective call seen (op, opCount, count, ...)."""
        out = dict(self.recognised_last_collective)
        for key_b, (_n, msg) in self._coll_stats.items():
            pre = self._prefix(key_b[: key_b.rfind(b" comm 0x")]) or ("", 0)
            j = msg.find(b" NCCL INFO ")
            m = COLL_RE.match(msg, j + 11 if j >= 0 else 0)
            if m is None:
                continue
            info = {"op": text(m.group(1)), "opCount": int(m.group(2), 16), "count": int(m.group(3)),
                    "datatype": int(m.group(4)), "redop": int(m.group(5)), "root": int(m.group(6)),
                    "comm": text(m.group(7))}
            key = (pre[0], pre[1], info["comm"])
            prev = out.get(key)
            if prev is None or prev["opCount"] <= info["opCount"]:
                out[key] = info
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete last line held back; subtract from the read offset to resume."""
        return len(self._pending)

    # ---- input -----------------------------------------------------------

    def feed(self, data: bytes) -> list[NcclEvent]:
        """Parse a chunk of raw bytes. A trailing partial line waits for the next chunk.

        Fast paths, no event: the bulk of big logs is per-call COLL lines and the same peer
        connection repeated on every channel. Both are recognised with a few C-level byte
        operations and folded into parser state; every other line goes to :meth:`_parse_line`.
        """
        if not data:
            return []
        if self._pending:
            data = self._pending + data
        lines = data.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > MAX_LINE:  # no newline for 64 KiB: binary; don't grow forever
            lines.append(self._pending)
            self._pending = b""
        out: list[NcclEvent] = []
        append = out.append
        parse = self._parse_line
        cache_get = self._prefix_cache.get
        chan_get = self._chan_fast.get
        fold_coll = not self.emit_collectives
        claimed_get = CLAIMED_BY_FIRST_BYTE.get
        coll_match = COLL_RE.match
        recognise_collective = collective
        run_head, run_tail, run_min, run_st = self._run if fold_coll else _NO_RUN
        run_hlen = len(run_head)
        ln = ln0 = self.line_no
        for ln, line in enumerate(lines, ln + 1):
            # 1. The next line of the COLL run being folded (see _fold_collective).
            if line.startswith(run_head) and line.endswith(run_tail) and len(line) > run_min \
                    and line.find(b": opCount ", run_hlen) >= 0:
                run_st[0] += 1
                run_st[1] = line
                continue
            i = line.find(b" NCCL INFO ")
            if i > 0:
                # 2. A connection or ring order already emitted, on another channel: only the
                # channel number is new.
                chan = line.startswith(b"Channel ", i + 11)
                if chan:
                    c = line.find(b" : ", i + 19)
                    if c > 0:
                        seen = chan_get((line[:i], line[c:]))
                        # No ':' between "Channel " and " : ": no ": opCount " (see _repeat_channel).
                        if seen is not None and line.find(b":", i + 19, c) < 0:
                            nb = line[i + 19 : i + 21]
                            if line[i + 21] == 47 and nb.isdigit():  # "Channel 05/..."
                                seen.append(int(nb))
                            else:
                                append_channel(seen, line[i + 11 : c])
                            continue
                    else:
                        chan = False
                # 3. A per-call COLL line.
                if b": opCount " not in line:
                    pass
                elif fold_coll:
                    if self._fold_collective(line, i):
                        run_head, run_tail, run_min, run_st = self._run
                        run_hlen = len(run_head)
                        continue
                # emit_collectives: straight to the COLL recogniser, where _parse_line would
                # end up there too (a cached prefix, no first word another recogniser claims).
                elif line.find(b" NCCL ", 0, i + 6) == i and len(line) <= MAX_LINE and not line.endswith(b"\r"):
                    claimed = claimed_get(line[i + 11 : i + 12])
                    if claimed is None or not line.startswith(claimed, i + 11):
                        pre = cache_get(line[:i])
                        if pre is not None:
                            m = coll_match(line, i + 11)
                            if m is not None:
                                self.line_no = ln
                                append(recognise_collective(self, pre, line[i + 11 :], m))
                                continue
                # 4. A channel repeat not in the table of step 2 yet.
                if chan and self._repeat_channel(line, i, c):
                    continue
            self.line_no = ln
            ev = parse(line)
            if ev is not None:
                append(ev)
        self.line_no = ln0 + len(lines)
        self.bytes_parsed += len(data) - len(self._pending)
        return out

    def _fold_collective(self, line: bytes, i: int) -> bool:
        """Count a COLL line (``i``: where " NCCL INFO " starts) under its thread and communicator.

        COLL lines come in runs from one thread and communicator: a line that starts with the
        run's "prefix NCCL INFO " and ends with its " comm 0x.. [nranks=N] stream 0x.." tail
        has the same key as the line that started the run (the first " NCCL INFO " and the
        last " comm 0x" are where they were in that line), so feed() counts it with a
        startswith and an endswith. This line starts such a run (``self._run``).
        """
        k = line.rfind(b" comm 0x")
        if k <= i:
            return False
        tail = line[k:]
        key = line[:i] + tail
        colls = self._coll_stats
        st = colls.get(key) or self._coll_alias.get(key)
        if st is None:
            full = key
            # Keyed from the host on: a timestamp or launcher tag before it (NCCL >= 2.26 stamps
            # every line) would make a counter per distinct time, growing forever in a long tail.
            lead = line[:i]
            hk = self._host_key.get(lead)
            if hk is None:
                hk = from_host(lead)
                if len(self._host_key) > 4096:  # stamped leads differ every line: bounded
                    self._host_key.clear()
                self._host_key[lead] = hk
            key = hk + tail
            st = colls.get(key)
            if hk != line[:i] and len(self._coll_alias) < 65536:  # later lines of this lead: one lookup
                if st is None:
                    st = colls[key] = [0, line]
                self._coll_alias[full] = st
        if st is None:
            st = colls[key] = [1, line]
        else:
            st[0] += 1
            st[1] = line
        head = line[: i + 11]
        if b": opCount " not in head and b": opCount " not in tail:
            # The rest of this run: ": opCount " can only be between the two.
            self._run = (head, tail, i + len(tail), st)
        return True

    def _repeat_channel(self, line: bytes, i: int, c: int) -> bool:
        """A channel line (" : " at ``c``) repeating one already emitted for this thread's
        communicator: append its channel number and remember it for feed()'s step 2."""
        lead = line[:i]
        pre = self._prefix_cache.get(lead)
        if pre is None:
            return False
        tail = line[c:]
        seen = self._dedupe.get((lead, self.thread_comm.get(pre[:3]), tail))
        if seen is None:
            return False
        if b": opCount " not in tail and b": opCount " not in line[: i + 11]:
            self._chan_fast[(lead, tail)] = seen
        append_channel(seen, line[i + 11 : c])
        return True

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
        self._coll_alias.clear()
        self._run = _NO_RUN
        self.recognised_last_collective.clear()
        self.recognised_collective_lines = 0

    def feed_line(self, line: bytes | str) -> NcclEvent | None:
        """Parse one complete line (without or with its newline)."""
        if isinstance(line, str):
            line = line.encode("utf-8", "surrogateescape")
        self.bytes_parsed += len(line) + (0 if line.endswith(b"\n") else 1)
        self.line_no += 1
        return self._parse_line(line.rstrip(b"\n"))

    def close(self) -> list[NcclEvent]:
        """End of input: the held-back partial line (a truncated file's last line) is parsed too."""
        if not self._pending:
            return []
        line, self._pending = self._pending, b""
        self.bytes_parsed += len(line)
        self.line_no += 1
        ev = self._parse_line(line)
        return [ev] if ev is not None else []

    # ---- one line, by kind ---------------------------------------------------

    def _parse_line(self, line: bytes) -> NcclEvent | None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE]
        # "NCCL " at the start: a legacy line without host:pid:tid (lead empty)
        i = -1 if line.startswith(b"NCCL ") else line.find(b" NCCL ")
        if i >= 0 or line.startswith(b"NCCL "):
            j = line.find(b" ", i + 6)
            kind = LEVELS.get(line[i + 6 : j]) if j > 0 else None
            if kind is not None:
                self.lead = lead = line[:i] if i > 0 else b""
                pre = self._prefix_cache.get(lead) or self._prefix(lead)
                if pre is not None:
                    level, recognise = kind
                    return recognise(self, pre, level, line[j + 1 :])
        if not line.strip():
            return None
        if self.ras is not None or line.lstrip(b"> ").startswith(RAS_HEADS):  # an ncclras report (2.24+)
            ev = ras_line(self, line)
            if ev is not None:
                return ev
        for might_be, recognise_other in OTHER_LINES:
            if might_be(line):
                ev = recognise_other(self, line)
                if ev is not None:
                    return ev
        self.count_unclassified()
        if not self.keep_unclassified:
            return None
        return NcclEvent(host=self.default_host, pid=self.default_pid, t=None, category="unclassified",
                         message=text(line[:512]), source_file=self.source_file, line_no=self.line_no)

    def _prefix(self, lead: bytes) -> Prefix | None:
        hit = self._prefix_cache.get(lead)
        if hit is not None:
            return hit
        val = parse_prefix(lead)
        if val is not None and not val[0]:
            # ":pid:tid" (an empty host name) or a legacy line without host:pid:tid: what the file name says
            val = (self.default_host, val[1] or self.default_pid, *val[2:])
        if val is not None and val[4] is None:  # stamped prefixes differ every line: caching them only costs memory
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            self._prefix_cache[lead] = val
        return val


# --------------------------------------------------------------------------
# Whole files
# --------------------------------------------------------------------------


def open_log(path: str) -> BinaryIO:
    """A log file for reading bytes, plain or .gz. Raises OSError (IsADirectoryError for a directory)."""
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory", path)
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def parse_stream(f: BinaryIO, source_file: str = "", **kw: Any) -> Iterator[NcclEvent]:
    """Yield every event of one binary stream, reading 1 MiB at a time."""
    p = NcclLogParser(source_file=source_file, **kw)
    while True:
        chunk = f.read(READ_CHUNK)
        if not chunk:
            break
        yield from p.feed(chunk)
    yield from p.close()


def parse_file(path: str, **kw: Any) -> Iterator[NcclEvent]:
    """Yield every event of one log file (plain or .gz). Raises OSError if it cannot be opened."""
    with open_log(path) as f:
        yield from parse_stream(f, source_file=path, **kw)
