"""One run's tables in the store: dedupe indexes, the write-ahead log, a queue, buffers, part files."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from head.store import compaction
from head.store.arrow import merge_packed, packed_to_table, rows_to_table
from head.store.dedupe import make_index
from head.store.wal import WriteAheadLog, json_entry, read_batches
from ranksight import schema, store_layout, wire
from ranksight.layout import atomic_write
from ranksight.store_layout import StoreFile
from ranksight.tables import SPECS, TableSpec

log = logging.getLogger("ranksight.store")

_json = msgspec.json.Encoder()

# A closed hour is compacted this long after it ends (a flush that began just before the hour turned has landed).
CLOSE_GRACE_S = 60.0
# Covered files outlive their compacted file this long: a reader that listed them just before may still open them.
CLEANUP_DELAY_S = 10.0


# String columns with a value per node, GPU or communicator (thousands of distinct values in a big job's flush): a
# dictionary page as large as the column, built by hashing every row, costs more than it saves in a fresh part
# (compaction writes the hour's file with its own encodings). Per-job values (run id, op, source) keep theirs.
_PER_ENTITY_COLUMNS = frozenset({"host", "group", "comm_id", "uuid"})


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    return [f.name for f in schema if (pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
            or (pa.types.is_list(f.type) and pa.types.is_string(f.type.value_type)))
            and f.name not in _PER_ENTITY_COLUMNS]


def _statistics_columns(table: str, schema: pa.Schema) -> list[str] | bool:
    """The columns a part file keeps min/max statistics for: the table's key (and its time column)."""
    spec = SPECS.get(table)
    want = [c for c in (*(spec.key if spec else ()), "step", "t", "t_start") if c in schema.names]
    return list(dict.fromkeys(want)) or True


def part_files(table_dir: Path) -> list[StoreFile]:
    """The files of one table a reader reads (``ranksight.store_layout.table_files``: local Hive partitions and
    flat parts of older stores, plus compacted partitions on object storage; covered files left out)."""
    return store_layout.table_files(table_dir)


def read_part_keys(path: Path | StoreFile, spec: TableSpec) -> pa.Table:
    """The key columns of a part file (its first column for a table without a key), a key column the part predates
    filled with zeros (e.g. collectives' ``attempt``; nulls too: a compacted file that merged such a part holds
    nulls there)."""
    f = path if isinstance(path, StoreFile) else StoreFile(str(path), Path(path).name, 0)
    cols = list(spec.key) or [spec.schema.names[0]]
    with f.open() as fh:
        pf = pq.ParquetFile(fh)
        have = set(pf.schema_arrow.names)
        t = pf.read(columns=[c for c in cols if c in have])
    for c in cols:
        if c not in have:
            t = t.append_column(c, pa.array([0] * t.num_rows, type=spec.schema.field(c).type))
        elif pa.types.is_integer(t.schema.field(c).type) and t.column(c).null_count:
            t = t.set_column(t.schema.get_field_index(c), c, pc.fill_null(t.column(c), 0))
    return t.select(cols)


