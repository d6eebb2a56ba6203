"""Robust statistics over rank x step matrices: noise (MAD), leave-one-out medians, windowed medians.

The checks compare each rank with its peers step by step. A cell's reference is the median of the *other* ranks
in that step (one slow rank cannot pull its own reference up); the noise a threshold is scaled by is a robust
spread (the median absolute deviation), estimated per rank over time so that many ranks shifting together do not
inflate it.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pandas as pd

MAD_SCALE = 1.4826  # MAD -> standard deviation for normal data


def robust_sigma(values: Iterable[float]) -> float:
    """The robust standard deviation (``MAD_SCALE`` x the median absolute deviation) of the finite values."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiu":  # numbers already: no Python per value
        arr = values.astype(float, copy=False).ravel()
        arr = arr[np.isfinite(arr)]
    else:
        arr = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if arr.size == 0:
        return 0.0
    return float(MAD_SCALE * np.median(np.abs(arr - np.median(arr))))


def temporal_sigma(frame: pd.DataFrame) -> float:
    """Noise of a rank x step frame of scores: the median over rows of each row's robust sigma over time.

    Estimating the spread per row (over time) and then taking the median across rows stays
    small when many rows shift together (half the world slow), where a pooled MAD would not.
    """
    # robust_sigma of every row at once: the same medians (nanmedian over the finite values), and 0.0 for a row
    # without any, as robust_sigma gives
    if frame.shape[0] == 0:
        return 0.0
    sig = row_robust_sigmas(frame.to_numpy(dtype=float))
    sig = sig[np.isfinite(sig)]
    return float(np.median(sig)) if sig.size else 0.0


def row_robust_sigmas(values: np.ndarray) -> np.ndarray:
    """``robust_sigma`` of each row of a 2-D array (non-finite values left out; 0.0 for a row without any)."""
    if values.shape[1] and np.isfinite(values).all():
        # every value finite (a full matrix): the same two medians without the masked copy, the deviations in place
        dev = values - median_rows(values)[:, None]
        np.abs(dev, out=dev)
        return MAD_SCALE * median_rows(dev, overwrite_input=True)
    v = np.where(np.isfinite(values), values, np.nan)
    has = ~np.isnan(v).all(axis=1)
    out = np.zeros(v.shape[0])
    if has.any():
        v = v[has]
        med = _nanmedian_rows(v)
        out[has] = MAD_SCALE * _nanmedian_rows(np.abs(v - med[:, None]))
    return out


def median_rows(v: np.ndarray, overwrite_input: bool = False) -> np.ndarray:
    """``np.median(v, axis=1)`` of a 2-D float array without NaN, the same floats: the middle value, or the mean of
    the two middle ones ((low + high) / 2, as np.mean of the two gives). np.median partitions an even row at its two
    middle places at once, which numpy does many times slower than at one place: here one single-place partition,
    and the next value up is the minimum of what lies above it."""
    n = v.shape[1]
    if n == 0 or v.shape[0] == 0 or v.dtype != np.float64:
        return np.median(v, axis=1)
    part = v if overwrite_input else v.copy()
    lo = (n - 1) // 2
    part.partition(lo, axis=1)
    low = part[:, lo]
    if n % 2:
        return low.copy()
    high = part[:, lo + 1:].min(axis=1)
    return (low + high) / 2.0


def _nanmedian_rows(v: np.ndarray) -> np.ndarray:
    """np.nanmedian along axis 1 of rows that each have a non-NaN value (no all-NaN warning to silence)."""
    if v.shape[1] == 0:
        return np.full(v.shape[0], np.nan)
    if not np.isnan(v).any():  # np.median's partition over every row at once: the same values, no per-row call
        return median_rows(v)
    return np.nanmedian(v, axis=1)


