"""The run store: Parquet per run-id, one directory of part files per table.

Layout (a contract users rely on, see docs/data-path.md)::

    <store>/<run-id>/run.json                    the manifest
    <store>/<run-id>/<table>/part-<ns>-<seq>.parquet   for table in STORE_TABLES
    <store>/<run-id>/.head/wal-*.log             the head's write-ahead log (internal)

``pandas.read_parquet("<store>/<run-id>/<table>")`` reads a table. Part files
are written under a dot-name and renamed into place, and pyarrow ignores
dot-files, so a reader never sees half a file, even while the head appends.

Exactly-once: every row has a natural key (``KEYS``). The head acknowledges a
request only after its rows are in the write-ahead log; rows already seen (in a
part file, the WAL, the buffer or the packed queue) are dropped before they are
buffered. On start the key indexes are rebuilt from the part files and the WAL is
replayed through the same dedupe, so duplicates are caught across head restarts
and a ``kill -9`` loses nothing that was acknowledged. Step keys live in a
bounded interval index (``SeqIndex``, see "Dedupe indexes" below).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ranksight import schema, wire
from ranksight.layout import atomic_write
from ranksight.tables import RUN_ID_COLUMN, SPECS, TABLE_TYPES, TableSpec

_json = msgspec.json.Encoder()

log = logging.getLogger("ranksight.store")

_wal_decoders = {name: msgspec.json.Decoder(list[typ]) for name, typ in TABLE_TYPES.items()}


# ---------------------------------------------------------------------------
# Dedupe indexes
# ---------------------------------------------------------------------------
#
# Exactly-once needs "was this natural key seen before?" for every row. A set of key tuples
# answers it but costs ~120 B per row for the life of the head (a 16,384-rank job adds 2 GB a
# day of step keys alone). Step keys are not random: each (rank, attempt) writes its steps in
# order, so the steps seen form one contiguous range almost always. ``SeqIndex`` keeps, per
# group (rank, attempt), that range [lo, hi] in three sorted numpy arrays, plus a short list of
# extra intervals for the rare group that had a gap (a spool line lost to garbage, a step
# number skipped) or got steps below its range. Memory is bounded by groups and gaps, not rows
# (32 B per (rank, attempt)), and the check is vectorized: a whole flush of rows is sorted by
# (group, step), looked up with one searchsorted, and the common case (every new step is hi+1,
# hi+2, ... of its group) extends ``hi`` without any Python per row. Anything irregular takes a
# per-group Python path that merges intervals exactly; nothing is ever approximated.
#
# Other tables (lower volume, keys without such an order: GPU sample times, NCCL lines, ...)
# keep an exact set of key tuples (``SetIndex``).

_GBITS = 20  # attempt bits in the packed group key (rank << 20 | attempt)
_MAX_RANK = 1 << 42


def _in_intervals(iv: list[list[int]], s: int) -> bool:
    i = bisect.bisect_right(iv, [s, 1 << 63]) - 1
    return i >= 0 and iv[i][0] <= s <= iv[i][1]


def _merge(iv: list[list[int]], steps) -> list[list[int]]:
    """Intervals ``iv`` (sorted, disjoint) with the integers ``steps`` added, merged."""
    pts = sorted([a, b] for a, b in iv) + [[int(s), int(s)] for s in steps]
    pts.sort()
    out: list[list[int]] = []
    for a, b in pts:
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


class SeqIndex:
    """Seen (rank, attempt, step) keys as intervals of steps per (rank, attempt); see above."""

    def __init__(self, group_cols: tuple[str, str] = ("rank", "attempt"), seq_col: str = "step"):
        self.group_cols = group_cols
        self.seq_col = seq_col
        self.gk = np.empty(0, np.int64)  # sorted group keys: rank << 20 | attempt
        self.lo = np.empty(0, np.int64)  # the highest contiguous range of steps seen: [lo, hi]
        self.hi = np.empty(0, np.int64)
        self.irregular = np.empty(0, np.bool_)  # has intervals below [lo, hi] (in ``extra``)
        self.extra: dict[int, list[list[int]]] = {}
        self.other: set = set()  # keys outside the packed range (negative rank, huge attempt): exact

    def __len__(self) -> int:
        return len(self.gk)

    def nbytes(self) -> int:
        return int(self.gk.nbytes * 3 + self.irregular.nbytes) + 64 * sum(len(v) for v in self.extra.values()) \
            + 120 * len(self.other)

    def new_rows(self, rows: list) -> list:
        """Struct rows whose key is new (recorded as seen)."""
        if not rows:
            return []
        g0, g1 = self.group_cols
        try:
            a = np.fromiter((getattr(r, g0) for r in rows), np.int64, len(rows))
            b = np.fromiter((getattr(r, g1) for r in rows), np.int64, len(rows))
            s = np.fromiter((getattr(r, self.seq_col) for r in rows), np.int64, len(rows))
        except (OverflowError, TypeError, ValueError):  # beyond int64: exact set (Parquet drops them later)
            out = []
            for r in rows:
                k = (getattr(r, g0), getattr(r, g1), getattr(r, self.seq_col))
                if k not in self.other:
                    self.other.add(k)
                    out.append(r)
            return out
        mask = self.new_mask(a, b, s)
        return [r for r, m in zip(rows, mask.tolist()) if m]

    def new_mask(self, a: np.ndarray, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Bool mask of rows (group columns a, b; sequence s) seen for the first time; records them."""
        n = len(s)
        out = np.zeros(n, np.bool_)
        if n == 0:
            return out
        ok = (a >= 0) & (a < _MAX_RANK) & (b >= 0) & (b < (1 << _GBITS))
        if not ok.all():
            for i in np.nonzero(~ok)[0].tolist():
                k = (int(a[i]), int(b[i]), int(s[i]))
                if k not in self.other:
                    self.other.add(k)
                    out[i] = True
            okidx = np.nonzero(ok)[0]
            out[okidx] = self.new_mask(a[okidx], b[okidx], s[okidx])
            return out
        g = (a << _GBITS) | b
        order = np.lexsort((s, g))
        gs, ss = g[order], s[order]
        first = np.ones(n, np.bool_)
        first[1:] = (gs[1:] != gs[:-1]) | (ss[1:] != ss[:-1])  # repeats inside this call
        if len(self.gk):
            idx = np.minimum(np.searchsorted(self.gk, gs), len(self.gk) - 1)
            found = self.gk[idx] == gs
            seen = found & (ss >= self.lo[idx]) & (ss <= self.hi[idx])
            check = found & ~seen & self.irregular[idx]
            if check.any():
                for i in np.nonzero(check)[0].tolist():
                    seen[i] = _in_intervals(self.extra[int(gs[i])], int(ss[i]))
        else:
            idx = np.zeros(n, np.int64)
            found = np.zeros(n, np.bool_)
            seen = found
        new = first & ~seen
        if new.any():
            ni = np.nonzero(new)[0]
            self._record(gs[ni], ss[ni], found[ni], idx[ni])
        out[order] = new
        return out

    def _record(self, gs: np.ndarray, ss: np.ndarray, found: np.ndarray, idx: np.ndarray) -> None:
        """Add new keys (sorted by (group, step), unique, none seen before)."""
        k = len(gs)
        gstart = np.ones(k, np.bool_)
        gstart[1:] = gs[1:] != gs[:-1]
        starts = np.nonzero(gstart)[0]
        ends = np.append(starts[1:], k) - 1
        gid = np.cumsum(gstart) - 1
        pos = np.arange(k) - starts[gid]
        # The in-order fast path: a group's new steps are exactly hi+1, hi+2, ... (or, for a group
        # not seen before, first, first+1, ...).
        base = np.where(found, self.hi[idx] + 1 if len(self.hi) else 0, ss[starts][gid])
        grp_ok = np.logical_and.reduceat(ss == base + pos, starts)
        gfound = found[starts]
        upd = grp_ok & gfound
        if upd.any():
            self.hi[idx[starts[upd]]] = ss[ends[upd]]
        new_g, new_lo, new_hi, new_irr = [], [], [], []
        add = grp_ok & ~gfound
        if add.any():
            new_g.append(gs[starts[add]])
            new_lo.append(ss[starts[add]])
            new_hi.append(ss[ends[add]])
            new_irr.append(np.zeros(int(add.sum()), np.bool_))
        for j in np.nonzero(~grp_ok)[0].tolist():  # gaps, steps below the range: exact interval merge
            g = int(gs[starts[j]])
            steps = ss[starts[j]:ends[j] + 1].tolist()
            if gfound[j]:
                i = int(idx[starts[j]])
                iv = self.extra.get(g, []) + [[int(self.lo[i]), int(self.hi[i])]]
            else:
                iv = []
            iv = _merge(iv, steps)
            main = iv.pop()
            if iv:
                self.extra[g] = iv
            else:
                self.extra.pop(g, None)
            if gfound[j]:
                self.lo[i], self.hi[i], self.irregular[i] = main[0], main[1], bool(iv)
            else:
                new_g.append(np.array([g], np.int64))
                new_lo.append(np.array([main[0]], np.int64))
                new_hi.append(np.array([main[1]], np.int64))
                new_irr.append(np.array([bool(iv)]))
        if new_g:
            gk = np.concatenate([self.gk] + new_g)
            o = np.argsort(gk, kind="stable")
            self.gk = gk[o]
            self.lo = np.concatenate([self.lo] + new_lo)[o]
            self.hi = np.concatenate([self.hi] + new_hi)[o]
            self.irregular = np.concatenate([self.irregular] + new_irr)[o]


