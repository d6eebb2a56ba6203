"""The node exporter's series stay bounded: per rank only a few gauges, the step-time histogram per node with
exemplars naming the rank, and with a dcgm-exporter as the GPU source no copy of its gauges, only the rank join."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from node.prom import AgentMetrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import prom_series  # noqa: E402


def _node_series(ranks_per_node: int, source: str = "nvml") -> tuple[int, str]:
    m = AgentMetrics()
    prom_series.feed_node(m, 0, ranks_per_node, source)
    return prom_series.series_count(m.registry), generate_latest(m.registry).decode()


def test_step_histogram_is_per_node_and_a_rank_costs_a_few_series():
    n8, text = _node_series(8)
    n16, _ = _node_series(16)
    # a rank adds its 4 gauges, its GPU's gauges and its join series; never a histogram
    per_rank_and_gpu = (n16 - n8) / 8
    n16_dcgm, _ = _node_series(16, "dcgm")
    n8_dcgm, _ = _node_series(8, "dcgm")
    assert (n16_dcgm - n8_dcgm) / 8 == 5, (n8_dcgm, n16_dcgm)  # 4 per-rank gauges + 1 join series
    assert per_rank_and_gpu < 20
    bucket_lines = [ln for ln in text.splitlines() if ln.startswith("ranksight_step_duration_seconds_bucket")]
    assert len(bucket_lines) == 77 and all('rank="' not in ln for ln in bucket_lines)
    assert 'ranksight_step_compute_seconds{node="0",rank="7",run_id="scale16k"}' in text
    assert 'ranksight_steps_total{node="0",run_id="scale16k"} 32.0' in text


def test_exemplars_link_a_bucket_to_its_rank():
    m = AgentMetrics()
    prom_series.feed_node(m, 0, 8, "nvml")
    om = generate_openmetrics(m.registry).decode()
    ex = [ln for ln in om.splitlines() if ln.startswith("ranksight_step_duration_seconds_bucket") and " # {" in ln]
    assert ex, om[:2000]
    # the records' step times are 900 + 37 s + local rank ms: step 3 of rank 7 is 1.018 s, alone in its bucket
    assert any('rank="7",step="3"' in ln for ln in ex), ex


def test_with_dcgm_exporter_as_source_no_dcgm_series_only_the_join():
    _, text = _node_series(8, "dcgm")
    assert not [ln for ln in text.splitlines() if ln.startswith("DCGM_")]
    info = [ln for ln in text.splitlines() if ln.startswith("ranksight_rank_gpu_info{")]
    assert len(info) == 8
    assert 'ranksight_rank_gpu_info{Hostname="node00000",UUID="GPU-00000000-0003",gpu="3",node="0",rank="3",' \
           'run_id="scale16k"} 1.0' in text
    _, nvml = _node_series(8, "nvml")
    assert nvml.count("DCGM_FI_DEV_GPU_UTIL{") == 8 and nvml.count("ranksight_rank_gpu_info{") == 8


def test_join_series_follow_the_manifest_and_skip_gpus_without_a_rank():
    from ranksight import schema

    m = AgentMetrics()
    pl = [schema.RankPlacement(rank=r, node=r // 2, host="h", local_rank=r % 2, pp_stage=0, dp_rank=r, tp_rank=0)
          for r in range(4)]
    m.observe_manifest("r", schema.Manifest(run_id="r", created=0, start_time=0, ranks=pl))
    for g in range(3):  # GPU 2 runs no rank
        m.observe_gpu(schema.GpuSample(node=1, host="h", gpu=g, t=0, source="dcgm", simulated=False, uuid=f"U{g}"))
    text = generate_latest(m.registry).decode()
    got = sorted(ln.split("rank=")[1][:3] for ln in text.splitlines() if ln.startswith("ranksight_rank_gpu_info{"))
    assert got == ['"2"', '"3"']
    # an elastic restart moves the ranks: no stale series remains
    m.observe_manifest("r", schema.Manifest(run_id="r", created=0, start_time=0, ranks=pl[:3]))
    text = generate_latest(m.registry).decode()
    assert text.count("ranksight_rank_gpu_info{") == 1


def test_bench_figure_for_16384_ranks_is_bounded(capsys):
    old, _ = prom_series.job_series(prom_series.old_exporter_class(), 2048, 8, "dcgm", 2)
    new, per_node = prom_series.job_series(AgentMetrics, 2048, 8, "dcgm", 2)
    assert old > 1_000_000  # the per-rank histograms of the old exporter
    assert new < 300_000 and new == per_node[0] * 2048
    assert prom_series.main(["--nodes", "16", "--simulate-nodes", "2"]) == 0
    assert "dcgm-exporter" in capsys.readouterr().out
