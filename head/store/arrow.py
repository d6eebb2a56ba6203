"""Rows to Arrow tables of the store's schema (``ranksight.tables.SPECS``).

Two sources: packed records (wire encoding packed-v1, a numpy structured array) become columns
without a Python object per record; decoded records (msgspec Structs) go through the table's
``TableSpec.to_table``, with rows Parquet cannot hold dropped one by one instead of failing the batch.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from ranksight import wire
from ranksight.tables import RUN_ID_COLUMN, SPECS, TableSpec

log = logging.getLogger("ranksight.store")


def _const_string(value: str, n: int) -> pa.Array:
    b = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(b)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b * n))


class PackedColumns:
    """Packed records as one contiguous numpy array per field, standing in for a structured array where the
    store reads one (``col = a[name]``, ``a[mask]``, ``len(a)``, ``a.dtype.names``): what ``merge_packed`` makes of
    chunks in several layouts, so each field is copied once, straight into the column ``packed_to_table`` hands to
    Arrow, instead of into a merged structured array and out of it again."""

    __slots__ = ("cols", "dtype", "n")

    def __init__(self, cols: dict[str, np.ndarray], dtype: np.dtype, n: int):
        self.cols, self.dtype, self.n = cols, dtype, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.cols[key]
        cols = {name: col[key] for name, col in self.cols.items()}  # a mask or index array: every column alike
        return PackedColumns(cols, self.dtype, len(next(iter(cols.values()))) if cols else 0)


def merge_packed(kind: str, chunks: list[tuple[wire.PackedLayout, bytes]]
                 ) -> tuple[np.ndarray | PackedColumns, wire.PackedLayout]:
    """One structured array (one layout) or ``PackedColumns`` (several), in the order of ``chunks``, from packed
    bodies of one kind in several layouts (string fields of another width, fields one sender left at their default):
    the union of their fields, each string as wide as its widest, a field a chunk lacks filled with its default (null
    as the packed codes write it). The live window keeps rows in arrival order, so a flush's rows must not be
    regrouped by layout."""
    layouts = {lay for lay, _ in chunks}
    if len(layouts) == 1:
        lay = chunks[0][0]
        return np.frombuffer(chunks[0][1] if len(chunks) == 1 else b"".join([c for _, c in chunks]), lay.dtype), lay
    width: dict[str, int] = {}
    codes: dict[str, str] = {}
    for lay in layouts:
        for name, code in lay.codes.items():
            codes[name] = code
            if code.startswith("S"):
                width[name] = max(width.get(name, 0), int(code[1:]))
    order = [f.name for f in SPECS[wire.BATCH_KINDS[kind][1]].schema if f.name in codes]
    order += [n for n in codes if n not in order]
    text = ",".join(f"{n}:S{width[n]}" if n in width else f"{n}:{codes[n]}" for n in order)
    union = wire.packed_layout_of(kind, text)
    # each layout's chunks joined into one array, and each of its fields written to its rows' places (in arrival
    # order) of that field's column: one fancy-indexed copy per layout and field, not one per chunk and field
    counts = np.array([len(body) // lay.dtype.itemsize for lay, body in chunks], np.int64)
    starts = np.cumsum(counts) - counts
    n = int(counts.sum())
    cols = {name: np.empty(n, union.dtype[name]) for name in order}
    for lay in layouts:
        which = [j for j, (c_lay, _) in enumerate(chunks) if c_lay == lay]
        a = np.frombuffer(b"".join([chunks[j][1] for j in which]), lay.dtype)
        cnt = counts[which]
        rows = np.repeat(starts[which] - (np.cumsum(cnt) - cnt), cnt) + np.arange(len(a))  # chunk start + 0..count-1
        for name in order:
            if name in lay.codes:
                cols[name][rows] = a[name]
            else:
                cols[name][rows] = packed_default(union.codes[name], lay.defaults.get(name))
    return PackedColumns(cols, union.dtype, n), union


def packed_default(code: str, default) -> object:
    """A field's default as its packed code writes it."""
    if default is None:
        return np.nan if code == "f8" else wire.NULL_INT if code == "n8" else 0
    if isinstance(default, str):
        return default.encode()
    return int(default) if code in ("b1", "i8", "n8") else default


def packed_to_table(table: str, run_id: str, arr: np.ndarray | PackedColumns, layout: wire.PackedLayout) -> pa.Table:
    """Arrow table of the store schema from a numpy structured array of packed records (or ``PackedColumns``)."""
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
            elif code == "n8":  # int64 or null (wire.NULL_INT)
                col = np.ascontiguousarray(col)
                null = col == wire.NULL_INT
                arrays.append(pa.array(col, type=pa.int64(), mask=null) if null.any() else
                              pa.array(col, type=pa.int64()))
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
        elif name in layout.derived:  # made from its source column: once per distinct source value
            src, fn = layout.derived[name]
            uniq, inv = np.unique(arr[src], return_inverse=True)
            arrays.append(pa.array([fn(v) for v in uniq.tolist()], type=at).take(pa.array(inv.ravel())))
        else:  # a field the sender's layout does not carry: its default, or null
            d = layout.defaults.get(name)
            if d is None:
                arrays.append(pa.nulls(n, at))
            elif isinstance(d, list):  # an empty list per row: offsets only
                arrays.append(pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)),
                                                       pa.array([], at.value_type)).cast(at))
            else:
                arrays.append(pa.array(np.full(n, d), type=at))
    return pa.Table.from_arrays(arrays, schema=spec.schema)


def rows_to_table(spec: TableSpec, run_id: str, rows: list) -> tuple[pa.Table | None, int]:
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


def conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """``t`` with ``schema``'s columns in its order: a column an older part lacks becomes nulls."""
    if t.schema.equals(schema, check_metadata=False):  # the head's own parts: nothing to do
        return t
    cols = []
    for f in schema:
        if f.name in t.column_names:
            c = t.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=schema)
