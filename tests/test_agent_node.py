"""The node agent in-process: outbox while the head is down, bounded drops, garbage gaps, control requests and acks."""

import threading
import urllib.request

import msgspec

from head.api import make_server
from head.service import Head
from node.agent import NodeAgent
from node.state import load_state
from ranksight.tables import read_table
from agent_helpers import TOKEN, FakeRanks, http_json, http_status, wait_for
from conftest import free_port
from ranksight import schema
from ranksight.layout import RunDir, atomic_write


class HeadThread:
    def __init__(self, store, port):
        self.head = Head(store, TOKEN, analyzer=None, flush_interval=0.2)
        self.srv = make_server(self.head, "127.0.0.1", port)
        self.t = threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.t.start()
        self.head.start_background()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()
        self.head.close()


def write_steps(rd, rank, node, rng, extra=b""):
    rd.spool_dir.mkdir(parents=True, exist_ok=True)
    with open(rd.spool(rank), "ab") as f:
        for s in rng:
            f.write(schema.encode(schema.StepRecord(run_id=rd.run_id, rank=rank, step=s, node=node, host="h",
                                                    world_size=2, t_start=float(s), t_end=s + 0.2, step_ms=200.0)) + b"\n")
        f.write(extra)


def stored(store, run_id):
    df = read_table(store, run_id, "steps")
    return sorted(zip(df["rank"].astype(int), df["step"].astype(int)))


