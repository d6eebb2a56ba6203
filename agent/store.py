"""The run store: Parquet per run-id, one directory of part files per table.

Layout (a contract users rely on, see docs/data-path.md)::

    <store>/<run-id>/run.json                    the manifest
    <store>/<run-id>/<table>/part-<ns>-<seq>.parquet   for table in STORE_TABLES
    <store>/<run-id>/.head/wal-*.jsonl           the head's write-ahead log (internal)

``pandas.read_parquet("<store>/<run-id>/<table>")`` reads a table. Part files
are written under a dot-name and renamed into place, and pyarrow ignores
dot-files, so a reader never sees half a file, even while the head appends.

Exactly-once: every row has a natural key (``KEYS``). The head acknowledges a
request only after the new rows are in the write-ahead log; rows already seen
(in a part file, the WAL, or the buffer) are dropped. On start the key sets are
rebuilt from the part files and the WAL is replayed, so duplicates are caught
across head restarts and a ``kill -9`` loses nothing that was acknowledged.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ranksight import schema
from ranksight.layout import atomic_write

log = logging.getLogger("ranksight.store")

# The msgspec type of each table's rows.
TABLE_TYPES: dict[str, type] = {
    "steps": schema.StepRecord,
    "collectives": schema.CollectiveRecord,
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
    "collectives": ("rank", "step", "group", "seq"),
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
        # How each column is built from a tuple of Python values: numpy for plain numbers (4-10x
        # faster than pyarrow's per-object conversion), pyarrow otherwise.
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
        # Transpose with C-level astuple + zip (3x faster than a getattr per cell).
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
_wal_decoders = {name: msgspec.json.Decoder(list[typ]) for name, typ in TABLE_TYPES.items()}


class RunStore:
    """One run's tables: dedupe keys, a write-ahead log, buffers, and part files."""

    def __init__(self, root: Path, run_id: str, flush_rows: int = 50_000, fsync: bool = False):
        self.root = root
        self.run_id = run_id
        self.flush_rows = flush_rows
        self.fsync = fsync
        self.lock = threading.Lock()
        self.keys: dict[str, set] = {t: set() for t in SPECS}
        self.buffers: dict[str, list] = {t: [] for t in SPECS}
        self.buffered = 0
        self.rows_stored: dict[str, int] = {t: 0 for t in SPECS}
        self.duplicates = 0
        self.unstorable = 0  # rows dropped at flush because Parquet cannot hold a value (logged)
        self._seq = 0
        self._unflushed_wals: list[Path] = []  # WAL generations whose rows are not all in Parquet yet
        self.head_dir = root / ".head"
        self.head_dir.mkdir(parents=True, exist_ok=True)
        self._load_keys()
        self._replay_wal()
        self._wal = open(self.head_dir / "wal-current.jsonl", "ab")

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
                    t = pq.read_table(p, columns=cols)
                except Exception as e:  # a foreign or damaged file must not stop the head
                    log.error("store: cannot read %s (%s); its rows are not deduplicated against", p, e)
                    continue
                self.rows_stored[name] += t.num_rows
                self.keys[name].update(spec.keys_from_table(t))

    def _replay_wal(self) -> None:
        """Rows acknowledged but not yet in a part file: back into the buffers."""
        wals = sorted(self.head_dir.glob("wal-*.jsonl"))
        replayed = 0
        for w in wals:
            with open(w, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # torn last write: it was never acknowledged
                    table, _, body = line.partition(b"\t")
                    name = table.decode(errors="replace")
                    if name not in _wal_decoders:
                        continue
                    try:
                        rows = _wal_decoders[name].decode(body)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.error("store: unreadable WAL line in %s skipped", w)
                        continue
                    new = self._dedupe(name, rows)
                    self.buffers[name].extend(new)
                    self.buffered += len(new)
                    replayed += len(new)
        if replayed:
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
    def _dedupe(self, table: str, rows: list) -> list:
        spec = SPECS[table]
        if not spec.key:
            return list(rows)
        keys = self.keys[table]
        ks = list(map(spec.key_fn, rows))
        if keys.isdisjoint(ks) and len(set(ks)) == len(ks):  # the common case: all new, no repeats
            keys.update(ks)
            return list(rows)
        new = []
        for k, r in zip(ks, rows):
            if k in keys:
                self.duplicates += 1
                continue
            keys.add(k)
            new.append(r)
        return new

    def add(self, table: str, rows: list, raw: bytes | str | None = None) -> list:
        """Keep the rows not seen before; durable (WAL) when this returns. Returns the new rows.

        ``raw``: the JSON array ``rows`` were decoded from; logged as is when all rows are new
        (the common case), which saves re-encoding them.
        """
        return self.add_chunks(table, [(rows, raw)])

    def add_chunks(self, table: str, chunks: list[tuple[list, bytes | str | None]]) -> list:
        """``add`` for several decoded batches at once: one WAL write, one lock round."""
        tag = table.encode() + b"\t"
        lines = []
        out: list = []
        with self.lock:
            for rows, raw in chunks:
                new = self._dedupe(table, rows)
                if not new:
                    continue
                body = None
                if raw is not None and len(new) == len(rows):
                    body = raw.encode() if isinstance(raw, str) else raw
                    if b"\n" in body:  # pretty-printed by some other client: re-encode to one line
                        body = None
                lines.append(tag + (body if body is not None else _json.encode(new)) + b"\n")
                out.extend(new)
            if not out:
                return out
            self._wal.write(b"".join(lines))
            self._wal.flush()
            if self.fsync:
                os.fsync(self._wal.fileno())
            self.buffers[table].extend(out)
            self.buffered += len(out)
            full = self.buffered >= self.flush_rows
        if full:
            self.flush()
        return out

    # -- flush ------------------------------------------------------------------
    def flush(self) -> int:
        with self.lock:
            return self._flush_locked()

    def _flush_locked(self, reason: str = "") -> int:
        if not self.buffered:
            return 0
        buffers = self.buffers
        self.buffers = {t: [] for t in SPECS}
        n = self.buffered
        self.buffered = 0
        # Rotate the WAL first: the old generation is deleted only once its rows are in parts.
        old_wal = None
        if getattr(self, "_wal", None) is not None:
            self._wal.close()
            old_wal = self.head_dir / f"wal-{time.time_ns()}.jsonl"
            os.replace(self.head_dir / "wal-current.jsonl", old_wal)
            self._wal = open(self.head_dir / "wal-current.jsonl", "ab")
        if old_wal is not None:
            self._unflushed_wals.append(old_wal)
        failed = None
        for table, rows in buffers.items():
            if not rows:
                continue
            if failed is None:
                try:
                    self._write_part(table, rows)
                    continue
                except OSError as e:  # disk full, permissions: keep the rows, try again next flush
                    failed = e
            # not written: back into the buffer (its WAL generation is kept until it is)
            self.buffers[table][:0] = rows
            self.buffered += len(rows)
        if failed is not None:
            log.error("store %s: flush failed (%s); %d rows kept for the next flush", self.run_id, failed,
                      self.buffered)
            return 0
        for w in self._unflushed_wals:
            w.unlink(missing_ok=True)
        self._unflushed_wals = []
        return n

    def _write_part(self, table: str, rows: list) -> None:
        spec = SPECS[table]
        try:
            arrow = spec.to_table(self.run_id, rows)
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
            # A value Parquet cannot hold (e.g. an integer beyond int64: JSON allows it) must not
            # block the table forever: find the rows at fault, drop them loudly, keep the rest.
            good = []
            for r in rows:
                try:
                    spec.to_table(self.run_id, [r])
                    good.append(r)
                except (pa.ArrowException, OverflowError, TypeError, ValueError):
                    self.unstorable += 1
            log.error("store %s/%s: %d row(s) with values Parquet cannot store dropped (%s)", self.run_id, table,
                      len(rows) - len(good), e)
            if not good:
                return
            rows = good
            arrow = spec.to_table(self.run_id, rows)
        d = self.root / table
        d.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        name = f"part-{time.time_ns()}-{os.getpid()}-{self._seq:06d}.parquet"
        tmp = d / f".{name}.tmp"
        pq.write_table(arrow, tmp)
        os.replace(tmp, d / name)
        self.rows_stored[table] += len(rows)

    def close(self) -> None:
        with self.lock:
            self._flush_locked()
            if self._wal is not None:
                self._wal.close()
                self._wal = None
            # nothing left to replay
            for w in self.head_dir.glob("wal-*.jsonl"):
                if w.stat().st_size == 0:
                    w.unlink(missing_ok=True)

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
            if d.is_dir() and (d / ".head").is_dir() and any((d / ".head").glob("wal-*.jsonl")):
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


def read_table(store: str | os.PathLike, run_id: str, table: str, columns: list[str] | None = None):
    """A stored table as a pandas DataFrame (empty with the right columns if nothing is stored yet)."""
    import pandas as pd

    d = Path(store) / run_id / table
    if not d.is_dir() or not any(p.name.startswith("part-") for p in d.iterdir()):
        names = columns or SPECS[table].schema.names
        return pd.DataFrame({n: [] for n in names})
    return pd.read_parquet(d, columns=columns)


def rows_of(records: Iterable[Any]) -> list[dict[str, Any]]:
    return [msgspec.to_builtins(r) for r in records]
