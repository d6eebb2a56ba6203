"""The agent's drill-down endpoint ``GET /ops`` (node/control.py over node/ops_reader.py): a local rank's raw
collective records over a step range, read from its spool through a step index, behind the /control token."""

from __future__ import annotations

import os

from agent_helpers import TOKEN, api_get
from node.ops_reader import SpoolIndexes, SpoolStepIndex, read_ops
from ops_helpers import DP, TP, agent_endpoint, write_steps
from ranksight.layout import RunDir
from ranksight.ops_query import OpsQuery

RUN = "drill"


def _spools(store, ranks=(0, 1, 2), steps=range(50), **kw):
    rd = RunDir(store, RUN)
    for r in ranks:
        write_steps(rd.spool(r), RUN, r, steps, **kw)
    return rd


def test_token_is_required_and_metrics_healthz_stay_open(tmp_path):
    _spools(tmp_path)
    with agent_endpoint(tmp_path, RUN, [0, 1, 2]) as srv:
        url = f"{srv.url}/ops?rank=1&steps=10-19"
        assert api_get(url, headers={})[0] == 401
        assert api_get(url, headers={"Authorization": "Bearer wrong"})[0] == 403
        status, body = api_get(url)
        assert status == 200 and len(body["ops"]) == 60
        assert api_get(f"{srv.url}/healthz", headers={})[0] == 200
        import urllib.request

        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as r:
            assert r.status == 200


