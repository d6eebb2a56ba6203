"""The heat map's rank x step matrix, built with numpy codes rather than ``pivot_table``.

On a big run (a thousand ranks x ten thousand steps, or sixteen thousand ranks) pandas' pivot and a per-bucket
``DataFrame.median`` cost seconds; here each record's rank and step become integer codes and the matrix is filled by
one assignment (``analyzers.matrices.RankStepCells``, as the checks' matrices), and a step bucket's median per rank is one ``nanmedian`` over a slice. The values are the same as
``steps.pivot_table(index="rank", columns="step", values=col, aggfunc="last")``: a cell holds the last non-missing
record of that rank and step, and ranks or steps without any value have no row or column.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from analyzers.matrices import RankStepCells, step_grid


@dataclass
class RankStepMatrix:
    """``values[i, j]``: rank ``ranks[i]``'s value at step ``steps[j]`` (NaN where it has none); both sorted."""

    ranks: np.ndarray
    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def empty(cls) -> "RankStepMatrix":
        return cls(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.empty((0, 0)))

    def frame(self) -> pd.DataFrame:
        """As pandas: ranks as the index, steps as the columns (what ``pivot_table`` gave)."""
        return pd.DataFrame(self.values, index=pd.Index(self.ranks, name="rank"),
                            columns=pd.Index(self.steps, name="step"))

    def bucket_medians(self, max_cols: int) -> tuple[pd.DataFrame, list[tuple[int, int]]]:
        """Each rank's median over consecutive step buckets (at most ``max_cols`` of them, each the same number of
        steps but the last; a bucket is labelled with its first step), and each bucket's (first, last) step."""
        n = len(self.steps)
        if n == 0 or len(self.ranks) == 0:
            return self.frame(), []
        size = max(1, math.ceil(n / max_cols))
        starts = range(0, n, size)
        out = np.empty((len(self.ranks), len(starts)), dtype=self.values.dtype)
        with warnings.catch_warnings():  # a rank without a value in a bucket: NaN, as pandas' median gives
            warnings.simplefilter("ignore", RuntimeWarning)
            for k, i in enumerate(starts):
                out[:, k] = np.nanmedian(self.values[:, i:i + size], axis=1)
        spans = [(int(self.steps[i]), int(self.steps[min(i + size, n) - 1])) for i in starts]
        return pd.DataFrame(out, index=pd.Index(self.ranks, name="rank"),
                            columns=pd.Index([self.steps[i] for i in starts])), spans


NOT_GIVEN = object()


def rank_step_matrix(frame: pd.DataFrame, col: str, grid: Any = NOT_GIVEN) -> RankStepMatrix:
    """``frame[col]`` per rank and step: the last record's non-missing value of each (rank, step) (the builder's
    ``RankStepCells``, in the column's own float width). ``grid``: the rows' ``step_grid``, where the caller has it
    (None: they are not one)."""
    if frame.empty or col not in frame.columns:
        return RankStepMatrix.empty()
    # float32 stays float32 (a store's *_ms columns are): the pivot kept it, and its medians were float32 ones
    kind = np.float32 if str(frame[col].dtype).lower() == "float32" else np.float64
    v = frame[col].to_numpy(dtype=kind, na_value=np.nan)
    if grid is NOT_GIVEN:
        grid = step_grid(frame["rank"].to_numpy(), frame["step"].to_numpy())
    if grid is not None:  # a store's rows: the matrix is the column reshaped (no rows to place)
        ranks, steps = grid
        values = np.empty((len(ranks), len(steps)), dtype=kind)
        np.copyto(values, v.reshape(len(steps), len(ranks)).T)
        has = ~np.isnan(values)
        if has.all():
            return RankStepMatrix(ranks, steps, values)
        if has.any():  # the ranks and steps without any value left out, as placing the rows leaves them
            r, s = has.any(axis=1), has.any(axis=0)
            return RankStepMatrix(ranks[r], steps[s], values[r][:, s])
    keep = ~np.isnan(v)
    cells = RankStepCells(frame["rank"].to_numpy()[keep], frame["step"].to_numpy()[keep])
    return RankStepMatrix(cells.ranks, cells.steps, cells.values(v[keep], kind))
