"""The TUI sized to the terminal and to the job (issue 17): findings columns that fit 80 to 200 columns, panels as
tall as their rows (a 4-rank job), node rows and zoom (a 4,096-rank job), the rank drill-down, the run's lifecycle,
the keyboard help; snapshots at 80×24 and 200×60 of both jobs, and ``ranksight tui`` in tmux at 80×24.

All against the fake head (tests/tui_fakehead.py), whose refresh timer is an hour: every refresh is awaited.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tui.help import HELP, HelpScreen, action_name, key_label
from tui.rank_screen import RankScreen
from tui.screens import ActionModal, RunPicker
from tui.trace_screen import TraceScreen
from tui.widgets.findings import FindingDetail, FindingsTable, column_widths
from tui.widgets.header import RunHeader
from tui.widgets.heatmap import HeatMap
from tui.widgets.ranks import RankTable
from tui_fakehead import RUN, TOKEN, FakeHead, job_data, make_app, plain

REPO = Path(__file__).resolve().parent.parent
BIG = dict(world=4096, per_node=8, slow=2053, steps=6)  # 512 nodes; rank 2053 is on node 256


@pytest.fixture
def small():
    fh = FakeHead(job_data(4, 2, 3))
    try:
        yield fh
    finally:
        fh.stop()


@pytest.fixture(scope="module")
def big():
    fh = FakeHead(job_data(**BIG))
    try:
        yield fh
    finally:
        fh.stop()


async def loaded(app, pilot):
    await app.refresh_now()
    await pilot.pause()


def cell(table, row: int, col: str):
    return plain(table.get_cell(table.coordinate_to_cell_key((row, 0)).row_key, col))


# -- columns that fit ------------------------------------------------------------------------


async def test_findings_summary_fits_80_and_200_columns(small):
    summary = "rank 3 (node 1) is the straggler since step 20: compute 185.0 ms vs peers 103.5 ms (1.79x)"
    # the summary column takes the room left at each width (the old table cut it to 1–6 characters)
    for width, at_least in ((80, 30), (200, 50)):
        app = make_app(small)
        async with app.run_test(size=(width, 24 if width == 80 else 60)) as pilot:
            await loaded(app, pilot)
            ft = app.query_one(FindingsTable)
            shown = cell(ft, 0, "summary")
            assert len(shown) >= at_least and shown.endswith("…") and summary.startswith(shown[:-1])
            assert ft.max_scroll_x == 0  # every column in view
            assert summary in plain(app.query_one(FindingDetail).render()).replace("\n", " ")  # whole in the detail
            # a finding whose summary fits is shown whole, no ellipsis
            small.data["findings"][0]["summary"] = "rank 3 is slow"
            await loaded(app, pilot)
            assert cell(ft, 0, "summary") == "rank 3 is slow"
            small.data["findings"][0]["summary"] = summary
            await pilot.press("q")


def test_column_widths_give_the_summary_room_first():
    from ranksight import schema

    f = schema.Finding(analyzer="x", kind="collective_latency", severity="warning", ranks=list(range(40)),
                       nodes=[1, 2, 3], step_start=1200, step_end=1300, summary="s" * 200)
    wide = column_widths([f], 120)
    assert set(wide) == {"sev", "kind", "ranks", "nodes", "steps", "summary"} and wide["summary"] >= 32
    narrow = column_widths([f], 60)
    assert "nodes" not in narrow and narrow["summary"] >= 12
    assert sum(narrow.values()) + 2 * len(narrow) <= 60  # fits, padding included
    tiny = column_widths([f], 40)
    assert sum(tiny.values()) + 2 * len(tiny) <= 40 and tiny["summary"] >= 12


# -- panels sized to the job -------------------------------------------------------------------


async def test_a_4_rank_job_has_no_empty_heat_map_rows(small):
    app = make_app(small)
    async with app.run_test(size=(200, 60)) as pilot:
        await loaded(app, pilot)
        heat, ranks = app.query_one(HeatMap), app.query_one(RankTable)
        assert heat.outer_size.height == 4 + 2  # four rows and the border (the old panel filled ~30 rows)
        assert ranks.outer_size.height == 4 + 1 + 2
        assert app.query_one("#trends").outer_size.height > 20  # the room goes to the trends
        lines = plain(heat.render()).splitlines()
        assert [x[:6].strip() for x in lines] == ["r0", "r1", "r2", "r3"]
        await pilot.press("q")


async def test_a_4096_rank_job_shows_nodes_and_zooms(big):
    app = make_app(big, window=6)
    async with app.run_test(size=(200, 60)) as pilot:
        await loaded(app, pilot)
        t = app.query_one(RankTable)
        assert t.by_node and t.row_count == 512
        # the culprit's node first: its worst rank named, its figures, "slow" for 1 of its 8 ranks
        assert [plain(c) for c in t.get_row_at(0)] == ["▶", "256", "8", "39", "2053", "220.0", "185.0", "25.0",
                                                       "10.0", "0.5s", "slow 1/8"]
        assert [plain(c) for c in t.get_row_at(1)][1:5] == ["0", "8", "39", "7"]
        assert "512 nodes, 4096 ranks" in str(t.border_title)
        heat = plain(app.query_one(HeatMap).render()).splitlines()
        assert heat[0].startswith("n256") and heat[1].startswith("n0 ")
        assert "node × step" in str(app.query_one(HeatMap).border_title)
        # Enter on the node row: its 8 ranks, in the table and the heat map
        t.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert app.zoom_node == 256 and not t.by_node and t.row_count == 8
        assert [cell(t, i, "rank") for i in range(8)] == [str(r) for r in range(2048, 2056)]
        assert cell(t, 5, "state") == "slow" and cell(t, 5, "mark") == "▶"
        heat = plain(app.query_one(HeatMap).render()).splitlines()
        assert [x[:6].strip() for x in heat] == [f"r{r}" for r in range(2048, 2056)]
        assert "esc: all nodes" in str(t.border_title)
        await pilot.press("escape")
        await pilot.pause()
        assert app.zoom_node is None and t.by_node and t.row_count == 512
        # z does the same as Enter; a with a node row selected names that node
        t.move_cursor(row=0)
        await pilot.press("z")
        await pilot.pause()
        assert app.zoom_node == 256
        await pilot.press("z", "a")
        await pilot.pause()
        assert isinstance(app.screen, ActionModal) and app.screen.node == 256
        await pilot.press("n", "q")


# -- the rank drill-down ------------------------------------------------------------------------


async def test_rank_drill_down_shows_its_history_findings_and_gpu(small):
    app = make_app(small)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(app, pilot)
        t = app.query_one(RankTable)
        t.focus()
        t.move_cursor(row=3)
        await pilot.press("enter")
        await pilot.pause()
        s = app.screen
        assert isinstance(s, RankScreen) and s.rank == 3
        head = plain(s.query_one("#rank-head").render())
        assert "rank 3" in head and "node 1 (node1)" in head and "slow" in head and "culprit" in head
        assert "window steps 0–39 (40 reported)" in head
        compute = plain(s.query_one("#lbl-compute_ms").render())
        # rank 3 computes 103 ms before step 20 and 183 after; its peers' median is 101 ms (1.81x)
        assert "last 183.0" in compute and "min 103.0" in compute and "peers' median 101.0 (1.81×)" in compute
        assert s.query_one("#spark-compute_ms").data == [103.0] * 20 + [183.0] * 20
        for key in ("step_ms", "comm_ms", "data_ms", "sync_wait_ms"):
            assert len(s.query_one(f"#spark-{key}").data) == 40
        assert not s.query_one("#spark-pipeline_wait_ms").display  # no pipeline wait in this job
        assert "straggler" in plain(s.query_one("#rank-findings").render())
        gt = s.query_one("#rank-gpus")
        assert gt.row_count == 1 and cell(gt, 0, "mark") == "▲" and cell(gt, 0, "ranks") == "3"
        # ] and [ step through the ranks; the next refresh keeps the screen current
        await pilot.press("right_square_bracket")
        assert s.rank == 0 and "no findings" in plain(s.query_one("#rank-findings").render())
        await pilot.press("left_square_bracket")
        small.data["steps"] += [dict(r, step=40) for r in small.data["steps"] if r["step"] == 39]
        for r in small.data["ranks"]:
            r["step"] = 40
        await loaded(app, pilot)
        assert s.rank == 3 and "(41 reported)" in plain(s.query_one("#rank-head").render())
        await pilot.press("a")
        await pilot.pause()
        assert isinstance(app.screen, ActionModal) and app.screen.node == 1
        await pilot.press("n", "escape")
        await pilot.pause()
        assert not isinstance(app.screen, (RankScreen, ActionModal))
        await pilot.press("d")  # the key does the same as Enter
        await pilot.pause()
        assert isinstance(app.screen, RankScreen) and app.screen.rank == 3
        await pilot.press("q")
    assert app.return_code == 0


# -- the run's lifecycle -----------------------------------------------------------------------


async def test_an_ended_user_run_shows_finished_and_its_ranks_done():
    data = job_data(4, 2, 3, ended=True)  # no manifest (no layout), every rank's exit event says "finished"
    fh = FakeHead(data)
    try:
        app = make_app(fh)
        async with app.run_test(size=(120, 40)) as pilot:
            await loaded(app, pilot)
            header = plain(app.query_one(RunHeader).render())
            assert "[finished at" in header and "running" not in header
            t = app.query_one(RankTable)
            assert [cell(t, i, "state") for i in range(4)] == ["done"] * 4  # not "stale" or "ok"
            # one rank exited with an error: failed (the head says the run failed); an evicted one says so
            data["ranks"][1]["exit_reason"] = "RuntimeError: NCCL timeout"
            data["ranks"][2]["exit_reason"] = "evicted"
            data["runs"][0]["status"] = "failed"
            await loaded(app, pilot)
            assert [cell(t, i, "state") for i in range(4)] == ["done", "failed", "evicted", "done"]
            assert "[failed at" in plain(app.query_one(RunHeader).render())
            # a run the head calls stopped (no exit events, no records for a while): said so, with since when
            data["runs"][0]["status"] = "stopped"
            await loaded(app, pilot)
            assert "[stopped no record since" in plain(app.query_one(RunHeader).render())
            # a rank the head holds no record of (a head restarted on the store) is not "waiting" in an ended run
            data["ranks"][0].update(state="waiting", step=None, age_s=None, exit_reason=None)
            await loaded(app, pilot)
            assert cell(t, 0, "state") == "ended"
            await pilot.press("q")
    finally:
        fh.stop()


# -- keyboard help -----------------------------------------------------------------------------


async def test_help_lists_every_binding_with_what_it_does(small):
    from tui.app import RanksightApp

    from tui.ops_screen import OpsScreen

    screens = (RanksightApp, RankScreen, TraceScreen, OpsScreen, RunPicker, ActionModal)
    missing = [(cls.__name__, b.action) for cls in screens for b in cls.BINDINGS if action_name(b.action) not in HELP]
    assert missing == []
    app = make_app(small)
    async with app.run_test(size=(120, 60)) as pilot:
        await loaded(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = plain(app.screen.query_one("#help-text").render())
        for cls in screens:
            for b in cls.BINDINGS:
                assert f"{key_label(b.key):<14}{HELP[action_name(b.action)]}" in text, (cls.__name__, b.key)
        assert "main view" in text and "rank drill-down" in text and "Enter" in text
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
    assert app.return_code == 0


# -- snapshots: both jobs at 80×24 and 200×60 ---------------------------------------------------


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


async def _settle(pilot):
    pilot.app.timer.pause()
    await pilot.app.refresh_now()
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (200, 60)], ids=["80x24", "200x60"])
def test_snapshot_4_ranks(small, snap_compare, utc, size):
    # the fake head's port is random: name it by a fixed label (the data is what the snapshot checks)
    app = make_app(small, head_label="http://fake-head:4318")
    assert snap_compare(app, terminal_size=size, run_before=_settle)


@pytest.mark.parametrize("size", [(80, 24), (200, 60)], ids=["80x24", "200x60"])
def test_snapshot_4096_ranks(big, snap_compare, utc, size):
    app = make_app(big, head_label="http://fake-head:4318", window=6)
    assert snap_compare(app, terminal_size=size, run_before=_settle)


# -- ranksight tui in tmux, 80×24 ----------------------------------------------------------------


def capture(sock: str) -> str:
    return subprocess.run(["tmux", "-L", sock, "capture-pane", "-p", "-t", "t"], capture_output=True,
                          text=True).stdout


def wait_screen(sock: str, *want: str, timeout: float = 30) -> str:
    """The pane once every ``want`` is on it (a capture can catch a frame half drawn), or as it is at the timeout."""
    screen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(w in screen for w in want):
        time.sleep(0.3)
        screen = capture(sock)
    return screen


@pytest.mark.skipif(shutil.which("tmux") is None,
                    reason="tmux is not installed (make setup installs it as root: apt-get install tmux)")
def test_tmux_80x24_shows_the_key_elements(small, tmp_path):
    sock = f"rs-tui80-{os.getpid()}"
    # the pause: tmux sizes a detached session's pane just after it starts the command
    cmd = (f"sleep 1; cd {REPO} && TERM=xterm-256color {sys.executable} -m cli.main tui --head {small.url} "
           f"--token {TOKEN} --run {RUN} --interval 30; echo exited-$? > {tmp_path}/rc; sleep 5")
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", "t", "-x", "80", "-y", "24", cmd], check=True)
    try:
        screen = wait_screen(sock, "straggler", "q Quit", "1 throttled")
        lines = screen.splitlines()
        assert len(lines) <= 24 and max(len(x) for x in lines) <= 80, screen
        assert "run run-a  [running]  dp4×tp1×pp1  world 4  nodes 2  step 39" in screen, screen
        row3 = next(x for x in lines if "183.0" in x)  # the culprit's row: marked, slow
        assert "▶" in row3 and "slow" in row3, screen
        assert sum(1 for x in lines if x.startswith("│ r")) == 4  # the heat map: 4 rows, no empty ones
        assert "ranks (4), 1 culprit" in screen and "heat map (rank × step)" in screen
        # the finding's summary at the width, cut with an ellipsis
        assert "rank 3 (node 1) is the straggler sin" in screen and "…" in screen, screen
        assert "4 GPUs  1 throttled" in screen and "? Help" in screen and "q Quit" in screen, screen
        subprocess.run(["tmux", "-L", sock, "send-keys", "-t", "t", "?"], check=True)
        screen = wait_screen(sock, "drill down")
        assert "keys (Esc or ? closes)" in screen, screen
        subprocess.run(["tmux", "-L", sock, "send-keys", "-t", "t", "Escape"], check=True)
        time.sleep(0.5)
        subprocess.run(["tmux", "-L", sock, "send-keys", "-t", "t", "d"], check=True)
        screen = wait_screen(sock, "history over the live window")
        assert "rank 0" in screen and "compute" in screen, screen
        subprocess.run(["tmux", "-L", sock, "send-keys", "-t", "t", "q"], check=True)
        deadline = time.monotonic() + 15
        rc = tmp_path / "rc"
        while time.monotonic() < deadline and not (rc.exists() and rc.read_text().strip()):
            time.sleep(0.2)
        assert rc.read_text().strip() == "exited-0"
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


# -- make tui-shot ------------------------------------------------------------------------------


def test_tui_shot_writes_the_screen_as_svg(small, tmp_path):
    from tui.shot import main

    out = tmp_path / "img" / "tui.svg"
    assert main(["--head", small.url, "--token", TOKEN, "--out", str(out), "--size", "120x40"]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") and "run-a" in svg and "straggler" in svg and "ranksight" in svg
