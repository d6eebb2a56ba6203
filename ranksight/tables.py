"""The run store's tables: which record type each holds, its natural key, its Arrow schema, how to read it.

One copy, used by the head's store (writing) and the analyzers' loader (reading)::

    <store>/<run-id>/<table>/run=<run-id>/hour=<YYYY-MM-DDTHH>/{part,compacted}-*.parquet   (table in TABLE_TYPES)
    <store>/<run-id>/<table>/part-*.parquet                  older stores (flat), still read
    <store>/<run-id>/nccl_tests/<table>/part-*.parquet       the collective benchmarks' tables (NCCL_TESTS_SCHEMAS)

Files are written under a dot-name and renamed into place, so a reader that skips dot-files (``part_files``)
never sees half a file; files a compacted file replaces are skipped too (``ranksight.store_layout``, docs/store.md).
``read_table`` is the one reader: every file of a table, concatenated, an unreadable one skipped and counted
(``read_parts``); the store may be a directory or a URI (object storage through pyarrow's filesystems).
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import msgspec
import numpy as np
import pyarrow as pa

from ranksight import schema, store_layout
from ranksight.store_layout import StoreFile

if TYPE_CHECKING:
    import pandas as pd

# The msgspec type of each table's rows.
TABLE_TYPES: dict[str, type] = {
    "steps": schema.StepRecord,
    "collectives": schema.CollectiveRecord,
    "communicators": schema.CommunicatorRecord,
    "events": schema.EventRecord,
    "gpu": schema.GpuSample,
    "host": schema.HostSample,
    "nccl_events": schema.NcclEvent,
    "trace_summaries": schema.TraceSummary,
    "findings": schema.Finding,
    "actions": schema.Action,
    # XID events of the node agents' GPU probes, one row per event.
    "xid": schema.XidEvent,
}
assert set(schema.STORE_TABLES) <= set(TABLE_TYPES)

# Columns added by the store to tables whose record type has no run_id (node-level samples).
RUN_ID_COLUMN = "run_id"

# Natural keys: a row whose key was seen before is a duplicate (at-least-once
# delivery from the agent + this = exactly once in the store). ``attempt`` is in
# the step key: after an elastic restart the same step number is genuinely run
# again and both executions are kept. Findings and actions are made by the head
# itself; actions keep every status change (id, status).
KEYS: dict[str, tuple[str, ...]] = {
    "steps": ("rank", "step", "attempt"),
    "collectives": ("rank", "attempt", "step", "group", "seq"),
    "communicators": ("comm_id",),
    "events": ("rank", "step", "event", "t", "detail"),
    "gpu": ("node", "gpu", "t"),
    "host": ("node", "t"),
    "nccl_events": ("host", "pid", "source_file", "line_no", "category"),
    "trace_summaries": ("rank", "trace_file", "step_start"),
    "findings": (),
    "actions": ("id", "status"),
    "xid": ("node", "gpu", "t", "code"),
}

_json = msgspec.json.Encoder()


def _arrow_type(t: msgspec.inspect.Type) -> tuple[pa.DataType, bool]:
    """(arrow type, stored as JSON text) for a msgspec field type."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        if len(rest) == 1:
            return _arrow_type(rest[0])
        return pa.string(), True
    if isinstance(t, mi.BoolType):
        return pa.bool_(), False
    if isinstance(t, mi.IntType):
        return pa.int64(), False
    if isinstance(t, mi.FloatType):
        return pa.float64(), False
    if isinstance(t, (mi.StrType, mi.LiteralType)):
        return pa.string(), False
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.IntType):
        return pa.list_(pa.int64()), False
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.StrType):
        return pa.list_(pa.string()), False
    # dicts, lists of dicts, Any: JSON text keeps one schema across part files
    return pa.string(), True


