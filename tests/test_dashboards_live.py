"""Dashboards and alerts against real servers: the ranksight node agent (+ head) exporting real
metrics, a real Prometheus scraping it and evaluating ranksight.rules.yml, a real Alertmanager
routing by severity to the reference webhook receiver.

- every PromQL expression of every dashboard panel (macros and variables replaced) is
  evaluated by Prometheus: status success, and data where the setup produces it;
- an XID injected into the node's simulated GPU fires RanksightGpuXid through the real
  chain (agent -> Prometheus rule -> Alertmanager critical route -> receiver), and the
  low SM clock of the other (busy) GPU fires RanksightGpuClockThrottled through the warning route.

One stack for the module; every process is killed (by pid) at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from dashboards.build import build_all
from dashboards.cli import ALERTMANAGER_EXAMPLE, RULES_FILE
from dashboards.lint import check_promql, panel_queries, promql_for_prometheus
from dashboards.webhook_receiver import WebhookReceiver
from ranksight import schema
from ranksight.layout import RunDir, atomic_write
from ranksight.simgpu import SimGpuState, THROTTLE_HW_THERMAL, THROTTLE_SW_THERMAL, write_state
from conftest import free_port

REPO = Path(__file__).resolve().parent.parent
RUN_ID = "dash-live"
TOKEN = "dash-live-token"
AM_TOKEN = "am-bearer-token"
RANKS = 4
SLOW_RANK = 3

pytestmark = pytest.mark.skipif(not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
                                reason="needs prometheus and prometheus-alertmanager (make debs)")


def _wait(pred, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001 - servers not up yet
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _query(prom: str, expr: str):
    return _get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]


class _Ranks(threading.Thread):
    """Spool writers for RANKS ranks on node 0 (the trainer's file interface); rank 3 computes 1.3x longer."""

    def __init__(self, rd: RunDir):
        super().__init__(daemon=True)
        self.rd = rd
        self.stop_ev = threading.Event()

    def run(self) -> None:
        files = {r: open(self.rd.spool(r), "ab") for r in range(RANKS)}
        step = 0
        try:
            while not self.stop_ev.is_set():
                t0 = time.time()
                for r in range(RANKS):
                    compute = 0.040 * (1.3 if r == SLOW_RANK else 1.0)
                    rec = schema.StepRecord(run_id=RUN_ID, rank=r, step=step, node=0, host="node0", world_size=RANKS,
                                            t_start=t0, t_end=t0 + 0.06, step_ms=60.0, compute_ms=compute * 1000,
                                            comm_ms=60.0 - compute * 1000, tokens=2048, loss=3.0 - step * 0.001)
                    files[r].write(schema.encode(rec) + b"\n")
                    files[r].flush()
                step += 1
                self.stop_ev.wait(0.06)
        finally:
            for f in files.values():
                f.close()


class Stack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.receiver: WebhookReceiver | None = None
        self.ranks: _Ranks | None = None
        self.xid_injected = False  # _inject_xid

    def start(self, name: str, args: list[str]) -> None:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(log, "wb") as f:
            self.procs[name] = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=self.tmp, env=env,
                                                start_new_session=True)

    def stop(self) -> None:
        if self.ranks is not None:
            self.ranks.stop_ev.set()
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=10)
                except ProcessLookupError:
                    pass
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver.server_close()

    def tail_logs(self) -> str:
        return "\n".join(f"===== {n}\n{p.read_text(errors='replace')[-2500:]}" for n, p in self.logs.items() if p.exists())


def _am_config(receiver_port: int, token_file: Path) -> str:
    """The shipped example, pointed at the test receiver and with zero waits (routing left as is)."""
    text = ALERTMANAGER_EXAMPLE.read_text()
    text = text.replace("http://127.0.0.1:9095", f"http://127.0.0.1:{receiver_port}")
    text = text.replace("/etc/ranksight/alertmanager-webhook.token", str(token_file))
    text = re.sub(r"group_wait: \d+s", "group_wait: 0s", text)
    text = re.sub(r"group_interval: \d+m", "group_interval: 1s", text)
    assert str(token_file) in text and "group_wait: 0s" in text
    return text


