"""One reader of Kineto / Chrome trace files for every consumer: the events array in chunks of complete events.

The agent's per-rank summary (``probes.profiler``), ``ranksight trace`` (``traces.load``) and the merged Perfetto
trace (``traces.perfetto_read``) all read the same format; each decodes the chunks with its own typed msgspec
decoder of only the fields it uses, so what is shared here is the byte level:

- **opening**: plain or gzip, told by the magic bytes whatever the name; concatenated gzip members are read on; a
  torn gzip stream (a copy in progress, a crashed writer) ends the bytes with a note.
- **the events array**: after ``"traceEvents": [`` (the object form Kineto writes) or the file's first ``[`` (the
  bare-array form, whose closing ``]`` the format makes optional). The bytes before it are ``header`` and the bytes
  after its ``]`` are ``trailer``: Kineto writes ``distributedInfo`` before the events and ``baseTimeNanoseconds``
  after them (:func:`json_object_after`, :func:`base_time_ns`).
- **chunks**: about ``chunk`` bytes of events, cut at a ``}`` ``,`` ``{`` between two events and handed to the
  consumer's ``decode`` as one JSON array. A cut inside a string or a nested value leaves a prefix that is not
  JSON (msgspec says "truncated", or fails at the appended ``]``), so the next cut point is tried; an error before
  the end is data that is not JSON, and the events before it are kept (found event by event) and reading stops
  there, with a note; "trailing characters" is the array's own ``]``.

``decode(doc)`` must return the decoded chunk or raise ``msgspec.DecodeError`` (or ``UnicodeDecodeError``) when
``doc`` is not a JSON array: a consumer whose typed decoder rejects valid JSON (``msgspec.ValidationError``)
decodes it loosely itself (:data:`RAW_LIST` gives the events one by one, undecoded).
"""

from __future__ import annotations

import re
import zlib
from typing import Callable, Iterator, TypeVar

import msgspec

T = TypeVar("T")

READ = 1 << 20  # bytes read (or decompressed from) the file at a time
CHUNK = 4 << 20  # bytes of events handed to decode at once
HEAD_MAX = 64 << 20  # bytes read looking for the events array before the input is judged not a trace
TRAILER_MAX = 16 << 20  # bytes kept after the events array
_WRONG_CUTS = 16  # wrong cut points tried at a chunk's end before the chunk is read event by event

_EVENTS_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
_SPLIT_RE = re.compile(rb"\}\s*,\s*\{")
_BYTE_RE = re.compile(r"\(byte (\d+)\)")
_BASE_RE = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')

RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])  # a valid array's elements, undecoded (for loose decoding)
_ANY = msgspec.json.Decoder()


def read_blocks(path: str, state: dict) -> Iterator[bytes]:
    """The file's bytes, decompressed when it is gzip (by its magic bytes). Raises OSError when it cannot be
    opened; a torn or corrupt gzip stream ends the blocks and sets ``state["torn"]`` to what went wrong."""
    with open(path, "rb") as f:
        first = f.read(READ)
        if first[:2] != b"\x1f\x8b":
            block = first
            while block:
                yield block
                block = f.read(READ)
            return
        d = zlib.decompressobj(wbits=47)
        raw = first
        while True:
            if not raw:
                if not d.eof:
                    state["torn"] = "the gzip stream ends early"
                return
            try:
                out = d.decompress(raw)
                while d.eof and d.unused_data:  # concatenated gzip members
                    if out:
                        yield out
                    rest = d.unused_data
                    d = zlib.decompressobj(wbits=47)
                    out = d.decompress(rest)
            except zlib.error as e:
                state["torn"] = f"zlib: {e}"
                return
            if out:
                yield out
            raw = f.read(READ)


def _error_byte(e: Exception) -> int | None:
    """Index of the character msgspec's error is at (its message counts from 1), None when it names none."""
    m = _BYTE_RE.search(str(e))
    return max(0, int(m.group(1)) - 1) if m else None


