"""The non-collective checks' array paths give what their pandas paths gave: the straggler scores worked out a block
of rows at a time with the CUSUM run only where a cumulative-sum bound says it can alarm, a group's episode read from
its rows, the per (step, node) median as a reshape, the rank x step cells placed by one assignment, memory's per-rank
peak from the step x rank grid, and GPU health's per-sample tests on the columns' arrays."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analyzer_fixtures import build

from analyzers.builder import StepView, step_node_median, build_frame
from analyzers.matrices import RankStepCells
from analyzers.changepoint import cusum_runs_rows, refine_onset
from analyzers.checks import gpu_health, memory_pressure, straggler_scores, stragglers
from analyzers.checks.straggler_scores import RankScores
from analyzers.checks.stragglers import StragglerConfig, merge_runs, noise_sigma


def _rank_findings_reference(frame, cfg, steps, signal):
    """stragglers._rank_findings as it was (a62194e): per-group pandas frames, concatenated; the CUSUM on every row."""
    out = []
    comp = steps.matrix(signal)
    groups = frame.placement.peer_groups(list(comp.index))
    ratios, refs = [], []
    for _, members in groups.items():
        if len(members) < cfg.min_ranks:
            continue
        ref = steps.group_reference(signal, members)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios.append(comp.loc[members] / ref.replace(0, np.nan))
        refs.append(ref)
    if not ratios:
        return out
    ratio_df = pd.concat(ratios) if len(ratios) > 1 else ratios[0]
    ref_df = pd.concat(refs) if len(refs) > 1 else refs[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        logr = np.log(ratio_df.where(ratio_df > 0))
    sigma, base_sigma = noise_sigma(logr, cfg)
    k = float(np.log(cfg.min_ratio))
    detectors = []
    for drift, h_sig, floor in ((k, cfg.h_sigma, cfg.min_h_factor),
                                (float(np.log(cfg.fast_ratio)), cfg.fast_h_sigma, cfg.fast_min_h_factor)):
        detectors.append((drift, max(h_sig * sigma, floor * drift)))
    group_of = {r: m for m in groups.values() for r in m}
    scale = np.array([cfg.few_peers_h_factor if len(group_of[r]) <= 2 else 1.0 for r in ratio_df.index])
    rank_list = list(ratio_df.index)
    runs_of: dict = {r: [] for r in rank_list}
    for drift, h in detectors:
        h_r = h * scale
        x = np.minimum(logr.to_numpy(dtype=float), (drift + cfg.clip_h_share * h_r)[:, None])
        for i, rank_runs in enumerate(cusum_runs_rows(x, list(logr.columns), drift, h_r, cfg.min_steps, cfg.high_share)):
            if rank_runs:
                runs_of[rank_list[i]] += [dict(run, drift=drift, h=float(h_r[i])) for run in rank_runs]
    for r in ratio_df.index:
        runs = runs_of[r]
        if not runs:
            continue
        for run in merge_runs(runs):
            s1 = run["end"]
            onset = min(refine_onset(logr.loc[r], run["onset"], s1), run["detected"])
            span = ratio_df.loc[r, onset:s1]
            high = logr.loc[r, onset:s1] > k
            flag_steps = [int(x) for x in high.index[high]]
            out.append(dict(rank=r, onset=onset, end=s1, flagged=len(flag_steps), flag_steps=flag_steps,
                            ratio=float(np.nanmedian(span)), own_ms=float(np.nanmedian(comp.loc[r, onset:s1])),
                            peers_ms=float(np.nanmedian(ref_df.loc[r, onset:s1])), threshold=float(np.exp(k)),
                            cusum_h=run["h"], cusum_drift=run["drift"], sigma=sigma, baseline_sigma=base_sigma,
                            group=group_of[r], confirmed_at=run["detected"]))
    return out


CASES = [
    dict(world=8, steps=40, compute_factor=lambda r, s: 1.15 if (r == 3 and s >= 12) else 1.0),
    dict(world=8, steps=60, pp=2, noise=0.03, compute_factor=lambda r, s: 1.3 if (r == 5 and 20 <= s < 45) else 1.0),
    dict(world=16, steps=50, pp=4, noise=0.05, seed=3,
         compute_factor=lambda r, s: (1.12 if (r == 2 and s >= 9) else 1.0) * (2.0 if (r == 9 and s in (30, 31)) else 1.0)),
    dict(world=8, steps=45, device_time=True, host_noise=0.2, seed=1,
         compute_factor=lambda r, s: 1.2 if (r == 6 and s >= 25) else 1.0),
    dict(world=4, steps=30, noise=0.0),  # no noise at all: every score 0, sigma 0
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("block_cells", [1 << 18, 7])  # one block, and blocks of a row or less
def test_rank_candidates_are_the_per_group_frames_ones(case, block_cells, monkeypatch):
    monkeypatch.setattr(straggler_scores, "BLOCK_CELLS", block_cells)
    frame = build_frame(build(**CASES[case]))
    cfg = StragglerConfig()
    steps = frame.judged(cfg.warmup_steps)
    found = []
    for signal in ("compute_ms",) + (("device_ms",) if frame.compute_signal == "device_ms" else ()):
        got = stragglers._rank_findings(frame, cfg, steps, signal)
        assert got == _rank_findings_reference(frame, cfg, steps, signal)
        found += got
    assert bool(found) == (CASES[case].get("noise") != 0.0)  # the planted slow ranks are candidates


def test_scores_with_gaps_and_a_zero_reference():
    # NaN cells (a rank missing steps) and zero compute (a reference of 0): the same scores, noise and candidates
    data = build(world=8, steps=40, noise=0.02, compute_factor=lambda r, s: 1.25 if (r == 1 and s >= 15) else 1.0)
    st = data.steps
    drop = ((st["rank"] == 4) & st["step"].between(20, 24)) | ((st["rank"] == 6) & (st["step"] == 30))
    data.steps = st[~drop].reset_index(drop=True)
    data.steps.loc[data.steps["step"] == 33, "compute_ms"] = 0.0
    frame = build_frame(data)
    cfg = StragglerConfig()
    steps = frame.judged(cfg.warmup_steps)
    got = stragglers._rank_findings(frame, cfg, steps, "compute_ms")
    assert got == _rank_findings_reference(frame, cfg, steps, "compute_ms")
    assert [c["rank"] for c in got] == [1]


def _scores_of(logr: np.ndarray) -> RankScores:
    sc = RankScores.__new__(RankScores)
    sc.logr = logr
    sc.row_max, sc.row_min = straggler_scores.row_range(logr)
    return sc


def test_the_cusum_bound_keeps_every_row_that_alarms():
    rng = np.random.default_rng(7)
    n, m = 300, 400
    logr = rng.normal(0.0, 0.03, (n, m))
    logr[rng.random((n, m)) < 0.02] = np.nan
    for i in range(0, n, 17):  # slow-downs of every size and length, some right at the threshold
        s0 = int(rng.integers(0, m - 5))
        logr[i, s0:s0 + int(rng.integers(2, 60))] += rng.uniform(0.05, 0.4)
    sc = _scores_of(logr)
    k = float(np.log(1.08))
    for h in (0.05, 0.15, 0.3, 0.6):
        h_r = np.full(n, h)
        clip = k + 0.5 * h_r
        rows, x = sc.cusum_rows(k, h_r, clip)
        every = cusum_runs_rows(np.minimum(logr, clip[:, None]), list(range(m)), k, h_r, 3, 0.6)
        alarmed = [i for i, runs in enumerate(every) if runs]
        assert set(alarmed) <= set(rows.tolist())
        assert len(rows) < n  # it does leave rows out
        got = cusum_runs_rows(x, list(range(m)), k, h_r[rows], 3, 0.6)
        assert [r for r in got if r] == [every[i] for i in rows.tolist() if every[i]]


def _full_bound_rows(sc: RankScores, drift: float, h: np.ndarray, clip: np.ndarray) -> np.ndarray:
    """cusum_rows' rows with no row left out by its range (``flat_rows`` finding none): the bound over every row."""
    whole = RankScores.__new__(RankScores)
    whole.logr = sc.logr
    whole.row_max = np.full(len(sc.logr), np.inf)
    whole.row_min = np.full(len(sc.logr), -np.inf)
    return whole.cusum_rows(drift, h, clip)[0]


