"""Memory pressure: peak memory near capacity, or growing steadily (a leak).

Capacity per rank: its GPU's ``mem_total_bytes`` (gpu table) on GPU runs; on CPU runs the
node's host memory divided among its ranks (host table); unknown -> only growth is judged.
Growth: least-squares slope of per-step peak memory after warm-up, reported when the run grew
by at least ``growth_frac`` of its starting level and ``growth_min_bytes``, and the series rises
in at least ``monotonic`` of its steps; the evidence projects the step at which it would hit capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage
from analyzers.matrices import distinct_codes
from analyzers.evidence import fmt_ranks, fnum
from ranksight.schema import Finding

NAME = "memory_pressure"
GiB = 1024**3


@dataclass
class MemoryConfig:
    warn_frac: float = 0.92
    critical_frac: float = 0.97
    growth_frac: float = 0.20
    growth_min_bytes: float = 512 * 1024**2
    monotonic: float = 0.7  # share of step-to-step changes that are increases (ignoring flat steps)
    warmup_steps: int = 2
    min_steps: int = 8


def _capacity(frame: AnalysisFrame) -> dict[int, float]:
    """Each rank's memory capacity: its GPU's (CUDA runs), else its node's host memory shared by its ranks. Asked for
    by ``coverage`` and ``analyze`` alike: worked out once per frame (a pass over every GPU sample)."""
    memo = frame.__dict__.get("_memory_capacity")
    if memo is not None and memo[0] is frame.data.gpu and memo[1] is frame.data.host:
        return dict(memo[2])
    data = frame.data
    cap: dict[int, float] = {}
    device = data.device or "cpu"
    if not data.gpu.empty and str(device).startswith("cuda"):
        for (node, gpu), v in _max_by_pair(data.gpu, "node", "gpu", "mem_total_bytes"):
            if v and v > 0:
                for r in frame.placement.gpu_ranks(int(node), int(gpu)):
                    cap[r] = float(v)
    elif not data.host.empty:
        tot = data.host.groupby("node")["mem_total_bytes"].max()
        for node, ranks in frame.placement.node_ranks.items():
            if node in tot.index and tot[node] > 0 and ranks:
                for r in ranks:
                    cap[r] = float(tot[node]) / len(ranks)
    frame.__dict__["_memory_capacity"] = (data.gpu, data.host, cap)
    return dict(cap)


def _max_by_pair(df: pd.DataFrame, a: str, b: str, col: str) -> list[tuple[tuple, float]]:
    """``df.groupby([a, b])[col].max().items()``: on integer keys without gaps in their span (a run's node and GPU
    numbers) grouped by one combined integer instead of two columns (the pair's factorizing was most of the time)."""
    ka, kb = df[a], df[b]
    if not (pd.api.types.is_integer_dtype(ka.dtype) and pd.api.types.is_integer_dtype(kb.dtype)):
        return list(df.groupby([a, b])[col].max().items())
    va, vb = ka.to_numpy(), kb.to_numpy()
    lo_a, lo_b = int(va.min()), int(vb.min())
    span_b = int(vb.max()) - lo_b + 1
    if (int(va.max()) - lo_a + 1) * span_b >= 2**62:
        return list(df.groupby([a, b])[col].max().items())
    # int32 where the keys fit (a fleet's samples: half the memory traffic), else int64: the same numbers
    wide = np.int32 if (int(va.max()) - lo_a + 1) * span_b < 2**31 else np.int64
    va, vb = va.astype(wide, copy=False), vb.astype(wide, copy=False)
    lo_a, lo_b, span_b = wide(lo_a), wide(lo_b), wide(span_b)
    key = (va - lo_a) * span_b + (vb - lo_b)
    lo_a, lo_b, span_b = int(lo_a), int(lo_b), int(span_b)
    grid = _grid_max(key, df[col].to_numpy())
    if grid is not None:
        return [((int(k // span_b) + lo_a, int(k % span_b) + lo_b), v) for k, v in zip(*grid)]
    tot = df[col].groupby(key).max()  # sorted by key: the pairs' order
    return [((int(k // span_b) + lo_a, int(k % span_b) + lo_b), v) for k, v in tot.items()]


def _grid_max(key: np.ndarray, v: np.ndarray) -> tuple[list, list] | None:
    """``pd.Series(v).groupby(key).max()``'s keys and values where the samples are a grid of their keys: every key
    in turn, sample tick after sample tick, or each key's samples together, keys in order (a store's GPU samples
    are one or the other). None otherwise, or where ``v`` is not float."""
    if v.dtype.kind != "f" or len(key) == 0:
        return None
    keys, code = distinct_codes(key)
    k, n = len(keys), len(code)
    if n % k:
        return None
    if np.array_equal(code.reshape(-1, k), np.broadcast_to(np.arange(k), (n // k, k))):
        by_key = v.reshape(-1, k).T
    elif np.array_equal(code.reshape(k, -1), np.broadcast_to(np.arange(k)[:, None], (k, n // k))):
        by_key = v.reshape(k, -1)
    else:
        return None
    with np.errstate(invalid="ignore"):
        tot = np.fmax.reduce(by_key, axis=1)  # NaN left out, as groupby's max; a key without any value: NaN
    return keys.tolist(), list(tot)


def _ranks_to_judge(st: pd.DataFrame, cap: dict, cfg: MemoryConfig):
    """``st.groupby("rank")``'s (rank, rows) pairs, in its order, of the ranks that can be near capacity or
    growing. The per-rank test (a line fit among others) runs every round for every rank; a rank whose peak is
    under ``warn_frac`` of its capacity and whose memory moved less than ``growth_min_bytes`` over the window
    (its end - start growth can be no more than max - min) is passed over without it."""
    if st.empty:
        return
    grid = _rank_grid(st)
    if grid is not None:
        ranks, mem = grid
        with np.errstate(invalid="ignore"):
            peaks, lows = np.fmax.reduce(mem, axis=0), np.fmin.reduce(mem, axis=0)  # NaN left out, as groupby's
        for j, (r, peak, low) in enumerate(zip(ranks.tolist(), peaks.astype(float).tolist(), lows.astype(float).tolist())):
            c = cap.get(int(r))
            near = bool(c) and peak / c >= min(cfg.warn_frac, cfg.critical_frac)
            moved = not (peak - low < cfg.growth_min_bytes)  # NaN: judge it
            if near or moved:
                yield r, st.iloc[j::len(ranks)]
        return
    g = st.groupby("rank")
    mem = g["mem_bytes"].agg(["max", "min"])
    # by position: both are in rank order (a .at lookup per rank and column cost ~2 s at 16,384 ranks)
    peaks, lows = mem["max"].to_numpy(dtype=float), mem["min"].to_numpy(dtype=float)
    for (r, idx), peak, low in zip(sorted(g.indices.items()), peaks.tolist(), lows.tolist()):
        c = cap.get(int(r))
        near = bool(c) and peak / c >= min(cfg.warn_frac, cfg.critical_frac)
        moved = not (peak - low < cfg.growth_min_bytes)  # NaN: judge it
        if near or moved:
            yield r, st.iloc[idx]


def _rank_grid(st: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """The ranks (sorted) and ``mem_bytes`` as a step x rank array where the rows are that grid already: each step's
    rows the same ranks in rank order, step after step (a store's and a live round's steps are; a groupby over 16
    million rows then only finds that out). None otherwise."""
    if "mem_bytes" not in st.columns or st["mem_bytes"].dtype.kind not in "fiu":
        return None
    rank = st["rank"].to_numpy()
    if rank.dtype.kind in "iu" and len(rank):
        # integer ranks: the first step's are the rows up to the first that does not rise; a grid repeats them
        n = int(np.argmax(rank[1:] <= rank[:-1])) + 1 if len(rank) > 1 and bool((rank[1:] <= rank[:-1]).any()) else len(rank)
        if len(rank) % n or not bool((rank.reshape(-1, n) == rank[:n]).all()):
            return None
        return rank[:n].copy(), st["mem_bytes"].to_numpy().reshape(-1, n)
    ranks, code = distinct_codes(rank)
    n = len(ranks)
    if n == 0 or len(rank) % n or not np.array_equal(code.reshape(-1, n), np.broadcast_to(np.arange(n), (len(rank) // n, n))):
        return None
    return ranks, st["mem_bytes"].to_numpy().reshape(-1, n)


def coverage(frame: AnalysisFrame, cfg: MemoryConfig | None = None) -> Coverage:
    """Can this check judge the run? It needs each step's peak memory (``mem_bytes``); a capacity (GPU samples of a
    CUDA run, host samples of a CPU run) to judge how near the limit it is."""
    if not frame.signals.memory:
        return Coverage(NAME, "not_run", "no mem_bytes in the step records (ranksight.init records peak memory)")
    if not _capacity(frame):
        return Coverage(NAME, "limited", ("no memory capacity known (no GPU or host samples from a node agent): only "
                                          "growth is judged"))
    return Coverage(NAME, "ran")


def analyze(frame: AnalysisFrame, cfg: MemoryConfig | None = None) -> list[Finding]:
    cfg = cfg or MemoryConfig()
    st = frame.data.steps
    if st.empty or not (st["mem_bytes"] > 0).any():
        return []
    st = frame.judged(cfg.warmup_steps).rows
    cap = _capacity(frame)
    node_of = frame.placement.rank_node
    near: dict[str, list] = {"warning": [], "critical": []}
    grow = []
    for r, sub in _ranks_to_judge(st, cap, cfg):
        r = int(r)
        mem = sub.set_index("step")["mem_bytes"].astype(float)
        if mem.empty:
            continue
        peak = float(mem.max())
        c = cap.get(r)
        if c:
            frac = peak / c
            if frac >= cfg.critical_frac:
                near["critical"].append((r, frac, peak, c, int(mem.idxmax())))
            elif frac >= cfg.warn_frac:
                near["warning"].append((r, frac, peak, c, int(mem.idxmax())))
        if len(mem) >= cfg.min_steps:
            x = mem.index.to_numpy(dtype=float)
            slope = float(np.polyfit(x, mem.to_numpy(), 1)[0])
            start = float(mem.iloc[: max(2, len(mem) // 5)].median())
            end = float(mem.iloc[-max(2, len(mem) // 5):].median())
            d = np.diff(mem.to_numpy())
            moving = d[d != 0]
            mono = float((moving > 0).mean()) if moving.size else 0.0
            if end - start >= max(cfg.growth_frac * start, cfg.growth_min_bytes) and mono >= cfg.monotonic and slope > 0:
                hit = int(mem.index.max() + (c - end) / slope) if c and c > end else None
                grow.append((r, slope, start, end, mono, hit, int(mem.index.min()), int(mem.index.max())))
    out: list[Finding] = []
    for sev in ("critical", "warning"):
        rows = near[sev]
        if not rows:
            continue
        ranks = [x[0] for x in rows]
        worst = max(rows, key=lambda x: x[1])
        out.append(Finding(
            analyzer=NAME, kind="memory_pressure", severity=sev, ranks=ranks, nodes=sorted({node_of.get(r, 0) for r in ranks}),
            step_start=min(x[4] for x in rows), step_end=int(st["step"].max()),
            evidence=dict(cause="near_capacity", peak_fraction={x[0]: fnum(x[1], 3) for x in rows},
                          peak_gib={x[0]: fnum(x[2] / GiB, 2) for x in rows}, capacity_gib={x[0]: fnum(x[3] / GiB, 2) for x in rows}),
            confidence=0.9,
            summary=f"memory at {worst[1]:.0%} of capacity on rank(s) {fmt_ranks(ranks)} ({worst[2] / GiB:.1f} of {worst[3] / GiB:.1f} GiB)",
            recommendation="Reduce activation memory: activation checkpointing, smaller micro-batches, FSDP/ZeRO sharding, or expandable_segments to fight fragmentation.",
        ))
    if grow:
        ranks = [g[0] for g in grow]
        g0 = max(grow, key=lambda g: g[1])
        out.append(Finding(
            analyzer=NAME, kind="memory_pressure", severity="warning", ranks=ranks, nodes=sorted({node_of.get(r, 0) for r in ranks}),
            step_start=min(g[6] for g in grow), step_end=max(g[7] for g in grow),
            evidence=dict(cause="growth", slope_mib_per_step={g[0]: fnum(g[1] / 1024**2, 2) for g in grow},
                          start_gib={g[0]: fnum(g[2] / GiB, 2) for g in grow}, end_gib={g[0]: fnum(g[3] / GiB, 2) for g in grow},
                          rising_share={g[0]: fnum(g[4], 2) for g in grow}, projected_full_step={g[0]: g[5] for g in grow}),
            confidence=0.7,
            summary=(f"memory grows steadily on rank(s) {fmt_ranks(ranks)}: +{g0[1] / 1024**2:.1f} MiB/step "
                     f"({g0[2] / GiB:.2f} -> {g0[3] / GiB:.2f} GiB)" + (f", full at about step {g0[5]}" if g0[5] else "")),
            recommendation="Look for tensors kept across steps (losses appended without .item(), growing caches, retained graphs); torch.cuda.memory_snapshot() shows who allocates.",
        ))
    return out
