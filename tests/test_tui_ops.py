"""The TUI's raw-ops screen (``o``, tui/ops_screen.py): a rank's raw collective records over its last steps, read on
demand through the head's drill-down route, moved and widened with keys, and a refusal shown with its reason. Against
the fake head (tests/tui_fakehead.py); the route itself is tested against real agents in tests/test_ops_proxy.py."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from tui.ops_screen import OpsScreen
from tui.rank_screen import RankScreen
from tui.widgets.ranks import RankTable
from tui_fakehead import RUN, T0, FakeHead, job_data, make_app, plain


@pytest.fixture
def small():
    fh = FakeHead(job_data(4, 2, 3))
    try:
        yield fh
    finally:
        fh.stop()


def answer(q: dict) -> tuple[int, dict]:
    """Rank R's ops over the steps asked: 3 TP all-reduces a step of 10 ms, the second of step B 40 ms."""
    rank = int(q["rank"])
    a, b = (int(x) for x in q["steps"].split("-"))
    ops = []
    for step in range(a, b + 1):
        for i in range(3):
            dur = 40.0 if (step == b and i == 1) else 10.0
            t = T0 + step + i * 0.05
            ops.append({"kind": "collective", "run_id": RUN, "rank": rank, "step": step, "seq": step * 3 + i,
                        "op": "all_reduce", "group": "tp", "nbytes": 4 << 20, "t_arrive": t, "t_done": t + dur / 1e3,
                        "duration_ms": dur, "comm_id": "tp-0"})
    return 200, {"run_id": RUN, "node": rank // 2, "rank": rank, "step_from": a, "step_to": b, "limit": 10000,
                 "ops": ops, "truncated": False, "damaged_lines": 0}


def ops_queries(fh: FakeHead) -> list[dict]:
    return [{k: v[-1] for k, v in parse_qs(urlsplit(g).query).items()} for g in fh.gets if "/ops?" in g]


async def settle(app, pilot):
    await app.workers.wait_for_complete()
    await pilot.pause()


async def select_rank(app, pilot, row: int) -> None:
    """The first refresh read, then the rank table focused on ``row``."""
    await app.refresh_now()
    await pilot.pause()
    t = app.query_one(RankTable)
    t.focus()
    t.move_cursor(row=row)


async def test_o_shows_the_selected_rank_s_last_steps_and_moves_with_the_keys(small):
    small.ops = answer
    app = make_app(small)
    async with app.run_test(size=(120, 40)) as pilot:
        await select_rank(app, pilot, 3)
        await pilot.press("o")
        await settle(app, pilot)
        s = app.screen
        assert isinstance(s, OpsScreen) and s.rank == 3
        assert ops_queries(small)[-1] == {"rank": "3", "steps": "38-39"}  # its last step in the window is 39
        head = plain(s.query_one("#ops-head").render())
        assert "rank 3 (node 1)  steps 38-39" in head and "6 op(s)" in head
        table = s.query_one("#ops-table")
        assert table.row_count == 6
        vs = [plain(table.get_row_at(i)[-1]) for i in range(6)]
        # the slow op stands 20 ms above its fold's mean (10, 40, 10: mean 20); the others 10 below it
        assert vs == ["+0.00", "+0.00", "+0.00", "-10.00", "+20.00", "-10.00"]
        assert "communicator tp: tp-0" in plain(s.query_one("#ops-notes").render())
        await pilot.press("left_square_bracket")
        await settle(app, pilot)
        assert ops_queries(small)[-1]["steps"] == "36-37"
        await pilot.press("plus")
        await settle(app, pilot)
        assert ops_queries(small)[-1]["steps"] == "35-37" and s.query_one("#ops-table").row_count == 9
        await pilot.press("right_square_bracket")
        await settle(app, pilot)
        assert ops_queries(small)[-1]["steps"] == "38-40"
        # the agent refuses (the head passes its reason on): said, and the last rows stay
        small.ops = lambda q: (502, {"error": "node 1: the agent's control endpoint is unreachable"})
        await pilot.press("r")
        await settle(app, pilot)
        head = plain(s.query_one("#ops-head").render())
        assert "refused (502): node 1: the agent's control endpoint is unreachable" in head
        assert "from the last read" in head and s.query_one("#ops-table").row_count == 9
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, OpsScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_o_on_the_rank_drill_down_opens_that_rank_s_ops(small):
    small.ops = answer
    app = make_app(small)
    async with app.run_test(size=(120, 40)) as pilot:
        await select_rank(app, pilot, 1)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, RankScreen)
        await pilot.press("right_square_bracket")  # rank 2
        await pilot.press("o")
        await settle(app, pilot)
        assert isinstance(app.screen, OpsScreen) and app.screen.rank == 2
        assert ops_queries(small)[-1]["rank"] == "2"
        await pilot.press("o")  # o again goes back to the drill-down
        await pilot.pause()
        assert isinstance(app.screen, RankScreen)
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_head_without_the_route_is_said_not_a_crash(small):
    app = make_app(small)  # small.ops is None: the fake head answers 404, as a head from before the route
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        app.query_one(RankTable).focus()
        await pilot.press("o")
        await settle(app, pilot)
        head = plain(app.screen.query_one("#ops-head").render())
        assert "refused (404)" in head and "no such endpoint" in head
        await pilot.press("q")
    assert app.return_code == 0
