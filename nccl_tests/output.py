"""nccl-tests' text report: header, one row per size, footer. Pure string formatting."""

from __future__ import annotations

from dataclasses import dataclass, field

# Column widths follow nccl-tests' printf formats (src/common.cu).
_LEFT = [("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6), ("root", "", 6)]
_BLOCK = [("time", "(us)", 7), ("algbw", "(GB/s)", 6), ("busbw", "(GB/s)", 6), ("#wrong", "", 6)]


@dataclass
class Result:
    """One placement (out-of-place or in-place) of one size row."""

    time_us: float
    algbw: float
    busbw: float
    wrong: int | None  # None: not checked (-c 0)


@dataclass
class Row:
    op: str
    size: int  # bytes of the whole buffer (the S of algbw)
    count: int  # elements of the whole buffer
    type_name: str
    redop: str  # "none" for ops without a reduction
    root: int  # -1 for ops without a root
    out_of_place: Result
    in_place: Result
    t: float = 0.0  # unix time the row finished
    per_rank_us: dict = field(default_factory=dict)  # {"out_of_place": [...], "in_place": [...]}


def _time_str(us: float) -> str:
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def _line(cells: list[tuple[str, int]], first_hash: bool) -> str:
    parts = []
    for i, (text, width) in enumerate(cells):
        if i == 0 and first_hash:
            parts.append("#" + text.rjust(width - 1))
        else:
            parts.append(text.rjust(width))
    return "  ".join(parts)


def table_header() -> list[str]:
    left_w = sum(w for _, _, w in _LEFT) + 2 * (len(_LEFT) - 1)
    block_w = sum(w for _, _, w in _BLOCK) + 2 * len(_BLOCK)
    title = "#" + " " * (left_w - 1) + "out-of-place".center(block_w) + "in-place".center(block_w)
    names = _line([(n, w) for n, _, w in _LEFT] + [(n, w) for n, _, w in _BLOCK] * 2, True)
    units = _line([(u, w) for _, u, w in _LEFT] + [(u, w) for _, u, w in _BLOCK] * 2, True)
    return [title.rstrip(), names, units.rstrip()]


def format_row(row: Row) -> str:
    s = f"{row.size:12d}  {row.count:12d}  {row.type_name:>8s}  {row.redop:>6s}  {row.root:6d}"
    for res in (row.out_of_place, row.in_place):
        wrong = "N/A" if res.wrong is None else str(res.wrong)
        s += f"  {_time_str(res.time_us)}  {res.algbw:6.2f}  {res.busbw:6.2f}  {wrong:>6s}"
    return s


def avg_busbw(rows: list[Row]) -> float:
    """nccl-tests' "Avg bus bandwidth": the mean of out-of-place and in-place busbw over all rows."""
    vals = [r.out_of_place.busbw for r in rows] + [r.in_place.busbw for r in rows]
    return sum(vals) / len(vals) if vals else 0.0


def total_wrong(rows: list[Row]) -> int:
    return sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows)


def footer(rows: list[Row], checked: bool) -> list[str]:
    wrong = total_wrong(rows)
    status = "OK" if wrong == 0 else "FAILED"
    lines = [f"# Out of bounds values : {wrong} {status}" + ("" if checked else " (not checked: -c 0)"),
             f"# Avg bus bandwidth    : {avg_busbw(rows):g} ", "#"]
    return lines


def parse_table(text: str) -> list[dict]:
    """Parse the data rows of a report (for tests and for people who pipe the output)."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        f = line.split()
        if len(f) != 13:
            continue
        try:
            def res(i: int) -> dict:
                return {"time_us": float(f[i]), "algbw": float(f[i + 1]), "busbw": float(f[i + 2]),
                        "wrong": None if f[i + 3] == "N/A" else int(f[i + 3])}
            rows.append({"size": int(f[0]), "count": int(f[1]), "type": f[2], "redop": f[3], "root": int(f[4]),
                         "out_of_place": res(5), "in_place": res(9)})
        except ValueError:
            continue
    return rows