class TableSpec:
    """Arrow schema and row->column conversion of one table, derived from the record type."""

    def __init__(self, name: str, typ: type):
        self.name = name
        self.type = typ
        info = msgspec.inspect.type_info(typ)
        self.fields: list[tuple[str, pa.DataType, bool]] = []
        # How each column is built from a tuple of Python values: numpy for plain numbers (far cheaper
        # than pyarrow's per-object conversion), pyarrow otherwise.
        self.builders = []
        for f in info.fields:
            at, as_json = _arrow_type(f.type)
            self.fields.append((f.name, at, as_json))
            nullable = isinstance(f.type, msgspec.inspect.UnionType)
            if as_json:
                self.builders.append(_json_column)
            elif at == pa.float64():
                self.builders.append(_float_column)  # None -> NaN -> null (msgspec never yields NaN)
            elif at == pa.int64():
                self.builders.append(_nullable_int_column if nullable else _int_column)
            elif at == pa.bool_() and not nullable:
                self.builders.append(_bool_column)
            else:
                self.builders.append(lambda col, at=at: pa.array(col, at))
        self.has_run_id = any(n == RUN_ID_COLUMN for n, _, _ in self.fields)
        cols = [pa.field(n, t) for n, t, _ in self.fields]
        if not self.has_run_id:
            cols.insert(0, pa.field(RUN_ID_COLUMN, pa.string()))
        self.schema = pa.schema(cols, metadata={b"ranksight.schema_version": str(schema.SCHEMA_VERSION).encode()})
        self.json_fields = {n for n, _, j in self.fields if j}
        self.key = KEYS[name]
        # The key of a row: a C-level attrgetter when no key column is stored as JSON.
        if self.key and not (set(self.key) & self.json_fields):
            getter = operator.attrgetter(*self.key)
            self.key_fn = getter if len(self.key) > 1 else (lambda r, g=getter: (g(r),))
        else:
            self.key_fn = self.key_of

    def key_of(self, rec) -> tuple:
        if not self.key:
            return ()
        out = []
        for k in self.key:
            v = getattr(rec, k)
            if k in self.json_fields or isinstance(v, (dict, list)):
                v = _json.encode(v).decode()
            out.append(v)
        return tuple(out)

    def to_table(self, run_id: str, rows: list) -> pa.Table:
        arrays = []
        if not self.has_run_id:
            arrays.append(pa.array([run_id] * len(rows), pa.string()))
        # Transpose with C-level astuple + zip (cheaper than a getattr per cell).
        cols = zip(*map(msgspec.structs.astuple, rows)) if rows else [() for _ in self.fields]
        for build, col in zip(self.builders, cols):
            arrays.append(build(col))
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def keys_from_table(self, table: pa.Table) -> Iterable[tuple]:
        if not self.key:
            return []
        cols = [table.column(k).to_pylist() for k in self.key]
        return zip(*cols)


def _json_column(col) -> pa.Array:
    return pa.array([None if v is None else _json.encode(v).decode() for v in col], pa.string())


def _float_column(col) -> pa.Array:
    try:
        return pa.array(np.array(col, dtype=np.float64), type=pa.float64(), from_pandas=True)
    except (TypeError, ValueError):
        return pa.array(col, pa.float64())


def _int_column(col) -> pa.Array:
    try:
        return pa.array(np.array(col, dtype=np.int64), type=pa.int64())
    except (TypeError, ValueError, OverflowError):
        return pa.array(col, pa.int64())


def _nullable_int_column(col) -> pa.Array:
    return pa.array(col, pa.int64())


def _bool_column(col) -> pa.Array:
    return pa.array(np.array(col, dtype=np.bool_), type=pa.bool_())


SPECS = {name: TableSpec(name, typ) for name, typ in TABLE_TYPES.items()}


# ---------------------------------------------------------------------------
# The collective benchmarks' tables (nccl_tests writes them, the comm analyzer reads ``perf``)
# ---------------------------------------------------------------------------

NCCL_TESTS_DIR = "nccl_tests"

PERF_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("op", pa.string()),
    ("size", pa.int64()),
    ("count", pa.int64()),
    ("dtype", pa.string()),
    ("redop", pa.string()),
    ("root", pa.int64()),
    ("in_place", pa.bool_()),
    ("time_us", pa.float64()),
    ("algbw", pa.float64()),
    ("busbw", pa.float64()),
    ("busbw_factor", pa.float64()),
    ("wrong", pa.int64()),
    ("per_rank_time_us", pa.list_(pa.float64())),
    ("nranks", pa.int64()),
    ("nnodes", pa.int64()),
    ("backend", pa.string()),
    ("device", pa.string()),
    ("hosts", pa.list_(pa.string())),
    ("nodes", pa.list_(pa.string())),
    ("iters", pa.int64()),
    ("warmup_iters", pa.int64()),
    ("time_agg", pa.string()),
    ("t", pa.float64()),
    ("schema_version", pa.int64()),
])

