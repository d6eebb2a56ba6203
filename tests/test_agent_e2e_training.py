"""End to end with real training: 4 ranks on 2 (local) nodes, 2 node agents, a head, a real Prometheus.

One run (multi-process torch on 2 cores is the expensive part, so the scenarios share it):

- every (rank, step) record the trainer wrote ends up in the store exactly once, although
- agent 1 is ``kill -9``-ed and restarted three times during the run, and
- the head is ``kill -9``-ed mid-run and stays down for 15 s, then restarts on the same port;
- a checkpoint requested through the head's API reaches the trainer and comes back "applied";
- Prometheus scrapes agent 0 throughout, and ``histogram_quantile(0.5, ...)`` over the step
  histogram matches the median step time of agent 0's ranks within 10 %;
- the simulated GPUs appear under dcgm-exporter names, labelled simulated.
"""

import signal
import statistics
import time

import pytest

from agent_helpers import (PY, TOKEN, Procs, Prometheus, head_ready, http_json, spool_keys, stored_key_list,
                           stored_steps, wait_for)
from conftest import free_port

STEPS = 400
RUN = "e2e"


def node_steps(store, node):
    """Max step per rank of ``node`` in its spool files (progress, read the way the trainer writes)."""
    keys = spool_keys(store, RUN)
    return max((s for r, s, _ in keys if r // 2 == node), default=-1)


@pytest.mark.distributed
def test_real_run_exactly_once_through_agent_kills_and_head_outage(tmp_path):
    store = tmp_path / "store"
    procs = Procs(tmp_path / "logs")
    hp, mp0, mp1 = free_port(), free_port(), free_port()
    prom = Prometheus(tmp_path / "prom", [f"127.0.0.1:{mp0}"], procs, free_port())
    head_url = f"http://127.0.0.1:{hp}"
    try:
        prom.start()
        procs.head(store, hp)
        procs.agent(store, RUN, 0, hp, mp0, name="agent0")
        procs.agent(store, RUN, 1, hp, mp1, name="agent1")
        wait_for(lambda: head_ready(hp), 30, what="head")
        launch = procs.start("launch", [PY, "-m", "cli.main", "launch", "--nnodes", "2", "--nproc-per-node", "2",
                                        "--steps", str(STEPS), "--run-id", RUN, "--store", str(store), "--no-live",
                                        "--timeout", "400", "--no-agents"])  # this test runs its own
        prom.wait_up(1, timeout=40)
        # training is under way and flowing through both agents
        wait_for(lambda: len([r for r in http_json(head_url + f"/api/runs/{RUN}/ranks")[1]
                              if (r["step"] or -1) >= 3]) == 4, 120, 0.5, "4 ranks past step 3 at the head")

        # a checkpoint through the API -> head -> agent -> trainer control file -> ack -> agent -> head
        st, act = http_json(head_url + f"/api/runs/{RUN}/actions", {"action": "checkpoint", "reason": "e2e"},
                            token=TOKEN)
        assert st == 202, act

        # kill -9 agent 1 three times while its ranks keep writing
        for i in range(3):
            before = node_steps(store, 1)
            wait_for(lambda: node_steps(store, 1) >= before + 10 or launch.poll() is not None, 60, 0.3,
                     "node 1 progress")
            assert launch.poll() is None, f"the run ended before kill {i + 1}: raise STEPS for this machine"
            procs.kill("agent1", signal.SIGKILL)
            procs.agent(store, RUN, 1, hp, mp1, name="agent1")
        # the head dies mid-run and stays away for 15 s; agents spool to disk meanwhile
        wait_for(lambda: node_steps(store, 0) >= 0, 10)
        procs.kill("head", signal.SIGKILL)
        down_at_step = node_steps(store, 0)
        time.sleep(15)
        assert launch.poll() is None or node_steps(store, 0) > down_at_step  # training went on without the head
        procs.head(store, hp)
        wait_for(lambda: head_ready(hp), 30, what="head back")

        assert launch.wait(timeout=400) == 0, procs.logs()
        want = spool_keys(store, RUN)
        assert len(want) == 4 * STEPS and len(set(want)) == len(want)
        # everything written arrives once the head is back, and nothing twice
        wait_for(lambda: len(stored_key_list(store, RUN)) >= len(want), 90, 1.0, "all steps in the store")
        time.sleep(1.5)  # let any late duplicate (it must not exist) be flushed too
        got = stored_key_list(store, RUN)
        assert len(got) == len(set(got)), "duplicates in the store"
        assert sorted(got) == sorted(want)

        # the agents' OTLP metrics (SDK periodic reader) reach the restarted head too
        wait_for(lambda: http_json(head_url + "/api/stats")[1]["stats"]["metric_points"] > 0, 20, 0.5,
                 "OTLP metric points at the head")

        # the checkpoint action was applied by the trainer and its status came back
        acts = wait_for(lambda: [a for a in http_json(head_url + f"/api/runs/{RUN}/actions")[1]
                                 if a["id"] == act["id"] and a["status"] == "applied"], 30, 0.5, "checkpoint applied")
        assert acts[0]["applied_step"] is not None

        # Prometheus: median step time of agent 0's ranks (0, 1) within 10 %
        df = stored_steps(store, RUN)
        true_median = statistics.median(df[df["node"] == 0]["step_ms"] / 1000.0)
        res = prom.query('histogram_quantile(0.5, sum by (le) '
                         '(increase(ranksight_step_duration_seconds_bucket{job="ranksight_agent"}[10m])))')
        prom_median = float(res[0]["value"][1])
        print(f"median step time: prometheus {prom_median:.4f}s, store {true_median:.4f}s")
        assert abs(prom_median - true_median) / true_median < 0.10, (prom_median, true_median)
        # the histogram is per node (bounded series); per rank, a few gauges
        per_node = prom.query('histogram_quantile(0.5, sum by (le, node) '
                              '(increase(ranksight_step_duration_seconds_bucket[10m])))')
        assert sorted(r["metric"]["node"] for r in per_node) == ["0"]
        per_rank = prom.query('ranksight_last_step{job="ranksight_agent"}')
        assert sorted(r["metric"]["rank"] for r in per_rank) == ["0", "1"]
        # simulated GPUs under dcgm-exporter names, labelled as simulated
        util = prom.query('DCGM_FI_DEV_GPU_UTIL{simulated="true"}')
        assert util and {"gpu", "UUID", "modelName", "Hostname"} <= set(util[0]["metric"])
        assert prom.query("ranksight_agent_records_shipped_total > 0")
        # GPU samples reached the store as well
        import pandas as pd

        gpu = pd.read_parquet(store / RUN / "gpu")
        assert len(gpu) > 0 and gpu["simulated"].all()
    finally:
        procs.stop_all()
