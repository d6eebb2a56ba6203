"""The logs stored with a run, read by the same readers as ``ranksight logs``: what ``diagnose <run-id>`` adds.

A run directory holds the logs its processes wrote (``logs/``: each node's torchrun output, the agents', the
head's; ``nccl/``: NCCL_DEBUG_FILE outputs when the job ran NCCL) and whatever a user drops there (a Flight Recorder
dump, a kernel log of one of the job's hosts). Only findings come back: a run's own logs hold mostly lines no reader
knows, which is not worth a report line each.
"""

from __future__ import annotations

from pathlib import Path

from logs.analysis import analyze
from ranksight.schema import Finding

RUN_LOG_DIRS = ("logs", "nccl")


def run_log_findings(run_dir: str | Path) -> tuple[list[Finding], list[str]]:
    """(findings from the logs stored under ``run_dir``, notes: inputs or readers that failed)."""
    paths = [str(Path(run_dir) / d) for d in RUN_LOG_DIRS if (Path(run_dir) / d).is_dir()]
    if not paths:
        return [], []
    report = analyze(paths)
    notes = [f"stored log {i.path} unreadable: {i.error}" for i in report.inputs if i.error] + report.errors
    return report.findings, notes