@pytest.mark.parametrize("noise", [0.005, 0.03])
def test_rows_left_out_by_their_range_are_the_bounds(noise):
    # quiet rows (every score below the drift: left out without the bound) among noisy ones, rows with NaN, an
    # infinite score, no finite score, scores right at the drift, and thresholds down to the margin
    rng = np.random.default_rng(11)
    n, m = 120, 300
    logr = rng.normal(0.0, noise, (n, m))
    logr[rng.random((n, m)) < 0.01] = np.nan
    logr[5] = np.nan
    logr[6, 10] = np.inf
    logr[7:9] = np.minimum(logr[7:9], 0.0)
    k = float(np.log(1.08))
    logr[8, 3] = k  # at the drift: x is 0 there, the row still flat
    for i in range(20, n, 9):
        s0 = int(rng.integers(0, m - 5))
        logr[i, s0:s0 + int(rng.integers(2, 40))] += rng.uniform(0.05, 0.3)
    sc = _scores_of(logr)
    flat = straggler_scores.flat_rows(sc.row_max, sc.row_min, k, np.full(n, 0.1), m)
    assert flat[7] and flat[8] and not flat[5] and not flat[6]
    for h in (1e-13, 1e-6, 0.05, 0.15, 0.6):
        for drift in (k, float(np.log(1.25))):
            h_r = np.full(n, h)
            h_r[::4] *= 1.35
            clip = drift + 0.5 * h_r
            rows, x = sc.cusum_rows(drift, h_r, clip)
            np.testing.assert_array_equal(rows, _full_bound_rows(sc, drift, h_r, clip))
            np.testing.assert_array_equal(x, np.minimum(logr[rows], clip[rows, None]))


