"""The live GPU window as the analyzers read it: each GPU's last samples converted column by column (the frame the
store's columnar reader gives diagnose), its strings kept once per distinct value rather than once per sample, and
the runs list answered from the window's Arrow batches without making records."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from analyzers import columnar
from analyzers.checks import gpu_health
from analyzers.loader import RunData
from head import live_frames
from head.live import RunLive
from ranksight import schema
from ranksight.simgpu import THROTTLE_HW_SLOWDOWN
from ranksight.tables import SPECS

GPUS = 8


def fleet_batch(t: float, nodes: int, rng, nulls: bool = False) -> pa.Table:
    """One sample of each of ``nodes`` x 8 GPUs at ``t`` (the store's schema), readings varying, uuids 40 characters
    long as NVML gives them; ``nulls``: some readings missing."""
    n = nodes * GPUS
    node = np.repeat(np.arange(nodes, dtype=np.int64), GPUS)
    gpu = np.tile(np.arange(GPUS, dtype=np.int64), nodes)
    clock = np.where((node == 1) & (gpu == 2), 1100.0, 1980.0)
    util = rng.uniform(80, 99, n).round(1)
    cols = {
        "run_id": pa.array(["r1"] * n), "node": node, "host": pa.array([f"node-{i:04d}.cluster" for i in node]),
        "gpu": gpu, "t": np.full(n, t), "source": pa.array(["nvml"] * n), "simulated": np.zeros(n, bool),
        "name": pa.array(["NVIDIA H100 80GB HBM3"] * n),
        "uuid": pa.array([f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(n)]),
        "util_pct": pa.array(util, mask=(rng.random(n) < 0.1) if nulls else None), "mem_total_bytes": np.full(n, 80 << 30),
        "sm_clock_mhz": clock, "max_sm_clock_mhz": np.full(n, 1980.0), "temp_c": rng.uniform(50, 70, n).round(1),
        "power_w": rng.uniform(250, 350, n).round(1),
        "throttle_reasons": np.where(clock < 1500, THROTTLE_HW_SLOWDOWN, 0).astype(np.int64),
        "ecc_sbe": pa.array(np.zeros(n, np.int64), mask=(rng.random(n) < 0.1) if nulls else None),
        "throttle_names": pa.array([["hw_slowdown"] if c < 1500 else [] for c in clock], pa.list_(pa.string())),
    }
    spec = SPECS["gpu"].schema
    zero = {pa.int64(): np.zeros(n, np.int64)}
    return pa.table([pa.array(cols[f.name], f.type) if f.name in cols else zero.get(f.type, pa.nulls(n, f.type))
                     for f in spec], schema=spec)


def window(seconds: int = 12, nodes: int = 16, nulls: bool = False) -> RunLive:
    rng = np.random.default_rng(3)
    live = RunLive("r1")
    for s in range(seconds):
        live.add_arrow("gpu", fleet_batch(1000.0 + s, nodes, rng, nulls), now=2000.0 + s)
    return live


def test_the_rounds_gpu_frame_is_the_columnar_readers_with_the_values_normalize_gave():
    live = window(nulls=True)
    # a batch of decoded records too (a head fed by the JSON path), older samples of two GPUs
    live.add("gpu", [schema.GpuSample(node=0, host="node-0000.cluster", gpu=g, t=999.5, source="nvml", simulated=False,
                                      name="NVIDIA H100 80GB HBM3", util_pct=50.0, throttle_reasons=0) for g in (0, 1)])
    data = live.run_data(now=1020.0)
    got = data.gpu
    assert "gpu" in data.prepared
    assert isinstance(got["host"].dtype, pd.CategoricalDtype) and isinstance(got["name"].dtype, pd.CategoricalDtype)
    # what the round was given before: the window as one table, to_pandas, RunData.normalize
    table = live.gpu_table().cast(SPECS["gpu"].schema)
    want = RunData(run_id="r1", gpu=table.to_pandas()).gpu
    assert len(got) == len(want) == 16 * GPUS * 12 + 2
    key = ["node", "gpu", "t"]
    got = got.sort_values(key, kind="stable").reset_index(drop=True)
    want = want.sort_values(key, kind="stable").reset_index(drop=True)
    for c in columnar.wanted_columns("gpu"):
        g, w = got[c], want[c]
        if isinstance(g.dtype, pd.CategoricalDtype) or w.dtype == object or pd.api.types.is_string_dtype(w.dtype):
            assert g.astype(object).tolist() == w.astype(object).tolist(), c
        else:
            np.testing.assert_allclose(g.to_numpy(float, na_value=np.nan), w.to_numpy(float, na_value=np.nan),
                                       rtol=1e-6, err_msg=c)
    (f,) = [f for f in gpu_health.analyze(__import__("analyzers.builder", fromlist=["x"]).build_frame(data))
            if f.evidence.get("cause") == "throttle"]
    assert (f.evidence["node"], f.evidence["gpu"]) == (1, 2)


def _window_bytes(live: RunLive) -> int:
    """The GPU window's memory: every Arrow buffer its batches hold, counted once however many batches share it."""
    seen: dict[int, int] = {}

    def walk(arr):
        for b in arr.buffers():
            if b is not None:
                seen[b.address] = b.size
        if pa.types.is_dictionary(arr.type):
            walk(arr.dictionary)

    for t in live._gpu_arrow:
        for col in t.columns:
            for chunk in col.chunks:
                walk(chunk)
    return sum(seen.values())


def test_the_window_keeps_each_string_once_not_once_per_sample():
    live = window(seconds=60, nodes=64)
    rows = live._gpu_arrow_rows
    assert rows == 64 * GPUS * 60
    numbers = sum(8 * rows for f in SPECS["gpu"].schema if pa.types.is_integer(f.type) or pa.types.is_floating(f.type))
    per_sample_strings = (_window_bytes(live) - numbers) / rows
    # five string columns held per sample take ~90 bytes (a 40-character uuid, a host, the device name, ...); their
    # indices into dictionaries the batches share take 4 bytes each, plus validity bits and the list offsets
    assert per_sample_strings < 40
    # and the views still read strings
    (newest,) = [g for g in live.gpu_latest() if (g.node, g.gpu) == (3, 4)]
    assert newest.host == "node-0003.cluster" and newest.uuid.startswith("GPU-") and len(newest.uuid) == 40


def test_a_dictionary_that_outgrows_its_cap_starts_anew(monkeypatch):
    monkeypatch.setattr(live_frames, "DICT_MAX", 100)  # fewer than the window's 128 GPUs' uuids
    live = window(seconds=3, nodes=16)
    t = live.gpu_table()
    assert t.num_rows == 3 * 16 * GPUS
    assert sorted(set(t.column("uuid").to_pylist())) == sorted({f"GPU-{i:08x}-1111-2222-3333-{i:012x}"
                                                                  for i in range(16 * GPUS)})


def test_the_runs_list_reads_the_newest_gpu_samples_without_making_records(tmp_path, monkeypatch):
    from head.runs import LiveRuns
    from head.store import Store

    runs = LiveRuns(Store(tmp_path), {"records_in": 0, "records_new": 0, "duplicates": 0})
    live = runs.run("r1")
    live.last_seen = 1.0
    sim = [schema.GpuSample(node=0, host="h", gpu=g, t=1.0, source="python-sim", simulated=True, name="Simulated GPU")
           for g in range(4)]
    live.add("gpu", sim)
    (row,) = runs.summary()
    assert row["gpu_simulated"] is True and row["peak_flops"] is None

    def no_records(self, limit):
        raise AssertionError("the runs list converted GPU samples to records")

    monkeypatch.setattr(RunLive, "_gpu_records", no_records)
    live.add_arrow("gpu", fleet_batch(2.0, 8, np.random.default_rng(0)))  # 64 real H100s: the newest 64 samples
    (row,) = runs.summary()
    assert row["gpu_simulated"] is False and row["device"] == "cuda"
    assert row["peak_flops"] and "H100" in row["peak_source"]


def _groups_reference(gp: pd.DataFrame, rows: pd.Series):
    flag = rows.to_numpy(dtype=bool)
    for key, idx in sorted(gp.groupby(["node", "gpu"]).indices.items()):
        if flag[idx].any():
            yield key, gp.iloc[idx]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_groups_of_the_flagged_gpus_only_are_the_same_groups(seed):
    rng = np.random.default_rng(seed)
    n = 5000
    gp = pd.DataFrame({"node": rng.integers(0, 40, n).astype(np.int32), "gpu": rng.integers(0, 8, n).astype(np.int32),
                       "t": rng.random(n)})
    rows = pd.Series(rng.random(n) < 0.002)
    got = list(gpu_health._gpu_groups(gp, rows))
    want = list(_groups_reference(gp, rows))
    assert 0 < len(got) < 40 * 8
    assert [k for k, _ in got] == [k for k, _ in want]
    for (_, a), (_, b) in zip(got, want):
        pd.testing.assert_frame_equal(a, b)


def _steps_batch(step: int, ranks: int) -> tuple[pa.Table, pa.Table]:
    """One step of every rank (steps and two collectives each), the store's schema, strings per row as they arrive."""
    r = np.arange(ranks)
    steps = SPECS["steps"].to_table("r1", [
        schema.StepRecord(run_id="r1", rank=int(i), step=step, node=int(i) // 8, host=f"node-{int(i) // 8:04d}.cluster",
                          world_size=ranks, t_start=step * 1.0, t_end=step * 1.0 + 0.9, step_ms=900.0, compute_ms=800.0)
        for i in r])
    colls = SPECS["collectives"].to_table("r1", [
        schema.CollectiveRecord(run_id="r1", rank=int(i), step=step, seq=2 * step + j, op="all_reduce" if j else "broadcast",
                                group="dp" if j else "tp", comm_id=f"{int(i) // 8 + 1000 * j:016x}", nbytes=1 << 20,
                                t_arrive=step + 0.5, t_done=step + 0.6, duration_ms=100.0)
        for i in r for j in (0, 1)])
    return steps, colls


def test_steps_and_collectives_keep_their_strings_once_and_the_views_read_them():
    live = RunLive("r1")
    ranks = 64
    for s in range(30):
        steps, colls = _steps_batch(s, ranks)
        live.add_arrow("steps", steps)
        live.add_arrow("collectives", colls)
    for name, table in (("_steps", "steps"), ("_colls", "collectives")):
        for col in live_mod_dict_columns()[table]:
            types = {t.schema.field(col).type for t in getattr(live, name)}
            assert types == {pa.dictionary(pa.int32(), pa.string())}, (table, col)
        # one dictionary array per column, shared by every batch
        first, last = getattr(live, name)[0], getattr(live, name)[-1]
        for col in live_mod_dict_columns()[table]:
            assert first.column(col).chunk(0).dictionary.buffers()[2].address == \
                last.column(col).chunk(0).dictionary.buffers()[2].address
    (st,) = [s for s in live.rank_states(now=40.0) if s["rank"] == 17]
    assert st["host"] == "node-0002.cluster" and st["step"] == 29
    rows = live.steps_since(27, rank=9)
    assert [(r.step, r.host, r.run_id) for r in rows] == [(28, "node-0001.cluster", "r1"), (29, "node-0001.cluster", "r1")]
    data = live.run_data(now=40.0)
    co = data.collectives
    assert set(co["op"].astype(str)) == {"all_reduce", "broadcast"} and set(co["group"].astype(str)) == {"dp", "tp"}
    assert len(data.steps) == 30 * ranks and data.steps["host"].astype(str).iloc[0].startswith("node-")


def live_mod_dict_columns():
    from head.live import DICT_COLUMNS

    return DICT_COLUMNS