class SetIndex:
    """Seen keys as an exact set of tuples (tables without an ordered sequence key)."""

    def __init__(self, spec: "TableSpec"):
        self.spec = spec
        self.keys: set = set()

    def __len__(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return 120 * len(self.keys)

    def new_rows(self, rows: list) -> list:
        if not self.spec.key:
            return list(rows)
        keys = self.keys
        ks = list(map(self.spec.key_fn, rows))
        if keys.isdisjoint(ks) and len(set(ks)) == len(ks):  # the common case: all new, no repeats
            keys.update(ks)
            return list(rows)
        new = []
        for k, r in zip(ks, rows):
            if k in keys:
                continue
            keys.add(k)
            new.append(r)
        return new

    def new_mask_keys(self, ks: list[tuple]) -> np.ndarray:
        out = np.zeros(len(ks), np.bool_)
        for i, k in enumerate(ks):
            if k not in self.keys:
                self.keys.add(k)
                out[i] = True
        return out


def make_index(table: str):
    return SeqIndex() if table == "steps" else SetIndex(SPECS[table])


def index_table(index, spec: "TableSpec", table: pa.Table) -> None:
    """Mark the keys of stored rows (a Parquet part file) as seen."""
    if not spec.key or table.num_rows == 0:
        return
    if isinstance(index, SeqIndex):
        cols = [table.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
                for c in (*index.group_cols, index.seq_col)]
        index.new_mask(*cols)
    else:
        index.keys.update(spec.keys_from_table(table))


# ---------------------------------------------------------------------------
# Packed step records (wire encoding packed-v1) -> Arrow, without a Python object per record
# ---------------------------------------------------------------------------


def _const_string(value: str, n: int) -> pa.Array:
    b = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(b)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b * n))