def _view(seed: int, shuffle: bool, dup: bool) -> StepView:
    rng = np.random.default_rng(seed)
    ranks, steps = 9, 30
    rows = pd.DataFrame({"rank": np.tile(np.arange(ranks, dtype=np.int32), steps),
                         "step": np.repeat(np.arange(steps, dtype=np.int32), ranks)})
    for c in ("sync_arrival", "sync_wait_ms", "pipeline_wait_ms", "data_ms", "step_ms", "comm_ms"):
        rows[c] = rng.random(len(rows)) * 10
    rows.loc[rng.random(len(rows)) < 0.1, "sync_arrival"] = np.nan
    rows.loc[rng.random(len(rows)) < 0.1, "sync_wait_ms"] = np.nan
    if dup:
        rows = pd.concat([rows, rows.sample(20, random_state=seed).assign(data_ms=-1.0)], ignore_index=True)
    if shuffle:
        rows = rows.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    return StepView(rows)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dup", [False, True])
def test_span_matrix_is_sub_matrix(shuffle, dup):
    for name in ("sync_arrival", "sync_wait_ms", "data_ms", "total_wait_ms", "data_share", "transfer_ms"):
        for ranks, first, last in (([1, 4, 7], 5, 17), ([0, 8], 0, 29), ([3], 12, 12), ([2, 5], 40, 50)):
            fresh, whole = _view(0, shuffle, dup), _view(0, shuffle, dup)
            got = fresh.span_matrix(name, ranks, first, last)
            assert name in ("transfer_ms",) or name not in fresh._matrices  # built from the span's rows alone
            want = whole.sub_matrix(name, ranks, first, last)
            if want.empty:
                assert got.empty
            else:
                pd.testing.assert_frame_equal(got, want)
            assert fresh.has_rows(ranks, first, last) == (first <= 29)