def _fast_rules() -> str:
    """The shipped rules with every `for:` set to 0s, so a test sees them fire within seconds."""
    text, n = re.subn(r"^(\s+)for: \d+[sm]$", r"\1for: 0s", RULES_FILE.read_text(), flags=re.M)
    assert n >= 7, n
    return text


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash-live")
    st = Stack(tmp)
    try:
        store = tmp / "runs"
        rd = RunDir(store, RUN_ID)
        rd.spool_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        manifest = schema.Manifest(run_id=RUN_ID, created=now, start_time=now, nodes=1,
                                   layout={"dp": RANKS, "tp": 1, "pp": 1, "world": RANKS},
                                   ranks=[schema.RankPlacement(rank=r, node=0, host="node0", local_rank=r, pp_stage=0,
                                                               dp_rank=r, tp_rank=0) for r in range(RANKS)])
        atomic_write(rd.manifest, schema.encode(manifest))
        simdir = rd.simgpu_node_dir(0)
        write_state(simdir, 0, SimGpuState(uuid="GPU-sim-0", util_gpu=97, temp_c=92, sm_clock_mhz=1100,
                                           power_mw=690_000, throttle_reasons=THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL))
        write_state(simdir, 1, SimGpuState(uuid="GPU-sim-1", util_gpu=95, temp_c=60, power_mw=500_000))
        st.ranks = _Ranks(rd)
        st.ranks.start()

        head_port, agent_port, prom_port, am_port = free_port(), free_port(), free_port(), free_port()
        st.receiver = WebhookReceiver(0, "unused-secret", bearer_token=AM_TOKEN, echo=False)
        threading.Thread(target=st.receiver.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

        # Alertmanager first, so Prometheus' first alert is not held back by the resend delay.
        token_file = tmp / "am.token"
        token_file.write_text(AM_TOKEN)
        (tmp / "alertmanager.yml").write_text(_am_config(st.receiver.server_address[1], token_file))
        st.start("alertmanager", ["prometheus-alertmanager", f"--config.file={tmp / 'alertmanager.yml'}",
                                  f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                                  "--cluster.listen-address=", "--log.level=warn"])
        st.start("head", [sys.executable, "-m", "cli.main", "head", "--store", str(store), "--port", str(head_port),
                          "--token", TOKEN, "--analyze-interval", "30"])
        st.start("agent", [sys.executable, "-m", "cli.main", "agent", "--store", str(store), "--run-id", RUN_ID,
                           "--node", "0", "--head", f"http://127.0.0.1:{head_port}", "--token", TOKEN,
                           "--metrics-port", str(agent_port), "--sim-gpu", "on", "--gpu-interval", "0.5",
                           "--ship-interval", "0.5", "--host", "node0"])
        (tmp / "rules.yml").write_text(_fast_rules())
        # YAML is a superset of JSON: the Prometheus config is written as JSON.
        (tmp / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "ranksight-agent",
                                "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
        }))
        st.start("prometheus", ["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                                "--web.enable-lifecycle", "--rules.alert.resend-delay=1s", "--log.level=warn"])
        st.prom = f"http://127.0.0.1:{prom_port}"
        st.am = f"http://127.0.0.1:{am_port}"
        st.rd = rd
        _wait(lambda: _query(st.prom, 'up{job="ranksight-agent"} == 1'), 25, "Prometheus scraping the agent (up == 1)")
        # Both simulated GPUs exported with XID 0, and steps flowing for every rank.
        _wait(lambda: len(_query(st.prom, 'DCGM_FI_DEV_XID_ERRORS{simulated="true"} == 0')) == 2, 15,
              "both simulated GPUs scraped with XID 0")
        _wait(lambda: len(_query(st.prom, "ranksight_last_step")) == RANKS and
              _query(st.prom, "rate(ranksight_steps_total[5s]) > 0"), 15, "steps from all ranks")
        yield st
    except Exception:
        print(st.tail_logs())
        raise
    finally:
        st.stop()


def _inject_xid(stack) -> None:
    """XID 79 on GPU 1 of node 0, the way the trainer's fault injection does it: in the state file. Once per stack,
    by whichever test needs it first (each test can run alone, e.g. under ``-k``)."""
    if stack.xid_injected:
        return
    write_state(stack.rd.simgpu_node_dir(0), 1, SimGpuState(uuid="GPU-sim-1", util_gpu=95, temp_c=60, power_mw=500_000,
                                                            xids=[(79, int(time.time() * 1000))]))
    stack.xid_injected = True


def test_alert_chain_delivers_xid_and_throttle_by_severity(stack):
    _inject_xid(stack)

    def alerts_named(name):
        out = []
        for d in stack.receiver.deliveries:
            for a in d["payload"].get("alerts", []):
                if a["labels"]["alertname"] == name and a["status"] == "firing":
                    out.append((d, a))
        return out

    try:
        _wait(lambda: alerts_named("RanksightGpuXid"), 25, "RanksightGpuXid at the webhook receiver")
        _wait(lambda: alerts_named("RanksightGpuClockThrottled"), 10, "RanksightGpuClockThrottled at the receiver")
    except AssertionError:
        print(stack.tail_logs())
        raise
    (d, a), *_ = alerts_named("RanksightGpuXid")
    assert d["auth"] == "bearer" and d["path"] == "/alertmanager/critical", d  # severity routing
    assert d["payload"]["receiver"] == "ranksight-critical" and d["payload"]["version"] == "4"
    assert a["labels"]["gpu"] == "1" and a["labels"]["simulated"] == "true" and a["labels"]["Hostname"] == "node0"
    assert a["labels"]["severity"] == "critical"
    assert a["annotations"]["summary"] == "XID 79 on GPU 1 of node0 [SIMULATED GPU]"
    assert "Ranks on it: 1 (run dash-live)." in a["annotations"]["description"]
    assert a["annotations"]["runbook_url"].endswith("#ranksightgpuxid")
    thermal = alerts_named("RanksightGpuClockThrottled")
    for d, a in thermal:
        assert d["path"] == "/alertmanager/warning" and d["payload"]["receiver"] == "ranksight-warning"
        assert a["labels"]["gpu"] == "0"
        assert "SM clock now 1100 MHz, temperature 92 C" in a["annotations"]["description"]
        # the ranks on GPU 0 (local ranks 0 of the manifest: gpu = local_rank), from ranksight_rank_gpu_info
        assert "Ranks on it: 0 (run dash-live)." in a["annotations"]["description"], a["annotations"]
    # GPU 1 is not throttled, GPU 0 had no XID
    assert all(a["labels"]["gpu"] == "0" for _, a in thermal)
    assert all(a["labels"]["gpu"] == "1" for _, a in alerts_named("RanksightGpuXid"))
    # The straggler rule (for: 0s here) sees rank 3's 1.3x compute from the agent's real gauges.
    strag = _wait(lambda: _query(stack.prom, 'ALERTS{alertname="RanksightStragglingRank", alertstate="firing"}'), 10,
                  "RanksightStragglingRank firing in Prometheus")
    assert [s["metric"]["rank"] for s in strag] == [str(SLOW_RANK)]
    assert stack.receiver.rejected == []


def test_every_dashboard_query_runs_on_real_prometheus(stack):
    # The XID counter gives panel B of "XID errors" data too.
    _inject_xid(stack)
    _wait(lambda: _query(stack.prom, "ranksight_gpu_xid_events_total"), 20, "the agent's XID counter")
    # Queries that legitimately return nothing in this setup (nothing was dropped, no export failed,
    # no real GPU): they must still parse and evaluate.
    may_be_empty = {("Dropped records and failed exports", "A"), ("Dropped records and failed exports", "B"),
                    ("GPUs reporting, by source", "B")}
    _wait(lambda: _query(stack.prom, "ranksight_rank_gpu_info"), 20, "the agent's rank-to-GPU join series")
    n = 0
    for uid, model in build_all().items():
        for title, ref, expr in panel_queries(model):
            q = promql_for_prometheus(expr)
            assert "$" not in q, q
            data = check_promql(stack.prom, q)
            n += 1
            if (title, ref) not in may_be_empty:
                assert data["result"], f"{uid} / {title} / {ref}: no data for {q}"
    assert n >= 22
    # Spot-check values: the p50 step time is about 60 ms on the node (one histogram for its ranks); rank 3 is the
    # straggler.
    p50 = {s["metric"]["node"]: float(s["value"][1]) for s in _query(stack.prom, promql_for_prometheus(
        'histogram_quantile(0.5, sum by (le, run_id, node) (rate(ranksight_step_duration_seconds_bucket[$__rate_interval])))'))}
    assert set(p50) == {"0"} and all(0.05 < v < 0.07 for v in p50.values()), p50
    # The join puts the simulated GPUs on the ranks placed on them (local ranks 0 and 1 of the manifest)
    per_rank = _query(stack.prom, promql_for_prometheus(
        next(e for t, r, e in panel_queries(build_all()["ranksight-job"]) if t == "GPU utilization per rank")))
    assert {(s["metric"]["rank"], s["metric"]["gpu"], float(s["value"][1])) for s in per_rank} == \
        {("0", "0", 97.0), ("1", "1", 95.0)}, per_rank
    ratio = {s["metric"]["rank"]: float(s["value"][1]) for s in _query(stack.prom, promql_for_prometheus(
        next(e for t, r, e in panel_queries(build_all()["ranksight-job"]) if t == "Compute time ÷ job median")))}
    assert ratio[str(SLOW_RANK)] == pytest.approx(1.3, rel=0.02), ratio
    assert max(v for r, v in ratio.items() if r != str(SLOW_RANK)) == pytest.approx(1.0, rel=0.02)
    # The simulated label is on every GPU series the agent exports.
    gpus = _query(stack.prom, "DCGM_FI_DEV_GPU_UTIL")
    assert gpus and all(s["metric"].get("simulated") == "true" for s in gpus)


def test_broken_promql_is_reported_by_prometheus(stack):
    from dashboards.lint import PromQLError

    with pytest.raises(PromQLError, match="HTTP 400"):
        check_promql(stack.prom, "sum(rate(ranksight_steps_total[1m])")


def test_cli_lint_against_prometheus(stack, tmp_path):
    import json as _json

    from typer.testing import CliRunner

    from dashboards.build import write_all
    from cli.main import main

    write_all(tmp_path)
    r = CliRunner().invoke(main, ["dashboards", "lint", "--dir", str(tmp_path), "--prometheus", stack.prom])
    assert r.exit_code == 0 and f"queries evaluated on {stack.prom}" in r.output, r.output
    m = _json.loads((tmp_path / "ranksight-job.json").read_text())
    m["panels"][1]["targets"][0]["expr"] = "rate(ranksight_steps_total[$__rate_interval]"
    (tmp_path / "ranksight-job.json").write_text(_json.dumps(m))
    r = CliRunner().invoke(main, ["dashboards", "lint", "--dir", str(tmp_path), "--prometheus", stack.prom])
    assert r.exit_code == 2 and "HTTP 400" in r.output and "Step time p50 / p95 per node / A" in r.output, r.output
