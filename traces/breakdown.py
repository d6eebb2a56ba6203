"""Per-rank analyses of one ``RankTrace``: HTA's, each with its definition stated (times in ms in the output).

Windows (``window=``):

- ``"all"``: the first GPU event's start to the last one's end (every kernel, copy and set).
- ``"steps"``: the span of the ``ProfilerStep#N`` steps. A GPU event belongs to the step during which it was
  launched (its runtime event's start; for an event without one, its own start). Step k's window runs from
  the end of step k-1's window (for the first step: its first GPU event) to the end of its last GPU event, so
  the windows tile the steps' span and sum to it. ``steps=(a, b)`` keeps steps a..b.
- ``"steps-hta"``: ``"steps"`` without the last step, as HTA drops it by default
  (``include_last_profiler_step=False``).

Temporal breakdown (HTA ``get_temporal_breakdown``, with memory time counted as busy, as HTA also does since it
takes every event with a stream): within the window, ``compute`` = |union of compute kernels|; then each other
kind counts only where nothing earlier in the order compute > comm > memcpy > memset runs: ``comm`` (exposed
communication), ``memcpy``, ``memset``; ``idle`` = window - |union of all GPU events|. Hence
window = compute + comm + memcpy + memset + idle. HTA's ``non_compute`` is comm + memcpy + memset here.
Where we differ from HTA: kernels without a launch event are kept (HTA drops them), times are not rounded to
whole microseconds, and the window is selectable.

Idle-time breakdown (HTA ``get_idle_time_breakdown``): per stream, the gap before each GPU event since the
previous one on that stream ended is ``host_wait`` when the event's launch started after that end (the CPU
was late), else ``kernel_wait`` when shorter than ``kernel_wait_us`` (HTA's ``consecutive_kernel_delay``,
30 in its microsecond columns), else ``other``. We also classify the GPU-wide idle (gaps in the union of all
streams) the same way by the event that ends each gap: the figure whose sum is the temporal ``idle``.

Comm-compute overlap (HTA ``get_comm_comp_overlap``): |compute ∩ comm| / |comm|.
CUDA launch statistics (HTA ``get_cuda_kernel_launch_stats``): launch delay = GPU start - launch end, clipped
at 0; ``short`` = launch CPU time <= ``runtime_cutoff_us`` and GPU time < CPU time; outliers over
``runtime_cutoff_us`` (CPU time) and ``launch_delay_cutoff_us``. Events without a launch are counted apart.
Queue length (HTA ``get_queue_length_time_series``): per stream, +1 at each launch, -1 when its GPU event
starts; the time-weighted mean and the max.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from traces.model import KIND_COMM, KIND_COMPUTE, KIND_MEMCPY, KIND_NAMES, RankTrace

WINDOWS = ("all", "steps", "steps-hta")


def merge(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint union of [s, e) intervals."""
    if not len(s):
        return np.zeros(0), np.zeros(0)
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(run_end, idx)


