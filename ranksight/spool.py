"""Tail a rank's step spool (``RunDir.spool(rank)``) with saved offsets.

The trainer appends one JSON object per line and never waits for anyone. This
reader turns the bytes appended since the last saved position into decoded
records, and hands back the position to save *after* those records are safe
somewhere else (the node agent saves it once the head acknowledged them).

What it must survive, and how:

- **Partial last line**: a rank may be mid-``write`` when we read. Only bytes up
  to the last newline are consumed; the tail waits for the next read.
- **Truncation / rotation**: if the file's inode changed or it is now shorter
  than our offset, it is a new file: restart from 0 and say so (``reset``), so
  the caller can record it. Records re-read after a reset are deduplicated by
  the head by their natural keys.
- **Restarts**: the position (inode, offset, last good step/time, counters) is a
  small msgspec struct the caller persists; a new tailer resumes from it.
- **Garbage**: a line that does not decode is never fatal. It is counted and
  returned as a ``SpoolGap`` (where, how many bytes, a sample), so the loss is
  visible downstream instead of silently skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from ranksight.schema import SpoolRecord, decode_spool_line

# One read is bounded so a large backlog (agent down for an hour) is shipped in
# pieces instead of being loaded whole.
DEFAULT_MAX_BYTES = 4 * 1024 * 1024
# A "line" longer than this with no newline is not a record: the writer is
# broken. Consume it as a gap rather than buffering forever.
MAX_LINE_BYTES = 16 * 1024 * 1024


class TailPosition(msgspec.Struct, kw_only=True):
    """Where a spool was read up to. Persisted by the caller (the agent's state file)."""

    inode: int = 0
    offset: int = 0
    # Last good record seen before ``offset``: lets a gap be placed in step order
    # deterministically, even after a restart.
    last_step: int = -1
    last_t: float = 0.0
    node: int | None = None  # the node the rank's records say it runs on
    records: int = 0  # records decoded so far (this file)
    garbage_lines: int = 0
    resets: int = 0


class SpoolGap(msgspec.Struct, kw_only=True):
    """Bytes of a spool that could not be decoded, or a restart of the file."""

    reason: str  # "garbage" | "reset" | "oversized_line"
    offset: int  # byte offset in the file where the gap starts
    nbytes: int
    lines: int
    inode: int
    after_step: int  # the last good step before the gap (-1: none)
    after_t: float
    sample: str = ""  # first bytes of the bad data, for a human


class TailResult(msgspec.Struct, kw_only=True):
    records: list  # list[SpoolRecord]
    raw: list  # the encoded line of each record (bytes), same order: shipped without re-encoding
    position: TailPosition
    gaps: list  # list[SpoolGap]
    eof: bool  # True when everything complete in the file was consumed


def tail(path: str | os.PathLike, position: TailPosition | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> TailResult:
    """Read the complete lines appended to ``path`` since ``position``.

    Pure with respect to ``position``: the input is never modified, a new one is
    returned. A missing file yields nothing (the rank has not started yet).
    """
    pos = msgspec.structs.replace(position) if position is not None else TailPosition()
    gaps: list[SpoolGap] = []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return TailResult(records=[], raw=[], position=pos, gaps=gaps, eof=True)
    with f:
        st = os.fstat(f.fileno())
        if pos.inode and (st.st_ino != pos.inode or st.st_size < pos.offset):
            # A new file under the same name (rotated) or the old one truncated.
            gaps.append(SpoolGap(reason="reset", offset=pos.offset, nbytes=0, lines=0, inode=pos.inode,
                                 after_step=pos.last_step, after_t=pos.last_t,
                                 sample=f"inode {pos.inode}->{st.st_ino}, size {st.st_size} < offset {pos.offset}"
                                 if st.st_size < pos.offset else f"inode {pos.inode}->{st.st_ino}"))
            pos = TailPosition(inode=st.st_ino, resets=pos.resets + 1, garbage_lines=pos.garbage_lines,
                               last_step=pos.last_step, last_t=pos.last_t, node=pos.node)
        pos.inode = st.st_ino
        if st.st_size <= pos.offset:
            return TailResult(records=[], raw=[], position=pos, gaps=gaps, eof=True)
        f.seek(pos.offset)
        data = f.read(max_bytes)
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) < max_bytes and pos.offset + len(data) >= st.st_size:
                # Only a partial line so far: leave it for the writer to finish.
                return TailResult(records=[], raw=[], position=pos, gaps=gaps, eof=True)
            # No newline in a full read: look further, up to MAX_LINE_BYTES.
            more = f.read(MAX_LINE_BYTES - len(data))
            nl = more.find(b"\n")
            if nl < 0 and len(data) + len(more) < MAX_LINE_BYTES:
                return TailResult(records=[], raw=[], position=pos, gaps=gaps, eof=True)
            if nl < 0:
                gap_len = len(data) + len(more)
            else:
                gap_len = len(data) + nl + 1
            gaps.append(SpoolGap(reason="oversized_line", offset=pos.offset, nbytes=gap_len, lines=1, inode=pos.inode,
                                 after_step=pos.last_step, after_t=pos.last_t, sample=data[:80].decode("utf-8", "replace")))
            pos.offset += gap_len
            pos.garbage_lines += 1
            return TailResult(records=[], raw=[], position=pos, gaps=gaps, eof=False)

        chunk = data[: end + 1]
        records: list[SpoolRecord] = []
        raw: list[bytes] = []
        line_start = 0
        bad: SpoolGap | None = None  # consecutive garbage lines merge into one gap
        for line in chunk.split(b"\n")[:-1]:
            line_off = pos.offset + line_start
            line_start += len(line) + 1
            stripped = line.strip()
            if not stripped:
                continue  # blank lines are harmless padding, not garbage
            try:
                rec = decode_spool_line(stripped)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pos.garbage_lines += 1
                if bad is not None and bad.offset + bad.nbytes == line_off:
                    bad.nbytes += len(line) + 1
                    bad.lines += 1
                else:
                    bad = SpoolGap(reason="garbage", offset=line_off, nbytes=len(line) + 1, lines=1, inode=pos.inode,
                                   after_step=pos.last_step, after_t=pos.last_t,
                                   sample=stripped[:80].decode("utf-8", "replace"))
                    gaps.append(bad)
                continue
            records.append(rec)
            raw.append(stripped)
            pos.last_step = rec.step
            t = getattr(rec, "t_end", None) or getattr(rec, "t", None) or getattr(rec, "t_arrive", None)
            if t is not None:
                pos.last_t = t
            node = getattr(rec, "node", None)
            if node is not None:
                pos.node = node
        pos.offset += len(chunk)
        pos.records += len(records)
        eof = pos.offset >= st.st_size or (len(data) < max_bytes and end == len(data) - 1)
        return TailResult(records=records, raw=raw, position=pos, gaps=gaps, eof=eof)


def spool_ranks(spool_dir: str | os.PathLike) -> list[int]:
    """Ranks that have a spool file (``rank-<R>.jsonl``) in ``spool_dir``."""
    out = []
    try:
        names = os.listdir(spool_dir)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("rank-") and name.endswith(".jsonl"):
            try:
                out.append(int(name[5:-6]))
            except ValueError:
                continue
    return sorted(out)


def first_node(path: str | os.PathLike) -> int | None:
    """The node named by the first step record of a spool (before a manifest exists)."""
    try:
        with open(Path(path), "rb") as f:
            for _ in range(64):
                line = f.readline()
                if not line.endswith(b"\n"):
                    return None
                try:
                    rec = decode_spool_line(line.strip())
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                node = getattr(rec, "node", None)
                if node is not None:
                    return node
    except FileNotFoundError:
        return None
    return None
