"""Compaction: the small part files of a time partition merged into one file, crash-safe.

A head flushing every second writes 3,600 parts an hour per table; readers pay per file. Once an ``hour``
partition is closed (the head stores rows in the current hour only), at the end of a run and when the head stops,
the partition's files are merged into one ``compacted-<ns>-<pid>.parquet``:

1. the merged file is written whole under a dot-name (``.compacted-….parquet.tmp``: no reader or engine lists
   it), its Parquet metadata naming every file it replaces (``ranksight.covers``, transitively: what a replaced
   compacted file replaced too), and, when the rows come strictly in the loader's key order, that they do
   (``ranksight.sorted``, ``ranksight.sort_marker``: ``diagnose`` then skips its sort and dedupe);
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

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from head.store import sorted_merge
from head.store.arrow import conform
from ranksight import store_layout
from ranksight.sort_marker import OrderCheck
from ranksight.store_layout import COMPACTED_PREFIX, COVERS_KEY, StoreFile

log = logging.getLogger("ranksight.store")

TMP_SUFFIX = ".tmp"
SPILL_SUFFIX = ".spill.arrow" + TMP_SUFFIX  # the sort's spill beside the output: a dot-name, cleared like it
SORT = True  # steps and collectives written in the loader's key order (``sorted_merge``)
PREFETCH = 8  # input files read ahead of the writer
# Rows per row group of a merged file (one write per part would leave the parts' tiny row groups, and readers pay
# per row group much as they paid per file); at most this many rows are held before a write.
ROW_GROUP_ROWS = 131_072


@dataclass
class Target:
    """Where a run's compacted partitions go: its local table directories (``fs`` None) or a pyarrow filesystem
    (object storage) with the run's directory in it (``run_path``)."""

    fs: object
    run_path: str

    def partition_path(self, table: str, partition: str) -> str:
        return f"{self.run_path}/{table}/{partition}"


def _read_schema(f: StoreFile) -> pa.Schema:
    with f.open() as fh:
        return pq.read_schema(fh)


# An input with more rows than this (an earlier compacted file of the hour, after a restart; a store compacted
# again) is read a row group at a time, so the merge never holds a whole partition's rows.
BIG_INPUT_ROWS = 4 * ROW_GROUP_ROWS


class _Big:
    """An input read a row group at a time by the writer (not prefetched whole)."""

    def __init__(self, f: StoreFile):
        self.f = f

    def tables(self):
        with self.f.open() as fh:
            pf = pq.ParquetFile(fh, page_checksum_verification=True)
            for i in range(pf.num_row_groups):
                yield pf.read_row_group(i)


def _read(f: StoreFile) -> pa.Table | _Big:
    with f.open() as fh:
        pf = pq.ParquetFile(fh, page_checksum_verification=True)
        if pf.metadata.num_rows > BIG_INPUT_ROWS:
            return _Big(f)
        return pf.read()


class _SchemaChanged(Exception):
    """An input does not fit the schema the merge started with (a part of an older or newer writer)."""


