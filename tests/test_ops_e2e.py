"""End to end: ``ranksight head`` and ``ranksight agent --collectives per-step --metrics-port`` as processes. The
head stores folded collective records (a rank's ops of one step, kind and communicator as one), and ``ranksight
ops`` through the head returns the raw ones from the node's spool: as many as the folded records say they stand for,
with the means the folded records carry."""

from __future__ import annotations

import json
import time
from collections import defaultdict

from typer.testing import CliRunner

from agent_helpers import TOKEN, Procs, api_get, head_ready, wait_for
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
    hport, mport = free_port(), free_port()
    try:
        procs.head(store, hport, extra=["--flush-interval", "0.5"])
        wait_for(lambda: head_ready(hport), 60, what="the head")
        procs.agent(store, RUN, 0, hport, metrics_port=mport, extra=["--collectives", "per-step"])
        head = f"http://127.0.0.1:{hport}"

        def stored():
            df = read_table(store, RUN, "collectives")
            return [df] if len(df) and int(df["ops"].sum()) == 2 * STEPS * 9 else None

        folded = wait_for(stored, 60, 0.5, "the folded collective records in the head's store")[0]
        assert len(folded) == 2 * STEPS * 2 and set(folded["ops"]) == {6, 3}  # one record per step, kind, comm
        wait_for(lambda: api_get(f"{head}/api/runs/{RUN}/agents")[1][0]["url"], 30, what="the agent's URL")
        for rank in (0, 1):
            r = CliRunner().invoke(ranksight_main, ["ops", RUN, "--rank", str(rank), "--steps", f"0-{STEPS - 1}",
                                                    "--head", head, "--token", TOKEN, "--json"])
            assert r.exit_code == 0, (r.stdout, r.stderr, procs.logs())
            raw = json.loads(r.stdout)
            assert raw["node"] == 0 and not raw["truncated"] and raw["damaged_lines"] == 0
            assert all(o["ops"] == 1 for o in raw["ops"])  # the records as the rank wrote them
            groups = defaultdict(list)
            for o in raw["ops"]:
                groups[(o["step"], o["group"], o["op"])].append(o)
            mine = folded[folded["rank"] == rank]
            assert len(mine) == len(groups) == STEPS * 2
            for f in mine.itertuples():
                ops = groups[(f.step, f.group, f.op)]
                assert f.ops == len(ops)  # the fold's count is the number of raw ops
                assert f.seq == min(o["seq"] for o in ops)
                assert abs(f.duration_ms - sum(o["duration_ms"] for o in ops) / len(ops)) < 1e-9
                assert f.nbytes == sum(o["nbytes"] for o in ops)
        # the table a person reads, for one step of rank 1: its 9 ops
        r = CliRunner().invoke(ranksight_main, ["ops", RUN, "--rank", "1", "--steps", "7", "--head", head,
                                                "--token", TOKEN])
        assert r.exit_code == 0 and sum(1 for ln in r.stdout.splitlines() if ln.split()[:1] == ["7"]) == 9, r.stdout
    finally:
        procs.stop_all()