def test_range_filters_and_bad_queries(tmp_path):
    _spools(tmp_path)
    with agent_endpoint(tmp_path, RUN, [0, 1, 2]) as srv:
        status, body = api_get(f"{srv.url}/ops?rank=1&steps=10-19")
        assert status == 200
        assert body["rank"] == 1 and body["node"] == 0 and body["step_from"] == 10 and body["step_to"] == 19
        assert {o["step"] for o in body["ops"]} == set(range(10, 20))
        assert {o["rank"] for o in body["ops"]} == {1}  # rank 1's file only, of the node's three
        assert len(body["ops"]) == 10 * 6 and not body["truncated"] and body["damaged_lines"] == 0
        seqs = [o["seq"] for o in body["ops"]]
        assert seqs == sorted(seqs) and seqs[0] == 60  # the spool's order, from step 10's first op
        status, body = api_get(f"{srv.url}/ops?rank=2&steps=7")
        assert status == 200 and {o["step"] for o in body["ops"]} == {7} and len(body["ops"]) == 6
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=0-49&comm={DP}")
        assert status == 200 and len(body["ops"]) == 100 and {o["op"] for o in body["ops"]} == {"reduce_scatter"}
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=0-49&comm=tp&op=all_reduce")
        assert status == 200 and len(body["ops"]) == 200 and {o["comm_id"] for o in body["ops"]} == {TP}
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=60-70")
        assert status == 200 and body["ops"] == []
        for bad in ("rank=1&steps=19-10", "rank=1&steps=0-1000", "rank=1&steps=x", "steps=1-2", "rank=1",
                    "rank=-1&steps=1-2", "rank=1&steps=1-2&limit=0", "rank=1&steps=1-2&limit=100001",
                    "rank=1&steps=1-2&op=a%20b"):
            status, body = api_get(f"{srv.url}/ops?{bad}")
            assert status == 400 and body["error"], bad
        status, body = api_get(f"{srv.url}/ops?rank=3&steps=1-2")  # a rank of another node
        assert status == 404 and "not on node 0" in body["error"]
        # each answered query counted by its status on the agent's /metrics (refused tokens are not queries)
        import urllib.request

        with urllib.request.urlopen(f"{srv.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'ranksight_agent_ops_queries_total{node="0",status="200"} 5.0' in text
        assert 'ranksight_agent_ops_queries_total{node="0",status="400"} 9.0' in text
        assert 'ranksight_agent_ops_queries_total{node="0",status="404"} 1.0' in text
        assert 'ranksight_agent_ops_seconds_total{node="0"}' in text


def test_limit_cuts_and_says_so(tmp_path):
    _spools(tmp_path, ranks=(0,))
    with agent_endpoint(tmp_path, RUN, [0]) as srv:
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=0-49&limit=7")
        assert status == 200 and len(body["ops"]) == 7 and body["truncated"] is True and body["limit"] == 7
        assert [o["seq"] for o in body["ops"]] == list(range(7))
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=0-49&limit=300")  # exactly what there is: not cut
        assert status == 200 and len(body["ops"]) == 300 and body["truncated"] is False
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=0-49")
        assert body["limit"] == 10_000 and len(body["ops"]) == 300


def test_damaged_lines_are_gaps_counted_in_the_answer(tmp_path):
    garbage = {12: [b'{"kind":"collective","rank":0,"st', b"\x00\xff not json"], 40: [b"{broken"]}
    _spools(tmp_path, ranks=(0,), garbage_after=garbage)
    with agent_endpoint(tmp_path, RUN, [0]) as srv:
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=10-19")
        assert status == 200 and len(body["ops"]) == 60  # every good record of the range is there
        assert body["damaged_lines"] == 2 and len(body["gaps"]) == 1  # two lines in a row: one gap
        g = body["gaps"][0]
        assert g["lines"] == 2 and g["after_step"] == 12 and g["sample"].startswith('{"kind":"collective"')
        with open(RunDir(tmp_path, RUN).spool(0), "rb") as f:
            f.seek(g["offset"])
            assert f.read(g["nbytes"]).count(b"\n") == 2
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=30-35")  # far from both: no gap counted
        assert status == 200 and body["damaged_lines"] == 0 and len(body["ops"]) == 36
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=40")
        assert body["damaged_lines"] == 1 and len(body["ops"]) == 6


def test_a_restarted_job_s_steps_going_back_are_all_found(tmp_path):
    """Attempt 1 resumes at step 30 after attempt 0 reached step 49: the file is not sorted by step, and both
    attempts' records of steps 35-39 are found (a binary search over line starts would find one of them)."""
    rd = _spools(tmp_path, ranks=(0,))
    write_steps(rd.spool(0), RUN, 0, range(30, 60), attempt=1)
    ix = SpoolStepIndex(rd.spool(0), block_bytes=2048)
    ans = read_ops(ix, OpsQuery(rank=0, step_from=35, step_to=39), RUN, 0)
    assert len(ans.ops) == 60 and {o.attempt for o in ans.ops} == {0, 1}
    assert [o.attempt for o in ans.ops] == [0] * 30 + [1] * 30  # file order


def test_the_index_reads_only_the_range_s_blocks_and_follows_a_growing_file(tmp_path):
    rd = _spools(tmp_path, ranks=(0,), steps=range(400))
    path = rd.spool(0)
    size = os.path.getsize(path)
    ix = SpoolStepIndex(path, block_bytes=4096)
    ans = read_ops(ix, OpsQuery(rank=0, step_from=200, step_to=209), RUN, 0)
    assert len(ans.ops) == 60 and ans.spool_bytes == size
    assert ans.bytes_read < size / 20  # a few blocks, not the file
    assert len(ix.starts) > 100 and all(e - s <= 4096 for s, e in zip(ix.starts, ix.ends))
    # the rank goes on writing, and leaves a line half written: the next query indexes only what was appended
    write_steps(path, RUN, 0, range(400, 410))
    with open(path, "ab") as f:
        f.write(b'{"kind":"collective","run_id":"drill","rank":0,"step":410')
    starts_before = list(ix.starts)
    ans = read_ops(ix, OpsQuery(rank=0, step_from=405, step_to=410), RUN, 0)
    assert len(ans.ops) == 30 and ans.damaged_lines == 0 and ix.rebuilds == 0  # step 410's half line: not yet
    assert ix.starts[:len(starts_before)] == starts_before and len(ix.starts) - len(starts_before) <= 8
    assert ix.indexed == os.path.getsize(path) - len(b'{"kind":"collective","run_id":"drill","rank":0,"step":410')
    # a new file under the same name (rotated, or the run started again): indexed again from its start
    os.replace(path, str(path) + ".old")
    write_steps(path, RUN, 0, range(5))
    ans = read_ops(ix, OpsQuery(rank=0, step_from=0, step_to=999), RUN, 0)
    assert len(ans.ops) == 30 and ix.rebuilds == 1


def test_the_endpoint_keeps_one_index_per_spool(tmp_path):
    _spools(tmp_path, ranks=(0, 1), steps=range(200))
    with agent_endpoint(tmp_path, RUN, [0, 1]) as srv:
        srv.spool_indexes = SpoolIndexes(block_bytes=4096)
        for _ in range(2):
            status, body = api_get(f"{srv.url}/ops?rank=1&steps=100-101")
            assert status == 200 and len(body["ops"]) == 12
            assert body["bytes_read"] < body["spool_bytes"] / 10
        ix = srv.spool_indexes.of(RunDir(tmp_path, RUN).spool(1))
        assert ix.indexed == body["spool_bytes"] and ix.rebuilds == 0
        os.unlink(RunDir(tmp_path, RUN).spool(0))
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=1-2")
        assert status == 404 and "no spool" in body["error"]


def test_token_errors_carry_no_token(tmp_path):
    _spools(tmp_path, ranks=(0,), steps=range(3))
    with agent_endpoint(tmp_path, RUN, [0]) as srv:
        status, body = api_get(f"{srv.url}/ops?rank=0&steps=0-2", headers={"Authorization": "Bearer nope"})
        assert status == 403 and TOKEN not in str(body) and "ops" not in body


def test_an_oversized_line_is_a_gap_and_never_held_whole(tmp_path):
    """A writer gone wrong: 64 KiB without a newline in the middle of step 5. With lines capped at 16 KiB, the index
    cuts it into blocks instead of reading on to its end, and the query around it counts it as damaged."""
    rd = _spools(tmp_path, ranks=(0,), steps=range(5))
    path = rd.spool(0)
    with open(path, "ab") as f:
        f.write(b"x" * 65536 + b"\n")
    write_steps(path, RUN, 0, range(5, 10))
    ix = SpoolStepIndex(path, block_bytes=4096, max_line_bytes=16384)
    ans = read_ops(ix, OpsQuery(rank=0, step_from=4, step_to=5), RUN, 0)
    assert len(ans.ops) == 12
    assert all(e - s <= 16384 for s, e in zip(ix.starts, ix.ends))
    assert ans.damaged_lines >= 1 and sum(g.nbytes for g in ans.gaps) >= 65536