def _prefetched(files: list[StoreFile], ahead: int = PREFETCH):
    """(file, table or the exception reading it) in order, ``ahead`` files read in parallel threads (pyarrow reads
    and decompresses without the GIL); at most ``ahead`` tables in memory beyond the one being written."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    def read(f):
        try:
            return _read(f)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            return e

    with ThreadPoolExecutor(max_workers=min(ahead, 4)) as pool:
        queue: deque = deque()
        it = iter(files)
        for f in it:
            queue.append((f, pool.submit(read, f)))
            if len(queue) >= ahead:
                break
        while queue:
            f, fut = queue.popleft()
            nxt = next(it, None)
            if nxt is not None:
                queue.append((nxt, pool.submit(read, nxt)))
            yield f, fut.result()


# Snappy: the codec every Parquet engine reads (Spark 3.2-3.4's parquet-mr, Trino, Athena, DuckDB, pyarrow). "lz4"
# (Parquet's LZ4_RAW) decompresses faster (a shorter load in diagnose: bench/RESULTS.md DG3) and makes
# slightly smaller files, but engines built on parquet-mr before 1.13 (Spark before 3.5) cannot read it, and a
# store any engine can read is the point of the store's layout.
COMPRESSION = "snappy"


def writer_options(schema: pa.Schema) -> dict:
    """How a compacted file encodes its columns: dictionaries for strings and integers (few distinct values per row
    group: ranks, steps, groups, hosts), none for floats (durations and clocks rarely repeat: a dictionary is tried,
    fails and falls back to plain pages, at a cost to writer and reader), whose bytes are split by position instead
    (BYTE_STREAM_SPLIT: exponents and high bytes together compress better). Pages compressed with ``COMPRESSION``
    (snappy; DuckDB reads them: tested), snappy where this pyarrow lacks the codec set there."""
    def leaf(t: pa.DataType) -> pa.DataType:
        while pa.types.is_list(t) or pa.types.is_large_list(t):
            t = t.value_type
        return t

    dict_cols, split_cols = [], []
    for f in schema:
        t = leaf(f.type)
        name = f.name if t is f.type else None  # list columns: pyarrow names their leaf; left at its default
        if name is None:
            continue
        if pa.types.is_floating(t):
            split_cols.append(name)
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) \
                or pa.types.is_dictionary(t) or pa.types.is_boolean(t):
            dict_cols.append(name)
    return {"compression": COMPRESSION if pa.Codec.is_available(COMPRESSION) else "snappy",
            "use_dictionary": dict_cols, "use_byte_stream_split": split_cols or False}


def _write_all(inputs: list[StoreFile], tmp: Path, schema: pa.Schema, strict: bool, table: str = ""
               ) -> tuple[list[str], int]:
    """Write the inputs' rows in ``schema`` to ``tmp``; ``strict``: an input with a column the schema lacks, or a
    type it cannot be cast to, raises _SchemaChanged (the caller then unifies all inputs' schemas first). The rows
    of a table with a loader key (steps, collectives) are written in that key's order (``sorted_merge``: an
    external sort through a spill file beside ``tmp``); when they come strictly in that order (no key twice), the
    file says so (``ranksight.sort_marker``)."""
    order = OrderCheck(table)
    covers: list[str] = []
    rows = 0
    pending: list[pa.Table] = []  # the parts are small: gathered into row groups of ROW_GROUP_ROWS
    pending_rows = 0
    writer = pq.ParquetWriter(tmp, schema, write_page_checksum=True, **writer_options(schema))
    spill = keys = None
    if SORT and sorted_merge.sortable(table):
        spill = sorted_merge.Spill(tmp.with_name(tmp.name[:-len(TMP_SUFFIX)] + SPILL_SUFFIX), schema)
        keys = sorted_merge.Keys(table)

    def write_pending() -> None:
        nonlocal pending, pending_rows
        if pending:
            writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
        pending, pending_rows = [], 0

    try:
        for f, got in _prefetched(inputs):
            if isinstance(got, Exception):
                log.error("store: compaction leaves %s alone (unreadable: %s)", f.path, got)
                continue
            # a big input in row groups: one that fails part way fails the merge (the inputs stay as they are)
            for t in (got.tables() if isinstance(got, _Big) else (got,)):
                if strict and not set(t.column_names) <= set(schema.names):
                    raise _SchemaChanged(f.path)
                try:
                    t = conform(t, schema)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
                    if strict:
                        raise _SchemaChanged(f.path) from e
                    if isinstance(got, _Big):
                        raise
                    log.error("store: compaction leaves %s alone (%s)", f.path, e)
                    break
                if t.num_rows:
                    if spill is not None:
                        keys.add(t)
                        spill.append(t)
                    else:
                        order.add(t)
                        pending.append(t)
                        pending_rows += t.num_rows
                        if pending_rows >= ROW_GROUP_ROWS:
                            write_pending()
                rows += t.num_rows
            else:
                covers.append(f.name)
                covers.extend(store_layout.read_covers(f))
        if spill is not None:
            spill.finish()
            pa.default_memory_pool().release_unused()  # the inputs' pages back before the sort's arrays
            at = sorted_merge.row_order(table, keys)
            keys = None
            for lo in range(0, len(at), sorted_merge.SLICE_ROWS):
                t = spill.take(at[lo:lo + sorted_merge.SLICE_ROWS])
                order.add(t)
                writer.write_table(t, row_group_size=ROW_GROUP_ROWS)
                del t
        write_pending()
        writer.add_key_value_metadata({COVERS_KEY: json.dumps(sorted(set(covers))).encode(), **order.metadata()})
    finally:
        writer.close()
        if spill is not None:
            spill.close()
    return sorted(set(covers)), rows


def merge_to(inputs: list[StoreFile], tmp: Path, fsync: bool, schema: pa.Schema | None = None, table: str = ""
             ) -> tuple[list[str], int]:
    """Write ``inputs`` (one partition's visible files, in order) as one Parquet file at ``tmp``; returns the names
    it covers (inputs read whole, and what compacted inputs covered) and its rows. An input that cannot be read is
    left out and stays where it is (readers count it as damaged, as before).

    ``schema`` (the table's, ``ranksight.tables.SPECS``): what the head's own parts have, so each input is opened
    once; when one does not fit, every input's schema is read and unified (a column an older part lacks: nulls).
    ``table``: the table's name, for the sorted marker (``ranksight.sort_marker``; none when not given)."""
    try:
        if schema is None:
            raise _SchemaChanged("no schema given")
        covers, rows = _write_all(inputs, tmp, schema, strict=True, table=table)
    except _SchemaChanged as e:
        log.info("store: compaction unifies the schemas of %d files (%s differs)", len(inputs), e)
        schemas = []
        for f in inputs:
            try:
                schemas.append(_read_schema(f))
            except Exception:  # noqa: BLE001 - left out when read (and logged there)
                pass
        if not schemas:
            return [], 0
        covers, rows = _write_all(inputs, tmp, pa.unify_schemas(schemas, promote_options="permissive"), strict=False,
                                  table=table)
    if fsync:
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    return covers, rows


def compact_partition(inputs: list[StoreFile], table: str, partition: str, local_table_dir: Path,
                      target: Target | None, scratch: Path, fsync: bool = False,
                      schema: pa.Schema | None = None) -> tuple[StoreFile | None, int]:
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
        covers, rows = merge_to(inputs, tmp, fsync, schema, table)
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
    pattern = f".{COMPACTED_PREFIX}*{TMP_SUFFIX}"  # hour partitions, and the flat parts ``ranksight compact`` merges
    for p in itertools.chain(local_table_dir.glob(f"*/*/{pattern}"), local_table_dir.glob(pattern)):
        try:
            if p.stat().st_mtime <= older_than:
                p.unlink()
                n += 1
        except FileNotFoundError:
            pass
    return n


def recompact_table(table_dir: Path, table: str, schema: pa.Schema | None = None) -> dict[str, int]:
    """Compact again the partitions of a run's table (a local store no head is writing): each partition that is not
    already one compacted file (in key order and marked, for a table with a loader key) is merged into one, and the
    files it covers are removed; the flat parts of an older store (no hour partitions) are one partition here. For
    stores an earlier head compacted without sorting (``ranksight compact``). Returns counts: partitions merged,
    rows, partitions marked sorted, files removed."""
    from ranksight.sort_marker import read_marker

    out = {"partitions": 0, "rows": 0, "marked": 0, "removed": 0}
    remove_stale_tmp(table_dir, time.time())
    files = store_layout.list_table(table_dir)
    out["removed"] += remove_covered(files, time.time(), 0)
    by_part: dict[str, list[StoreFile]] = {}
    for f in store_layout.visible(store_layout.list_table(table_dir)):
        # the hour partitions, and the flat parts of older stores (".": one partition; a head leaves those alone,
        # as it may still be writing them)
        if f.partition == "." or f.partition.startswith(f"{store_layout.RUN_KEY}="):
            by_part.setdefault(f.partition, []).append(f)
    for part, fs in sorted(by_part.items()):
        if len(fs) == 1 and fs[0].compacted and (not (SORT and sorted_merge.sortable(table))
                                                 or read_marker(_metadata(fs[0]), table) is not None):
            continue
        new, rows = compact_partition(fs, table, part, table_dir, None, table_dir / ".compact", schema=schema)
        if new is None:
            continue
        out["partitions"] += 1
        out["rows"] += rows
        out["marked"] += read_marker(_metadata(new), table) is not None
        out["removed"] += remove_covered(fs + [new], time.time(), 0)
    return out


def _metadata(f: StoreFile) -> dict | None:
    with f.open() as fh:
        return pq.read_metadata(fh).metadata
