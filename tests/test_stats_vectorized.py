"""The vectorized statistics give the same floats as the per-label / per-column code they replace.

``windowed_medians`` (every (label, step) window at once) against ``_windowed_medians_by_label`` (a np.median /
np.quantile call per window), and ``group_loo_median`` against ``leave_one_out_median`` on the matrix with one column
per group: random data with NaNs, ties, several values per (label, step), steps outside the output range."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from analyzers import stats


def test_windowed_medians_equals_per_window_numpy():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n_labels, n_rows = int(rng.integers(1, 8)), int(rng.integers(0, 200))
        labels = [f"l{x}" for x in rng.integers(0, n_labels + 1, n_rows)]  # l<n_labels> is not in the index
        step = rng.integers(0, 40, n_rows)
        vals = rng.normal(10, 3, n_rows).round(int(rng.integers(0, 3)))  # rounding: ties
        if trial % 5 == 0 and n_rows:
            vals[rng.integers(0, n_rows)] = np.nan
        index = sorted({f"l{x}" for x in range(n_labels)})
        steps = sorted(set(rng.integers(0, 45, int(rng.integers(1, 30))).tolist()))
        window, min_ops = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        q = [0.5, 0.25, 0.9, 0.1][trial % 4]
        got = stats.windowed_medians(labels, step, vals, index, steps, window, min_ops, q)
        code = pd.Index(index).get_indexer(np.asarray(labels, dtype=object)) if n_rows else np.zeros(0, np.int64)
        keep = code >= 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = stats._windowed_medians_by_label(code[keep], step[keep], vals[keep], index, steps, window, min_ops, q)
        assert got.equals(want), (trial, window, min_ops, q)


def test_windowed_medians_integer_labels():
    got = stats.windowed_medians(np.array([7, 7, 7, 3]), np.array([1, 2, 3, 3]), [1.0, 5.0, 2.0, 9.0], [3, 7], [2, 3], 2, 1)
    assert got.loc[7].tolist() == [3.0, 3.5] and np.isnan(got.loc[3, 2]) and got.loc[3, 3] == 9.0


def test_group_loo_median_equals_leave_one_out_median():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n_groups, n_rows = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        m = rng.normal(1.7e9, 0.01, (n_rows, n_groups)).round(int(rng.integers(2, 9)))  # wall clocks: cancellation
        m[rng.random((n_rows, n_groups)) < 0.2] = np.nan
        want = stats.leave_one_out_median(pd.DataFrame(m)).to_numpy()
        r, c = np.nonzero(np.ones_like(m, bool))
        perm = rng.permutation(len(r))
        got = stats.group_loo_median(c[perm], m[r[perm], c[perm]])
        assert np.array_equal(got, want[r[perm], c[perm]], equal_nan=True)


def test_windowed_medians_rows_without_enough_values_are_not_sorted(monkeypatch):
    """A row whose every window has fewer than ``min_ops`` values is NaN throughout: its values are never sorted (the
    comm checks' 3-step windows of one op per communicator and step against ``link_min_ops`` = 4: every row)."""
    def no_sort(parts):
        raise AssertionError("sorted the values of rows that cannot have a median")

    monkeypatch.setattr(stats, "_sorted_small", no_sort)
    labels = np.repeat(np.arange(50), 100)
    step = np.tile(np.arange(100), 50)
    vals = np.random.default_rng(3).normal(10, 1, len(labels))
    got = stats.windowed_medians(labels, step, vals, list(range(50)), list(range(100)), 3, 4)
    assert got.shape == (50, 100) and got.isna().all().all()
    # weighted records (folded ops) that reach min_ops are computed, the others are NaN
    w = np.ones(len(labels))
    w[labels == 7] = 2
    monkeypatch.undo()
    got = stats.windowed_medians(labels, step, vals, list(range(50)), list(range(100)), 3, 4, weights=w)
    assert got.drop(index=7).isna().all().all() and got.loc[7, 2:].notna().all()


def test_windowed_medians_gate_keeps_every_value():
    """Rows that reach ``min_ops`` in some window only (min_ops up to 7, weights up to 3): the same floats as a
    median per window, and with weights as the unweighted medians masked by the windows' weight."""
    rng = np.random.default_rng(4)
    for trial in range(200):
        n_labels, n_rows = int(rng.integers(1, 8)), int(rng.integers(0, 200))
        labels = rng.integers(0, n_labels + 1, n_rows)
        step = rng.integers(0, 40, n_rows)
        vals = rng.normal(10, 3, n_rows).round(1)
        index = list(range(n_labels))
        steps = sorted(set(rng.integers(0, 45, int(rng.integers(1, 30))).tolist()))
        window, min_ops = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        code = pd.Index(index).get_indexer(labels)
        keep = code >= 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = stats._windowed_medians_by_label(code[keep], step[keep], vals[keep], index, steps, window, min_ops, 0.5)
        assert stats.windowed_medians(labels, step, vals, index, steps, window, min_ops).equals(want), trial
        w = rng.integers(1, 4, n_rows).astype(float)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            every = stats._windowed_medians_by_label(code[keep], step[keep], vals[keep], index, steps, window, 1, 0.5)
        enough = stats.windowed_sums(labels, step, w, index, steps, window) >= min_ops
        got = stats.windowed_medians(labels, step, vals, index, steps, window, min_ops, weights=w)
        if len(w) and w.max() > 1:
            assert got.equals(every.where(enough)), trial


def test_rows_with_window_count_equals_brute_force(monkeypatch):
    rng = np.random.default_rng(5)
    for trial in range(200):
        if trial == 100:  # the grid a block of rows at a time
            monkeypatch.setattr(stats, "GRID_CELLS", 1)
        n_rows, n = int(rng.integers(1, 9)), int(rng.integers(0, 120))
        code = rng.integers(-1, n_rows, n)
        step = rng.integers(-3, 50, n)
        steps = np.array(sorted(set(rng.integers(0, 50, int(rng.integers(1, 20))).tolist())))
        window, m = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        w = rng.integers(1, 3, n).astype(float) if trial % 2 else None
        got = stats.rows_with_window_count(code, step, n_rows, steps, window, m, w)
        ww = np.ones(n) if w is None else w
        want = [any(ww[(code == r) & (step > s - window) & (step <= s)].sum() >= m for s in steps) for r in range(n_rows)]
        assert got.tolist() == want, trial
