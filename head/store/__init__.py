"""The run store: Parquet per run-id, Hive-partitioned by run and hour, compacted by the head.

Layout (a contract users rely on, see docs/store.md and docs/data-path.md)::

    <store>/<run-id>/run.json                    the manifest
    <store>/<run-id>/<table>/run=<run-id>/hour=<YYYY-MM-DDTHH>/part-<ns>-<pid>-<seq>.parquet   one per flush
    <store>/<run-id>/<table>/run=<run-id>/hour=<YYYY-MM-DDTHH>/compacted-<ns>-<pid>.parquet    one per closed hour
    <store>/<run-id>/remote.json                 where compacted partitions went, when not here (object storage)
    <store>/<run-id>/.head/wal-*.log             the head's write-ahead log (internal)

``pandas.read_parquet("<store>/<run-id>/<table>")`` and DuckDB/Spark read a table (``run`` and ``hour`` as
columns); ``ranksight.tables.read_table`` also skips files a compacted file replaced. Files are written under a
dot-name and renamed into place, and readers ignore dot-files, so a reader never sees half a file.

Exactly-once: every row has a natural key (``ranksight.tables.KEYS``). The head
acknowledges a request only after its rows are in the write-ahead log; rows
already seen (in a part file, the WAL, the buffer or the packed queue) are dropped
before they are buffered.

Modules: ``run_store`` (``RunStore``: one run's queue, buffers, part files and compaction), ``compaction``
(merging a partition's files, crash-safe), ``dedupe`` (the key indexes), ``wal`` (the write-ahead log), ``arrow``
(rows and packed records to Arrow tables). Table schemas and keys are ``ranksight.tables``; readers use
``ranksight.tables.read_table``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from head.store.run_store import RunStore
from ranksight import store_layout
from ranksight.layout import RunDir

__all__ = ["RunStore", "Store"]


class Store:
    """All runs under one store directory."""

    def __init__(self, root: str | os.PathLike, flush_rows: int = 250_000, fsync: bool = False,
                 compact_to: str | None = None, **run_options):
        """``compact_to``: a directory or URI (``s3://bucket/prefix``) the runs' compacted partitions go to instead of
        ``root`` (the write-ahead log and fresh parts stay on local disk). ``run_options``: for each ``RunStore``
        (``clock``, ``cleanup_delay``)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.flush_rows = flush_rows
        self.fsync = fsync
        if compact_to is not None:
            store_layout.open_location(compact_to)  # a bad URI (credentials in it, unknown scheme) fails at start
        self.compact_to = compact_to
        self.run_options = run_options
        self.runs: dict[str, RunStore] = {}
        self._lock = threading.Lock()

    def run(self, run_id: str) -> RunStore:
        """The run's store, opened (keys loaded, WAL replayed) on first use. ValueError for an invalid run id."""
        rs = self.runs.get(run_id)
        if rs is not None:
            return rs
        with self._lock:
            rs = self.runs.get(run_id)
            if rs is None:
                RunDir(self.root, run_id)  # validates the id (no path tricks)
                rs = RunStore(self.root / run_id, run_id, self.flush_rows, self.fsync, self.compact_to,
                              **self.run_options)
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

    def compact_all(self) -> dict[str, int]:
        """Compact every open run's closed partitions (``RunStore.compact``); summed counts."""
        total: dict[str, int] = {}
        for rs in list(self.runs.values()):
            for k, v in rs.compact().items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        for rs in list(self.runs.values()):
            rs.close()

    def run_ids(self) -> list[str]:
        """Runs open in this head or stored (a run.json or a steps table) under the root."""
        out = set(self.runs)
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.is_dir() and not d.name.startswith(".") and ((d / "run.json").exists() or (d / "steps").is_dir()):
                    out.add(d.name)
        return sorted(out)