def teststep_node_median_is_pivot_tables():
    rng = np.random.default_rng(2)
    for per in (1, 2, 3, 8):
        steps, nodes = 20, 5
        st = pd.DataFrame({"step": np.repeat(np.arange(steps, dtype=np.int32), nodes * per),
                           "rank": np.tile(np.arange(nodes * per, dtype=np.int32), steps),
                           "node": np.tile(np.repeat(np.arange(nodes, dtype=np.int32), per), steps)})
        st["t_end"] = 1.7e9 + rng.random(len(st)) * 100
        want = st.pivot_table(index="step", columns="node", values="t_end", aggfunc="median")
        pd.testing.assert_frame_equal(step_node_median(st, "t_end"), want)
    assert step_node_median(st.sample(frac=1.0, random_state=0), "t_end") is None  # not in (step, node) order
    assert step_node_median(st.iloc[:-1], "t_end") is None  # a cell short
    moved = st.copy()
    moved.loc[moved["step"] == 3, "node"] = moved.loc[moved["step"] == 3, "node"].to_numpy()[::-1]
    assert step_node_median(moved, "t_end") is None  # ranks that change node


def test_cells_with_and_without_duplicates():
    rng = np.random.default_rng(4)
    rank = rng.integers(0, 6, 200)
    step = rng.integers(0, 40, 200)
    x = rng.random(200)
    cells = RankStepCells(rank, step)
    df = pd.DataFrame({"rank": rank, "step": step, "x": x})
    want = df.pivot_table(index="rank", columns="step", values="x", aggfunc="last").sort_index(axis=1)
    np.testing.assert_array_equal(cells.values(x), want.to_numpy())
    full = pd.DataFrame({"rank": np.tile(np.arange(6), 40), "step": np.repeat(np.arange(40), 6), "x": rng.random(240)})
    c2 = RankStepCells(full["rank"].to_numpy(), full["step"].to_numpy())
    np.testing.assert_array_equal(c2.values(full["x"].to_numpy()),
                                  full.pivot_table(index="rank", columns="step", values="x", aggfunc="last").to_numpy())


def test_memory_grid_path_is_the_groupby_path(monkeypatch):
    data = build(world=8, steps=40, mem_bytes=lambda r, s: (2 + (0.05 * s if r == 3 else 0)) * 1024**3)
    frame = build_frame(data)
    assert memory_pressure._rank_grid(frame.judged(1).rows) is None  # the fixture's rows: rank after rank
    st = frame.judged(1).rows.sort_values(["step", "rank"])  # a store's: step after step
    assert memory_pressure._rank_grid(st) is not None
    fast = [(r, sub.index.tolist()) for r, sub in memory_pressure._ranks_to_judge(st, {3: 8 * 1024**3}, memory_pressure.MemoryConfig())]
    monkeypatch.setattr(memory_pressure, "_rank_grid", lambda st: None)
    slow = [(r, sub.index.tolist()) for r, sub in memory_pressure._ranks_to_judge(st, {3: 8 * 1024**3}, memory_pressure.MemoryConfig())]
    assert fast == slow and [r for r, _ in fast] == [3]
    assert memory_pressure._rank_grid(st.sample(frac=1.0, random_state=0)) is None


