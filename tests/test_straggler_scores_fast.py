"""The straggler scores' order statistics (``analyzers.checks.straggler_scores``): one partition at the lower middle
place and the minima above it give np.median's medians and ``leave_one_out_median``'s references exactly (odd and
even counts, ties, infinities), for arrays in either memory order, and leave their input as it was (the partitions
work on copies: a transpose that is already contiguous is not the caller's array to reorder)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analyzers.checks import straggler_scores
from analyzers.checks.straggler_scores import LooStats, log_ratio, loo_log_ratios, loo_reference, median_finite
from analyzers.stats import leave_one_out_median


def _arrays():
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 4, 5, 8, 9, 64, 65):
        for kind in ("normal", "ties"):
            v = rng.normal(100.0, 5.0, (n, 37)) if kind == "normal" else rng.integers(0, 3, (n, 37)).astype(float)
            if n > 2:
                v[1, 3] = np.inf
            for order in ("C", "F"):
                yield np.array(v, order=order)


@pytest.mark.parametrize("axis", [0, 1])
def test_median_finite_is_np_median(axis):
    for v in _arrays():
        before = v.copy()
        assert np.array_equal(median_finite(v, axis), np.median(before, axis=axis))
        assert np.array_equal(v, before)  # untouched
        w = v.copy(order="K")
        assert np.array_equal(median_finite(w, axis, overwrite_input=True), np.median(before, axis=axis))


def test_loo_reference_is_leave_one_out_median():
    for v in _arrays():
        if v.shape[0] < 2:
            continue
        before = v.copy()
        want = leave_one_out_median(pd.DataFrame(before)).to_numpy()
        st = LooStats.of(v)
        assert np.array_equal(loo_reference(st, v), want, equal_nan=True)
        assert np.array_equal(loo_reference(st, v), st.reference(v), equal_nan=True)
        assert np.array_equal(v, before)


def test_loo_reference_near_the_largest_float():
    # an even number of rows (the others' median at one place): values whose sum would overflow take the sum's path,
    # and both give the same references (inf where (x + x) / 2 overflows)
    big = np.finfo(np.float64).max
    for vals in ([1.0, 2.0, 3.0, 4.0], [big, big / 2, big / 3, 1.0], [np.inf, -np.inf, 1.0, 2.0]):
        v = np.array(vals)[:, None] * np.ones((1, 3))
        st = LooStats.of(v)
        with np.errstate(over="ignore"):
            want = st.reference(v)
        assert np.array_equal(loo_reference(st, v), want, equal_nan=True)


def test_loo_log_ratios_and_a_rows_reference():
    for v in _arrays():
        if v.shape[0] < 2:
            continue
        before = v.copy()
        out = np.empty(v.shape)
        stats = loo_log_ratios(v, out)
        ref = leave_one_out_median(pd.DataFrame(before)).to_numpy()
        want = np.empty(v.shape)
        log_ratio(before, ref.copy(), want)
        assert np.array_equal(out, want, equal_nan=True)
        assert np.array_equal(v, before)
        assert isinstance(stats, LooStats)
        assert np.array_equal(stats.reference(v[-1:])[0], ref[-1], equal_nan=True)


def test_log_ratio_marks_a_zero_reference_and_a_non_positive_ratio():
    own = np.array([[2.0, 1.0, -1.0, 0.0]])
    ref = np.array([[1.0, 0.0, 1.0, 1.0]])
    out = np.empty(own.shape)
    with np.errstate(divide="ignore"):
        log_ratio(own, ref, out)
    assert out[0, 0] == np.log(2.0)
    assert np.isnan(out[0, 1:]).all()


def test_loo_log_ratios_of_picked_rows_are_those_of_the_rows_gathered():
    rng = np.random.default_rng(12)
    v = rng.normal(100.0, 5.0, (30, 41))
    for pos in ([3, 4, 5, 6, 7], [0, 7, 2, 29, 11, 12], list(range(30))):
        picked = straggler_scores.PickedRows(v, pos)
        want_out, got_out = np.empty((len(pos), 41)), np.empty((len(pos), 41))
        want = loo_log_ratios(v[pos], want_out)
        got = loo_log_ratios(v, got_out, picked.rows)
        assert np.array_equal(got_out, want_out)
        assert np.array_equal(got.reference(v[pos][-1:]), want.reference(v[pos][-1:]))
        assert all(np.array_equal(picked[k], v[p]) for k, p in enumerate(pos))


def test_rank_scores_of_groups_with_and_without_nan_elsewhere():
    # interleaved groups read in place (no NaN anywhere) or gathered (a NaN in another group's row): the same scores
    from analyzers.checks.straggler_scores import RankScores

    rng = np.random.default_rng(13)
    comp = pd.DataFrame(rng.normal(100.0, 5.0, (12, 25)), index=list(range(12)))
    groups = [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]

    class Steps:
        def __init__(self, m):
            self.m = m

        def group_reference(self, name, members):
            return leave_one_out_median(self.m.loc[members])

    clean = RankScores(Steps(comp), "x", comp, groups)
    gappy_comp = comp.copy()
    gappy_comp.iloc[2, 4] = np.nan  # rank 2: the third group only
    gappy = RankScores(Steps(gappy_comp), "x", gappy_comp, groups)
    for i, r in enumerate(clean.ranks):
        group = next(g for g in groups if r in g)
        ref = leave_one_out_median(comp.loc[group]).loc[r].to_numpy()
        want = np.empty((1, 25))
        log_ratio(comp.loc[[r]].to_numpy(), ref[None, :].copy(), want)
        assert np.array_equal(clean.logr[i], want[0])
        own, peers = clean.own_and_peers(i)
        assert np.array_equal(own, comp.loc[r].to_numpy()) and np.array_equal(peers, ref)
        if r % 3 != 2:  # the groups without the NaN: the same scores either way
            assert np.array_equal(gappy.logr[i], want[0])
