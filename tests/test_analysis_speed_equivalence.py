"""The vectorized helpers of the head's analysis round give exactly what the per-rank code they replaced gave.

The analyzers' findings must not change when their cost does: each fast path here is compared with a plain
reference implementation (the code it replaced) on random data with the awkward cases (NaN, inf, ties, a
single row, an empty frame). The whole analyzers are compared on stored runs by bench/findings_equivalence.py.
No timings are asserted.
"""

from __future__ import annotations

import random
import warnings
from collections import deque

import numpy as np
import pandas as pd
import pytest

from analyzers.matrices import rank_step_matrix
from analyzers.changepoint import cusum_runs, cusum_runs_rows
from analyzers.collectives import group_key, group_keys
from analyzers.persistence import persistent_runs, rows_with_runs
from analyzers.stats import MAD_SCALE, leave_one_out_median, robust_sigma, temporal_sigma


def _loo_reference(frame: pd.DataFrame) -> pd.DataFrame:
    """leave_one_out_median as it was: delete each row, nanmedian of the rest."""
    out = pd.DataFrame(np.nan, index=frame.index, columns=frame.columns)
    values = frame.to_numpy(dtype=float)
    for i, idx in enumerate(frame.index):
        others = np.delete(values, i, axis=0)
        if others.shape[0] == 0:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out.loc[idx] = np.nanmedian(others, axis=0)
    return out


def _random_frame(rng: np.random.Generator, rows: int, cols: int, trial: int) -> pd.DataFrame:
    v = rng.normal(size=(rows, cols))
    if trial % 3 == 0:
        v = np.round(v, 1)  # ties
    v[rng.random((rows, cols)) < rng.choice([0.0, 0.1, 0.5, 0.95])] = np.nan
    if trial % 7 == 0 and v.size:
        v.flat[rng.integers(0, v.size)] = np.inf
        v.flat[rng.integers(0, v.size)] = -np.inf
    return pd.DataFrame(v, index=[10 + 3 * i for i in range(rows)], columns=list(range(5, 5 + cols)))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 65])
def test_leave_one_out_median_and_temporal_sigma_match_the_per_row_code(rows):
    rng = np.random.default_rng(rows)
    for trial in range(40):
        f = _random_frame(rng, rows, int(rng.integers(0, 12)), trial)
        got, want = leave_one_out_median(f), _loo_reference(f)
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        sig = [robust_sigma(f.loc[i].to_numpy(dtype=float)) for i in f.index]
        sig = [s for s in sig if np.isfinite(s)]
        assert temporal_sigma(f) == (float(np.median(sig)) if sig else 0.0)
    assert temporal_sigma(pd.DataFrame()) == 0.0
    assert MAD_SCALE == 1.4826


def test_rank_step_matrix_is_pivot_table_last():
    rng = np.random.default_rng(1)
    for trial in range(60):
        n = int(rng.integers(1, 300))
        df = pd.DataFrame({"rank": rng.integers(0, 9, n), "step": rng.integers(0, 30, n) * 2, "v": rng.normal(size=n)})
        df.loc[rng.random(n) < rng.choice([0.0, 0.3, 0.9]), "v"] = np.nan
        want = df.pivot_table(index="rank", columns="step", values="v", aggfunc="last").sort_index(axis=1)
        pd.testing.assert_frame_equal(rank_step_matrix(df, "v"), want, check_exact=True)
    # other dtypes go through pivot_table itself
    df = pd.DataFrame({"rank": [0, 1, 0], "step": [1, 1, 2], "b": [1, 2, 3]})
    pd.testing.assert_frame_equal(rank_step_matrix(df, "b"),
                                  df.pivot_table(index="rank", columns="step", values="b", aggfunc="last"))


def _cusum_reference(logr: pd.Series, k: float, h: float, min_steps: int, high_share: float) -> list[dict]:
    """cusum_runs as it was: over the Series' items."""
    runs: list[dict] = []
    S, start, n, n_high, cur, last_high = 0.0, None, 0, 0, None, None
    for step, x in logr.items():
        if not np.isfinite(x):
            continue
        S_new = S + x - k
        if S_new <= 0:
            if cur is not None:
                cur["end"] = last_high
                runs.append(cur)
            S, start, n, n_high, cur, last_high = 0.0, None, 0, 0, None, None
            continue
        if start is None:
            start = int(step)
        S = S_new
        n += 1
        if x > k:
            n_high += 1
            last_high = int(step)
        if cur is None and S >= h and n >= min_steps and n_high >= high_share * n:
            cur = dict(onset=start, detected=int(step))
    if cur is not None:
        cur["end"] = last_high
        runs.append(cur)
    return runs


