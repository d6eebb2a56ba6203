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
            ref = steps.group_reference(signal, members).to_numpy(dtype=float)
            own = values if members == index else values[[pos_of[r] for r in members]]
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
    """``row_robust_sigmas(lr)``: where every score is finite, the same two medians per row without its copies of
    the block (the second one partitions its own temporary in place)."""
    if not np.isfinite(lr).all():
        return row_robust_sigmas(lr)
    if lr.shape[1] == 0:
        return np.zeros(lr.shape[0])
    med = np.median(lr, axis=1)
    return MAD_SCALE * np.median(np.abs(lr - med[:, None]), axis=1, overwrite_input=True)


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
