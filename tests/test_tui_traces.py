"""The TUI's traces screen (key t) against the fake head, whose /traces answers through the head's own
``head.trace_windows``: the newest capture's per-step figures, the slowest rank marked, the CPU caveat, the empty
state, node rows when the ranks do not fit, stale data when the head goes away, and 80x24 without cut numbers.

The refresh timer interval is an hour: every refresh is one the test awaits. No timed assertions.
"""

from __future__ import annotations

import re

import pytest

from tui.client import HeadClient
from tui.screens import ActionModal
from tui.trace_model import CPU_NOTE, EMPTY_NOTE, build_trace_view
from tui.trace_screen import TraceScreen
from tui.widgets.traces import TracePanel
from tui_fakehead import RUN, TOKEN, FakeHead, make_app, plain, trace_summary


@pytest.fixture
def fake():
    fh = FakeHead()
    try:
        yield fh
    finally:
        fh.stop()


def screen_text(app) -> str:
    """What the terminal shows, line by line (the compositor's full frame)."""
    update = app.screen._compositor.render_update(full=True)
    return "\n".join("".join(seg.text for seg in strip) for strip in update.strips)


async def open_traces(app, pilot):
    await app.refresh_now()
    await pilot.press("t")
    await pilot.pause()
    await app.refresh_now()  # the screen's first read (the tick it started may still be in flight)
    await pilot.pause()
    assert isinstance(app.screen, TraceScreen)
    return app.screen.query_one(TracePanel)


def table_rows(panel) -> dict[str, list[str]]:
    t = panel.query_one("#trace-table")
    return {str(k.value): [plain(c) for c in t.get_row(k)] for k in t.rows}


# -- client and model --------------------------------------------------------------------------


def test_client_reads_the_newest_window(fake):
    rows = HeadClient(fake.url, token=TOKEN).traces(RUN, windows=1)
    assert [r.rank for r in rows] == list(range(8)) and {r.step_start for r in rows} == {30}
    assert rows[5].kernel_ms_per_step == pytest.approx(180.0) and rows[0].trace_file == "rank-0.step30-34.json"
    # both windows on request, the older one first; the view takes the newest
    both = HeadClient(fake.url, token=TOKEN).traces(RUN, windows=4)
    assert [r.step_start for r in both] == [10] * 8 + [30] * 8
    v = build_trace_view(both, world=8)
    assert (v.step_start, v.step_end, v.steps) == (30, 34, 5)
    # an independent median: kernels 100..107 with rank 5 at 180 -> (103 + 104) / 2
    assert v.median_kernel == pytest.approx(103.5)
    assert v.slowest.rank == 5 and v.slowest.ratio == pytest.approx(180 / 103.5)
    assert [n.rank for n in v.nodes()] == [3, 5]  # node 0's slowest is rank 3, node 1's rank 5


def test_one_rank_is_no_one_slower():
    from tui.client import TraceRow

    v = build_trace_view([TraceRow(rank=0, step_start=1, step_end=2, steps=2, kernel_ms_per_step=5.0)])
    assert v.slowest is None and v.ranks[0].ratio == pytest.approx(1.0)


# -- the screen ------------------------------------------------------------------------------


async def test_traces_screen_figures_and_the_slowest_rank(fake):
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        panel = await open_traces(app, pilot)
        assert any("/traces?windows=1" in g for g in fake.gets)
        rows = table_rows(panel)
        assert list(rows) == [f"r{r}" for r in range(8)]
        # kernel 100 + rank, NCCL 40, exposed 40 - 10, idle 8 of 140 + rank ms, ratio to the median 103.5
        assert rows["r0"] == ["", "0", "0", "100.0", "40.0", "30.0", "6%", "0.97×"]
        assert rows["r5"] == ["▶", "5", "1", "180.0", "40.0", "30.0", "4%", "1.74×"]
        t = panel.query_one("#trace-table")
        r5 = t.get_row("r5")
        assert "red" in str(r5[1].style) and "reverse" in str(r5[-1].style)
        assert "red" not in str(t.get_row("r0")[1].style)
        header = plain(panel.query_one("#trace-header").render())
        assert "steps 30–34 (5 steps)" in header and "device cuda" in header and "8 ranks" in header
        assert "median kernel 103.5" in header and "slowest rank 5 (node 1) 1.74×" in header
        assert CPU_NOTE not in header
        # the fake run's GPUs are simulated: the screen says so too
        assert "SIMULATED GPU" in header
        # back with escape; t is in the main screen's footer
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, TraceScreen) and app._traces is None
        assert "Traces" in screen_text(app)
        n = len(fake.gets)
        await app.refresh_now()
        assert not any("/traces" in g for g in fake.gets[n:])  # read only while the screen is open


async def test_cpu_trace_says_so(fake):
    fake.data["traces"] = [trace_summary(r, device="cpu") for r in range(4)]
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        panel = await open_traces(app, pilot)
        header = plain(panel.query_one("#trace-header").render())
        assert CPU_NOTE in header and "device cpu" in header
        labels = [plain(c.label) for c in panel.query_one("#trace-table").columns.values()]
        assert "host op" in labels and "kernel" not in labels and "NCCL" not in labels


async def test_empty_state_and_a_requests_a_profile(fake):
    fake.data["traces"] = []
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        panel = await open_traces(app, pilot)
        assert EMPTY_NOTE in plain(panel.query_one("#trace-header").render())
        assert panel.query_one("#trace-table").row_count == 0
        await pilot.press("a")
        await pilot.pause()
        assert isinstance(app.screen, ActionModal)  # the dialog for the selected rank's node
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, TraceScreen)


