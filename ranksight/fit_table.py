"""Rich tables that fit the terminal without cutting a value.

Rich squeezes a table that is wider than its console by cutting cells with an ellipsis, so a run id or a number can
be shown wrong. ``fit_table`` builds the table with every column folding (a value too long for any width wraps onto
the next line, whole) and, while the table's narrowest layout is still wider than the console, drops the columns the
caller named as the least useful, in that order. The caller says which were dropped (``dropped_note``), so a reader
knows that more is there (``--json`` always has everything).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.cells import cell_len
from rich.table import Table


@dataclass
class Col:
    """One column: its header and alignment (which columns may go is ``fit_table``'s ``drop_order``)."""

    header: str
    justify: str = "left"
    style: str | None = None


@dataclass
class Fitted:
    table: Table
    dropped: list[str] = field(default_factory=list)


def _text(cell: Any) -> str:
    return cell.plain if hasattr(cell, "plain") else str(cell)


def _whole_width(header: str, cells: Iterable[Any]) -> int:
    """The width a column needs to show each of its values on one line (its header may wrap between words)."""
    w = max((cell_len(word) for word in header.split()), default=1)
    for c in cells:
        w = max(w, max((cell_len(line) for line in _text(c).splitlines()), default=0))
    return w


def _build(cols: Sequence[Col], rows: Sequence[Sequence[Any]], keep: list[int], widths: dict[int, int] | None,
           **table_kw) -> Table:
    t = Table(**table_kw)
    for i in keep:
        c = cols[i]
        # fold, never ellipsis: should a value still not fit, it wraps onto the next line instead of being cut
        t.add_column(c.header, justify=c.justify, overflow="fold", style=c.style,
                     width=widths[i] if widths else None)
    for r in rows:
        t.add_row(*(r[i] if hasattr(r[i], "__rich_console__") else str(r[i]) for i in keep))
    return t


def fit_table(console: Console, cols: Sequence[Col], rows: Iterable[Sequence[Any]], drop_order: Sequence[str] = (),
              width: int | None = None, **table_kw) -> Fitted:
    """A table of ``rows`` under ``cols`` no wider than ``width`` (default: the console's), every value whole on its
    line, when dropping the columns named in ``drop_order`` (first named, first dropped) gets it there; else without
    all of them, the values too long for their column wrapped (never cut). ``table_kw`` goes to
    ``rich.table.Table`` (title, caption, ...)."""
    rows = [list(r) for r in rows]
    width = width or console.width
    table_kw.setdefault("box", box.SIMPLE_HEAD)
    table_kw.setdefault("pad_edge", False)
    # Rich would squeeze the widest columns first, splitting a run id or a date mid-value: fix each column at the
    # width of its longest value instead, and take columns away until that fits.
    whole = {i: _whole_width(c.header, (r[i] for r in rows)) for i, c in enumerate(cols)}
    keep = list(range(len(cols)))
    dropped: list[str] = []
    index = {c.header: i for i, c in enumerate(cols)}
    order = [index[h] for h in drop_order if h in index]
    while True:
        t = _build(cols, rows, keep, whole, **table_kw)
        need = Measurement.get(console, console.options.update_width(10_000), t).maximum
        if need <= width:
            return Fitted(t, dropped)
        if not order:
            # still too wide with every droppable column gone: rich's own layout, values folded (never cut)
            return Fitted(_build(cols, rows, keep, None, **table_kw), dropped)
        i = order.pop(0)
        keep.remove(i)
        dropped.append(cols[i].header)


def dropped_note(dropped: Sequence[str], width: int) -> str:
    """The line printed under a table that lost columns to the terminal's width."""
    if not dropped:
        return ""
    return (f"(not shown at {width} columns: {', '.join(dropped)}; a wider terminal or --json shows them)")
