"""The head's drill-down route ``GET /api/runs/<id>/ops`` (head/ops_proxy.py) against real agent endpoints on
127.0.0.1, and ``ranksight ops`` (cli/ops.py) on top of it: the raw records come from the node of the rank, errors
say which part failed."""

from __future__ import annotations

import json
import time

from typer.testing import CliRunner

from agent_helpers import TOKEN, api_get, serving
from cli.main import main as ranksight_main
from conftest import free_port  # a port nothing listens on: an unreachable agent or head
from cli.ops import ops_table
from head.service import Head
from ops_helpers import TP, agent_endpoint, write_steps
from ranksight import schema, wire
from ranksight.layout import RunDir
from ranksight.ops_query import decode_answer

RUN = "proxy"


def _head(store, **kw):
    h = Head(store, TOKEN, analyzer=None, **kw)
    live = h.live.run(RUN)
    # ranks 0-1 on node 0, 2-3 on node 1 (an agent without --metrics-port), 4 on node 2 (its agent is gone)
    live.manifest = schema.Manifest(run_id=RUN, created=0.0, start_time=0.0, nodes=3, ranks=[
        schema.RankPlacement(rank=r, node=r // 2, host=f"n{r // 2}", local_rank=r % 2, pp_stage=0, dp_rank=r,
                             tp_rank=0) for r in range(5)])
    return h


def _beat(head, node: int, url: str, ranks: list[int]) -> None:
    head.live.run(RUN).heartbeat(wire.Heartbeat(node=node, host=f"n{node}", url=url, t=time.time(), ranks=ranks))


def _spools(store, ranks=(0, 1), steps=range(40)):
    rd = RunDir(store, RUN)
    for r in ranks:
        write_steps(rd.spool(r), RUN, r, steps)


def test_the_head_forwards_to_the_rank_s_node_and_says_what_failed(tmp_path):
    store = tmp_path / "store"
    _spools(store, ranks=(0, 1))
    with agent_endpoint(store, RUN, [0, 1], node=0) as agent, \
            agent_endpoint(store, RUN, [6], node=3, token="another-token") as stranger, \
            serving(_head(store)) as head:
        _beat(head, 0, agent.url, [0, 1])
        _beat(head, 1, "", [2, 3])
        _beat(head, 2, f"http://127.0.0.1:{free_port()}", [4])
        _beat(head, 3, stranger.url, [6])  # rank 6: known from this heartbeat alone
        base = f"{head.url}/api/runs/{RUN}/ops"
        status, body = api_get(f"{base}?rank=1&steps=10-14&op=all_reduce")
        assert status == 200, body
        assert body["node"] == 0 and body["rank"] == 1 and len(body["ops"]) == 5 * 4
        assert {(o["rank"], o["op"], o["comm_id"]) for o in body["ops"]} == {(1, "all_reduce", TP)}
        assert decode_answer(json.dumps(body).encode()).ops[0].seq == 60
        status, body = api_get(f"{base}?rank=0&steps=0-39&limit=11")
        assert status == 200 and len(body["ops"]) == 11 and body["truncated"] is True
        # without the head's token: refused by the head, nothing forwarded
        assert api_get(f"{base}?rank=1&steps=1-2", headers={})[0] == 401
        status, body = api_get(f"{base}?rank=9&steps=1-2")
        assert status == 404 and "rank 9" in body["error"]
        status, body = api_get(f"{base}?rank=1&steps=9-2")
        assert status == 400 and "ends before it starts" in body["error"]
        status, body = api_get(f"{base}?rank=1&steps=0-5000")
        assert status == 400 and "at most 1000" in body["error"]
        status, body = api_get(f"{base}?steps=0-5")
        assert status == 400 and "rank" in body["error"]
        status, body = api_get(f"{base}?rank=2&steps=1-2")
        assert status == 502 and "node 1" in body["error"] and "--metrics-port" in body["error"]
        status, body = api_get(f"{base}?rank=4&steps=1-2")
        assert status == 502 and "node 2" in body["error"] and "unreachable" in body["error"]
        status, body = api_get(f"{base}?rank=6&steps=1-2")
        assert status == 502 and "token" in body["error"] and TOKEN not in body["error"]
        # the manifest places rank 5 on node 0, whose agent does not hold it: the agent's 404 is passed on
        head.live.run(RUN).manifest.ranks.append(schema.RankPlacement(rank=5, node=0, host="n0", local_rank=2,
                                                                      pp_stage=0, dp_rank=5, tp_rank=0))
        status, body = api_get(f"{base}?rank=5&steps=1-2")
        assert status == 404 and "agent of node 0" in body["error"] and "not on node 0" in body["error"]
        status, body = api_get(f"{head.url}/api/runs/no-such-run/ops?rank=1&steps=1-2")
        assert status == 404


