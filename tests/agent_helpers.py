"""Shared helpers for the data-path tests: processes, waits, a fake rank writer, store readers.

Every process is started through ``Procs`` and killed by it (by pid) in the test's finally.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from ranksight import schema

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TOKEN = "test-token-123"


def wait_for(pred, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001 - a not-yet-ready server raises
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def http_json(url: str, data: dict | None = None, token: str | None = TOKEN, timeout: float = 5.0):
    """GET (or POST ``data``) with the tests' token (every head endpoint but /api/health needs one); token="" or
    None sends none."""
    req = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                                 method="GET" if data is None else "POST")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


def api_get(url: str, token: str | None = TOKEN, headers: dict | None = None, timeout: float = 10.0):
    """GET an endpoint: (status, parsed JSON body), for an error answer too (its JSON error, or {}). ``headers``,
    when given, replace the token's Authorization header (none, or a wrong one)."""
    if headers is None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def http_status(url: str, body: bytes | None = None, headers: dict | None = None, method: str = "POST") -> int:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Procs:
    """Processes started by a test; each one is killed by pid (process group) at the end."""

    def __init__(self, logdir: Path):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self._n = 0

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        self._n += 1
        log = open(self.logdir / f"{name}.{self._n}.log", "wb")
        e = dict(os.environ)
        e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=e, start_new_session=True)
        self.procs[name] = p
        return p

    def head(self, store: Path, port: int, name: str = "head", extra: list[str] | None = None):
        return self.start(name, [PY, "-m", "cli.main", "head", "--store", str(store), "--port", str(port),
                                 "--token", TOKEN, "--analyze-interval", "2", *(extra or [])])

    def agent(self, store: Path, run_id: str, node: int, head_port: int, metrics_port: int | None = None,
              name: str | None = None, extra: list[str] | None = None):
        args = [PY, "-m", "cli.main", "agent", "--store", str(store), "--run-id", run_id, "--node", str(node),
                "--head", f"http://127.0.0.1:{head_port}", "--token", TOKEN, "--ship-interval", "0.5",
                "--sim-gpu", "on"]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        return self.start(name or f"agent{node}", args + list(extra or []))

    def kill(self, name: str, sig=signal.SIGKILL, wait: float = 15.0) -> None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=5)

    def stop_all(self) -> None:
        # newest first: agents before the head they ship to
        for name in reversed(list(self.procs)):
            self.kill(name, signal.SIGTERM, wait=10)

    def logs(self) -> str:
        out = []
        for f in sorted(self.logdir.glob("*.log")):
            out.append(f"===== {f.name}\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)


@contextmanager
def serving(head, poll: float = 0.05, background: bool = False, tls=None):
    """An in-process head (``head.service.Head``) served on a free 127.0.0.1 port (HTTPS with a server ``tls``
    context); ``head.url`` is set; with ``background`` its flusher (and analysis loop) run too. The server and the
    head are closed on exit."""
    from head.api import make_server

    srv = make_server(head, "127.0.0.1", 0, tls=tls)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": poll}, daemon=True).start()
    if background:
        head.start_background()
    head.url = f"{srv.scheme}://127.0.0.1:{srv.server_address[1]}"
    try:
        yield head
    finally:
        srv.shutdown()
        srv.server_close()
        head.close()


def head_ready(port: int) -> bool:
    return http_json(f"http://127.0.0.1:{port}/api/health")[1]["ok"]


class FakeRanks:
    """A stand-in for the trainer's spool writers: ranks append StepRecords at a steady rate.

    Legitimate for testing the data path on its own (tailing, shipping, dedupe); the
    end-to-end tests with real training use the trainer.
    """

    def __init__(self, store: Path, run_id: str, ranks_per_node: dict[int, list[int]], step_s: float = 0.05,
                 steps: int = 100, write_manifest: bool = True, jitter: float = 0.0):
        from ranksight.layout import RunDir

        self.rd = RunDir(store, run_id)
        self.run_id = run_id
        self.ranks_per_node = ranks_per_node
        self.step_s = step_s
        self.steps = steps
        self.jitter = jitter
        self.world = sum(len(v) for v in ranks_per_node.values())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.written: dict[int, int] = {}
        self.rd.spool_dir.mkdir(parents=True, exist_ok=True)
        if write_manifest:
            now = time.time()
            m = schema.Manifest(run_id=run_id, created=now, start_time=now, nodes=len(ranks_per_node),
                                layout={"dp": self.world, "tp": 1, "pp": 1, "world": self.world},
                                ranks=[schema.RankPlacement(rank=r, node=n, host=f"node{n}", local_rank=i, pp_stage=0,
                                                            dp_rank=r, tp_rank=0)
                                       for n, rs in ranks_per_node.items() for i, r in enumerate(rs)])
            from ranksight.layout import atomic_write

            atomic_write(self.rd.manifest, schema.encode(m))

    def record(self, rank: int, node: int, step: int, t0: float, dur: float) -> schema.StepRecord:
        return schema.StepRecord(run_id=self.run_id, rank=rank, step=step, node=node, host=f"node{node}",
                                 world_size=self.world, t_start=t0, t_end=t0 + dur, step_ms=dur * 1000.0,
                                 compute_ms=dur * 800.0, comm_ms=dur * 200.0, tokens=1024, loss=2.0 - step * 0.001)

    def _run(self) -> None:
        import random

        rnd = random.Random(7)
        files = {r: open(self.rd.spool(r), "ab") for rs in self.ranks_per_node.values() for r in rs}
        try:
            for step in range(self.steps):
                if self._stop.is_set():
                    break
                t0 = time.time()
                dur = self.step_s * (1 + self.jitter * (rnd.random() - 0.5))
                for node, rs in self.ranks_per_node.items():
                    for r in rs:
                        f = files[r]
                        f.write(schema.encode(self.record(r, node, step, t0, dur)) + b"\n")
                        f.flush()
                        self.written[r] = step + 1
                time.sleep(max(0.0, dur - (time.time() - t0)))
        finally:
            for f in files.values():
                f.close()

    def start(self) -> "FakeRanks":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float = 120) -> None:
        if self._thread:
            self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        self.join(10)