class Cover:
    """A union of intervals that answers |union ∩ [lo, hi]| for many windows at once."""

    def __init__(self, s: np.ndarray, e: np.ndarray):
        self.s, self.e = merge(s, e)
        self.cum = np.concatenate([[0.0], np.cumsum(self.e - self.s)])

    def within(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        lo = np.atleast_1d(np.asarray(lo, dtype=np.float64))
        hi = np.atleast_1d(np.asarray(hi, dtype=np.float64))
        if not len(self.s):
            return np.zeros(len(lo))
        i = np.searchsorted(self.e, lo, side="right")  # first interval ending after lo
        j = np.searchsorted(self.s, hi, side="left")  # intervals starting before hi: < j
        tot = self.cum[np.maximum(j, i)] - self.cum[i]
        has = j > i
        ii = np.minimum(i, len(self.s) - 1)
        jj = np.maximum(j - 1, 0)
        tot = tot - np.where(has, np.maximum(0.0, lo - self.s[ii]), 0.0)
        tot = tot - np.where(has, np.maximum(0.0, self.e[jj] - hi), 0.0)
        return np.maximum(tot, 0.0)


def op_steps(t: RankTrace) -> np.ndarray:
    """Index into t.steps of the step each GPU event belongs to (by launch time), -1 outside every step."""
    n = len(t.gpu)
    if not len(t.steps) or not n:
        return np.full(n, -1, dtype=np.int64)
    key = np.where(np.isnan(t.gpu.launch_ts), t.gpu.ts, t.gpu.launch_ts)
    st = t.steps.ts
    o = np.argsort(st, kind="stable")
    idx = np.searchsorted(st[o], key, side="right") - 1
    out = np.where(idx >= 0, o[np.maximum(idx, 0)], -1)
    last = o[-1]
    out = np.where((out == last) & (key > t.steps.end[last]), -1, out)
    return out


def step_windows(t: RankTrace, ops_step: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step numbers, window start, window end) for the steps with GPU events, tiled as the module doc says."""
    if ops_step is None:
        ops_step = op_steps(t)
    end = t.gpu.ts + t.gpu.dur
    nums, lo, hi = [], [], []
    prev_end = None
    for k in np.argsort(t.steps.num, kind="stable").tolist():
        m = ops_step == k
        if not m.any():
            continue
        first = float(t.gpu.ts[m].min())
        last = float(end[m].max())
        start = first if prev_end is None else min(prev_end, first)
        if prev_end is not None and last < prev_end:
            last = prev_end
        nums.append(int(t.steps.num[k]))
        lo.append(start)
        hi.append(last)
        prev_end = last
    return np.asarray(nums, dtype=np.int64), np.asarray(lo), np.asarray(hi)


class RankAnalysis:
    """The covers of one rank, built once and asked for any windows."""

    def __init__(self, t: RankTrace):
        self.t = t
        g = t.gpu
        end = g.ts + g.dur
        k = g.kind
        self.end = end
        self.c = Cover(g.ts[k == KIND_COMPUTE], end[k == KIND_COMPUTE])
        self.comm = Cover(g.ts[k == KIND_COMM], end[k == KIND_COMM])
        m1 = (k == KIND_COMPUTE) | (k == KIND_COMM)
        self.cm = Cover(g.ts[m1], end[m1])
        m2 = m1 | (k == KIND_MEMCPY)
        self.cmp = Cover(g.ts[m2], end[m2])
        self.busy = Cover(g.ts, end)
        self.ops_step = op_steps(t)

    def temporal(self, lo: np.ndarray, hi: np.ndarray) -> dict[str, np.ndarray]:
        """Arrays (us) per window: compute, comm (exposed), memcpy, memset, idle, comm_total, overlap."""
        c = self.c.within(lo, hi)
        cm = self.cm.within(lo, hi)
        cmp_ = self.cmp.within(lo, hi)
        busy = self.busy.within(lo, hi)
        comm_total = self.comm.within(lo, hi)
        return {"window": np.asarray(hi) - np.asarray(lo), "compute": c, "comm": cm - c, "memcpy": cmp_ - cm,
                "memset": busy - cmp_, "idle": np.maximum(0.0, np.asarray(hi) - np.asarray(lo) - busy),
                "comm_total": comm_total, "overlap": np.maximum(0.0, c + comm_total - cm)}


def select_window(t: RankTrace, ra: RankAnalysis, window: str, steps: tuple[int, int] | None,
                  notes: list[str]) -> tuple[float, float, np.ndarray, np.ndarray, np.ndarray]:
    """(lo, hi, step nums, step lo, step hi) of the chosen window; falls back to "all" with a note."""
    nums, slo, shi = step_windows(t, ra.ops_step)
    lo, hi = t.span
    if window == "all" and steps is None:
        return lo, hi, nums, slo, shi
    if not len(nums):
        notes.append(f"window {window!r}: no ProfilerStep with GPU events; the window is all GPU events")
        return lo, hi, nums, slo, shi
    keep = np.ones(len(nums), dtype=bool)
    if steps is not None:
        keep &= (nums >= steps[0]) & (nums <= steps[1])
    if window == "steps-hta" and len(nums):
        keep &= nums != nums.max()
        notes.append(f"window steps-hta: the last step ({int(nums.max())}) dropped, as HTA does by default")
    if not keep.any():
        notes.append(f"no step in the chosen range {steps}: the window is all GPU events")
        return lo, hi, nums[:0], slo[:0], shi[:0]
    return float(slo[keep].min()), float(shi[keep].max()), nums[keep], slo[keep], shi[keep]


def _ms(x: float) -> float:
    return round(float(x) / 1000.0, 6)


def _idle_classes(gaps: np.ndarray, host: np.ndarray, kernel_wait_us: float) -> dict[str, float]:
    gaps = np.maximum(gaps, 0.0)
    kw = ~host & (gaps < kernel_wait_us)
    other = ~host & ~kw
    return {"host_wait_ms": _ms(gaps[host].sum()), "kernel_wait_ms": _ms(gaps[kw].sum()),
            "other_ms": _ms(gaps[other].sum())}


def idle_breakdown(t: RankTrace, lo: float, hi: float, kernel_wait_us: float = 30.0) -> dict[str, Any]:
    g = t.gpu
    end = g.ts + g.dur
    inw = (g.ts >= lo) & (end <= hi)
    per_stream = []
    for s in np.unique(g.stream[inw]).tolist():
        m = inw & (g.stream == s)
        ts, en, lt = g.ts[m], end[m], g.launch_ts[m]
        if len(ts) < 2:
            continue
        prev_end = np.maximum.accumulate(en)[:-1]
        gaps = ts[1:] - prev_end
        host = lt[1:] > prev_end  # NaN (no launch) compares False: not host wait
        row = {"stream": int(s), **_idle_classes(gaps, host, kernel_wait_us)}
        row["idle_ms"] = round(row["host_wait_ms"] + row["kernel_wait_ms"] + row["other_ms"], 6)
        per_stream.append(row)
    # GPU-wide: the gaps of the union of all streams within the window, classified by the event ending each gap.
    s_, e_ = merge(np.clip(g.ts[inw], lo, hi), np.clip(end[inw], lo, hi))
    gpu = {"host_wait_ms": 0.0, "kernel_wait_ms": 0.0, "other_ms": 0.0}
    if len(s_) > 1:
        gap_lo, gap_hi = e_[:-1], s_[1:]
        nxt = np.searchsorted(g.ts, gap_hi, side="left")
        nxt = np.minimum(nxt, len(g.ts) - 1)
        host = g.launch_ts[nxt] > gap_lo
        gpu = _idle_classes(gap_hi - gap_lo, host, kernel_wait_us)
    edge = 0.0
    if len(s_):
        edge = (s_[0] - lo) + (hi - e_[-1])  # idle at the window's edges (steps windows): no event ends it
    gpu["edge_ms"] = _ms(max(0.0, edge))
    return {"gpu": gpu, "streams": per_stream, "kernel_wait_us": kernel_wait_us}


def kernel_table(t: RankTrace, lo: float, hi: float) -> list[dict[str, Any]]:
    """Per kernel name (every GPU event kind): total, count, mean, min, max (ms), events starting in the window."""
    g = t.gpu
    m = (g.ts >= lo) & (g.ts < hi) if hi > lo else np.ones(len(g), dtype=bool)
    ids = g.name_id[m]
    dur = g.dur[m]
    kinds = g.kind[m]
    if not len(ids):
        return []
    u, inv = np.unique(ids, return_inverse=True)
    tot = np.bincount(inv, weights=dur)
    cnt = np.bincount(inv)
    mx = np.full(len(u), -np.inf)
    np.maximum.at(mx, inv, dur)
    mn = np.full(len(u), np.inf)
    np.minimum.at(mn, inv, dur)
    kind_of = np.zeros(len(u), dtype=np.int8)
    kind_of[inv] = kinds
    order = np.argsort(-tot, kind="stable")
    return [{"name": t.names[int(u[i])], "kind": KIND_NAMES[int(kind_of[i])], "total_ms": _ms(tot[i]),
             "count": int(cnt[i]), "mean_ms": _ms(tot[i] / cnt[i]), "min_ms": _ms(mn[i]), "max_ms": _ms(mx[i])}
            for i in order.tolist()]


def launch_stats(t: RankTrace, lo: float, hi: float, runtime_cutoff_us: float = 50.0,
                 launch_delay_cutoff_us: float = 100.0) -> dict[str, Any]:
    g = t.gpu
    m = (g.ts >= lo) & (g.ts < hi) if hi > lo else np.ones(len(g), dtype=bool)
    has = m & ~np.isnan(g.launch_ts)
    delay = np.maximum(0.0, g.ts[has] - g.launch_end[has])
    cpu = g.launch_end[has] - g.launch_ts[has]
    gdur = g.dur[has]
    out: dict[str, Any] = {"events": int(m.sum()), "with_launch": int(has.sum()),
                           "without_launch": int((m & np.isnan(g.launch_ts)).sum()),
                           "without_launch_compute_ms": _ms(g.dur[m & np.isnan(g.launch_ts)
                                                                  & (g.kind == KIND_COMPUTE)].sum())}
    if len(delay):
        out.update({"launch_delay_mean_ms": _ms(delay.mean()), "launch_delay_p50_ms": _ms(np.median(delay)),
                    "launch_delay_p95_ms": _ms(np.percentile(delay, 95)), "launch_delay_max_ms": _ms(delay.max()),
                    "launch_delay_outliers": int((delay > launch_delay_cutoff_us).sum()),
                    "runtime_outliers": int((cpu > runtime_cutoff_us).sum()),
                    "short_kernels": int(((cpu <= runtime_cutoff_us) & (gdur < cpu)).sum()),
                    "runtime_cutoff_us": runtime_cutoff_us, "launch_delay_cutoff_us": launch_delay_cutoff_us})
    return out


def queue_length(t: RankTrace, lo: float, hi: float) -> list[dict[str, Any]]:
    """Per stream: max and time-weighted mean of launched-not-yet-started GPU events, within [lo, hi]."""
    g = t.gpu
    has = ~np.isnan(g.launch_ts)
    out = []
    for s in np.unique(g.stream[has]).tolist():
        m = has & (g.stream == s)
        times = np.concatenate([g.launch_ts[m], g.ts[m]])
        delta = np.concatenate([np.ones(int(m.sum())), -np.ones(int(m.sum()))])
        o = np.lexsort((delta, times))  # at equal times the start (-1) comes first
        times, delta = times[o], delta[o]
        q = np.cumsum(delta)
        seg_lo = np.clip(times[:-1], lo, hi)
        seg_hi = np.clip(times[1:], lo, hi)
        w = seg_hi - seg_lo
        span = hi - lo
        inw = (times >= lo) & (times <= hi)
        out.append({"stream": int(s), "max": int(q[inw].max()) if inw.any() else 0,
                    "mean": round(float((q[:-1] * w).sum() / span), 4) if span > 0 and len(w) else 0.0})
    return out


def analyse_rank(t: RankTrace, *, window: str = "all", steps: tuple[int, int] | None = None,
                 kernel_wait_us: float = 30.0, top: int | None = 10) -> dict[str, Any]:
    """Every per-rank figure, in ms, as a JSON-ready dict (``report`` and ``checks`` read it)."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}")
    notes: list[str] = list(t.notes)
    ra = RankAnalysis(t)
    lo, hi, nums, slo, shi = select_window(t, ra, window, steps, notes)
    tb = ra.temporal(np.array([lo]), np.array([hi]))
    tot = {k: _ms(v[0]) for k, v in tb.items()}
    window_ms = tot["window"]
    pct = {f"{k}_pct": round(100.0 * tot[k] / window_ms, 3) if window_ms > 0 else 0.0
           for k in ("compute", "comm", "memcpy", "memset", "idle")}
    per_step = []
    if len(nums):
        st = ra.temporal(slo, shi)
        g = t.gpu
        for i, n in enumerate(nums.tolist()):
            # kernel time launched in this step (sums of durations, not unions): the straggler signal
            k_idx = np.flatnonzero(t.steps.num == n)
            m = ra.ops_step == (k_idx[0] if len(k_idx) else -2)
            per_step.append({"step": n, "start_us": float(slo[i]), "window_ms": _ms(st["window"][i]),
                             "compute_ms": _ms(st["compute"][i]), "comm_ms": _ms(st["comm_total"][i]),
                             "exposed_comm_ms": _ms(st["comm"][i]), "memcpy_ms": _ms(st["memcpy"][i]),
                             "memset_ms": _ms(st["memset"][i]), "idle_ms": _ms(st["idle"][i]),
                             "compute_kernel_ms": _ms(g.dur[m & (g.kind == KIND_COMPUTE)].sum()),
                             "nccl_kernel_ms": _ms(g.dur[m & (g.kind == KIND_COMM)].sum())})
    comm_total = tot["comm_total"]
    return {
        "rank": t.rank, "path": t.path, "rank_source": t.rank_source, "world_size": t.world_size,
        "window": {"policy": window, "steps": [int(nums.min()), int(nums.max())] if len(nums) and window != "all"
                   or (steps and len(nums)) else None, "start_us": lo, "end_us": hi},
        "temporal": {"window_ms": window_ms, "compute_ms": tot["compute"], "comm_ms": tot["comm"],
                     "memcpy_ms": tot["memcpy"], "memset_ms": tot["memset"], "idle_ms": tot["idle"],
                     "non_compute_ms": round(tot["comm"] + tot["memcpy"] + tot["memset"], 6), **pct},
        "overlap": {"comm_total_ms": comm_total, "overlap_ms": tot["overlap"],
                    "overlap_ratio": round(tot["overlap"] / comm_total, 4) if comm_total > 0 else 0.0},
        "idle": idle_breakdown(t, lo, hi, kernel_wait_us),
        "kernels": kernel_table(t, lo, hi)[:top],  # top=None: every kernel name
        "launch": launch_stats(t, lo, hi),
        "queue": queue_length(t, lo, hi),
        "steps": per_step,
        "counts": {"gpu_events": len(t.gpu), "nccl_kernels": len(t.coll), "events": t.n_events,
                   "launches": t.n_launches},
        "truncated": t.truncated,
        "notes": notes,
    }


