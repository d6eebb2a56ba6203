"""Start and stop the data path (a head and one agent per node) next to a local run.

For ``ranksight launch`` (and tests, demos): ``DataPath(store, run_id, nodes).start()`` runs
``ranksight head`` and ``ranksight agent --node N`` as child processes, logs under
``<run>/logs/``, and ``stop()`` ends them in the order that loses nothing: agents first
(SIGTERM: each ships its last batch, or keeps it in its outbox), then the head (SIGTERM:
flushes every buffered row to Parquet).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

from ranksight.layout import RunDir
from cli.local_cluster import free_port


class DataPath:
    def __init__(self, store: str | os.PathLike, run_id: str, nodes: int, *, head_port: int | None = None,
                 head_url: str | None = None, token: str | None = None, metrics_ports: list[int] | None = None,
                 sim_gpu: str = "auto", python: str = sys.executable, extra_env: dict | None = None,
                 head_args: list[str] | None = None, agent_args: list[str] | None = None,
                 agent_priority: str | None = None,
                 head_priority: str | None = None):
        self.rd = RunDir(store, run_id)
        self.nodes = nodes
        self.token = token or os.environ.get("RANKSIGHT_TOKEN") or secrets.token_urlsafe(24)
        self.own_head = head_url is None
        self.head_port = head_port or (free_port() if self.own_head else None)
        self.head_url = head_url or f"http://127.0.0.1:{self.head_port}"
        self.metrics_ports = metrics_ports or [free_port() for _ in range(nodes)]
        self.sim_gpu = sim_gpu
        self.head_args = list(head_args or [])  # extra ``ranksight head`` options (e.g. --evict on)
        self.agent_args = list(agent_args or [])  # extra ``ranksight agent`` options (e.g. --collectives per-step)
        # ``--priority`` of the agents and the head (idle | low | normal). None: the command's default (agent: low,
        # head: normal), or RANKSIGHT_AGENT_PRIORITY / RANKSIGHT_HEAD_PRIORITY from the environment.
        self.agent_priority = agent_priority
        self.head_priority = head_priority
        self.python = python
        self.env = {**os.environ, "RANKSIGHT_TOKEN": self.token, **(extra_env or {})}
        self.head: subprocess.Popen | None = None
        self.agents: list[subprocess.Popen] = []
        self._logs: list = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        logdir = self.rd.root / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        log = open(logdir / f"{name}.log", "ab")
        self._logs.append(log)
        # The token travels in the environment, not on the command line (ps shows arguments).
        return subprocess.Popen([self.python, "-m", "cli.main", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, start_new_session=True)

    def start(self, timeout: float = 30.0) -> "DataPath":
        if self.own_head:
            prio = ["--priority", self.head_priority] if self.head_priority else []
            self.head = self._spawn("head", ["head", "--store", str(self.rd.store), "--port", str(self.head_port),
                                               *prio, *self.head_args])
            self.wait_head(timeout)
        for n in range(self.nodes):
            self.agents.append(self._spawn(f"agent-node{n}", [
                "agent", "--store", str(self.rd.store), "--run-id", self.rd.run_id, "--node", str(n),
                "--head", self.head_url, "--metrics-port", str(self.metrics_ports[n]), "--sim-gpu", self.sim_gpu,
                *(["--priority", self.agent_priority] if self.agent_priority else []), *self.agent_args]))
        return self

    def wait_head(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.head is not None and self.head.poll() is not None:
                raise RuntimeError(f"the head exited with code {self.head.returncode}; see {self.rd.root / 'logs' / 'head.log'}")
            try:
                with urllib.request.urlopen(self.head_url + "/api/health", timeout=2) as r:
                    if json.loads(r.read()).get("ok"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the head did not answer at {self.head_url} within {timeout:.0f} s")

    @staticmethod
    def _term(p: subprocess.Popen, timeout: float, signalled: bool = False) -> int | None:
        """SIGTERM (unless ``signalled`` already), wait ``timeout`` s, then SIGKILL. A second SIGTERM is never sent:
        one arriving while the process is past its handler (Python restores the default at exit) kills it with -15
        after a clean stop."""
        if p.poll() is not None:
            return p.returncode
        try:
            if not signalled:
                os.killpg(p.pid, signal.SIGTERM)
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            return p.wait(5)
        except ProcessLookupError:
            return p.poll()

    def stop(self, timeout: float = 30.0) -> dict[int, dict]:
        """Agents first (all signalled at once: each ships its last records and, if the head is away, retries for
        its --drain-timeout), then the head. Returns each agent's exit report (``<run>/agent/node-<N>.exit.json``:
        what it left undelivered), by node; a node without one is reported with ``"missing": True``."""
        for p in self.agents:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.agents:
            self._term(p, timeout, signalled=True)
        if self.head is not None:
            self._term(self.head, timeout)
        for f in self._logs:
            f.close()
        self._logs = []
        reports = {}
        for n in range(len(self.agents)):
            try:
                reports[n] = json.loads(self.rd.agent_exit_report(n).read_bytes())
            except (OSError, ValueError):
                reports[n] = {"node": n, "missing": True}
        return reports

    def __enter__(self) -> "DataPath":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
