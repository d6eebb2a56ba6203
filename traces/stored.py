"""The profiler traces stored with a run (``<run>/traces/``: periodic and on-demand captures), analysed as
``ranksight trace`` does: what ``diagnose <run-id>`` adds from them."""

from __future__ import annotations

from pathlib import Path

from ranksight.schema import Finding


def run_trace_findings(run_dir: str | Path) -> tuple[list[Finding], list[str]]:
    """(findings from the traces under ``run_dir/traces``, notes: unreadable traces)."""
    d = Path(run_dir) / "traces"
    if not d.is_dir() or not any(d.iterdir()):
        return [], []
    from traces.breakdown import analyse_rank
    from traces.checks import run_checks
    from traces.load import load_traces

    analysed: dict[int, dict] = {}

    def each(t):  # one large trace in memory at a time (see traces.cli.analyse)
        analysed[id(t)] = analyse_rank(t)
        t.slim()

    traces, errors = load_traces([str(d)], each)
    ranks = [analysed[id(t)] for t in traces]
    findings, _extra = run_checks(ranks, traces) if ranks else ([], {})
    return findings, [f"stored trace {p} unreadable: {e}" for p, e in errors.items()]