def test_gpu_may_find_arrays_are_the_pandas_tests():
    rng = np.random.default_rng(5)
    n = 4000
    gp = pd.DataFrame({"node": rng.integers(0, 200, n).astype(np.int32), "gpu": rng.integers(0, 8, n).astype(np.int32),
                       "t": np.arange(n, dtype=float)})
    for c in ("ecc_dbe", "ecc_sbe", "retired_pages", "remapped_rows"):
        gp[c] = np.where(rng.random(n) < 0.001, 1.0, 0.0).astype(np.float32)
    gp.loc[rng.random(n) < 0.05, "ecc_sbe"] = np.nan
    gp["util_pct"] = np.where(rng.random(n) < 0.1, np.nan, rng.uniform(0, 100, n)).astype(np.float32)
    gp["sm_clock_mhz"] = rng.uniform(900, 1500, n).astype(np.float32)
    gp["max_sm_clock_mhz"] = np.float32(1410.0)
    gp["temp_c"] = np.float32(60.0)
    gp["throttle_reasons"] = np.where(gp["node"].to_numpy() == 7, 0x8, 0).astype(int)  # node 7's GPUs throttle
    cfg = gpu_health.GpuHealthConfig()
    fast = gpu_health._may_find(gp, cfg)
    # the pandas path (keys that are not plain integers take it): node numbers as strings, the same groups
    slow = gpu_health._may_find(gp.assign(node=gp["node"].astype(str)), cfg)
    assert fast.tolist() == slow.tolist()
    assert 0 < int(fast.sum()) < n


@pytest.mark.parametrize("shuffle", [False, True])
def test_grid_matrix_is_the_placed_cells_one(shuffle):
    # a store's rows (a step x rank grid) reshape into the matrix that placing each row gives; shuffled rows are
    # placed one by one
    view = _view(1, shuffle, False)
    view.rows.loc[view.rows["rank"] == 4, "sync_arrival"] = np.nan  # a rank without any arrival: left out
    view.rows.loc[view.rows["step"] == 7, "sync_wait_ms"] = np.nan  # a step without any wait: left out
    assert (view._grid is not None) == (not shuffle)
    for name in ("sync_arrival", "sync_wait_ms", "data_ms", "total_wait_ms", "transfer_ms"):
        got = view.matrix(name)
        src = pd.DataFrame({"rank": view.rows["rank"], "step": view.rows["step"], name: view.column(name)})
        want = src.pivot_table(index="rank", columns="step", values=name, aggfunc="last").sort_index(axis=1)
        np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())
        assert got.index.tolist() == want.index.tolist() and got.columns.tolist() == want.columns.tolist()
    assert 4 not in view.matrix("sync_arrival").index and 7 not in view.matrix("sync_wait_ms").columns


@pytest.mark.parametrize("shuffle", [False, True])
def test_distinct_ranks_and_steps_from_the_grid_are_the_rows_unique_ones(shuffle):
    view = _view(3, shuffle, False)
    partial = StepView(view.rows.iloc[5:])  # a step misses ranks: no grid, the rows' own values
    assert (view._grid is not None) == (not shuffle) and partial._grid is None
    for v in (view, partial):
        for name in ("rank", "step"):
            want = sorted(int(x) for x in v.rows[name].unique())
            got = v.distinct(name)
            assert got == want and all(type(x) is int for x in got)
            assert v.distinct(name) is got  # kept


def test_one_value_is_nunique_one_and_from_step_searches_in_the_column_type():
    from analyzers import builder
    from analyzers.builder import one_value

    for values in ([], [3], [3, 3, 3], [3, 4], [0, 0, 1]):
        for dtype in (np.int32, np.int64, np.float64):
            col = pd.Series(values, dtype=dtype)
            assert one_value(col) == (col.nunique() == 1)
    for col in (pd.Series([np.nan, 1.0, 1.0]), pd.Series([np.nan, np.nan]), pd.Series([1, None], dtype="Int64")):
        assert one_value(col) == (col.nunique() == 1)
    st = pd.DataFrame({"step": np.repeat(np.arange(5, 9), 3).astype(np.int32)})
    for first in (-2**40, 0, 6, 7, 9, 2**40):
        pd.testing.assert_frame_equal(builder._from_step(st, first), st[st["step"] >= first])


