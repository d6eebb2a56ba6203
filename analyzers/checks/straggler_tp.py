"""The straggler check's tensor-parallel evidence: the time each rank blocks in TP collectives per step, and whether
a candidate is the member of its TP group that waits least there (its partners wait for it). One rank's group is read
off the collectives alone, over its episode's steps (a slice of them where they are in step order, as a store leaves
them)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame
from analyzers.collectives import op_counts
from analyzers.evidence import fnum
from analyzers.matrices import distinct_codes


def tp_wait_frame(frame: AnalysisFrame, s0: int | None = None, s1: int | None = None,
                  rank: int | None = None) -> tuple[pd.DataFrame, dict[int, list[int]]]:
    """Time each rank spent blocked in tensor-parallel collectives per step (rank x step, ms), and each rank's TP
    group. Summed per step rather than matched by sequence number: a rank may record an async TP op its partner
    does not, so sequence numbers need not line up across a TP group. ``rank``: only that rank's TP group (its rows
    of the matrix, over the same steps: every step any rank's TP ops ran in), and only its members; the matrix of
    every rank is ranks x steps (10,000 steps post-mortem) where one group's is a few rows."""
    co = frame.data.collectives
    if co.empty:
        return pd.DataFrame(), {}
    # the TP rows with a duration (in s0..s1): a mask over the collectives, their rows taken once, only those needed;
    # collectives in step order (as a store leaves them): s0..s1 is a slice, and the kept rows' steps are in order
    step = co["step"].to_numpy()
    in_order = rank is not None and s0 is not None and _ascending(step)
    lo, hi = (_search(step, s0, "left"), _search(step, s1, "right")) if in_order else (0, len(co))
    keep = frame.group_mask("tp")[lo:hi] & co["duration_ms"].iloc[lo:hi].notna().to_numpy()
    if s0 is not None and not in_order:
        keep = keep & (step >= s0) & (step <= s1)
    if not keep.any():
        return pd.DataFrame(), {}
    all_steps = None
    if rank is None:
        tp = co[keep]
    else:
        # the whole matrix's steps: those with a kept row
        all_steps = _steps_with(step[lo:hi], keep) if in_order else _distinct_steps(step[lo:hi][keep])
        ranks_in = co["rank"].to_numpy()[lo:hi]
        gr = co["group_ranks"].iloc[lo + np.flatnonzero(keep & (ranks_in == rank))].dropna()
        gr = gr.iloc[0] if len(gr) else None
        group = sorted({int(x) for x in gr} | {int(rank)}) if isinstance(gr, (list, tuple, np.ndarray)) else [int(rank)]
        tp = co.iloc[lo + np.flatnonzero(keep & np.isin(ranks_in, np.asarray(group, dtype=np.int64)))]
    members: dict[int, list[int]] = {}
    for r, gr in tp.groupby("rank")["group_ranks"].first().items():
        if isinstance(gr, (list, tuple, np.ndarray)) and len(gr) > 1:
            members[int(r)] = sorted(int(x) for x in gr)
    # a folded record's duration is its ops' mean: it blocks once per op it stands for
    blocked = tp.assign(blocked_ms=tp["duration_ms"] * op_counts(tp))
    w = blocked.pivot_table(index="rank", columns="step", values="blocked_ms", aggfunc="sum")
    if all_steps is not None and len(w.columns) != len(all_steps):
        w = w.reindex(columns=pd.Index(all_steps, name="step"))
    return w, members


def _ascending(x: np.ndarray) -> bool:
    return len(x) < 2 or bool((x[1:] >= x[:-1]).all())


def _search(x: np.ndarray, v: int, side: str) -> int:
    """``np.searchsorted(x, v, side)`` of an integer array, ``v`` in the array's own type where it fits (numpy would
    first convert the whole array to the type both fit in)."""
    if x.dtype.kind in "iu":
        info = np.iinfo(x.dtype)
        if v < info.min:
            return 0
        if v > info.max:
            return len(x)
        return int(np.searchsorted(x, x.dtype.type(v), side))
    return int(np.searchsorted(x, v, side))


def _steps_with(step: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The distinct steps of the rows ``keep`` marks, ``step`` ascending: each step's rows found by bisection and
    asked whether any is kept (no gather of the kept rows' steps), where the steps are not much sparser than the
    rows."""
    if len(step) == 0 or step.dtype.kind not in "iu" or int(step[-1]) - int(step[0]) + 1 > len(step):
        return _distinct_ascending(step[keep])
    cand = np.arange(int(step[0]), int(step[-1]) + 1, dtype=step.dtype)
    starts = np.searchsorted(step, cand, "left")
    present = np.searchsorted(step, cand, "right") > starts
    cand, starts = cand[present], starts[present]
    return cand[np.logical_or.reduceat(keep, starts)]


def _distinct_ascending(x: np.ndarray) -> np.ndarray:
    """The distinct values of an ascending array (``np.unique``'s, without its sort)."""
    if len(x) == 0:
        return x.copy()
    return x[np.concatenate(([0], np.flatnonzero(x[1:] != x[:-1]) + 1))]


def _distinct_steps(step: np.ndarray) -> np.ndarray:
    """``distinct_codes(step)[0]`` (the distinct steps, sorted) without the codes."""
    if len(step) == 0 or step.dtype.kind not in "iu":
        return distinct_codes(step)[0]
    lo = int(step.min())
    if int(step.max()) - lo > 4 * len(step) + 1024:
        return distinct_codes(step)[0]
    off = (step - np.asarray(lo, dtype=step.dtype)).astype(np.intp, copy=False)
    return (np.flatnonzero(np.bincount(off) > 0) + lo).astype(step.dtype)


def tp_evidence(frame: AnalysisFrame, rank: int, s0: int, s1: int) -> dict:
    """Culprit vs its TP partners: the partners block in the TP all-reduces for the rank that computes longer,
    so the culprit is the member of its TP group that waits least there, by about its extra compute."""
    w, members = tp_wait_frame(frame, s0, s1, rank)
    group = [r for r in members.get(rank, []) if r in w.index]
    if rank not in group or len(group) < 2:
        return {}
    sub = w.loc[group].fillna(0.0)
    partners = sub.drop(index=rank)
    return dict(tp_group=group, tp_own_wait_ms=fnum(sub.loc[rank].median(), 1),
                tp_partners_wait_ms=fnum(partners.median().median(), 1),
                tp_partners_wait_minus_own_ms=fnum((partners.median() - sub.loc[rank]).median(), 1),
                tp_least_wait_share=fnum((sub.idxmin() == rank).mean(), 2))