def leave_one_out_median(frame: pd.DataFrame) -> pd.DataFrame:
    """For a rank x step frame, each cell's reference: the median of the *other* rows in that column (NaNs left
    out; NaN where no other row has a value).

    Vectorized (deleting one row per rank and taking a median of the rest costs O(ranks^2 x steps)): sort each
    column once; the median of a column without one of its values is read off the sorted column at the one or two
    middle positions of the n - 1 values left, skipping the removed value's own position. As in np.nanmedian, an
    even count's median is (low + high) / 2."""
    values = frame.to_numpy(dtype=float)
    return pd.DataFrame(_loo_median(values), index=frame.index, columns=frame.columns, copy=False)  # a new array


LOO_BLOCK_CELLS = 1 << 20  # columns taken this many cells at a time: the temporaries stay a few tens of MB
LOO_FULL_BLOCK_CELLS = 1 << 17  # a matrix without NaN: its columns, transposed, this many cells at a time (in cache)


def _loo_median(values: np.ndarray) -> np.ndarray:
    n_rows, n_cols = values.shape
    if n_rows >= 2 and n_cols >= 1 and not np.isnan(values).any():
        return _loo_median_full(values)
    if n_rows >= 2 and n_cols > 1 and n_rows * n_cols > LOO_BLOCK_CELLS:
        # each column on its own: a block of columns at a time (a 1,024 x 10,000 matrix whole needs ~10 temporaries
        # of its size)
        out = np.empty((n_rows, n_cols))
        step = max(1, LOO_BLOCK_CELLS // n_rows)
        for c0 in range(0, n_cols, step):
            out[:, c0:c0 + step] = _loo_median_block(values[:, c0:c0 + step])
        return out
    return _loo_median_block(values)


def _loo_median_full(values: np.ndarray) -> np.ndarray:
    """``_loo_median_block``'s medians of a matrix without NaN (2 rows or more), from each column's order statistics
    (``LooStats``: one single-place partition and the minima above it; numpy partitions at several places many times
    slower than at one), a block of columns at a time so that the block stays in cache."""
    n_rows, n_cols = values.shape
    out = np.empty((n_rows, n_cols))
    step = max(32, LOO_FULL_BLOCK_CELLS // n_rows)  # 32 columns at least: a partition per row has a fixed cost
    for c0 in range(0, n_cols, step):
        block = np.asarray(values[:, c0:c0 + step], dtype=np.float64)
        out[:, c0:c0 + step] = LooStats.of(block).reference(block)
    return out


def _loo_median_block(values: np.ndarray) -> np.ndarray:
    """Each cell's leave-one-out column median, from one sort of the values (no argsort): a column of n valid values
    less one valid cell x leaves m = n - 1, whose median sits at the middle positions lo = (m - 1) // 2 and
    hi = m // 2 of what is left; the value left at position j is the sorted column's j-th if that one is below x,
    else its (j + 1)-th (x removed at its first position among equal values: removing another copy of x leaves the
    same values). A NaN cell removes nothing: the median of all n."""
    n_rows, n_cols = values.shape
    out = np.full((n_rows, n_cols), np.nan)
    if n_rows < 2 or n_cols == 0:
        return out
    valid = ~np.isnan(values)
    if valid.all():
        # every column holds n_rows values: only the few middle places read below need their sorted values (a
        # partition at those places puts them there, in linear time; a sort of every column cost twice as much)
        m_all = n_rows - 1
        places = {(m_all - 1) // 2, (m_all - 1) // 2 + 1, m_all // 2, m_all // 2 + 1, (n_rows - 1) // 2, n_rows // 2}
        srt = np.partition(values, sorted({min(max(k, 0), n_rows - 1) for k in places}), axis=0)
        lo, hi = (m_all - 1) // 2, m_all // 2  # the same places in every column: rows of the partitioned block
        return loo_median_of_full_columns(values, srt[lo], srt[lo + 1], *((srt[hi], srt[hi + 1]) if hi != lo else ()))
    else:
        srt = np.sort(values, axis=0)  # NaNs last
    n_valid = valid.sum(axis=0)  # per column
    cols = np.arange(n_cols)

    def at(i: np.ndarray) -> np.ndarray:  # srt[i[c], c] for each column c (i clipped into the column)
        return srt[np.clip(i, 0, n_rows - 1), cols]

    m = n_valid - 1  # values left by a valid cell
    lo, hi = (m - 1) // 2, m // 2
    with np.errstate(invalid="ignore", over="ignore"):
        lo_v = np.where(at(lo)[None, :] < values, at(lo)[None, :], at(lo + 1)[None, :])
        hi_v = np.where(at(hi)[None, :] < values, at(hi)[None, :], at(hi + 1)[None, :])
        med_valid = (lo_v + hi_v) / 2.0
        med_nan = (at((n_valid - 1) // 2) + at(n_valid // 2)) / 2.0  # a NaN cell: all n values
    ok_valid = valid & (m > 0)[None, :]
    ok_nan = ~valid & (n_valid > 0)[None, :]
    out[ok_valid] = med_valid[ok_valid]
    out[ok_nan] = np.broadcast_to(med_nan[None, :], out.shape)[ok_nan]
    return out


def loo_median_of_full_columns(values: np.ndarray, at_lo: np.ndarray, at_lo1: np.ndarray,
                               at_hi: np.ndarray | None = None, at_hi1: np.ndarray | None = None) -> np.ndarray:
    """Each cell's leave-one-out median, from its column's order statistics (every column full, no NaN): ``at_lo``,
    ``at_lo1`` the column's values at the others' lower middle place ``lo`` and ``lo + 1`` of the sorted column,
    ``at_hi``, ``at_hi1`` at the upper one (left out when the others are odd in number: the same place). A cell above
    the value at a place leaves it where it is; a cell at or below it moves the next value down into the place."""
    with np.errstate(invalid="ignore", over="ignore"):
        lo_v = np.where(at_lo[None, :] < values, at_lo[None, :], at_lo1[None, :])
        hi_v = lo_v if at_hi is None else np.where(at_hi[None, :] < values, at_hi[None, :], at_hi1[None, :])
        lo_v += hi_v
        lo_v /= 2.0
    return lo_v


class LooStats:
    """The column order statistics a group's leave-one-out reference is read off (``reference``): for a column of
    n values without NaN, removing a cell x leaves m = n - 1 values, whose median sits at places lo = (m - 1) // 2
    and hi = m // 2 of what is left; the value left at place j is the sorted column's j-th if that one is below x,
    else its (j + 1)-th (``_loo_median_block``'s arithmetic: ``loo_median_of_full_columns``)."""

    def __init__(self, n_rows: int, at: dict[int, np.ndarray]):
        m = n_rows - 1
        self.lo, self.hi = (m - 1) // 2, m // 2
        self.at = at  # place in the sorted column -> that value of each column

    @classmethod
    def of(cls, values: np.ndarray) -> "LooStats":
        """The statistics of ``values``' columns: one partition at lo of the columns laid out as rows (a partition
        at several places costs a selection pass per place, and a column's values are contiguous there), the
        minimum above it, and for an odd n the next one."""
        n_rows = values.shape[0]
        m = n_rows - 1
        lo, hi = (m - 1) // 2, m // 2
        cols = values.T.copy(order="C")  # a copy even where the transpose is contiguous: it is partitioned in place
        cols.partition(lo, axis=1)
        at = {lo: cols[:, lo].copy()}
        upper = cols[:, lo + 1:]
        at[lo + 1] = upper.min(axis=1)
        if hi != lo:
            # the second smallest above lo: the smallest once one copy of the smallest is out of the way
            upper[np.arange(upper.shape[0]), upper.argmin(axis=1)] = np.inf
            at[lo + 2] = upper.min(axis=1)
        return cls(n_rows, at)

    @classmethod
    def of_columns(cls, values: np.ndarray) -> "LooStats":
        """``of`` every column of a matrix without NaN (2 rows or more, a column or more), a block of columns at a
        time as ``_loo_median_full`` takes them (in cache): the statistics each column's reference is read off, for
        any of its rows or blocks (``columns``) when they are needed, without a reference matrix."""
        n_rows, n_cols = values.shape
        step = max(32, LOO_FULL_BLOCK_CELLS // n_rows)
        return cls.joined(n_rows, [cls.of(np.asarray(values[:, c0:c0 + step], dtype=np.float64))
                                   for c0 in range(0, n_cols, step)])

    def columns(self, c0: int, c1: int) -> "LooStats":
        """The statistics of columns ``c0`` to ``c1`` (excluded)."""
        out = object.__new__(LooStats)
        out.lo, out.hi, out.at = self.lo, self.hi, {k: v[c0:c1] for k, v in self.at.items()}
        return out

    @classmethod
    def joined(cls, n_rows: int, parts: list["LooStats"]) -> "LooStats":
        if len(parts) == 1:
            return parts[0]
        return cls(n_rows, {k: np.concatenate([p.at[k] for p in parts]) for k in parts[0].at})

    def reference(self, values: np.ndarray) -> np.ndarray:
        """The leave-one-out medians of ``values`` (rows of the group, the columns these statistics are of)."""
        lo, hi, at = self.lo, self.hi, self.at
        return loo_median_of_full_columns(values, at[lo], at[lo + 1], *((at[hi], at[hi + 1]) if hi != lo else ()))


def group_loo_median(code: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each row, the median of the *other* rows of its group (``code``) that have a value (NaN where none): what
    ``leave_one_out_median`` gives on a matrix with one column per group, without building it (a column per
    collective op instance would be ranks x ops). One sort by (group, value); the arithmetic is
    ``_loo_median``'s."""
    n = len(values)
    out = np.full(n, np.nan)
    if n == 0:
        return out
    values = np.asarray(values, dtype=float)
    order = np.lexsort((values, code))  # by group, then value (NaN last within its group); stable
    srt, cs = values[order], np.asarray(code)[order]
    starts = np.r_[0, np.flatnonzero(cs[1:] != cs[:-1]) + 1]
    sizes = np.diff(np.r_[starts, n])
    start = np.repeat(starts, sizes)
    valid_sorted = ~np.isnan(srt)
    n_valid = np.repeat(np.add.reduceat(valid_sorted.astype(np.int64), starts), sizes)
    pos = np.arange(n) - start  # each row's place in its sorted group
    m = np.where(valid_sorted, n_valid - 1, n_valid)
    lo, hi = (m - 1) // 2, m // 2
    lo = np.where(lo >= pos, lo + 1, lo)
    hi = np.where(hi >= pos, hi + 1, hi)
    ok = m > 0
    lo_v = srt[np.where(ok, start + lo, 0)]
    hi_v = srt[np.where(ok, start + hi, 0)]
    with np.errstate(invalid="ignore", over="ignore"):
        med = (lo_v + hi_v) / 2.0
    res = np.full(n, np.nan)
    res[ok] = med[ok]
    out[order] = res
    return out


def _label_codes(labels: Iterable[Any], index: list) -> np.ndarray:
    """Each label's place in ``index`` (-1: not in it). A categorical column is looked up by its categories (one
    lookup per communicator, not a string per record: millions at 16,384 ranks); integer labels (a caller's codes)
    as they are; others as objects."""
    if isinstance(labels, pd.Series) and isinstance(labels.dtype, pd.CategoricalDtype):
        codes = labels.cat.codes.to_numpy()
        if not len(codes):
            return np.zeros(0, np.int64)
        cat_pos = np.r_[pd.Index(index).get_indexer(labels.cat.categories.astype(object)), -1]  # code -1: missing
        missing = pd.Index(index).get_indexer(pd.Index([np.nan], dtype=object))[0] if (codes < 0).any() else -1
        cat_pos[-1] = missing  # a missing label where the index holds one (as a lookup of the value finds it)
        return cat_pos[codes].astype(np.int64)
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        labels = labels.astype(object)
    return pd.Index(index).get_indexer(labels) if len(labels) else np.zeros(0, np.int64)


def windowed_medians(labels: Iterable[Any], step: Iterable[Any], values: Iterable[float], index: list, steps: list,
                     window: int, min_ops: int, q: float = 0.5, weights: Iterable[float] | None = None,
                     _rows: np.ndarray | None = None) -> pd.DataFrame:
    """index x steps: for each row label and step s, the median (or the ``q`` quantile) of ``values`` of that label
    with a step in (s - window, s]; NaN with fewer than ``min_ops`` of them (labels not in ``index`` are left out).
    ``weights``: how many ops each value stands for (a collective record a node agent folded per step is its ops'
    mean, ranksight/collective_fold.py); they count toward ``min_ops``, and each value still counts once in the median.

    Every (label, step) cell at once: the values go into a dense label x step x k array (k: the most values one
    label has in one step; padding sorts last), each window is a view of ``window`` consecutive steps, and one sort
    along the window's values gives every median (a median per cell in Python cost labels x steps calls: minutes at
    16,384 ranks). Where the steps are too sparse for a dense grid, the rows of a label sorted by step make each
    window one contiguous slice (``_windowed_medians_by_label``). Both give what ``np.median`` / ``np.quantile``
    (linear) give on each window's values. Only the rows (labels) that have a window of at least ``min_ops`` values
    are computed: the others are NaN throughout (in the comm checks' windows of one op per step and communicator,
    every row), and their values are never sorted. ``_rows``: that mask over ``index``, when the caller knows it."""
    if weights is not None:
        w = np.asarray(weights, dtype=float)
        if len(w) and np.nanmax(w) > 1:
            labels, step = np.asarray(labels), np.asarray(step)
            enough = windowed_sums(labels, step, w, index, steps, window) >= max(min_ops, 1)
            # the medians of the rows with a window of enough ops only: the others are all NaN
            med = windowed_medians(labels, step, values, index, steps, window, 1, q, _rows=enough.any(axis=1))
            return med.where(enough)
    code = _label_codes(labels, index)
    step, vals = np.asarray(step), np.asarray(values, dtype=float)
    s_arr = np.asarray(steps)
    window = max(int(window), 1)
    if _rows is None and len(code) and len(s_arr) and np.issubdtype(step.dtype, np.integer) \
            and np.issubdtype(s_arr.dtype, np.integer):
        _rows = rows_with_window_count(code, step, len(index), s_arr, window, max(min_ops, 1))
    keep = code >= 0
    if _rows is not None:  # a row without a window of enough values is all NaN: its values are not sorted
        keep &= np.r_[np.asarray(_rows, dtype=bool), False][code]
    code, step, vals = code[keep], step[keep], vals[keep]
    if not len(code) or not len(s_arr):
        return pd.DataFrame(np.full((len(index), len(steps)), np.nan), index=index, columns=steps)
    if not (np.issubdtype(step.dtype, np.integer) and np.issubdtype(s_arr.dtype, np.integer)):
        return _windowed_medians_by_label(code, step, vals, index, steps, window, min_ops, q)
    g0, g1 = int(s_arr.min()) - window + 1, int(s_arr.max())  # the steps any window covers
    inside = (step >= g0) & (step <= g1)
    code, cell_step, vals = code[inside], step[inside].astype(np.int64) - g0, vals[inside]
    n_grid = g1 - g0 + 1
    labels_used = np.unique(code)
    # the k-th value of a (label, step): the rows sorted by cell, each one's place within its cell
    cell = code.astype(np.int64) * n_grid + cell_step
    order = np.argsort(cell, kind="stable")
    cs = cell[order]
    starts = np.r_[0, np.flatnonzero(np.diff(cs)) + 1] if len(cs) else np.zeros(0, np.int64)
    nth = np.arange(len(cs)) - np.repeat(starts, np.diff(np.r_[starts, len(cs)]))
    k = int(nth.max()) + 1 if len(nth) else 1
    dense_cells = len(labels_used) * n_grid * k * window
    if dense_cells > max(64 * len(cs), 1 << 22) * 4:  # sparse steps: a dense grid would dwarf the rows
        return _windowed_medians_by_label(code, step[inside], vals, index, steps, window, min_ops, q)
    out = np.full((len(index), len(s_arr)), np.nan)
    row_of = np.full(len(index), -1, np.int64)
    row_of[labels_used] = np.arange(len(labels_used))
    col = s_arr.astype(np.int64) - g0 - (window - 1)  # the first grid step of each output step's window
    contiguous_cols = len(col) > 0 and bool((np.diff(col) == 1).all())
    chunk = max(1, (1 << 23) // max(1, len(s_arr) * window * k))  # labels per pass: bounded memory
    sc, sstep, sval = code[order], cell_step[order], vals[order]
    for c0 in range(0, len(labels_used), chunk):
        part = labels_used[c0:c0 + chunk]
        lo, hi = np.searchsorted(sc, [part[0], part[-1] + 1])
        dense = np.full((len(part), n_grid, k), np.inf)
        li = row_of[sc[lo:hi]] - c0
        v = sval[lo:hi]
        dense[li, sstep[lo:hi], nth[lo:hi]] = np.where(np.isnan(v), np.inf, v)
        flat = li * n_grid + sstep[lo:hi]
        count = np.bincount(flat, minlength=len(part) * n_grid).reshape(len(part), n_grid)
        nans = np.bincount(flat, weights=np.isnan(v), minlength=len(part) * n_grid).reshape(len(part), n_grid)
        # each output step's window: ``window`` grid steps x k values, padding (inf) after the values when sorted
        if k * window <= SMALL_SORT:
            win = _sorted_small([dense[:, col + w, j] for w in range(window) for j in range(k)])
        else:
            view = np.lib.stride_tricks.sliding_window_view(dense, window, axis=1)  # part x steps x k x window
            # consecutive output steps (the usual case): a slice of the windows, not a gather (one copy less)
            win = view[:, int(col[0]):int(col[0]) + len(col)] if contiguous_cols else view[:, col]
            win = np.sort(win.reshape(len(part), len(s_arr), k * window), axis=2)
        csum = np.concatenate([np.zeros((len(part), 1), np.int64), np.cumsum(count, axis=1)], axis=1)
        nsum = np.concatenate([np.zeros((len(part), 1), np.int64), np.cumsum(nans, axis=1)], axis=1)
        n = csum[:, col + window] - csum[:, col]
        has_nan = (nsum[:, col + window] - nsum[:, col]) > 0
        out[part] = _sorted_quantile(win, n, q, min_ops, has_nan)
    return pd.DataFrame(out, index=index, columns=steps)


# Windows of at most this many values (the comm checks' 3-step windows of one or two ops per step) are sorted by a
# compare-exchange network over whole arrays: numpy's sort along a short last axis costs a call per window.
SMALL_SORT = 6


def _sorted_small(parts: list[np.ndarray]) -> np.ndarray:
    """``np.sort(np.stack(parts, axis=-1), axis=-1)`` for a few arrays of one shape without NaN (padding is inf):
    odd-even transposition, each compare-exchange one np.minimum and one np.maximum over the whole arrays. The same
    values in the same order: a sort of numbers without NaN has one result."""
    c = list(parts)
    n = len(c)
    for rnd in range(n):
        for i in range(rnd % 2, n - 1, 2):
            lo = np.minimum(c[i], c[i + 1])
            c[i + 1] = np.maximum(c[i], c[i + 1])
            c[i] = lo
    return np.stack(c, axis=-1)


def rows_with_window_count(code: np.ndarray, step: np.ndarray, n_rows: int, steps: np.ndarray, window: int,
                           min_count: float, weights: np.ndarray | None = None) -> np.ndarray:
    """Over rows 0..n_rows-1: does the row have a step s of ``steps`` whose window (s - window, s] holds at least
    ``min_count`` records (or, with ``weights``, that much weight)? ``code``: each record's row (-1: none); integer
    steps. One bincount of the records into a row x step grid and a running sum along it (no sort)."""
    s_arr = np.asarray(steps, dtype=np.int64)
    out = np.zeros(n_rows, dtype=bool)
    if not len(code) or not len(s_arr) or n_rows == 0:
        return out
    window = max(int(window), 1)
    g0, g1 = int(s_arr.min()) - window + 1, int(s_arr.max())
    keep = (code >= 0) & (step >= g0) & (step <= g1)
    width = g1 - g0 + 2  # column 0: before the grid (the running sum's zero)
    every = bool(keep.all())
    # each record's cell, in place (a temporary of 20 M records is 160 MB)
    cell = (code if every else code[keep]).astype(np.int64)
    cell *= width
    cell += step if every else step[keep]
    cell += 1 - g0
    w = None if weights is None else np.nan_to_num(np.asarray(weights, dtype=float)[keep])
    col = s_arr - g0 + 1
    if n_rows * width <= GRID_CELLS:  # one bincount of every record; the window sums a block of rows at a time
        grid = np.bincount(cell, weights=w, minlength=n_rows * width).reshape(n_rows, width)
        del cell
        np.cumsum(grid, axis=1, out=grid)
        block = max(1, (1 << 22) // max(len(col), 1))
        for r0 in range(0, n_rows, block):
            g = grid[r0:r0 + block]
            out[r0:r0 + block] = ((g[:, col] - g[:, col - window]) >= min_count).any(axis=1)
        return out
    # a wider grid: rows a block at a time (each block a pass over the records)
    block = max(1, (1 << 23) // width)
    for r0 in range(0, n_rows, block):
        r1 = min(n_rows, r0 + block)
        lo, hi = r0 * width, r1 * width
        sel = (cell >= lo) & (cell < hi)
        grid = np.bincount(cell[sel] - lo, weights=w[sel] if w is not None else None,
                           minlength=(r1 - r0) * width).reshape(r1 - r0, width)
        np.cumsum(grid, axis=1, out=grid)
        out[r0:r1] = ((grid[:, col] - grid[:, col - window]) >= min_count).any(axis=1)
    return out


GRID_CELLS = 1 << 25  # rows_with_window_count's grid in one piece up to this many cells (256 MB)


def windowed_sums(labels: Iterable[Any], step: Iterable[Any], values: Iterable[float], index: list, steps: list,
                  window: int) -> np.ndarray:
    """index x steps: for each row label and step s, the sum of ``values`` of that label with a step in
    (s - window, s] (integer steps)."""
    labels, step, vals = np.asarray(labels), np.asarray(step), np.asarray(values, dtype=float)
    if labels.dtype.kind not in "iu":
        labels = labels.astype(object)
    out = np.zeros((len(index), len(steps)))
    code = pd.Index(index).get_indexer(labels) if len(labels) else np.zeros(0, np.int64)
    s_arr = np.asarray(steps, dtype=np.int64)
    if not len(code) or not len(s_arr):
        return out
    window = max(int(window), 1)
    g0, g1 = int(s_arr.min()) - window + 1, int(s_arr.max())
    keep = (code >= 0) & (step >= g0) & (step <= g1)
    grid = np.zeros((len(index), g1 - g0 + 2))
    np.add.at(grid, (code[keep], step[keep].astype(np.int64) - g0 + 1), np.nan_to_num(vals[keep]))
    csum = np.cumsum(grid, axis=1)
    return csum[:, s_arr - g0 + 1] - csum[:, s_arr - g0 + 1 - window]


def _sorted_quantile(srt: np.ndarray, n: np.ndarray, q: float, min_ops: int, has_nan: np.ndarray) -> np.ndarray:
    """Along the last axis of ``srt`` (each row's ``n`` values sorted first): ``np.median`` (q = 0.5) or
    ``np.quantile`` (linear) of those values, the same floats; NaN where ``n < min_ops`` (or none), or where a value
    was NaN."""
    ok = (n >= max(min_ops, 1))
    nn = np.maximum(n, 1)
    take = lambda i: np.take_along_axis(srt, np.clip(i, 0, srt.shape[-1] - 1)[..., None], axis=-1)[..., 0]  # noqa: E731
    with np.errstate(invalid="ignore", over="ignore"):
        if q == 0.5:
            lo_v, hi_v = take((nn - 1) // 2), take(nn // 2)
            res = np.where(nn % 2 == 1, lo_v, (lo_v + hi_v) / 2.0)
        else:  # numpy's "linear" method, its own arithmetic (virtual index (n - 1) q, _get_gamma, _lerp)
            vi = (nn - 1) * q
            prev = np.floor(vi)
            gamma = vi - prev
            prev_i = np.clip(prev.astype(np.int64), 0, nn - 1)
            next_i = np.clip(prev.astype(np.int64) + 1, 0, nn - 1)
            a, b = take(prev_i), take(next_i)
            diff = b - a
            res = a + diff * gamma
            res = np.where(gamma >= 0.5, b - diff * (1 - gamma), res)
    res = np.where(ok & ~has_nan, res, np.nan)
    return res


def _windowed_medians_by_label(code: np.ndarray, step: np.ndarray, vals: np.ndarray, index: list, steps: list,
                               window: int, min_ops: int, q: float) -> pd.DataFrame:
    """``windowed_medians`` label by label: the rows of a label sorted by step (stably) make each window one
    contiguous slice, found with two searchsorted calls per label."""
    out = np.full((len(index), len(steps)), np.nan)
    if len(code) and len(steps):
        order = np.lexsort((step, code))  # by label, then step; stable: ties keep their row order
        code, step, vals = code[order], step[order], vals[order]
        bounds = np.flatnonzero(np.diff(code)) + 1
        s_arr = np.asarray(steps)
        for seg_code, lo_i, hi_i in zip(code[np.r_[0, bounds]], np.r_[0, bounds], np.r_[bounds, len(code)]):
            st_arr, dur = step[lo_i:hi_i], vals[lo_i:hi_i]
            lo = np.searchsorted(st_arr, s_arr - window, side="right")
            hi = np.searchsorted(st_arr, s_arr, side="right")
            ok = np.flatnonzero(hi - lo >= min_ops)
            if q == 0.5:
                out[seg_code, ok] = [float(np.median(dur[lo[j]:hi[j]])) for j in ok]
            else:
                out[seg_code, ok] = [float(np.quantile(dur[lo[j]:hi[j]], q)) for j in ok]
    return pd.DataFrame(out, index=index, columns=steps)


def few_group_medians(key: pd.Series, columns: dict[str, pd.Series]) -> pd.DataFrame:
    """``DataFrame(columns).groupby(key).agg(median)``, the same values and dtypes, for a key of few distinct values
    (a run's pipeline stages) over many rows: per group a mask and one selection per column instead of pandas'
    sort of every row by group. NaN left out as pandas does (a group of NaN only: NaN); the median of an even count is
    the mean of the two middle values in float64, as pandas' (then cast to the column's float type: float32 stays
    float32; integers give float64)."""
    k = key.to_numpy()
    groups = np.unique(k)
    if groups.dtype.kind == "f":
        groups = groups[~np.isnan(groups)]  # rows without a key are in no group (groupby's dropna)
    out = {}
    for name, col in columns.items():
        v = col.to_numpy()
        res = np.full(len(groups), np.nan)
        for i, g in enumerate(groups):
            x = v[k == g].astype(np.float64)
            x = x[~np.isnan(x)]
            if len(x):
                res[i] = np.median(x, overwrite_input=True)
        out[name] = res.astype(v.dtype) if v.dtype.kind == "f" else res
    return pd.DataFrame(out, index=pd.Index(groups, name=key.name))
