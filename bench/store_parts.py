"""Reading a table from per-second part files vs from the head's compacted hour partitions (issue 15).

A head flushing every second leaves one part file per second per table. This writes ``--parts`` such parts
(``--ranks`` rows each: one step of every rank per second) into one run's ``steps`` table in the store's layout
(``run=<id>/hour=<h>/part-*.parquet``, the hour from the simulated second), copies the run, compacts the copy with
the head's own code (``RunStore.compact``: one file per hour), then reads both with ``ranksight.tables.read_table``
(the one reader), with DuckDB (``read_parquet`` over the Hive partitions: median step time per rank), as
``diagnose`` loads a run (``analyzers.loader.load_run``) and as a restarting head does (its dedupe indexes rebuilt
from the files), in interleaved rounds.

    .venv/bin/python bench/store_parts.py [--parts 10000] [--ranks 100] [--rounds 3]

Prints files before/after, the compaction's time, and per reader the min/median seconds of each layout and the
ratio parts/compacted (the baseline is the part-file layout, measured in the same run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from head.store import RunStore  # noqa: E402
from ranksight import store_layout  # noqa: E402
from ranksight.tables import SPECS, read_table  # noqa: E402

RUN = "bench-parts"
T0 = 1_795_000_000.0 - (1_795_000_000.0 % 3600)


def part_table(step: int, ranks: int) -> pa.Table:
    """One second of steps: every rank's step ``step``, in the store's schema."""
    spec = SPECS["steps"]
    n = ranks
    rank = np.arange(n, dtype=np.int64)
    t_start = np.full(n, T0 + step)
    step_ms = 100.0 + (rank % 7) * 3.0
    cols = {
        "run_id": pa.array([RUN] * n), "rank": rank, "step": np.full(n, step, dtype=np.int64),
        "node": rank // 8, "host": pa.array([f"h{r // 8}" for r in range(n)]), "attempt": np.zeros(n, np.int64),
        "world_size": np.full(n, n, np.int64), "t_start": t_start, "t_end": t_start + step_ms / 1000,
        "step_ms": step_ms, "tokens": np.full(n, 4096, np.int64), "loss": np.full(n, 2.0),
    }
    arrays = []
    for f in spec.schema:
        v = cols.get(f.name)
        arrays.append(pa.nulls(n, f.type) if v is None else pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=spec.schema)


def write_parts(root: Path, parts: int, ranks: int) -> None:
    table_dir = root / RUN / "steps"
    for s in range(parts):
        d = table_dir / store_layout.partition_dir(RUN, T0 + s)
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(part_table(s, ranks), d / f"part-{int((T0 + s) * 1e9)}-{os.getpid()}-{s:06d}.parquet",
                       write_page_checksum=True)


def count_files(root: Path) -> int:
    return sum(1 for _ in (root / RUN / "steps").rglob("*.parquet"))


def read_pandas(root: Path) -> int:
    return len(read_table(root, RUN, "steps"))


def read_duckdb(root: Path) -> int:
    import duckdb

    con = duckdb.connect()
    try:
        return con.execute("SELECT count(*) FROM (SELECT rank, median(step_ms) FROM read_parquet(?, "
                           "hive_partitioning = true) GROUP BY rank)",
                           [str(root / "*" / "steps" / "*" / "*" / "*.parquet")]).fetchone()[0]
    finally:
        con.close()


def load_for_diagnose(root: Path) -> int:
    """diagnose's load path (``analyzers.loader.load_run``: every table of the run, normalised)."""
    from analyzers.loader import load_run

    return len(load_run(root, RUN, progress=False).steps)


def open_head(root: Path) -> int:
    """A head (re)starting on the run: its dedupe indexes are rebuilt from the table's files."""
    rs = RunStore(root / RUN, RUN, cleanup_delay=3600.0)
    try:
        return rs.rows_stored["steps"]
    finally:
        rs.wal.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="store-parts-"))
    try:
        parts_root, compact_root = work / "parts", work / "compacted"
        t = time.perf_counter()
        write_parts(parts_root, args.parts, args.ranks)
        print(f"wrote {args.parts:,} parts x {args.ranks} rows in {time.perf_counter() - t:.1f} s", flush=True)
        shutil.copytree(parts_root, compact_root)
        before = count_files(compact_root)
        t = time.perf_counter()
        rs = RunStore(compact_root / RUN, RUN, clock=lambda: T0 + args.parts + 7200, cleanup_delay=0.0)
        opened = time.perf_counter() - t
        t = time.perf_counter()
        out = rs.compact()
        took = time.perf_counter() - t
        rs.close()
        after = count_files(compact_root)
        print(f"files: {before:,} parts -> {after} compacted (hours) ; head open (keys of {before:,} parts) "
              f"{opened:.1f} s, compaction {took:.1f} s ({out['rows']:,} rows)", flush=True)
        rows = args.parts * args.ranks
        results: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.rounds):
            for reader_name, reader in READERS:
                for layout, root in (("parts", parts_root), ("compacted", compact_root)):
                    t = time.perf_counter()
                    got = reader(root)
                    results.setdefault((reader_name, layout), []).append(time.perf_counter() - t)
                    want = args.ranks if reader_name == "duckdb" else rows
                    assert got == want, (reader_name, layout, got, want)
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        print(f"\n{rows:,} rows of steps, {args.parts:,} per-second parts vs {after} compacted partitions; "
              f"load average {os.getloadavg()[0]:.2f} (2 cores shared)")
        print(f"{'reader':<11} {'parts min/med s':>17} {'compacted min/med s':>21} {'ratio (min)':>12}")
        for reader_name, _ in READERS:
            p, c = results[(reader_name, "parts")], results[(reader_name, "compacted")]
            print(f"{reader_name:<11} {min(p):>8.2f}/{statistics.median(p):<8.2f} {min(c):>10.2f}/"
                  f"{statistics.median(c):<10.2f} {min(p) / min(c):>11.1f}x")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


READERS = (("read_table", read_pandas), ("duckdb", read_duckdb), ("load_run", load_for_diagnose),
           ("head_start", open_head))


if __name__ == "__main__":
    raise SystemExit(main())
