"""The straggler check's scores at scale: log(own compute / the peers' leave-one-out median), one row per rank, worked
out a block of rows at a time (the temporaries stay in the CPU's cache), their noise, and which rows' CUSUMs can
alarm at all (``analyzers.checks.stragglers`` runs the CUSUM only on those)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analyzers.builder import StepView
from analyzers.stats import MAD_SCALE, LooStats, median_rows, robust_sigma, row_robust_sigmas

StragglerConfig = Any  # analyzers.checks.stragglers.StragglerConfig (not imported: that module imports this one)


# Rows of the scores are worked out this many cells at a time: the temporaries stay in the CPU's cache.
BLOCK_CELLS = 1 << 18


class RankScores:
    """The judged ranks' scores, log(own / peers' leave-one-out median), one row per rank (group after group, in
    each group's order), worked out a block of rows at a time; and what the CUSUMs need of them."""

    def __init__(self, steps: StepView, signal: str, comp: pd.DataFrame, judged: list[list[int]],
                 scratch: dict | None = None):
        values = comp.to_numpy(dtype=float)
        index = comp.index.tolist()
        pos_of = {r: i for i, r in enumerate(index)}
        self.ranks: list = [r for m in judged for r in m]
        self.logr = _scores_array(scratch, (len(self.ranks), values.shape[1]))
        self.row_sigma = np.empty(len(self.ranks))
        # each row's largest and smallest finite score (NaN for a row without any): cusum_rows leaves out the rows
        # whose every score is at or below the drift without running the bound over them
        self.row_max = np.empty(len(self.ranks))
        self.row_min = np.empty(len(self.ranks))
        # per group: its own rows, its peers' reference (the rows' array, or the columns' order statistics it is read
        # off), its first row
        self._own: list[tuple[np.ndarray, Any, int]] = []
        block = max(1, BLOCK_CELLS // max(1, values.shape[1]))
        first = 0
        full = not np.isnan(values).any()  # every group's rows without NaN: each group's reference from its columns
        for members in judged:
            out = self.logr[first:first + len(members)]
            if members == index or not full:
                own = values if members == index else _rows(values, [pos_of[r] for r in members])
            if members == index or (not full and np.isnan(own).any()):
                # the whole world's reference is the view's, shared with the checks that ask for it (comm)
                ref = steps.group_reference(signal, members).to_numpy(dtype=float)
                for b in range(0, len(members), block):
                    log_ratio(own[b:b + block], ref[b:b + block].copy(), out[b:b + block])
                self._own.append((own, ref, first))
            elif full:
                # a group's rows are read a block of columns at a time where they are needed, not gathered whole first
                own = PickedRows(values, [pos_of[r] for r in members])
                self._own.append((own, loo_log_ratios(values, out, own.rows), first))
            else:
                self._own.append((own, loo_log_ratios(own, out), first))
            for b in range(0, len(members), block):
                chunk = out[b:b + block]
                at = slice(first + b, first + b + len(chunk))
                self.row_sigma[at] = row_sigmas(chunk)
                self.row_max[at], self.row_min[at] = row_range(chunk)
            first += len(members)

    def own_and_peers(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i``'s own signal and its peers' median, by step."""
        for own, ref, first in reversed(self._own):
            if i >= first:
                row = own[i - first]
                return row, (ref[i - first] if isinstance(ref, np.ndarray) else ref.reference(row[None, :])[0])
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
        the sums) cannot alarm. A row whose every score is at or below the drift (``flat_rows``) never rises at all:
        the bound is run over the others only."""
        n, n_cols = self.logr.shape
        rows_in = np.flatnonzero(~flat_rows(self.row_max, self.row_min, drift, h, n_cols))
        whole = len(rows_in) == n  # every row: blocks of the array itself (slices), no gathered copy
        keep: list[np.ndarray] = []
        block = max(1, BLOCK_CELLS // max(1, n_cols))
        for b in range(0, len(rows_in), block):
            if whole:
                idx = slice(b, b + block)
                x = np.minimum(self.logr[idx], clip[idx, None])
            else:
                idx = rows_in[b:b + block]
                x = self.logr[idx]  # a gathered copy: clipped in place
                np.minimum(x, clip[idx, None], out=x)
            x -= drift
            if not np.isfinite(x).all():
                x[~np.isfinite(x)] = 0.0  # a skipped step adds nothing
            c = np.cumsum(x, axis=1)
            if n_cols:
                low = np.minimum(c, 0.0)
                np.minimum.accumulate(low, axis=1, out=low)
                np.subtract(c, low, out=c)
                rise = c.max(axis=1)
                # the sums' rounding is below n x eps x sum |y| <= n^2 x eps x max |y|: far below this margin
                margin = 1e-9 * n_cols * np.maximum(x.max(axis=1), -x.min(axis=1)) + 1e-12
            else:
                rise, margin = np.zeros(len(x)), 1e-12
            rows = np.arange(n)[idx] if whole else idx
            keep.append(rows[rise >= h[idx] - margin])
        rows = np.concatenate(keep) if keep else np.zeros(0, np.int64)
        return rows, np.minimum(self.logr[rows], clip[rows, None])


def row_range(lr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's largest and smallest score, NaN left out (NaN for a row of NaN only)."""
    if lr.shape[1] == 0:
        return np.full(lr.shape[0], np.nan), np.full(lr.shape[0], np.nan)
    return np.fmax.reduce(lr, axis=1), np.fmin.reduce(lr, axis=1)


def flat_rows(row_max: np.ndarray, row_min: np.ndarray, drift: float, h: np.ndarray, n_cols: int) -> np.ndarray:
    """The rows ``RankScores.cusum_rows``' bound would leave out, found from each row's range alone: every finite
    score at or below ``drift`` (clipped, less the drift, none is above 0), so the cumulative sums never rise and
    the bound's rise is exactly 0; and h above the bound's margin for that row (its largest |x| is drift - the
    row's smallest score; taken a little larger here, which can only keep a row). A row with an infinite score, or
    none finite, is not among them: the bound decides."""
    with np.errstate(invalid="ignore"):
        low = np.isfinite(row_min) & np.isfinite(row_max) & (row_max <= drift)
        margin = 1e-9 * n_cols * (drift - np.where(low, row_min, drift)) * (1.0 + 1e-6) + 2e-12
        return low & (h > margin)


def _scores_array(scratch: dict | None, shape: tuple[int, int]) -> np.ndarray:
    """The scores' array (every cell is written): the one in ``scratch`` (an attempt's second signal takes its first
    one's, whose scores are no longer read: its pages are already in memory), else a new one, left there."""
    got = scratch.get("logr") if scratch is not None else None
    if got is None or got.shape != shape:
        got = np.empty(shape)
        if scratch is not None:
            scratch["logr"] = got
    return got


class PickedRows:
    """Rows ``pos`` of ``values`` (a slice where they are consecutive), one at a time, without a copy of them all."""

    def __init__(self, values: np.ndarray, pos: list[int]):
        self.values = values
        consecutive = bool(pos) and pos == list(range(pos[0], pos[0] + len(pos)))
        self.rows: slice | np.ndarray = slice(pos[0], pos[0] + len(pos)) if consecutive else np.asarray(pos, np.intp)
        self._pos = pos

    def __getitem__(self, k: int) -> np.ndarray:
        return self.values[self._pos[k]]


def _rows(values: np.ndarray, pos: list[int]) -> np.ndarray:
    """``values[pos]``: a view where the rows are a run of consecutive ones (a pipeline stage's ranks, as placed
    most often), else a copy."""
    if pos and pos == list(range(pos[0], pos[0] + len(pos))):
        return values[pos[0]:pos[0] + len(pos)]
    return values[pos]


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
    """``np.median(x, axis)`` of a 2-D array without NaN (the same values) by ``stats.median_rows``' single-place
    partition; a column's values are laid out as a row first (one partition of rows is faster than one of columns)."""
    if x.shape[axis] == 0 or axis not in (0, 1) or x.ndim != 2:
        return np.median(x, axis=axis, overwrite_input=overwrite_input)
    if axis == 0:
        return median_rows(x.T.copy(order="C"), overwrite_input=True)
    return median_rows(x, overwrite_input=overwrite_input)


def log_ratio(own: np.ndarray, ref: np.ndarray, out: np.ndarray) -> None:
    """``out`` = log(own / ref), NaN where ref is 0 or the ratio is not positive. ``ref`` is overwritten."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ref[ref == 0] = np.nan
        np.divide(own, ref, out=ref)
        ref[~(ref > 0)] = np.nan
        np.log(ref, out=out)


# Columns of a group's leave-one-out reference are worked out this many cells at a time.
LOO_BLOCK_CELLS = 1 << 20


def loo_log_ratios(values: np.ndarray, out: np.ndarray, rows: slice | np.ndarray | None = None) -> LooStats:
    """``out`` = log(values / their leave-one-out column medians) (``log_ratio``) of a group's rows without NaN (at
    least 2), a block of columns at a time; returns the columns' ``LooStats`` (a row's reference is read off them
    again when it is needed, instead of holding the group's whole reference). ``rows``: the group's rows of
    ``values`` (default: all), taken a block at a time."""
    rows = slice(None) if rows is None else rows
    n_rows, n_cols = out.shape
    step = max(1, LOO_BLOCK_CELLS // max(1, n_rows))
    parts = []
    for c0 in range(0, n_cols, step):
        blk = values[rows, c0:c0 + step]
        st = LooStats.of(blk)
        log_ratio(blk, loo_reference(st, blk), out[:, c0:c0 + step])
        parts.append(st)
    return LooStats.joined(n_rows, parts)


# |x| at most this: x + x is finite, and (x + x) / 2 is x again
HALF_MAX = np.finfo(np.float64).max / 2


def loo_reference(st: LooStats, values: np.ndarray) -> np.ndarray:
    """``st.reference(values)``: where the others' median is one place (an even number of rows), the mean of that
    place's value with itself is the value (no sum that overflows: every finite one within ``HALF_MAX``), so the
    reference is the one selection without the sum and the halving (the same floats)."""
    if st.hi != st.lo:
        return st.reference(values)
    a, b = st.at[st.lo], st.at[st.lo + 1]
    with np.errstate(invalid="ignore"):
        if not (np.abs(a[np.isfinite(a)]) <= HALF_MAX).all() or not (np.abs(b[np.isfinite(b)]) <= HALF_MAX).all():
            return st.reference(values)
        return np.where(a[None, :] < values, a[None, :], b[None, :])


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