@pytest.mark.parametrize("vector_min_rows", [0, 1000])  # the vectorized pass and the per-row loop
def test_cusum_over_all_ranks_matches_cusum_per_rank(vector_min_rows):
    rng = np.random.default_rng(2)
    k = float(np.log(1.08))
    for _ in range(150):
        rows, cols = int(rng.integers(1, 12)), int(rng.integers(0, 50))
        x = rng.normal(0, rng.choice([0.02, 0.1, 0.3]), size=(rows, cols)) + (rng.random((rows, 1)) < 0.3) * 0.2
        x[rng.random((rows, cols)) < 0.1] = np.nan
        x[rng.random((rows, cols)) < 0.02] = np.inf
        steps = sorted(int(s) for s in rng.choice(1000, cols, replace=False))
        h = rng.choice([0.1, 0.2, 0.5], rows)
        got = cusum_runs_rows(x, steps, k, h, 3, 0.6, vector_min_rows=vector_min_rows)
        for i in range(rows):
            want = _cusum_reference(pd.Series(x[i], index=steps), k, float(h[i]), 3, 0.6)
            assert got[i] == want == cusum_runs(pd.Series(x[i], index=steps), k, float(h[i]), 3, 0.6)


def test_rows_with_runs_keeps_every_row_with_a_persistent_run():
    rng = np.random.default_rng(3)
    for _ in range(50):
        flags = pd.DataFrame(rng.random((8, 30)) < rng.choice([0.05, 0.2, 0.6]), index=range(8), columns=range(30))
        kept = rows_with_runs(flags, 3)
        assert kept == sorted(kept)
        for r in flags.index:
            if persistent_runs(flags.loc[r], 3, 5):
                assert r in kept


def test_group_keys_once_per_distinct_list_same_keys():
    # the row-by-row path (lists, None, a float array, a missing group) ...
    groups = ["dp", "dp", "tp", "dp", None, "pp:0>1"]
    members = [np.array([3, 1, 2]), np.array([3, 1, 2]), [1, 0], np.array([1.0, 2.0]), None, np.array([], dtype=np.int64)]
    attempts = [0, 1, 0, 0, 0, 2]
    assert group_keys(groups, members, attempts) == [group_key(g, m, a) for g, m, a in zip(groups, members, attempts)]
    # ... and the bulk one (integer arrays, string groups, int attempts), with repeats, an empty list, mixed widths
    rng = np.random.default_rng(4)
    lists = [np.array([3, 1, 2]), np.array([1, 2, 3]), np.array([], dtype=np.int64), np.array([0, 1], dtype=np.int32),
             np.arange(64), np.arange(64)[::-1].copy(), np.array([7])]
    for _ in range(20):
        n = int(rng.integers(1, 200))
        members = [lists[i] for i in rng.integers(0, len(lists), n)]
        groups = [str(rng.choice(["dp", "tp", "world", "pp:0>1"])) for _ in range(n)]
        attempts = [int(a) for a in rng.integers(0, 3, n)]
        assert group_keys(groups, members, attempts) == [group_key(g, m, a) for g, m, a in
                                                          zip(groups, members, attempts)]


def test_member_counts_andsorted_members():
    from analyzers.checks.links import sorted_members
    from analyzers.collectives import member_counts

    s = pd.Series([np.array([2, 0, 1]), [4, 3], (), np.array([2, 0, 1])], index=[5, 6, 7, 8])
    pd.testing.assert_series_equal(member_counts(s), s.map(lambda gr: len(gr) if isinstance(gr, (list, tuple, np.ndarray)) else 0))
    s2 = pd.Series([np.array([1, 0]), None, "x"])
    pd.testing.assert_series_equal(member_counts(s2), pd.Series([2, 0, 0]))
    assert sorted_members(s) == [(0, 1, 2), (3, 4), (), (0, 1, 2)]


