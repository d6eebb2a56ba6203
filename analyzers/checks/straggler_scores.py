"""The straggler check's scores at scale: log(own compute / the peers' leave-one-out median), one row per rank, worked
out a block of rows at a time (the temporaries stay in the CPU's cache), their noise, and which rows' CUSUMs can
alarm at all (``analyzers.checks.stragglers`` runs the CUSUM only on those)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analyzers.builder import StepView
from analyzers.stats import MAD_SCALE, robust_sigma, row_robust_sigmas

StragglerConfig = Any  # analyzers.checks.stragglers.StragglerConfig (not imported: that module imports this one)


# Rows of the scores are worked out this many cells at a time: the temporaries stay in the CPU's cache.
BLOCK_CELLS = 1 << 18


class RankScores:
    """The judged ranks' scores, log(own / peers' leave-one-out median), one row per rank (group after group, in
    each group's order), worked out a block of rows at a time; and what the CUSUMs need of them."""

    def __init__(self, steps: StepView, signal: str, comp: pd.DataFrame, judged: list[list[int]]):
        values = comp.to_numpy(dtype=float)
        index = comp.index.tolist()
        pos_of = {r: i for i, r in enumerate(index)}
        self.ranks: list = [r for m in judged for r in m]
        self.logr = np.empty((len(self.ranks), values.shape[1]))
        self.row_sigma = np.empty(len(self.ranks))
        self._own: list[tuple[np.ndarray, np.ndarray, int]] = []  # per group: own rows, peers' rows, first row
        block = max(1, BLOCK_CELLS // max(1, values.shape[1]))
        first = 0
        for members in judged:
            own = values if members == index else values[[pos_of[r] for r in members]]
            if members == index or np.isnan(own).any():
                # the whole world's reference is the view's, shared with the checks that ask for it (comm)
                ref = steps.group_reference(signal, members).to_numpy(dtype=float)
            else:
                ref = loo_median_values(own)
            self._own.append((own, ref, first))
            for b in range(0, len(members), block):
                o, p = own[b:b + block], ref[b:b + block]
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = o / np.where(p == 0, np.nan, p)
                    lr = np.log(np.where(ratio > 0, ratio, np.nan))
                self.logr[first + b:first + b + len(lr)] = lr
                self.row_sigma[first + b:first + b + len(lr)] = row_sigmas(lr)
            first += len(members)

    def own_and_peers(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i``'s own signal and its peers' median, by step."""
        for own, ref, first in reversed(self._own):
            if i >= first:
                return own[i - first], ref[i - first]
        raise IndexError(i)

    def noise_sigma(self, cfg: StragglerConfig) -> tuple[float, float | None]:
        """``noise_sigma`` of the scores (each row's robust spread is its own: taken a block at a time)."""
        sig = self.row_sigma[np.isfinite(self.row_sigma)]
        sigma = float(np.median(sig)) if sig.size else 0.0
        return with_baseline_noise(sigma, self.logr, cfg)

    def cusum_rows(self, drift: float, h: np.ndarray, clip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows whose CUSUM (scores clipped at ``clip``, drift ``drift``) can reach its threshold ``h``, and
        their clipped scores. The CUSUM S = max(0, S + x - drift) is the cumulative sum of x - drift less its
        running minimum (and 0): a row whose largest such rise is below h (less a margin far above the rounding of
        the sums) cannot alarm."""
        keep: list[np.ndarray] = []
        n, n_cols = self.logr.shape
        block = max(1, BLOCK_CELLS // max(1, n_cols))
        for b in range(0, n, block):
            x = np.minimum(self.logr[b:b + block], clip[b:b + block, None])
            x -= drift
            y = x if np.isfinite(x).all() else np.where(np.isfinite(x), x, 0.0)  # a skipped step adds nothing
            c = np.cumsum(y, axis=1)
            rise = (c - np.minimum.accumulate(np.minimum(c, 0.0), axis=1)).max(axis=1) if n_cols else np.zeros(len(x))
            # the sums' rounding is below n x eps x sum |y| <= n^2 x eps x max |y|: far below this margin
            margin = 1e-9 * n_cols * (np.abs(y).max(axis=1) if n_cols else 0.0) + 1e-12
            keep.append(b + np.flatnonzero(rise >= h[b:b + block] - margin))
        rows = np.concatenate(keep) if keep else np.zeros(0, np.int64)
        return rows, np.minimum(self.logr[rows], clip[rows, None])


def row_sigmas(lr: np.ndarray) -> np.ndarray:
    """``row_robust_sigmas(lr)``: where every score is finite, the same two medians per row (``median_finite``)
    without its copies of the block (the second one partitions its own temporary in place)."""
    if not np.isfinite(lr).all():
        return row_robust_sigmas(lr)
    if lr.shape[1] == 0:
        return np.zeros(lr.shape[0])
    med = median_finite(lr, axis=1)
    dev = lr - med[:, None]
    np.abs(dev, out=dev)
    return MAD_SCALE * median_finite(dev, axis=1, overwrite_input=True)


def median_finite(x: np.ndarray, axis: int, overwrite_input: bool = False) -> np.ndarray:
    """``np.median(x, axis)`` of an array without NaN (the same values: an even count's median is (low + high) / 2,
    as np.median's mean of the two gives). One partition at the lower middle place and the minimum of what lies
    above it: np.median partitions at both middle places and at the last one (its NaN test), and each place is a
    selection pass of its own."""
    n = x.shape[axis]
    if n == 0 or axis not in (0, 1) or x.ndim != 2:
        return np.median(x, axis=axis, overwrite_input=overwrite_input)
    k = (n - 1) // 2
    if overwrite_input:
        x.partition(k, axis=axis)
        part = x
    else:
        part = np.partition(x, k, axis=axis)
    low = np.take(part, k, axis=axis)
    if n % 2:
        return low
    high = part[k + 1:].min(axis=0) if axis == 0 else part[:, k + 1:].min(axis=1)
    low = low + high
    low /= 2.0
    return low


# Columns of a group's leave-one-out reference are worked out this many cells at a time.
LOO_BLOCK_CELLS = 1 << 20


def loo_median_values(values: np.ndarray) -> np.ndarray:
    """``analyzers.stats.leave_one_out_median`` of a rank x step array without NaN (the same values): each column's
    few middle order statistics from one partition at the lowest of them and the minima above it (a partition at
    several places costs a selection pass per place), a block of columns at a time."""
    n_rows, n_cols = values.shape
    out = np.empty((n_rows, n_cols))
    if n_rows < 2 or n_cols == 0:
        out.fill(np.nan)
        return out
    step = max(1, LOO_BLOCK_CELLS // n_rows)
    for c0 in range(0, n_cols, step):
        out[:, c0:c0 + step] = _loo_block(values[:, c0:c0 + step])
    return out


def _loo_block(values: np.ndarray) -> np.ndarray:
    """The leave-one-out column medians of a block without NaN: removing a cell x from a column of n values leaves
    m = n - 1, whose median sits at places lo = (m - 1) // 2 and hi = m // 2 of what is left; the value left at
    place j is the sorted column's j-th if that one is below x, else its (j + 1)-th (as in
    ``analyzers.stats._loo_median_block``, whose arithmetic this repeats)."""
    n_rows = values.shape[0]
    m = n_rows - 1
    lo, hi = (m - 1) // 2, m // 2
    part = np.partition(values, lo, axis=0)
    at = {lo: part[lo]}  # the sorted column's lo-th, (lo + 1)-th and, for an odd n, (lo + 2)-th values
    upper = part[lo + 1:]
    at[lo + 1] = upper.min(axis=0)
    if hi != lo:
        # the second smallest above lo: the smallest once one copy of the smallest is out of the way
        first = upper.argmin(axis=0)
        upper[first, np.arange(upper.shape[1])] = np.inf
        at[lo + 2] = upper.min(axis=0)
    with np.errstate(invalid="ignore", over="ignore"):
        lo_v = np.where(at[lo][None, :] < values, at[lo][None, :], at[lo + 1][None, :])
        hi_v = lo_v if hi == lo else np.where(at[hi][None, :] < values, at[hi][None, :], at[hi + 1][None, :])
        lo_v += hi_v
        lo_v /= 2.0
    return lo_v


def with_baseline_noise(sigma: float, logr: np.ndarray, cfg: StragglerConfig) -> tuple[float, float | None]:
    """``sigma`` floored by ``baseline_noise_weight`` x the pooled robust spread of the first ``baseline_steps``
    judged steps (when the run is long enough to have a warm-up and steps after it); and that spread."""
    base = None
    if logr.shape[1] >= 2 * cfg.baseline_steps:
        vals = logr[:, : cfg.baseline_steps].ravel()
        vals = vals[np.isfinite(vals)]
        if vals.size >= 2 * cfg.baseline_steps:
            base = robust_sigma(vals)
            sigma = max(sigma, cfg.baseline_noise_weight * base)
    return sigma, base
