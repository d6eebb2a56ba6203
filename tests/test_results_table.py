"""bench/RESULTS.md stays one table with one row per claim: every row has the header's cells, a date and a verdict.

A row edited by hand can lose or gain a cell (a second command pasted beside the first, a missing date) and Markdown
then shifts every column after it without a warning; this catches that.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "RESULTS.md"
HEADER = ["claim", "command", "figure", "baseline", "ratio", "date", "goal", "met"]


def cells(line: str) -> list[str]:
    """The cells of a Markdown table row; a `|` inside backticks is text (commands can hold pipes)."""
    out, cur, code = [], "", False
    for ch in line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]:
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def test_cells_split_on_pipes_outside_code():
    assert cells("| a | `x | y` | c |") == ["a", "`x | y`", "c"]
    assert cells("| a | b") == ["a", "b"]


def test_every_row_has_the_headers_cells_a_date_and_a_verdict():
    lines = RESULTS.read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| claim |")))
    assert cells(lines[start]) == HEADER
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    assert len(rows) > 10
    ids = []
    for row in rows:
        claim = row[0][:60]
        assert len(row) == len(HEADER), (claim, len(row))
        assert re.fullmatch(r"\*\*[A-Z]+[0-9]+\*\*.*", row[0]), claim
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", row[HEADER.index("date")]), (claim, row[HEADER.index("date")])
        assert row[HEADER.index("met")], claim
        ids.append(row[0].split("**")[1])
    assert len(ids) == len(set(ids)), "a claim id is used twice"
