"""A network namespace per simulated node (cli.netns, cli.local_cluster), the slow link's rate limit on a node's
interface (trainer.netfault), and ``ranksight launch`` refusing a bad ``--inject`` before it starts anything.

The tests that need namespaces (root, ``ip``, ``tc``, a working probe) skip with the probe's reason elsewhere;
the fallback to 127.0.0.1 is tested everywhere. Every test removes what it made, also when it fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from cli import local_cluster, netns
from cli.local_cluster import LocalCluster
from trainer.netfault import LinkShaper, ShapeError

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def owned_by(pid: int) -> tuple[list[str], list[str]]:
    """The namespaces and root-namespace links that process ``pid``'s clusters own."""
    prefix = f"{netns.PREFIX}{pid % 0x1000000:06x}"
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return [], []
    return ([n for n in netns.list_namespaces() if n.startswith(prefix)],
            [n for n in netns.list_links() if n.startswith(prefix)])


@pytest.fixture
def need_netns():
    """Skips without namespaces; afterwards removes whatever this process's clusters left (and fails on it)."""
    ok, why = netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable here: {why}")
    yield
    left = owned_by(os.getpid())
    netns.remove(*left)
    assert left == ([], []), f"left behind: {left}"


def run_toy_cluster(tmp_path: Path, use_netns: bool | None) -> tuple[LocalCluster, list[dict]]:
    out = tmp_path / "out"
    out.mkdir()
    cluster = LocalCluster(run_dir=tmp_path / "run", nnodes=2, nproc_per_node=2, trainer_args=[], min_nodes=2,
                           module="netns_toyworker", netns=use_netns,
                           env={"TOY_OUT": str(out), "PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT}"})
    try:
        cluster.start()
        deadline = time.monotonic() + 240
        while not cluster.done:
            assert time.monotonic() < deadline, "the toy job did not finish"
            cluster.poll()
            time.sleep(0.2)
        assert cluster.exit_codes() == {0: 0, 1: 0}
        net = cluster.net
    finally:
        cluster.stop()
    assert cluster.net is None
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3] and all(r["sum"] == 4.0 for r in reports)
    return net, reports


# -- names, the fallback ------------------------------------------------------------------------------------


def test_names_fit_the_kernels_interface_names_and_say_whose_they_are():
    net = netns.ClusterNet(tag=netns.make_tag(4194304, 31), nnodes=netns.MAX_NODES)
    namespaces, links = net.names()
    inside = [net.node_net(i).iface for i in range(net.nnodes)]
    assert max(len(n) for n in links + inside) <= 15  # IFNAMSIZ - 1
    for name in namespaces + links + inside:
        m = netns.NAME_RE.match(name)
        assert m and int(m["pid"], 16) == 4194304, name
    assert len(set(namespaces)) == len(namespaces) and len(set(links + inside)) == len(links + inside)
    assert netns.make_tag(1234, 1) != netns.make_tag(1234, 2) != netns.make_tag(1235, 1)


def test_without_namespaces_the_nodes_share_loopback_and_it_is_said_once(monkeypatch, capsys):
    monkeypatch.setattr(netns, "available", lambda: (False, "not running as root"))
    monkeypatch.setattr(local_cluster, "_fallback_said", False)
    assert local_cluster.use_netns(None) is False
    assert local_cluster.use_netns(None) is False
    err = capsys.readouterr().err
    assert err.count("nodes share 127.0.0.1 (no network namespace per node: not running as root)") == 1
    with pytest.raises(netns.NetnsError, match="not running as root"):
        local_cluster.use_netns(True)
    monkeypatch.setattr(netns, "available", lambda: pytest.fail("--no-netns probes nothing"))
    assert local_cluster.use_netns(False) is False


def test_a_cluster_without_namespaces_runs_on_loopback(tmp_path):
    net, reports = run_toy_cluster(tmp_path, use_netns=False)
    assert net is None
    assert {r["iface"] for r in reports} == {""} and {r["gloo_iface"] for r in reports} == {"lo"}


