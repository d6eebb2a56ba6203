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
    v = np.where(np.isfinite(values), values, np.nan)
    has = ~np.isnan(v).all(axis=1)
    out = np.zeros(v.shape[0])
    if has.any():
        v = v[has]
        med = _nanmedian_rows(v)
        out[has] = MAD_SCALE * _nanmedian_rows(np.abs(v - med[:, None]))
    return out


def _nanmedian_rows(v: np.ndarray) -> np.ndarray:
    """np.nanmedian along axis 1 of rows that each have a non-NaN value (no all-NaN warning to silence)."""
    if v.shape[1] == 0:
        return np.full(v.shape[0], np.nan)
    return np.nanmedian(v, axis=1)


def leave_one_out_median(frame: pd.DataFrame) -> pd.DataFrame:
    """For a rank x step frame, each cell's reference: the median of the *other* rows in that column (NaNs left
    out; NaN where no other row has a value).

    Vectorized (deleting one row per rank and taking a median of the rest costs O(ranks^2 x steps)): sort each
    column once; the median of a column without one of its values is read off the sorted column at the one or two
    middle positions of the n - 1 values left, skipping the removed value's own position. As in np.nanmedian, an
    even count's median is (low + high) / 2."""
    values = frame.to_numpy(dtype=float)
    return pd.DataFrame(_loo_median(values), index=frame.index, columns=frame.columns)


def _loo_median(values: np.ndarray) -> np.ndarray:
    n_rows, n_cols = values.shape
    out = np.full((n_rows, n_cols), np.nan)
    if n_rows < 2 or n_cols == 0:
        return out
    order = np.argsort(values, axis=0, kind="stable")  # NaNs last
    srt = np.take_along_axis(values, order, axis=0)
    pos = np.empty_like(order)  # each cell's position in its sorted column
    np.put_along_axis(pos, order, np.arange(n_rows)[:, None].repeat(n_cols, axis=1), axis=0)
    valid = ~np.isnan(values)
    n_valid = valid.sum(axis=0)  # per column
    # a NaN cell removes nothing: the others are all n valid values; a valid cell leaves n - 1
    m = np.where(valid, n_valid[None, :] - 1, n_valid[None, :])
    lo, hi = (m - 1) // 2, m // 2  # the middle positions among the values left
    # positions at or after the removed value's own shift by one (a NaN cell's position is past every valid one)
    lo = np.where(lo >= pos, lo + 1, lo)
    hi = np.where(hi >= pos, hi + 1, hi)
    ok = m > 0
    cols = np.broadcast_to(np.arange(n_cols), (n_rows, n_cols))
    lo_v = srt[np.where(ok, lo, 0), cols]
    hi_v = srt[np.where(ok, hi, 0), cols]
    with np.errstate(invalid="ignore", over="ignore"):
        med = (lo_v + hi_v) / 2.0
    out[ok] = med[ok]
    return out


def windowed_medians(labels: Iterable[Any], step: Iterable[Any], values: Iterable[float], index: list, steps: list,
                     window: int, min_ops: int, q: float = 0.5) -> pd.DataFrame:
    """index x steps: for each row label and step s, the median (or the ``q`` quantile) of ``values`` of that label
    with a step in (s - window, s]; NaN with fewer than ``min_ops`` of them (labels not in ``index`` are left out).

    The rows of a label sorted by step (stably) make each window one contiguous slice: one sort of all rows,
    then two searchsorted calls per label give every step's slice."""
    out = np.full((len(index), len(steps)), np.nan)
    labels, step, vals = np.asarray(labels, dtype=object), np.asarray(step), np.asarray(values, dtype=float)
    code = pd.Index(index).get_indexer(labels) if len(labels) else np.zeros(0, np.int64)
    keep = code >= 0
    code, step, vals = code[keep], step[keep], vals[keep]
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
