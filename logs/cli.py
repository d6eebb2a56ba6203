"""``ranksight logs PATH... [--json] [--html FILE]``: one report across every log a user brings."""

from __future__ import annotations

import typer

from ranksight.exit_codes import EXIT_CODES_HELP

logs_command = typer.Typer(add_completion=False, help="Diagnose the logs you already have.")


@logs_command.command(help="Diagnose logs you already have: NCCL debug output, PyTorch watchdog lines, Flight Recorder "
                           "dumps, nccl-tests output, kernel logs (Xid, AER), nvidia-smi / dcgm-exporter output, "
                           "loss-scale messages, per-iteration training logs. Files or directories (recursive; plain "
                           "or .gz); '-' reads standard input. " + EXIT_CODES_HELP)
def logs(
    paths: list[str] = typer.Argument(..., help="Files or directories."),
    as_json: bool = typer.Option(False, "--json", help='Print {"verdict", "inputs", "findings", ...} as JSON.'),
    html_file: str = typer.Option(None, "--html", help="Also write a self-contained HTML report to this file."),
) -> None:
    from logs.analysis import analyze
    from logs.report import exit_code, render_html, render_text, to_json

    report = analyze(paths)
    if html_file:
        with open(html_file, "w", encoding="utf-8") as f:
            f.write(render_html(report))
    if as_json:
        typer.echo(to_json(report))
    else:
        render_text(report)
    raise typer.Exit(exit_code(report))