def spool_keys(store: Path, run_id: str) -> list[tuple[int, int, int]]:
    """(rank, step, attempt) of every step record in the run's spool files."""
    out = []
    spool = Path(store) / run_id / "spool"
    for p in sorted(spool.glob("rank-*.jsonl")):
        for line in p.read_bytes().splitlines():
            try:
                rec = schema.decode_spool_line(line)
            except Exception:  # noqa: BLE001 - garbage lines are not records
                continue
            if isinstance(rec, schema.StepRecord):
                out.append((rec.rank, rec.step, rec.attempt))
    return out


def stored_steps(store: Path, run_id: str) -> pd.DataFrame:
    # the store's reader: Hive partitions, and no row twice while a compaction's merged file sits beside its parts
    from ranksight.tables import read_table

    return read_table(store, run_id, "steps")


def stored_key_list(store: Path, run_id: str) -> list[tuple[int, int, int]]:
    df = stored_steps(store, run_id)
    return [tuple(int(x) for x in t) for t in df[["rank", "step", "attempt"]].itertuples(index=False)]


class Prometheus:
    """A real Prometheus (Debian package) on 127.0.0.1 from a temp dir, scraping every second."""

    def __init__(self, workdir: Path, targets: list[str], procs: Procs, port: int, flags: tuple[str, ...] = ()):
        import shutil

        self.binary = shutil.which("prometheus")
        if self.binary is None:
            raise AssertionError("prometheus is not installed: `make debs` (apt-get install prometheus) provides it")
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        (self.dir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: ranksight_agent\n"
            f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n")
        self.procs = procs
        self.flags = list(flags)

    def start(self) -> "Prometheus":
        self.procs.start("prometheus", [self.binary, f"--config.file={self.dir / 'prometheus.yml'}",
                                        f"--storage.tsdb.path={self.dir / 'data'}",
                                        f"--web.listen-address=127.0.0.1:{self.port}", *self.flags])
        return self

    def query(self, q: str) -> list:
        from urllib.parse import quote

        status, body = http_json(f"{self.url}/api/v1/query?query={quote(q)}")
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_up(self, n_targets: int = 1, timeout: float = 30.0) -> None:
        # the first scrape lands ~6 s after start (discovery manager's fixed throttle in 2.42)
        wait_for(lambda: len([r for r in self.query("up == 1")]) >= n_targets, timeout, 0.5, "prometheus up == 1")
