"""What a reader hands over, and the finding helper every reader's conclusions use.

A reader turns one input's bytes into a :class:`ReadResult`: the events it understood (plain dicts, each with the
input ``source`` and its ``line`` number, so a finding can cite them), how many lines it claimed, and notes about how
it read them (a truncated dump, an unknown version). Conclusions across all inputs come from the reader's
``conclude`` over every result it produced, so a watchdog line from rank 7 in one file and one from rank 3 in another
make one finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ranksight.schema import Finding


@dataclass
class ReadResult:
    reader: str  # the reader's NAME
    source: str  # the input's path (or "<stdin>")
    events: list[dict[str, Any]] = field(default_factory=list)
    claimed_lines: set[int] = field(default_factory=set)  # 0-based line numbers this reader understood
    notes: list[str] = field(default_factory=list)  # how it was read: truncation, unknown version, caps
    summary: dict[str, Any] = field(default_factory=dict)  # reader-specific structured facts (JSON-safe)


@dataclass
class LogInput:
    """One input as ``ranksight logs`` reports it."""

    path: str
    bytes: int = 0
    lines: int = 0
    formats: dict[str, int] = field(default_factory=dict)  # reader -> lines it claimed
    unknown_lines: int = 0
    error: str | None = None  # why it could not be read (the input is then skipped, never fatal)
    notes: list[str] = field(default_factory=list)


def log_finding(reader: str, kind: str, severity: str, summary: str, *, inputs: list[str], evidence: dict[str, Any],
                recommendation: str = "", ranks: list[int] | None = None, nodes: list[int] | None = None,
                hosts: list[str] | None = None, gpus: list[str] | None = None, step_start: int | None = None,
                step_end: int | None = None, confidence: float = 1.0) -> Finding:
    """A Finding from logs: the same schema as ``diagnose``; ``analyzer`` is ``logs.<reader>``, ``inputs`` the files it
    rests on (sorted, de-duplicated)."""
    return Finding(analyzer=f"logs.{reader}", kind=kind, severity=severity, summary=summary,
                   ranks=sorted(set(ranks or [])), nodes=sorted(set(nodes or [])), hosts=sorted(set(hosts or [])),
                   gpus=sorted(set(gpus or [])), step_start=step_start, step_end=step_end, evidence=evidence,
                   recommendation=recommendation, confidence=confidence, inputs=sorted(set(inputs)))


class LineIndex:
    """Line numbers of byte offsets in one input, for readers that scan the whole buffer with a regex (``re.finditer``
    over bytes runs at C speed; a Python loop over every line does not) and touch only the lines they match."""

    def __init__(self, data: bytes):
        import numpy as np

        self._np = np
        self._data = data
        self._newlines = None

    @property
    def newlines(self):
        """Offsets of every newline, found on first use (a reader that matches nothing never pays for them)."""
        if self._newlines is None:
            np = self._np
            self._newlines = np.flatnonzero(np.frombuffer(self._data, dtype=np.uint8) == 10)
        return self._newlines

    def line_of(self, offset: int) -> int:
        """0-based line number of the byte at ``offset``."""
        return int(self._np.searchsorted(self.newlines, offset, side="left"))

    def lines_of(self, offsets) -> set[int]:
        """0-based line numbers of many offsets at once."""
        np = self._np
        return set(np.searchsorted(self.newlines, np.asarray(list(offsets), dtype=np.int64), side="left").tolist())
