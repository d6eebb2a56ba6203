"""Prometheus series of a 16,384-rank job, counted from the node exporter's own output, against the old exporter.

Each node agent exports its own ranks and GPUs; a job's series are the sum over its node exporters. This feeds
every node exporter of the job (default 2,048 nodes x 8 ranks, 8 GPUs per node) what it would see: a few steps per
rank (step records with loss, tokens, FLOPs, memory), one sample per GPU, the manifest's placements, host samples.
It counts the sample lines of each exporter's exposition (each line is one series in Prometheus) and sums them.

Baseline, in the same run: the exporter before the bounded-cardinality change (``git show f5424f3:node/prom.py``),
fed the same records (it exports a 77-bucket step histogram and a dozen gauges per rank).

Two GPU modes: the agent reading NVML (it exports the GPU gauges under dcgm-exporter's names, there is no
dcgm-exporter) and the agent reading a dcgm-exporter (``--dcgm-url``: the new exporter exports no GPU gauge, only the
rank-to-GPU join; the old one re-exported every gauge it read, duplicating dcgm-exporter's series).

    python bench/prom_series.py [--nodes 2048] [--ranks-per-node 8] [--simulate-nodes 4]

All nodes of the synthetic job are alike, so by default 4 node exporters are built and checked to give the same
count, and the job's total is that count times the nodes (``--simulate-nodes 0`` builds every node exporter).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

from prometheus_client.exposition import generate_latest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.prom import AgentMetrics  # noqa: E402
from ranksight import schema  # noqa: E402

BASELINE_COMMIT = "f5424f3"


def old_exporter_class():
    """``AgentMetrics`` as it was at ``BASELINE_COMMIT``, loaded from git into its own module."""
    src = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:node/prom.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType("old_node_prom")
    exec(compile(src, f"{BASELINE_COMMIT}:node/prom.py", "exec"), mod.__dict__)
    return mod.AgentMetrics


def series_count(registry) -> int:
    return sum(1 for line in generate_latest(registry).decode().splitlines() if line and not line.startswith("#"))


def feed_node(metrics, node: int, ranks_per_node: int, gpu_source: str, steps: int = 4) -> None:
    run_id = "scale16k"
    host = f"node{node:05d}"
    placements = [schema.RankPlacement(rank=node * ranks_per_node + lr, node=node, host=host, local_rank=lr,
                                       pp_stage=0, dp_rank=node * ranks_per_node + lr, tp_rank=0, gpu=lr)
                  for lr in range(ranks_per_node)]
    manifest = schema.Manifest(run_id=run_id, created=0.0, start_time=0.0, nodes=1, ranks=placements)
    metrics.observe_manifest(run_id, manifest)
    for p in placements:
        recs = [schema.StepRecord(run_id=run_id, rank=p.rank, step=s, node=node, host=host, world_size=16384,
                                  t_start=float(s), t_end=s + 0.9, step_ms=900.0 + 37 * s + p.local_rank,
                                  compute_ms=600.0, comm_ms=250.0, data_ms=10.0, pipeline_wait_ms=5.0, tokens=8192,
                                  flops=1e15, loss=2.5 - 0.01 * s, grad_norm=1.0, loss_scale=65536.0,
                                  mem_bytes=70 << 30) for s in range(steps)]
        metrics.observe_steps(recs)
    for g in range(ranks_per_node):
        s = schema.GpuSample(node=node, host=host, gpu=g, t=1.0, source=gpu_source, simulated=False, name="NVIDIA H100",
                             uuid=f"GPU-{node:08x}-{g:04x}", util_pct=97.0, mem_util_pct=40.0, mem_used_bytes=70 << 30,
                             mem_total_bytes=80 << 30, power_w=650.0, temp_c=70.0, sm_clock_mhz=1980.0,
                             mem_clock_mhz=2619.0, throttle_reasons=0, ecc_sbe=0, ecc_dbe=0)
        metrics.observe_gpu(s, 0)
    metrics.observe_host(schema.HostSample(node=node, host=host, t=1.0, cpu_pct=30.0, load1=4.0, mem_used_bytes=1 << 30,
                                           mem_total_bytes=2 << 30, net_rx_bytes=1, net_tx_bytes=1,
                                           disk_read_bytes=0, disk_write_bytes=0))


def job_series(cls, nodes: int, ranks_per_node: int, gpu_source: str, simulate: int) -> tuple[int, list[int]]:
    built = nodes if simulate <= 0 else min(simulate, nodes)
    counts = []
    for node in range(built):
        m = cls()
        feed_node(m, node, ranks_per_node, gpu_source)
        counts.append(series_count(m.registry))
    if built == nodes:
        return sum(counts), counts
    if len(set(counts)) != 1:
        raise SystemExit(f"node exporters differ ({counts}): run with --simulate-nodes 0")
    return counts[0] * nodes, counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--simulate-nodes", type=int, default=4)
    a = ap.parse_args(argv)
    ranks = a.nodes * a.ranks_per_node
    old_cls = old_exporter_class()
    print(f"Prometheus series of a {ranks:,}-rank job ({a.nodes:,} nodes x {a.ranks_per_node} ranks, "
          f"{a.ranks_per_node} GPUs per node), from each node exporter's /metrics")
    print(f"{'GPU source':<22} {'old exporter':>14} {'new exporter':>14} {'ratio':>8}   per node old/new")
    for label, source in (("NVML (agent exports)", "nvml"), ("dcgm-exporter", "dcgm")):
        old, old_nodes = job_series(old_cls, a.nodes, a.ranks_per_node, source, a.simulate_nodes)
        new, new_nodes = job_series(AgentMetrics, a.nodes, a.ranks_per_node, source, a.simulate_nodes)
        print(f"{label:<22} {old:>14,} {new:>14,} {old / new:>7.1f}x   {old_nodes[0]} / {new_nodes[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