def test_link_shaper_needs_the_launchers_interface(monkeypatch):
    monkeypatch.delenv("RANKSIGHT_NET_IFACE", raising=False)
    assert LinkShaper.from_env() is None
    monkeypatch.setenv("RANKSIGHT_NET_IFACE", "rsn0000010v1")
    assert LinkShaper.from_env().iface == "rsn0000010v1"
    assert LinkShaper.burst_bytes(1) == 16_000 and LinkShaper.burst_bytes(1000) == 1_250_000
    # clearing an interface that is gone (the run's namespace already removed) is not an error
    LinkShaper("rsnnosuchif0").clear()
    with pytest.raises(ValueError):
        LinkShaper("rsnnosuchif0").apply(0)


# -- ranksight launch --inject ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ("slow_lnk:rank=1", "unknown fault kind 'slow_lnk'"),
    ("slow_link:node=1,rate_mbit=0", "rate_mbit must be > 0"),
    ("slow_rank:rank=4", "rank=4 is not a rank of this 4-rank job"),
    ("xid:node=2", "node=2 is not a node of this 2-node job"),
    ("few_microbatches", "needs --pp > 1"),
])
def test_launch_refuses_a_bad_inject_before_starting_anything(tmp_path, spec, message):
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "launch", "--nnodes", "2", "--nproc-per-node", "2",
                             "--store", str(store), "--run-id", "bad", "--inject", "slow_rank:rank=1,start=3",
                             "--inject", spec], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="300"))
    children: set[int] = set()
    while proc.poll() is None:  # whatever it starts shows up as a child
        try:
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.01)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ranksight launch: error: --inject") and message in lines[0], err
    assert not store.exists() and not children
    assert owned_by(proc.pid) == ([], [])


# -- with namespaces --------------------------------------------------------------------------------------------


def test_each_node_runs_in_its_own_namespace_and_nothing_is_left(tmp_path, need_netns):
    net, reports = run_toy_cluster(tmp_path, use_netns=True)
    by_node = {r["node"]: r for r in reports}
    for node, r in by_node.items():
        mine = net.node_net(node).iface
        # gloo binds the node's own veth, the shaper gets its name, and the node sees no other node's interface
        assert r["iface"] == r["gloo_iface"] == mine
        assert mine in r["links"] and not any(name.startswith(net.tag, 3) and name != mine for name in r["links"])
    assert by_node[0]["iface"] != by_node[1]["iface"]
    assert owned_by(os.getpid()) == ([], [])


def test_a_failed_start_removes_the_namespaces(tmp_path, monkeypatch, need_netns):
    def broken(self, node):
        raise RuntimeError("torchrun would not start")

    monkeypatch.setattr(LocalCluster, "_start_node", broken)
    cluster = LocalCluster(run_dir=tmp_path / "run", nnodes=2, nproc_per_node=1, trainer_args=[], netns=True)
    with pytest.raises(RuntimeError, match="would not start"):
        cluster.start()
    assert cluster.net is None and cluster.store_proc is None
    assert owned_by(os.getpid()) == ([], [])


