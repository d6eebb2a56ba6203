"""The findings list (severity-coloured) and the detail of the selected one (evidence numbers, recommendation)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable, Static

from ranksight import schema
from tui.model import fmt_evidence_value

SEV_STYLE = {"critical": "bold white on red", "warning": "bold black on yellow", "info": "bold white on blue"}


def fmt_ranks(xs: list[int]) -> str:
    if not xs:
        return "—"
    return ",".join(map(str, xs[:6])) + ("…" if len(xs) > 6 else "")


def fmt_steps(f: schema.Finding) -> str:
    if f.step_start is None:
        return "—"
    span = f"{f.step_start}–{f.step_end}" if f.step_end is not None and f.step_end != f.step_start else f"{f.step_start}–"
    return span + (" closed" if f.status == "closed" else "")


def evidence_text(f: schema.Finding) -> str:
    return " ".join(f"{k}={fmt_evidence_value(v)}" for k, v in f.evidence.items())


class FindingsTable(DataTable):
    def on_mount(self) -> None:
        self.cursor_type = "row"
        # Fixed widths where the longest value is known (" critical ", "pipeline_bubble"): auto widths
        # would depend on which rows arrived before the first layout, so the view would jitter.
        for label, key, width in (("sev", "sev", 10), ("kind", "kind", 16), ("ranks", "ranks", None),
                                  ("nodes", "nodes", None), ("steps", "steps", None), ("summary", "summary", None)):
            self.add_column(label, key=key, width=width)
        self.findings: list[schema.Finding] = []

    def show_findings(self, findings: list[schema.Finding]) -> None:
        keys = [self._key(i, f) for i, f in enumerate(findings)]
        if keys == [k.value for k in self.rows]:
            self.findings = findings
            return
        keep = self.cursor_row
        self.findings = findings
        self.clear()
        for k, f in zip(keys, findings):
            # a closed episode (the head no longer sees it at the run's latest steps) is dimmed, kept for the record
            dim = "dim" if f.status == "closed" else ""
            self.add_row(Text(f" {f.severity} ", style=SEV_STYLE.get(f.severity, "")), f.kind, fmt_ranks(f.ranks),
                         fmt_ranks(f.nodes), Text(fmt_steps(f), style=dim), Text(f.summary or f.analyzer, style=dim), key=k)
        if findings:
            self.move_cursor(row=min(keep, len(findings) - 1))

    @staticmethod
    def _key(i: int, f: schema.Finding) -> str:
        # a live episode keeps its id while its span, severity and status move: all of them are in the key
        return f"{f.id or f.analyzer}/{f.kind}/{f.ranks}/{f.nodes}/{f.step_start}/{f.step_end}/{f.severity}/{f.status}/{i}"

    def selected(self) -> schema.Finding | None:
        if not self.findings or self.cursor_row is None or not 0 <= self.cursor_row < len(self.findings):
            return None
        return self.findings[self.cursor_row]


class FindingDetail(Static):
    def show_finding(self, f: schema.Finding | None) -> None:
        if f is None:
            self.update(Text("no findings", style="dim"))
            return
        t = Text()
        t.append(f" {f.severity} ", style=SEV_STYLE.get(f.severity, ""))
        t.append(f" {f.kind} ", style="bold")
        t.append(f"({f.analyzer}, confidence {f.confidence:.2f})", style="dim")
        if f.simulated:
            t.append("  SIMULATED", style="bold magenta")
        t.append("\n" + (f.summary or "(no summary)") + "\n")
        t.append(f"ranks {fmt_ranks(f.ranks)}  nodes {fmt_ranks(f.nodes)}  steps {fmt_steps(f)}\n", style="dim")
        t.append("evidence: ", style="bold")
        t.append((evidence_text(f) or "(none)") + "\n")
        t.append("recommendation: ", style="bold green")
        t.append(f.recommendation or "(none)")
        self.update(t)
