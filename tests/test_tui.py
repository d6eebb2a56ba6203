"""The TUI against a fake head (stdlib http.server on 127.0.0.1 answering the head's API shapes).

Driven with App.run_test() + Pilot; the refresh timer interval is an hour, so every refresh
is one the test awaits (``app.refresh_now()``): no timed assertions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from tui.client import ClientError, HeadClient, HeadError, HeadUnreachable, MalformedResponse, StepWindow
from tui.model import build_view
from tui.widgets.findings import FindingDetail, FindingsTable
from tui.widgets.header import RunHeader, StatusBar, header_text
from tui.widgets.heatmap import BLOCK, render_heat
from tui.widgets.ranks import RankTable
from tui.widgets.actions import ActionsTable
from ranksight import schema
from tui_fakehead import RUN, T0, TOKEN, FakeHead, make_app, plain, step_record

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake():
    fh = FakeHead()
    try:
        yield fh
    finally:
        fh.stop()


# -- client -----------------------------------------------------------------------------


def test_client_typed_reads_and_error_kinds(fake):
    c = HeadClient(fake.url, token=TOKEN)
    d = c.fetch(RUN, window=10)
    assert d.run.run_id == RUN and d.run.layout["pp"] == 2 and d.run.peak_simulated is True
    assert sorted({s.step for s in d.steps}) == list(range(30, 40))  # the last `window` steps (since is exclusive)
    assert d.findings[0].evidence["ratio"] == pytest.approx(1.787)
    assert [a.id for a in d.actions] == ["ck0001"] and d.skipped == {}

    # Findings read back from Parquet carry evidence as JSON text; one broken item is skipped and counted.
    f0 = dict(fake.data["findings"][0], evidence=json.dumps({"ratio": 2.5}), ranks="[5]")
    fake.data["findings"] = [f0, {"analyzer": "x", "kind": "straggler", "severity": "warning", "step_start": "soon"}]
    skipped: dict[str, int] = {}
    got = c.findings(RUN, skipped)
    assert len(got) == 1 and got[0].evidence == {"ratio": 2.5} and got[0].ranks == [5]
    assert skipped == {"findings": 1}

    fake.raw["/api/runs"] = b"<html>proxy error</html>"
    with pytest.raises(MalformedResponse, match="not JSON"):
        c.runs()
    fake.raw["/api/runs"] = b'{"runs": []}'
    with pytest.raises(MalformedResponse, match="expected a JSON list"):
        c.runs()
    with pytest.raises(HeadError) as e:
        c._request("GET", "/api/nope")
    assert e.value.status == 404 and "no such endpoint" in e.value.message
    with pytest.raises(ClientError, match="no token"):
        HeadClient(fake.url, token="").request_action(RUN, "checkpoint")
    with pytest.raises(HeadError) as e:
        HeadClient(fake.url, token="wrong").request_action(RUN, "checkpoint")
    assert e.value.status == 401 and fake.posts[-1]["auth"] == "Bearer wrong"
    fake.stop()
    with pytest.raises(HeadUnreachable, match="refused"):
        c.runs()


def test_step_window_fetches_only_what_is_new(fake):
    c = HeadClient(fake.url)
    w = StepWindow(window=20)

    def since_asked():
        return [int(p.split("since=")[1].split("&")[0]) for p in fake.gets if "/steps?" in p][-1]

    d = c.fetch(RUN, 20, w)
    assert since_asked() == 19 and sorted({s.step for s in d.steps}) == list(range(20, 40))
    # Rank 7 is stalled at 31: it does not hold the window back; the live ranks all hold step 39.
    d = c.fetch(RUN, 20, w)
    assert since_asked() == 39 and len(d.steps) == 20 * 8 - 0  # nothing new, the window is kept
    # Node 1's agent is behind: its ranks report step 41, node 0's 43. Ask from the slowest live rank.
    for s in (40, 41, 42, 43):
        for r in range(8):
            if r < 4 or (s <= 41 and r != 7):
                fake.data["steps"].append(step_record(r, s))
    for r in fake.data["ranks"]:
        if r["state"] == "running":
            r["step"] = 43 if r["rank"] < 4 else 41
    d = c.fetch(RUN, 20, w)
    assert since_asked() == 39
    assert min(s.step for s in d.steps) == 24 and max(s.step for s in d.steps) == 43  # pruned to the window
    d = c.fetch(RUN, 20, w)
    assert since_asked() == 41
    # A restart (attempt 1, resumed from step 30): the cache starts over.
    for r in fake.data["ranks"]:
        r.update(attempt=1, step=32)
    fake.data["runs"][0]["last_step"] = 32
    fake.data["steps"] = [dict(step_record(r, s), attempt=1) for s in range(30, 33) for r in range(8)]
    d = c.fetch(RUN, 20, w)
    assert since_asked() == 12 and {(s.step, s.attempt) for s in d.steps} == {(30, 1), (31, 1), (32, 1)}


# -- model -------------------------------------------------------------------------------


def test_model_states_throughput_and_mfu(fake):
    v = build_view(RUN, HeadClient(fake.url).fetch(RUN, 60))
    states = {r.rank: r.state for r in v.rows}
    assert states == {0: "ok", 1: "ok", 2: "ok", 3: "ok", 4: "ok", 5: "slow", 6: "ok", 7: "stale"}
    assert v.culprits == {5}
    # 8 ranks x 4096 tokens, each tp x pp (=2) group counts its replica once, 220 ms steps
    assert v.tokens_per_s == pytest.approx(8 * 4096 / 2 / 0.22)
    assert v.mfu == pytest.approx(2.0e12 / 0.22 / 1.0e14)
    assert "simulated/CPU-measured peak" in v.peak_label
    assert v.step_ms_series[:20] == [140.0] * 20 and v.step_ms_series[-1] == 220.0
    assert v.loss_series[0] == pytest.approx(4.0) and v.loss_series[-1] == pytest.approx(4.0 - 39 * 0.02)

    # After a restart (attempt 1 resumed at step 30) the old attempt's steps 30..39 are superseded.
    data = HeadClient(fake.url).fetch(RUN, 60)
    data.steps += [msgspec.convert(dict(step_record(r, s), attempt=1), schema.StepRecord) for s in (30, 31) for r in range(8)]
    v2 = build_view(RUN, data)
    assert v2.steps[-1] == 31 and len(v2.steps) == 32 and v2.heat[0][-1] == 100.0

    # An applied evict of node 1 with its ranks finished -> "evicted"; a dry-run evict would not count.
    data = HeadClient(fake.url).fetch(RUN, 60)
    for r in data.ranks:
        if r.node == 1:
            object.__setattr__(r, "state", "finished")
    ev = data.actions[0].__class__(run_id=RUN, id="ev1", t=T0, action="evict", node=1, status="applied")
    assert {r.rank: r.state for r in build_view(RUN, data).rows if r.node == 1} == {4: "done", 5: "done", 6: "done", 7: "done"}
    data.actions.append(ev)
    assert {r.state for r in build_view(RUN, data).rows if r.node == 1} == {"evicted"}


def test_culprits_are_the_ranks_of_the_worst_findings(fake):
    c = HeadClient(fake.url)
    assert build_view(RUN, c.fetch(RUN, 60)).culprits == {5}  # the warning; the info finding names none
    fake.data["findings"].append({"analyzer": "gpu_health", "kind": "gpu_health", "severity": "critical", "ranks": [],
                                  "nodes": [0], "evidence": {"xid": 79}, "summary": "XID 79 on node 0"})
    v = build_view(RUN, c.fetch(RUN, 60))
    assert v.culprits == {0, 1, 2, 3}  # a critical finding about node 0: its ranks; the older warning steps back
    assert {r.rank: r.state for r in v.rows if r.rank in (0, 5)} == {0: "slow", 5: "slow"}  # 5 still computes 1.8x
    fake.data["findings"] = [f for f in fake.data["findings"] if f["severity"] == "info"]
    assert build_view(RUN, c.fetch(RUN, 60)).culprits == set()


def test_heat_map_marks_the_slow_rank_hot(fake):
    v = build_view(RUN, HeadClient(fake.url).fetch(RUN, 60))
    t = render_heat(v, max_cols=40)
    lines = t.split("\n")
    r5 = next(line for line in lines if line.plain.startswith("r5"))
    r0 = next(line for line in lines if line.plain.startswith("r0"))
    hot = "#d0021b"
    def hot_cells(line):
        return sum(s.end - s.start for s in line.spans if str(s.style) == hot)

    assert hot_cells(r5) == 20 and r5.plain.endswith(BLOCK * 40)  # steps 20..39 at 1.79x the median
    assert hot_cells(r0) == 0


# -- the app --------------------------------------------------------------------------------


async def test_table_culprit_header_findings(fake):
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        t = app.query_one(RankTable)
        assert t.row_count == 8
        row5 = t.get_row("5")
        assert [plain(c) for c in row5] == ["▶", "5", "1", "1", "39", "220.0", "185.0", "25.0", "10.0", "0.5s", "slow"]
        assert "red" in str(row5[1].style) and "reverse" in str(row5[-1].style)
        row0 = t.get_row("0")
        assert plain(row0[0]) == "" and "red" not in str(row0[1].style) and plain(row0[-1]) == "ok"
        assert plain(t.get_row("7")[-1]) == "stale" and plain(t.get_row("7")[4]) == "31"
        assert "1 culprit" in str(t.border_title)

        header = plain(app.query_one(RunHeader).render())
        assert "run-a" in header and "dp4×tp1×pp2" in header and "world 8" in header and "nodes 2" in header
        assert "step 39" in header and "tokens/s 74.47k" in header and "9.09 TFLOP/s/rank" in header and "MFU 9.1%" in header
        assert "simulated/CPU-measured peak" in header

        ft = app.query_one(FindingsTable)
        assert ft.row_count == 2 and plain(ft.get_row_at(0)[1]) == "straggler"  # warning sorts before info
        detail = plain(app.query_one(FindingDetail).render())
        # the evidence in the head's sentences, not key=value (issue 17); what no sentence says, in words
        assert "Rank 5 computes 185 ms per step against its peers' 104 ms (1.79x) since step 20." in detail
        assert "measured: cusum threshold 0.393" in detail and "=" not in detail
        assert "checkpoint and evict node 1" in detail

        await pilot.press("f")
        assert app.focused is ft
        await pilot.press("down")
        await pilot.pause()
        assert ("The pipeline idles 21% of each step against 20% in theory for 2 stages, 8 micro-batches and the "
                "1f1b schedule." in plain(app.query_one(FindingDetail).render()))

        assert app.query_one(ActionsTable).row_count == 1
        await pilot.press("q")
    assert app.return_code == 0


async def test_detail_from_a_head_before_the_sentences_falls_back_to_key_value(fake):
    fake.old_findings = True  # findings without evidence_sentences / evidence_other
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        detail = plain(app.query_one(FindingDetail).render())
        assert "evidence: " in detail and "rank_median_compute_ms=185" in detail and "computes" not in detail
        await pilot.press("q")


def test_client_reads_the_sentences_and_survives_bad_ones(fake):
    c = HeadClient(fake.url, token=TOKEN)
    f = c.findings(RUN)[0]
    assert f.evidence_sentences[0].startswith("Rank 5 computes 185 ms per step")
    assert ("cusum threshold", "0.393") in f.evidence_other and isinstance(f, schema.Finding)
    # words of the wrong shape cost the finding its words, not the finding
    bad = dict(fake.data["findings"][0], evidence_sentences="not a list", evidence_other=[[1]])
    fake.raw[f"/api/runs/{RUN}/findings"] = json.dumps([bad]).encode()
    skipped: dict[str, int] = {}
    got = c.findings(RUN, skipped)
    assert len(got) == 1 and got[0].evidence_sentences == [] and got[0].evidence_other == [] and not skipped


async def test_dead_head_shows_unreachable_and_keeps_last_data(fake):
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        assert "UNREACHABLE" not in plain(app.query_one(StatusBar).render())
        fake.stop()
        await app.refresh_now()
        await pilot.press("r")  # the key path too: a refresh worker against a dead head
        await app.refresh_now()
        await pilot.pause()
        status = plain(app.query_one(StatusBar).render())
        assert "HEAD UNREACHABLE" in status and "unreachable since 22:13:29" in status and "refused" in status
        t = app.query_one(RankTable)
        assert "STALE" in str(t.border_title) and t.row_count == 8 and plain(t.get_row("5")[6]) == "185.0"
        assert app.query_one("#body").has_class("stale")
        # The head comes back (a new server on another port stands in): the state clears.
        fh2 = FakeHead()
        try:
            app.client.base_url = fh2.url
            await app.refresh_now()
            await pilot.pause()
            assert "UNREACHABLE" not in plain(app.query_one(StatusBar).render())
            assert not app.query_one("#body").has_class("stale")
        finally:
            fh2.stop()
        await pilot.press("q")
    assert app.return_code == 0


async def test_malformed_responses_are_shown_not_raised(fake):
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        fake.raw[f"/api/runs/{RUN}/ranks"] = b'{"not": "a list"}'
        await app.refresh_now()
        await pilot.pause()
        status = plain(app.query_one(StatusBar).render())
        assert "HEAD ERROR" in status and "expected a JSON list" in status
        assert app.query_one(RankTable).row_count == 8  # last good data stays
        del fake.raw[f"/api/runs/{RUN}/ranks"]
        fake.data["steps"].append({"rank": "zero", "step": 40})
        fake.data["findings"].append({"severity": "warning"})
        await app.refresh_now()
        await pilot.pause()
        status = plain(app.query_one(StatusBar).render())
        assert "HEAD ERROR" not in status and "malformed items skipped: findings 1, steps 1" in status
        assert app.query_one(FindingsTable).row_count == 2
        await pilot.press("q")
    assert app.return_code == 0


async def test_action_posts_bearer_and_body_only_after_confirmation(fake):
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        # Without a token nothing is sent, and the user is told why.
        app.client.token = ""
        await pilot.press("a", "c", "y")
        for w in list(app.workers):
            await w.wait()
        assert fake.posts == []
        assert any("no token" in str(n.message) for n in app._notifications)
        app.client.token = TOKEN

        t = app.query_one(RankTable)
        t.move_cursor(row=5)
        assert t.selected_rank() == 5
        await pilot.press("a")
        await pilot.pause()
        text = plain(app.screen.query_one("#action-title").render())
        assert "node 1" in text and "ranks 4,5,6,7" in text
        await pilot.press("e", "n")  # chosen, then cancelled
        await pilot.pause()
        assert fake.posts == []
        await pilot.press("a", "p", "plus", "plus")
        await pilot.pause()
        assert "PROFILE 7 steps on node 1" in plain(app.screen.query_one("#action-text").render())
        await pilot.press("y")
        for w in list(app.workers):
            await w.wait()
        await pilot.pause()
        assert fake.posts == [{"path": f"/api/runs/{RUN}/actions", "auth": f"Bearer {TOKEN}",
                               "body": {"action": "profile", "node": 1, "steps": 7, "ranks": [4, 5, 6, 7],
                                        "reason": "requested from the TUI", "dry_run": False}}]
        assert app.query_one(ActionsTable).row_count == 2  # refreshed after the POST

        # The head says it is in dry-run: the modal says so and the request is dry-run.
        fake.data["health"]["dry_run"] = True
        await app.refresh_now()
        await pilot.press("a", "e")
        await pilot.pause()
        assert "DRY-RUN (the head is in dry-run)" in plain(app.screen.query_one("#action-text").render())
        await pilot.press("y")
        for w in list(app.workers):
            await w.wait()
        assert fake.posts[-1]["body"] == {"action": "evict", "node": 1, "ranks": [4, 5, 6, 7],
                                          "reason": "requested from the TUI", "dry_run": True}
        # The mouse path: the dialog's buttons do the same.
        await pilot.press("a")
        await pilot.click("#btn-checkpoint")
        await pilot.click("#btn-confirm")
        for w in list(app.workers):
            await w.wait()
        assert fake.posts[-1]["body"]["action"] == "checkpoint" and len(fake.posts) == 3
        await pilot.press("q")
    assert app.return_code == 0


async def test_a_refused_evict_is_explained_and_can_be_forced_with_a_reason(fake):
    """The head refuses an evict (409: the policy's cooldown): the TUI says why and how to override; f asks for a
    reason (confirming without one sends nothing), and the forced evict carries force, the reason and who."""
    fake.refuse_evict = "node 1: cooldown, the last evict was 30 s ago (minimum 300 s)"
    app = make_app(fake)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        app.query_one(RankTable).move_cursor(row=5)
        await pilot.press("a", "e", "y")
        for w in list(app.workers):
            await w.wait()
        await pilot.pause()
        assert fake.posts[-1]["body"].get("force") is None and len(fake.posts) == 1
        note = " ".join(str(n.message) for n in app._notifications)
        assert "refused by the head's evict policy" in note and "cooldown" in note and "press f" in note

        await pilot.press("a", "f")  # nothing chosen yet: only an evict can be forced
        await pilot.pause()
        assert not app.screen.force
        await pilot.press("e", "f")
        await pilot.pause()
        assert "FORCED" in plain(app.screen.query_one("#action-text").render())
        assert app.screen.query_one("#btn-confirm").disabled  # no reason yet
        await pilot.press("enter")  # Enter in the empty reason field: nothing is sent
        await pilot.pause()
        assert len(fake.posts) == 1
        await pilot.press(*"bad nvlink")
        await pilot.press("enter")
        for w in list(app.workers):
            await w.wait()
        await pilot.pause()
        body = fake.posts[-1]["body"]
        assert body["force"] is True and body["reason"] == "bad nvlink" and body["by"].startswith("tui")
        assert body["action"] == "evict" and body["node"] == 1 and len(fake.posts) == 2
        await pilot.press("q")


async def test_run_picker_and_pause(fake):
    app = make_app(fake, run_id=None)
    async with app.run_test(size=(100, 30)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        from textual.widgets import DataTable

        from tui.screens import RunPicker
        assert isinstance(app.screen, RunPicker)
        rt = app.screen.query_one("#runs-table", DataTable)
        assert [plain(rt.get_row_at(i)[0]) for i in range(rt.row_count)] == ["run-a", "run-b"]
        assert plain(rt.get_row_at(0)[3]) == "dp4×tp1×pp2"
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, RunPicker) and app.run_id == RUN
        await app.refresh_now()
        await pilot.pause()
        assert app.query_one(RankTable).row_count == 8
        await pilot.press("g")
        await pilot.pause()
        assert isinstance(app.screen, RunPicker)
        await pilot.press("a")  # the main view's keys do not apply over the picker
        await pilot.pause()
        assert isinstance(app.screen, RunPicker)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, RunPicker) and app.run_id == RUN

        await pilot.press("p")
        assert app.paused and app.timer._active.is_set() is False
        assert "PAUSED" in plain(app.query_one(StatusBar).render())
        await pilot.press("p")
        assert not app.paused and "PAUSED" not in plain(app.query_one(StatusBar).render())
        await pilot.press("q")
    assert app.return_code == 0


def test_gpu_simulated_badge(fake):
    fake.data["runs"][0]["gpu_simulated"] = True
    v = build_view(RUN, HeadClient(fake.url).fetch(RUN, 60))
    assert v.gpu_simulated
    assert "SIMULATED GPU" in header_text(v).plain
    fake.data["runs"][0]["gpu_simulated"] = False
    # the GPU endpoint's samples are simulated: that alone is enough for the badge
    assert build_view(RUN, HeadClient(fake.url).fetch(RUN, 60)).gpu_simulated
    for g in fake.data["gpus"]:
        g["simulated"] = False
    assert not build_view(RUN, HeadClient(fake.url).fetch(RUN, 60)).gpu_simulated


def test_snapshot(fake, snap_compare, monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()

    async def run_before(pilot):
        pilot.app.timer.pause()
        await pilot.app.refresh_now()
        await pilot.pause()

    try:
        # The fake head's port is random: name it by a fixed label (the data is what the snapshot checks).
        app = make_app(fake, head_label="http://fake-head:4318")
        assert snap_compare(app, terminal_size=(150, 45), run_before=run_before)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_tmux_smoke(fake, tmp_path):
    sock = f"rs-tui-{os.getpid()}"
    # the pause: tmux sizes a detached session's pane just after it starts the command
    cmd = (f"sleep 1; cd {REPO} && TERM=xterm-256color {sys.executable} -m cli.main tui --head {fake.url} "
           f"--run {RUN} --interval 0.5; echo exited-$? > {tmp_path}/rc; sleep 5")
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", "t", "-x", "150", "-y", "45", cmd], check=True)
    try:
        screen = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "dp4×tp1×pp2" not in screen:
            time.sleep(0.3)
            screen = subprocess.run(["tmux", "-L", sock, "capture-pane", "-p", "-t", "t"], capture_output=True,
                                    text=True).stdout
        assert "run-a" in screen and "dp4×tp1×pp2" in screen and "straggler" in screen, screen
        subprocess.run(["tmux", "-L", sock, "send-keys", "-t", "t", "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not ((tmp_path / "rc").exists() and (tmp_path / "rc").read_text().strip()):
            time.sleep(0.2)
        assert (tmp_path / "rc").read_text().strip() == "exited-0"
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


def test_unknown_run_says_so(fake):
    v = build_view("nope", HeadClient(fake.url).fetch("nope", 60))
    assert v.rows == [] and v.step is None and v.tokens_per_s is None
    text = header_text(v).plain
    assert "run nope" in text and "not in the head's run list" in text and "MFU —" in text


# -- the GPU panel --------------------------------------------------------------------------


def test_gpu_client_and_cells(fake):
    from tui.widgets.gpus import gpu_alert, gpu_cells, summary_text

    c = HeadClient(fake.url)
    gpus = {(g.node, g.gpu): g for g in c.fetch(RUN, 10).gpus}
    assert len(gpus) == 8
    thr, xid, ok = gpus[(1, 1)], gpus[(1, 3)], gpus[(0, 0)]
    assert thr.throttled and thr.throttle_names == ("sw_thermal_slowdown", "hw_thermal_slowdown") and thr.ranks == (5,)
    assert (gpu_alert(thr), gpu_alert(xid), gpu_alert(ok)) == ("throttled", "xid", "")
    cells = [plain(x) for x in gpu_cells(thr)]
    assert cells == ["▲", "1", "1", "5", "96", "30.0/80", "610", "92", "1215 / 1980 61%",
                     "sw_thermal_slowdown,hw_thermal_slowdown", "0/0", "0", "1.0s"]
    assert all("yellow" in str(x.style) for x in gpu_cells(thr))
    cells = [plain(x) for x in gpu_cells(xid)]
    assert cells[0] == "✖" and cells[11] == "1 (last 79)" and cells[12] == "3.0s"
    assert all("red" in str(x.style) for x in gpu_cells(xid))
    assert [plain(x) for x in gpu_cells(ok)][0] == "" and not any(str(x.style) for x in gpu_cells(ok))
    s = summary_text(list(gpus.values())).plain
    assert "SIMULATED" in s and "8 GPUs" in s and "1 throttled" in s and "1 with XID/ECC errors" in s
    # real GPUs: no SIMULATED; a double-bit ECC error is highlighted like an XID
    from dataclasses import replace

    assert "SIMULATED" not in summary_text([replace(ok, simulated=False)]).plain
    assert gpu_alert(replace(ok, ecc_dbe=1)) == "xid"
    # a broken item is skipped and counted, the rest shown
    fake.data["gpus"].append({"node": "one", "gpu": 0})
    skipped: dict[str, int] = {}
    assert len(c.gpus(RUN, skipped)) == 8 and skipped == {"gpus": 1}


async def test_gpu_panel_highlights_and_says_simulated(fake):
    from tui.widgets.gpus import GpuPanel, GpuTable

    app = make_app(fake)
    async with app.run_test(size=(150, 45)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        panel = app.query_one(GpuPanel)
        t = app.query_one(GpuTable)
        assert t.row_count == 8
        assert "SIMULATED" in str(panel.border_title) and "GPUs (8)" in str(panel.border_title)
        summary = plain(app.query_one("#gpu-summary").render())
        assert "SIMULATED" in summary and "1 throttled" in summary and "1 with XID/ECC errors" in summary
        row = t.get_row("1/1")
        assert plain(row[0]) == "▲" and "yellow" in str(row[1].style) and "reverse" in str(row[9].style)
        row = t.get_row("1/3")
        assert plain(row[0]) == "✖" and "red" in str(row[1].style) and plain(row[11]) == "1 (last 79)"
        assert plain(t.get_row("0/0")[0]) == "" and plain(t.get_row("0/0")[4]) == "96"
        # the throttle clears and the samples are real: the same refresh path updates the panel
        for g in fake.data["gpus"]:
            g.update(simulated=False, throttled=False, throttle_reasons=0, throttle_names=[])
        await app.refresh_now()
        await pilot.pause()
        assert plain(t.get_row("1/1")[0]) == "" and "SIMULATED" not in str(panel.border_title)
        assert "SIMULATED" not in plain(app.query_one("#gpu-summary").render())
        # the head goes away: the panel keeps its rows, marked stale
        fake.stop()
        await app.refresh_now()
        await pilot.pause()
        assert t.row_count == 8 and panel.has_class("stale") and "STALE" in str(panel.border_title)
        await pilot.press("q")
    assert app.return_code == 0


async def test_gpu_panel_with_a_head_without_the_endpoint(fake):
    del fake.data["gpus"]  # the fake head answers 404 "no such endpoint", like a head from before it
    app = make_app(fake)
    async with app.run_test(size=(150, 45)) as pilot:
        await app.refresh_now()
        await pilot.pause()
        status = plain(app.query_one(StatusBar).render())
        assert "ERROR" not in status and app.query_one(RankTable).row_count == 8
        assert "no GPU endpoint" in plain(app.query_one("#gpu-summary").render())
        await pilot.press("q")
    assert app.return_code == 0


async def test_findings_table_follows_a_live_episode_and_dims_it_when_closed():
    from textual.app import App, ComposeResult

    class OneTable(App):
        def compose(self) -> ComposeResult:
            yield FindingsTable()

    f = schema.Finding(analyzer="stragglers", kind="straggler", severity="warning", ranks=[3], nodes=[1], step_start=12,
                       step_end=20, summary="rank 3 slow", id="ep1", status="open")
    app = OneTable()
    async with app.run_test(size=(100, 10)) as pilot:
        ft = app.query_one(FindingsTable)
        ft.show_findings([f])
        await pilot.pause()

        def cell(col):
            return ft.get_cell(ft.coordinate_to_cell_key((0, 0)).row_key, col)

        assert plain(cell("steps")) == "12–20"
        # the same episode, grown: the row follows it (same id, new span)
        ft.show_findings([msgspec.structs.replace(f, step_end=31, severity="critical")])
        await pilot.pause()
        assert plain(cell("steps")) == "12–31" and plain(cell("sev")).strip() == "critical"
        ft.show_findings([msgspec.structs.replace(f, step_end=31, severity="critical", status="closed")])
        await pilot.pause()
        assert plain(cell("steps")) == "12–31 closed" and "dim" in str(cell("summary").style)
