"""``ranksight compact``: compact a stored run's partitions again, offline (no head needed), so each one is a
single file in the loader's key order with the sorted marker (``head.store.compaction.recompact_table``).

For stores an earlier head compacted without sorting (``diagnose`` then sorts them at every load) and for parts a
head left uncompacted. Run it only on runs no head is writing (a live head compacts its own runs)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer

compact_command = typer.Typer(add_completion=False, help="Compact a stored run's partitions again, sorted.")


def compact_run(run_root: Path) -> dict[str, dict[str, int]]:
    """Every table of the run under ``run_root`` (``<store>/<run-id>``) compacted again; counts per table."""
    from head.store import compaction
    from ranksight.tables import SPECS

    out = {}
    for table, spec in SPECS.items():
        d = run_root / table
        if d.is_dir():
            out[table] = compaction.recompact_table(d, table, spec.schema)
    return out


@compact_command.command()
def compact(
    runs: Optional[List[str]] = typer.Argument(None, help="Run ids (default: every run in the store)."),
    store: Path = typer.Option(Path("./runs"), "--store", help="Run store directory (the head's --store)."),
    as_json: bool = typer.Option(False, "--json", help='Print one JSON object, {"store", "runs": [...]}.'),
) -> None:
    """Merge each partition of the runs' tables that is not one compacted file yet (steps and collectives: sorted
    and marked) into one, and remove what it replaces. Exit 1 when there is no store at --store or a head holds it, 2 for a bad
    run id."""
    from ranksight.layout import RunDir

    def fail(msg: str, code: int) -> None:
        if as_json:
            typer.echo(json.dumps({"store": str(store), "error": msg, "runs": []}))
        else:
            typer.echo(msg, err=True)
        raise typer.Exit(code)

    if not store.is_dir():
        fail(f"no store at {store} (use --store DIR)", 1)
    ids = runs or sorted(d.name for d in store.iterdir() if d.is_dir() and not d.name.startswith("."))
    for run_id in ids:
        try:
            RunDir(store, run_id)  # validates the id (no path tricks)
        except ValueError as e:
            fail(str(e), 2)
        if not (store / run_id).is_dir():
            fail(f"no run {run_id} in {store}", 2)
    from head.store.store_lock import StoreBusy, StoreLock

    try:  # a head compacts its own runs; merging under it would remove parts it still counts on
        lock = StoreLock(store, "ranksight compact")
    except StoreBusy as e:
        fail(f"{e}: a running head compacts its own runs (stop it first to compact them here)", 1)
    out = []
    for run_id in ids:
        t0 = time.monotonic()
        tables = compact_run(store / run_id)
        row = {"run_id": run_id, "seconds": round(time.monotonic() - t0, 3), "tables": tables,
               "partitions": sum(c["partitions"] for c in tables.values()),
               "marked": sum(c["marked"] for c in tables.values()), "rows": sum(c["rows"] for c in tables.values())}
        out.append(row)
        if not as_json:
            typer.echo(f"{run_id}: {row['partitions']} partition(s) compacted ({row['rows']} rows, {row['marked']} "
                       f"marked sorted) in {row['seconds']:.1f} s")
    lock.release()
    if as_json:
        typer.echo(json.dumps({"store": str(store), "runs": out}, indent=2))
