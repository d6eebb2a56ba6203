"""The comm check's wait-deficit signature of a slow link: a rank that arrives at its collectives on time, while its
peers wait longer than it does, is slow to deliver its data (``comm`` merges what it finds with its other
signatures). Apart from comm.py because of its size; nothing else calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from analyzers.builder import StepView
from analyzers.checks.links import latest_finish_ms
from analyzers.checks.completion_leads import CompletionLeads
from analyzers.persistence import confirmation_step, persistent_runs, rows_with_runs
from analyzers.stats import LooStats, temporal_sigma

WAIT_BLOCK_CELLS = 1 << 17  # the arrival lags: this many cells at a time


def wait_deficit(cfg, view: StepView, skip: set[int], leads: CompletionLeads) -> list[dict]:
    """Peers wait for a rank that arrived on time: its data reaches them late (a slow link). ``cfg``: comm's
    ``CommConfig`` (not imported here: comm imports this module).

    Per step: deficit = peers' median sync wait - own sync wait (how much longer the others wait than
    it does); a compute straggler explains that by arriving late, so the unexplained part is
    deficit - max(arrival lag, 0). Persistent (3 of 5 steps) and above max(min_extra_ms, deficit_k sigma,
    10 % of the step) -> slow link of that rank.
    Unless the rank's own collectives end after its peers' (``links.latest_finish_ms`` over the span at least
    ``min_extra_ms``; ``leads``: ``completion_leads.CompletionLeads``): peers that waited for its data would be done after
    it, not before. (A rank whose data leaves late, a delay before it is sent, ends with them.)
    """
    st = view.rows
    if st["sync_wait_ms"].isna().all() or st["sync_arrival"].isna().all():
        return []
    wait = view.matrix("sync_wait_ms")
    arr = view.matrix("sync_arrival")
    step_ms = view.per_step_median("step_ms")
    if wait.shape[0] < 3 or wait.shape[1] < cfg.persist:
        return []
    wait_ref = view.reference("sync_wait_ms")
    try:
        return _wait_deficit_of(cfg, view, skip, leads, wait, wait_ref, arr, step_ms)
    finally:
        view.release("sync_arrival")  # read by this signature only (the straggler check places its own spans)


def _wait_deficit_of(cfg, view: StepView, skip: set[int], leads: CompletionLeads, wait: pd.DataFrame,
                     wait_ref: pd.DataFrame, arr: pd.DataFrame, step_ms: pd.Series) -> list[dict]:
    """``wait_deficit`` from the matrices it reads."""
    unexplained, lag_of = unexplained_wait_rows(wait, wait_ref, arr, lambda: view.reference("sync_arrival"))
    step_floor = 0.10 * step_ms.reindex(unexplained.columns).fillna(0)
    if not (unexplained.to_numpy(dtype=float) >= np.maximum(cfg.min_extra_ms, step_floor.to_numpy(dtype=float))[None, :]).any():
        return []  # no cell above the floor's fixed parts: none above the floor (its noise part is not needed)
    sigma = temporal_sigma(unexplained)
    floor = pd.Series(np.maximum(cfg.min_extra_ms, cfg.deficit_k * sigma), index=unexplained.columns)
    floor = np.maximum(floor, step_floor)
    out = []
    flag_rows = pd.DataFrame(unexplained.to_numpy(dtype=float) >= floor.to_numpy(dtype=float)[None, :],
                             index=unexplained.index, columns=unexplained.columns)
    for r in rows_with_runs(flag_rows, cfg.persist):
        if int(r) in skip:
            continue
        flags = flag_rows.loc[r]
        for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
            if latest_finish_ms(leads.of_rank(int(r)), int(r), s0, s1) >= cfg.min_extra_ms:
                continue  # it finished after its peers: they were not waiting for its data
            peers_wait = float(np.nanmedian(wait_ref.loc[r, s0:s1]))
            out.append(dict(rank=int(r), onset=s0, end=s1, n=n, own=float(np.nanmedian(wait.loc[r, s0:s1])), peers=peers_wait,
                            ratio=peers_wait / max(float(np.nanmedian(wait.loc[r, s0:s1])), 1e-3), comp_ratio=float("nan"),
                            confirmed=confirmation_step(flags, s0, cfg.persist), method="wait_deficit",
                            unexplained=float(np.nanmedian(unexplained.loc[r, s0:s1])),
                            lag=float(np.nanmedian(lag_of(r).loc[s0:s1]))))
    return out


def unexplained_wait_rows(wait: pd.DataFrame, wait_ref: pd.DataFrame, arr: pd.DataFrame,
                           arr_ref_of: Callable[[], pd.DataFrame]) -> tuple[pd.DataFrame, Callable[[int], pd.Series]]:
    """``unexplained_wait``'s matrix, and a rank's lag row (``lag_of(rank)``) when asked. Where the arrivals are
    every cell's (no NaN) over the waits' cells, the arrivals' reference is read off their columns' order statistics
    (``stats.LooStats``) a block of columns at a time, and a rank's lag from its own row: neither the reference nor
    the lag is a matrix (80 MB each at 1,024 x 10,000, at the comm check's high-water mark). The same arithmetic cell
    by cell. Else ``unexplained_wait`` with ``arr_ref_of()``, the arrivals' ``leave_one_out_median``."""
    values = arr.to_numpy()
    n_rows, n_cols = values.shape
    if not (wait.index.equals(arr.index) and wait.columns.equals(arr.columns) and values.dtype == np.float64
            and n_rows >= 2 and n_cols >= 1 and not np.isnan(values).any()):
        unexplained, lag = unexplained_wait(wait, wait_ref, arr, arr_ref_of())
        return unexplained, lambda r: lag.loc[r]
    stats = LooStats.of_columns(values)
    step = max(1, WAIT_BLOCK_CELLS // n_rows)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, as pandas gives it (silently)
        unexplained = np.subtract(wait_ref.to_numpy(), wait.to_numpy())
        for c0 in range(0, n_cols, step):
            block = values[:, c0:c0 + step]
            lag = np.subtract(block, stats.columns(c0, c0 + step).reference(block))
            lag *= 1000.0
            out = unexplained[:, c0:c0 + step]
            np.subtract(out, lag, out=out, where=~(lag < 0))

    def lag_of(r: int) -> pd.Series:
        row = values[arr.index.get_loc(r)][None, :]
        with np.errstate(invalid="ignore", over="ignore"):
            lag = np.subtract(row, stats.reference(row))
            lag *= 1000.0
        return pd.Series(lag[0], index=arr.columns)

    return pd.DataFrame(unexplained, index=wait.index, columns=wait.columns, copy=False), lag_of


def unexplained_wait(wait: pd.DataFrame, wait_ref: pd.DataFrame, arr: pd.DataFrame,
                      arr_ref: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(wait_ref - wait - lag.clip(lower=0), lag), lag = (arr - arr_ref) x 1000: the wait deficit less the arrival
    lag, in ms. Over the same cells, two new matrices instead of five (80 MB each at 1,024 x 10,000): where the lag
    is below zero its clip is 0, and x - 0.0 is x (NaN and -0.0 included); else pandas' aligned arithmetic."""
    if not (wait.index.equals(arr.index) and wait.columns.equals(arr.columns)):
        lag = (arr - arr_ref) * 1000.0
        return (wait_ref - wait) - lag.clip(lower=0), lag
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, as pandas gives it (silently)
        lag_values = np.subtract(arr.to_numpy(), arr_ref.to_numpy())
        lag_values *= 1000.0
        unexplained = np.subtract(wait_ref.to_numpy(), wait.to_numpy())
        np.subtract(unexplained, lag_values, out=unexplained, where=~(lag_values < 0))
    return (pd.DataFrame(unexplained, index=wait.index, columns=wait.columns, copy=False),
            pd.DataFrame(lag_values, index=arr.index, columns=arr.columns, copy=False))
