"""``ranksight compact``: compact a stored run's partitions again, offline (no head needed), so each one is a
single file in the loader's key order with the sorted marker (``head.store.compaction.recompact_table``).

For stores an earlier head compacted without sorting (``diagnose`` then sorts them at every load) and for parts a
head left uncompacted. Run it only on runs no head is writing (a live head compacts its own runs)."""

from __future__ import annotations

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


@compact_command.callback(invoke_without_command=True)
def main(store: Path = typer.Argument(..., help="The store directory (the head's --store)."),
         runs: Optional[List[str]] = typer.Argument(None, help="Run ids (default: every run in the store).")) -> None:
    from ranksight.layout import RunDir

    if not store.is_dir():
        raise typer.BadParameter(f"{store}: no such store directory")
    ids = runs or sorted(d.name for d in store.iterdir() if d.is_dir() and not d.name.startswith("."))
    for run_id in ids:
        try:
            RunDir(store, run_id)  # validates the id
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        t0 = time.monotonic()
        counts = compact_run(store / run_id)
        merged = sum(c["partitions"] for c in counts.values())
        marked = sum(c["marked"] for c in counts.values())
        rows = sum(c["rows"] for c in counts.values())
        typer.echo(f"{run_id}: {merged} partition(s) compacted ({rows} rows, {marked} marked sorted) "
                   f"in {time.monotonic() - t0:.1f} s")
