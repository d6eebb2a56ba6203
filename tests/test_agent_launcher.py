"""cli.datapath.DataPath: head + one agent per node around a run, stopped without losing records."""

from cli.datapath import DataPath
from agent_helpers import FakeRanks, http_json, spool_keys, stored_key_list, wait_for


def test_datapath_start_run_stop_loses_nothing(tmp_path):
    store = tmp_path / "runs"
    fr = FakeRanks(store, "dp1", {0: [0, 1], 1: [2, 3]}, step_s=0.02, steps=40)
    dp = DataPath(store, "dp1", nodes=2, sim_gpu="off")
    try:
        dp.start()
        assert dp.token not in " ".join(dp.head.args + dp.agents[0].args)  # the token travels in the environment
        fr.start()
        fr.join(60)
        # agents are stopped right after training ends: their last batch still arrives
        wait_for(lambda: len(http_json(dp.head_url + "/api/runs/dp1/agents", token=dp.token)[1]) == 2, 30, what="2 agents")
    finally:
        dp.stop()
    logs = {p.name: p.read_text(errors="replace")[-1500:] for p in (store / "dp1" / "logs").glob("*.log")}
    # on failure, say why: an agent starved at nice 19 on a busy box, killed after stop's timeout (-9), or an error
    assert dp.head.returncode == 0 and all(a.returncode == 0 for a in dp.agents), (
        dp.head.returncode, [a.returncode for a in dp.agents], logs)
    want = sorted(spool_keys(store, "dp1"))
    assert len(want) == 160 and sorted(stored_key_list(store, "dp1")) == want
    assert (store / "dp1" / "logs" / "head.log").exists() and (store / "dp1" / "logs" / "agent-node1.log").exists()