def test_release_reference_keeps_the_matrix_and_rebuilds_the_same_reference():
    view = _view(4, False, False)
    m, ref = view.matrix("sync_wait_ms"), view.reference("sync_wait_ms")
    view.release_reference("sync_wait_ms")
    assert view.matrix("sync_wait_ms") is m and "sync_wait_ms" not in view._references
    pd.testing.assert_frame_equal(view.reference("sync_wait_ms"), ref)
    view.release_reference("not_built")  # nothing to forget: no error


def _skewed_ranks_as_before(data):
    """builder.skewed_ranks as it was (pandas' median over the columns, nunique), the reference of the shortcuts."""
    from analyzers import builder

    st = data.steps
    if st.empty or st["node"].nunique() < 2 or st["t_end"].isna().all():
        return set()
    ends = builder.step_node_median(st, "t_end")
    if ends is None:
        ends = st.pivot_table(index="step", columns="node", values="t_end", aggfunc="median")
    med = ends.sub(ends[ends.columns[0]], axis=0).median(axis=0)
    off = {n: float(med[n]) for n in ends.columns if np.isfinite(float(med[n]))}
    tol = max(builder.CLOCK_SKEW_S, 2.0 * float(st["step_ms"].median()) / 1000.0)
    groups = []
    for n in sorted(off, key=lambda n: off[n]):
        if groups and off[n] - off[groups[-1][-1]] <= tol:
            groups[-1].append(n)
        else:
            groups.append([n])
    if len(groups) < 2:
        return set()
    ranks_of = st.groupby("node")["rank"].unique()
    size = {i: sum(len(ranks_of.get(n, [])) for n in g) for i, g in enumerate(groups)}
    keep = max(size, key=lambda i: (size[i], -min(groups[i])))
    return {int(r) for i, g in enumerate(groups) if i != keep for n in g for r in ranks_of.get(n, [])}


@pytest.mark.parametrize("layout", ["grid", "shuffled", "one_node"])
def test_skewed_ranks_shortcuts_are_the_pandas_ones(layout):
    import dataclasses

    from analyzers.builder import skewed_ranks, two_values

    rng = np.random.default_rng(25)
    for trial in range(4):
        data = build(world=8, nodes=4 if layout != "one_node" else 1, steps=30)
        st = data.steps.copy()
        skew = {0: 0.0, 1: 0.0, 2: 60.0 * (trial % 2), 3: 0.02 * trial}  # node 2 off by a minute in odd trials
        st["t_end"] = st["t_end"] + st["node"].map(skew).fillna(0.0) + rng.normal(size=len(st)) * 1e-3
        if layout == "shuffled":
            st = st.sample(frac=1.0, random_state=trial).reset_index(drop=True)
        else:  # a store's order: a step x rank grid
            st = st.sort_values(["step", "rank"]).reset_index(drop=True)
        got_data = dataclasses.replace(data, steps=st, clock_offset_s={})
        assert skewed_ranks(got_data) == _skewed_ranks_as_before(got_data)
        if layout == "grid":
            from analyzers.builder import step_node_median
            assert step_node_median(st, "t_end") is not None  # the reshape: numpy's medians
            assert bool(skewed_ranks(got_data)) == bool(trial % 2)  # the skewed node found: the test can fail
    for values in ([], [1], [1, 1], [1, 2], [2, 1, 1]):
        for dtype in (np.int32, np.float64):
            col = pd.Series(values, dtype=dtype)
            assert two_values(col) == (col.nunique() >= 2)


def test_no_grid_where_a_step_misses_a_rank_or_repeats_one():
    view = _view(2, False, False)
    assert StepView(view.rows.iloc[1:]).__dict__.get("_grid") is None and StepView(view.rows.iloc[1:])._grid is None
    rows = view.rows.copy()
    rows.loc[5, "rank"] = rows.loc[4, "rank"]
    assert StepView(rows)._grid is None
    assert StepView(rows.iloc[:0])._grid is None


