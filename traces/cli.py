"""``ranksight trace PATH... [--json] [--html FILE] [--perfetto OUT] [--window ...] [--steps A-B] [--diff PATH...]``.

PATHs are trace files (``.json``, ``.json.gz``) or directories of per-rank traces. ``--diff`` compares against a
second set (base = PATHs, new = the --diff set); ``--diff-steps A-B`` compares two step ranges of one set
(base = --steps, new = --diff-steps). Exit status as ``diagnose``'s: 0 nothing wrong, 20 warning, 30 critical, 40
nothing could be read (never 1 or 2: a crash and a usage error).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ranksight.exit_codes import EXIT, EXIT_LOAD_ERROR
from ranksight.schema import SEVERITY_ORDER

trace_command = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


def _steps(s: str | None) -> tuple[int, int] | None:
    if not s:
        return None
    a, _, b = s.partition("-")
    return int(a), int(b or a)


def analyse(paths: list[str], window: str, steps: tuple[int, int] | None, top: int | None = 10):
    from traces.breakdown import analyse_rank
    from traces.load import load_traces

    analysed: dict[int, dict] = {}

    def each(t):  # analysed as soon as it is loaded, then slimmed to what the cross-rank checks read
        analysed[id(t)] = analyse_rank(t, window=window, steps=steps, top=top)
        t.slim()

    traces, errors = load_traces(paths, each)
    return traces, [analysed[id(t)] for t in traces], errors


@trace_command.command()
def trace(
    paths: list[str] = typer.Argument(..., help="trace files or directories of per-rank traces"),
    json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
    html_out: Optional[str] = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    perfetto: Optional[str] = typer.Option(None, "--perfetto", help="write one merged multi-rank trace here"),
    window: str = typer.Option("all", "--window", help="all | steps | steps-hta (HTA's default: last step dropped)"),
    steps: Optional[str] = typer.Option(None, "--steps", help="step range A-B"),
    diff_paths: Optional[list[str]] = typer.Option(None, "--diff", help="a second trace set to compare with"),
    diff_steps: Optional[str] = typer.Option(None, "--diff-steps", help="a second step range A-B of the same set"),
) -> None:
    from traces import checks, report
    from traces.breakdown import WINDOWS, kernel_spread

    if window not in WINDOWS:
        raise typer.BadParameter(f"--window must be one of {', '.join(WINDOWS)}")
    rng = _steps(steps)
    traces, ranks, errors = analyse(paths, window, rng)
    findings, extra = checks.run_checks(ranks, traces)
    extra["kernel_spread"] = kernel_spread(ranks, traces)
    notes = [f"rank {r['rank']}: {n}" for r in ranks for n in r["notes"]]
    d = None
    if diff_paths or diff_steps:
        from traces.diff import diff

        base = [dict(r) for r in analyse(paths, window, rng, top=None)[1]]
        if diff_paths:
            new = analyse(list(diff_paths), window, rng, top=None)[1]
        else:
            new = analyse(paths, "steps", _steps(diff_steps), top=None)[1]
        d = diff(base, new)
    rep = report.build(ranks, findings, extra, notes, errors, d)
    if perfetto:
        try:
            from traces.perfetto import write_merged
        except ImportError as e:
            print(f"--perfetto: traces.perfetto is not available ({e})", file=sys.stderr)
            raise typer.Exit(2)
        write_merged(traces, findings, perfetto)
    if html_out:
        with open(html_out, "w") as f:
            f.write(report.to_html(rep))
    print(report.to_json(rep) if json_out else report.to_text(rep), end="" if not json_out else "\n")
    if not ranks:
        raise typer.Exit(EXIT_LOAD_ERROR)
    worst = max((f.severity for f in findings), key=SEVERITY_ORDER.__getitem__, default=None)
    raise typer.Exit(EXIT[worst])