def kernel_spread(ranks: list[dict[str, Any]], traces: list[RankTrace], top: int = 10) -> list[dict[str, Any]]:
    """The top kernels by total time over all ranks, each with its per-rank totals and their spread."""
    totals: dict[str, dict[int, float]] = {}
    for r, t in zip(ranks, traces):
        lo, hi = r["window"]["start_us"], r["window"]["end_us"]
        for row in kernel_table(t, lo, hi):
            totals.setdefault(row["name"], {})[t.rank] = row["total_ms"]
    rank_ids = [t.rank for t in traces]
    rows = []
    for name, per in totals.items():
        vals = np.asarray([per.get(rk, 0.0) for rk in rank_ids])
        mean = float(vals.mean())
        rows.append({"name": name, "total_ms": round(float(vals.sum()), 6), "mean_ms": round(mean, 6),
                     "min_ms": round(float(vals.min()), 6), "max_ms": round(float(vals.max()), 6),
                     "max_rank": rank_ids[int(vals.argmax())], "min_rank": rank_ids[int(vals.argmin())],
                     "spread_pct": round(100.0 * float(vals.max() - vals.min()) / mean, 3) if mean > 0 else 0.0})
    rows.sort(key=lambda x: -x["total_ms"])
    return rows[:top]


__all__ = ["analyse_rank", "kernel_spread", "merge", "Cover", "RankAnalysis", "op_steps", "step_windows",
           "idle_breakdown", "kernel_table", "launch_stats", "queue_length", "WINDOWS"]
