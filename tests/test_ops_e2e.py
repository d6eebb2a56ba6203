"""End to end: ``ranksight head`` and ``ranksight agent --collectives per-step --metrics-port`` as processes. The
head stores folded collective records (a rank's ops of one step, kind and communicator as one), and ``ranksight
ops`` through the head returns the raw ones from the node's spool: as many as the folded records say they stand for,
with the means the folded records carry. Once over spools written for the test, once over a real (tensor-parallel)
training run's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import defaultdict

import pytest
from typer.testing import CliRunner

from agent_helpers import PY, REPO, TOKEN, Procs, api_get, head_ready, wait_for
from cli.main import main as ranksight_main
from conftest import free_port
from ops_helpers import write_steps
from ranksight import schema
from ranksight.layout import RunDir, atomic_write
from ranksight.tables import read_table

RUN = "drill-e2e"
STEPS = 30


def test_ops_returns_the_raw_records_a_folded_run_s_head_holds_as_folds(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, RUN)
    rd.spool_dir.mkdir(parents=True)
    now = time.time()
    atomic_write(rd.manifest, schema.encode(schema.Manifest(
        run_id=RUN, created=now, start_time=now, nodes=1, layout={"dp": 2, "tp": 1, "pp": 1, "world": 2},
        ranks=[schema.RankPlacement(rank=r, node=0, host="node0", local_rank=r, pp_stage=0, dp_rank=r, tp_rank=0)
               for r in (0, 1)])))
    for r in (0, 1):  # 6 all-reduces on TP and 3 reduce-scatters on DP per step
        write_steps(rd.spool(r), RUN, r, range(STEPS), tp_ops=6, dp_ops=3, t0=now - 100)
    procs = Procs(tmp_path / "logs")
    try:
        head = _head_and_agent(procs, store, RUN)
        folded = _folded(store, RUN, 2 * STEPS * 9)
        assert len(folded) == 2 * STEPS * 2 and set(folded["ops"]) == {6, 3}  # one record per step, kind, comm
        for rank in (0, 1):
            assert _raw_matches_folds(head, RUN, rank, 0, STEPS - 1, folded, procs) == STEPS * 2
        # the table a person reads, for one step of rank 1: its 9 ops
        r = CliRunner().invoke(ranksight_main, ["ops", RUN, "--rank", "1", "--steps", "7", "--head", head,
                                                "--token", TOKEN])
        assert r.exit_code == 0 and sum(1 for ln in r.stdout.splitlines() if ln.split()[:1] == ["7"]) == 9, r.stdout
    finally:
        procs.stop_all()



def _head_and_agent(procs: Procs, store, run_id: str) -> str:
    """A head and node 0's agent (folding per step, with its endpoint) as processes; the head's URL once the agent
    told it its own."""
    hport, mport = free_port(), free_port()
    procs.head(store, hport, extra=["--flush-interval", "0.5"])
    wait_for(lambda: head_ready(hport), 60, what="the head")
    procs.agent(store, run_id, 0, hport, metrics_port=mport, extra=["--collectives", "per-step"])
    head = f"http://127.0.0.1:{hport}"
    wait_for(lambda: api_get(f"{head}/api/runs/{run_id}/agents")[1][0]["url"], 60, what="the agent's URL")
    return head


def _folded(store, run_id: str, n_ops: int):
    """The head's stored collective records once they stand for ``n_ops`` ops."""
    def stored():
        df = read_table(store, run_id, "collectives")
        return [df] if len(df) and int(df["ops"].sum()) == n_ops else None

    return wait_for(stored, 90, 0.5, f"folded collective records standing for {n_ops} ops in the head's store")[0]


def _raw_matches_folds(head: str, run_id: str, rank: int, a: int, b: int, folded, procs: Procs) -> int:
    """``ranksight ops --json`` for ``rank``'s steps a..b, checked against the head's folded records of them: each
    fold stands for as many raw ops as ``ops`` says, with their first seq, mean duration and total bytes. The
    number of folds."""
    r = CliRunner().invoke(ranksight_main, ["ops", run_id, "--rank", str(rank), "--steps", f"{a}-{b}",
                                            "--head", head, "--token", TOKEN, "--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr, procs.logs())
    raw = json.loads(r.stdout)
    assert raw["node"] == 0 and not raw["truncated"] and raw["damaged_lines"] == 0
    assert raw["ops"] and all(o["ops"] == 1 for o in raw["ops"])  # the records as the rank wrote them
    groups = defaultdict(list)
    for o in raw["ops"]:
        groups[(o["attempt"], o["step"], o["group"], o["op"])].append(o)
    mine = folded[(folded["rank"] == rank) & folded["step"].between(a, b)]
    assert len(mine) == len(groups)
    for f in mine.itertuples():
        ops = groups[(f.attempt, f.step, f.group, f.op)]
        assert f.ops == len(ops)  # the fold's count is the number of raw ops
        assert f.seq == min(o["seq"] for o in ops)
        assert abs(f.duration_ms - sum(o["duration_ms"] for o in ops) / len(ops)) < 1e-6
        assert f.nbytes == sum(o["nbytes"] for o in ops)
    return len(mine)


@pytest.mark.distributed
def test_ops_of_a_real_tensor_parallel_run_match_its_folds(tmp_path):
    """2 ranks, TP 2, 6 steps of the bundled trainer (each step: 9 all-reduces on TP and a broadcast on the
    world), then the data path folding them."""
    store = tmp_path / "store"
    run = subprocess.run([PY, "-m", "cli.main", "launch", "--nnodes", "1", "--nproc-per-node", "2", "--tp", "2",
                          "--steps", "6", "--no-agents", "--no-live", "--store", str(store), "--run-id", "tp2",
                          "--timeout", "240", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    spooled = sum(p.read_bytes().count(b'"kind":"collective"') for p in (store / "tp2" / "spool").glob("*.jsonl"))
    procs = Procs(tmp_path / "logs")
    try:
        head = _head_and_agent(procs, store, "tp2")
        folded = _folded(store, "tp2", spooled)
        assert int(folded["ops"].max()) > 1 and len(folded) < spooled  # folded, as the head holds them
        assert sum(_raw_matches_folds(head, "tp2", rank, 0, 10, folded, procs) for rank in (0, 1)) == len(folded)
    finally:
        procs.stop_all()
