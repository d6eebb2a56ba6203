"""A rank's raw collective records over a step range, read from its spool file without reading the whole file.

The spool (``ranksight.spool``) is append-only and written step after step, but not strictly sorted by step: a
restarted job (a new ``attempt``) resumes from its checkpoint's step, so steps go back, and a gap event carries the
step before it. So no binary search over line starts: ``SpoolStepIndex`` cuts the file into blocks of about
``BLOCK_BYTES`` at line ends and keeps, for each, the smallest and largest step number written in it. A query reads
only the blocks whose span meets its range, whatever the order of steps in the file. The index is built on the first
query of a file (one pass over the file that parses no JSON: a regular expression finds the step numbers) and kept;
each later query only indexes what was appended since, and a replaced or truncated file is indexed again.

Why the index may be loose but never wrong: every decodable record has a top-level ``"step":N`` that the expression
finds, so a record's step always lies in its block's span; a ``"step"`` inside another field (an event's detail)
only widens the span, which costs a read, not a record.
"""

from __future__ import annotations

import os
import re
import threading
import msgspec

from ranksight.ops_query import OpsAnswer, OpsGap, OpsQuery
from ranksight.schema import CollectiveRecord, decode_spool_line
from ranksight.spool import MAX_LINE_BYTES

BLOCK_BYTES = 1 << 20
STEP_NUMBER = re.compile(rb'"step":\s*(-?\d+)')


class SpoolStepIndex:
    """Blocks of one spool file: ``starts[i]`` (byte offset of a line start), ``ends[i]`` (one past its last
    newline; or a cut inside a line longer than ``max_line_bytes``, which no record is), ``lo[i]`` / ``hi[i]`` (the
    smallest and largest step number in it). Only complete lines are indexed; a line the rank is still writing is
    indexed once its newline is there. Thread-safe (one lock per file)."""

    def __init__(self, path: str | os.PathLike, block_bytes: int = BLOCK_BYTES, max_line_bytes: int = MAX_LINE_BYTES):
        self.path = os.fspath(path)
        self.block_bytes = block_bytes
        self.max_line_bytes = max_line_bytes
        self.lock = threading.Lock()
        self.rebuilds = 0  # times the file was found replaced or truncated, and indexed again
        self._reset(0)

    def _reset(self, inode: int) -> None:
        self.inode = inode
        self.indexed = 0  # bytes of the file indexed (up to a newline)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.lo: list[int] = []
        self.hi: list[int] = []

    def refresh(self) -> int:
        """Index what was appended since the last call (everything, for a new or replaced file); the file's size.
        FileNotFoundError when the spool is not there."""
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_ino != self.inode or st.st_size < self.indexed:
                self.rebuilds += bool(self.inode)
                self._reset(st.st_ino)
            if st.st_size > self.indexed:
                f.seek(self.indexed)
                self._index_from(f, st.st_size)
            return st.st_size

    def _index_from(self, f, size: int) -> None:
        pos = self.indexed
        carry = b""
        while pos + len(carry) < size:
            # a block holds at most block_bytes, unless one line is longer
            want = self.block_bytes - len(carry) if len(carry) < self.block_bytes else self.block_bytes
            data = carry + f.read(min(want, size - pos - len(carry)))
            end = data.rfind(b"\n") + 1
            if end == 0:
                if pos + len(data) >= size:
                    break  # the last line is still being written
                if len(data) < self.max_line_bytes:
                    carry = data  # a line longer than a block: read on to its end
                    continue
                end = len(data)  # no record is that long: a block of garbage, cut here, not held in memory whole
            self._add_block(pos, data[:end])
            pos += end
            carry = data[end:]
        self.indexed = pos

    def _add_block(self, start: int, chunk: bytes) -> None:
        found = STEP_NUMBER.findall(chunk)
        if found:
            steps = [int(s) for s in set(found)]  # a step number repeats on each of its records
            lo, hi = min(steps), max(steps)
        else:  # only damaged or blank lines: they belong after the step before them
            lo = hi = self.hi[-1] if self.hi else -1
        if self.ends and self.ends[-1] == start and start - self.starts[-1] + len(chunk) <= self.block_bytes:
            # what a live spool appended since the last query: grows the last block rather than adding a small one
            self.ends[-1] = start + len(chunk)
            self.lo[-1] = min(self.lo[-1], lo)
            self.hi[-1] = max(self.hi[-1], hi)
            return
        self.starts.append(start)
        self.ends.append(start + len(chunk))
        self.lo.append(lo)
        self.hi.append(hi)

    def blocks(self, step_from: int, step_to: int) -> list[tuple[int, int]]:
        """The byte ranges (blocks, in file order) to read for steps ``step_from..step_to``: those whose span of
        steps meets the range."""
        return [(s, e) for s, e, lo, hi in zip(self.starts, self.ends, self.lo, self.hi)
                if lo <= step_to and hi >= step_from]


