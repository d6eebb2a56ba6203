"""The rig of the fault-injection benchmark (bench/fault_injection.py): a real run's processes, one scenario at a time.

``Rig`` starts, kills and restarts the real processes of a 2-node x 2-rank CPU run as ``ranksight launch`` does
(``cli.local_cluster.LocalCluster`` for the torchruns; ``ranksight head`` and one ``ranksight agent`` per node as
commands), with two differences a benchmark needs:

- the head keeps its store in a directory of its own (``head_store``, possibly a small tmpfs), apart from the run
  directory the ranks and agents write (``data_store``): what the store holds then came through the head alone;
- the agents ship through ``AckRecorder``, a pass-through HTTP proxy in this process that decodes every
  ``/v1/logs`` request the head answered 200 and keeps the natural key of each record in it: the set of records the
  head acknowledged, counted from its answers, whatever later happens to the head or the agents.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cli.local_cluster import LocalCluster, free_port  # noqa: E402
from head.receiver import HttpError, decompress, parse  # noqa: E402
from ranksight import wire, wire_decode  # noqa: E402
from ranksight.layout import RunDir  # noqa: E402
from ranksight.spool import read_spool  # noqa: E402
from ranksight.tables import KEYS, SPECS, read_table  # noqa: E402

# bench/detect.py's model: a few hundred ms a step on 2 shared cores, so a run of a few dozen steps lasts long enough
# for faults "mid-run" and several of the head's analysis rounds
MODEL = ["--d-model", "128", "--n-layers", "4", "--n-heads", "4", "--seq-len", "48", "--batch-size", "16"]
TOKEN = "fault-injection-bench-token"


# ---------------------------------------------------------------------------
# what the head acknowledged
# ---------------------------------------------------------------------------

def record_keys(run_id: str, body: bytes, encoding: str | None, content_type: str | None) -> dict[str, list[tuple]]:
    """The natural key of every record of ``run_id`` in one OTLP logs request, by store table, decoded as the head
    decodes it (records of another run and undecodable log records are not this run's data)."""
    req = parse("logs", decompress(body, encoding), content_type)
    out: dict[str, list[tuple]] = {}
    for batch, _reason in wire_decode.iter_batches(req):
        if batch is None or batch.run_id != run_id or batch.kind not in wire.BATCH_KINDS:
            continue
        table = wire.BATCH_KINDS[batch.kind][1]
        if table is None:
            continue
        keys = out.setdefault(table, [])
        if isinstance(batch.items, wire.PackedBatch):
            layout = batch.items.layout
            arr = np.frombuffer(batch.items.payload, dtype=layout.dtype)
            # string fields are fixed-width bytes in a packed body: as the store keeps them, text; a field every
            # record of the batch holds at its default is left out of the layout: the default, as the store fills it
            cols = [[v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in arr[k].tolist()]
                    if k in layout.codes else [layout.defaults.get(k)] * len(arr) for k in KEYS[table]]
            keys.extend(zip(*cols))
        else:
            keys.extend(SPECS[table].key_of(r) for r in batch.items if getattr(r, "run_id", run_id) == run_id)
    return out


class AckRecorder(ThreadingHTTPServer):
    """Forwards every POST to the head at ``head_port`` and answers with the head's answer (503 while the head is
    unreachable: the agent retries, as it would against a head that is down). For each ``/v1/logs`` request answered
    200 it adds the records' keys to ``acked`` (table -> Counter of keys: a count above 1 is a record acknowledged
    more than once, e.g. re-sent by an agent killed before it saw the answer)."""

    daemon_threads = True

    def __init__(self, head_port: int, run_id: str):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.head_port = head_port
        self.run_id = run_id
        self.acked: dict[str, Counter] = {}
        self.statuses: Counter = Counter()
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def note(self, path: str, status: int, body: bytes, headers) -> None:
        with self.lock:
            self.statuses[f"{path} {status}"] += 1
        if path != "/v1/logs" or status != 200:
            return
        try:
            keys = record_keys(self.run_id, body, headers.get("Content-Encoding"), headers.get("Content-Type"))
        except HttpError:
            return  # the head answered 200 to a body we cannot read: it cannot have stored any record of it either
        with self.lock:
            for table, ks in keys.items():
                self.acked.setdefault(table, Counter()).update(ks)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        srv: AckRecorder = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fwd = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type", "content-encoding")}
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.head_port, timeout=20)
            conn.request("POST", self.path, body=body, headers=fwd)
            resp = conn.getresponse()
            status, out, ctype = resp.status, resp.read(), resp.getheader("Content-Type") or "application/x-protobuf"
            conn.close()
        except OSError:
            status, out, ctype = 503, b"", "text/plain"
        srv.note(self.path.split("?")[0], status, body, self.headers)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


