"""The local multi-node cluster behind `ranksight launch`, exercised with a toy worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from cli.local_cluster import LocalCluster

TESTS = Path(__file__).parent


def make_cluster(tmp_path: Path, **env) -> LocalCluster:
    out = tmp_path / "out"
    out.mkdir()
    os.environ["PYTHONPATH"] = f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return LocalCluster(run_dir=tmp_path / "run", nnodes=2, nproc_per_node=2, trainer_args=[],
                        module="launch_toyworker", env={"TOY_OUT": str(out), **env})


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_two_nodes_form_one_world_with_node_identity(tmp_path):
    cluster = make_cluster(tmp_path)
    try:
        cluster.start()
        wait_until(lambda: (cluster.poll(), cluster.done)[1], 180, "both nodes to finish")
        assert cluster.exit_codes() == {0: 0, 1: 0}
        reports = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank-*.json"))]
        assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
        assert all(r["world"] == 4 and r["sum"] == 4.0 for r in reports)
        # Two ranks per node, and a distinct host name per simulated node.
        by_node = {}
        for r in reports:
            by_node.setdefault(r["node"], set()).add(r["host"])
        assert sorted(by_node) == [0, 1] and all(len(h) == 1 for h in by_node.values())
        assert {r["share_store"] for r in reports} == {"1"}
        assert (tmp_path / "run" / "logs" / "node-0.log").exists()
    finally:
        cluster.stop()


def test_kill_node_takes_its_workers_with_it(tmp_path):
    cluster = make_cluster(tmp_path, TOY_SLEEP="120")
    try:
        cluster.start()
        wait_until(lambda: len(list((tmp_path / "out").glob("rank-*.json"))) == 4, 180, "all ranks to start")
        cluster.poll()
        node1_workers = [json.loads(p.read_text())["pid"] for p in (tmp_path / "out").glob("rank-*.json")
                         if json.loads(p.read_text())["node"] == 1]
        assert len(node1_workers) == 2
        cluster.kill_node(1)
        wait_until(lambda: not cluster.nodes[1].running, 30, "node 1's torchrun to die")
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                   for p in node1_workers), 30, "node 1's workers to die")
    finally:
        cluster.stop()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in node1_workers)


def test_launch_rejects_a_layout_that_does_not_fit_the_world(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cli.main", "launch", "--nnodes", "2", "--nproc-per-node", "2",
                        "--dp", "3", "--store", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "dp*tp*pp = 3*1*1 = 3 but nnodes*nproc_per_node = 4" in r.stderr


def test_launch_passes_collectives_to_its_agents(tmp_path, monkeypatch):
    """`launch --collectives per-step` reaches every agent's command line (a folded local run, whose raw ops
    `ranksight ops` reads back); a bad value is a usage error before anything starts."""
    from cli.datapath import DataPath

    r = subprocess.run([sys.executable, "-m", "cli.main", "launch", "--nnodes", "1", "--nproc-per-node", "1",
                        "--collectives", "sometimes", "--store", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--collectives must be auto, per-op or per-step" in r.stderr

    spawned: dict[str, list[str]] = {}

    class Dummy:
        def poll(self):
            return None

    def spawn(self, name, args):
        spawned[name] = args
        return Dummy()

    monkeypatch.setattr(DataPath, "_spawn", spawn)
    monkeypatch.setattr(DataPath, "wait_head", lambda self, timeout=30.0: None)
    DataPath(tmp_path, "r1", nodes=2, agent_args=["--collectives", "per-step"]).start()
    for n in (0, 1):
        args = spawned[f"agent-node{n}"]
        assert args[args.index("--collectives") + 1] == "per-step"
    assert "--collectives" not in spawned["head"]
