"""Small helpers shared by the analyzers: persistence runs, robust statistics, placement maps."""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

from ranksight.schema import SEVERITY_ORDER, Finding

MAD_SCALE = 1.4826  # MAD -> standard deviation for normal data


def persistent_runs(flags: pd.Series, persist: int, window: int) -> list[tuple[int, int, int]]:
    """Runs of flagged steps that persist.

    ``flags`` is a boolean Series indexed by step (sorted). A run is a maximal chain of
    flagged steps in which consecutive flagged steps are at most ``window - persist + 1``
    steps apart, so that "``persist`` flagged steps out of any ``window``" holds along it;
    a run counts only with at least ``persist`` flagged steps. Returns (first step,
    last step, flagged count) of each run; the first step is the onset.
    """
    flagged = [int(s) for s, f in flags.items() if bool(f)]
    if not flagged or persist <= 0:
        return []
    max_gap = max(1, window - persist + 1)
    runs: list[list[int]] = [[flagged[0]]]
    for s in flagged[1:]:
        if s - runs[-1][-1] <= max_gap:
            runs[-1].append(s)
        else:
            runs.append([s])
    return [(r[0], r[-1], len(r)) for r in runs if len(r) >= persist]


def rows_with_runs(flags: pd.DataFrame, persist: int) -> list:
    """The rows (labels, in order) of a rank x step frame of flags that can hold a persistent run: those with at
    least ``persist`` flagged steps (``persistent_runs`` of any other row is empty). The analyzers compute their
    flags for every rank at once and walk only these rows, not every rank every round."""
    if flags.empty:
        return []
    counts = flags.to_numpy(dtype=bool).sum(axis=1)
    return [r for r, c in zip(flags.index, counts) if c >= max(persist, 1)]


def confirmation_step(flags: pd.Series, start: int, persist: int) -> int:
    """The step at which a run starting at ``start`` had collected ``persist`` flagged steps."""
    n = 0
    for s, f in flags.items():
        if s < start or not bool(f):
            continue
        n += 1
        if n >= persist:
            return int(s)
    return int(start)


def robust_sigma(values: Iterable[float]) -> float:
    arr = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if arr.size == 0:
        return 0.0
    return float(MAD_SCALE * np.median(np.abs(arr - np.median(arr))))


def temporal_sigma(frame: pd.DataFrame) -> float:
    """Noise of a rank x step frame of scores: the median over rows of each row's robust sigma over time.

    Estimating the spread per row (over time) and then taking the median across rows stays
    small when many rows shift together (half the world slow), where a pooled MAD would not.
    """
    # robust_sigma of every row at once (the head runs this every round over ranks x steps): the same medians
    # (nanmedian over the finite values), and 0.0 for a row without any, as robust_sigma gives
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

    Vectorized, because the head runs it several times a round over ranks x steps (deleting one row per rank and
    taking a median of the rest cost O(ranks^2 x steps)): sort each column once; the median of a column without
    one of its values is read off the sorted column at the one or two middle positions of the n - 1 values left,
    skipping the removed value's own position. As in np.nanmedian, an even count's median is (low + high) / 2."""
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


def rank_step_matrix(frame: pd.DataFrame, col: str) -> pd.DataFrame:
    """``frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)``: a rank x
    step matrix of ``col`` (its last non-NaN value per (rank, step); ranks and steps without any left out).

    The analyzers build a dozen of these per round from the same step rows, and pivot_table's generic
    groupby + unstack costs ~10 ms each at 64 ranks x 256 steps; for a float column the same matrix is a few
    numpy operations. Other dtypes (where pivot_table's result dtype depends on gaps) go through pivot_table."""
    values = frame[col] if col in frame.columns else None
    if values is None or frame.empty or values.dtype != np.float64:
        return frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)
    x = values.to_numpy()
    keep = ~np.isnan(x)  # "last" skips NaN; a (rank, step) with only NaN is no cell, as in pivot_table
    r, s, x = frame["rank"].to_numpy()[keep], frame["step"].to_numpy()[keep], x[keep]
    if x.size == 0:
        return frame.pivot_table(index="rank", columns="step", values=col, aggfunc="last").sort_index(axis=1)
    ranks, ri = np.unique(r, return_inverse=True)
    steps, si = np.unique(s, return_inverse=True)
    cell = ri * len(steps) + si
    # the last row of each cell (row order, as groupby's "last"): the end of each run of a stable sort by cell
    order = np.argsort(cell, kind="stable")
    cs = cell[order]
    last = np.ones(len(cs), np.bool_)
    last[:-1] = cs[1:] != cs[:-1]
    take = order[last]
    out = np.full(len(ranks) * len(steps), np.nan)
    out[cell[take]] = x[take]
    return pd.DataFrame(out.reshape(len(ranks), len(steps)), index=pd.Index(ranks, name="rank"),
                        columns=pd.Index(steps, name="step"))


def windowed_medians(labels: Iterable[Any], step: Iterable[Any], values: Iterable[float], index: list, steps: list,
                     window: int, min_ops: int) -> pd.DataFrame:
    """index x steps: for each row label and step s, the median of ``values`` of that label with a step in
    (s - window, s]; NaN with fewer than ``min_ops`` of them (labels not in ``index`` are left out).

    The rows of a label sorted by step (stably) make each window one contiguous slice: one sort of all rows,
    then two searchsorted calls per label give every step's slice. (The comm analyzer's self-delay and
    communicators signatures run this every round, for every rank that arrived last somewhere.)"""
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
            out[seg_code, ok] = [float(np.median(dur[lo[j]:hi[j]])) for j in ok]
    return pd.DataFrame(out, index=index, columns=steps)


def fnum(x: Any, nd: int = 2) -> Any:
    """Round a number for evidence (JSON-safe: NaN/inf become None)."""
    if x is None:
        return None
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return x
    if not math.isfinite(xf):
        return None
    if float(xf).is_integer() and abs(xf) < 2**53 and nd == 0:
        return int(xf)
    return round(xf, nd)


def worst_severity(findings: Iterable[Finding]) -> str | None:
    worst = None
    for f in findings:
        if worst is None or SEVERITY_ORDER[f.severity] > SEVERITY_ORDER[worst]:
            worst = f.severity
    return worst


def fmt_ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(set(int(r) for r in ranks))
    if not ranks:
        return "-"
    return ",".join(str(r) for r in ranks)


def step_of_time(steps: pd.DataFrame, t: float) -> int | None:
    """The first step (any rank) that ended at or after wall time ``t``."""
    if steps.empty or t is None or not np.isfinite(t):
        return None
    ends = steps.groupby("step")["t_end"].max().sort_index()
    after = ends[ends >= t]
    if after.empty:
        return int(ends.index.max())
    return int(after.index[0])


def sorted_unique(values: Iterable[Any]) -> list[int]:
    return sorted({int(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))})


def transfer_ms(st: pd.DataFrame) -> pd.Series:
    """Exposed communication of each step row, without the time spent waiting for a slower peer.

    ``comm_ms`` is time blocked in collectives; of the gradient sync's ``sync_wait_ms`` the part
    above the step's smallest wait (the last arriver's: pure transfer) is waiting for the
    slowest rank, which is the straggler's cost, not communication.
    """
    wait = st["sync_wait_ms"].astype(float)
    min_wait = wait.groupby(st["step"]).transform("min")
    waiting = (wait - min_wait).fillna(0.0).clip(lower=0.0)
    return (st["comm_ms"] - waiting).clip(lower=0.0)


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