def packed_to_table(table: str, run_id: str, arr: np.ndarray, layout: "wire.PackedLayout") -> pa.Table:
    """Arrow table of the store schema from a numpy structured array of packed records."""
    spec = SPECS[table]
    n = len(arr)
    names = arr.dtype.names or ()
    arrays = []
    for f in spec.schema:
        name, at = f.name, f.type
        if name in names:
            col = arr[name]
            code = layout.codes[name]
            if code == "f8":  # NaN is null (msgspec encodes NaN as null, so the JSON path agrees)
                col = np.ascontiguousarray(col)
                nan = np.isnan(col)
                arrays.append(pa.array(col, type=pa.float64(), mask=nan) if nan.any() else
                              pa.array(col, type=pa.float64()))
            elif code == "i8":
                arrays.append(pa.array(np.ascontiguousarray(col), type=pa.int64()))
            elif code == "b1":
                arrays.append(pa.array(col != 0, type=pa.bool_()))
            else:  # fixed-width UTF-8 bytes
                raw = pa.array(col)
                try:
                    arrays.append(raw.cast(pa.string()))
                except pa.ArrowInvalid:
                    log.error("store %s/%s: invalid UTF-8 in column %s replaced", run_id, table, name)
                    arrays.append(pa.array([v.decode("utf-8", "replace") for v in col.tolist()], pa.string()))
        elif name == RUN_ID_COLUMN:
            arrays.append(_const_string(run_id, n))
        else:  # a field the sender's layout does not carry: its default, or null
            d = layout.defaults.get(name)
            arrays.append(pa.nulls(n, at) if d is None else pa.array(np.full(n, d), type=at))
    return pa.Table.from_arrays(arrays, schema=spec.schema)