class TraceEvents:
    """One trace file's events, in chunks decoded by the caller's ``decode``: ``for evs in TraceEvents(p).chunks(
    decode)``. After the loop: ``form`` (``"object"``, ``"array"``, or None when no events array was found),
    ``header``, ``trailer``, ``closed`` (the array's ``]`` was read), ``truncated`` and ``notes`` (how the file
    ended when it did not end well), ``offset`` (bytes of the events array read)."""

    def __init__(self, path: str, chunk: int = CHUNK):
        self.path = path
        self.chunk = max(1, chunk)
        self.form: str | None = None
        self.header = b""
        self.trailer = b""
        self.closed = False
        self.truncated = False
        self.notes: list[str] = []
        self.offset = 0

    # -- the stream --------------------------------------------------------------------------------------------

    def chunks(self, decode: Callable[[bytes], T]) -> Iterator[T]:
        state: dict = {}
        blocks = read_blocks(self.path, state)
        buf = self._find_array(blocks)
        if buf is None:
            self._stop(state)
            return
        base = 0  # buf[base:] is still to be decoded (kept, not sliced, so small chunks do not copy big buffers)
        search_from = 0
        wrong = 0
        eof = False
        while True:
            if not eof and len(buf) - base < self.chunk + min(READ, self.chunk):
                # read up to a chunk and a bit more at once: one copy of the bytes left, not one per block
                parts = [buf[base:]]
                size = len(parts[0])
                while size < self.chunk + min(READ, self.chunk):
                    block = next(blocks, None)
                    if block is None:
                        eof = True
                        break
                    parts.append(block)
                    size += len(block)
                buf = b"".join(parts)
                search_from = max(0, search_from - base)
                base = 0
                continue
            if eof:
                yield from self._last(buf[base:], decode, blocks)
                self._stop(state)
                return
            m = _SPLIT_RE.search(buf, max(search_from, base + self.chunk))
            if m is None:  # no cut point in what is buffered: read on
                search_from = max(search_from, len(buf) - 64)
                block = next(blocks, None)
                if block is None:
                    eof = True
                else:
                    buf = buf[base:] + block
                    search_from = max(0, search_from - base)
                    base = 0
                continue
            doc = b"".join((b"[", memoryview(buf)[base: m.start() + 1], b"]"))
            try:
                evs = decode(doc)
            except (msgspec.DecodeError, UnicodeDecodeError) as e:
                at = _error_byte(e)
                msg = str(e)
                if isinstance(e, msgspec.DecodeError) and (at is None and "truncated" in msg
                                                           or at is not None and at >= len(doc) - 1):
                    # a cut inside a string or a nested value: try the next cut point
                    search_from = m.end()
                    wrong += 1
                    if wrong <= _WRONG_CUTS:
                        continue
                    # many cut points inside values: find the last event's end one event at a time
                    good = _whole_events_end(doc, len(doc))
                    if good <= 1:
                        continue
                    doc = doc[:good] + b"]"
                    try:
                        evs = decode(doc)
                    except (msgspec.DecodeError, UnicodeDecodeError):
                        yield from self._salvage(doc, None, decode)
                        self._stop(state)
                        return
                    cut_end = base + good - 1  # buf index just past the last whole event's "}"
                    nxt = buf.find(b"{", cut_end)
                    self.offset += nxt - base
                    base = nxt
                    wrong = 0
                    search_from = 0
                    yield evs
                    continue
                if at is not None and "trailing characters" in msg:
                    # the array's "]" is inside this piece: the rest of the buffer is the trailer's start
                    yield from self._closed_at(doc[:-1], at, decode, blocks, buf[m.start() + 1:])
                else:
                    yield from self._salvage(doc, at, decode)
                self._stop(state)
                return
            wrong = 0
            search_from = 0
            self.offset += m.end() - 1 - base
            base = m.end() - 1
            yield evs

    def _find_array(self, blocks: Iterator[bytes]) -> bytes | None:
        """Reads up to the events array; returns the bytes after its ``[`` (None: not a trace)."""
        head = b""
        looked = 0
        while True:
            s = head.lstrip()
            if s[:1] == b"[":  # the bare-array form
                self.form = "array"
                return s[1:].lstrip()
            if s[:1] not in (b"", b"{"):
                self._note("not a JSON trace (starts with neither { nor [)")
                return None
            m = _EVENTS_RE.search(head, max(0, looked - 64))
            if m is not None:
                self.form = "object"
                self.header = head[: m.start()]
                return head[m.end():].lstrip()
            looked = len(head)
            if looked > HEAD_MAX:
                self._note("no traceEvents array in the first %d MB" % (HEAD_MAX >> 20))
                return None
            block = next(blocks, None)
            if block is None:
                self._note("no traceEvents array: not a trace, or cut before its events" if head.strip()
                           else "an empty file")
                return None
            head += block

    def _last(self, buf: bytes, decode: Callable[[bytes], T], blocks: Iterator[bytes]) -> Iterator[T]:
        """The end of the stream: the last events and the closing ``]`` (then the trailer), or a cut."""
        doc = b"[" + buf
        try:
            evs = decode(doc)  # a bare array closed at the file's end
            self.closed = True
            self.offset += len(buf)
            yield evs
            return
        except (msgspec.DecodeError, UnicodeDecodeError) as e:
            at = _error_byte(e)
            if at is not None and isinstance(e, msgspec.DecodeError) and "trailing characters" in str(e):
                yield from self._closed_at(doc, at, decode, blocks, b"")
                return
            if at is not None and at < len(doc) - 1 and isinstance(e, msgspec.DecodeError):
                yield from self._salvage(doc + b"]", at, decode)
                return
        # No closing bracket: the stream was cut, or a bare array left open (allowed). Its last event counts if whole.
        body = buf.rstrip()
        ends_at_event = body.endswith((b"}", b","))
        body = body.rstrip(b",").rstrip()
        if body.endswith(b"}"):
            doc = b"[" + body + b"]"
            try:
                evs = decode(doc)
            except (msgspec.DecodeError, UnicodeDecodeError):
                pass
            else:
                self.offset += len(body)
                if self.form == "array" and ends_at_event:
                    self._note("bare event array without its closing ']' (allowed by the trace format)",
                               truncated=False)
                else:
                    self._note("cut short (no closing ']'): read its complete events")
                yield evs
                return
        if not body:
            self._note("cut short (no closing ']')")
            return
        yield from self._salvage(b"[" + body + b"]", None, decode, cut=True)

    def _closed_at(self, doc: bytes, at: int, decode: Callable[[bytes], T], blocks: Iterator[bytes],
                   more: bytes) -> Iterator[T]:
        """``doc[:at]`` is the rest of the array, ``]`` included; the rest of ``doc``, ``more`` and the blocks left
        are the trailer."""
        try:
            evs = decode(doc[:at])
        except (msgspec.DecodeError, UnicodeDecodeError) as e:  # not expected: read what can be read
            yield from self._salvage(doc, _error_byte(e), decode)
            return
        self.closed = True
        self.offset += at - 1
        yield evs
        trailer = [doc[at:], more]
        size = len(doc) - at + len(more)
        for block in blocks:
            if size < TRAILER_MAX:
                trailer.append(block)
                size += len(block)
        self.trailer = b"".join(trailer)[:TRAILER_MAX]

    def _salvage(self, doc: bytes, at: int | None, decode: Callable[[bytes], T], cut: bool = False) -> Iterator[T]:
        """The complete events at the start of ``doc`` (``[`` + events, not JSON at byte ``at`` or at its end):
        their ends are found one event at a time (each piece from the last end found to the next cut point), then
        they are decoded together; reading stops there."""
        good = _whole_events_end(doc, len(doc) if at is None else at)
        if good:
            try:
                evs = decode(doc[:good] + b"]")
            except (msgspec.DecodeError, UnicodeDecodeError):
                good = 0
            else:
                self.offset += good - 1
                yield evs
        if cut:
            self._note("cut short inside an event: read up to its last complete event (byte %d of the events "
                       "array)" % self.offset)
        else:
            self._note("unreadable data after byte %d of the events array: read the events before it"
                       % self.offset)

    def _stop(self, state: dict) -> None:
        if state.get("torn"):
            self._note("stopped reading: torn gzip stream (%s)" % state["torn"])

    def _note(self, note: str, truncated: bool = True) -> None:
        self.notes.append(note)
        self.truncated = self.truncated or truncated


