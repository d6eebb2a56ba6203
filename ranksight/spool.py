"""A rank's spool (``RunDir.spool(rank)``): the one file format between a training rank and ranksight.

One JSON object per line (``ranksight.schema`` step, collective and event records), appended by the
rank that owns the file and by nobody else. Here are the one writer and the two readers:

- ``SpoolWriter``: the rank's side. Records are batched and written with one ``os.write`` per flush
  on an ``O_APPEND`` descriptor, so a reader never sees half a line and the rank never waits.
- ``tail``: the node agent's side. The bytes appended since a saved position become decoded
  records, and the position to save *after* those records are safe somewhere else (the agent saves
  it once the head acknowledged them).
- ``read_spool``: a whole file at once (``diagnose`` on a run that had no agents).

What the readers must survive, and how:

- **Partial last line**: a rank may be mid-``write`` when we read. Only bytes up
  to the last newline are consumed; the tail waits for the next read. ``read_spool``
  counts a cut-short last line as truncated (a rank killed mid-write), not as garbage.
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

# ---------------------------------------------------------------------------
# Writing (the training rank)
# ---------------------------------------------------------------------------

# ``ranksight.schema.encode``'s encoder settings (msgspec's defaults): ``encode_lines`` gives exactly the bytes of
# ``b"".join(encode(r) + b"\n" for r in recs)`` in one call, without a bytes object per record and a join.
_lines_encoder = msgspec.json.Encoder()


class SpoolWriter:
    """Append-only JSON-lines file, one ``os.write`` per flush (line-atomic, O_APPEND)."""

    def __init__(self, path: os.PathLike):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pending: list[msgspec.Struct] = []

    def add(self, rec: msgspec.Struct) -> None:
        self.pending.append(rec)

    def flush(self) -> None:
        if self.pending:
            data = _lines_encoder.encode_lines(self.pending)
            self.pending.clear()
            os.write(self.fd, data)

    def write_now(self, rec: msgspec.Struct) -> None:
        self.add(rec)
        self.flush()


class NullSpool:
    """A spool that writes nothing (instrumentation off)."""

    def add(self, rec) -> None:
        pass

    def flush(self) -> None:
        pass

    def write_now(self, rec) -> None:
        pass


# ---------------------------------------------------------------------------
# Reading (the node agent: ``tail``; post-mortem: ``read_spool``)
# ---------------------------------------------------------------------------

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
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
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
                except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
                    continue
                node = getattr(rec, "node", None)
                if node is not None:
                    return node
    except FileNotFoundError:
        return None
    return None


class SpoolContents(msgspec.Struct, kw_only=True):
    """A whole spool file, decoded."""

    records: list[SpoolRecord]
    truncated: int  # a last line without its newline that does not decode: a write cut short (tolerated)
    bad: int  # undecodable lines elsewhere (skipped)
    nbytes: int


def read_spool(path: str | os.PathLike) -> SpoolContents:
    """Every record of one spool file, and the count of truncated trailing lines and of bad lines elsewhere."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    records, truncated, bad = [], 0, 0
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(decode_spool_line(line))
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            # The final line without its newline is a write cut short; anything else is garbage.
            if i == last:
                truncated += 1
            else:
                bad += 1
    return SpoolContents(records=records, truncated=truncated, bad=bad, nbytes=len(data))