def read_ops(index: SpoolStepIndex, q: OpsQuery, run_id: str, node: int) -> OpsAnswer:
    """The collective records of ``q``'s rank and range in the spool ``index`` covers, in file order, at most
    ``q.limit`` of them (``truncated`` when more matched). Undecodable lines among those read are gaps: counted,
    and those next to a record of the range (or inside it) reported with where they are."""
    with index.lock:
        size = index.refresh()
        blocks = index.blocks(q.step_from, q.step_to)
    ops: list[CollectiveRecord] = []
    gaps: list[OpsGap] = []
    damaged = 0
    truncated = False
    nread = 0
    read_to = -1  # where the last block read ended
    prev_step = -1  # the last good record's step (in the blocks read back to back)
    bad: OpsGap | None = None  # the run of damaged lines since that record

    def close_gap(next_in_range: bool = False) -> None:
        # a gap counts for the range when a record on either side of it is in the range
        nonlocal damaged, bad
        if bad is not None and (next_in_range or q.step_from <= prev_step <= q.step_to):
            gaps.append(bad)
            damaged += bad.lines
        bad = None

    with open(index.path, "rb") as f:
        for start, end in blocks:  # one block in memory at a time
            if start != read_to:  # not the next block of the file: what came before is not known here
                close_gap()
                prev_step = -1
                f.seek(start)
            data = f.read(end - start)
            read_to = end
            nread += len(data)
            off = start
            lines = data.split(b"\n")
            if not lines[-1]:
                lines.pop()  # a block ends at a newline, but for one cut inside an oversized line
            for line in lines:
                line_off = off
                off += len(line) + 1
                if not line.strip():
                    continue
                try:
                    rec = decode_spool_line(line)
                except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                    if bad is None:
                        bad = OpsGap(offset=line_off, lines=0, nbytes=0, after_step=prev_step,
                                     sample=line[:80].decode("utf-8", "replace"))
                    bad.lines += 1
                    bad.nbytes += len(line) + 1
                    continue
                in_range = q.step_from <= rec.step <= q.step_to
                close_gap(in_range)
                prev_step = rec.step
                if in_range and isinstance(rec, CollectiveRecord) and q.matches(rec):
                    if len(ops) == q.limit:
                        truncated = True
                        break
                    ops.append(rec)
            if truncated:
                break
        if not truncated:
            close_gap()
    return OpsAnswer(run_id=run_id, node=node, rank=q.rank, step_from=q.step_from, step_to=q.step_to, comm=q.comm,
                     op=q.op, limit=q.limit, ops=ops, truncated=truncated, damaged_lines=damaged, gaps=gaps,
                     bytes_read=nread, spool_bytes=size)


class SpoolIndexes:
    """One ``SpoolStepIndex`` per rank, made on the rank's first query and kept (the agent's endpoint holds one)."""

    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._by_path: dict[str, SpoolStepIndex] = {}

    def of(self, path: str | os.PathLike) -> SpoolStepIndex:
        key = os.fspath(path)
        with self._lock:
            ix = self._by_path.get(key)
            if ix is None:
                ix = self._by_path[key] = SpoolStepIndex(key, self.block_bytes)
            return ix
