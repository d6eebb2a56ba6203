"""A simulated multi-node cluster on one host: one torchrun per "node".

This is how tests and the demo get a real elastic multi-node job on a laptop. Run as root where network
namespaces work, each node runs in a namespace of its own, joined to the others through a bridge
(cli.netns): its traffic to other nodes crosses a link of its own, which a slow_link fault can slow. Otherwise
(``netns=False``, not root, or the probe failed: said once on stderr) every node shares 127.0.0.1.
What it takes care of (each learned the hard way, see the torch CPU research notes):

- The c10d rendezvous store runs in its own process (``is_host=false``) so that
  killing or evicting any node never takes the rendezvous down with it.
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the shared store a restarted
  worker can read the dead incarnation's gloo addresses and hang.
- torchrun starts its workers in their own sessions, so killing a node means
  killing torchrun *and* every descendant, found through /proc (psutil).
- Each node's processes carry ``RANKSIGHT_NODE`` (its node index) and
  ``RANKSIGHT_HOST`` (a per-node host name), because global ranks are assigned by
  the rendezvous and say nothing about which node a rank lives on; with namespaces also
  ``RANKSIGHT_NET_IFACE``, the node's network interface (trainer.netfault shapes it).
- The namespaces, veths and bridge are removed by ``stop()`` (and at interpreter exit at the latest);
  a killed run's leftovers are removed by the next setup (cli.netns).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from cli import netns


def free_port(bind: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f} s")


_fallback_said = False


def use_netns(wanted: bool | None) -> bool:
    """Whether a cluster gets a namespace per node. ``None``: where it works (said once per process when it does
    not); ``True``: required (NetnsError with the reason when it does not work); ``False``: never."""
    global _fallback_said
    if wanted is False:
        return False
    ok, why = netns.available()
    if ok:
        return True
    if wanted:
        raise netns.NetnsError(f"a network namespace per node is not available here: {why}")
    if not _fallback_said:
        _fallback_said = True
        print(f"ranksight: nodes share 127.0.0.1 (no network namespace per node: {why})", file=sys.stderr, flush=True)
    return False


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process and all its descendants (torchrun workers live in their own sessions)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


@dataclass
class NodeProcess:
    node: int
    proc: subprocess.Popen
    log_path: Path
    evicted: bool = False

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


@dataclass
class LocalCluster:
    """Start a rendezvous store and ``nnodes`` torchruns running ``python -m trainer``."""

    run_dir: Path
    nnodes: int
    nproc_per_node: int
    trainer_args: list[str]
    min_nodes: int = 1
    max_restarts: int = 3
    last_call_timeout: int = 5
    module: str = "trainer"  # what each torchrun runs with `-m`
    env: dict[str, str] = field(default_factory=dict)
    # a network namespace per node: None = where it works, True = required, False = all on 127.0.0.1
    netns: bool | None = None
    net: netns.ClusterNet | None = None
    rdzv_port: int = 0
    nodes: list[NodeProcess] = field(default_factory=list)
    store_proc: subprocess.Popen | None = None
    # Every worker pid seen so far: a crashed torchrun leaves orphans that stop() must still reap.
    seen_pids: set[int] = field(default_factory=set)

    def start(self) -> None:
        """Set up the nodes' network (namespaces, when used), the rendezvous store, then every node. On any error
        what was started is stopped and the network removed before the error goes on."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if use_netns(self.netns):
            self.net = netns.ClusterNet.create(self.nnodes)
        host = self.store_host
        self.rdzv_port = self.rdzv_port or free_port(host)
        store_log = open(logs / "rdzv-store.log", "ab")
        self.store_proc = subprocess.Popen(
            [sys.executable, "-m", "cli.rdzv_store", "--host", host, "--port", str(self.rdzv_port)],
            stdout=store_log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for_port(self.rdzv_port, timeout=60, proc=self.store_proc, host=host)
        for node in range(self.nnodes):
            self.nodes.append(self._start_node(node))

    @property
    def store_host(self) -> str:
        """Where the rendezvous store listens: the bridge with namespaces (every node reaches it), else loopback."""
        return self.net.bridge_addr if self.net is not None else "127.0.0.1"

    def node_addr(self, node: int) -> str:
        return self.net.nodes[node].addr if self.net is not None else "127.0.0.1"

    def torchrun_cmd(self, node: int = 0) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.min_nodes}:{self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.store_host}:{self.rdzv_port}",
            f"--rdzv-id={self.run_dir.name}",
            f"--rdzv-conf=is_host=false,last_call_timeout={self.last_call_timeout}",
            f"--max-restarts={self.max_restarts}",
            "--monitor-interval=1",
            f"--local-addr={self.node_addr(node)}",
            "-m", self.module, *self.trainer_args,
        ]

    def _start_node(self, node: int) -> NodeProcess:
        env = dict(os.environ)
        env.update(self.env)
        env.update({
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "RANKSIGHT_NODE": str(node),
            "RANKSIGHT_HOST": f"{socket.gethostname()}-node{node}",
            "MASTER_ADDR": self.node_addr(node),
            "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
        })
        cmd = self.torchrun_cmd(node)
        if self.net is not None:
            env.update(self.net.node_env(node))
            cmd = self.net.wrap(node, cmd)
        else:
            env.pop("RANKSIGHT_NET_IFACE", None)  # no link of its own to shape
        log_path = self.run_dir / "logs" / f"node-{node}.log"
        log = open(log_path, "ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return NodeProcess(node=node, proc=proc, log_path=log_path)

    def evicted_nodes(self) -> set[int]:
        """Nodes whose ranks left the job on an evict request (the trainer writes these markers)."""
        marker_dir = self.run_dir / "control" / "evicted"
        found = set()
        if marker_dir.is_dir():
            for p in marker_dir.glob("node-*"):
                try:
                    found.add(int(p.name.split("-", 1)[1]))
                except ValueError:
                    continue
        return found

    def poll(self) -> None:
        for n in self.nodes:
            if n.running:
                try:
                    self.seen_pids.update(c.pid for c in psutil.Process(n.proc.pid).children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
        for n in self.evicted_nodes():
            if n < len(self.nodes) and not self.nodes[n].evicted:
                self.nodes[n].evicted = True
                # The evicted ranks asked their torchrun to stop; make sure nothing of it lingers.
                if self.nodes[n].running:
                    kill_tree(self.nodes[n].proc.pid, signal.SIGTERM)

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> None:
        """Crash a node: its torchrun and all its workers."""
        kill_tree(self.nodes[node].proc.pid, sig)

    @property
    def done(self) -> bool:
        return all(not n.running for n in self.nodes if not n.evicted)

    def exit_codes(self) -> dict[int, int | None]:
        return {n.node: n.proc.poll() for n in self.nodes}

    def stop(self) -> None:
        try:
            self._stop_processes()
        finally:
            if self.net is not None:
                # after every process of the nodes is gone (a namespace lives on while a process is in it)
                self.net.teardown()
                self.net = None

    def _stop_processes(self) -> None:
        for n in self.nodes:
            if n.running:
                kill_tree(n.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(n.running for n in self.nodes):
            time.sleep(0.2)
        for n in self.nodes:
            kill_tree(n.proc.pid, signal.SIGKILL)
            n.proc.wait()
        for pid in self.seen_pids:
            kill_tree(pid, signal.SIGKILL)
        if self.store_proc is not None:
            kill_tree(self.store_proc.pid, signal.SIGKILL)
            self.store_proc.wait()
            self.store_proc = None
