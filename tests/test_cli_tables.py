"""Every text table the commands print, at 80 columns (issue 17): no line wider than the terminal, no value cut
without an ellipsis rule (a cell cut by rich's squeeze, a path folded mid-name), and the elements a reader needs
present. ``runs`` and ``nccl-log`` are covered in test_cli_json.py (``assert_fits``).

- ``diagnose`` (analyzers/report/render_text.py): findings, coverage, heat map, faults, history, profiler windows;
- ``ranksight trace`` (traces/report.py): the breakdown tables, findings, notes;
- ``ranksight logs`` (logs/report.py): the inputs table, findings with where / from / next;
- ``nccl-tests --check`` (nccl_tests/health_report.py): the pairwise matrix up to 5 ranks, one line per rank above.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pandas as pd
import pytest
from analyzer_fixtures import build, with_records
from rich.cells import cell_len
from rich.console import Console

from analyzers import run_all
from analyzers.report.model import build_report
from analyzers.report.render_text import render_text
from ranksight import schema
from ranksight.schema import FaultSpec

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 80


def console(width: int = WIDTH) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None, record=True)


def lines_of(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.splitlines()]


def assert_fits(text: str, width: int = WIDTH) -> list[str]:
    lines = lines_of(text)
    wide = [ln for ln in lines if cell_len(ln) > width]
    assert not wide, f"{len(wide)} line(s) wider than {width}: {wide[0]!r}"
    return lines


def one_line(text: str) -> str:
    """The text with its wrapping undone: words joined by single spaces (to find a sentence that wraps)."""
    return " ".join(text.split())


# --- diagnose -------------------------------------------------------------------------------------------------------

def trace_summary(rank: int, kernel: float) -> schema.TraceSummary:
    return schema.TraceSummary(run_id="synth", rank=rank, step_start=10, step_end=11, wall_ms=200.0,
                               trace_file=f"/var/lib/ranksight/traces/node-0/rank-{rank}.1700000000123456789.pt.trace.json",
                               compute_ms=2 * kernel, comm_ms=12.0, overlap_ms=1.0, idle_ms=5.0, device="cuda")


@pytest.fixture(scope="module")
def diagnose_text() -> str:
    world = 64
    data = build(world=world, nodes=16, steps=30, compute_factor=lambda r, s: 1.5 if (r == 3 and s >= 10) else 1.0,
                 faults=[FaultSpec(kind="slow_rank", rank=3, factor=1.5, start=10),
                         FaultSpec(kind="xid", node=9, code=79, start=20)])
    data = with_records(data, [trace_summary(r, 15.0 if r == 3 else 10.0) for r in range(world)])
    data.actions = pd.DataFrame([{"id": "ev0001", "action": "evict", "node": 0, "status": "applied", "applied_step": 25,
                                  "dry_run": False, "requested_by": "policy:straggler-evict-after-10-steps",
                                  "finding_kind": "straggler", "reason": "rank 3 (node 0) has straggled for 15 steps",
                                  "t": 1_700_000_100.0}])
    con = console()
    render_text(build_report(data, run_all(data)), con)
    return con.export_text()


def test_diagnose_fits_80_columns_and_cuts_nothing(diagnose_text):
    lines = assert_fits(diagnose_text)
    assert "…" not in diagnose_text  # the profiler table was squeezed to "expos…", "ms/st…", "rank-…"
    text = one_line(diagnose_text)
    # the finding's sentence whole, its wrapped lines under its indent
    assert "Rank 3 computes 15" in text and "per step against its peers' 10" in text
    i = next(i for i, ln in enumerate(lines) if "Rank 3 computes" in ln)
    assert lines[i].startswith("    Rank 3") and lines[i + 1].startswith("    ") and lines[i + 1].strip()
    # the faults table: both faults whole, one found, one missed
    assert "slow_rank factor=1.5" in diagnose_text and "xid code=79" in diagnose_text and "MISSED" in diagnose_text
    # the history: the eviction and who asked, whole (a long requester folds, never "…")
    assert "evict" in text and "policy:straggler-evict-after-10-steps" in diagnose_text.replace("\n", "").replace(" ", "")
    # the profiler window: its per-step columns, the trace file column left out and named, 32 of 64 ranks
    assert "profiler trace (periodic), steps 10-11 (cuda: device kernel time)" in text
    assert re.search(r"^ +3 +0 +15\.00 +1\.50x", diagnose_text, flags=re.M), "rank 3's row"
    assert "(not shown at 80 columns: trace" in text
    assert "32 of 64 ranks shown: those with the most kernel time against the median" in text
    # the heat map: 12 rank rows (rank 3 first) and the others' p95 / median / p5
    heat = diagnose_text[diagnose_text.index("per rank x step"):]
    rows = re.findall(r"^\s*(\d+|others' \w+)  ", heat, flags=re.M)[:15]
    assert rows[0] == "3" and rows[-3:] == ["others' p95", "others' median", "others' p5"]
    assert "the other 52 ranks" in one_line(heat)
    # what to do next, numbered, its wrapped line under its text
    j = next(i for i, ln in enumerate(lines) if ln.startswith("  1. "))
    assert lines[j + 1].startswith("     ")


def test_diagnose_keeps_every_column_when_wide(diagnose_text):
    con = console(200)
    data = build(world=4, steps=20)
    data = with_records(data, [trace_summary(r, 10.0) for r in range(4)])
    render_text(build_report(data, run_all(data)), con)
    text = con.export_text()
    assert "not shown" not in text and "rank-3.1700000000123456789.pt.trace.json" in text


# --- ranksight trace --------------------------------------------------------------------------------------------------

def test_trace_text_fits_and_says_the_severity():
    from traces.report import to_text

    rep = {"verdict": "rank 5 is slow [3 of 4 windows]", "ranks": [],
           "kernel_spread": [{"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
                              "total_ms": 12.5, "min_ms": 1.0, "max_ms": 4.0, "max_rank": 5, "spread_pct": 120.0}],
           "findings": [{"severity": "warning", "kind": "straggler", "ranks": [5],
                         "summary": "rank 5's kernels take 1.8x its peers' in every window"}],
           "notes": ["rank 5: [dropped 3 events] without a launch"], "errors": {}}
    text = to_text(rep, width=WIDTH)
    assert_fits(text)
    # "[warning]" and "[dropped ...]" were read as rich markup and vanished
    assert "[warning] straggler ranks [5]" in text and "[dropped 3 events]" in text and "[3 of 4 windows]" in text
    assert "ncclDevKernel_AllReduce_Sum_f32_RING_…" in text  # cut, but with its ellipsis


# --- ranksight logs ----------------------------------------------------------------------------------------------------

def test_logs_text_fits_with_whole_paths():
    from logs.analysis import analyze
    from logs.report import render_text as logs_text

    base = ROOT / "tests" / "fixtures" / "logs" / "nccl_tests"
    report = analyze([str(base)])
    con = console()
    logs_text(report, con)
    text = con.export_text()
    lines = assert_fits(text)
    assert f"Inputs under {base}/" in one_line(text)
    shown = [i for i in report.inputs if i.formats or i.error]
    assert len(shown) >= 8
    for i in shown:  # each input's name whole on one line (a path was folded mid-name: "…/cut" + "_short.log")
        rel = str(Path(i.path).relative_to(base))
        assert any(rel in ln for ln in lines), rel
    # where / from / next under their labels, wrapped lines indented past them
    j = next(i for i, ln in enumerate(lines) if ln.strip().startswith("next:"))
    assert lines[j + 1].startswith(" " * 16) and lines[j + 1].strip()
    assert "CRITICAL" in text and "data corruption" in text


# --- nccl-tests --check ------------------------------------------------------------------------------------------------

def health(n: int, slow: int = 2, host: str = "gpu-node-{:03d}.cluster.example"):
    from nccl_tests.health_report import analyze, format_report

    pair_bw = {(i, j): (1.0 if slow in (i, j) else 10.0 + 0.01 * (i + j)) for i in range(n) for j in range(i + 1, n)}
    nodes = [host.format(r // 8) for r in range(n)]
    rep = analyze(pair_bw, nodes, 0.5)
    return "\n".join(format_report(rep, nodes, nodes, pair_bw, 1 << 20, 20, "nccl"))


@pytest.mark.parametrize("n", [4, 5, 6, 8, 64])
def test_health_check_fits_80_columns(n):
    text = health(n)
    lines = assert_fits(text)
    if n <= 5:  # the matrix: a column per peer
        assert re.search(rf"r{n - 1}$", next(ln for ln in lines if ln.startswith("# rank")))
    else:  # one line per rank: its slowest pair and peer, the median, the fastest
        assert "slowest pair" in text and "matrix" not in text and "every pair: --json or the store" in one_line(text)
        row2 = next(ln for ln in lines if re.match(r"^ +2 ", ln))
        assert re.search(r"1\.000 +r0 +1\.000 +1\.000$", row2)
        assert len([ln for ln in lines if re.match(r"^ +\d+ +\S+ +\S+ +\d+\.\d+ +r\d+ ", ln)]) == n
    assert "! rank 2 " in text and "gpu-node-000 " in text  # host names: the part before the domain
    assert "# Health check: FAILED - slow rank(s): 2 (host" in text  # what people (and tests) grep for


def test_health_check_long_names_stay_whole_on_their_own_line():
    text = health(16, host="a-very-long-host-name-that-will-not-fit-{:03d}")
    lines = assert_fits(text)
    # a node pair's name longer than its column: on a line of its own, its figures under it
    pair = next(i for i, ln in enumerate(lines) if ln.endswith("a-very-long-host-name-that-will-not-fit-000<->")) + 1
    assert lines[pair].strip() == "a-very-long-host-name-that-will-not-fit-001"
    assert re.match(r"^ {4,}\s+\d+\.\d+ +\d+\.\d+ +\d+\.\d+  (ok|SLOW)", lines[pair + 1])
    assert re.search(r" …[a-z-]*fit-000 ", text)  # the host column keeps the end of a name, behind an ellipsis


def test_comment_wraps_and_never_cuts_a_word():
    from nccl_tests.health_report import comment

    word = "x" * 100
    got = comment(f"the path {word} is long and the rest of this sentence wraps onto further comment lines")
    assert got[0] == "# the path" and got[1] == f"#   {word}" and all(ln.startswith("#") for ln in got)
    assert all(len(ln) <= WIDTH for ln in got if word not in ln)
