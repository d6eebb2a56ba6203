"""The records the head refused, kept aside by the agent: ``<run>/agent/node-<N>.rejected.jsonl``.

The head refuses a record it cannot take (one of another run, one that does not decode, a batch it cannot store)
and says which in its OTLP partial success (``ranksight.wire_rejections.rejections_message``). Such a record would be refused
again: the agent never retries it, and it is not lost either. Each one becomes a line here::

    {"t": <when>, "kind": "step", "rank": 0, "why": "<the head's reason>", "raw": "<the record's JSON, byte for byte>"}

(``raw_b64`` and ``layout`` instead of ``raw`` for a packed body; ``records`` when a line holds more than one record:
a body that is not a JSON array). Bounded: past ``max_bytes`` no line is written and the records are counted in
``not_kept`` (as are rejections a head did not itemize), so the file cannot fill the disk and nothing is lost
unannounced.
"""

from __future__ import annotations

import base64
import logging
import os
import time
from pathlib import Path

import msgspec

from node.outbox import Item
from ranksight import wire_rejections

log = logging.getLogger("ranksight.agent")

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

_raw_array = msgspec.json.Decoder(list[msgspec.Raw])
_enc = msgspec.json.Encoder()


class RejectedLine(msgspec.Struct, omit_defaults=True):
    t: float
    kind: str
    why: str
    rank: int | None = None
    raw: str | None = None  # the record as shipped (JSON text)
    raw_b64: str | None = None  # a packed body, base64
    layout: str | None = None  # its packed layout
    records: int = 1


class RejectedLog:
    """The rejected-records file of one agent; ``kept`` / ``not_kept`` count records since the agent started."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.kept = 0  # records written to the file
        self.not_kept = 0  # records refused but not written (file at its bound, or the head did not say which)

    @property
    def total(self) -> int:
        """Every record the head refused."""
        return self.kept + self.not_kept

    def keep(self, item: Item, rejection: wire_rejections.Rejection) -> int:
        """Write the records of ``item`` that ``rejection`` names; returns how many records it names."""
        now = time.time()
        lines: list[RejectedLine] = []
        if item.layout is not None:  # packed: the head refuses a packed body only whole
            lines.append(RejectedLine(t=now, kind=item.kind, why=rejection.why, rank=item.rank,
                                      raw_b64=base64.b64encode(item.body).decode(), layout=item.layout,
                                      records=item.count or 1))
        else:
            try:
                rows = _raw_array.decode(item.body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                rows = None
            if rows is None:
                lines.append(RejectedLine(t=now, kind=item.kind, why=rejection.why, rank=item.rank,
                                          raw=item.body.decode("utf-8", "replace"), records=item.count or 1))
            else:
                picked = range(len(rows)) if rejection.rows is None else [j for j in rejection.rows if 0 <= j < len(rows)]
                lines += [RejectedLine(t=now, kind=item.kind, why=rejection.why, rank=item.rank,
                                       raw=bytes(rows[j]).decode("utf-8", "replace")) for j in picked]
        self.not_kept += rejection.rows_more
        named = sum(x.records for x in lines) + rejection.rows_more
        self._write(lines)
        return named

    def not_itemized(self, n: int) -> None:
        """Records the head refused without saying which (an older head, a message cut at its bound)."""
        self.not_kept += n

    def _write(self, lines: list[RejectedLine]) -> None:
        if not lines:
            return
        data = [_enc.encode(x) + b"\n" for x in lines]
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0
        out, n = [], 0
        for d, x in zip(data, lines):
            if size + len(d) > self.max_bytes:
                self.not_kept += x.records
                continue
            out.append(d)
            size += len(d)
            n += x.records
        if len(out) < len(data):
            log.error("agent: rejected-records file %s is at its bound (%d bytes): %d record(s) refused by the head "
                      "not kept so far", self.path, self.max_bytes, self.not_kept)
        if not out:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                buf = memoryview(b"".join(out))
                while buf:  # a short write is retried, never ignored
                    buf = buf[os.write(fd, buf):]
            finally:
                os.close(fd)
            self.kept += n
        except OSError as e:
            log.error("agent: cannot write rejected records to %s: %s", self.path, e)
            self.not_kept += n
