"""The node agent (and the head, when asked) run below training: SCHED_IDLE on every thread, or nice 19.

Read back from the kernel (``os.sched_getscheduler`` / ``os.getpriority`` per thread id, and
``/proc/<pid>/sched``), so these fail if a thread is left at the normal policy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import ranksight.http_server as http_mod
import node.otlp_session as session_mod
import ranksight.priority as prio_mod
from cli.datapath import DataPath
from agent_helpers import REPO, TOKEN, http_json, wait_for
from conftest import free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
                                reason="SCHED_IDLE and /proc are Linux only")


def _threads(pid: int) -> list[int]:
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def _sched_policy(pid: int) -> int:
    """The ``policy`` line of /proc/<pid>/sched (5 = SCHED_IDLE)."""
    with open(f"/proc/{pid}/sched") as f:
        for line in f:
            if line.startswith("policy"):
                return int(line.split(":")[1])
    raise AssertionError("no policy line in /proc/<pid>/sched")


def _spawn(args: list[str], tmp_path, name: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANKSIGHT_AGENT_PRIORITY", "RANKSIGHT_HEAD_PRIORITY")}
    env.update({"RANKSIGHT_TOKEN": TOKEN, "PYTHONPATH": str(REPO), **(env_extra or {})})
    log = open(tmp_path / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=REPO, start_new_session=True)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def _agent_args(tmp_path, metrics_port: int) -> list[str]:
    # The head is not there: the agent keeps its batches in the outbox and goes on running. At stop it does not
    # retry delivering them (--drain-timeout 0: the default 15 s of retries would only slow this test down).
    return ["agent", "--store", str(tmp_path / "runs"), "--run-id", "r1", "--node", "0",
            "--head", f"http://127.0.0.1:{free_port()}", "--metrics-port", str(metrics_port), "--sim-gpu", "off",
            "--drain-timeout", "0"]


def test_agent_command_puts_every_thread_at_sched_idle_on_request(tmp_path):
    port = free_port()
    p = _spawn(_agent_args(tmp_path, port) + ["--priority", "idle"], tmp_path, "agent")
    try:
        # /healthz answers once run() started its HTTP server; the sampler and OTel reader threads start with it
        wait_for(lambda: http_json(f"http://127.0.0.1:{port}/healthz")[1]["ok"], 60, what="the agent's /healthz")
        wait_for(lambda: len(_threads(p.pid)) >= 4, 30, what="the agent's threads")
        tids = _threads(p.pid)
        assert {t: os.sched_getscheduler(t) for t in tids} == {t: os.SCHED_IDLE for t in tids}
        assert _sched_policy(p.pid) == os.SCHED_IDLE
    finally:
        _kill(p)
    assert "priority idle" in (tmp_path / "agent.log").read_text()


def test_agent_default_is_nice_19_on_every_thread_and_normal_is_untouched(tmp_path):
    for prio, env in (("low", {}), ("normal", {"RANKSIGHT_AGENT_PRIORITY": "normal"})):
        port = free_port()
        args = _agent_args(tmp_path, port)  # low: the default; normal: from the environment
        p = _spawn(args, tmp_path, f"agent-{prio}", env)
        try:
            wait_for(lambda: http_json(f"http://127.0.0.1:{port}/healthz")[1]["ok"], 60, what="the agent's /healthz")
            wait_for(lambda: len(_threads(p.pid)) >= 4, 30, what="the agent's threads")
            tids = _threads(p.pid)
            want_nice = 19 if prio == "low" else os.getpriority(os.PRIO_PROCESS, 0)
            assert {t: os.sched_getscheduler(t) for t in tids} == {t: os.SCHED_OTHER for t in tids}
            assert {t: os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {t: want_nice for t in tids}
        finally:
            _kill(p)


def test_head_priority_idle(tmp_path):
    port = free_port()
    p = _spawn(["head", "--store", str(tmp_path / "runs"), "--port", str(port), "--priority", "idle"], tmp_path, "head")
    try:
        wait_for(lambda: http_json(f"http://127.0.0.1:{port}/api/health")[1]["ok"], 60, what="the head")
        tids = _threads(p.pid)
        assert len(tids) >= 3  # HTTP server, flusher, analyzer: started after the policy was set
        assert {t: os.sched_getscheduler(t) for t in tids} == {t: os.SCHED_IDLE for t in tids}
    finally:
        _kill(p)


def test_threads_started_later_inherit_it(tmp_path):
    code = ("import json, os, threading; from ranksight.priority import set_priority, current_priority\n"
            "notes = set_priority('idle')\n"
            "out = {}\n"
            "t = threading.Thread(target=lambda: out.update(thread=current_priority(threading.get_native_id())))\n"
            "t.start(); t.join()\n"
            "print(json.dumps({'notes': notes, 'main': current_priority(), **out}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"notes": [], "main": "idle", "thread": "idle"}


def test_refused_priority_is_logged_and_the_process_goes_on(monkeypatch, caplog):
    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(prio_mod.os, "sched_setscheduler", refuse)
    monkeypatch.setattr(prio_mod.os, "setpriority", refuse)
    monkeypatch.setattr(prio_mod, "_ioprio_set", refuse)
    notes = prio_mod.set_priority("idle", who="test")
    assert len(notes) == 3 and "SCHED_IDLE refused" in notes[0] and "nice 19 refused" in notes[1]
    assert "I/O priority" in notes[2] and "SCHED_IDLE refused" in caplog.text
    with pytest.raises(ValueError):
        prio_mod.set_priority("highest")


def test_datapath_passes_the_priorities_through(tmp_path, monkeypatch):
    spawned = {}

    class Dummy:
        pid = 0

    def spawn(self, name, args):
        spawned[name] = args
        return Dummy()

    monkeypatch.setattr(DataPath, "_spawn", spawn)
    monkeypatch.setattr(DataPath, "wait_head", lambda self, timeout=30.0: None)
    DataPath(tmp_path, "r1", nodes=2, agent_priority="low", head_priority="idle").start()
    assert spawned["head"][spawned["head"].index("--priority") + 1] == "idle"
    assert all(spawned[f"agent-node{n}"][spawned[f"agent-node{n}"].index("--priority") + 1] == "low" for n in (0, 1))
    spawned.clear()
    DataPath(tmp_path, "r2", nodes=1).start()  # not given: the commands' defaults (agent low, head normal)
    assert "--priority" not in spawned["head"] and "--priority" not in spawned["agent-node0"]


# -- the agent's quieter plumbing: the exporters' HTTP session and the HTTP server's shutdown ----------------------

def _counting_server(close_after: int | None = None):
    """A keep-alive HTTP/1.1 server that counts connections; it closes a connection after ``close_after`` requests."""
    from http.server import ThreadingHTTPServer

    from ranksight.http_server import NoDelayHandler

    conns, bodies = [], []

    class H(NoDelayHandler):
        def setup(self):
            super().setup()
            conns.append(self.client_address)
            self.n = 0

        def log_message(self, *a):
            pass

        def do_POST(self):
            bodies.append((self.path, self.headers.get("Content-Type"), self.rfile.read(int(self.headers["Content-Length"]))))
            self.n += 1
            out = b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            if close_after is not None and self.n >= close_after:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(out)

    class S(ThreadingHTTPServer):
        daemon_threads = True

    srv = S(("127.0.0.1", 0), H)
    t = http_mod.serve_in_thread(srv, "test-http")
    return srv, t, conns, bodies


def test_lean_session_keeps_one_connection_and_reconnects(monkeypatch):
    for k in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    srv, t, conns, bodies = _counting_server()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/logs"
    s = session_mod.exporter_session(url)
    assert isinstance(s, session_mod.LeanSession)
    try:
        for i in range(3):
            r = s.request("POST", url, headers={"Content-Type": "application/x-protobuf"}, data=b"x" * (i + 1), timeout=5)
            assert r.status_code == 200 and r.content == b"ok" and r.text == "ok"
        assert len(conns) == 1  # kept alive
        assert [b for _, _, b in bodies] == [b"x", b"xx", b"xxx"] and bodies[0][:2] == ("/v1/logs", "application/x-protobuf")
        s._conn.sock.close()  # the connection dies between two exports: the next one opens a new one
        assert s.request("POST", url, data=b"y", timeout=5).status_code == 200 and len(conns) == 2
    finally:
        http_mod.shutdown_server(srv)
        srv.server_close()
    t.join(10)
    assert not t.is_alive()
    import requests

    with pytest.raises(requests.exceptions.ConnectionError):  # the SDK retries these (is_connection_error)
        session_mod.LeanSession(url).request("POST", url, data=b"z", timeout=5)


def test_lean_session_follows_connection_close():
    srv, t, conns, bodies = _counting_server(close_after=1)
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/metrics"
    s = session_mod.LeanSession(url)
    try:
        assert [s.request("POST", url, data=b"a", timeout=5).status_code for _ in range(3)] == [200, 200, 200]
        assert len(conns) == 3 and s._conn is None
    finally:
        http_mod.shutdown_server(srv)
        srv.server_close()


def test_exporters_use_requests_for_tls_and_proxies(monkeypatch):
    import requests

    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert isinstance(session_mod.exporter_session("https://head:4318/v1/logs"), requests.Session)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    assert isinstance(session_mod.exporter_session("http://head:4318/v1/logs"), requests.Session)
    monkeypatch.setenv("NO_PROXY", "head")
    assert isinstance(session_mod.exporter_session("http://head:4318/v1/logs"), session_mod.LeanSession)
