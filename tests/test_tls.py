"""TLS on the head and on the agent's /metrics + /control endpoint, with a throwaway CA made in the test (trustme):
an agent ships to an https head and the data lands; clients that do not trust the server, or present no certificate
under mutual TLS, are refused; the head posts an action to an https agent; /metrics is scraped over TLS; a head
bound beyond loopback without TLS refuses to start. Every server binds 127.0.0.1."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import urllib.error
import urllib.request
from types import SimpleNamespace

import msgspec
import pytest

trustme = pytest.importorskip("trustme", reason="trustme (pyproject's dev extra) makes the tests' throwaway CA")

from typer.testing import CliRunner  # noqa: E402

from agent_helpers import PY, REPO, TOKEN, FakeRanks, Procs, wait_for  # noqa: E402
from conftest import free_port  # noqa: E402
from head.api import make_server  # noqa: E402
from head.cli import head_command  # noqa: E402
from head.service import Head  # noqa: E402
from node.agent import NodeAgent  # noqa: E402
from node.control import ControlServer  # noqa: E402
from node.prom import AgentMetrics  # noqa: E402
from ranksight import schema  # noqa: E402
from ranksight.http_server import serve_in_thread, shutdown_server  # noqa: E402
from ranksight.layout import RunDir  # noqa: E402
from ranksight.tables import read_table  # noqa: E402
from ranksight.tls import ClientTls, ServerTls, TlsConfigError, is_loopback  # noqa: E402
from tui.client import HeadClient, HeadUnreachable  # noqa: E402


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """One CA with a server certificate for 127.0.0.1 and a client certificate; a second CA nobody trusts, with a
    client certificate of its own. All PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("agent-0.ranksight.test")
    intruder = rogue.issue_cert("intruder.test")
    p = SimpleNamespace(ca=str(d / "ca.pem"), rogue_ca=str(d / "rogue-ca.pem"))
    ca.cert_pem.write_to_path(p.ca)
    rogue.cert_pem.write_to_path(p.rogue_ca)
    for name, leaf in (("server", server), ("client", client), ("intruder", intruder)):
        cert, key = str(d / f"{name}.pem"), str(d / f"{name}.key")
        for i, blob in enumerate(leaf.cert_chain_pems):
            blob.write_to_path(cert, append=i > 0)
        leaf.private_key_pem.write_to_path(key)
        setattr(p, f"{name}_cert", cert)
        setattr(p, f"{name}_key", key)
    return p


class TlsHead:
    """A head in this process on https://127.0.0.1:<free port> (``client_ca``: mutual TLS)."""

    def __init__(self, store, pki, *, client_ca: str | None = None, agent_tls: ssl.SSLContext | None = None,
                 tls: bool = True):
        self.head = Head(store, TOKEN, analyzer=None, flush_interval=0.2, agent_tls=agent_tls)
        ctx = ServerTls.from_options(pki.server_cert, pki.server_key, client_ca).context() if tls else None
        self.srv = make_server(self.head, "127.0.0.1", free_port(), tls=ctx)
        self.url = f"{self.srv.scheme}://127.0.0.1:{self.srv.server_address[1]}"
        serve_in_thread(self.srv, "test-head")
        self.head.start_background()

    def close(self):
        shutdown_server(self.srv)
        self.srv.server_close()
        self.head.close()


def write_steps(rd: RunDir, rank: int, node: int, steps) -> None:
    rd.spool_dir.mkdir(parents=True, exist_ok=True)
    with open(rd.spool(rank), "ab") as f:
        for s in steps:
            f.write(schema.encode(schema.StepRecord(run_id=rd.run_id, rank=rank, step=s, node=node, host="h",
                                                    world_size=1, t_start=float(s), t_end=s + 0.2,
                                                    step_ms=200.0)) + b"\n")


def stored(store, run_id):
    df = read_table(store, run_id, "steps")
    return sorted(zip(df["rank"].astype(int), df["step"].astype(int)))


def test_agent_ships_to_a_tls_head_and_the_data_lands(tmp_path, pki):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    write_steps(rd, 0, 0, range(5))
    h = TlsHead(store, pki)
    assert h.url.startswith("https://")
    a = NodeAgent(rd, 0, h.url, TOKEN, sim_gpu="off", otlp_metrics=False, ship_timeout=5.0,
                  tls_client=ClientTls.from_options(pki.ca))
    try:
        a.cycle()
        assert a.shipper.errors == 0
        h.head.store.flush_all()
        assert stored(store, "r1") == [(0, s) for s in range(5)]
        # the API over the same TLS port, read by the TUI's client with the CA
        c = HeadClient(h.url, token=TOKEN, tls=ClientTls.from_options(pki.ca))
        assert [r.run_id for r in c.runs()] == ["r1"]
        assert h.srv.tls_refused == 0
    finally:
        a.shipper.close()
        h.close()


