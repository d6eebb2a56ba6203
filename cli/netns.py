"""One network namespace per simulated node: each node gets its own network link, as on a real cluster.

``ranksight launch`` runs every node's torchrun on one host. Sharing 127.0.0.1, the nodes' traffic never
crosses anything that could be slowed on its own. Run as root, each node instead lives in a network namespace
of its own, joined to the others by a veth pair plugged into a bridge in the root namespace::

    root ns:   bridge rsn<tag>b  10.213.X.1/24  (the rendezvous store listens here)
                 |-- rsn<tag>h0 ==veth== rsn<tag>v0  10.213.X.10  (netns rsn<tag>n0: node 0's torchrun, its ranks)
                 '-- rsn<tag>h1 ==veth== rsn<tag>v1  10.213.X.11  (netns rsn<tag>n1: node 1 ...)

Traffic between two ranks of one node stays inside its namespace (its loopback); traffic between nodes leaves
through the node's veth, so a ``tc`` rate limit on that interface (trainer.netfault) is a slow NIC.

Names carry the owner's pid (``<tag>`` = 6 hex digits of the pid + 1 of a per-process counter) so that clusters
of concurrent processes never collide, a leftover of a killed run is recognised (its owner is gone) and removed
before the next setup, and every name fits the kernel's 15-character interface names. Each cluster takes a free
/24 of 10.213.0.0/16, chosen under a file lock against concurrent setups.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PREFIX = "rsn"
POOL = ipaddress.ip_network("10.213.0.0/16")  # each cluster takes one /24 of it
NODE_HOST_BASE = 10  # node i is .10+i on its cluster's /24; the bridge is .1
MAX_NODES = 200
LOCK_PATH = Path("/run/lock/ranksight-netns.lock") if Path("/run/lock").is_dir() else Path("/tmp/ranksight-netns.lock")
NAME_RE = re.compile(rf"^{PREFIX}(?P<pid>[0-9a-f]{{6}})(?P<seq>[0-9a-f])(?P<role>[bhvn])(?P<node>\d*)$")

_counter = itertools.count()


def make_tag(pid: int, seq: int) -> str:
    """The part of every name that says whose cluster it is: the owner's pid (6 hex digits: Linux pids stay below
    2^22) and the cluster's number in that process (mod 16)."""
    return f"{pid % 0x1000000:06x}{seq % 16:x}"


