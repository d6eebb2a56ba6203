"""Rank x step matrices of step rows: where each row of a set of step records goes in a ranks x steps array, and the
array itself, without pandas' pivot (the builder's ``StepView``, the checks and the report's heat map share them).

A set of step rows is placed by ``RankStepCells`` (each cell's last row, as ``pivot_table(aggfunc="last")``), or,
where the rows already are a whole step x rank grid (``step_grid``: a store's steps and a live round's are), by a
reshape of the column (``grid_matrix``). ``distinct_codes`` numbers ranks and steps without a sort where it can.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def rank_step_matrix(frame: pd.DataFrame, col: str) -> pd.DataFrame:
    """``frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)``: a rank x
    step matrix of ``col`` (its last non-NaN value per (rank, step); ranks and steps without any left out).

    For a float column the same matrix is a few numpy operations instead of pivot_table's generic groupby and
    unstack. Other dtypes (where pivot_table's result dtype depends on gaps) go through pivot_table."""
    values = frame[col] if col in frame.columns else None
    if values is None or frame.empty or not is_float(values):
        return frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)
    x = values.to_numpy(dtype=np.float64)
    keep = ~np.isnan(x)  # "last" skips NaN; a (rank, step) with only NaN is no cell, as in pivot_table
    if not keep.any():
        return frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)
    return RankStepCells(frame["rank"].to_numpy()[keep], frame["step"].to_numpy()[keep]).matrix(x[keep])


def is_float(values: pd.Series) -> bool:
    """A float column of any width (the store's reader may narrow a column to float32): its matrix is float64."""
    return isinstance(values.dtype, np.dtype) and values.dtype.kind == "f"


def distinct_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(x, return_inverse=True)`` of integers without a sort where their span is not much wider than
    their count (ranks, steps): each present value marked, its code the count of present values below it."""
    x = np.asarray(x)
    if len(x) == 0 or x.dtype.kind not in "iu":
        return np.unique(x, return_inverse=True)
    lo, hi = int(x.min()), int(x.max())
    if hi - lo > 4 * len(x) + 1024:
        return np.unique(x, return_inverse=True)
    off = x - np.asarray(lo, dtype=x.dtype) if x.dtype.itemsize >= 4 and x.dtype.kind == "i" else x.astype(np.int64) - lo
    present = np.bincount(off, minlength=hi - lo + 1) > 0
    code = np.cumsum(present) - 1
    return (np.flatnonzero(present) + lo).astype(x.dtype), code[off]


class RankStepCells:
    """Where each row of a set of step rows goes in a rank x step matrix: the sorted ranks and steps, and the
    last row of each (rank, step) cell. Worked out once, it places any column of those rows."""

    def __init__(self, rank: np.ndarray, step: np.ndarray):
        self.ranks, ri = distinct_codes(rank)
        self.steps, si = distinct_codes(step)
        cell = ri.astype(np.int64) * len(self.steps) + si
        n_cells = len(self.ranks) * len(self.steps)
        if n_cells == len(cell) and (np.bincount(cell, minlength=n_cells) == 1).all():
            # one row in every cell (a run's every rank in every step): each cell's row is its last
            self.cell = np.arange(n_cells)
            self.take = np.empty(n_cells, np.int64)
            self.take[cell] = np.arange(n_cells)
            return
        if n_cells <= 4 * len(cell) + 1024:
            # the last row of each cell (row order, as groupby's "last"): the largest row number that lands in it
            last_row = np.full(n_cells, -1, np.int64)
            np.maximum.at(last_row, cell, np.arange(len(cell), dtype=np.int64))
            self.cell = np.flatnonzero(last_row >= 0)
            self.take = last_row[self.cell]
            return
        # the end of each run of a stable sort by cell
        order = np.argsort(cell, kind="stable")
        cs = cell[order]
        last = np.ones(len(cs), np.bool_)
        last[:-1] = cs[1:] != cs[:-1]
        self.take = order[last]
        self.cell = cell[self.take]

    def values(self, x: np.ndarray, dtype=np.float64) -> np.ndarray:
        """The rows' values ``x`` as a ranks x steps array of ``dtype`` (NaN where a cell has no row)."""
        n_cells = len(self.ranks) * len(self.steps)
        if len(self.cell) == n_cells:  # every cell has a row (``cell`` is sorted): one gather, no scatter
            return x[self.take].astype(dtype, copy=False).reshape(len(self.ranks), len(self.steps))
        out = np.full(n_cells, np.nan, dtype=dtype)
        out[self.cell] = x[self.take]
        return out.reshape(len(self.ranks), len(self.steps))

    def matrix(self, x: np.ndarray) -> pd.DataFrame:
        """The matrix of the rows' values ``x`` (float)."""
        return pd.DataFrame(self.values(x), index=pd.Index(self.ranks, name="rank"),
                            columns=pd.Index(self.steps, name="step"))


def step_grid(rank: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(ranks, steps) where step records are a whole step x rank grid: step after step, ascending, each step's rows
    the same ranks in ascending order (a store's steps and a live round's are); None where they are anything else."""
    if len(step) == 0 or rank.dtype.kind not in "iu" or step.dtype.kind not in "iu":
        return None
    other = np.flatnonzero(step != step[0])
    n = int(other[0]) if len(other) else len(step)
    if len(step) % n:
        return None
    ranks = rank[:n]
    if n > 1 and not bool((ranks[1:] > ranks[:-1]).all()):
        return None
    by_step = step.reshape(-1, n)
    steps = by_step[:, 0]
    if (len(steps) > 1 and not bool((steps[1:] > steps[:-1]).all())) or not bool((by_step == steps[:, None]).all()):
        return None
    if not bool((rank.reshape(-1, n) == ranks).all()):
        return None
    return ranks.copy(), steps.copy()


TRANSPOSE_STEPS = 64  # grid_matrix's transposing copy: this many steps at a time


def grid_matrix(values: np.ndarray, ranks: np.ndarray, steps: np.ndarray, rows, cols: slice) -> pd.DataFrame | None:
    """The rank x step matrix (float64) of a grid's ``values`` (step after step, each step's ranks in order; only
    the steps ``cols`` of it), rows ``rows`` of the ranks and those steps: ``rank_step_matrix``'s, the ranks and
    steps without a value left out. None where no cell has a value (``rank_step_matrix`` then)."""
    n_steps = len(steps[cols])
    by_step = values.reshape(n_steps, len(ranks))
    if not isinstance(rows, slice):
        by_step = by_step[:, rows]
    out = np.empty((by_step.shape[1], n_steps))
    # converted to float64 and transposed, a block of steps at a time (a whole transposing copy strides through
    # memory, and took three times as long)
    for c0 in range(0, n_steps, TRANSPOSE_STEPS):
        out[:, c0:c0 + TRANSPOSE_STEPS] = by_step[c0:c0 + TRANSPOSE_STEPS].T
    has = ~np.isnan(out)
    if not has.any():
        return None
    df = pd.DataFrame(out, index=pd.Index(ranks[rows], name="rank"), columns=pd.Index(steps[cols], name="step"),
                      copy=False)
    if has.all():
        return df
    return df.loc[has.any(axis=1), has.any(axis=0)]