def test_live_telemetry_window_converts_only_new_samples_same_frame():
    from head.live_frames import ConvertedWindow
    from ranksight.tables import SPECS
    from ranksight import schema

    rnd = random.Random(0)
    conv = ConvertedWindow("r", "gpu")
    dq: deque = deque(maxlen=50)
    t = 0
    for it in range(120):
        for _ in range(rnd.choice([0, 0, 1, 7, 30, 80])):
            t += 1
            dq.append(schema.GpuSample(node=t % 3, host="h", gpu=t % 4, t=float(t), source="sim", simulated=True,
                                       name="x", uuid="u", util_pct=float(t % 100)))
        if it % 37 == 0:
            dq = deque(list(dq)[::-1], maxlen=50)  # not a continuation: converted whole
        rows = list(dq)
        if rows:
            assert conv.table(rows).to_pandas().equals(SPECS["gpu"].to_table("r", rows).to_pandas())


def test_live_collectives_frame_shares_equal_member_lists_same_content():
    import pyarrow as pa

    from head.live_frames import to_pandas_shared_lists

    members = [[3, 1, 2], [3, 1, 2], None, [], [0], [3, 1, 2], [1, 2, 3]]
    t = pa.table({"rank": list(range(7)), "group_ranks": pa.array(members, pa.list_(pa.int64())),
                  "group": ["dp"] * 7}).slice(1)  # a sliced table: offsets into the list buffers
    got, want = to_pandas_shared_lists(t, "group_ranks"), t.to_pandas()
    assert list(got.columns) == list(want.columns)
    pd.testing.assert_frame_equal(got.drop(columns="group_ranks"), want.drop(columns="group_ranks"))
    for a, b in zip(got["group_ranks"], want["group_ranks"]):
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))
    assert got["group_ranks"].iloc[0] is got["group_ranks"].iloc[4]  # equal lists: one object
    # the loader keys them as it keys one array per row
    keys = group_keys(got["group"].tolist(), got["group_ranks"].tolist(), [0] * len(got))
    assert keys == [group_key(g, m, 0) for g, m in zip(want["group"], want["group_ranks"])]


def _windowed_reference(df: pd.DataFrame, label: str, value: str, index: list, steps: list, window: int,
                        min_ops: int) -> pd.DataFrame:
    """The per-label loop windowed_medians replaced (comm's self-delay and links' communicators)."""
    med = pd.DataFrame(np.nan, index=index, columns=steps)
    s_arr = np.asarray(steps)
    for key, sub in df.groupby(label):
        if key not in med.index:
            continue
        sub = sub.sort_values("step", kind="stable")
        st_arr = sub["step"].to_numpy()
        dur = sub[value].to_numpy(dtype=float)
        lo = np.searchsorted(st_arr, s_arr - window, side="right")
        hi = np.searchsorted(st_arr, s_arr, side="right")
        med.loc[key] = [float(np.median(dur[a:b])) if b - a >= min_ops else np.nan for a, b in zip(lo, hi)]
    return med


def test_windowed_medians_match_the_per_label_loop():
    from analyzers.stats import windowed_medians

    rng = np.random.default_rng(5)
    for trial in range(60):
        n = int(rng.integers(0, 300))
        df = pd.DataFrame({"rank": rng.integers(0, 12, n), "gkey": [f"dp[{i}]" for i in rng.integers(0, 5, n)],
                           "step": rng.integers(0, 40, n), "v": np.round(rng.normal(10, 3, n), 1)})
        df.loc[rng.random(n) < 0.05, "v"] = np.nan
        steps = sorted(int(s) for s in rng.choice(50, int(rng.integers(1, 30)), replace=False))
        window, min_ops = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        ranks = list(range(0, 10))  # rows of ranks 10, 11 are left out
        got = windowed_medians(df["rank"], df["step"], df["v"], ranks, steps, window, min_ops)
        pd.testing.assert_frame_equal(got, _windowed_reference(df, "rank", "v", ranks, steps, window, min_ops),
                                      check_exact=True)
        keys = sorted(df["gkey"].unique())
        got = windowed_medians(df["gkey"], df["step"], df["v"], keys, steps, window, min_ops)
        pd.testing.assert_frame_equal(got, _windowed_reference(df, "gkey", "v", keys, steps, window, min_ops),
                                      check_exact=True)