def test_public_read_does_not_open_the_drill_down(tmp_path):
    """--public-read opens the head's own GETs, not the route that makes the head call an agent with its token."""
    store = tmp_path / "store"
    _spools(store, ranks=(0, 1))
    with agent_endpoint(store, RUN, [0, 1], node=0) as agent, serving(_head(store, public_read=True)) as head:
        _beat(head, 0, agent.url, [0, 1])
        assert api_get(f"{head.url}/api/runs/{RUN}/ranks", headers={})[0] == 200
        base = f"{head.url}/api/runs/{RUN}/ops?rank=1&steps=10-14"
        assert api_get(base, headers={})[0] == 401
        status, body = api_get(base)
        assert status == 200 and body["ops"] and {o["rank"] for o in body["ops"]} == {1}


def test_an_https_agent_is_reached_with_the_head_s_tls_options(tmp_path):
    import trustme

    from ranksight.tls import ClientTls, ServerTls

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "agent.pem"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "agent.key"))
    server_tls = ServerTls.from_options(tmp_path / "agent.pem", tmp_path / "agent.key").context()
    store = tmp_path / "store"
    _spools(store, ranks=(0,), steps=range(5))
    with agent_endpoint(store, RUN, [0], tls=server_tls) as agent, \
            serving(_head(store, agent_tls=ClientTls.from_options(tmp_path / "ca.pem").context())) as head:
        assert agent.url.startswith("https://")
        _beat(head, 0, agent.url, [0])
        status, body = api_get(f"{head.url}/api/runs/{RUN}/ops?rank=0&steps=0-4")
        assert status == 200 and len(body["ops"]) == 30
    # a head that does not trust the agent's certificate says so, with a 502
    with agent_endpoint(store, RUN, [0], tls=server_tls) as agent, serving(_head(store)) as head:
        _beat(head, 0, agent.url, [0])
        status, body = api_get(f"{head.url}/api/runs/{RUN}/ops?rank=0&steps=0-4")
        assert status == 502 and "CERTIFICATE_VERIFY_FAILED" in body["error"]


def _cli(*args):
    r = CliRunner().invoke(ranksight_main, ["ops", *args])
    return r.exit_code, r.stdout, r.stderr


