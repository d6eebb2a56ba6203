"""Reading raw Kineto/Chrome trace events for the merged trace (``traces.perfetto``): one file's events in chunks.

The bytes are read by ``probes.trace_events`` (the reader the agent's summarizer and ``traces.load`` share: plain or
gzip, torn streams and cut files ended with a note, chunks of complete events cut where they decode) and each chunk
decoded by a typed msgspec decoder that keeps only the fields Perfetto reads (``Event``; args pass through as raw
JSON); an event whose fields have other types is dropped and counted. So memory holds one chunk, never a whole
rank. ``trace_meta`` reads a file's rank and clock base from its head and tail
without reading its events.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

import msgspec
from msgspec import Raw

from probes.trace_events import CHUNK, READ, RAW_LIST, TraceEvents, base_time_ns, read_blocks

_TAIL = 256 << 10  # bytes of the file's end searched for baseTimeNanoseconds / distributedInfo
_EVENTS_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
# distributedInfo's own "rank" (its pg_config entries say "ranks"), wherever it comes among its keys.
_DIST_RANK_RE = re.compile(rb'"distributedInfo"\s*:\s*\{.{0,65536}?"rank"\s*:\s*(-?\d+)', re.S)


class Event(msgspec.Struct, omit_defaults=True):
    """The fields Perfetto reads; decoded from and encoded to the same shape. Raw fields pass through untouched."""

    ph: str = ""
    name: str = ""
    cat: str = ""
    ts: float | None = None
    dur: Raw = Raw()
    pid: int | str = 0
    tid: Raw = Raw()
    s: Raw = Raw()
    id: int | str | None = None
    bp: Raw = Raw()
    args: Raw = Raw()


_DECODE_EVENTS = msgspec.json.Decoder(list[Event])
_DECODE_EVENT = msgspec.json.Decoder(Event)


def _head_and_tail(path: str) -> tuple[bytes, bytes]:
    """The first bytes (``READ``) and the last ``_TAIL`` bytes, decompressed."""
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
        if not gz:
            f.seek(0)
            head = f.read(READ)
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - _TAIL))
            return head, f.read()
    head = b""
    tail = b""
    for block in read_blocks(path, {}):
        if len(head) < READ:
            head += block
        tail = (tail + block)[-_TAIL:]
    return head, tail


def trace_meta(path: str) -> tuple[int | None, int | None]:
    """(rank from distributedInfo, baseTimeNanoseconds) from the file's head and tail, without reading events."""
    head, tail = _head_and_tail(path)
    m = _EVENTS_RE.search(head)
    pre = head[: m.start()] if m else head[:4096]
    rank = base = None
    for part in (pre, tail):
        d = _DIST_RANK_RE.search(part)
        if rank is None and d:
            rank = int(d.group(1))
        if base is None:
            base = base_time_ns(part)
    return rank, base


class EventChunks:
    """Chunks of decoded events of one file, in order; ``truncated``/``note`` say how the file ended, ``skipped``
    counts the events whose fields have other types than ``Event``'s (dropped)."""

    def __init__(self, path: str, chunk: int = CHUNK):
        self.path = path
        self.chunk = chunk
        self.truncated = False
        self.note = ""
        self.offset = 0  # bytes of event text consumed
        self.skipped = 0

    def _decode(self, doc: bytes) -> list[Event]:
        try:
            return _DECODE_EVENTS.decode(doc)
        except (msgspec.ValidationError, UnicodeDecodeError):
            out = []
            for raw in RAW_LIST.decode(doc):  # not JSON here: raises, and the reader tries another cut point
                try:
                    out.append(_DECODE_EVENT.decode(raw))
                except (msgspec.DecodeError, UnicodeDecodeError):
                    self.skipped += 1
            return out

    def __iter__(self) -> Iterator[list[Event]]:
        reader = TraceEvents(self.path, self.chunk)
        try:
            yield from reader.chunks(self._decode)
        finally:
            self.offset = reader.offset
            notes = list(reader.notes)
            if self.skipped:
                notes.append("%d event(s) with fields of unexpected types dropped" % self.skipped)
            self.truncated = reader.truncated
            self.note = "; ".join(notes)