class NetnsError(RuntimeError):
    """Setting up the namespaces failed (the message says which command, and why)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def in_ns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return ip("netns", "exec", ns, *cmd, check=check)


@dataclass
class NodeNet:
    node: int
    netns: str  # the namespace the node's processes run in
    iface: str  # the node's end of its veth pair, inside its namespace
    host_iface: str  # the other end, on the bridge in the root namespace
    addr: str  # the node's address (on iface)


@dataclass
class ClusterNet:
    """The namespaces, veth pairs and bridge of one local cluster. ``setup`` makes them, ``teardown`` removes them."""

    tag: str
    nnodes: int
    subnet: ipaddress.IPv4Network | None = None
    nodes: list[NodeNet] = field(default_factory=list)

    @classmethod
    def create(cls, nnodes: int) -> ClusterNet:
        """A set-up cluster network for ``nnodes`` nodes, named after this process; torn down at exit at the latest."""
        if not 1 <= nnodes <= MAX_NODES:
            raise NetnsError(f"{nnodes} nodes: a cluster network holds 1 to {MAX_NODES}")
        net = cls(tag=make_tag(os.getpid(), next(_counter)), nnodes=nnodes)
        net.setup()
        return net

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.tag}b"

    @property
    def bridge_addr(self) -> str:
        return str(self.subnet.network_address + 1)

    def names(self) -> tuple[list[str], list[str]]:
        """(namespaces, root-namespace links) this cluster owns."""
        nodes = [self.node_net(i) for i in range(self.nnodes)]
        return [n.netns for n in nodes], [self.bridge] + [n.host_iface for n in nodes]

    def setup(self) -> None:
        remove_stale()
        remove(*self.names())  # a leftover of a killed run of a process with this pid
        atexit.register(self.teardown)
        try:
            with open(LOCK_PATH, "w") as lock:
                # choosing a free /24 and putting it on the bridge is one step for concurrent setups
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.subnet = free_subnet()
                ip("link", "add", self.bridge, "type", "bridge")
                ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(self.nnodes):
                self.nodes.append(self._add_node(i))
        except BaseException:
            self.teardown()
            raise

    def node_net(self, i: int) -> NodeNet:
        """Node ``i``'s names and address (nothing is created)."""
        addr = str(self.subnet.network_address + NODE_HOST_BASE + i) if self.subnet is not None else ""
        return NodeNet(node=i, netns=f"{PREFIX}{self.tag}n{i}", iface=f"{PREFIX}{self.tag}v{i}",
                       host_iface=f"{PREFIX}{self.tag}h{i}", addr=addr)

    def _add_node(self, i: int) -> NodeNet:
        n = self.node_net(i)
        ip("netns", "add", n.netns)
        ip("link", "add", n.host_iface, "type", "veth", "peer", "name", n.iface)
        ip("link", "set", n.iface, "netns", n.netns)
        ip("link", "set", n.host_iface, "master", self.bridge, "up")
        in_ns(n.netns, "ip", "addr", "add", f"{n.addr}/24", "dev", n.iface)
        in_ns(n.netns, "ip", "link", "set", n.iface, "up")
        in_ns(n.netns, "ip", "link", "set", "lo", "up")  # a node's own ranks talk over its loopback
        return n

    def wrap(self, node: int, cmd: list[str]) -> list[str]:
        """``cmd`` run inside node ``node``'s namespace (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.nodes[node].netns, *cmd]

    def node_env(self, node: int) -> dict[str, str]:
        """What a node's processes need to use its link: gloo binds the node's veth, and trainer.netfault shapes it."""
        n = self.nodes[node]
        return {"GLOO_SOCKET_IFNAME": n.iface, "RANKSIGHT_NET_IFACE": n.iface}

    def teardown(self) -> None:
        """Remove everything this cluster made (idempotent; a part already gone is skipped)."""
        atexit.unregister(self.teardown)
        remove(*self.names())
        self.nodes = []


def remove(namespaces: list[str], links: list[str]) -> None:
    """Delete these namespaces (the veth end inside goes with its namespace) and root-namespace links, where present."""
    present_ns = set(list_namespaces())
    for ns in namespaces:
        if ns in present_ns:
            ip("netns", "del", ns, check=False)
    present = set(list_links())
    for link in links:
        if link in present:
            ip("link", "del", link, check=False)


def list_namespaces() -> list[str]:
    r = ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def list_links() -> list[str]:
    r = ip("-o", "link", "show", check=False)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            out.append(parts[1].strip().split("@", 1)[0])
    return out


def remove_stale() -> None:
    """Remove the namespaces and links of clusters whose owner process is gone (a run killed with SIGKILL)."""
    def stale(name: str) -> bool:
        m = NAME_RE.match(name)
        return bool(m) and not psutil.pid_exists(int(m["pid"], 16))

    remove([n for n in list_namespaces() if stale(n)], [n for n in list_links() if stale(n)])


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 of POOL that no address or route of the root namespace overlaps (the caller holds LOCK_PATH)."""
    used = []
    for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for tok in ip(*args, check=False).stdout.split():
            try:
                used.append(ipaddress.ip_network(tok, strict=False))
            except ValueError:
                continue
    subnets = list(POOL.subnets(new_prefix=24))
    start = os.getpid() % len(subnets)
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(u) for u in used if u.version == 4 and u.prefixlen > 0):
            return net
    raise NetnsError(f"no free /24 left in {POOL}")


_probe_result: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """Whether per-node namespaces work here, and if not why: root, ``ip`` and ``tc``, and a probe cluster whose
    node reaches the bridge over TCP (run once per process)."""
    global _probe_result
    if _probe_result is None:
        _probe_result = _probe()
    return _probe_result


def _probe() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"no `{tool}` command"
    try:
        net = ClusterNet.create(1)
    except (NetnsError, OSError) as e:
        return False, str(e)
    try:
        n = net.nodes[0]
        r = in_ns(n.netns, "tc", "qdisc", "replace", "dev", n.iface, "root", "tbf", "rate", "100mbit", "burst", "16kb",
                  "latency", "50ms", check=False)
        if r.returncode != 0:
            return False, f"tc tbf unavailable: {(r.stderr or r.stdout).strip()}"
        with socket.socket() as srv:
            srv.bind((net.bridge_addr, 0))
            srv.listen(1)
            port = srv.getsockname()[1]
            code = (f"import socket; socket.create_connection(({net.bridge_addr!r}, {port}), timeout=10).close()")
            r = subprocess.run(["ip", "netns", "exec", n.netns, sys.executable, "-c", code], capture_output=True,
                               text=True, timeout=60)
            if r.returncode != 0:
                return False, f"a namespace cannot reach the bridge: {r.stderr.strip()[-200:]}"
        return True, ""
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    finally:
        net.teardown()