def test_head_down_outbox_then_delivery_exactly_once(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    port = free_port()
    write_steps(rd, 0, 0, range(0, 30))
    write_steps(rd, 1, 1, range(0, 30))  # another node's rank: not ours
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", ship_timeout=0.5, otlp_metrics=False)
    try:
        a.cycle()  # head unreachable
        assert a.spool.local_ranks == [0]
        assert len(a.outbox) == 1 and a.outbox.records() == 30
        # the batch is durable in the outbox, so the position moved on (and was saved)
        assert load_state(rd.agent_state(0), 0).positions[0].records == 30
        write_steps(rd, 0, 0, range(30, 40))
        a.cycle()
        assert a.outbox.records() == 40 and a.shipper.errors >= 2
        assert a.lag() > 0
        # stopping while the head is away: the last batch goes to the outbox without another try
        errors = a.shipper.errors
        write_steps(rd, 0, 0, range(40, 42))
        a.cycle(final=True)
        assert a.shipper.errors == errors and a.outbox.records() == 42
        h = HeadThread(store, port)
        try:
            write_steps(rd, 0, 0, range(42, 45))
            a.cycle()  # drains the outbox oldest first, then ships the new batch
            assert len(a.outbox) == 0 and a.lag() == 0.0
            h.head.store.flush_all()
            assert stored(store, "r1") == [(0, s) for s in range(45)]
            # a restarted agent with a lost state file re-reads everything: the head drops it all
            rd.agent_state(0).unlink()
            b = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", otlp_metrics=False)
            b.cycle()
            h.head.store.flush_all()
            assert stored(store, "r1") == [(0, s) for s in range(45)]
            assert h.head.stats["duplicates"] >= 45
        finally:
            h.close()
    finally:
        a.shipper.close()


def test_outbox_is_bounded_and_drops_are_counted(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{free_port()}", TOKEN, sim_gpu="off", ship_timeout=0.2,
                  outbox_bytes=3000, otlp_metrics=False)
    try:
        for i in range(6):
            write_steps(rd, 0, 0, range(i * 10, i * 10 + 10))
            a.cycle()
        assert a.outbox.bytes() <= 3000
        assert a.outbox.dropped_records > 0
        assert a.outbox.records() + a.outbox.dropped_records == 60
        text = a.metrics.registry.get_sample_value("ranksight_agent_dropped_records_total", {"node": "0"})
        assert text == a.outbox.dropped_records
    finally:
        a.shipper.close()


def test_garbage_spool_lines_become_a_recorded_gap(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    port = free_port()
    h = HeadThread(store, port)
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", otlp_metrics=False)
    try:
        write_steps(rd, 0, 0, range(0, 5), extra=b"this is {not json\n\x00\x01\x02\n")
        write_steps(rd, 0, 0, range(5, 10))
        a.cycle()
        a.cycle()  # re-reading nothing new must not duplicate the gap
        h.head.store.flush_all()
        assert stored(store, "r1") == [(0, s) for s in range(10)]
        ev = read_table(store, "r1", "events")
        gaps = ev[ev["event"] == "spool_gap"]
        assert len(gaps) == 1 and int(gaps.iloc[0]["step"]) == 4 and '"lines":2' in gaps.iloc[0]["detail"]
        assert a.metrics.registry.get_sample_value("ranksight_agent_spool_garbage_lines_total",
                                                   {"node": "0", "rank": "0"}) == 2
        # the same gap re-read by a restarted agent (state lost) is deduplicated by the head
        rd.agent_state(0).unlink()
        b = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", otlp_metrics=False)
        b.cycle()
        h.head.store.flush_all()
        ev = read_table(store, "r1", "events")
        assert (ev["event"] == "spool_gap").sum() == 1
    finally:
        a.shipper.close()
        h.close()


def test_action_flow_head_to_agent_to_trainer_files_and_back(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    port = free_port()
    h = HeadThread(store, port)
    fr = FakeRanks(store, "r1", {0: [0, 1]}, steps=3)
    fr.start()
    fr.join()
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", metrics_port=0, otlp_metrics=False)
    try:
        a.start_server()
        # the control endpoint refuses requests without the shared token
        body = schema.encode(schema.ControlRequest(id="x1", action="checkpoint", t=1.0))
        assert http_status(a.url + "/control", body) == 401
        assert http_status(a.url + "/control", body, {"Authorization": "Bearer wrong"}) == 403
        assert http_status(a.url + "/control", b'{"id":"../../etc","action":"checkpoint","t":1}',
                           {"Authorization": f"Bearer {TOKEN}"}) == 400
        assert not rd.control_requests.exists() or not list(rd.control_requests.iterdir())
        a.cycle()  # heartbeat tells the head where the agent listens
        head_url = f"http://127.0.0.1:{port}"
        st, act = http_json(head_url + "/api/runs/r1/actions", {"action": "profile", "steps": 3, "reason": "test"},
                            token=TOKEN)
        assert st == 202 and act["status"] == "requested"
        req_file = rd.control_requests / f"{act['id']}.json"
        creq = msgspec.json.decode(req_file.read_bytes(), type=schema.ControlRequest)
        assert creq.action == "profile" and creq.steps == 3
        # the trainer acknowledges; the agent ships the ack; the action's status follows
        atomic_write(rd.control_acks / f"{act['id']}.json",
                     schema.encode(schema.ControlAck(id=act["id"], action="profile", applied_step=2, t=5.0)))
        a.cycle()
        acts = http_json(head_url + "/api/runs/r1/actions")[1]
        assert [(x["id"], x["status"], x["applied_step"]) for x in acts] == [(act["id"], "applied", 2)]
        h.head.store.flush_all()
        df = read_table(store, "r1", "actions")
        assert sorted(df["status"]) == ["applied", "requested"]
        # a restarted head knows the action's latest status from the store
        h2 = Head(store, TOKEN, analyzer=None)
        assert [(x["status"], x["applied_step"]) for x in h2.actions.current("r1")] == [("applied", 2)]
        h2.close()
        # an evict without a node is refused with a 400
        assert http_status(head_url + "/api/runs/r1/actions", b'{"action":"evict"}',
                           {"Authorization": f"Bearer {TOKEN}"}) == 400
        # metrics endpoint: Prometheus text with the node's step histogram (one per node, not per rank)
        text = urllib.request.urlopen(a.url + "/metrics").read().decode()
        assert 'ranksight_step_duration_seconds_bucket{le="0.01",node="0",run_id="r1"}' in text
        assert "ranksight_agent_records_shipped_total" in text
    finally:
        a.server.shutdown()
        a.shipper.close()
        h.close()


def test_unreadable_state_file_means_reread_not_crash(tmp_path):
    rd = RunDir(tmp_path, "r1")
    atomic_write(rd.agent_state(0), b"{garbage")
    st = load_state(rd.agent_state(0), 0)
    assert st.positions == {} and st.node == 0
    atomic_write(rd.agent_state(0), b'{"node": 5}')
    assert load_state(rd.agent_state(0), 0).node == 0


def test_nccl_logs_traces_and_dcgm_flow_into_the_store(tmp_path):
    import os
    import shutil
    import socket
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures"
    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    write_steps(rd, 3, 0, range(3))  # the fixture trace is rank 3's (its distributedInfo says so)
    rd.nccl_dir.mkdir(parents=True)
    shutil.copy(fixtures / "nccl" / "v27_ib.log", rd.nccl_dir / f"{socket.gethostname()}.4242.log")
    shutil.copy(fixtures / "nccl" / "v27_ib.log", rd.nccl_dir / "some-other-host.99.log")  # not this node's
    rd.traces_dir.mkdir(parents=True)
    trace = rd.traces_dir / "rank-3.step1-2.json"
    shutil.copy(fixtures / "traces" / "hand_cpu.json", trace)
    old = time.time() - 60
    os.utime(trace, (old, old))
    prom_text = (fixtures / "dcgm" / "scrape1.prom").read_bytes()

    class Dcgm(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(prom_text)))
            self.end_headers()
            self.wfile.write(prom_text)

        def log_message(self, *a):
            pass

    dcgm = ThreadingHTTPServer(("127.0.0.1", 0), Dcgm)
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    port = free_port()
    h = HeadThread(store, port)
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, otlp_metrics=False,
                  dcgm_url=f"http://127.0.0.1:{dcgm.server_address[1]}/metrics")
    try:
        a.samples.build_probes()
        a.samples.sample_once()
        a.cycle()
        # the trace is summarized on the agent's worker thread: a later cycle ships it
        wait_for(lambda: (a.cycle(), h.head.store.flush_all(),
                          len(read_table(store, "r1", "trace_summaries")))[-1] == 1, 30, 0.2, what="the trace summary")
        h.head.store.flush_all()
        nccl = read_table(store, "r1", "nccl_events")
        assert len(nccl) > 0 and set(nccl["source_file"]) == {f"{socket.gethostname()}.4242.log"}
        assert "version" in set(nccl["category"])
        ts = read_table(store, "r1", "trace_summaries")
        assert list(ts["rank"]) == [3] and list(ts["trace_file"]) == [str(trace)]
        gpu = read_table(store, "r1", "gpu")
        assert len(gpu) > 0 and set(gpu["source"]) == {"dcgm"} and not gpu["simulated"].any()
        # a restarted agent that lost its state re-reads the log and the trace: nothing doubles
        n_nccl = len(nccl)
        rd.agent_state(0).unlink()
        b = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", otlp_metrics=False)
        b.cycle()
        h.head.store.flush_all()
        assert len(read_table(store, "r1", "nccl_events")) == n_nccl
        assert len(read_table(store, "r1", "trace_summaries")) == 1
    finally:
        a.shipper.close()
        dcgm.shutdown()
        h.close()


def test_head_down_at_the_end_the_agent_retries_reports_and_drains_later(tmp_path):
    """Issue 16 item 4: the head is away when training ends. The agent keeps trying for its drain timeout, writes
    what it left undelivered to its exit report, and `ranksight agent --drain` delivers it later, exactly once."""
    import json
    import subprocess
    import sys
    import time

    store = tmp_path / "store"
    rd = RunDir(store, "r1")
    port = free_port()
    write_steps(rd, 0, 0, range(0, 120))
    a = NodeAgent(rd, 0, f"http://127.0.0.1:{port}", TOKEN, sim_gpu="off", ship_timeout=0.3, otlp_metrics=False)
    t0 = time.monotonic()
    report = a.close(drain_timeout_s=1.5)
    assert 1.5 <= time.monotonic() - t0 < 15
    assert report.undelivered_records == 120 and report.drain_s >= 1.5
    on_disk = json.loads(rd.agent_exit_report(0).read_bytes())
    assert on_disk["undelivered_records"] == 120 and on_disk["outbox"].endswith("node-0.outbox")
    # nothing to deliver to: --drain says so and exits 1
    cmd = [sys.executable, "-m", "cli.main", "agent", "--drain", "--drain-timeout", "0", "--store", str(store),
           "--run-id", "r1", "--node", "0", "--head", f"http://127.0.0.1:{port}", "--token", TOKEN]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "delivered 0 of 120 record(s); 120 left" in r.stdout, r.stdout + r.stderr
    h = HeadThread(store, port)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "delivered 120 of 120 record(s); 0 left" in r.stdout, r.stdout + r.stderr
        h.head.store.flush_all()
        assert stored(store, "r1") == [(0, s) for s in range(120)]
    finally:
        h.close()