@pytest.mark.parametrize("layout", ["tick_major", "gpu_major", "shuffled"])
def test_capacity_max_by_gpu_is_groupbys(layout):
    rng = np.random.default_rng(6)
    nodes, gpus, ticks = 5, 4, 30
    gp = pd.DataFrame({"t": np.repeat(np.arange(ticks, dtype=float), nodes * gpus),
                       "node": np.tile(np.repeat(np.arange(nodes, dtype=np.int32), gpus), ticks),
                       "gpu": np.tile(np.arange(gpus, dtype=np.int32), nodes * ticks)})
    gp["mem_total_bytes"] = (rng.integers(70, 80, len(gp)) * 2**30).astype(np.float32)
    gp.loc[gp.sample(frac=0.2, random_state=1).index, "mem_total_bytes"] = np.nan
    gp.loc[(gp["node"] == 2) & (gp["gpu"] == 1), "mem_total_bytes"] = np.nan  # a GPU that never said
    if layout == "gpu_major":
        gp = gp.sort_values(["node", "gpu", "t"], kind="stable").reset_index(drop=True)
    elif layout == "shuffled":
        gp = gp.sample(frac=1.0, random_state=2).reset_index(drop=True)
    got = memory_pressure._max_by_pair(gp, "node", "gpu", "mem_total_bytes")
    want = list(gp.groupby(["node", "gpu"])["mem_total_bytes"].max().items())
    assert [k for k, _ in got] == [k for k, _ in want]
    np.testing.assert_array_equal(np.array([v for _, v in got]), np.array([v for _, v in want]))
    key = gp["node"].to_numpy() * gpus + gp["gpu"].to_numpy()
    assert (memory_pressure._grid_max(key, gp["mem_total_bytes"].to_numpy()) is None) == (layout == "shuffled")


@pytest.mark.parametrize("shuffle", [False, True])
def test_report_heat_matrix_from_the_grid_is_the_placed_one(shuffle):
    from analyzers.report.heat import rank_step_matrix as heat_matrix

    rows = _view(3, shuffle, False).rows.copy()
    rows["step_ms"] = rows["step_ms"].astype(np.float32)
    rows.loc[rows["rank"] == 2, "step_ms"] = np.nan  # a rank without any value: left out
    got = heat_matrix(rows, "step_ms")
    keep = rows["step_ms"].notna().to_numpy()
    cells = RankStepCells(rows["rank"].to_numpy()[keep], rows["step"].to_numpy()[keep])
    assert got.values.dtype == np.float32 and 2 not in got.ranks.tolist()
    np.testing.assert_array_equal(got.ranks, cells.ranks)
    np.testing.assert_array_equal(got.steps, cells.steps)
    np.testing.assert_array_equal(got.values, cells.values(rows["step_ms"].to_numpy()[keep], np.float32))


def test_row_range_is_nanmax_nanmin():
    rng = np.random.default_rng(9)
    x = rng.normal(0, 0.05, (6, 30))
    x[1, 4] = np.nan
    x[2] = np.nan
    x[3, 7] = np.inf
    hi, lo = straggler_scores.row_range(x)
    with pytest.warns(RuntimeWarning):
        np.testing.assert_array_equal(hi, np.nanmax(x, axis=1))
    with pytest.warns(RuntimeWarning):
        np.testing.assert_array_equal(lo, np.nanmin(x, axis=1))
    assert all(np.isnan(v).all() for v in straggler_scores.row_range(np.zeros((3, 0))))


def test_row_sigmas_are_row_robust_sigmas():
    from analyzers.stats import row_robust_sigmas

    rng = np.random.default_rng(8)
    for shape in ((5, 0), (7, 1), (6, 40), (9, 41)):
        x = rng.normal(0, 0.05, shape)
        np.testing.assert_array_equal(straggler_scores.row_sigmas(x), row_robust_sigmas(x))
        if x.size:
            x[1, 0] = np.nan
            x[2, -1] = -np.inf
            np.testing.assert_array_equal(straggler_scores.row_sigmas(x), row_robust_sigmas(x))


