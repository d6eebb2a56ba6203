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
    sig = [robust_sigma(frame.loc[idx].to_numpy(dtype=float)) for idx in frame.index]
    sig = [s for s in sig if np.isfinite(s)]
    return float(np.median(sig)) if sig else 0.0


def leave_one_out_median(frame: pd.DataFrame) -> pd.DataFrame:
    """For a rank x step frame, each cell's reference: the median of the *other* rows in that column."""
    out = pd.DataFrame(np.nan, index=frame.index, columns=frame.columns)
    values = frame.to_numpy(dtype=float)
    for i, idx in enumerate(frame.index):
        others = np.delete(values, i, axis=0)
        if others.shape[0] == 0:
            continue
        with np.errstate(all="ignore"):
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out.loc[idx] = np.nanmedian(others, axis=0)
    return out


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