def _rows_to_table(spec: "TableSpec", run_id: str, rows: list) -> tuple[pa.Table | None, int]:
    """Arrow table of struct rows; rows with values Parquet cannot hold (an integer beyond int64:
    JSON allows it) are dropped, loudly, so they never block a table. Returns (table, dropped)."""
    try:
        return spec.to_table(run_id, rows), 0
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
        good = []
        for r in rows:
            try:
                spec.to_table(run_id, [r])
                good.append(r)
            except (pa.ArrowException, OverflowError, TypeError, ValueError):
                pass
        log.error("store %s/%s: %d row(s) with values Parquet cannot store dropped (%s)", run_id, spec.name,
                  len(rows) - len(good), e)
        return (spec.to_table(run_id, good) if good else None), len(rows) - len(good)


# ---------------------------------------------------------------------------
# Write-ahead log
# ---------------------------------------------------------------------------
#
# ``.head/wal-<ns>.log`` (and ``wal-current.log``): a sequence of entries
#     <table> \t <encoding> \t <layout> \t <payload length> \n <payload> \n
# encoding ``json`` (payload: a JSON array of records, layout empty), ``packed-v1`` (payload:
# packed records; layout ``@<id>``) or ``layout`` (defines id ``<layout>`` as the layout text in
# the payload, for the rest of the file: the ~600-byte text is written once per file, not once
# per request). A torn last entry (crash mid-write) was never acknowledged and is ignored.
# ``wal-*.jsonl`` files of older heads (lines ``<table>\t<JSON array>``) are replayed too.

WAL_CURRENT = "wal-current.log"


def _wal_entry(table: str, enc: str, layout: str, payload: bytes) -> bytes:
    return b"%s\t%s\t%s\t%d\n" % (table.encode(), enc.encode(), layout.encode(), len(payload)) + payload + b"\n"


def _read_wal(path: Path) -> Iterable[tuple[str, str, str, bytes]]:
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


