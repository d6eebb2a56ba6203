"""A run's write-ahead log: what the head acknowledged and has not written to Parquet yet.

Files: ``<run>/.head/wal-current.log`` (the generation being appended to) and ``wal-<ns>.log`` (older
generations, renamed at each flush and deleted once all their rows are in part files). Each is a
sequence of entries::

    <table> \\t <encoding> \\t <layout> \\t <payload length> \\n <payload> \\n

encoding ``json`` (payload: a JSON array of records, layout empty), ``packed-v1`` (payload: packed
records; layout ``@<id>``) or ``layout`` (defines id ``<layout>`` as the layout text in the payload,
for the rest of the file: the layout text is written once per file, not once per request). A torn
last entry (crash mid-write) was never acknowledged and is ignored. ``wal-*.jsonl`` files of older
heads (lines ``<table>\\t<JSON array>``) are replayed too.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import msgspec

from ranksight import wire
from ranksight.tables import SPECS, TABLE_TYPES

log = logging.getLogger("ranksight.store")

WAL_CURRENT = "wal-current.log"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)  # buffers one writev takes

_decoders = {name: msgspec.json.Decoder(list[typ]) for name, typ in TABLE_TYPES.items()}


def json_entry(table: str, payload: bytes) -> bytes:
    """A WAL entry holding ``payload``, a JSON array of ``table`` records."""
    return _entry(table, "json", "", payload)


def _entry(table: str, enc: str, layout: str, payload: bytes) -> bytes:
    return b"%s\t%s\t%s\t%d\n" % (table.encode(), enc.encode(), layout.encode(), len(payload)) + payload + b"\n"


def read_entries(path: Path) -> Iterator[tuple[str, str, str, bytes]]:
    """(table, encoding, layout text, payload) of every complete entry of one WAL file, layout ids resolved."""
    with open(path, "rb") as f:
        if path.name.endswith(".jsonl"):  # an older head's WAL
            for line in f:
                if not line.endswith(b"\n"):
                    return
                table, _, body = line.partition(b"\t")
                yield table.decode(errors="replace"), "json", "", body
            return
        layouts: dict[str, str] = {}
        while True:
            header = f.readline()
            if not header.endswith(b"\n"):
                return
            parts = header[:-1].split(b"\t")
            try:
                table, enc, layout, n = parts[0].decode(), parts[1].decode(), parts[2].decode(), int(parts[3])
            except (IndexError, ValueError, UnicodeDecodeError):
                log.error("store: unreadable WAL entry header in %s: rest of the file skipped", path)
                return
            payload = f.read(n)
            if len(payload) != n or f.read(1) != b"\n":
                return  # torn last write: it was never acknowledged
            if enc == "layout":  # defines layout id ``layout`` for the rest of this file
                layouts[layout] = payload.decode(errors="replace")
                continue
            if layout.startswith("@"):
                layout = layouts.get(layout[1:], "")
            yield table, enc, layout, payload


class LoggedBatch(NamedTuple):
    """One batch read back from a WAL file: decoded ``rows`` (a JSON entry), or packed records (``layout``,
    ``payload``, ``count``)."""

    table: str
    rows: list | None
    layout: wire.PackedLayout | None = None
    payload: bytes = b""
    count: int = 0


def read_batches(path: Path) -> Iterator[LoggedBatch]:
    """The batches of one WAL file; entries of unknown tables are skipped, unreadable ones logged and skipped."""
    for table, enc, layout, payload in read_entries(path):
        if table not in SPECS:
            continue
        if enc == "json":
            try:
                rows = _decoders[table].decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.error("store: unreadable WAL entry in %s skipped", path)
                continue
            yield LoggedBatch(table, rows)
        else:
            try:
                lay = wire.packed_layout_of(wire.KIND_OF_TABLE.get(table, ""), layout)
                n = wire.packed_count(lay, payload)
            except wire.WireError as e:
                log.error("store: unreadable WAL entry in %s skipped: %s", path, e)
                continue
            yield LoggedBatch(table, None, lay, payload, n)


class WalFull(OSError):
    """The write-ahead log could not take an entry (a full disk, an I/O error); nothing of it was kept."""


class WriteAheadLog:
    """One run's WAL files: the current generation (an ``O_APPEND`` descriptor: one ``write()`` per request), the
    packed layouts already defined in it, and the older generations whose rows are not all in Parquet yet."""

    def __init__(self, directory: Path, fsync: bool = False):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._fd: int | None = None
        self._layout_prefix: dict[tuple[str, wire.PackedLayout], bytes] = {}  # per file: (table, layout) -> header
        self._unflushed: list[Path] = []

    def leftover_files(self) -> list[Path]:
        """WAL files left by an earlier head, in the order their rows were logged (the current one last)."""
        return sorted(list(self.dir.glob("wal-*.jsonl")) + list(self.dir.glob("wal-*.log")),
                      key=lambda p: (p.name.startswith("wal-current"), p.name))

    def open(self) -> None:
        self._fd = os.open(self.dir / WAL_CURRENT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, data: bytes) -> None:
        """Durable when this returns: in the kernel's page cache (survives a kill -9 of the head), fsynced too
        with ``fsync``. Written whole or not at all: a short write (a full disk) is retried for the rest, and when
        the disk refuses, the file is cut back to where this entry began and ``WalFull`` is raised, so the head
        answers an error instead of acknowledging what it could not keep, and no torn entry hides the ones after it."""
        start = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no progress writing the write-ahead log")
                view = view[n:]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:
            self._refuse(start, "write", e)

    def _refuse(self, start: int, what: str, e: OSError) -> None:
        """Cut the file back to where the failed entry began (no torn entry hides the ones after it) and raise
        ``WalFull``."""
        try:
            os.ftruncate(self._fd, start)
        except OSError:
            log.error("store: could not cut the WAL back after a failed %s: a torn entry stays at %d", what, start)
        raise WalFull(f"cannot write the write-ahead log ({e.strerror or e}); nothing of this request was kept") from e

    def packed_parts(self, table: str, batches: list) -> list[bytes]:
        """The entries of packed batches (``ranksight.wire.PackedBatch``; a layout is defined once per file) as a
        list of buffers (headers and the bodies themselves, not copied) for ``append_parts``."""
        parts: list[bytes] = []
        for b in batches:
            pre = self._layout_prefix.get((table, b.layout))
            if pre is None:  # first use of this layout in this WAL generation: define it once
                lid = str(len(self._layout_prefix))
                parts.append(_entry(table, "layout", lid, b.layout.text.encode()))
                pre = self._layout_prefix[(table, b.layout)] = b"%s\t%s\t@%s\t" % (
                    table.encode(), b.layout.encoding.encode(), lid.encode())
            parts.append(b"%s%d\n" % (pre, len(b.payload)))
            parts.append(b.payload)
            parts.append(b"\n")
        return parts

    def append_entries(self, packed: list[tuple[str, list]], json_payloads: list[bytes] = ()) -> None:
        """One request's entries in one write: packed batches per table (``(table, [PackedBatch, ...])``) and JSON
        entries already made (``json_entry``). A layout first defined here is forgotten again if the write fails, so
        a later entry never names a layout id whose definition is not in the file."""
        known = set(self._layout_prefix)
        parts: list[bytes] = []
        for table, batches in packed:
            parts += self.packed_parts(table, batches)
        parts += json_payloads
        try:
            self.append_parts(parts)
        except BaseException:
            for k in set(self._layout_prefix) - known:
                del self._layout_prefix[k]
            raise

    def append_parts(self, parts: list[bytes]) -> None:
        """``append`` of the buffers ``parts`` one after another, in one ``writev`` (no joined copy of the
        request's bodies); the same guarantees: whole or not at all, ``WalFull`` when the disk refuses."""
        total = sum(len(p) for p in parts)
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            n = os.writev(self._fd, parts[:_IOV_MAX]) if parts else 0
        except OSError:
            n = -1  # the whole entry again through ``append``, which cuts the file back and raises WalFull
        if n == total:
            if self.fsync:
                try:
                    os.fsync(self._fd)
                except OSError as e:
                    self._refuse(start, "fsync", e)
            return
        # a short write (a full disk, more buffers than one writev takes): the rest through ``append``, from where
        # this entry began, so the file holds it whole or not at all
        if n > 0:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                log.error("store: could not cut the WAL back after a short write: a torn entry stays at %d", start)
        self.append(b"".join(parts))

    def holds_entries(self) -> bool:
        """Whether the current generation has anything in it."""
        return self._fd is not None and os.fstat(self._fd).st_size > 0

    def rotate(self) -> None:
        """Start a new generation; the old one is kept until ``release`` (its rows are about to be written to
        Parquet). Nothing to rotate before ``open``."""
        if self._fd is None:
            return
        os.close(self._fd)
        old = self.dir / f"wal-{time.time_ns()}.log"
        os.replace(self.dir / WAL_CURRENT, old)
        self.open()
        self._layout_prefix = {}  # layout ids are per WAL file
        self._unflushed.append(old)

    def retain(self, files: list[Path]) -> None:
        """Keep ``files`` (replayed ones whose rows could not be written to Parquet yet) until ``release``."""
        self._unflushed.extend(files)

    def release(self) -> None:
        """Every logged row is in a part file: delete the older generations."""
        for w in self._unflushed:
            w.unlink(missing_ok=True)
        self._unflushed = []

    def close(self) -> None:
        """Close the current generation and delete the empty WAL files (nothing left to replay in them)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for w in list(self.dir.glob("wal-*.log")) + list(self.dir.glob("wal-*.jsonl")):
            if w.stat().st_size == 0:
                w.unlink(missing_ok=True)