class RunStore:
    """One run's tables: dedupe indexes, a write-ahead log, a queue, buffers, part files.

    Two ways in:
    - ``add`` (tests, the head's own findings/actions): decoded records are deduplicated at once,
      logged, buffered as an Arrow table; the new records are returned.
    - ``enqueue_packed`` / ``enqueue_rows`` (the head's ingest): batches are only logged and
      queued, and the request is acknowledged once they are in the WAL. ``process`` (run at every
      flush, before ``add`` of the same table, before any view of the live window, and when the
      queue is large) takes all queued batches of a table at once: packed ones become one numpy
      array (one ``np.frombuffer`` over the concatenated bodies), decoded ones one list; the keys
      are deduplicated vectorized, the new rows become one Arrow table, and ``on_new`` hands it
      to the head (live window, counters). So the per-request work is a WAL append, and the
      per-row work runs in C over a whole flush: no Python object per packed record.

    On start the indexes are rebuilt from the part files and the WAL is replayed through the same
    dedupe, so duplicates are caught across head restarts and a ``kill -9`` loses nothing that was
    acknowledged.
    """

    def __init__(self, root: Path, run_id: str, flush_rows: int = 50_000, fsync: bool = False,
                 compact_to: str | None = None, clock: Callable[[], float] = time.time,
                 cleanup_delay: float = CLEANUP_DELAY_S):
        self.root = root
        self.run_id = run_id
        self.flush_rows = flush_rows
        # Two locks, so that ingest never waits out a flush: ``lock`` is short (the WAL append and the queue, the
        # buffers and their counts), ``process_lock`` serializes what turns the queue into rows and parts (the dedupe
        # indexes, the order the live window is fed in, the part files). Taken in that order when both are.
        self.lock = threading.RLock()
        self.process_lock = threading.RLock()
        # compaction (head/store/compaction.py): its own lock, so ingest and flushes never wait on a merge
        self.compact_lock = threading.Lock()
        self.clock = clock  # the time that names the hour partition a flush writes into
        self.cleanup_delay = cleanup_delay
        self.ended = False  # the manifest says the run finished: its open partition is compacted too
        self.target: compaction.Target | None = None
        if compact_to is None:
            # a run whose compacted hours went to object storage goes on there: merging its local parts here too
            # would merge rows that a remote file already covers, and readers would see them twice
            compact_to = store_layout.remote_of(root)
        if compact_to is not None:
            fs, base = store_layout.open_location(compact_to)
            self.target = compaction.Target(fs, f"{base}/{run_id}")
            link = msgspec.json.encode({"compacted_to": compact_to})
            if store_layout.remote_of(root) != compact_to:
                atomic_write(root / store_layout.REMOTE_LINK, link)
        self.indexes = {t: make_index(t) for t in SPECS}
        self.buffers: dict[str, list[pa.Table]] = {t: [] for t in SPECS}
        self.buffered_rows: dict[str, int] = {t: 0 for t in SPECS}
        self.buffered = 0
        # the queue: per table, packed bodies (layout, body) in arrival order (one array when processed) and decoded
        # row lists
        self.q_packed: dict[str, list[tuple[Any, bytes]]] = {t: [] for t in SPECS}
        self.q_rows: dict[str, list[list]] = {t: [] for t in SPECS}
        self.pending_rows = 0  # rows queued, or taken from the queue and not yet processed
        self.rows_stored: dict[str, int] = {t: 0 for t in SPECS}
        self.duplicates = 0
        self.unstorable = 0  # rows dropped because Parquet cannot hold a value (logged)
        # Called (under ``process_lock``, in arrival order) as on_new(table, Arrow table of the new rows or None, the
        # new rows as structs or None, rows in, rows new) for every processed queue; the head feeds its live window
        # and counters with it.
        self.on_new: Callable[..., Any] | None = None
        self._seq = 0
        self.fsync_compacted = fsync
        self._manifest_uploaded: float | None = None  # mtime of the run.json last copied to a remote target
        self.wal = WriteAheadLog(root / ".head", fsync)
        self._cleanup_at_start()
        self._load_keys()
        self._replay_wal()
        self.wal.open()

    # -- startup --------------------------------------------------------------
    def _load_keys(self) -> None:
        for name, spec in SPECS.items():
            try:
                files = part_files(self.root / name)
            except store_layout.StoreLocationError as e:  # object storage unreachable: say what that costs
                log.error("store %s/%s: %s; rows compacted there are not deduplicated against", self.run_id, name, e)
                files = [f for f in store_layout.visible(store_layout.list_table(self.root / name))]
            for p in files:
                try:
                    t = read_part_keys(p, spec)
                except Exception as e:  # a foreign or damaged file must not stop the head
                    log.error("store: cannot read %s (%s); its rows are not deduplicated against", p, e)
                    continue
                self.rows_stored[name] += t.num_rows
                self.indexes[name].add_table(t)

    def _replay_wal(self) -> None:
        """Rows acknowledged but not yet in a part file: back into the buffers (through the dedupe)."""
        wals = self.wal.leftover_files()
        before = self.buffered
        for w in wals:
            for b in read_batches(w):
                if b.rows is not None:
                    self.q_rows[b.table].append(b.rows)
                    self.pending_rows += len(b.rows)
                else:
                    self.q_packed[b.table].append((b.layout, b.payload))
                    self.pending_rows += b.count
        self._process_locked()
        replayed = self.buffered - before
        if replayed > 0:
            log.info("store %s: replayed %d rows from the write-ahead log", self.run_id, replayed)
        # Rewrite them as one fresh WAL generation, then drop the old files.
        if wals:
            self._flush_locked()
            if self.buffered:  # could not write Parquet now: keep the old WAL files for the next start
                self.wal.retain(wals)
            else:
                for w in wals:
                    w.unlink(missing_ok=True)

    # -- ingest ---------------------------------------------------------------
    def _buffer(self, table: str, t: pa.Table) -> None:
        self.buffers[table].append(t)
        self.buffered_rows[table] += t.num_rows
        self.buffered += t.num_rows

    def add(self, table: str, rows: list) -> list:
        """Keep the rows not seen before; durable (WAL) when this returns. Returns the new rows."""
        with self.process_lock:
            self._process_locked(table)  # queued rows first: they were acknowledged earlier
            # logged before they are marked as seen: if the log refuses them (a full disk), a retry is not a duplicate
            with self.lock:
                self.wal.append(json_entry(table, _json.encode(rows)))
            new = self.indexes[table].new_rows(rows)
            self.duplicates += len(rows) - len(new)
            if new:
                t, dropped = rows_to_table(SPECS[table], self.run_id, new)
                self.unstorable += dropped
                if t is not None:
                    with self.lock:
                        self._buffer(table, t)
            full = self.buffered + self.pending_rows >= self.flush_rows
        if full:
            self.flush()
        return new

    def enqueue_rows(self, table: str, chunks: list[tuple[list, bytes | str | None]]) -> None:
        """Queue decoded batches (rows, the JSON they came from); durable (WAL) when this returns."""
        self.enqueue([(table, [], chunks)])

    def enqueue_packed(self, table: str, batches: list) -> None:
        """Queue packed batches (``ranksight.wire.PackedBatch``: layout, payload, count); durable (WAL)
        when this returns."""
        self.enqueue([(table, batches, [])])

    def enqueue(self, work: list[tuple[str, list, list]]) -> None:
        """Queue one request's batches of this run, ``(table, packed batches, decoded chunks)`` per table, under one
        lock and in one write-ahead-log write (one system call per request, not one per table); durable when this
        returns. The lock is the short one: a flush processing and writing the rows queued before does not hold
        it."""
        entries = []
        for table, _, chunks in work:
            for rows, raw in chunks:
                body = raw.encode() if isinstance(raw, str) else raw
                entries.append(json_entry(table, body if body is not None else _json.encode(rows)))
        with self.lock:
            self.wal.append_entries([(t, p) for t, p, _ in work if p], entries)
            for table, packed, chunks in work:
                q = self.q_packed[table]
                for b in packed:
                    q.append((b.layout, b.payload))  # no copy here: the bodies are joined once, when processed
                    self.pending_rows += b.count
                rq = self.q_rows[table]
                for rows, _ in chunks:
                    rq.append(rows)
                    self.pending_rows += len(rows)
            if self.buffered + self.pending_rows < self.flush_rows:
                return
        self.flush()

    def process(self) -> int:
        """Dedupe the queued batches into the buffers (feeding ``on_new``); returns the number of new rows."""
        with self.process_lock:
            return self._process_locked()

    def _take_queue(self, only: str | None = None) -> list[tuple[str, list, list]]:
        """The queued batches of ``only`` (every table when None), ``(table, packed, row lists)`` each, taken out of
        the queue (under ``lock``). Their rows stay counted in ``pending_rows`` until ``_process_taken`` is done
        with them, so a view that finds rows pending waits for that processing (``process_lock``)."""
        out = []
        for table in ([only] if only else list(SPECS)):
            packed, rowlists = self.q_packed[table], self.q_rows[table]
            if packed or rowlists:
                self.q_packed[table], self.q_rows[table] = [], []
                out.append((table, packed, rowlists))
        return out

    def _process_locked(self, only: str | None = None) -> int:
        """The queue into the buffers; the caller holds ``process_lock`` (not ``lock``: ingest goes on meanwhile)."""
        if not self.pending_rows:
            return 0
        with self.lock:
            taken = self._take_queue(only)
        total = 0
        for table, t in self._process_taken(taken):
            with self.lock:
                self._buffer(table, t)
            total += t.num_rows
        return total

    def _process_taken(self, taken: list[tuple[str, list, list]]) -> list[tuple[str, pa.Table]]:
        """Taken batches deduplicated (vectorized: one array per table) into Arrow tables of their new rows, in
        arrival order, ``on_new`` fed with each; the caller holds ``process_lock``."""
        out = []
        for table, packed, rowlists in taken:
            index = self.indexes[table]
            if packed:  # one array in arrival order, whatever the layouts (the live window keeps arrival order)
                n = sum(len(body) // lay.dtype.itemsize for lay, body in packed)
                try:
                    arr, lay = merge_packed(wire.KIND_OF_TABLE[table], packed)
                    mask = index.new_packed(arr, lay)
                    k = int(np.count_nonzero(mask))
                    self.duplicates += n - k
                    t = None
                    if k:
                        try:
                            t = packed_to_table(table, self.run_id, arr if k == n else arr[mask], lay)
                        except (pa.ArrowException, ValueError, TypeError) as e:  # never expected: layouts are checked
                            log.error("store %s/%s: %d packed rows not convertible, dropped: %s", self.run_id, table,
                                      k, e)
                            self.unstorable += k
                    if t is not None:
                        out.append((table, t))
                    if self.on_new is not None:
                        self.on_new(table, t, None, n, k)
                finally:
                    with self.lock:
                        self.pending_rows -= n
            if rowlists:
                rows = rowlists[0] if len(rowlists) == 1 else [r for rl in rowlists for r in rl]
                n = len(rows)
                try:
                    new = index.new_rows(rows)
                    self.duplicates += n - len(new)
                    t = None
                    if new:
                        t, dropped = rows_to_table(SPECS[table], self.run_id, new)
                        self.unstorable += dropped
                        if t is not None:
                            out.append((table, t))
                    if self.on_new is not None:
                        self.on_new(table, t, new, n, len(new))
                finally:
                    with self.lock:
                        self.pending_rows -= n
        return out

    # -- flush ------------------------------------------------------------------
    def flush(self) -> int:
        """Process the queue and write the buffers as one part file per table; returns the rows written."""
        with self.process_lock:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        """The flush; the caller holds ``process_lock``. Under ``lock``, briefly: the queue and the buffers are
        taken and the WAL rotated, together, so every row of the old generations is in what this flush writes and
        every row logged after is in the new generation and the new queue. Then, with ingest going on: the taken
        queue processed, the parts written, and the old generations deleted once they are."""
        with self.lock:
            taken = self._take_queue()
            if not self.buffered and not taken:
                if not self.pending_rows and self.wal.holds_entries():
                    # every row the WAL holds was a duplicate of one already in a part (``add`` logs rows before the
                    # dedupe drops them): nothing to keep
                    self.wal.rotate()
                    self.wal.release()
                return 0
            buffers = self.buffers
            counts = self.buffered_rows
            self.buffers = {t: [] for t in SPECS}
            self.buffered_rows = {t: 0 for t in SPECS}
            n = self.buffered
            self.buffered = 0
            # the old generation is deleted only once its rows are in parts
            self.wal.rotate()
        for table, t in self._process_taken(taken):
            buffers[table].append(t)
            counts[table] += t.num_rows
            n += t.num_rows
        failed = None
        kept: list[tuple[str, list[pa.Table]]] = []
        for table, chunks in buffers.items():
            if not chunks:
                continue
            if failed is None:
                try:
                    self._write_part(table, chunks)
                    continue
                except OSError as e:  # disk full, permissions: keep the rows, try again next flush
                    failed = e
            kept.append((table, chunks))
        with self.lock:
            for table, chunks in kept:  # not written: back into the buffer (its WAL generation is kept until it is)
                self.buffers[table][:0] = chunks
                self.buffered_rows[table] += counts[table]
                self.buffered += counts[table]
            if failed is None:
                self.wal.release()
        if failed is not None:
            log.error("store %s: flush failed (%s); %d rows kept for the next flush", self.run_id, failed,
                      self.buffered)
            return 0
        return n

    def _write_part(self, table: str, chunks: list[pa.Table]) -> None:
        # the chunks as they are (no combined copy): the writer makes one row group of them either way
        arrow = pa.concat_tables(chunks) if len(chunks) > 1 else chunks[0]
        d = self.root / table / store_layout.partition_dir(self.run_id, self.clock())
        d.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        name = f"part-{time.time_ns()}-{os.getpid()}-{self._seq:06d}.parquet"
        tmp = d / f".{name}.tmp"
        # CRC per page: corruption is detected on read. Dictionary encoding for the string columns with few distinct
        # values only (run ids, ops: ``_dictionary_columns``), not for the float and int columns, where it costs
        # more CPU than it saves bytes in a part file that compaction rewrites anyway; for the same reason min/max
        # statistics for the key columns only (a reader filtering on them skips parts; the compacted file has them
        # all).
        pq.write_table(arrow, tmp, write_page_checksum=True, use_dictionary=_dictionary_columns(arrow.schema),
                       write_statistics=_statistics_columns(table, arrow.schema))
        os.replace(tmp, d / name)
        self.rows_stored[table] += arrow.num_rows

    def close(self) -> None:
        with self.process_lock:
            self._flush_locked()
            with self.lock:
                self.wal.close()
        try:  # the head stops: every partition to one file, covered parts removed at once (no reader waits on us)
            self.compact(everything=True, cleanup_delay=0.0)
        except Exception:  # noqa: BLE001 - the rows are safe in their parts; the next start compacts them
            log.exception("store %s: compaction at close failed", self.run_id)

    # -- compaction -----------------------------------------------------------------
    def _table_files(self, table: str) -> list[StoreFile]:
        """Every file of a table, covered ones included: local, and at the compaction target."""
        files = store_layout.list_table(self.root / table)
        if self.target is not None:
            files += store_layout.list_fs(self.target.fs, f"{self.target.run_path}/{table}")
        return files

    def _files_to_compact(self, table: str) -> list[StoreFile]:
        """The local files of a table, and at a remote target only the partitions that still have local files (one
        listing each: usually the hour that just closed and the current one), not the run's whole history."""
        files = store_layout.list_table(self.root / table)
        if self.target is not None and self.target.fs is not None:
            for part in sorted({f.partition for f in files if f.partition.startswith(f"{store_layout.RUN_KEY}=")}):
                base = f"{self.target.run_path}/{table}"
                files += [StoreFile(f.path, f"{part}/{f.name}", f.size, f.fs, f.mtime)
                          for f in store_layout.list_fs(self.target.fs, f"{base}/{part}")]
        return files

    def _upload_manifest(self) -> None:
        """run.json beside the run's tables at a remote target, so the bucket says what each run was (diagnose and
        fleet queries join on it); uploaded under a dot-name and moved, again whenever the local one changes."""
        if self.target is None or self.target.fs is None:
            return
        path = self.root / "run.json"
        try:
            mtime = path.stat().st_mtime
            if mtime == self._manifest_uploaded:
                return
            data = path.read_bytes()
            tmp = f"{self.target.run_path}/.run.json.tmp"
            self.target.fs.create_dir(self.target.run_path, recursive=True)
            with self.target.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.target.fs.move(tmp, f"{self.target.run_path}/run.json")
            self._manifest_uploaded = mtime
        except FileNotFoundError:
            return
        except Exception as e:  # noqa: BLE001 - retried next round
            log.error("store %s: run.json not copied to the compaction target (%s)", self.run_id, e)

    def _cleanup_at_start(self) -> None:
        """What a compaction that crashed before its cleanup left: covered files, dot-files."""
        for table in SPECS:
            compaction.remove_stale_tmp(self.root / table, time.time())
            try:
                compaction.remove_covered(self._table_files(table), time.time(), self.cleanup_delay)
            except store_layout.StoreLocationError as e:
                log.error("store %s/%s: covered files not removed: %s", self.run_id, table, e)

    def compact(self, everything: bool = False, cleanup_delay: float | None = None) -> dict[str, int]:
        """Merge each closed ``hour`` partition (every partition when ``everything``, or when the run ended) into one
        compacted file, then remove the files it covers once they are ``cleanup_delay`` s old. Returns counts:
        partitions merged, files merged, rows, files removed."""
        delay = self.cleanup_delay if cleanup_delay is None else cleanup_delay
        everything = everything or self.ended
        out = {"partitions": 0, "files": 0, "rows": 0, "removed": 0}
        merged: list[tuple[str, list[StoreFile]]] = []
        with self.compact_lock:
            now = self.clock()
            for table in SPECS:
                compaction.remove_stale_tmp(self.root / table, time.time())
                try:
                    files = self._files_to_compact(table)
                except store_layout.StoreLocationError as e:
                    log.error("store %s/%s: not compacted: %s", self.run_id, table, e)
                    continue
                out["removed"] += compaction.remove_covered(files, time.time(), delay)
                by_part: dict[str, list[StoreFile]] = {}
                for f in store_layout.visible(files):
                    if f.partition.startswith(f"{store_layout.RUN_KEY}="):  # flat parts of older stores stay
                        by_part.setdefault(f.partition, []).append(f)
                for part, fs in by_part.items():
                    start = store_layout.hour_start(part.rsplit("=", 1)[-1])
                    closed = everything or (start is not None and start + 3600 + CLOSE_GRACE_S <= now)
                    remote_missing = self.target is not None and any(f.fs is None for f in fs)
                    if not closed or (len(fs) == 1 and fs[0].compacted and not remote_missing):
                        continue
                    try:
                        new, rows = compaction.compact_partition(fs, table, part, self.root / table, self.target,
                                                           self.root / ".head" / "compact", self.fsync_compacted,
                                                           SPECS[table].schema)
                    except Exception as e:  # noqa: BLE001 - disk full, network: the parts stay, retried next round
                        log.error("store %s/%s/%s: compaction failed (%s); parts kept", self.run_id, table, part, e)
                        continue
                    if new is not None:
                        out["partitions"] += 1
                        out["files"] += len(store_layout.read_covers(new) & {f.name for f in fs})
                        out["rows"] += rows
                        merged.append((table, fs + [new]))
            self._upload_manifest()
            if merged:
                if delay > 0:  # a reader that listed the parts just before the rename may still open them
                    time.sleep(delay)
                for _table, fs in merged:
                    out["removed"] += compaction.remove_covered(fs, time.time(), delay)
        if out["partitions"]:
            log.info("store %s: compacted %d partition(s): %d files, %d rows -> %d files", self.run_id,
                     out["partitions"], out["files"], out["rows"], out["partitions"])
        return out

    def stored_and_buffered(self, table: str) -> int:
        """Rows of ``table`` in part files or buffered (after dedupe of the queue)."""
        with self.process_lock:
            self._process_locked(table)
            return self.rows_stored[table] + self.buffered_rows[table]

    # -- manifest -----------------------------------------------------------------
    def write_manifest(self, manifest: schema.Manifest, mtime: float | None) -> bool:
        """Write run.json if absent, or if the shipped one is newer than ours. Returns True if written."""
        path = self.root / "run.json"
        if manifest.finished is not None:
            self.ended = True
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
