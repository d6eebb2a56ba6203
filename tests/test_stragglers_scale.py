"""The stragglers check at scale: one rank's TP evidence from its group's rows only, the same figures."""

import numpy as np
import pandas as pd
import pytest

from analyzers.builder import build_frame
from analyzers.checks import straggler_tp
from analyzers.checks.stragglers import tp_evidence, tp_wait_frame
from analyzers.loader import RunData


def _run(seed: int = 0) -> RunData:
    """8 ranks in two TP groups of 4, 30 steps, a TP all_reduce or two per rank and step with random waits; rank 5 has
    no TP ops in steps 10-14, rank 6 none in step 3, and the second group none in step 25 (a step only the other
    group's matrix rows have)."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(30):
        for r in range(8):
            if (r == 5 and 10 <= s < 15) or (r == 6 and s == 3) or (r >= 4 and s == 25):
                continue
            members = [0, 1, 2, 3] if r < 4 else [4, 5, 6, 7]
            for j in range(1 + (s + r) % 2):
                rows.append(dict(run_id="x", rank=r, step=s, seq=3 * s + j, op="all_reduce", group="tp", group_ranks=members,
                                 nbytes=1 << 20, t_arrive=100.0 + s, t_done=100.0 + s + 0.01,
                                 duration_ms=float(rng.uniform(0, 5)), attempt=0))
    steps = pd.DataFrame([dict(run_id="x", rank=r, step=s, node=r // 4, step_ms=100.0, compute_ms=50.0, t_end=100.0 + s)
                          for s in range(30) for r in range(8)])
    return RunData(run_id="x", steps=steps, collectives=pd.DataFrame(rows))


@pytest.mark.parametrize("shuffled", [False, True])
def test_one_ranks_tp_wait_frame_is_its_groups_rows_of_the_whole_one(shuffled):
    # collectives in step order (an episode's steps a slice of them) and shuffled (a mask over every row)
    data = _run()
    if shuffled:
        data.collectives = data.collectives.sample(frac=1.0, random_state=1).reset_index(drop=True)
    frame = build_frame(data)
    for rank, (s0, s1) in ((5, (8, 20)), (6, (0, 29)), (1, (2, 5)), (4, (20, 29))):
        full, members = tp_wait_frame(frame, s0, s1)
        got, got_members = tp_wait_frame(frame, s0, s1, rank)
        group = members[rank]
        assert got_members[rank] == group and set(got.index) == set(group)
        pd.testing.assert_frame_equal(got.loc[group].fillna(0.0), full.loc[group].fillna(0.0))
        ev = tp_evidence(frame, rank, s0, s1)
        assert ev["tp_group"] == group and ev["tp_least_wait_share"] is not None


def test_distinct_ascending_is_unique():
    for x in ([], [4], [1, 1, 2, 5, 5, 5, 9], [3, 3, 3]):
        a = np.asarray(x, dtype=np.int32)
        np.testing.assert_array_equal(straggler_tp._distinct_ascending(a), np.unique(a))


def test_tp_evidence_of_a_rank_without_tp_ops_is_empty():
    frame = build_frame(_run())
    assert tp_evidence(frame, 42, 0, 29) == {}
    assert tp_wait_frame(frame, 40, 50, 5)[0].empty


def test_leave_one_out_median_block_by_block_is_the_whole_matrix(monkeypatch):
    from analyzers import stats

    rng = np.random.default_rng(3)
    v = rng.normal(size=(37, 101))
    v[rng.random(v.shape) < 0.1] = np.nan
    v[:, 5] = np.nan
    v[3] = np.nan
    whole = stats._loo_median_block(v)
    monkeypatch.setattr(stats, "LOO_BLOCK_CELLS", 37 * 4)  # blocks of 4 columns (the last one shorter)
    np.testing.assert_array_equal(stats._loo_median(v), whole)


def test_small_windows_sort_as_numpy_does():
    from analyzers import stats

    rng = np.random.default_rng(5)
    for n in range(1, stats.SMALL_SORT + 1):
        parts = [np.round(rng.normal(size=(6, 7)), 1) for _ in range(n)]  # ties
        parts[0][0, 0] = np.inf
        parts[-1][1, 1] = -np.inf
        np.testing.assert_array_equal(stats._sorted_small(parts), np.sort(np.stack(parts, axis=-1), axis=-1))


def test_windowed_medians_same_with_the_network_and_numpys_sort(monkeypatch):
    from analyzers import stats

    rng = np.random.default_rng(6)
    n = 4000
    labels, step = rng.integers(0, 40, n), rng.integers(0, 60, n)
    values = np.round(rng.exponential(size=n), 2)
    values[rng.random(n) < 0.02] = np.nan
    got = [stats.windowed_medians(labels, step, values, list(range(40)), list(range(5, 60)), w, 2, q)
           for w in (1, 2, 3) for q in (0.5, 0.9)]
    monkeypatch.setattr(stats, "SMALL_SORT", 0)
    want = [stats.windowed_medians(labels, step, values, list(range(40)), list(range(5, 60)), w, 2, q)
            for w in (1, 2, 3) for q in (0.5, 0.9)]
    for a, b in zip(got, want):
        pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_search_in_the_arrays_own_type_is_searchsorted():
    x = np.array([-5, 0, 0, 3, 3, 3, 7, 2**31 - 1], dtype=np.int32)
    for v in (-(2**40), -(2**31), -6, -5, 0, 1, 3, 7, 8, 2**31 - 1, 2**31, 2**40):
        for side in ("left", "right"):
            assert straggler_tp._search(x, v, side) == int(np.searchsorted(x.astype(np.int64), v, side)), (v, side)
    f = np.array([0.5, 1.0, 2.0])
    assert straggler_tp._search(f, 1, "right") == 2


def test_steps_with_kept_rows_are_the_kept_rows_distinct_steps():
    rng = np.random.default_rng(4)
    for step in (np.repeat(np.arange(3, 40, dtype=np.int32), rng.integers(1, 6, 37)),  # dense, gaps of a step or two
                 np.array([2, 2, 5, 9, 9, 9, 30], dtype=np.int32), np.array([7], dtype=np.int64),
                 np.array([0, 10**6], dtype=np.int32), np.zeros(0, dtype=np.int32)):
        step = np.sort(step)
        step = step[(step % 7) != 4] if len(step) > 8 else step  # a few steps missing altogether
        for share in (0.0, 0.1, 0.5, 1.0):
            keep = rng.random(len(step)) < share
            np.testing.assert_array_equal(straggler_tp._steps_with(step, keep), np.unique(step[keep]))