def test_leftovers_of_a_killed_run_are_removed_by_the_next_setup(tmp_path, need_netns):
    code = ("import sys, time; from cli import netns; n = netns.ClusterNet.create(2); "
            "print(n.tag, flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        tag = proc.stdout.readline().strip()
        assert tag, "the setup did not finish"
        proc.send_signal(signal.SIGKILL)  # no teardown runs
        proc.wait(timeout=30)
        left = owned_by(proc.pid)
        assert len(left[0]) == 2 and len(left[1]) == 3, left
        net = netns.ClusterNet.create(1)  # its setup removes the dead owner's leftovers
        net.teardown()
        assert owned_by(proc.pid) == ([], [])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        netns.remove(*owned_by(proc.pid))


def test_a_leftover_with_the_same_names_is_removed_before_setup(monkeypatch, need_netns):
    import itertools

    monkeypatch.setattr(netns, "_counter", itertools.count(7))
    stale = netns.ClusterNet(tag=netns.make_tag(os.getpid(), 7), nnodes=1)
    try:
        netns.ip("netns", "add", stale.node_net(0).netns)
        netns.ip("link", "add", stale.bridge, "type", "bridge")
        net = netns.ClusterNet.create(1)  # same names: would fail with "File exists" without the cleanup
        assert net.tag == stale.tag and net.nodes[0].netns == stale.node_net(0).netns
        net.teardown()
    finally:
        stale.teardown()


def test_the_shaper_limits_what_a_node_sends(need_netns):
    """tbf at 8 Mbit/s on a node's veth: 1 MB to the bridge takes at least ~1 s (a lower bound: a loaded host only
    makes it slower); cleared, the limit is gone, and clearing again is harmless."""
    net = netns.ClusterNet.create(1)
    received = []
    try:
        node = net.nodes[0]
        with socket.socket() as srv:
            srv.bind((net.bridge_addr, 0))
            srv.listen(1)
            port = srv.getsockname()[1]

            def serve():
                conn, _ = srv.accept()
                with conn:
                    n = 0
                    while n < 1_000_000:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        n += len(chunk)
                    received.append(n)
                    conn.sendall(b"k")

            t = threading.Thread(target=serve, daemon=True)
            t.start()
            code = f"""
import socket, time
from trainer.netfault import LinkShaper
s = LinkShaper({node.iface!r})
s.apply(8)
shown = s.current()
c = socket.create_connection(({net.bridge_addr!r}, {port}), timeout=60)
t0 = time.monotonic()
c.sendall(b"x" * 1_000_000)
c.recv(1)
elapsed = time.monotonic() - t0
s.clear()
print(repr((shown, elapsed, s.current())))
s.clear()
"""
            r = subprocess.run(net.wrap(0, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=120,
                               cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            assert r.returncode == 0, r.stderr
            t.join(timeout=30)
        shown, elapsed, after = eval(r.stdout.strip().splitlines()[-1])
        assert received == [1_000_000]
        assert "tbf" in shown and "rate 8Mbit" in shown, shown
        assert elapsed >= 0.8, f"1 MB at 8 Mbit/s took {elapsed:.2f} s"
        assert "tbf" not in after
        with pytest.raises(ShapeError):
            LinkShaper("rsnnosuchif0").apply(8)
    finally:
        net.teardown()
    assert owned_by(os.getpid()) == ([], [])


@pytest.mark.distributed
def test_the_trainers_slow_link_limits_the_nodes_link_while_it_lasts(tmp_path, need_netns):
    """The bundled trainer on 2 nodes x 2 ranks, each node in its own namespace; node 1's link limited to 2 Mbit/s
    for steps 5-8: its gradient ring (~240 kB a step out of node 1) then takes about a second a step, several times a
    clean step even on a loaded host; before and after, the link is the node's own veth at full speed."""
    from analyzers.loader import load_run

    store = tmp_path / "store"
    args = ["--d-model", "32", "--n-layers", "2", "--seq-len", "16", "--batch-size", "4", "--dp", "4", "--steps", "12",
            "--inject", "slow_link:node=1,rate_mbit=2,start=5,end=8", "--store", str(store), "--run-id", "shaped",
            "--quiet"]
    cluster = LocalCluster(run_dir=store / "shaped", nnodes=2, nproc_per_node=2, min_nodes=2, max_restarts=0,
                           trainer_args=args, netns=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        cluster.start()
        deadline = time.monotonic() + 400
        while not cluster.done:
            assert time.monotonic() < deadline, "the run did not finish"
            cluster.poll()
            time.sleep(0.5)
        assert cluster.exit_codes() == {0: 0, 1: 0}
    finally:
        cluster.stop()
    data = load_run(store, "shaped")
    per_step = data.steps.groupby("step")["step_ms"].median()
    shaped = per_step.loc[5:8].median()
    assert shaped >= 600, per_step.round(0).to_dict()
    assert shaped >= 2.5 * max(per_step.loc[2:4].median(), per_step.loc[10:12].median()), per_step.round(0).to_dict()
    ev = data.events
    started = ev[ev["event"] == "fault_start"]
    assert sorted(started["rank"]) == sorted(data.steps.loc[data.steps["node"] == 1, "rank"].unique())
