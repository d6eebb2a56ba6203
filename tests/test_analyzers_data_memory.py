"""Data stalls and memory pressure."""

from analyzer_fixtures import build, with_records

from analyzers.builder import build_frame
from analyzers.checks import data_stall, memory_pressure
from analyzers.persistence import rows_with_runs
from ranksight.schema import HostSample

GiB = 1024**3


def test_one_rank_waits_for_data():
    data = build(data_extra_ms=lambda r, s: 60.0 if (r == 2 and s >= 8) else 0.0)
    (f,) = data_stall.analyze(build_frame(data))
    assert f.ranks == [2] and f.step_start == 8 and f.severity == "warning"
    assert 60.0 <= f.evidence["data_ms_median"] <= 64.0
    assert 55.0 <= f.evidence["victims_mean_wait_ms"] <= 62.0
    assert f.evidence["peers_data_ms_median"] < 3.0


def test_every_rank_waits_for_data():
    data = build(data_extra_ms=lambda r, s: 150.0 if s >= 5 else 0.0)
    (f,) = data_stall.analyze(build_frame(data))
    assert f.evidence["scope"] == "world" and f.ranks == [0, 1, 2, 3] and f.severity == "critical"


def test_clean_data():
    assert data_stall.analyze(build_frame(build())) == []


def test_a_run_without_persistent_stalled_rows_is_judged_without_the_matrices():
    # _may_stall (by rows) against the matrices' flags: a run it passes over has no row rows_with_runs would walk
    cfg = data_stall.DataStallConfig()
    cases = [lambda r, s: 0.0, lambda r, s: 60.0 if (r == 2 and s in (8, 12)) else 0.0,
             lambda r, s: 60.0 if (r == 2 and s in (8, 12, 19)) else 0.0, lambda r, s: 4.0 if r == 1 else 0.0,
             lambda r, s: 60.0 if (r == 3 and s >= 1) else 0.0, lambda r, s: 150.0 if s >= 5 else 0.0]
    for extra in cases:
        data = build(data_extra_ms=extra)
        for gap in (False, True):
            if gap:  # a rank missing steps, a step without a step time (its share 0)
                st = data.steps
                data.steps = st[~((st["rank"] == 2) & (st["step"] == 12))].reset_index(drop=True)
                data.steps.loc[data.steps["step"] == 19, "step_ms"] = 0.0
            judged = build_frame(data).judged(cfg.warmup_steps)
            flags = ((judged.matrix("data_share") >= cfg.share) & (judged.matrix("data_ms") >= cfg.min_ms)).fillna(False)
            assert data_stall._may_stall(judged, cfg) == bool(rows_with_runs(flags, cfg.persist))
            if not data_stall._may_stall(judged, cfg):
                assert data_stall.analyze(build_frame(data), cfg) == []


def test_memory_growth_projects_when_full():
    data = build(mem_bytes=lambda r, s: 2 * GiB + s * 100 * 1024**2 if r == 0 else 2 * GiB)
    host = [HostSample(node=0, host="node0", t=float(data.steps["t_start"].min()), cpu_pct=50, load1=1, mem_used_bytes=8 * GiB,
                       mem_total_bytes=64 * GiB, net_rx_bytes=0, net_tx_bytes=0, disk_read_bytes=0, disk_write_bytes=0)]
    (f,) = memory_pressure.analyze(build_frame(with_records(data, host)))
    assert f.ranks == [0] and f.evidence["cause"] == "growth"
    assert f.evidence["slope_mib_per_step"][0] == 100.0
    # capacity per rank: 64 GiB / 4 ranks = 16 GiB; ~4.9 GiB at step 29 -> about (16-4.8)*1024/100 steps later
    assert 130 <= f.evidence["projected_full_step"][0] <= 150


def test_memory_near_capacity():
    data = build(mem_bytes=lambda r, s: int(15.8 * GiB) if r == 1 else 4 * GiB)
    host = [HostSample(node=0, host="node0", t=float(data.steps["t_start"].min()), cpu_pct=50, load1=1, mem_used_bytes=8 * GiB,
                       mem_total_bytes=64 * GiB, net_rx_bytes=0, net_tx_bytes=0, disk_read_bytes=0, disk_write_bytes=0)]
    (f,) = memory_pressure.analyze(build_frame(with_records(data, host)))
    assert f.severity == "critical" and f.ranks == [1] and f.evidence["cause"] == "near_capacity"


def test_flat_memory_is_clean():
    assert memory_pressure.analyze(build_frame(build())) == []
