"""The agent's bounded disk buffer for shipments the head has not acknowledged.

When the head is unreachable, each cycle's shipment (spool records, GPU/host
samples, control acks) is written here as one segment file and the tail
positions move on, so nothing the agent sampled in memory is lost while the
head is down. Segments are shipped oldest first and deleted only after the
head acknowledged them (a crash in between re-ships them; the head dedupes).

Bounded: over ``max_bytes`` the oldest segments are dropped, and the records
they held are counted (``dropped_records``), never silently lost.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from ranksight.layout import atomic_write

log = logging.getLogger("ranksight.agent.outbox")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class Item(msgspec.Struct, array_like=True):
    """One OTLP log record to be: kind + body + the attributes that describe it.

    ``layout``: None for a JSON body; the packed-v1 layout when the body is packed records
    (ranksight.wire.pack_records). New fields go at the end with a default: segments written by
    an older agent still decode."""

    kind: str
    body: bytes
    rank: int | None = None
    count: int = 0
    step_min: int | None = None
    step_max: int | None = None
    t_first: float = 0.0  # wall time of the oldest record inside (for the lag metric)
    layout: str | None = None


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[Item])


class Outbox:
    def __init__(self, directory: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.dropped_records = 0
        self._segs: list[Path] | None = None
        for p in self.dir.glob(".*.tmp.*"):  # a crash mid-write leaves only a temp file
            p.unlink(missing_ok=True)

    def _segments(self) -> list[Path]:
        # One agent owns its outbox directory: the listing is read once and then kept up to date by
        # append/remove/drop here (the agent asks for it several times per cycle).
        if self._segs is None:
            self._segs = sorted(p for p in self.dir.iterdir() if p.name.startswith("seg-") and p.name.endswith(".msgpack"))
        return list(self._segs)

    @staticmethod
    def _count(p: Path) -> int:
        try:
            return int(p.name.split("-")[2].split(".")[0])
        except (IndexError, ValueError):
            return 0

    def records(self) -> int:
        return sum(self._count(p) for p in self._segments())

    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self._segments())

    def oldest_t(self) -> float | None:
        segs = self._segments()
        if not segs:
            return None
        items = self.read(segs[0])
        ts = [i.t_first for i in items if i.t_first]
        return min(ts) if ts else None

    def __len__(self) -> int:
        return len(self._segments())

    def append(self, items: list[Item]) -> Path:
        segs = self._segments()
        seq = int(segs[-1].name.split("-")[1]) + 1 if segs else 1
        count = sum(i.count for i in items)
        path = self.dir / f"seg-{seq:012d}-{count}.msgpack"
        atomic_write(path, _enc.encode(items))
        self._segs = None
        self._enforce_bound()
        return path

    def _enforce_bound(self) -> None:
        segs = self._segments()
        total = sum(p.stat().st_size for p in segs)
        while segs and total > self.max_bytes:
            p = segs.pop(0)
            n = self._count(p)
            total -= p.stat().st_size
            p.unlink(missing_ok=True)
            self._segs = None
            self.dropped_records += n
            log.error("agent outbox over %d bytes: dropped the oldest segment (%d records)", self.max_bytes, n)

    def oldest(self) -> Path | None:
        segs = self._segments()
        return segs[0] if segs else None

    def read(self, path: Path) -> list[Item]:
        try:
            return _dec.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            # Unreadable segment (disk damage): count it as dropped, never loop on it.
            log.error("agent outbox: unreadable segment %s dropped: %s", path, e)
            self.dropped_records += self._count(path)
            path.unlink(missing_ok=True)
            self._segs = None
            return []

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self._segs = None