class RunStore:
    """One run's tables: dedupe indexes, a write-ahead log, a queue, buffers, part files.

    Two ways in:
    - ``add``/``add_chunks`` (tests, the head's own findings/actions): decoded records are
      deduplicated at once, logged, buffered as an Arrow table; the new records are returned.
    - ``enqueue_packed`` / ``enqueue_rows`` (the head's ingest): batches are only logged and
      queued, and the request is acknowledged once they are in the WAL. ``process`` (run at every
      flush, before ``add`` of the same table, before any view of the live window, and when the
      queue is large) takes all queued batches of a table at once: packed ones become one numpy
      array (one ``np.frombuffer`` over the concatenated bodies), decoded ones one list; the keys
      are deduplicated vectorized, the new rows become one Arrow table, and ``on_new`` hands it
      to the head (live window, counters). So the per-request work is a WAL append, and the
      per-row work runs in C over a whole flush: no Python object per packed record.
    """

    def __init__(self, root: Path, run_id: str, flush_rows: int = 50_000, fsync: bool = False):
        self.root = root
        self.run_id = run_id
        self.flush_rows = flush_rows
        self.fsync = fsync
        self.lock = threading.RLock()
        self.keys = {t: make_index(t) for t in SPECS}
        self.buffers: dict[str, list[pa.Table]] = {t: [] for t in SPECS}
        self.buffered_rows: dict[str, int] = {t: 0 for t in SPECS}
        self.buffered = 0
        # the queue: per table, packed bodies per layout (appended into one bytearray) and decoded row lists
        self.q_packed: dict[str, dict[Any, bytearray]] = {t: {} for t in SPECS}
        self.q_rows: dict[str, list[list]] = {t: [] for t in SPECS}
        self.pending_rows = 0
        self.rows_stored: dict[str, int] = {t: 0 for t in SPECS}
        self.duplicates = 0
        self.unstorable = 0  # rows dropped because Parquet cannot hold a value (logged)
        # Called (under the lock) as on_new(table, Arrow table of the new rows or None, the new rows
        # as structs or None, rows in, rows new) for every processed queue; the head feeds its live
        # window and counters with it.
        self.on_new: Callable[..., Any] | None = None
        self._seq = 0
        self._unflushed_wals: list[Path] = []  # WAL generations whose rows are not all in Parquet yet
        self._wal_prefix: dict[tuple[str, Any], bytes] = {}
        self.head_dir = root / ".head"
        self.head_dir.mkdir(parents=True, exist_ok=True)
        self._wal: int | None = None  # an O_APPEND file descriptor: one write() syscall per request
        self._load_keys()
        self._replay_wal()
        self._wal = self._open_wal()

    def _open_wal(self) -> int:
        return os.open(self.head_dir / WAL_CURRENT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    # -- startup --------------------------------------------------------------
    def _part_files(self, table: str) -> list[Path]:
        d = self.root / table
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if p.name.startswith("part-") and p.name.endswith(".parquet"))

    def _load_keys(self) -> None:
        for name, spec in SPECS.items():
            for p in self._part_files(name):
                try:
                    cols = list(spec.key) or [spec.schema.names[0]]
                    have = set(pq.read_schema(p).names)
                    t = pq.read_table(p, columns=[c for c in cols if c in have])
                    for c in cols:
                        if c not in have:  # a part written before the column existed (e.g. collectives' attempt)
                            t = t.append_column(c, pa.array([0] * t.num_rows, type=spec.schema.field(c).type))
                    t = t.select(cols)
                except Exception as e:  # a foreign or damaged file must not stop the head
                    log.error("store: cannot read %s (%s); its rows are not deduplicated against", p, e)
                    continue
                self.rows_stored[name] += t.num_rows
                index_table(self.keys[name], spec, t)

    def _replay_wal(self) -> None:
        """Rows acknowledged but not yet in a part file: back into the buffers (through the dedupe)."""
        wals = sorted(list(self.head_dir.glob("wal-*.jsonl")) + list(self.head_dir.glob("wal-*.log")),
                      key=lambda p: (p.name.startswith("wal-current"), p.name))
        before = self.buffered
        for w in wals:
            for name, enc, layout, payload in _read_wal(w):
                if name not in SPECS:
                    continue
                if enc == "json":
                    try:
                        rows = _wal_decoders[name].decode(payload)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.error("store: unreadable WAL entry in %s skipped", w)
                        continue
                    self.q_rows[name].append(rows)
                    self.pending_rows += len(rows)
                else:
                    try:
                        lay = wire.packed_layout_of(wire.KIND_OF_TABLE.get(name, ""), layout)
                        n = wire.packed_count(lay, payload)
                    except wire.WireError as e:
                        log.error("store: unreadable WAL entry in %s skipped: %s", w, e)
                        continue
                    self.q_packed[name].setdefault(lay, bytearray()).extend(payload)
                    self.pending_rows += n
        self._process_locked()
        replayed = self.buffered - before
        if replayed > 0:
            log.info("store %s: replayed %d rows from the write-ahead log", self.run_id, replayed)
        # Rewrite them as one fresh WAL generation, then drop the old files.
        if wals:
            self._flush_locked(reason="replay")
            if self.buffered:  # could not write Parquet now: keep the old WAL files for the next start
                self._unflushed_wals.extend(wals)
            else:
                for w in wals:
                    w.unlink(missing_ok=True)

    # -- ingest ---------------------------------------------------------------
    def _write_wal(self, data: bytes) -> None:
        os.write(self._wal, data)  # in the kernel's page cache: survives a kill -9 of the head
        if self.fsync:
            os.fsync(self._wal)

    def _buffer(self, table: str, t: pa.Table) -> None:
        self.buffers[table].append(t)
        self.buffered_rows[table] += t.num_rows
        self.buffered += t.num_rows

    def add(self, table: str, rows: list, raw: bytes | str | None = None) -> list:
        """Keep the rows not seen before; durable (WAL) when this returns. Returns the new rows.

        ``raw``: the JSON array ``rows`` were decoded from; logged as is when all rows are new
        (the common case), which saves re-encoding them.
        """
        return self.add_chunks(table, [(rows, raw)])

    def add_chunks(self, table: str, chunks: list[tuple[list, bytes | str | None]]) -> list:
        """``add`` for several decoded batches at once: one WAL write, one lock round."""
        with self.lock:
            self._process_locked(table)  # queued rows first: they were acknowledged earlier
            index = self.keys[table]
            entries, out = [], []
            for rows, raw in chunks:
                new = index.new_rows(rows)
                self.duplicates += len(rows) - len(new)
                if not new:
                    continue
                body = None
                if raw is not None and len(new) == len(rows):
                    body = raw.encode() if isinstance(raw, str) else raw
                entries.append(_wal_entry(table, "json", "", body if body is not None else _json.encode(new)))
                out.extend(new)
            if out:
                self._write_wal(b"".join(entries))
                t, dropped = _rows_to_table(SPECS[table], self.run_id, out)
                self.unstorable += dropped
                if t is not None:
                    self._buffer(table, t)
            full = self.buffered + self.pending_rows >= self.flush_rows
        if full:
            self.flush()
        return out

    def enqueue_rows(self, table: str, chunks: list[tuple[list, bytes | str | None]]) -> None:
        """Queue decoded batches (rows, the JSON they came from); durable (WAL) when this returns."""
        entries = []
        for rows, raw in chunks:
            body = raw.encode() if isinstance(raw, str) else raw
            entries.append(_wal_entry(table, "json", "", body if body is not None else _json.encode(rows)))
        with self.lock:
            self._write_wal(b"".join(entries))
            q = self.q_rows[table]
            for rows, _ in chunks:
                q.append(rows)
                self.pending_rows += len(rows)
            full = self.buffered + self.pending_rows >= self.flush_rows
        if full:
            self.flush()

    def enqueue_packed(self, table: str, batches: list) -> None:
        """Queue packed batches (``ranksight.wire.PackedBatch``: layout, payload, count); durable (WAL)
        when this returns."""
        with self.lock:
            entries = []
            for b in batches:
                pre = self._wal_prefix.get((table, b.layout))
                if pre is None:  # first use of this layout in this WAL generation: define it once
                    lid = str(len(self._wal_prefix))
                    entries.append(_wal_entry(table, "layout", lid, b.layout.text.encode()))
                    pre = self._wal_prefix[(table, b.layout)] = b"%s\t%s\t@%s\t" % (
                        table.encode(), b.layout.encoding.encode(), lid.encode())
                entries.append(b"%s%d\n%s\n" % (pre, len(b.payload), b.payload))
            self._write_wal(entries[0] if len(entries) == 1 else b"".join(entries))
            q = self.q_packed[table]
            for b in batches:
                buf = q.get(b.layout)
                if buf is None:
                    buf = q[b.layout] = bytearray()
                buf += b.payload
                self.pending_rows += b.count
            if self.buffered + self.pending_rows < self.flush_rows:
                return
        self.flush()

    def process(self) -> int:
        with self.lock:
            return self._process_locked()

    def _process_locked(self, only: str | None = None) -> int:
        """Dedupe the queued batches (vectorized) into the buffers; returns the number of new rows."""
        if not self.pending_rows:
            return 0
        total = 0
        for table in ([only] if only else list(SPECS)):
            packed, rowlists = self.q_packed[table], self.q_rows[table]
            if not packed and not rowlists:
                continue
            self.q_packed[table], self.q_rows[table] = {}, []
            index = self.keys[table]
            for lay, buf in packed.items():
                arr = np.frombuffer(buf, dtype=lay.dtype)
                n = len(arr)
                self.pending_rows -= n
                if isinstance(index, SeqIndex):
                    cols = [arr[c].astype(np.int64) if c in lay.codes else
                            np.full(n, lay.defaults.get(c) or 0, np.int64) for c in (*index.group_cols, index.seq_col)]
                    mask = index.new_mask(*cols)
                else:
                    keycols = [arr[c].tolist() if c in lay.codes else [lay.defaults.get(c)] * n
                               for c in SPECS[table].key]
                    mask = index.new_mask_keys(list(zip(*keycols)))
                k = int(np.count_nonzero(mask))
                self.duplicates += n - k
                t = None
                if k:
                    try:
                        t = packed_to_table(table, self.run_id, arr if k == n else arr[mask], lay)
                    except (pa.ArrowException, ValueError, TypeError) as e:  # never expected: layouts are checked
                        log.error("store %s/%s: %d packed rows not convertible, dropped: %s", self.run_id, table, k, e)
                        self.unstorable += k
                if t is not None:
                    self._buffer(table, t)
                    total += t.num_rows
                if self.on_new is not None:
                    self.on_new(table, t, None, n, k)
            if rowlists:
                rows = rowlists[0] if len(rowlists) == 1 else [r for rl in rowlists for r in rl]
                n = len(rows)
                self.pending_rows -= n
                new = index.new_rows(rows)
                self.duplicates += n - len(new)
                t = None
                if new:
                    t, dropped = _rows_to_table(SPECS[table], self.run_id, new)
                    self.unstorable += dropped
                    if t is not None:
                        self._buffer(table, t)
                        total += t.num_rows
                if self.on_new is not None:
                    self.on_new(table, t, new, n, len(new))
        return total

    # -- flush ------------------------------------------------------------------
    def flush(self) -> int:
        with self.lock:
            self._process_locked()
            return self._flush_locked()

    def _flush_locked(self, reason: str = "") -> int:
        if not self.buffered:
            return 0
        buffers = self.buffers
        counts = self.buffered_rows
        self.buffers = {t: [] for t in SPECS}
        self.buffered_rows = {t: 0 for t in SPECS}
        n = self.buffered
        self.buffered = 0
        # Rotate the WAL first: the old generation is deleted only once its rows are in parts.
        # (Packed batches still queued would be lost with it: callers process the queue first.)
        old_wal = None
        if self._wal is not None:
            os.close(self._wal)
            old_wal = self.head_dir / f"wal-{time.time_ns()}.log"
            os.replace(self.head_dir / WAL_CURRENT, old_wal)
            self._wal = self._open_wal()
            self._wal_prefix = {}  # layout ids are per WAL file
        if old_wal is not None:
            self._unflushed_wals.append(old_wal)
        failed = None
        for table, chunks in buffers.items():
            if not chunks:
                continue
            if failed is None:
                try:
                    self._write_part(table, chunks)
                    continue
                except OSError as e:  # disk full, permissions: keep the rows, try again next flush
                    failed = e
            # not written: back into the buffer (its WAL generation is kept until it is)
            self.buffers[table][:0] = chunks
            self.buffered_rows[table] += counts[table]
            self.buffered += counts[table]
        if failed is not None:
            log.error("store %s: flush failed (%s); %d rows kept for the next flush", self.run_id, failed,
                      self.buffered)
            return 0
        for w in self._unflushed_wals:
            w.unlink(missing_ok=True)
        self._unflushed_wals = []
        return n

    def _write_part(self, table: str, chunks: list[pa.Table]) -> None:
        arrow = pa.concat_tables(chunks).combine_chunks() if len(chunks) > 1 else chunks[0]
        d = self.root / table
        d.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        name = f"part-{time.time_ns()}-{os.getpid()}-{self._seq:06d}.parquet"
        tmp = d / f".{name}.tmp"
        pq.write_table(arrow, tmp)
        os.replace(tmp, d / name)
        self.rows_stored[table] += arrow.num_rows

    def close(self) -> None:
        with self.lock:
            self._process_locked()
            self._flush_locked()
            if self._wal is not None:
                os.close(self._wal)
                self._wal = None
            # nothing left to replay
            for w in list(self.head_dir.glob("wal-*.log")) + list(self.head_dir.glob("wal-*.jsonl")):
                if w.stat().st_size == 0:
                    w.unlink(missing_ok=True)

    def stored_and_buffered(self, table: str) -> int:
        """Rows of ``table`` in part files or buffered (after dedupe of the queue)."""
        with self.lock:
            self._process_locked(table)
            return self.rows_stored[table] + self.buffered_rows[table]

    # -- manifest -----------------------------------------------------------------
    def write_manifest(self, manifest: schema.Manifest, mtime: float | None) -> bool:
        """Write run.json if absent, or if the shipped one is newer than ours. Returns True if written."""
        path = self.root / "run.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None:
            if mtime is None or mtime <= st.st_mtime:
                return False
            try:
                if path.read_bytes() == schema.encode(manifest):
                    return False
            except OSError:
                pass
        atomic_write(path, schema.encode(manifest))
        return True