PAIRS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("rank_a", pa.int64()),
    ("rank_b", pa.int64()),
    ("node_a", pa.string()),
    ("node_b", pa.string()),
    ("host_a", pa.string()),
    ("host_b", pa.string()),
    ("size", pa.int64()),
    ("iters", pa.int64()),
    ("time_us", pa.float64()),
    ("bw", pa.float64()),
    ("median_bw", pa.float64()),
    ("ratio", pa.float64()),
    ("flagged", pa.bool_()),
    ("threshold", pa.float64()),
    ("nranks", pa.int64()),
    ("backend", pa.string()),
    ("t", pa.float64()),
    ("schema_version", pa.int64()),
])

ENTITIES_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("kind", pa.string()),
    ("name", pa.string()),
    ("ranks", pa.list_(pa.int64())),
    ("nodes", pa.list_(pa.string())),
    ("bw", pa.float64()),
    ("reference", pa.float64()),
    ("ratio", pa.float64()),
    ("flagged", pa.bool_()),
    ("explained_by", pa.string()),
    ("threshold", pa.float64()),
    ("nranks", pa.int64()),
    ("backend", pa.string()),
    ("t", pa.float64()),
    ("schema_version", pa.int64()),
])

NCCL_TESTS_SCHEMAS = {"perf": PERF_SCHEMA, "health_pairs": PAIRS_SCHEMA, "health_entities": ENTITIES_SCHEMA}


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def part_files(table_dir: str | os.PathLike) -> list[Path | StoreFile]:
    """The Parquet files a reader reads of one table directory (a local path or a store URI), oldest first: the
    Hive partitions (``run=…/hour=…``) and the flat parts of older stores, dot-files (being written) and files a
    compacted file replaces left out (``ranksight.store_layout``), plus the run's compacted partitions a head put
    on object storage (``remote.json``). Local files are ``Path``; remote ones ``StoreFile`` (read them with
    ``read_parts``)."""
    return [Path(f.path) if f.fs is None else f for f in store_layout.table_files(table_dir)]


def _read_file(f: Path | StoreFile, columns: list[str] | None) -> "pd.DataFrame":
    import pandas as pd

    # page checksums (the head writes them) are verified: a corrupted page fails here instead of reading back as
    # garbage numbers
    if isinstance(f, StoreFile) and f.fs is not None:
        return pd.read_parquet(f.path, filesystem=f.fs, columns=columns, page_checksum_verification=True)
    return pd.read_parquet(os.fspath(f), columns=columns, page_checksum_verification=True)


def _read_files(files: list, columns: list[str] | None,
                on_file: Callable[[Path], None] | None) -> tuple[list["pd.DataFrame"], int, int]:
    """(frames, unreadable files, files gone since the listing: removed by a compaction's cleanup)."""
    frames, bad, gone = [], 0, 0
    for f in files:
        try:
            frames.append(_read_file(f, columns))
        except FileNotFoundError:
            gone += 1
        except Exception:  # noqa: BLE001 - a damaged or foreign file: skip it and count it
            bad += 1
        if on_file is not None:
            on_file(f)
    return frames, bad, gone


def _concat(frames: list["pd.DataFrame"]) -> "pd.DataFrame":
    import pandas as pd

    frames = [fr for fr in frames if not fr.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def read_parts(files: list, columns: list[str] | None = None,
               on_file: Callable[[Path], None] | None = None) -> tuple["pd.DataFrame", int]:
    """The part files concatenated (an empty frame without columns when none has rows), and how many could not
    be read (a damaged or foreign file is skipped, never fatal; so is one a compaction removed since the listing,
    which ``read_table`` avoids by listing again). ``on_file`` is called after each file."""
    frames, bad, gone = _read_files(files, columns, on_file)
    return _concat(frames), bad + gone


def read_table(store: str | os.PathLike, run_id: str, table: str, columns: list[str] | None = None) -> "pd.DataFrame":
    """A stored table as a pandas DataFrame (empty with the table's columns if nothing is stored yet). ``store`` is
    a directory or a URI (``s3://bucket/prefix``: what a head compacted there)."""
    import pandas as pd

    table_dir = store_layout.join(store, run_id, table)
    for _attempt in range(3):
        frames, _bad, gone = _read_files(part_files(table_dir), columns, None)
        if not gone:  # else a compaction replaced files while we read: its merged file holds their rows; list again
            break
    df = _concat(frames)
    if df.empty:
        names = columns or SPECS[table].schema.names
        return pd.DataFrame({n: [] for n in names})
    return df