def _rank_grid_by_codes(st):
    """memory_pressure._rank_grid as it was (distinct_codes of every row's rank)."""
    from analyzers.matrices import distinct_codes

    rank = st["rank"].to_numpy()
    ranks, code = distinct_codes(rank)
    n = len(ranks)
    if n == 0 or len(rank) % n or not np.array_equal(code.reshape(-1, n), np.broadcast_to(np.arange(n), (len(rank) // n, n))):
        return None
    return ranks, st["mem_bytes"].to_numpy().reshape(-1, n)


def test_rank_grid_by_the_first_steps_ranks_is_by_codes():
    grid = pd.DataFrame({"rank": np.tile(np.array([0, 2, 3, 7], dtype=np.int32), 6), "mem_bytes": np.arange(24.0)})
    cases = {"grid": grid, "rank after rank": grid.sort_values("rank", kind="stable"), "shuffled": grid.sample(frac=1.0, random_state=0),
             "a repeated rank": grid.assign(rank=np.tile(np.array([0, 2, 2, 7], dtype=np.int32), 6)),
             "a row missing": grid.iloc[1:], "one rank": grid[grid["rank"] == 3], "one step": grid.iloc[:4],
             "one row": grid.iloc[:1], "a step in another order": grid.assign(rank=np.r_[np.tile([0, 2, 3, 7], 5), [0, 3, 2, 7]].astype(np.int32))}
    for name, st in cases.items():
        got, want = memory_pressure._rank_grid(st), _rank_grid_by_codes(st)
        assert (got is None) == (want is None), name
        if got is not None:
            np.testing.assert_array_equal(got[0], want[0])
            assert got[0].dtype == want[0].dtype
            np.testing.assert_array_equal(got[1], want[1])


def test_a_groups_normed_median_is_the_normed_matrixs():
    # against the normalised matrix of every rank, a group's rows taken from it (the stage drift's old path)
    import warnings

    rng = np.random.default_rng(14)
    values = rng.normal(100.0, 5.0, (12, 30))
    values[4, 7] = np.nan  # a NaN in one group
    base = np.nanmedian(values[:, :5], axis=1)
    base[9] = 0.0  # a zero baseline: NaN
    base = np.where(base == 0, np.nan, base)
    norm = values / base[:, None]
    for rows in (slice(0, 4), np.array([4, 5, 6, 7]), np.array([8, 10, 9, 11]), slice(3, 3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an empty group: NaN either way
            got = stragglers._normed_median_down(values, rows, base)
            want = stragglers._median_rows_down(norm[rows])
        np.testing.assert_array_equal(got, want)


def test_scores_in_a_scratch_array_left_with_other_values():
    # the second signal's scores written over the first's array (every cell written): the same candidates as fresh
    data = build(world=8, steps=40, noise=0.02, compute_factor=lambda r, s: 1.25 if (r == 1 and s >= 15) else 1.0)
    st = data.steps
    data.steps = st[~((st["rank"] == 4) & st["step"].between(20, 24))].reset_index(drop=True)  # NaN cells too
    frame = build_frame(data)
    cfg = StragglerConfig()
    steps = frame.judged(cfg.warmup_steps)
    fresh = stragglers._rank_findings(frame, cfg, steps, "compute_ms")
    shape = steps.matrix("compute_ms").shape
    for junk in (np.full(shape, np.nan), np.full(shape, 7.0), np.full((3, 3), 1.0)):
        scratch = {"logr": junk}
        assert stragglers._rank_findings(frame, cfg, steps, "compute_ms", scratch) == fresh
        assert scratch["logr"].shape == shape
    assert [c["rank"] for c in fresh] == [1]
