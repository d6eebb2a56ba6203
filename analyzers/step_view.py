"""The builder's step views: a selection of step rows and the rank x step matrices over it (``StepView``), with the
step columns derived from the recorded ones (``DERIVED_COLUMNS``). Part of the builder (``analyzers/builder.py``,
which hands them out through ``AnalysisFrame`` and re-exports them); apart because of the builder's size.

What a view hands out is shared by every check of the round: read it, never modify it in place.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from analyzers.matrices import RankStepCells, grid_matrix, is_float, rank_step_matrix, step_grid
from analyzers.stats import LooStats, leave_one_out_median


# --------------------------------------------------------------------------
# Step columns derived from the recorded ones
# --------------------------------------------------------------------------


def transfer_ms(st: pd.DataFrame) -> pd.Series:
    """Exposed communication of each step row, without the time spent waiting for a slower peer.

    ``comm_ms`` is time blocked in collectives; of the gradient sync's ``sync_wait_ms`` the part
    above the step's smallest wait (the last arriver's: pure transfer) is waiting for the
    slowest rank, which is the straggler's cost, not communication. (Per step over ``st``'s rows: pass
    whole steps.)
    """
    wait = st["sync_wait_ms"].astype(float)
    min_wait = wait.groupby(st["step"]).transform("min")
    waiting = (wait - min_wait).fillna(0.0).clip(lower=0.0)
    return (st["comm_ms"] - waiting).clip(lower=0.0)


def grid_transfer_ms(st: pd.DataFrame, n_ranks: int) -> pd.Series:
    """``transfer_ms`` of rows that are a whole step x rank grid (``matrices.step_grid``: each step's rows together,
    ``n_ranks`` of them): each step's smallest wait is a row minimum of the reshaped column, not a groupby-transform
    (half a second at 10 M rows). The same values: a minimum is exact, and the clips keep what pandas' keep (NaN,
    and a zero's sign)."""
    # one new array, worked in place: the waits (a copy), less each step's smallest, then the transfer time
    col = st["sync_wait_ms"]
    out = col.to_numpy(dtype=np.float64, na_value=np.nan)
    if np.may_share_memory(out, col.to_numpy()):  # the column's own float64 array: not ours to change
        out = out.copy()
    by_step = out.reshape(-1, n_ranks)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as pandas gives (then 0)
        by_step -= np.fmin.reduce(by_step, axis=1)[:, None]  # fmin: NaN left out (NaN where a step has none)
        out[np.isnan(out)] = 0.0  # fillna(0.0)
        out[out < 0.0] = 0.0  # clip(lower=0.0): -0.0 and NaN kept (none left)
        comm = st["comm_ms"]
        comm = comm.to_numpy() if is_float(comm) else comm.to_numpy(dtype=np.float64, na_value=np.nan)
        np.subtract(comm, out, out=out)  # comm_ms - waiting (a float32 column widened first, as pandas does)
        out[out < 0.0] = 0.0
    return pd.Series(out, index=st.index, copy=False)


def total_wait_ms(st: pd.DataFrame) -> pd.Series:
    """Time each step row spent blocked for others: the gradient sync's wait plus the pipeline's p2p waits."""
    return st["sync_wait_ms"].fillna(0.0) + st["pipeline_wait_ms"].fillna(0.0)


def data_share(st: pd.DataFrame) -> pd.Series:
    """The share of each step row's time spent waiting for its batch (0 for a row without a step time)."""
    return pd.Series(np.where(st["step_ms"] > 0, st["data_ms"] / st["step_ms"].where(st["step_ms"] > 0, 1), 0.0),
                     index=st.index)


DERIVED_COLUMNS: dict[str, Callable[[pd.DataFrame], pd.Series]] = {
    "transfer_ms": transfer_ms, "total_wait_ms": total_wait_ms, "data_share": data_share}
ROW_WISE_DERIVED = frozenset({"total_wait_ms", "data_share"})  # each row's value from that row alone




