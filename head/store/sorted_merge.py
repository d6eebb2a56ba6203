"""A partition's rows written in the loader's key order with bounded memory: an external sort for compaction.

The loader (``analyzers.columnar``) sorts the steps by (step, rank) and the collectives by (attempt, step, rank,
group, seq), a group ordered by where it first appears in the rows read, and skips that sort on files whose marker
(``ranksight.sort_marker``) says the rows already come in that order. A head's parts do not (ranks ship
independently), so compaction sorts them, without holding the partition in memory:

1. each input's rows (as compaction reads them) are appended to a spill file (Arrow IPC, lz4, next to the output,
   a dot-name ``remove_stale_tmp`` clears after a crash), and only the key columns are kept in memory, narrowed;
2. the row order is computed from the keys alone (one int64 code per row and a stable argsort; ``np.lexsort`` when
   the code would not fit);
3. the output is gathered slice by slice (``SLICE_ROWS``) from the spill, a few decoded spill batches cached (rows
   that arrive nearly in order, as parts do, touch one or two batches per slice).

Memory: the key columns (4 bytes each per row), the code and the order (8 bytes each per row), one slice and the
cached batches; not the partition's rows.

The group order the rows are sorted by is the one the sorted rows themselves give (a fixed point): groups ordered by
the first (attempt, step, rank) they appear in, groups new in the same one by where they first appear in the input.
Then the first-seen order of the output is the order it is sorted by, so the loader, which orders groups by first
appearance, finds the file in its own order (the marker's check, ``OrderCheck``, confirms it row by row).

Rows are only reordered, never dropped or changed: a key seen twice stays twice (then the file is sorted but not
marked, and the loader's dedupe decides as before); rows with equal keys keep their input order (a stable sort).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ranksight.sort_marker import GROUP, KEYS

SLICE_ROWS = 131_072  # rows gathered per output write (one row group of the compacted file)
SPILL_BATCH_ROWS = 131_072  # rows per spill batch (inputs gathered into batches of about this many)
CACHED_BATCHES = 8  # decoded spill batches kept while gathering


def sortable(table: str) -> bool:
    return table in KEYS


class Keys:
    """The key columns of the rows appended, in input order, as narrow integer arrays; groups as codes in the order
    they first appear in the input (nulls: 0 for numbers, a group of their own)."""

    def __init__(self, table: str):
        self.key = KEYS[table]
        self.parts: dict[str, list[np.ndarray]] = {c: [] for c in self.key}
        self.groups: dict[object, int] = {}
        self.rows = 0

    def add(self, t: pa.Table) -> None:
        for c in self.key:
            col = t.column(c) if c in t.column_names else pa.nulls(t.num_rows, pa.int64())
            self.parts[c].append(self._group(col) if c == GROUP else self._number(col))
        self.rows += t.num_rows

    @staticmethod
    def _number(col: pa.ChunkedArray) -> np.ndarray:
        if col.null_count:
            col = pc.fill_null(col, 0)
        v = col.to_numpy()
        if v.dtype.kind not in "iu":
            v = v.astype(np.int64)
        lo, hi = (int(v.min()), int(v.max())) if len(v) else (0, 0)
        small = np.int32 if -2**31 <= lo and hi < 2**31 else np.int64
        return v.astype(small, copy=False)

    def _group(self, col: pa.ChunkedArray) -> np.ndarray:
        arr = col.combine_chunks()
        if pa.types.is_dictionary(arr.type):
            arr = arr.cast(arr.type.value_type)
        enc = pc.dictionary_encode(arr, null_encoding="encode")  # its dictionary in the order of first appearance
        lut = np.array([self.groups.setdefault(s, len(self.groups)) for s in enc.dictionary.to_pylist()] + [0],
                       dtype=np.int32)
        return lut[enc.indices.to_numpy()]

    def column(self, c: str) -> np.ndarray:
        parts = self.parts.pop(c)
        if not parts:
            return np.zeros(0, np.int32)
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return out


def _spans(keys: list[np.ndarray]) -> list[tuple[int, int]] | None:
    """(lowest value, span) of each key; None when the spans' product does not fit one int64 code."""
    out, total = [], 1
    for k in keys:
        lo, hi = (int(k.min()), int(k.max())) if len(k) else (0, 0)
        out.append((lo, hi - lo + 1))
        total *= hi - lo + 1
        if total >= 2**62:
            return None
    return out


def _code(keys: list[np.ndarray]) -> np.ndarray | None:
    """One int64 per row ordering as the tuple of ``keys``, built in place; the keys are taken out of the list as
    they are added (so their memory goes as the code grows). None (and the keys left) when it would not fit."""
    spans = _spans(keys)
    if spans is None:
        return None
    return _fold(keys.pop(0).astype(np.int64), keys, spans)


def _fold(code: np.ndarray, keys: list[np.ndarray], spans: list[tuple[int, int]]) -> np.ndarray:
    """``code`` (int64, changed in place) made the first key of the tuple ``(code, *keys)``: each value less its
    key's lowest (``spans``: ``_spans`` of the whole tuple), times the next key's span, plus that key. The keys are
    taken out of the list as they are folded in."""
    code -= spans[0][0]
    for lo, span in spans[1:]:
        k = keys.pop(0)
        code *= span
        code += k
        code -= lo
        del k
    return code


