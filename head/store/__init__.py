"""The run store: Parquet per run-id, one directory of part files per table.

Layout (a contract users rely on, see docs/data-path.md)::

    <store>/<run-id>/run.json                    the manifest
    <store>/<run-id>/<table>/part-<ns>-<pid>-<seq>.parquet   for table in STORE_TABLES
    <store>/<run-id>/.head/wal-*.log             the head's write-ahead log (internal)

``pandas.read_parquet("<store>/<run-id>/<table>")`` reads a table. Part files
are written under a dot-name and renamed into place, and pyarrow ignores
dot-files, so a reader never sees half a file, even while the head appends.

Exactly-once: every row has a natural key (``ranksight.tables.KEYS``). The head
acknowledges a request only after its rows are in the write-ahead log; rows
already seen (in a part file, the WAL, the buffer or the packed queue) are dropped
before they are buffered.

Modules: ``run_store`` (``RunStore``: one run's queue, buffers and part files),
``dedupe`` (the key indexes), ``wal`` (the write-ahead log), ``arrow`` (rows and
packed records to Arrow tables). Table schemas and keys are ``ranksight.tables``;
readers use ``ranksight.tables.read_table``.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from head.store.run_store import RunStore
from ranksight.layout import RunDir

__all__ = ["RunStore", "Store"]


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
        """The run's store, opened (keys loaded, WAL replayed) on first use. ValueError for an invalid run id."""
        rs = self.runs.get(run_id)
        if rs is not None:
            return rs
        with self._lock:
            rs = self.runs.get(run_id)
            if rs is None:
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
        """Runs open in this head or stored (a run.json or a steps table) under the root."""
        out = set(self.runs)
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.is_dir() and not d.name.startswith(".") and ((d / "run.json").exists() or (d / "steps").is_dir()):
                    out.add(d.name)
        return sorted(out)
