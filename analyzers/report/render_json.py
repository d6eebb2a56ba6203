"""The diagnose report as JSON (``diagnose --json``): one object on one line."""

from __future__ import annotations

import json

from analyzers.report.model import EXIT_LOAD_ERROR, DiagnoseReport


def render_json(report: DiagnoseReport) -> str:
    """The report's summary, one line."""
    return json.dumps(report.summary, default=str) + "\n"


def load_error_json(run_id: str, error: str) -> str:
    """The object printed in place of a report when the run cannot be read."""
    return json.dumps({"run_id": run_id, "error": error, "exit_code": EXIT_LOAD_ERROR}) + "\n"