class Store:
    """All runs under one store directory."""

    def __init__(self, root: str | os.PathLike, flush_rows: int = 50_000, fsync: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.flush_rows = flush_rows
        self.fsync = fsync
        self.runs: dict[str, RunStore] = {}
        self._lock = threading.Lock()

    def run(self, run_id: str) -> RunStore:
        rs = self.runs.get(run_id)
        if rs is not None:
            return rs
        with self._lock:
            rs = self.runs.get(run_id)
            if rs is None:
                from ranksight.layout import RunDir

                RunDir(self.root, run_id)  # validates the id (no path tricks)
                rs = RunStore(self.root / run_id, run_id, self.flush_rows, self.fsync)
                self.runs[run_id] = rs
            return rs

    def open_existing(self) -> None:
        """Open every run that has a pending WAL, so acknowledged rows reach Parquet without new traffic."""
        for d in self.root.iterdir() if self.root.is_dir() else []:
            if d.is_dir() and (d / ".head").is_dir() and (any((d / ".head").glob("wal-*.log"))
                                                          or any((d / ".head").glob("wal-*.jsonl"))):
                try:
                    self.run(d.name)
                except ValueError:
                    continue

    def flush_all(self) -> int:
        return sum(rs.flush() for rs in list(self.runs.values()))

    def close(self) -> None:
        for rs in list(self.runs.values()):
            rs.close()

    def run_ids(self) -> list[str]:
        out = set(self.runs)
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.is_dir() and not d.name.startswith(".") and ((d / "run.json").exists() or (d / "steps").is_dir()):
                    out.add(d.name)
        return sorted(out)