MEDIAN_BLOCK_STEPS = 256  # StepView.per_step_median: this many steps' rows at a time


class StepView:
    """A selection of step rows (at most one per rank and step: the judged steps of a run, one attempt's) and the
    rank x step matrices over it, each built on first use.

    Columns are the step records' own or a derived one (``DERIVED_COLUMNS``: computed over these rows)."""

    def __init__(self, rows: pd.DataFrame):
        self.rows = rows
        self._derived: dict[str, pd.Series] = {}
        self._matrices: dict[str, pd.DataFrame] = {}
        self._references: dict[str, pd.DataFrame] = {}
        self._distinct: dict[str, list[int]] = {}

    def column(self, name: str) -> pd.Series:
        """A column of the rows, or a derived one."""
        if name not in DERIVED_COLUMNS:
            return self.rows[name]
        if name not in self._derived:
            grid = self._grid if name == "transfer_ms" else None
            self._derived[name] = (grid_transfer_ms(self.rows, len(grid[0])) if grid is not None
                                   else DERIVED_COLUMNS[name](self.rows))
        return self._derived[name]

    def release(self, name: str) -> None:
        """Forget the matrix, the reference and the derived column of ``name`` (a check done with a column no other
        check reads frees 80 MB a matrix at 1,024 x 10,000; one that asks again gets them rebuilt)."""
        self._matrices.pop(name, None)
        self._references.pop(name, None)
        self._derived.pop(name, None)

    def release_reference(self, name: str) -> None:
        """Forget the reference of ``name`` only (its matrix stays for the checks that read it): a check done with a
        reference no other check reads frees 80 MB at 1,024 x 10,000; one that asks again gets it rebuilt."""
        self._references.pop(name, None)

    def per_step_means(self, columns: dict[str, pd.Series]) -> pd.DataFrame:
        """``pd.DataFrame({"step": rows["step"], **columns}).groupby("step").agg(<each column's mean>)``: on a grid
        whose columns have no NaN, each step's rows are one contiguous segment, and pandas takes such means as
        ``np.add.reduceat`` over the float64 values divided by the segment sizes: the same call here, without the
        frame and the group numbering of 10 M rows. Otherwise (a gap, no grid) pandas' own (it then sums with
        compensation, skipping NaN)."""
        grid = self._grid
        if grid is not None and all(is_float(v) for v in columns.values()):
            ranks, steps = grid
            arrays = {name: v.to_numpy(dtype=np.float64) for name, v in columns.items()}
            if len(steps) and not any(np.isnan(a).any() for a in arrays.values()):
                starts = np.arange(len(steps), dtype=np.intp) * len(ranks)
                sizes = np.full(len(steps), float(len(ranks)))
                return pd.DataFrame({name: np.add.reduceat(a, starts) / sizes for name, a in arrays.items()},
                                    index=pd.Index(steps, name="step"))
        frame = pd.DataFrame({"step": self.rows["step"], **columns})
        return frame.groupby("step").agg(**{name: (name, "mean") for name in columns})

    def per_step_median(self, name: str) -> pd.Series:
        """``rows.groupby("step")[name].median()`` of a float column: on a grid, each step's rows are one row of the
        reshaped column (numpy's median of the same values in float64: the same middle values and mean of two, cast
        back to the column's width as pandas does); otherwise pandas'."""
        values = self.rows[name]
        grid = self._grid if is_float(values) else None
        if grid is None:
            return self.rows.groupby("step")[name].median()
        ranks, steps = grid
        column = values.to_numpy().reshape(len(steps), len(ranks))
        med = np.empty(len(steps))
        # a block of steps at a time: the float64 copy numpy's median sorts in place stays a block's, not the
        # column's (two temporaries of 80 MB at 1,024 x 10,000); each step's median is its own row's
        for s0 in range(0, len(steps), MEDIAN_BLOCK_STEPS):
            by_step = column[s0:s0 + MEDIAN_BLOCK_STEPS].astype(np.float64)
            if np.isnan(by_step).any():
                part = np.full(len(by_step), np.nan)
                has = ~np.isnan(by_step).all(axis=1)
                part[has] = np.nanmedian(by_step[has], axis=1)
            else:
                part = np.median(by_step, axis=1, overwrite_input=True)
            med[s0:s0 + MEDIAN_BLOCK_STEPS] = part
        # in the column's own width, as pandas gives it (its median in float64, the result cast back)
        return pd.Series(med.astype(values.dtype, copy=False), index=pd.Index(steps, name="step"), name=name)

    def matrix(self, name: str) -> pd.DataFrame:
        """Rank x step matrix of a column (``rank_step_matrix``)."""
        if name not in self._matrices:
            values = self.column(name)
            grid = self._grid if is_float(values) else None
            if grid is not None:
                ranks, steps = grid
                got = grid_matrix(values.to_numpy(), ranks, steps, slice(None), slice(None))
                if got is not None:
                    self._matrices[name] = got
                    return got
            if is_float(values) and not self.rows.empty and not values.isna().any():
                # a value in every row: every column without a gap has the same cells
                self._matrices[name] = self._cells.matrix(values.to_numpy(dtype=np.float64))
            else:
                src = self.rows
                if name in DERIVED_COLUMNS:
                    src = pd.DataFrame({"rank": self.rows["rank"], "step": self.rows["step"], name: values})
                self._matrices[name] = rank_step_matrix(src, name)
        return self._matrices[name]

    def distinct(self, name: str) -> list[int]:
        """The distinct ranks or steps of the rows (``name``: "rank" or "step"), sorted, as ints:
        ``sorted(int(x) for x in rows[name].unique())``, read off the grid where the rows are one (no pass over
        10 M rows and no Python int per row), kept for the next caller."""
        if name not in self._distinct:
            grid = self._grid
            values = (grid[0] if name == "rank" else grid[1]) if grid is not None else self.rows[name].unique()
            self._distinct[name] = sorted(int(x) for x in values)
        return self._distinct[name]

    @cached_property
    def _grid(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``step_grid`` of the rows: a column's matrix is then its values reshaped, with no rows to place."""
        return step_grid(self.rows["rank"].to_numpy(), self.rows["step"].to_numpy())

    @cached_property
    def _cells(self) -> RankStepCells:
        return RankStepCells(self.rows["rank"].to_numpy(), self.rows["step"].to_numpy())

    def reference(self, name: str) -> pd.DataFrame:
        """Each cell's reference: the median of the other ranks in that step (``leave_one_out_median``)."""
        if name not in self._references:
            self._references[name] = leave_one_out_median(self.matrix(name))
        return self._references[name]

    def row_reference(self, name: str) -> Callable[[int], pd.Series]:
        """A rank's row of ``reference(name)`` (``reference(name).loc[rank]``), when asked: off the reference when it
        is built already; else, where the matrix has a value in every cell, read off its columns' order statistics
        (``stats.LooStats``, worked out on the first call) for that row alone, without the reference matrix (80 MB at
        1,024 x 10,000) when a check reads a few rows of it; else the reference, built."""
        if name in self._references:
            ref = self._references[name]
            return lambda r: ref.loc[r]
        stats: list[LooStats | None] = []  # the matrix's column statistics; None: no full matrix

        def row(r: int) -> pd.Series:
            if name in self._references:
                return self._references[name].loc[r]
            m = self.matrix(name)
            values = m.to_numpy()
            if not stats:
                full = (values.dtype == np.float64 and values.shape[0] >= 2 and values.shape[1] >= 1
                        and not np.isnan(values).any())
                stats.append(LooStats.of_columns(values) if full else None)
            if stats[0] is None:
                return self.reference(name).loc[r]
            own = values[m.index.get_loc(r)][None, :]
            return pd.Series(stats[0].reference(own)[0], index=m.columns, name=r)

        return row

    def group_reference(self, name: str, members: list) -> pd.DataFrame:
        """The reference within a group of ranks (rows ``members`` of the matrix): the median of the group's other
        ranks in each step. The group of every rank, in the matrix's order, is ``reference``."""
        m = self.matrix(name)
        if list(members) == list(m.index):
            return self.reference(name)
        return leave_one_out_median(m.loc[members])

    def sub_matrix(self, name: str, ranks: Iterable[int], first: int, last: int) -> pd.DataFrame:
        """The matrix of ``ranks`` over steps ``first``..``last``: what ``rank_step_matrix`` gives on those rows
        alone (the ranks and steps without a value there left out)."""
        m = self.matrix(name)
        if m.empty:
            return m
        sub = m.loc[m.index.isin(list(ranks)), (m.columns >= first) & (m.columns <= last)]
        has = sub.notna()
        return sub.loc[has.any(axis=1).to_numpy(), has.any(axis=0).to_numpy()]

    def span_matrix(self, name: str, ranks: Iterable[int], first: int, last: int) -> pd.DataFrame:
        """``sub_matrix(name, ranks, first, last)``, built from those rows alone where the whole matrix is not built
        yet (a check that reads one group over one episode of a 16,384-rank run need not place every row). A
        derived column that is not row by row (transfer_ms: each step's smallest wait) takes the whole matrix."""
        if name in self._matrices or (name in DERIVED_COLUMNS and name not in ROW_WISE_DERIVED):
            return self.sub_matrix(name, ranks, first, last)
        grid = self._grid
        if grid is not None:
            all_ranks, steps = grid
            c0, c1 = int(np.searchsorted(steps, first, "left")), int(np.searchsorted(steps, last, "right"))
            at = np.flatnonzero(np.isin(all_ranks, np.fromiter((int(r) for r in ranks), np.int64)))
            rows = self.rows.iloc[c0 * len(all_ranks):c1 * len(all_ranks)]  # the span's steps: a slice, no copy
            values = (self._derived[name].iloc[c0 * len(all_ranks):c1 * len(all_ranks)] if name in self._derived
                      else DERIVED_COLUMNS[name](rows) if name in DERIVED_COLUMNS else rows[name])
            got = grid_matrix(values.to_numpy(), all_ranks, steps, at, slice(c0, c1)) if is_float(values) else None
            if got is not None:
                return got
        pos = self._span_rows(ranks, first, last)
        sub = self.rows.iloc[pos]
        values = (self._derived[name].iloc[pos] if name in self._derived
                  else DERIVED_COLUMNS[name](sub) if name in DERIVED_COLUMNS else sub[name])
        src = pd.DataFrame({"rank": sub["rank"].to_numpy(), "step": sub["step"].to_numpy(), name: values.to_numpy()})
        return rank_step_matrix(src, name)

    def _span_rows(self, ranks: Iterable[int], first: int, last: int) -> np.ndarray:
        """The positions of the rows of ``ranks`` in steps ``first``..``last``, in row order (steps in order: the
        span is a slice, found by bisection)."""
        step = self.rows["step"].to_numpy()
        if self._steps_sorted:
            lo, hi = int(np.searchsorted(step, first, side="left")), int(np.searchsorted(step, last, side="right"))
            in_span = np.ones(hi - lo, np.bool_)
        else:
            lo, hi = 0, len(step)
            in_span = (step >= first) & (step <= last)
        rank = self.rows["rank"].to_numpy()[lo:hi]
        return lo + np.flatnonzero(in_span & np.isin(rank, np.fromiter((int(r) for r in ranks), np.int64)))

    @cached_property
    def _steps_sorted(self) -> bool:
        step = self.rows["step"].to_numpy()
        return len(step) < 2 or bool((step[1:] >= step[:-1]).all())

    def has_rows(self, ranks: Iterable[int], first: int, last: int) -> bool:
        """Whether any of ``ranks`` has a row in steps ``first``..``last``."""
        return len(self._span_rows(ranks, first, last)) > 0
