"""``diagnose <run-id>``: the post-mortem report of a run.

Reads the run store (or, without agents, the spool files), runs every check, and prints a
report a person reads in a minute: a verdict, findings by severity with their evidence, the
checks that could not judge the run and why (the fields they need are missing), a rank x step
heat map of compute time, MFU and step time over time, the injected faults next to what was
found, and what to do next. ``--json`` prints one object; ``--html FILE`` writes a
self-contained page with inline SVG plots. (The report itself: ``analyzers.report``; the command, which also reads
the logs stored with the run: ``cli/diagnose.py``.)

Exit codes (``analyzers.report.model``): 0 healthy, 10 incomplete (nothing found, but some checks
could not run), 20 warnings, 30 critical, 40 the run could not be read. None is 1 or 2, which
click (typer) uses for a crash and a usage error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from analyzers import ANALYZERS, merge_corroborating, run_all, sort_findings
from analyzers.forked import default_jobs
from analyzers.loader import LoadError, load_run
from analyzers.report.model import EXIT_LOAD_ERROR, build_report
from analyzers.report.render_html import render_html
from analyzers.report.render_json import load_error_json, render_json
from analyzers.report.render_text import render_text
from ranksight.layout import DEFAULT_STORE
from ranksight.schema import Finding

StoredLogs = Callable[[Path], tuple[list[Finding], list[str]]]  # run directory -> (findings, notes)


def diagnose(run_id: str, store: str | os.PathLike | None = None, as_json: bool = False, html_file: str | None = None,
             since: int | None = None, until: int | None = None, progress: bool | None = None,
             out: Any = None, stored_logs: StoredLogs | None = None, jobs: int | None = None) -> int:
    """Run the report; returns the exit code. ``out``: a rich Console (default: stdout). ``stored_logs``: reads the
    logs stored in the run's directory into findings and notes (the command passes ``logs.stored.run_log_findings``;
    the log readers stand on the analyzers, so they are handed in rather than imported). ``jobs``: processes the
    checks run in (``analyzers.forked``); None: one per idle CPU on a big run, else 1
    (``analyzers.forked.default_jobs``)."""
    from rich.console import Console

    console = out or Console()
    err = Console(stderr=True)
    store = store if store is not None else os.environ.get("RANKSIGHT_STORE", str(DEFAULT_STORE))
    try:
        # the bar goes to stderr; with --json only when asked (a pipeline reading stdout wants no noise around it)
        data = load_run(store, run_id, since=since, until=until,
                        progress=(False if progress is None else progress) if as_json else progress)
    except LoadError as e:
        if as_json:
            sys.stdout.write(load_error_json(run_id, str(e)))
        else:
            err.print(f"[bold red]diagnose: cannot read run[/] {e}")
        return EXIT_LOAD_ERROR
    errors: list[str] = []
    coverage: list = []
    if jobs is None:
        jobs = default_jobs(data, len(ANALYZERS))
    findings = run_all(data, errors=errors, coverage=coverage, jobs=jobs)
    if stored_logs is not None:
        log_findings, notes = stored_logs(Path(store) / run_id)
        findings = findings + log_findings
        merge_corroborating(findings)  # a stored trace's straggler confirms the step records' one
        sort_findings(findings)
        errors.extend(notes)
    report = build_report(data, findings, errors, coverage, with_plots=bool(html_file))  # only the page draws plots
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
