"""The live window's GPU samples are bounded per GPU, not globally: at 16,384 GPUs sampled once a second every GPU
keeps its recent samples, and the live gpu_health check finds one throttled GPU among them."""

import logging

import numpy as np
import pyarrow as pa

from analyzers.builder import build_frame
from analyzers.checks import gpu_health
from head import live as live_mod
from head.live import RunLive
from ranksight.simgpu import THROTTLE_HW_SLOWDOWN
from ranksight.tables import SPECS

NODES, GPUS = 2048, 8  # 16,384 GPUs
GPU_SAMPLES_PER_GPU = getattr(live_mod, "GPU_SAMPLES_PER_GPU", 60)


def fleet_second(t: float, nodes: int = NODES, throttled=(2000, 3)) -> pa.Table:
    """One sample of every GPU of the fleet at time ``t`` (the store's schema), built column by column."""
    n = nodes * GPUS
    node = np.repeat(np.arange(nodes, dtype=np.int64), GPUS)
    gpu = np.tile(np.arange(GPUS, dtype=np.int64), nodes)
    bad = (node == throttled[0]) & (gpu == throttled[1])
    cols = {
        "run_id": pa.array(["r1"] * n), "node": node, "host": pa.array([f"node{i}" for i in node]), "gpu": gpu,
        "t": np.full(n, t), "source": pa.array(["nvml"] * n), "simulated": np.zeros(n, bool),
        "name": pa.array(["NVIDIA H100 80GB HBM3"] * n), "uuid": pa.array([f"GPU-{i}" for i in range(n)]),
        "util_pct": np.full(n, 97.0), "mem_total_bytes": np.full(n, 80 << 30, np.int64),
        "sm_clock_mhz": np.where(bad, 1100.0, 1980.0), "max_sm_clock_mhz": np.full(n, 1980.0),
        "throttle_reasons": np.where(bad, THROTTLE_HW_SLOWDOWN, 0).astype(np.int64), "temp_c": np.full(n, 60.0),
        "throttle_names": pa.array([["hw_slowdown"] if b else [] for b in bad], pa.list_(pa.string())),
    }
    schema = SPECS["gpu"].schema
    zero = {pa.int64(): np.zeros(n, np.int64), pa.string(): pa.array([""] * n)}  # fields an agent always sends
    return pa.table([pa.array(cols[f.name], f.type) if f.name in cols else zero.get(f.type, pa.nulls(n, f.type))
                     for f in schema], schema=schema)


def test_16384_gpus_keep_their_window_and_a_throttled_gpu_is_found_live():
    live = RunLive("r1")
    seconds = 8
    for s in range(seconds):
        # an agent batch per 256 nodes, as they arrive
        t = fleet_second(1000.0 + s)
        for k in range(0, t.num_rows, 256 * GPUS):
            live.add_arrow("gpu", t.slice(k, 256 * GPUS), now=2000.0 + s)
    data = live.run_data(now=1010.0)
    per_gpu = np.bincount(data.gpu["node"].to_numpy() * GPUS + data.gpu["gpu"].to_numpy(), minlength=NODES * GPUS)
    assert per_gpu.min() >= min(seconds, GPU_SAMPLES_PER_GPU) and len(data.gpu) == NODES * GPUS * seconds
    found = [f for f in gpu_health.analyze(build_frame(data)) if f.evidence.get("cause") == "throttle"]
    assert [(f.evidence["node"], f.evidence["gpu"]) for f in found] == [(2000, 3)]
    assert live.gpu_rows_cut == 0


def test_each_gpu_keeps_its_last_samples_only():
    live = RunLive("r1")
    for s in range(GPU_SAMPLES_PER_GPU + 40):
        live.add_arrow("gpu", fleet_second(1000.0 + s, nodes=64), now=2000.0 + s)
    g = live.gpu_table()
    assert g.num_rows == 64 * GPUS * GPU_SAMPLES_PER_GPU
    assert g.column("t").to_numpy().min() == 1000.0 + 40
    assert live._gpu_arrow_rows <= 64 * GPUS * (GPU_SAMPLES_PER_GPU + 1)  # older batches dropped, not just hidden


def test_a_small_fleet_keeps_at_least_what_the_global_bound_kept():
    live = RunLive("r1")
    for s in range(400):  # 16 GPUs: 7,680 samples are 480 s of them
        live.add_arrow("gpu", fleet_second(1000.0 + s, nodes=2, throttled=(1, 1)), now=2000.0 + s)
    assert live.gpu_table().num_rows == 16 * 400


def test_the_memory_cap_cuts_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(live_mod, "MAX_GPU_ROWS", 10 * 64 * GPUS)  # room for 10 samples per GPU of 64 nodes
    live = RunLive("r1")
    with caplog.at_level(logging.WARNING, logger="ranksight.live"):
        for s in range(30):
            live.add_arrow("gpu", fleet_second(1000.0 + s, nodes=64, throttled=(7, 1)), now=2000.0 + s)
    assert live._gpu_arrow_rows <= 11 * 64 * GPUS
    assert live.gpu_rows_cut == (30 - 10) * 64 * GPUS
    assert any("gpu_rows_cut" in r.getMessage() for r in caplog.records)
    (f,) = [f for f in gpu_health.analyze(build_frame(live.run_data(now=1030.0))) if f.evidence.get("cause") == "throttle"]
    assert (f.evidence["node"], f.evidence["gpu"]) == (7, 1)


def test_the_gpus_api_shows_every_gpu_of_a_16384_gpu_fleet():
    from head.api import gpu_states

    live = RunLive("r1")
    for s in range(3):
        t = fleet_second(1000.0 + s)
        for k in range(0, t.num_rows, 256 * GPUS):
            live.add_arrow("gpu", t.slice(k, 256 * GPUS), now=2000.0 + s)
    out = gpu_states(live, now=1003.0)
    assert len(out) == NODES * GPUS and {g["t"] for g in out} == {1002.0}
    (bad,) = [g for g in out if g["throttled"]]
    assert (bad["node"], bad["gpu"]) == (2000, 3)


def test_a_null_where_a_sample_has_a_default_does_not_blank_the_gpu_views(caplog):
    """A sender that leaves throttle_names (a list with a default) null: the views show the samples with the
    default, instead of logging "not shown" and returning none; a row that cannot be a sample is left out alone."""
    t = fleet_second(100.0, nodes=2)
    t = t.set_column(t.schema.get_field_index("throttle_names"), "throttle_names",
                     pa.nulls(t.num_rows, pa.list_(pa.string())))
    live = RunLive("r1")
    live.add_arrow("gpu", t)
    latest = live.gpu_latest()
    assert len(latest) == 2 * GPUS and all(g.throttle_names == [] for g in latest)
    assert len(live.gpu) == 2 * GPUS
    bad = fleet_second(101.0, nodes=1)
    bad = bad.set_column(bad.schema.get_field_index("node"), "node", pa.array([None] + [0] * (GPUS - 1), pa.int64()))
    with caplog.at_level(logging.ERROR):
        live.add_arrow("gpu", bad)
        assert len(live.gpu) == 2 * GPUS + GPUS - 1  # the row without a node is the only one left out
    assert "1 gpu row(s) not shown live" in caplog.text