def test_clients_that_do_not_trust_the_head_are_refused_and_keep_their_data(tmp_path, pki):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    write_steps(rd, 0, 0, range(3))
    h = TlsHead(store, pki)
    # the agent with the system's CAs only: the throwaway CA is not among them
    a = NodeAgent(rd, 0, h.url, TOKEN, sim_gpu="off", otlp_metrics=False, ship_timeout=2.0)
    try:
        a.cycle()
        assert a.shipper.errors >= 1
        assert a.outbox.records() == 3  # not acknowledged: kept in the outbox, not lost
        h.head.store.flush_all()
        assert h.head.stats["records_in"] == 0
        for tls in (ClientTls(), ClientTls.from_options(pki.rogue_ca)):  # system CAs; a CA that did not sign it
            with pytest.raises(HeadUnreachable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
                HeadClient(h.url, token=TOKEN, tls=tls).runs()
        # plain http sent to the TLS port gets no answer, and the server goes on serving good clients
        with pytest.raises(HeadUnreachable):
            HeadClient(h.url.replace("https://", "http://"), token=TOKEN, timeout=5).runs()
        assert HeadClient(h.url, tls=ClientTls.from_options(pki.ca)).health()["ok"] is True
        assert wait_for(lambda: h.srv.tls_refused >= 3, 10, what="refused handshakes counted")
        # the same agent, now given the CA, delivers what it kept: exactly once
        b = NodeAgent(rd, 0, h.url, TOKEN, sim_gpu="off", otlp_metrics=False, ship_timeout=5.0,
                      tls_client=ClientTls.from_options(pki.ca))
        try:
            b.cycle()
            assert b.shipper.errors == 0
        finally:
            b.shipper.close()
        h.head.store.flush_all()
        assert stored(store, "r1") == [(0, 0), (0, 1), (0, 2)]
    finally:
        a.shipper.close()
        h.close()


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(tmp_path, pki):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    write_steps(rd, 0, 0, range(4))
    h = TlsHead(store, pki, client_ca=pki.ca)
    try:
        for tls in (ClientTls.from_options(pki.ca),  # trusts the head, presents nothing
                    ClientTls.from_options(pki.ca, pki.intruder_cert, pki.intruder_key)):  # a certificate of another CA
            with pytest.raises(HeadUnreachable):
                HeadClient(h.url, token=TOKEN, tls=tls, timeout=5).runs()
        no_cert = NodeAgent(rd, 0, h.url, TOKEN, sim_gpu="off", otlp_metrics=False, ship_timeout=2.0,
                            tls_client=ClientTls.from_options(pki.ca))
        try:
            no_cert.cycle()
            assert no_cert.shipper.errors >= 1
        finally:
            no_cert.shipper.close()
        assert h.head.stats["records_in"] == 0
        assert wait_for(lambda: h.srv.tls_refused >= 3, 10, what="refused handshakes counted")
        # with the CA's client certificate: served, and the agent's data lands
        good = ClientTls.from_options(pki.ca, pki.client_cert, pki.client_key)
        assert HeadClient(h.url, token=TOKEN, tls=good).runs() == []
        a = NodeAgent(rd, 0, h.url, TOKEN, sim_gpu="off", otlp_metrics=False, ship_timeout=5.0, tls_client=good)
        try:
            a.cycle()
            assert a.shipper.errors == 0
        finally:
            a.shipper.close()
        h.head.store.flush_all()
        assert stored(store, "r1") == [(0, s) for s in range(4)]
    finally:
        h.close()


def _get(url: str, ctx: ssl.SSLContext) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
        return r.status, r.read().decode()


def test_head_posts_actions_to_a_tls_agent_and_prometheus_scrapes_it(tmp_path, pki):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    write_steps(rd, 0, 0, range(3))
    head_tls = ClientTls.from_options(pki.ca, pki.client_cert, pki.client_key)
    h = TlsHead(store, pki, tls=False, agent_tls=head_tls.context())  # a loopback head: plain http is fine
    agent_tls = ServerTls.from_options(pki.server_cert, pki.server_key, client_ca=pki.ca).context()
    a = NodeAgent(rd, 0, h.url, TOKEN, sim_gpu="off", otlp_metrics=False, metrics_port=0, tls_server=agent_tls)
    try:
        a.start_server()
        assert a.url.startswith("https://127.0.0.1:")
        a.cycle()  # the heartbeat tells the head the agent's https control URL
        act = h.head.actions.request("r1", {"action": "checkpoint", "reason": "tls test"})
        assert act.status == "requested", act.reason
        creq = msgspec.json.decode((rd.control_requests / f"{act.id}.json").read_bytes(), type=schema.ControlRequest)
        assert creq.action == "checkpoint" and creq.reason == "tls test"
        # a head that does not trust the agent's certificate, or has no client certificate: the action fails,
        # says why, and no request reaches the trainer
        for tls in (ClientTls(), ClientTls.from_options(pki.ca)):
            h.head.actions.tls = tls.context()
            bad = h.head.actions.request("r1", {"action": "checkpoint"})
            assert bad.status == "failed" and "unreachable" in bad.reason
            assert not (rd.control_requests / f"{bad.id}.json").exists()
        # Prometheus' scrape with tls_config (ca_file, cert_file, key_file): the agent's metrics over TLS
        status, text = _get(a.url + "/metrics", head_tls.context())
        assert status == 200 and "ranksight_agent_records_shipped_total" in text
        status, body = _get(a.url + "/healthz", head_tls.context())
        assert status == 200 and '"ok": true' in body
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _get(a.url + "/metrics", ClientTls.from_options(pki.ca).context())  # no client certificate
    finally:
        shutdown_server(a.server)
        a.server.server_close()
        a.shipper.close()
        h.close()


def test_a_head_bound_beyond_loopback_without_tls_refuses_to_start(tmp_path):
    store = tmp_path / "store"
    # a process with a time limit: were the refusal gone, a head would start and serve, and the limit end it
    env = {k: v for k, v in os.environ.items() if k != "RANKSIGHT_TOKEN"}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), COLUMNS="300")
    r = subprocess.run([PY, "-m", "cli.main", "head", "--store", str(store), "--port", str(free_port()),
                        "--bind", "0.0.0.0", "--analyze-interval", "0"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    out = re.sub(r"[\s│╭╮╰╯─]+", " ", r.stdout + r.stderr)  # rich's error box wraps the message
    assert r.returncode == 2, out
    assert "refusing to listen on 0.0.0.0 without TLS" in out and "--insecure-bind" in out and "--tls-cert" in out
    assert not (store / ".head-token").exists()  # refused before anything was written
    # a half-given pair is refused as clearly
    r = CliRunner().invoke(head_command, ["--store", str(store), "--tls-cert", str(tmp_path / "x.pem")],
                           env={"RANKSIGHT_TOKEN": TOKEN})
    assert r.exit_code == 2 and "go together" in re.sub(r"[\s│╭╮╰╯─]+", " ", r.output)


def test_loopback_and_tls_option_checks(tmp_path, pki):
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.1.2.3", "192.168.0.1"))
    with pytest.raises(TlsConfigError, match="--tls-key"):
        ServerTls.from_options(pki.server_cert, None)
    with pytest.raises(TlsConfigError, match="--tls-client-ca needs"):
        ServerTls.from_options(None, None, pki.ca)
    with pytest.raises(TlsConfigError, match="no such file"):
        ServerTls.from_options(tmp_path / "missing.pem", pki.server_key)
    with pytest.raises(TlsConfigError, match="cannot load"):  # a key that is not the certificate's
        ServerTls.from_options(pki.server_cert, pki.client_key).context()
    with pytest.raises(TlsConfigError, match="go together"):
        ClientTls.from_options(pki.ca, pki.client_cert, None)
    ctx = ServerTls.from_options(pki.server_cert, pki.server_key).context()
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    # the control URL the head is told: https under TLS, or the advertised one (a name the certificate holds)
    for advertise, want in ((None, "https://127.0.0.1:"), ("https://node3.example:9401/", "https://node3.example:9401")):
        srv = ControlServer(("127.0.0.1", 0), rd=RunDir(tmp_path, "r"), node=0, token=TOKEN, metrics=AgentMetrics(),
                            local_ranks=list, tls=ctx, advertise_url=advertise)
        try:
            assert srv.url.startswith(want) and not srv.url.endswith("/")
        finally:
            srv.server_close()


def test_the_commands_over_tls_end_to_end(tmp_path, pki):
    """``ranksight head`` and ``ranksight agent`` as processes, with their TLS options and mutual TLS both ways:
    the agent's steps reach the head, and an action reaches the agent's https control endpoint."""
    store = tmp_path / "store"
    procs = Procs(tmp_path / "logs")
    hport, mport = free_port(), free_port()
    client = ["--tls-ca", pki.ca, "--tls-client-cert", pki.client_cert, "--tls-client-key", pki.client_key]
    server = ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca]
    fr = FakeRanks(store, "e2e", {0: [0]}, steps=20, step_s=0.02)
    try:
        procs.head(store, hport, extra=[*server, *client])
        head_url = f"https://127.0.0.1:{hport}"
        c = HeadClient(head_url, token=TOKEN, tls=ClientTls.from_options(pki.ca, pki.client_cert, pki.client_key))
        wait_for(lambda: c.health()["ok"], 60, what="the TLS head")
        fr.start()
        fr.join()
        procs.start("agent", [PY, "-m", "cli.main", "agent", "--store", str(store), "--run-id", "e2e", "--node", "0",
                              "--head", head_url, "--token", TOKEN, "--ship-interval", "0.5", "--sim-gpu", "on",
                              "--metrics-port", str(mport), *server, *client])
        wait_for(lambda: any(r.run_id == "e2e" and r.last_step == 19 for r in c.runs()), 60,
                 what="the agent's steps at the head")
        wait_for(lambda: any(ag.get("url", "").startswith("https://") for ag in
                             c._request("GET", "/api/runs/e2e/agents")), 30, what="the agent's https control URL")
        act = c.request_action("e2e", "checkpoint")
        assert act.status == "requested", act.reason
        assert (RunDir(store, "e2e").control_requests / f"{act.id}.json").exists()
        assert "listening on https://" in (tmp_path / "logs").joinpath("head.1.log").read_text()
    except AssertionError:
        print(procs.logs())
        raise
    finally:
        fr.stop()
        procs.stop_all()