# ---------------------------------------------------------------------------
# the processes
# ---------------------------------------------------------------------------

class Rig:
    """One scenario's run: ``tmp`` holds the ranks' run directory (``data_store``) and, unless given, the head's
    store. Processes are killed by their own process group, never by name."""

    def __init__(self, tmp: Path, run_id: str, steps: int, head_store: Path | None = None):
        self.tmp = Path(tmp)
        self.run_id = run_id
        self.steps = steps
        self.data_store = self.tmp / "runs"
        self.head_store = Path(head_store) if head_store else self.tmp / "head"
        self.rd = RunDir(self.data_store, run_id)
        self.rd.root.mkdir(parents=True, exist_ok=True)
        self.logs = self.tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.head_port = free_port()
        self.proxy = AckRecorder(self.head_port, run_id)
        self.env = {**os.environ, "RANKSIGHT_TOKEN": TOKEN, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.head: subprocess.Popen | None = None
        self.agents: dict[int, subprocess.Popen] = {}
        self.cluster: LocalCluster | None = None
        self.head_stats: dict[int, dict] = {}  # by pid: /api/stats of each head incarnation, last read
        self.live_findings: dict[str, dict] = {}  # by id, from the head's API
        self.events: list[str] = []  # what the scenario did
        self.t_start = time.time()

    def say(self, what: str) -> None:
        self.events.append(what)

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        """The command, its output in ``logs/<name>.log`` (``<name>.2.log``, ... for a restarted one)."""
        path, k = self.logs / f"{name}.log", 1
        while path.exists():
            k += 1
            path = self.logs / f"{name}.{k}.log"
        log = open(path, "ab")
        try:
            p = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT, env={**self.env, **(env or {})}, start_new_session=True)
        finally:
            log.close()
        p.log_path = path
        return p

    # -- head ----------------------------------------------------------------------------------------------------
    def start_head(self, timeout: float = 60.0) -> None:
        self.head = self._spawn("head", ["head", "--store", str(self.head_store), "--port", str(self.head_port),
                                         "--analyze-interval", "2", "--evict", "dry-run", "--min-nodes", "1",
                                         "--log-level", "INFO"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.head.poll() is not None:
                raise RuntimeError(f"the head exited with {self.head.returncode}; see {self.logs / 'head.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.head_port}/api/health", timeout=2) as r:
                    if json.loads(r.read()).get("ok"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the head did not answer within {timeout:.0f} s")

    def api(self, path: str):
        req = urllib.request.Request(f"http://127.0.0.1:{self.head_port}{path}",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def read_head(self) -> None:
        """Keep the head's counters and live findings (lost with the process when it is killed or stopped)."""
        try:
            self.head_stats[self.head.pid] = self.api("/api/stats").get("stats", {})
            body = self.api(f"/api/runs/{self.run_id}/findings")
            items = body.get("findings", body) if isinstance(body, dict) else body
            for f in items:
                if isinstance(f, dict):
                    self.live_findings[str(f.get("id") or len(self.live_findings))] = f
        except (OSError, ValueError):
            pass

    def kill_head(self, sig: int = signal.SIGKILL) -> None:
        if sig != signal.SIGKILL:
            self.read_head()
        _signal_group(self.head, sig)
        self.head.wait(60)

    # -- agents --------------------------------------------------------------------------------------------------
    def start_agent(self, node: int, env: dict | None = None, drain_timeout: float = 15.0) -> None:
        self.agents[node] = self._spawn(f"agent-node{node}", [
            "agent", "--store", str(self.data_store), "--run-id", self.run_id, "--node", str(node),
            "--head", self.proxy.url, "--metrics-port", "0", "--sim-gpu", "on",
            "--drain-timeout", str(drain_timeout)], env)
        # until it has its signal handlers (it prints its pid line then): a SIGTERM during its imports would end it
        # before it ships anything, which is not what a scenario means by stopping it
        p, deadline = self.agents[node], time.monotonic() + 90
        while time.monotonic() < deadline and p.poll() is None and "pid" not in log_text(p.log_path):
            time.sleep(0.2)

    def kill_agent(self, node: int, sig: int = signal.SIGKILL) -> None:
        _signal_group(self.agents[node], sig)
        self.agents[node].wait(90)

    def stop_agents(self) -> dict[int, dict]:
        """SIGTERM to every agent at once (as launch does), wait; each one's exit report."""
        for p in self.agents.values():
            _signal_group(p, signal.SIGTERM)
        for p in self.agents.values():
            try:
                p.wait(90)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(10)
        out = {}
        for n in self.agents:
            path = self.rd.agent_exit_report(n)
            try:
                out[n] = json.loads(path.read_bytes())
                if path.stat().st_mtime < self.t_start:
                    out[n] = {"missing": True}  # a report left by an earlier run in this directory
            except (OSError, ValueError):
                out[n] = {"missing": True}
        return out

    def drain_agent(self, node: int, timeout: float = 60.0) -> int:
        """``ranksight agent --drain``: deliver a stopped agent's leftover outbox; its exit code."""
        p = self._spawn(f"drain-node{node}", ["agent", "--drain", "--store", str(self.data_store), "--run-id",
                                              self.run_id, "--node", str(node), "--head", self.proxy.url,
                                              "--drain-timeout", "20"])
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            return p.wait(10)

    # -- training ------------------------------------------------------------------------------------------------
    def start_training(self, env: dict | None = None) -> None:
        args = [*MODEL, "--dp", "4", "--steps", str(self.steps), "--store", str(self.data_store),
                "--run-id", self.run_id, "--quiet"]
        self.cluster = LocalCluster(run_dir=self.rd.root, nnodes=2, nproc_per_node=2, trainer_args=args,
                                    min_nodes=2, max_restarts=0, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                                                       **(env or {})}, netns=False)
        self.cluster.start()

    def last_step(self) -> int:
        """The step every rank has written (-1 before all four spools have one)."""
        last = []
        for p in self.rd.spool_dir.glob("rank-*.jsonl") if self.rd.spool_dir.is_dir() else []:
            steps = [r.step for r in read_spool(p).records if type(r).__name__ == "StepRecord"]
            if steps:
                last.append(max(steps))
        return min(last) if len(last) == 4 else -1

    def wait_step(self, step: int, timeout: float = 240.0) -> None:
        """Until every rank has written ``step`` (or training ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.last_step() < step and not self.cluster.done:
            self.cluster.poll()
            time.sleep(0.2)

    def wait_training(self, timeout: float = 300.0) -> dict[int, int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.cluster.done:
            self.cluster.poll()
            time.sleep(0.3)
        codes = self.cluster.exit_codes()
        self.cluster.stop()
        self.say(f"training ended (node exit codes {codes})")
        return codes

    def close(self) -> None:
        """Whatever still runs, killed (a scenario that failed half-way)."""
        if self.cluster is not None:
            self.cluster.stop()
        for p in [*self.agents.values(), self.head]:
            if p is not None and p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait(10)
        self.proxy.close()

    # -- what happened -------------------------------------------------------------------------------------------
    def written_steps(self) -> set[tuple]:
        """(rank, step, attempt) of every step record of this run in the ranks' spool files."""
        out = set()
        for p in self.rd.spool_dir.glob("rank-*.jsonl"):
            for r in read_spool(p).records:
                if type(r).__name__ == "StepRecord" and r.run_id == self.run_id:
                    out.add((r.rank, r.step, r.attempt))
        return out

    def stored_keys(self, table: str) -> Counter:
        df = read_table(self.head_store, self.run_id, table, columns=list(KEYS[table]))
        if df.empty:
            return Counter()
        return Counter(zip(*(df[k].tolist() for k in KEYS[table])))

    def stored(self, table: str):
        return read_table(self.head_store, self.run_id, table)


def _signal_group(p: subprocess.Popen | None, sig: int) -> None:
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def log_count(logs: Path, prefix: str, needle: str) -> int:
    """Occurrences of ``needle`` in the logs of every incarnation of ``prefix`` (``head``, ``agent-node0``, ...)."""
    return sum(log_text(p).count(needle) for p in logs.glob(f"{prefix}*.log"))
