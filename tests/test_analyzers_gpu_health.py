"""GPU health: XIDs counted right, ECC, throttling, clocks."""

from analyzer_fixtures import build, gpu_samples, step_time, with_records

from analyzers.builder import build_frame
from analyzers.checks import gpu_health
from analyzers.checks.gpu_health import count_xids
from ranksight.schema import XidEvent
from ranksight.simgpu import THROTTLE_APP_CLOCKS, THROTTLE_GPU_IDLE, THROTTLE_SW_POWER_CAP


def test_xid_events_deduplicated_and_repeats_counted():
    data = build(world=4, nodes=2)
    t = step_time(data, 10)[0]
    xs = [XidEvent(node=1, host="node1", gpu=0, t=t, code=79, source="simulated-nvml", simulated=True),
          XidEvent(node=1, host="node1", gpu=0, t=t, code=79, source="simulated-nvml", simulated=True),  # same event twice
          XidEvent(node=1, host="node1", gpu=0, t=t + 0.5, code=79, source="simulated-nvml", simulated=True)]  # a repeat
    d = with_records(data, xs)
    c = count_xids(d.xid, d.gpu)
    assert len(c) == 1 and int(c.iloc[0]["count"]) == 2
    (f,) = gpu_health.analyze(build_frame(d))
    assert f.severity == "critical" and f.nodes == [1] and f.ranks == [2]
    assert f.evidence["xid_count"] == 2 and f.evidence["codes"] == [79]
    assert f.step_start == 10 and f.simulated and "[simulated]" in f.summary


def test_xid_counter_increases_with_reset():
    data = build(world=2)
    t0 = float(data.steps["t_start"].min())
    t1 = float(data.steps["t_end"].max())
    mid = (t0 + t1) / 2

    # counter: 0 ... 2 (two XIDs), probe restarts -> 1 (one more) => 3 events
    def total(n, g, t):
        if g != 1:
            return 0
        if t < mid - 0.5:
            return 0
        if t < mid:
            return 2
        return 1

    d = with_records(data, gpu_samples(data, xid_total=total))
    c = count_xids(d.xid, d.gpu)
    assert len(c) == 1 and int(c.iloc[0]["count"]) == 3 and int(c.iloc[0]["gpu"]) == 1
    (f,) = gpu_health.analyze(build_frame(d))
    assert f.ranks == [1] and f.evidence["xid_counter_increase"] == 3 and f.evidence["codes"] == []


def test_events_and_counter_are_not_double_counted():
    data = build(world=2)
    t = step_time(data, 5)[0]
    xs = [XidEvent(node=0, host="node0", gpu=0, t=t, code=48, source="nvml", simulated=False)]
    d = with_records(data, xs + gpu_samples(data, xid_total=lambda n, g, tt: 1 if (g == 0 and tt >= t) else 0, simulated=False))
    (f,) = gpu_health.analyze(build_frame(d))
    assert f.evidence["xid_count"] == 1 and not f.simulated


def test_ecc_double_bit_is_critical():
    data = build(world=2)
    t = step_time(data, 7)[0]
    d = with_records(data, gpu_samples(data, ecc_dbe=lambda n, g, tt: 1 if (g == 1 and tt >= t) else 0))
    (f,) = gpu_health.analyze(build_frame(d))
    assert f.evidence["cause"] == "ecc_dbe" and f.severity == "critical" and f.ranks == [1] and f.step_start == 7


def test_harmful_throttle_and_low_clocks():
    data = build(world=4)
    t = step_time(data, 12)[0]
    d = with_records(data, gpu_samples(
        data, throttle=lambda n, g, tt: THROTTLE_SW_POWER_CAP if (g == 3 and tt >= t) else THROTTLE_APP_CLOCKS,
        sm_clock=lambda n, g, tt: 1300.0 if (g == 3 and tt >= t) else 1980.0))
    (f,) = gpu_health.analyze(build_frame(d))
    assert f.evidence["cause"] == "throttle" and f.ranks == [3] and f.severity == "warning"
    assert f.evidence["reasons"] == ["sw_power_cap"] and f.evidence["sm_clock_mhz"] == 1300
    assert 11 <= f.step_start <= 12


def test_benign_throttle_reasons_are_clean():
    data = build(world=4)
    d = with_records(data, gpu_samples(data, throttle=lambda n, g, t: THROTTLE_GPU_IDLE | THROTTLE_APP_CLOCKS))
    assert gpu_health.analyze(build_frame(d)) == []


def test_node_wide_xid_is_one_finding():
    data = build(world=4, nodes=2)
    t = step_time(data, 4)[0]
    xs = [XidEvent(node=0, host="node0", gpu=g, t=t + 0.01 * g, code=79, source="simulated-nvml", simulated=True) for g in (0, 1)]
    (f,) = gpu_health.analyze(build_frame(with_records(data, xs)))
    assert f.nodes == [0] and f.ranks == [0, 1] and f.evidence["gpus"] == [0, 1]
    assert f.evidence["xid_count"] == 2 and f.evidence["per_gpu"] == {0: 1, 1: 1}


def test_may_find_by_gpu_codes_same_as_groupby():
    import numpy as np
    import pandas as pd

    from analyzers.checks.gpu_health import GpuHealthConfig
    _may_find = gpu_health._may_find
    rng = np.random.default_rng(0)
    n = 4000
    node, gpu = rng.integers(0, 6, n), rng.integers(0, 8, n)
    # node 1: single-bit errors on GPU 3 (one of them NaN); node 2: throttled; node 3: slow clocks while busy or idle;
    # node 4: a double-bit error on one sample; node 5 and the rest: clean
    gp = pd.DataFrame({"node": node, "gpu": gpu,
                       "ecc_dbe": np.where((node == 4) & (np.arange(n) == np.flatnonzero(node == 4)[0]), 1.0, 0.0),
                       "ecc_sbe": np.where((node == 1) & (gpu == 3), rng.choice([0.0, 2.0, np.nan], n), 0.0),
                       "retired_pages": rng.choice([0.0, np.nan], n), "remapped_rows": 0.0,
                       "throttle_reasons": np.where(node == 2, rng.choice([0, 0x8, 0x20], n), 0),
                       "util_pct": rng.choice([10.0, 95.0, np.nan], n),
                       "sm_clock_mhz": np.where(node == 3, rng.choice([900.0, 1900.0], n), 1900.0), "max_sm_clock_mhz": 1980.0})
    cfg = GpuHealthConfig()
    got = _may_find(gp, cfg)
    want = _may_find(gp.astype({"node": float, "gpu": float}), cfg)  # float keys: pandas' groupby path
    assert 0 < got.sum() < n
    pd.testing.assert_series_equal(got, want, check_names=False)
