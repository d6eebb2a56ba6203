"""The heat map's rank x step matrix without ``pivot_table`` (issue 15): the same cells and bucket medians as the
pivot the report used to build (last non-missing record per rank and step, ranks and steps without a value left
out), and a report built on a run without calling pandas' pivot at all."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analyzers.loader import load_run
from analyzers.matrices import distinct_codes
from analyzers.report.heat import rank_step_matrix
from analyzers.report.model import build_report

FIXTURES = Path(__file__).parent / "fixtures" / "runs"


def pivot_reference(frame: pd.DataFrame, col: str) -> pd.DataFrame:
    """What model.py computed before: the pivot, then its columns in step order."""
    return frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)


def bucket_reference(piv: pd.DataFrame, max_cols: int) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
    steps = list(piv.columns)
    size = max(1, math.ceil(len(steps) / max_cols))
    buckets = [steps[i:i + size] for i in range(0, len(steps), size)]
    return (pd.DataFrame({b[0]: piv[b].median(axis=1) for b in buckets}),
            [(int(b[0]), int(b[-1])) for b in buckets])


def messy_steps(seed: int, ranks: int = 37, steps: int = 211) -> pd.DataFrame:
    """Records with gaps in ranks and steps, repeated (rank, step) records (a replay), missing values, a rank and a
    step with no value at all, shuffled."""
    rng = np.random.default_rng(seed)
    r = np.repeat(np.arange(ranks) * 3 + 5, steps)
    s = np.tile(np.arange(steps) * 2 + 100, ranks)
    v = rng.lognormal(3.0, 0.3, len(r)).round(2)  # rounded: equal values, so medians hit ties
    v[rng.random(len(v)) < 0.1] = np.nan
    v[r == 5 + 3 * 7] = np.nan  # a rank without any value
    v[s == 100 + 2 * 50] = np.nan  # a step without any value
    f = pd.DataFrame({"rank": r, "step": s, "compute_ms": v})
    again = f.sample(frac=0.2, random_state=seed).assign(compute_ms=lambda d: d["compute_ms"] * 1.5)
    again.loc[again.index[::7], "compute_ms"] = np.nan  # a replayed record without a value: the earlier one stays
    return pd.concat([f, again]).sample(frac=1.0, random_state=seed + 1).reset_index(drop=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_matrix_is_the_pivot(seed):
    f = messy_steps(seed)
    m = rank_step_matrix(f, "compute_ms")
    ref = pivot_reference(f, "compute_ms")
    got = m.frame()
    assert list(got.index) == list(ref.index) and list(got.columns) == list(ref.columns)
    assert 5 + 3 * 7 not in got.index and 200 not in got.columns
    np.testing.assert_array_equal(got.to_numpy(), ref.to_numpy(dtype=float))


@pytest.mark.parametrize("max_cols", [1, 7, 48, 120, 1000])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_bucket_medians_are_the_old_heat_map(max_cols, dtype):
    f = messy_steps(3).astype({"compute_ms": dtype})  # a store's *_ms columns are float32: so were the medians
    heat, spans = rank_step_matrix(f, "compute_ms").bucket_medians(max_cols)
    ref, ref_spans = bucket_reference(pivot_reference(f, "compute_ms"), max_cols)
    assert spans == ref_spans
    assert list(heat.index) == list(ref.index) and list(heat.columns) == list(ref.columns)
    assert (heat.dtypes == ref.dtypes).all()
    np.testing.assert_array_equal(heat.to_numpy(), ref.to_numpy())


def test_no_value_no_matrix():
    f = pd.DataFrame({"rank": [0, 1], "step": [1, 1], "compute_ms": [np.nan, np.nan]})
    heat, spans = rank_step_matrix(f, "compute_ms").bucket_medians(10)
    assert heat.empty and spans == []
    assert rank_step_matrix(f.iloc[:0], "compute_ms").frame().empty


def test_codes_of_sparse_and_compact_values_are_sorted_unique():
    for x in (np.array([7, 3, 3, 9, 7]), np.array([10**12, 5, 10**12, -3])):
        uniq, codes = distinct_codes(x)
        ref_uniq, ref_codes = np.unique(x, return_inverse=True)
        np.testing.assert_array_equal(uniq, ref_uniq)
        np.testing.assert_array_equal(codes, ref_codes)


def test_the_report_builds_no_pivot(monkeypatch):
    # pandas' pivot (and its per-bucket DataFrame.median) cost seconds on a thousand ranks x ten thousand steps
    data = load_run(str(FIXTURES), "real-4rank-slow", progress=False)
    ref, _ = bucket_reference(pivot_reference(data.steps, data.compute_signal()), 48)

    def no_pivot(*a, **k):
        raise AssertionError("the report called pivot_table")

    monkeypatch.setattr(pd.DataFrame, "pivot_table", no_pivot)
    report = build_report(data, [], [], None, with_plots=False)
    heat, _ = report.heat_map(48)
    np.testing.assert_array_equal(heat.to_numpy(), ref.to_numpy(dtype=float))


def test_step_rows_are_the_records_distinct_ranks_and_nodes():
    # a grid (its ranks the first step's), a grid where a rank moves node, shuffled rows (not a grid), gaps, empty
    from analyzers.matrices import step_grid
    from analyzers.report.model import StepRows

    ranks, steps = np.arange(12, dtype=np.int32), np.arange(5, dtype=np.int32)
    base = pd.DataFrame({"rank": np.tile(ranks, len(steps)), "step": np.repeat(steps, len(ranks)),
                         "node": np.tile(ranks // 4, len(steps)).astype(np.int64)})
    moved = base.copy()
    moved.loc[(moved["rank"] == 5) & (moved["step"] == 3), "node"] = 7
    shuffled = base.sample(frac=1.0, random_state=2)
    gap = base[~((base["rank"] == 11) & (base["step"] == 2))]
    for st in (base, moved, shuffled, gap, base.iloc[:0]):
        got = StepRows.of(st)
        assert got.ranks == sorted(int(r) for r in st["rank"].unique())
        assert got.nodes == sorted(int(n) for n in st["node"].unique())
        want = step_grid(st["rank"].to_numpy(), st["step"].to_numpy()) if len(st) else None
        assert (got.grid is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(got.grid[0], want[0])
            np.testing.assert_array_equal(got.grid[1], want[1])
            m, given = rank_step_matrix(st.assign(v=1.5), "v"), rank_step_matrix(st.assign(v=1.5), "v", grid=got.grid)
            np.testing.assert_array_equal(m.values, given.values)


def test_the_json_report_does_not_make_the_heat_matrix(monkeypatch):
    from analyzer_fixtures import build

    from analyzers.report import model
    from analyzers.report.render_json import render_json

    data = build(world=8, steps=20)
    report = build_report(data, [], [], [])
    want = rank_step_matrix(data.steps, data.compute_signal())
    monkeypatch.setattr(model, "rank_step_matrix", lambda *a, **k: pytest.fail("the heat matrix was made"))
    lazy = build_report(data, [], [], [])
    assert render_json(lazy) == render_json(report)
    monkeypatch.undo()
    got = build_report(data, [], [], []).cells
    np.testing.assert_array_equal(got.values, want.values)
    np.testing.assert_array_equal(got.ranks, want.ranks)
    assert report.cells is report.cells  # made once
