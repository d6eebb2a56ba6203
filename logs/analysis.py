"""Every input through every reader that sniffs it, then each reader's conclusions across all of its inputs."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from logs.inputs import iter_inputs
from logs.model import LogInput, ReadResult
from logs.registry import readers
from ranksight.schema import Finding

SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


@dataclass
class LogReport:
    inputs: list[LogInput] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    summaries: dict[str, Any] = field(default_factory=dict)  # reader -> its structured facts across inputs
    errors: list[str] = field(default_factory=list)  # a reader that failed: the report says so, the rest stands

    @property
    def worst(self) -> str | None:
        sev = [f.severity for f in self.findings]
        return max(sev, key=SEVERITY_ORDER.__getitem__) if sev else None


def count_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def analyze(paths: list[str]) -> LogReport:
    """One report over every file under ``paths``. Never raises on input: unreadable files and failing readers are
    recorded in the report."""
    mods, import_errors = readers()
    report = LogReport(errors=[f"reader {m} unavailable: {e}" for m, e in import_errors.items()])
    results: dict[str, list[ReadResult]] = {m.NAME: [] for m in mods}
    for item in iter_inputs(paths):
        if isinstance(item, tuple):
            report.inputs.append(LogInput(path=item[0], error=item[1]))
            continue
        inp = LogInput(path=item.path, bytes=len(item.data), lines=count_lines(item.data))
        if item.note:
            inp.notes.append(item.note)
        claimed: set[int] = set()
        for m in mods:
            try:
                if not m.sniff(item.data):
                    continue
                res = m.read(item)
            except Exception as e:  # a reader's bug must not cost the other readers' findings
                report.errors.append(f"reader {m.NAME} failed on {item.path}: {type(e).__name__}: {e} "
                                     f"({traceback.extract_tb(e.__traceback__)[-1].name})")
                continue
            if res is None:
                continue
            results[m.NAME].append(res)
            if res.claimed_lines:
                inp.formats[m.NAME] = len(res.claimed_lines)
                claimed |= res.claimed_lines
            elif res.events:  # a structured input (a dump): the whole file is the reader's
                inp.formats[m.NAME] = inp.lines
                claimed.update(range(inp.lines))
            inp.notes.extend(res.notes)
        inp.unknown_lines = max(0, inp.lines - len(claimed))
        report.inputs.append(inp)
    for m in mods:
        if not results[m.NAME]:
            continue
        try:
            report.findings.extend(m.conclude(results[m.NAME]))
            summarize = getattr(m, "summarize", None)
            if summarize is not None:
                report.summaries[m.NAME] = summarize(results[m.NAME])
        except Exception as e:
            report.errors.append(f"reader {m.NAME} failed to conclude: {type(e).__name__}: {e} "
                                 f"({traceback.extract_tb(e.__traceback__)[-1].name})")
    report.findings.sort(key=lambda f: (-SEVERITY_ORDER.get(f.severity, 0), f.kind, f.summary))
    return report
