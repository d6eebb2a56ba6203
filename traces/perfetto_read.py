"""Reading raw Kineto/Chrome trace events for the merged trace (``traces.perfetto``): one file's events in chunks.

A plain or gzipped file (a torn gzip stream ends the events with a note, concatenated members are read on) is cut
into chunks of complete events at ``},{`` boundaries and each chunk decoded by a typed msgspec decoder that keeps
only the fields Perfetto reads (``Event``; args pass through as raw JSON). A wrong split point fails to decode and
the next one is tried; a chunk no split point decodes is where the file is judged corrupt, and it ends there. So
memory holds one chunk, never a whole rank. ``trace_meta`` reads a file's rank and clock base from its head and tail
without reading its events.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Iterator

import msgspec
from msgspec import Raw

_READ = 1 << 20
CHUNK = 4 << 20  # bytes of events decoded at once
_SLACK = 64 << 10  # bytes buffered past the chunk size before a split is looked for
_MAX_TRIES = 16  # split points tried before a chunk is judged corrupt (a wrong split fails to decode)
_HEAD_MAX = 64 << 20  # bytes read looking for "traceEvents" before the input is judged not a trace
_TAIL = 256 << 10  # bytes of the file's end searched for baseTimeNanoseconds / distributedInfo
_EVENTS_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
_SPLIT_RE = re.compile(rb"\}\s*,\s*\{")
_BASE_RE = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')
# distributedInfo's own "rank" (its pg_config entries say "ranks"), wherever it comes among its keys.
_DIST_RANK_RE = re.compile(rb'"distributedInfo"\s*:\s*\{.{0,65536}?"rank"\s*:\s*(-?\d+)', re.S)
_WS = frozenset(b" \t\r\n")


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

# ----------------------------------------------------------------------------------------------------------------
# Reading: bytes of a plain or gzipped file, torn gzip tolerated
# ----------------------------------------------------------------------------------------------------------------


def _is_gz(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _read_blocks(path: str, state: dict) -> Iterator[bytes]:
    """Decompressed blocks of the file; a torn gzip stream ends the blocks and sets ``state["torn"]``."""
    gz = _is_gz(path)
    with open(path, "rb") as f:
        if not gz:
            while block := f.read(_READ):
                yield block
            return
        d = zlib.decompressobj(wbits=47)
        while True:
            raw = f.read(_READ)
            if not raw:
                if not d.eof:
                    state["torn"] = True
                return
            try:
                out = d.decompress(raw)
            except zlib.error:
                state["torn"] = True
                return
            if out:
                yield out
            while d.eof and d.unused_data:  # concatenated gzip members
                rest = d.unused_data
                d = zlib.decompressobj(wbits=47)
                try:
                    out = d.decompress(rest)
                except zlib.error:
                    state["torn"] = True
                    return
                if out:
                    yield out


def _head_and_tail(path: str) -> tuple[bytes, bytes]:
    """The first bytes up to the events array (or ``_HEAD_MAX``) and the last ``_TAIL`` bytes, decompressed."""
    head = b""
    tail = b""
    state: dict = {}
    if not _is_gz(path):
        with open(path, "rb") as f:
            head = f.read(_READ)
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - _TAIL))
            tail = f.read()
        return head, tail
    for block in _read_blocks(path, state):
        if len(head) < _READ:
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
        b = _BASE_RE.search(part)
        if base is None and b:
            base = int(b.group(1))
    return rank, base


class EventChunks:
    """Chunks of decoded events of one file, in order; ``truncated``/``note`` say how the file ended."""

    def __init__(self, path: str, chunk: int = CHUNK):
        self.path = path
        self.chunk = chunk
        self.truncated = False
        self.note = ""
        self.offset = 0  # bytes of event text consumed

    def __iter__(self) -> Iterator[list[Event]]:
        state: dict = {}
        blocks = _read_blocks(self.path, state)
        buf = b""
        eof = False
        # The events array: after "traceEvents": [ (object form), or the file's first [ (bare array form).
        while True:
            m = _EVENTS_RE.search(buf)
            if m:
                buf = buf[m.end():]
                break
            stripped = buf.lstrip()
            if stripped[:1] == b"[":
                buf = stripped[1:]
                break
            if stripped[:1] not in (b"", b"{"):
                self._end(True, "not a JSON trace (starts with neither { nor [)")
                return
            if len(buf) > _HEAD_MAX:
                self._end(True, "no traceEvents array in the first %d MB" % (_HEAD_MAX >> 20))
                return
            block = next(blocks, None)
            if block is None:
                self._end(True, "no traceEvents array: not a trace, or cut before its events")
                return
            buf += block
        buf = buf.lstrip()
        tries = 0
        pos = self.chunk  # a split is looked for past this many bytes: chunks of about that size
        search_from = pos
        while True:
            if not eof and len(buf) < pos + _SLACK:
                block = next(blocks, None)
                if block is None:
                    eof = True
                else:
                    buf += block
                continue
            if eof:
                yield from self._last(buf, state.get("torn", False))
                return
            m = _SPLIT_RE.search(buf, search_from)
            if m is None:  # no split in what is buffered: read on
                search_from = max(search_from, len(buf) - 64)
                block = next(blocks, None)
                if block is None:
                    eof = True
                else:
                    buf += block
                continue
            try:
                events = _DECODE_EVENTS.decode(b"[" + buf[: m.start() + 1] + b"]")
            except msgspec.DecodeError:
                # The split was inside a string or a nested value (or the data is corrupt): try the next one.
                tries += 1
                if tries > _MAX_TRIES:
                    self._end(True, "unreadable events after byte %d of the events array: merged up to there"
                              % self.offset)
                    return
                search_from = m.end()
                continue
            tries = 0
            self.offset += m.end() - 1
            buf = buf[m.end() - 1:]
            search_from = pos
            yield events

    def _last(self, buf: bytes, torn: bool) -> Iterator[list[Event]]:
        """The end of the array: its last events and the closing ``]``; or, cut short, its complete events.

        All but the last event are decoded as a chunk (the longest prefix ending at a split that decodes: splits
        in a trailer after the array fail); the rest, one event and the trailer, is small, so trying each ``]``
        that follows a ``}`` there is cheap.
        """
        how = "torn gzip stream" if torn else "cut short (no closing ']')"
        splits = [m for m in _SPLIT_RE.finditer(buf)]
        rest = buf
        for m in reversed(splits[-_MAX_TRIES * 4:]):
            try:
                events = _DECODE_EVENTS.decode(b"[" + buf[: m.start() + 1] + b"]")
            except msgspec.DecodeError:
                continue
            self.offset += m.end() - 1
            rest = buf[m.end() - 1:]
            yield events
            break
        for m in re.finditer(rb"\]", rest):
            b = m.start() - 1
            while b >= 0 and rest[b] in _WS:
                b -= 1
            a = m.end()
            while a < len(rest) and rest[a] in _WS:
                a += 1
            if (b >= 0 and rest[b] != 0x7D) or (a < len(rest) and rest[a] not in (0x2C, 0x7D)):  # } , }
                continue
            try:
                events = _DECODE_EVENTS.decode(b"[" + rest[: b + 1] + b"]")
            except msgspec.DecodeError:
                continue
            if torn:
                self._end(True, "gzip stream torn after the events array")
            yield events
            return
        # No closing bracket: the file was cut. Its last event counts if it is whole.
        body = rest.rstrip().rstrip(b",").rstrip()
        if body.endswith(b"}"):
            try:
                events = _DECODE_EVENTS.decode(b"[" + body + b"]")
            except msgspec.DecodeError:
                pass
            else:
                self.offset += len(body)
                self._end(True, "%s: merged its complete events, up to byte %d of the events array"
                          % (how, self.offset))
                yield events
                return
        self._end(True, "%s: merged its complete events, up to byte %d of the events array" % (how, self.offset))

    def _end(self, truncated: bool, note: str) -> None:
        self.truncated = truncated
        self.note = note
