"""``diagnose <run-id>``: the post-mortem report of a run.

Reads the run store (or, without agents, the spool files), runs every check, and prints a
report a person reads in a minute: a verdict, findings by severity with their evidence, the
checks that could not judge the run and why (the fields they need are missing), a rank x step
heat map of compute time, MFU and step time over time, the injected faults next to what was
found, and what to do next. ``--json`` prints one object; ``--html FILE`` writes a
self-contained page with inline SVG plots. (The report itself: ``analyzers.report``.)

Exit codes (``analyzers.report.model``): 0 healthy, 10 incomplete (nothing found, but some checks
could not run), 20 warnings, 30 critical, 40 the run could not be read. None is 1 or 2, which
click (typer) uses for a crash and a usage error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from analyzers import run_all
from analyzers.loader import LoadError, load_run
from analyzers.report.model import EXIT_CODES_HELP, EXIT_LOAD_ERROR, build_report
from analyzers.report.render_html import render_html
from analyzers.report.render_json import load_error_json, render_json
from analyzers.report.render_text import render_text
from ranksight.layout import DEFAULT_STORE


def diagnose(run_id: str, store: str | os.PathLike | None = None, as_json: bool = False, html_file: str | None = None,
             since: int | None = None, until: int | None = None, progress: bool | None = None,
             out: Any = None) -> int:
    """Run the report; returns the exit code. ``out``: a rich Console (default: stdout)."""
    from rich.console import Console

    console = out or Console()
    err = Console(stderr=True)
    store = store if store is not None else os.environ.get("RANKSIGHT_STORE", str(DEFAULT_STORE))
    try:
        data = load_run(store, run_id, since=since, until=until, progress=False if as_json else progress)
    except LoadError as e:
        if as_json:
            sys.stdout.write(load_error_json(run_id, str(e)))
        else:
            err.print(f"[bold red]diagnose: cannot read run[/] {e}")
        return EXIT_LOAD_ERROR
    errors: list[str] = []
    coverage: list = []
    findings = run_all(data, errors=errors, coverage=coverage)
    report = build_report(data, findings, errors, coverage)
    if html_file:
        Path(html_file).write_text(render_html(report), encoding="utf-8")
    if as_json:
        sys.stdout.write(render_json(report))
        sys.stdout.flush()
    else:
        render_text(report, console)
        if html_file:
            console.print(f"[dim]HTML report written to {html_file}[/]")
    return report.summary["exit_code"]


diagnose_command = typer.Typer(add_completion=False, help="Post-mortem report of a run.")


@diagnose_command.command(help="Post-mortem report of a run: which rank, which node, since which step, and why; and "
                               "which checks could not judge it, and why. " + EXIT_CODES_HELP)
def _diagnose_cli(
    run_id: str = typer.Argument(..., help="The run id (a directory under the store)."),
    store: Optional[str] = typer.Option(None, "--store", help="Run store directory (default $RANKSIGHT_STORE or ./runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    html_file: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML page to FILE."),
    since: Optional[int] = typer.Option(None, "--since", help="First step to analyse."),
    until: Optional[int] = typer.Option(None, "--until", help="Last step to analyse."),
) -> None:
    code = diagnose(run_id, store=store, as_json=as_json, html_file=html_file, since=since, until=until)
    raise typer.Exit(code)


def main() -> None:
    diagnose_command()


if __name__ == "__main__":
    main()