def _whole_events_end(doc: bytes, limit: int) -> int:
    """``doc`` is ``[`` + events: the end (past its ``}``) of the last whole event before ``limit`` that is followed
    by another (0: none), found one event at a time (each piece from the last end found to the next cut point)."""
    good = 0
    start = 1
    for m in _SPLIT_RE.finditer(doc, 1, limit):
        if m.start() < start:
            continue
        try:
            RAW_LIST.decode(b"[" + doc[start: m.start() + 1] + b"]")
        except (msgspec.DecodeError, UnicodeDecodeError):
            continue
        good = m.start() + 1
        start = m.end() - 1
    return good


def json_object_after(text: bytes, key: bytes) -> bytes | None:
    """The JSON object that follows ``"key":`` in ``text`` (braces counted outside strings, within 1 MB), or None
    (no such key, or its value is not an object)."""
    i = text.find(b'"' + key + b'"')
    if i < 0:
        return None
    j = text.find(b"{", i)
    if j < 0 or text[i + len(key) + 2:j].strip() != b":":
        return None
    depth = 0
    in_str = False
    esc = False
    for k in range(j, min(len(text), j + (1 << 20))):
        c = text[k]
        if in_str:
            if esc:
                esc = False
            elif c == 92:  # backslash
                esc = True
            elif c == 34:
                in_str = False
        elif c == 34:
            in_str = True
        elif c == 123:
            depth += 1
        elif c == 125:
            depth -= 1
            if depth == 0:
                return text[j:k + 1]
    return None


def distributed_info(header: bytes, trailer: bytes) -> dict:
    """The trace's ``distributedInfo`` object (Kineto writes it before the events; some writers after), or {}."""
    for text in (header, trailer):
        obj = json_object_after(text, b"distributedInfo") if text else None
        if obj is not None:
            try:
                d = _ANY.decode(obj)
            except (msgspec.DecodeError, UnicodeDecodeError):
                continue
            if isinstance(d, dict):
                return d
    return {}


def base_time_ns(*texts: bytes) -> int | None:
    """``baseTimeNanoseconds`` (Kineto writes it after the events), from the first text that has it."""
    for t in texts:
        m = _BASE_RE.search(t) if t else None
        if m:
            return int(m.group(1))
    return None


__all__ = ["TraceEvents", "read_blocks", "json_object_after", "distributed_info", "base_time_ns", "RAW_LIST",
           "CHUNK", "READ"]
