"""Compaction: the small part files of a time partition merged into one file, crash-safe.

A head flushing every second writes 3,600 parts an hour per table; readers pay per file. Once an ``hour``
partition is closed (the head stores rows in the current hour only), at the end of a run and when the head stops,
the partition's files are merged into one ``compacted-<ns>-<pid>.parquet``:

1. the merged file is written whole under a dot-name (``.compacted-….parquet.tmp``: no reader or engine lists
   it), its Parquet metadata naming every file it replaces (``ranksight.covers``, transitively: what a replaced
   compacted file replaced too);
2. it is renamed into place (object storage: uploaded under a dot-name, then moved, so it appears whole);
3. the files it covers are removed, once it is ``cleanup_delay`` seconds old (a reader that listed the parts just
   before step 2 can still open them), and again by every later round and head start.

A crash before 2 leaves a dot-file (removed by the next round) and the parts: nothing changed for readers. A crash
between 2 and 3 leaves both: readers skip what a compacted file covers (``ranksight.store_layout.visible``), so no
row is read twice; the next round removes the covered files. Rows never change, so the dedupe indexes (built from
the same rows) are unaffected. External engines (DuckDB, Spark) do not know ``ranksight.covers``: they can see a
partition's rows twice only while a crashed head has not restarted (docs/store.md).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ranksight import store_layout
from ranksight.store_layout import COMPACTED_PREFIX, COVERS_KEY, StoreFile

log = logging.getLogger("ranksight.store")

TMP_SUFFIX = ".tmp"


@dataclass
class Target:
    """Where a run's compacted partitions go: its local table directories (``fs`` None) or a pyarrow filesystem
    (object storage) with the run's directory in it (``run_path``)."""

    fs: object
    run_path: str

    def partition_path(self, table: str, partition: str) -> str:
        return f"{self.run_path}/{table}/{partition}"


def _conform(t: pa.Table, schema: pa.Schema) -> pa.Table:
    """``t`` with ``schema``'s columns in its order: a column an older part lacks becomes nulls."""
    cols = []
    for f in schema:
        if f.name in t.column_names:
            c = t.column(f.name)
            cols.append(c if c.type == f.type else c.cast(f.type))
        else:
            cols.append(pa.nulls(t.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def _read_schema(f: StoreFile) -> pa.Schema:
    with f.open() as fh:
        return pq.read_schema(fh)


def _read(f: StoreFile) -> pa.Table:
    with f.open() as fh:
        return pq.read_table(fh, page_checksum_verification=True)


def merge_to(inputs: list[StoreFile], tmp: Path, fsync: bool) -> tuple[list[str], int]:
    """Write ``inputs`` (one partition's visible files, in order) as one Parquet file at ``tmp``; returns the names
    it covers (inputs read whole, and what compacted inputs covered) and its rows. An input that cannot be read is
    left out and stays where it is (readers count it as damaged, as before)."""
    readable, schemas = [], []
    for f in inputs:
        try:
            schemas.append(_read_schema(f))
            readable.append(f)
        except Exception as e:  # noqa: BLE001 - damaged or foreign file: not merged, not covered
            log.error("store: compaction leaves %s alone (unreadable: %s)", f.path, e)
    if not readable:
        return [], 0
    schema = pa.unify_schemas(schemas, promote_options="permissive")
    covers: list[str] = []
    rows = 0
    writer = pq.ParquetWriter(tmp, schema, write_page_checksum=True)
    try:
        for f in readable:
            try:
                t = _read(f)
            except Exception as e:  # noqa: BLE001
                log.error("store: compaction leaves %s alone (unreadable: %s)", f.path, e)
                continue
            if t.num_rows:
                writer.write_table(_conform(t, schema))
            rows += t.num_rows
            covers.append(f.name)
            covers.extend(sorted(store_layout.read_covers(f)))
        import json

        writer.add_key_value_metadata({COVERS_KEY: json.dumps(sorted(set(covers))).encode()})
    finally:
        writer.close()
    if fsync:
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    return sorted(set(covers)), rows


def compact_partition(inputs: list[StoreFile], table: str, partition: str, local_table_dir: Path,
                      target: Target | None, scratch: Path, fsync: bool = False) -> tuple[StoreFile | None, int]:
    """Merge one partition's visible files into one compacted file at the target; returns it (None when there was
    nothing to merge) and its rows. Does not remove the covered inputs: ``remove_covered`` does, later."""
    name = f"{COMPACTED_PREFIX}{time.time_ns()}-{os.getpid()}.parquet"
    if target is None:
        final_dir = local_table_dir / partition
        final_dir.mkdir(parents=True, exist_ok=True)
        tmp = final_dir / f".{name}{TMP_SUFFIX}"
    else:
        scratch.mkdir(parents=True, exist_ok=True)
        tmp = scratch / f".{name}{TMP_SUFFIX}"
    try:
        covers, rows = merge_to(inputs, tmp, fsync)
        if not covers:
            return None, 0
        size = tmp.stat().st_size
        if target is None:
            os.replace(tmp, final_dir / name)
            return StoreFile(str(final_dir / name), f"{partition}/{name}", size, None, time.time()), rows
        import pyarrow.fs as pafs

        remote_dir = target.partition_path(table, partition)
        remote_tmp = f"{remote_dir}/.{name}{TMP_SUFFIX}"
        target.fs.create_dir(remote_dir, recursive=True)
        pafs.copy_files(str(tmp), remote_tmp, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=target.fs)
        got = target.fs.get_file_info(remote_tmp)
        if got.size != size:  # never publish a short upload
            target.fs.delete_file(remote_tmp)
            raise OSError(f"upload of {remote_tmp} is {got.size} bytes, expected {size}")
        target.fs.move(remote_tmp, f"{remote_dir}/{name}")
        return StoreFile(f"{remote_dir}/{name}", f"{partition}/{name}", size, target.fs, time.time()), rows
    finally:
        tmp.unlink(missing_ok=True)


def _delete(f: StoreFile) -> bool:
    try:
        if f.fs is None:
            os.unlink(f.path)
        else:
            f.fs.delete_file(f.path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("store: cannot remove compacted-away file %s (%s); readers skip it", f.path, e)
        return False


def remove_covered(files: list[StoreFile], now: float, delay: float) -> int:
    """Remove the files that a compacted file at least ``delay`` seconds old covers; returns how many."""
    cov: set[tuple[str, str]] = set()
    for f in files:
        if f.compacted and f.mtime <= now - delay:
            cov.update((f.partition, n) for n in store_layout.read_covers(f))
    return sum(_delete(f) for f in files if (f.partition, f.name) in cov)


def remove_stale_tmp(local_table_dir: Path, older_than: float) -> int:
    """Dot-files a crashed compaction left (``.compacted-….parquet.tmp``) in a table's partitions."""
    n = 0
    if not local_table_dir.is_dir():
        return 0
    for p in local_table_dir.glob(f"*/*/.{COMPACTED_PREFIX}*{TMP_SUFFIX}"):
        try:
            if p.stat().st_mtime <= older_than:
                p.unlink()
                n += 1
        except FileNotFoundError:
            pass
    return n
