"""The ``diagnose`` command: ``analyzers.diagnose`` over a run, with the logs stored beside it read by the same readers
as ``ranksight logs`` (``logs.stored``). It lives here, above both, because the log readers stand on the analyzers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from analyzers.diagnose import diagnose
from analyzers.report.model import EXIT_CODES_HELP
from logs.stored import run_log_findings
from ranksight.schema import Finding
from traces.stored import run_trace_findings


def stored_findings(run_dir: Path) -> tuple[list[Finding], list[str]]:
    """What the files stored with a run add to its report: its logs (``ranksight logs``' readers) and its profiler
    traces (``ranksight trace``'s checks)."""
    findings, notes = run_log_findings(run_dir)
    more, more_notes = run_trace_findings(run_dir)
    return findings + more, notes + more_notes

diagnose_command = typer.Typer(add_completion=False, help="Post-mortem report of a run.")


@diagnose_command.command(help="Post-mortem report of a run: which rank, which node, since which step, and why; and "
                               "which checks could not judge it, and why. Logs stored with the run (its logs/ and "
                               "nccl/ directories) are read as `ranksight logs` reads them, its profiler traces "
                               "(traces/) as `ranksight trace` does. " + EXIT_CODES_HELP)
def _diagnose_cli(
    run_id: str = typer.Argument(..., help="The run id (a directory under the store)."),
    store: Optional[str] = typer.Option(None, "--store", help="Run store directory (default $RANKSIGHT_STORE or ./runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    html_file: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML page to FILE."),
    since: Optional[int] = typer.Option(None, "--since", help="First step to analyse."),
    until: Optional[int] = typer.Option(None, "--until", help="Last step to analyse."),
    no_logs: bool = typer.Option(False, "--no-logs", help="Do not read the logs and traces stored with the run."),
    jobs: Optional[int] = typer.Option(
        None, "--jobs", "-j", min=1,
        help="Processes the checks run in, forked after the run is loaded (they share its frames). Default: one per "
             "idle CPU (the available ones less the load average, to the nearest) on a big run (over 500,000 step and collective "
             "records), else 1. Each adds its check's working memory to the run's."),
    progress: Optional[bool] = typer.Option(
        None, "--progress/--no-progress",
        help="A progress bar (on stderr) while the run loads. Default: shown for a run over 8 MB when stderr is a "
             "terminal, never with --json unless asked; --json's stdout holds the JSON object alone either way."),
) -> None:
    code = diagnose(run_id, store=store, as_json=as_json, html_file=html_file, since=since, until=until,
                    progress=progress, stored_logs=None if no_logs else stored_findings, jobs=jobs)
    raise typer.Exit(code)


def main() -> None:
    diagnose_command()


if __name__ == "__main__":
    main()
