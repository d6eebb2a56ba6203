"""The TUI against a real head process (``ranksight head``) fed a few records over OTLP."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter  # noqa: E402
from opentelemetry.sdk._logs.export import LogRecordExportResult  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402

from ranksight import wire  # noqa: E402  (the test feeds the head like an agent; the TUI itself imports no agent code)
from agent_helpers import TOKEN, Procs, head_ready, http_json, wait_for  # noqa: E402
from ranksight import schema  # noqa: E402
from tui.app import RanksightApp  # noqa: E402
from tui.client import HeadClient  # noqa: E402
from tui.widgets.actions import ActionsTable  # noqa: E402
from tui.widgets.findings import FindingDetail, FindingsTable  # noqa: E402
from tui.widgets.gpus import GpuTable  # noqa: E402
from tui.widgets.header import RunHeader, StatusBar  # noqa: E402
from tui.widgets.ranks import RankTable  # noqa: E402
from tui_fakehead import plain  # noqa: E402

RUN = "tui-real"


def records(now: float) -> tuple[schema.Manifest, dict[int, list[schema.StepRecord]]]:
    placement = [schema.RankPlacement(rank=r, node=r // 2, host=f"node{r // 2}", local_rank=r % 2, pp_stage=0,
                                      dp_rank=r, tp_rank=0) for r in range(4)]
    m = schema.Manifest(run_id=RUN, created=now, start_time=now, nodes=2, ranks=placement,
                        layout={"dp": 4, "tp": 1, "pp": 1, "world": 4})
    steps: dict[int, list[schema.StepRecord]] = {}
    for r in range(4):
        for s in range(30):
            compute = 50.0 * (2.0 if r == 3 and s >= 10 else 1.0)
            t0 = now - 30 + s * 0.15
            steps.setdefault(r, []).append(schema.StepRecord(
                run_id=RUN, rank=r, step=s, node=r // 2, host=f"node{r // 2}", world_size=4, t_start=t0,
                t_end=t0 + 0.12, step_ms=120.0, compute_ms=compute, comm_ms=120.0 - compute - 5.0, data_ms=5.0,
                tokens=2048, loss=3.0 - 0.01 * s, flops=1e9))
    return m, steps


async def test_tui_against_a_real_head(tmp_path, port):
    procs = Procs(tmp_path / "logs")
    try:
        procs.head(tmp_path / "store", port)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: head_ready(port), timeout=30, what="head up")
        m, steps = records(time.time())
        exp = OTLPLogExporter(endpoint=url + "/v1/logs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        res = Resource.create({})
        batch = [wire.make_log_record(RUN, "manifest", schema.encode(m), resource=res)]
        for r, recs in steps.items():
            batch.append(wire.make_log_record(RUN, "step", wire.join_array([schema.encode(x) for x in recs]),
                                              rank=r, node=r // 2, count=len(recs), resource=res))
        # simulated GPU samples of node 1 as its agent ships them: GPU 1 (rank 3's) throttles for heat
        now = time.time()
        gpus = [schema.GpuSample(node=1, host="node1", gpu=g, t=now - 1.0, source="simulated-nvml", simulated=True,
                                 util_pct=95.0, mem_used_bytes=1 << 30, mem_total_bytes=8 << 30, power_w=300.0,
                                 temp_c=90.0 if g == 1 else 60.0, sm_clock_mhz=1000.0 if g == 1 else 1980.0,
                                 max_sm_clock_mhz=1980.0, throttle_reasons=0x20 if g == 1 else 0)
                for g in (0, 1)]
        batch.append(wire.make_log_record(RUN, "gpu", wire.join_array([schema.encode(x) for x in gpus]), node=1,
                                          count=len(gpus), resource=res))
        assert exp.export(batch) == LogRecordExportResult.SUCCESS
        wait_for(lambda: len(http_json(url + f"/api/runs/{RUN}/ranks")[1]) == 4, timeout=15, what="ranks at the head")

        app = RanksightApp(HeadClient(url, token=TOKEN), run_id=RUN, interval=3600)
        async with app.run_test(size=(160, 50)) as pilot:
            await app.refresh_now()
            await pilot.pause()
            status = plain(app.query_one(StatusBar).render())
            assert "UNREACHABLE" not in status and "ERROR" not in status, status
            t = app.query_one(RankTable)
            assert t.row_count == 4
            assert [plain(c) for c in t.get_row("3")][1:9] == ["3", "1", "0", "29", "120.0", "100.0", "15.0", "5.0"]
            assert plain(t.get_row("3")[-1]) == "slow"  # 2x the median compute, whatever the analyzers say yet
            assert plain(t.get_row("0")[-1]) == "ok"
            header = plain(app.query_one(RunHeader).render())
            assert RUN in header and "dp4×tp1×pp1" in header and "world 4" in header and "step 29" in header
            # the GPU panel, from the real head's GET /api/runs/<id>/gpus
            gt = app.query_one(GpuTable)
            assert gt.row_count == 2
            thr = [plain(c) for c in gt.get_row("1/1")]
            assert thr[0] == "▲" and thr[3] == "3" and thr[9] == "sw_thermal_slowdown" and "1000 / 1980" in thr[8]
            assert plain(gt.get_row("1/0")[0]) == "" and "SIMULATED" in plain(app.query_one("#gpu-summary").render())

            # The head's own analyzers (every 2 s here) name rank 3; the TUI marks it the culprit and shows the numbers.
            wait_for(lambda: any(f["kind"] == "straggler" for f in http_json(url + f"/api/runs/{RUN}/findings")[1]),
                     timeout=30, what="a straggler finding from the head's analyzers")
            await app.refresh_now()
            await pilot.pause()
            assert plain(t.get_row("3")[0]) == "▶" and plain(t.get_row("0")[0]) == ""
            ft = app.query_one(FindingsTable)
            kinds = [plain(ft.get_row_at(i)[1]) for i in range(ft.row_count)]
            assert kinds[0] == "straggler"
            detail = plain(app.query_one(FindingDetail).render())
            # the real head's own words for the evidence (GET findings' evidence_sentences), not key=value
            assert "Rank 3 computes 100 ms per step against its peers' 50 ms (2.00x) since step 10" in detail, detail
            assert "rank_median_compute_ms" not in detail
            assert "evict node 1" in detail

            # A dry-run checkpoint through the modal: the real head records it and the actions list shows it.
            t.move_cursor(row=3)
            await pilot.press("a", "c", "d", "y")
            for w in list(app.workers):
                await w.wait()
            await app.refresh_now()
            await pilot.pause()
            acts = [a for a in http_json(url + f"/api/runs/{RUN}/actions")[1] if a["requested_by"].startswith("api:")]
            assert [(a["action"], a["dry_run"], a["node"], a["reason"]) for a in acts] == \
                [("checkpoint", True, 1, "requested from the TUI")]
            at = app.query_one(ActionsTable)
            shown = [[plain(c) for c in at.get_row_at(i)] for i in range(at.row_count)]
            assert ["checkpoint", "1", "", "requested (dry-run)"] in [row[1:5] for row in shown]

            # The head goes away: the TUI says so and keeps the last data.
            procs.kill("head")
            await app.refresh_now()
            await pilot.pause()
            assert "HEAD UNREACHABLE" in plain(app.query_one(StatusBar).render())
            assert t.row_count == 4
            await pilot.press("q")
        assert app.return_code == 0
    except BaseException:
        print(procs.logs())
        raise
    finally:
        procs.stop_all()