def _order_of(code: np.ndarray) -> np.ndarray:
    """Row positions sorted (stable) by ``code``; no sort when they already are (parts that arrived in order)."""
    if bool((code[1:] >= code[:-1]).all()):
        return np.arange(len(code), dtype=np.int64)
    return np.argsort(code, kind="stable")


def _stable_order(keys: list[np.ndarray]) -> np.ndarray:
    """Row positions sorted (stable) by the tuple of ``keys``; the list is emptied as it is used."""
    code = _code(keys)
    if code is None:
        order = np.lexsort(keys[::-1])  # (stable)
        keys.clear()
        return order
    return _order_of(code)


def row_order(table: str, keys: Keys) -> np.ndarray:
    """The input rows' positions in the key order (stable), the groups in their fixed-point order. Memory: the key
    columns until they are folded into one int64 code, then the code and the order."""
    key = list(KEYS[table])
    if GROUP not in key:
        return _stable_order([keys.column(c) for c in key])
    gpos = key.index(GROUP)
    head = [keys.column(c) for c in key[:gpos]]  # (attempt, step, rank): the block a row is in
    g = keys.column(GROUP)
    n = len(g)
    block = _code(head)
    if block is None:  # spans too wide for one code: the blocks' ranks instead
        block = np.empty(n, np.int64)
        block[np.lexsort(head[::-1])] = np.arange(n)
        head.clear()
    # each group's first block (ties: the group first seen earlier in the input): that order is the groups' order
    n_groups = int(g.max(initial=-1)) + 1
    first_block = np.full(n_groups, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first_block, g, block)
    by_first = np.lexsort((np.arange(n_groups), first_block))
    rank_of = np.empty(n_groups, np.int32)
    rank_of[by_first] = np.arange(n_groups, dtype=np.int32)
    np.take(rank_of, g, out=g)  # in place: the groups' codes now in that order
    # the code over (block, group, the rest): the block's code extended in place
    tail = [g] + [keys.column(c) for c in key[gpos + 1:]]
    del g
    spans = _spans([block] + tail)
    if spans is None:
        return _stable_order([block] + tail)
    return _order_of(_fold(block, tail, spans))


class Spill:
    """Rows appended to an Arrow IPC file, read back by global row position (batches decoded on demand, a few
    cached)."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path = path
        self.schema = schema
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_file(self._sink, schema,
                                       options=pa.ipc.IpcWriteOptions(compression=_spill_codec()))
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._sizes: list[int] = []
        self._reader = None
        self._map = None
        self.starts: np.ndarray | None = None
        self._cache: OrderedDict[int, pa.RecordBatch] = OrderedDict()

    def append(self, t: pa.Table) -> None:
        self._pending.append(t)
        self._pending_rows += t.num_rows
        if self._pending_rows >= SPILL_BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            t = pa.concat_tables(self._pending)
            if t.num_rows < SPILL_BATCH_ROWS // 4 * len(self._pending):  # small parts: gathered into one batch
                t = t.combine_chunks()
            for b in t.to_batches():
                self._writer.write_batch(b)
                self._sizes.append(b.num_rows)
        self._pending, self._pending_rows = [], 0

    def finish(self) -> None:
        """Done appending: the file closed and mapped for reading."""
        self._flush()
        self._writer.close()
        self._sink.close()
        # read, not memory-mapped: the batches decoded land in the cache (freed as it turns over), where a mapping
        # would keep every page of the spill it touched in the process's resident set
        self._map = pa.OSFile(str(self.path), "rb")
        self._reader = pa.ipc.open_file(self._map)
        self.starts = np.concatenate(([0], np.cumsum(self._sizes, dtype=np.int64)))

    def _batch(self, i: int) -> pa.RecordBatch:
        b = self._cache.get(i)
        if b is None:
            b = self._reader.get_batch(i)
            self._cache[i] = b
            if len(self._cache) > CACHED_BATCHES:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(i)
        return b

    def take(self, idx: np.ndarray) -> pa.Table:
        """The rows at global positions ``idx``, in that order: one take over the batches they are in (as chunks
        of one table, not copied together first)."""
        which = np.searchsorted(self.starts, idx, side="right") - 1
        touched = np.unique(which)
        batches = [self._batch(int(b)) for b in touched]
        sizes = np.array([b.num_rows for b in batches], dtype=np.int64)
        at = np.zeros(int(touched[-1]) + 1 if len(touched) else 0, np.int64)  # each touched batch's offset in them
        at[touched] = np.concatenate(([0], np.cumsum(sizes)[:-1])) if len(sizes) else sizes
        local = idx - self.starts[which] + at[which]
        return pa.Table.from_batches(batches, schema=self.schema).take(pa.array(local))

    def close(self) -> None:
        self._cache.clear()
        self._reader = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if not self._sink.closed:
            try:
                self._writer.close()
            except (pa.ArrowException, OSError):
                pass
            self._sink.close()
        self.path.unlink(missing_ok=True)


def _spill_codec() -> str | None:
    return "lz4" if pa.Codec.is_available("lz4") else None
