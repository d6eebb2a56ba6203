"""A real Prometheus scrapes a node agent: dcgm-exporter names and labels for (simulated) GPUs, XIDs counted,
self-metrics, and the step histogram's median.

The real-training version of the median check (a multi-process torch run) is in
tests/test_agent_e2e_training.py; this one drives the agent with a steady fake rank writer so
the GPU state (throttle, XID) can be set exactly.
"""

import statistics
import time

from agent_helpers import Procs, Prometheus, FakeRanks, head_ready, http_json, stored_steps, wait_for
from conftest import free_port
from ranksight.simgpu import THROTTLE_HW_THERMAL, SimGpuState, write_state
from ranksight.layout import RunDir


def test_prometheus_scrapes_dcgm_names_xids_self_metrics_and_step_histogram(tmp_path):
    store = tmp_path / "store"
    rd = RunDir(store, "p1")
    procs = Procs(tmp_path / "logs")
    hp, mp = free_port(), free_port()
    prom = Prometheus(tmp_path / "prom", [f"127.0.0.1:{mp}"], procs, free_port(),
                      flags=("--enable-feature=exemplar-storage",))
    node_dir = rd.simgpu_node_dir(0)
    write_state(node_dir, 0, SimGpuState(util_gpu=91, throttle_reasons=THROTTLE_HW_THERMAL, temp_c=92))
    write_state(node_dir, 1, SimGpuState(util_gpu=88, uuid="GPU-00000000-sim0-0000-0000-000000000001"))
    fr = FakeRanks(store, "p1", {0: [0, 1]}, step_s=0.1, steps=70, jitter=0.8)
    try:
        prom.start()
        procs.head(store, hp)
        procs.agent(store, "p1", 0, hp, mp, extra=["--gpu-interval", "0.5"])
        wait_for(lambda: head_ready(hp), 30, what="head")
        prom.wait_up(1, timeout=40)
        fr.start()
        # an XID on GPU 1 while the job runs
        write_state(node_dir, 1, SimGpuState(util_gpu=88, uuid="GPU-00000000-sim0-0000-0000-000000000001",
                                             xids=[(79, int(time.time() * 1000))]))
        fr.join(60)
        want = 2 * 70
        wait_for(lambda: len(stored_steps(store, "p1")) == want, 30, 0.5, "all steps stored")
        wait_for(lambda: prom.query("ranksight_steps_total") and
                 sum(float(r["value"][1]) for r in prom.query("ranksight_steps_total")) == want, 20, 0.5,
                 "Prometheus saw every step")

        thr = prom.query('DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0"}')
        assert len(thr) == 1 and float(thr[0]["value"][1]) == THROTTLE_HW_THERMAL
        lab = thr[0]["metric"]
        assert lab["simulated"] == "true" and lab["UUID"].startswith("GPU-") and lab["modelName"] and lab["Hostname"]
        assert float(prom.query('DCGM_FI_DEV_GPU_TEMP{gpu="0"}')[0]["value"][1]) == 92
        assert float(prom.query('DCGM_FI_DEV_GPU_UTIL{gpu="1"}')[0]["value"][1]) == 88
        xid = wait_for(lambda: prom.query('DCGM_FI_DEV_XID_ERRORS{gpu="1"} == 79'), 15, 0.5, "XID gauge")
        assert xid[0]["metric"]["simulated"] == "true"
        assert float(prom.query('sum(ranksight_gpu_xid_events_total{gpu="1",code="79"})')[0]["value"][1]) == 1
        assert float(prom.query("sum(ranksight_agent_records_shipped_total)")[0]["value"][1]) >= want
        assert prom.query("ranksight_agent_lag_seconds") and prom.query("ranksight_agent_dropped_records_total")
        tokens = float(prom.query("sum(ranksight_tokens_total)")[0]["value"][1])
        assert tokens == want * 1024

        df = stored_steps(store, "p1")
        true_median = statistics.median(df["step_ms"] / 1000.0)
        res = prom.query("histogram_quantile(0.5, sum by (le) (increase(ranksight_step_duration_seconds_bucket[5m])))")
        got = float(res[0]["value"][1])
        assert abs(got - true_median) / true_median < 0.10, (got, true_median)
        # one histogram per node, not per rank; its buckets' exemplars name the rank and step (OpenMetrics scrape)
        assert {tuple(sorted(s["metric"])) for s in prom.query("ranksight_step_duration_seconds_count")} == \
            {("__name__", "instance", "job", "node", "run_id")}
        assert len(prom.query("ranksight_step_compute_seconds")) == 2  # the per-rank gauges: one per rank
        from urllib.parse import quote
        _, body = http_json(f"{prom.url}/api/v1/query_exemplars?query={quote('ranksight_step_duration_seconds_bucket')}"
                            f"&start={time.time() - 600}&end={time.time() + 60}")
        ex = [e for series in body["data"] for e in series["exemplars"]]
        assert ex and {e["labels"]["rank"] for e in ex} <= {"0", "1"}
        assert all(0 <= int(e["labels"]["step"]) < 70 for e in ex)
    finally:
        fr.stop()
        procs.stop_all()