def test_the_cli_prints_an_80_column_table_or_the_json_answer(tmp_path):
    store = tmp_path / "store"
    _spools(store, ranks=(0, 1))
    with agent_endpoint(store, RUN, [0, 1], node=0) as agent, serving(_head(store)) as head:
        _beat(head, 0, agent.url, [0, 1])
        _beat(head, 2, f"http://127.0.0.1:{free_port()}", [4])
        common = ["--head", head.url, "--token", TOKEN]
        code, out, _ = _cli(RUN, "--rank", "1", "--steps", "3-4", *common)
        assert code == 0, out
        lines = out.splitlines()
        assert max(len(ln) for ln in lines) <= 80, "\n".join(ln for ln in lines if len(ln) > 80)
        assert lines[0].startswith(f"run {RUN}  rank 1 (node 0)  steps 3-4")
        rows = [ln.split() for ln in lines if ln[:6].strip().isdigit()]
        assert len(rows) == 12 and [int(r[0]) for r in rows] == [3] * 6 + [4] * 6
        assert [int(r[1]) for r in rows] == list(range(18, 30))  # seq
        assert rows[0][2:5] == ["all_reduce", "tp", "1.0M"] and rows[4][2:5] == ["reduce_scatter"[:10], "dp", "4.0M"]
        # the four all-reduces of step 3 took 1, 2, 3, 4 ms: 2.5 ms on average, which their folded record says
        assert [r[7] for r in rows[:4]] == ["1.000", "2.000", "3.000", "4.000"]
        assert [r[8] for r in rows[:4]] == ["-1.50", "-0.50", "+0.50", "+1.50"]
        assert float(rows[0][5]) == 0.0 and abs(float(rows[1][5]) - 10.0) < 1e-3  # arrivals, ms after t0
        assert any(ln.startswith("communicator tp: " + TP) for ln in lines)
        code, out, _ = _cli(RUN, "--rank", "1", "--steps", "3-4", "--comm", "dp", "--json", *common)
        doc = json.loads(out)
        assert code == 0 and len(doc["ops"]) == 4 and {o["group"] for o in doc["ops"]} == {"dp"}
        assert {"run_id", "node", "rank", "ops", "truncated", "damaged_lines", "gaps"} <= set(doc)
        code, out, err = _cli(RUN, "--rank", "1", "--steps", "0-39", "--limit", "5", *common)
        assert code == 0 and "cut at 5 records" in out
        code, out, err = _cli(RUN, "--rank", "4", "--steps", "1-2", "--json", *common)
        assert code == 4 and json.loads(out)["status"] == 502 and "unreachable" in json.loads(out)["error"]
        code, out, err = _cli(RUN, "--rank", "7", "--steps", "1-2", *common)
        assert code == 3 and "refused (404)" in err
        code, out, err = _cli(RUN, "--rank", "1", "--steps", "5-1", *common)  # refused before any request
        assert code == 2
        code, out, err = _cli(RUN, "--rank", "1", "--steps", "1-2", "--head", head.url, "--token", "wrong")
        assert code == 4 and "403" in err


def test_the_table_reports_damaged_lines_and_an_empty_range():
    from ranksight.ops_query import OpsAnswer, OpsGap

    empty = OpsAnswer(run_id="r", node=1, rank=2, step_from=5, step_to=6, limit=10, ops=[], truncated=False,
                      damaged_lines=3, gaps=[OpsGap(offset=100, lines=3, nbytes=40, after_step=5)])
    text = "\n".join(ops_table(empty))
    assert "no collective records in this range" in text
    assert "3 damaged spool line(s)" in text and "at offset 100, after step 5" in text


def test_an_unreachable_head_is_exit_4():
    code, out, _ = _cli("r", "--rank", "0", "--steps", "0-5", "--head", f"http://127.0.0.1:{free_port()}",
                        "--json")
    assert code == 4 and json.loads(out)["status"] is None


def test_the_table_keeps_a_restarted_job_s_attempts_apart():
    """Steps 3 of attempt 0 and of attempt 1 (the job resumed from a checkpoint): each attempt's ops are their own
    fold group, so an op's distance from its fold's mean is not taken against the other attempt's ops."""
    import msgspec

    from ops_helpers import step_ops
    from ranksight.ops_query import OpsAnswer

    recs = [r for a, scale in ((0, 1.0), (1, 10.0)) for r in step_ops("r", 0, 3, tp_ops=2, dp_ops=0, attempt=a)[:-1]
            for r in [msgspec.structs.replace(r, duration_ms=r.duration_ms * scale)]]
    ans = OpsAnswer(run_id="r", node=0, rank=0, step_from=3, step_to=3, limit=10, ops=recs, truncated=False,
                    damaged_lines=0)
    lines = ops_table(ans)
    assert any("attempts 0, 1" in ln for ln in lines)
    rows = [ln.split() for ln in lines if ln[:6].strip().isdigit()]
    assert [r[8] for r in rows] == ["-0.50", "+0.50", "-5.00", "+5.00"]