async def test_older_head_without_the_endpoint(fake):
    del fake.data["traces"]
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        panel = await open_traces(app, pilot)
        assert "no traces endpoint" in plain(panel.query_one("#trace-header").render())
        assert app.error == ""  # the rest of the app reads on


async def test_head_gone_keeps_the_capture_marked_stale(fake):
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        panel = await open_traces(app, pilot)
        fake.stop()
        await app.refresh_now()
        await pilot.pause()
        assert panel.has_class("stale")
        assert table_rows(panel)["r5"][-1] == "1.74×"  # the last data stays
        header = plain(panel.query_one("#trace-header").render())
        assert "STALE" in header and "unreachable since" in header
        assert "UNREACHABLE" in screen_text(app)  # the status line on this screen too


async def test_many_ranks_become_nodes_with_the_slowest_named(fake):
    # 64 ranks on 8 nodes (8 per node): rank 45 (node 5) is slow; 64 rows do not fit 24 lines
    fake.data["ranks"] = [{"rank": r, "node": r // 8, "host": f"node{r // 8}", "step": 39, "state": "running"}
                          for r in range(64)]
    kernel = {r: 250.0 if r == 45 else 100.0 + r % 8 for r in range(64)}
    fake.data["traces"] = [trace_summary(r, compute_ms=5 * kernel[r], wall_ms=5 * (kernel[r] + 40.0)) for r in range(64)]
    app = make_app(fake)
    async with app.run_test(size=(80, 24)) as pilot:
        panel = await open_traces(app, pilot)
        assert panel.by_node
        rows = table_rows(panel)
        assert list(rows) == [f"n{n}" for n in range(8)]
        # node, ranks, slowest rank, its kernel, NCCL, exposed, idle, ratio to the median over all 64 ranks (103.5)
        assert rows["n5"] == ["▶", "5", "8", "45", "250.0", "40.0", "30.0", "3%", "2.42×"]
        assert rows["n0"][:5] == ["", "0", "8", "7", "107.0"]
        assert "one row per node" in plain(panel.query_one("#trace-header").render())
        # a: the dialog for the selected node's slowest rank
        await pilot.press("down", "down", "down", "down", "down")
        assert panel.selected_rank() == 45
        text = screen_text(app)
        assert "2.42×" in text and "▶" in text
    # the same job in a tall terminal: ranks again
    app = make_app(fake)
    async with app.run_test(size=(100, 80)) as pilot:
        panel = await open_traces(app, pilot)
        assert not panel.by_node and len(table_rows(panel)) == 64


async def test_fits_80x24_without_cutting_numbers(fake):
    fake.data["traces"] = [trace_summary(r, device="cpu", compute_ms=5 * 12345.6, comm_ms=5 * 9876.5,
                                         truncated=r == 2, notes=["truncated: cut"] if r == 2 else [])
                           for r in range(8)]
    app = make_app(fake)
    async with app.run_test(size=(80, 24)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        footer = screen_text(app).splitlines()[-1]
        assert "t Traces" in footer and "q Quit" in footer  # the key is in view at 80 columns
        panel = await open_traces(app, pilot)
        assert not panel.by_node
        t = panel.query_one("#trace-table")
        assert t.max_scroll_x == 0  # every column in view, no horizontal scroll
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        assert CPU_NOTE in text and "cut short" in text
        for r, cells in table_rows(panel).items():
            for cell in cells[1:]:
                assert re.search(rf"(^|\s){re.escape(cell)}(\s|$)", text), (r, cell)  # each figure whole on screen
        assert "12345.6" in text and "9876.5" in text
        assert "esc" in lines[-1] and "Back" in lines[-1]


async def test_against_a_real_head(tmp_path):
    """The route and the client agree: a real head (in-process, no analyzer) fed three ranks' summaries."""
    import threading

    from head.api import make_server
    from head.service import Head
    from ranksight import schema
    from tui.app import RanksightApp

    h = Head(tmp_path / "store", TOKEN, analyzer=None)
    srv = make_server(h, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        live = h.live.run(RUN)
        live.manifest = schema.Manifest(
            run_id=RUN, created=0.0, start_time=0.0, nodes=3, device="cpu",
            ranks=[schema.RankPlacement(rank=r, node=r, host=f"n{r}", local_rank=0, pp_stage=0, dp_rank=r, tp_rank=0)
                   for r in range(3)])
        import msgspec

        live.add("trace_summaries", msgspec.convert(
            [trace_summary(r, 7, 8, device="cpu", compute_ms=2 * (50.0 if r != 1 else 80.0)) for r in range(3)],
            list[schema.TraceSummary]))
        app = RanksightApp(HeadClient(f"http://127.0.0.1:{srv.server_address[1]}", token=TOKEN, timeout=5.0),
                           run_id=RUN, interval=3600)
        async with app.run_test(size=(80, 24)) as pilot:
            panel = await open_traces(app, pilot)
            rows = table_rows(panel)
            assert rows["r1"][:4] == ["▶", "1", "1", "80.0"] and rows["r1"][-1] == "1.60×"
            header = plain(panel.query_one("#trace-header").render())
            assert "steps 7–8 (2 steps)" in header and CPU_NOTE in header and "3 ranks" in header
    finally:
        srv.shutdown()
        srv.server_close()
        h.close()
