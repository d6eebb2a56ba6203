"""MFU drops against the run's own baseline, with their likely cause."""

from analyzer_fixtures import build, gpu_samples, step_time, with_records

from analyzers.builder import build_frame
from analyzers.checks import mfu
from ranksight.simgpu import THROTTLE_HW_THERMAL


def test_mfu_series_is_palm_over_peak():
    data = build(flops=5e12, peak_flops=100e12, compute_ms=100.0, data_ms=0.0, transfer_ms=0.0, noise=0.0)
    ser = mfu.series(data)
    # 5 TFLOP in ~0.1 s = 50 TFLOP/s of a 100 TFLOP/s peak
    assert abs(ser["mfu"].median() - 0.5) < 0.01
    label, simulated = mfu.peak_label(data)
    assert "measured fp32 matmul on this CPU" in label and simulated


def test_clean_run_no_drop():
    for seed in range(3):
        assert mfu.analyze(build_frame(build(steps=40, noise=0.03, seed=seed))) == []


def test_drop_attributed_to_clock_throttle():
    # node 0 GPU 2 (rank 2) throttles from step 12: its compute is 1.4x; telemetry shows the clocks down
    data = build(compute_factor=lambda r, s: 1.4 if (r == 2 and s >= 12) else 1.0)
    t12 = step_time(data, 12)[0]
    samples = gpu_samples(
        data, sm_clock=lambda n, g, t: 1100.0 if (g == 2 and t >= t12) else 1980.0,
        throttle=lambda n, g, t: THROTTLE_HW_THERMAL if (g == 2 and t >= t12) else 0)
    (f,) = mfu.analyze(build_frame(with_records(data, samples)))
    assert f.kind == "mfu_drop" and f.step_start == 12
    assert f.evidence["cause"] == "clock_throttle"
    assert f.ranks == [2]
    assert f.evidence["throttled_gpus"][0]["gpu"] == 2
    assert 0.2 <= f.evidence["drop"] <= 0.35
    assert f.simulated


def test_drop_without_telemetry_is_straggler():
    data = build(compute_factor=lambda r, s: 1.4 if (r == 2 and s >= 12) else 1.0)
    (f,) = mfu.analyze(build_frame(data))
    assert f.evidence["cause"] == "straggler" and f.ranks == [2]


def test_drop_attributed_to_profiler():
    data = build(compute_factor=lambda r, s: 1.3 if s >= 15 else 1.0, profiling=lambda r, s: s >= 15)
    (f,) = mfu.analyze(build_frame(data))
    assert f.evidence["cause"] == "profiler_on" and f.step_start == 15


def test_drop_attributed_to_data_stall():
    data = build(data_extra_ms=lambda r, s: 50.0 if s >= 10 else 0.0)
    (f,) = mfu.analyze(build_frame(data))
    assert f.evidence["cause"] == "data_stall" and f.step_start == 10


def test_run_all_reports_an_mfu_drop_as_a_symptom_or_unconfirmed():
    from analyzers import run_all

    data = build(compute_factor=lambda r, s: 1.4 if (r == 2 and s >= 12) else 1.0)
    both = run_all(data, only=["stragglers", "mfu"])
    # confirmed: the drop is a symptom of the straggler finding, which carries its cost (one warning to act on)
    assert [(f.kind, f.severity) for f in both] == [("straggler", "warning"), ("mfu_drop", "info")]
    straggler, drop = both
    assert drop.evidence["cause_confirmed"] is True
    assert drop.evidence["symptom_of"] == {"kind": "straggler", "ranks": [2], "step_start": straggler.step_start}
    assert "a symptom of the straggler finding on rank(s) 2" in drop.summary
    assert straggler.evidence["mfu_drop"] == drop.evidence["drop"] > 0.1
    (alone,) = run_all(data, only=["mfu"])  # no straggler finding confirms the blamed cause
    assert alone.severity == "info" and alone.evidence["cause_confirmed"] is False
    assert "no straggler finding confirms it" in alone.summary


def test_drop_with_device_time_unchanged_is_host_contention():
    # every rank's wall-clock compute grows 1.6x from step 10 while the devices' own time does not
    data = build(device_time=True, host_factor=lambda r, s: 1.6 if s >= 10 else 1.0)
    (f,) = mfu.analyze(build_frame(data))
    assert f.evidence["cause"] == "host_contention" and f.severity == "info" and f.step_start == 10
    assert abs(f.evidence["device_ms_delta"]) < 5 and "contended" in f.recommendation
    # the same drop with the devices slower too is a compute slowdown
    (g,) = mfu.analyze(build_frame(build(device_time=True, compute_factor=lambda r, s: 1.6 if s >= 10 else 1.0)))
    assert g.evidence["cause"] == "compute_slowdown"


def test_per_step_max_and_mean_are_pandas_groupbys():
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(6)
    n_r, n_s = 37, 50
    for dtype in (np.float32, np.float64):
        st = pd.DataFrame({"step": np.repeat(np.arange(3, 3 + n_s, dtype=np.int32), n_r),
                           "step_ms": (rng.random(n_r * n_s) * 100 + 900).astype(dtype),
                           "flops": rng.random(n_r * n_s) * 3e14})
        gappy = st[rng.random(len(st)) > 0.2]  # steps of different sizes
        zero = st.copy()
        zero.loc[5, "step_ms"] = 0.0  # its fps NaN: pandas' groupby
        for frame in (st, gappy, zero, st.sample(frac=1.0, random_state=1)):
            fps = np.where(frame["step_ms"] > 0,
                           frame["flops"] / (frame["step_ms"].where(frame["step_ms"] > 0, 1) / 1000.0), np.nan)
            want = frame.assign(fps=fps).groupby("step").agg(step_ms=("step_ms", "max"), fps=("fps", "mean"))
            got = mfu._per_step_max_mean(frame["step"], frame["step_ms"], fps)
            if frame is zero or not frame["step"].is_monotonic_increasing:
                assert got is None
            else:
                pd.testing.assert_frame_equal(got, want, check_exact=True)


def test_flops_per_s_is_the_pandas_expression():
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(7)
    for ms_dtype in (np.float32, np.float64, "Float64"):
        for fl_dtype in (np.float64, np.float32):
            ms = pd.Series(rng.random(200) * 1000, dtype=ms_dtype)
            ms.iloc[[3, 9]] = 0.0
            ms.iloc[5] = -1.0
            if ms_dtype != "Float64":
                ms.iloc[7] = np.nan
            fl = pd.Series(rng.random(200) * 3e14, dtype=fl_dtype)
            want = np.where(ms > 0, fl / (ms.where(ms > 0, 1) / 1000.0), np.nan)
            got = mfu.flops_per_s(ms, fl)
            assert got.dtype == np.asarray(want).dtype
            np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype))
