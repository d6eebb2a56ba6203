"""Change detection on a rank's per-step scores: the one-sided CUSUM that raises an alarm, the onset it names.

``cusum_runs`` (Page's CUSUM) accumulates a score's excess over a drift and alarms once the sum passes a
threshold after enough steps, most of them above the drift; ``refine_onset`` then places the onset at the
least-squares change point of the excursion (the CUSUM itself starts on the first noisy-high step).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def cusum_runs(logr: pd.Series, k: float, h: float, min_steps: int, high_share: float) -> list[dict]:
    """One-sided CUSUM (Page) on a rank's log-score: S = max(0, S + x - k); an alarm when S >= h after at
    least ``min_steps`` steps of which ``high_share`` scored above k. Returns runs with onset (first step of
    the excursion), detection step (the alarm) and end (last slow step before S fell back to 0)."""
    return _cusum_row(list(logr.index), logr.tolist(), k, h, min_steps, high_share)


def _cusum_row(steps: list, xs: list, k: float, h: float, min_steps: int, high_share: float) -> list[dict]:
    """``cusum_runs`` over plain lists (Python floats: the same double arithmetic as numpy's, without a numpy
    call per step)."""
    runs: list[dict] = []
    S, start, n, n_high, cur, last_high = 0.0, None, 0, 0, None, None
    for step, x in zip(steps, xs):
        if not math.isfinite(x):
            continue
        S_new = S + x - k
        if S_new <= 0:
            if cur is not None:
                cur["end"] = last_high
                runs.append(cur)
            S, start, n, n_high, cur, last_high = 0.0, None, 0, 0, None, None
            continue
        if start is None:
            start = int(step)
        S = S_new
        n += 1
        if x > k:
            n_high += 1
            last_high = int(step)
        if cur is None and S >= h and n >= min_steps and n_high >= high_share * n:
            cur = dict(onset=start, detected=int(step))
    if cur is not None:
        cur["end"] = last_high
        runs.append(cur)
    return runs


def cusum_runs_rows(x: np.ndarray, steps: list, k: float, h: np.ndarray, min_steps: int,
                    high_share: float, vector_min_rows: int = 32) -> list[list[dict]]:
    """``cusum_runs`` of every row of ``x`` (ranks x steps, step labels ``steps``; row i's threshold ``h[i]``).

    From ``vector_min_rows`` rows on, in one pass over the steps with the ranks as vectors: the same runs
    without a Python loop per rank and step. Each row's update is cusum_runs' own, in the same float
    operations. Fewer rows go through the per-row loop, cheaper there than the vector pass's numpy calls per step."""
    n_rows = x.shape[0]
    if n_rows < vector_min_rows:
        return [_cusum_row(steps, x[i].tolist(), k, float(h[i]), min_steps, high_share) for i in range(n_rows)]
    out: list[list[dict]] = [[] for _ in range(n_rows)]
    S = np.zeros(n_rows)
    start = np.full(n_rows, -1, np.int64)  # -1: no excursion under way
    n = np.zeros(n_rows, np.int64)
    n_high = np.zeros(n_rows, np.int64)
    last_high = np.full(n_rows, -1, np.int64)  # -1: None
    alarmed = np.zeros(n_rows, np.bool_)  # a run (cur) is open
    onset = np.zeros(n_rows, np.int64)
    detected = np.zeros(n_rows, np.int64)

    def close(rows: np.ndarray) -> None:
        for i in np.nonzero(rows)[0]:
            end = int(last_high[i])
            out[i].append(dict(onset=int(onset[i]), detected=int(detected[i]), end=end if end >= 0 else None))

    for j, step in enumerate(steps):
        step = int(step)
        xj = x[:, j]
        fin = np.isfinite(xj)
        with np.errstate(invalid="ignore"):
            S_new = S + xj - k
        reset = fin & (S_new <= 0)
        close(reset & alarmed)
        S[reset], start[reset], n[reset], n_high[reset], last_high[reset] = 0.0, -1, 0, 0, -1
        alarmed &= ~reset
        go = fin & ~reset
        start[go & (start < 0)] = step
        S[go] = S_new[go]
        n += go
        high = go & (xj > k)
        n_high += high
        last_high[high] = step
        new = go & ~alarmed & (S >= h) & (n >= min_steps) & (n_high >= high_share * n)
        onset[new], detected[new] = start[new], step
        alarmed |= new
    close(alarmed)
    return out


def refine_onset(x: pd.Series, first: int, last: int, lookback: int = 10) -> int:
    """Least-squares change point over [first - lookback, last]: the split maximising
    n1*n2/(n1+n2) * (mean_after - mean_before)^2. CUSUM starts accumulating on the first noisy-high step,
    which can be early, and a noisy dip can restart it late; this is the onset the data supports best."""
    x = x.dropna()
    idx = list(x.index)
    if first not in idx:
        return first
    i0 = max(0, idx.index(first) - lookback)
    seg = x.loc[idx[i0]:last].to_numpy(dtype=float)
    steps = idx[i0: i0 + len(seg)]
    n = len(seg)
    if n < 2:
        return first
    csum = np.cumsum(seg)
    j = np.arange(1, n)
    mean_a = csum[:-1] / j
    mean_b = (csum[-1] - csum[:-1]) / (n - j)
    stat = j * (n - j) / n * (mean_b - mean_a) ** 2
    # candidates may precede the excursion's start: in noisy data a dip can reset the CUSUM after the true onset
    valid = mean_b > mean_a
    if not valid.any():
        return first
    stat = np.where(valid, stat, -1.0)
    best_t = steps[1 + int(np.argmax(stat))]
    return int(best_t)
