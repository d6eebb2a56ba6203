"""The findings list (severity-coloured) and the detail of the selected one (the evidence in sentences with the
numbers, as the head serves them; the recommendation)."""

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


def evidence_lines(f: schema.Finding) -> tuple[list[str], str]:
    """(the evidence in sentences, the rest in words as one line) as the head serves them; a head older than the
    sentences (or evidence no sentence reads) gives none, and the rest is then the evidence as ``key=value``."""
    sentences = list(getattr(f, "evidence_sentences", None) or [])
    other = getattr(f, "evidence_other", None) or []
    if sentences or other:
        return sentences, "; ".join(f"{k} {v}" for k, v in other)
    return [], evidence_text(f)


SEV_W = 10  # " critical "
SUMMARY_WANT = 32  # below this, the summary first takes the optional columns' room
MIN_SUMMARY = 12
CAPS = {"kind": 22, "ranks": 14, "nodes": 10, "steps": 16}  # beyond these a column is cut (…), the detail has it
DROP_ORDER = ("nodes", "steps", "ranks")  # the columns given up, in this order, for the summary's room


def column_widths(findings: list[schema.Finding], width: int, padding: int = 1) -> dict[str, int]:
    """Widths that fit ``width`` cells: each column as wide as its longest value (capped), the summary the rest.

    When the summary would get fewer than ``SUMMARY_WANT`` cells, nodes, then steps, then ranks are left out (the
    detail pane shows them); when even ``MIN_SUMMARY`` does not fit, the kind column is cut."""
    def longest(key: str, vals: list[str]) -> int:
        return min(CAPS[key], max([len(key)] + [len(x) for x in vals]))

    w = {"sev": SEV_W, "kind": longest("kind", [f.kind for f in findings]),
         "ranks": longest("ranks", [fmt_ranks(f.ranks) for f in findings]),
         "nodes": longest("nodes", [fmt_ranks(f.nodes) for f in findings]),
         "steps": longest("steps", [fmt_steps(f) for f in findings])}

    def rest() -> int:
        return width - sum(w.values()) - 2 * padding * (len(w) + 1)

    for key in DROP_ORDER:
        if rest() >= SUMMARY_WANT:
            break
        del w[key]
    if rest() < MIN_SUMMARY:
        w["kind"] = max(5, w["kind"] - (MIN_SUMMARY - rest()))
    w["summary"] = max(MIN_SUMMARY, rest())
    return w


def cut(text: str, width: int) -> str:
    """``text`` in ``width`` cells: whole, or cut with an ellipsis."""
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


class FindingsTable(DataTable):
    """Severity, kind, ranks, nodes, steps and the summary, sized to the table's width (re-laid out on resize):
    columns the summary needs the room of are left out, what still does not fit is cut with "…", and the detail pane
    below shows the finding whole."""

    COLUMN_KEYS = ("sev", "kind", "ranks", "nodes", "steps", "summary")

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.findings: list[schema.Finding] = []
        self._widths: dict[str, int] | None = None
        self._keys: list[str] = []
        self._layout()

    def on_resize(self) -> None:
        self._layout()

    def _avail(self) -> int:
        # the content width less a vertical scrollbar's, which appears once the rows outgrow the height
        region = self.scrollable_content_region
        width = region.width or self.size.width or 80
        return width - (self.styles.scrollbar_size_vertical if len(self.findings) + 1 > region.height else 0)

    def _layout(self) -> None:
        widths = column_widths(self.findings, self._avail(), self.cell_padding)
        if widths == self._widths:
            return
        keep = self.cursor_row
        self._widths = widths
        self.clear(columns=True)
        for key in self.COLUMN_KEYS:
            if key in widths:
                self.add_column("summary (whole text below)" if key == "summary" and widths[key] >= 26 else key,
                                key=key, width=widths[key])
        self._fill(keep)

    def _fill(self, keep: int) -> None:
        w = self._widths
        self.clear()
        self._keys = [self._key(i, f) for i, f in enumerate(self.findings)]
        for k, f in zip(self._keys, self.findings):
            # a closed episode (the head no longer sees it at the run's latest steps) is dimmed, kept for the record
            dim = "dim" if f.status == "closed" else ""
            cells = {"sev": Text(f" {f.severity} ", style=SEV_STYLE.get(f.severity, "")), "kind": f.kind,
                     "ranks": fmt_ranks(f.ranks), "nodes": fmt_ranks(f.nodes),
                     "steps": Text(cut(fmt_steps(f), w.get("steps", 0)), style=dim),
                     "summary": Text(cut(f.summary or f.analyzer, w["summary"]), style=dim)}
            self.add_row(*(c if isinstance(c, Text) else cut(c, w[key]) for key, c in cells.items() if key in w),
                         key=k)
        if self.findings:
            self.move_cursor(row=min(keep, len(self.findings) - 1))

    def show_findings(self, findings: list[schema.Finding]) -> None:
        keys = [self._key(i, f) for i, f in enumerate(findings)]
        self.findings = findings
        if keys == self._keys:
            return
        if column_widths(findings, self._avail(), self.cell_padding) != self._widths:
            self._layout()
        else:
            self._fill(self.cursor_row)

    @staticmethod
    def _key(i: int, f: schema.Finding) -> str:
        # a live episode keeps its id while its span, severity and status move: all of them are in the key
        return (f"{f.id or f.analyzer}/{f.kind}/{f.ranks}/{f.nodes}/{f.step_start}/{f.step_end}/{f.severity}/{f.status}/"
                f"{i}/{hash(f.summary)}")

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
        sentences, rest = evidence_lines(f)
        for sentence in sentences:
            t.append(sentence + "\n", style="cyan")
        if rest or not sentences:
            t.append("measured: " if sentences else "evidence: ", style="bold" if not sentences else "dim bold")
            t.append((rest or "(none)") + "\n", style="dim" if sentences else "")
        t.append("recommendation: ", style="bold green")
        t.append(f.recommendation or "(none)")
        self.update(t)
