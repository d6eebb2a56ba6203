"""Kernel time: the straggler as the device's own profiler saw it, from the runs' trace summaries.

The node agents summarize each rank's profiler (Kineto) traces into ``TraceSummary`` records (``probes/profiler.py``):
over a capture window of steps, the time compute kernels kept the device busy (``compute_ms``) and the time NCCL
kernels ran (``comm_ms``). On a GPU this is the one signal host noise cannot fake: a kernel runs as long as it runs,
whatever the CPU next to it does. And NCCL kernels tell culprit from victim: a collective's kernel starts when its
rank reaches it and ends when the last rank has, so the ranks that arrive early wait *inside* the kernel. In
synchronous training the slow rank therefore has the most compute kernel time per step and the least NCCL kernel
time; its peers have about its extra compute added to their NCCL time.

Per capture window (the summaries of one capture: ``analyzers.trace_windows``), per group of comparable ranks (the world, or one pipeline
stage's ranks when pp > 1: ``Placement.peer_groups``), each rank's kernel time per step is compared with the
median of the others'. A rank over it by ``min_excess_pct`` is a suspect; it is *confirmed* when its NCCL time per
step is below the others' median by at least ``wait_fraction`` of its extra compute (they wait for it). Confirmed
suspects are warnings (critical at ``critical_ratio``), the others info: the extra kernel time is real but nobody
waits for it (work after the step's last collective, or a rank whose peers are slow too). A rank's windows make one
finding. CPU traces are not judged: their "kernels" are CPU ops, whose time is host time (the step records'
compute signal already covers it).

``run_all`` merges a finding of this check into the ``stragglers`` finding of the same rank and steps when there is
one (``analyzers.merge_corroborating``): one cause, one finding, with the kernel time in its evidence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage
from analyzers.evidence import fnum
from analyzers.trace_windows import window_key
from ranksight.schema import Finding

NAME = "kernel_time"


@dataclass
class KernelTimeConfig:
    min_excess_pct: float = 5.0  # kernel time per step over the peers' median (as ``ranksight trace``'s straggler)
    wait_fraction: float = 0.5  # confirmed: the peers' NCCL time per step exceeds the rank's by this share of its excess
    critical_ratio: float = 2.0  # as the stragglers check: a rank at 2x its peers is critical
    min_ranks: int = 2  # ranks of a peer group in one window
    min_kernel_ms: float = 0.05  # a window whose peers' median kernel time per step is below this is not judged


def coverage(frame: AnalysisFrame, cfg: KernelTimeConfig | None = None) -> Coverage:
    """Can this check judge the run? It needs GPU profiler trace summaries of two ranks or more over the same steps
    (periodic captures, or one requested with the ``profile`` action)."""
    ts = frame.data.trace_summaries
    if ts.empty:
        return Coverage(NAME, "not_applicable", "no profiler trace summary: capture one (the `profile` action, or a "
                                                "profile schedule) to compare ranks by device kernel time")
    gpu = ts[ts["device"].astype(str) != "cpu"]
    if gpu.empty:
        return Coverage(NAME, "not_applicable", "CPU traces only: their op time is host time, not device kernel time "
                                                "(the stragglers check's compute signal covers it)")
    if len(_windows(gpu, (cfg or KernelTimeConfig()).min_ranks)) == 0:
        return Coverage(NAME, "limited", "no capture window holds GPU traces of two ranks or more")
    return Coverage(NAME, "ran")


def _windows(ts: pd.DataFrame, min_ranks: int) -> list[pd.DataFrame]:
    """The capture windows (``analyzers.trace_windows.window_key``: the same steps and kind of capture), with
    ``min_ranks`` ranks or more, one row per rank (the latest), untruncated, with ProfilerStep marks, in step order."""
    ok = ts[~ts["truncated"].astype(bool) & (ts["step_start"] >= 0)]
    if ok.empty:
        return []
    keys = [window_key(r) for r in ok.itertuples(index=False)]
    out = []
    for _, w in ok.groupby(pd.Series(keys, index=ok.index).astype(str), sort=False):
        w = w.drop_duplicates("rank", keep="last")
        if len(w) >= min_ranks:
            out.append(w)
    return sorted(out, key=lambda w: (int(w["step_end"].iloc[0]), int(w["step_start"].iloc[0])))


def _judge_window(w: pd.DataFrame, frame: AnalysisFrame, cfg: KernelTimeConfig) -> list[dict]:
    """Suspects of one capture window: per peer group, each rank's kernel and NCCL time per step against the others'."""
    steps = max(1, int(w["step_end"].iloc[0]) - int(w["step_start"].iloc[0]) + 1)
    kt = dict(zip(w["rank"].astype(int), w["compute_ms"].astype(float) / steps))
    nccl = dict(zip(w["rank"].astype(int), w["comm_ms"].astype(float) / steps))
    files = dict(zip(w["rank"].astype(int), w["trace_file"].astype(str)))
    out = []
    for members in frame.placement.peer_groups(sorted(kt)).values():
        if len(members) < cfg.min_ranks:
            continue
        for r in members:
            others = [x for x in members if x != r]
            ref = float(np.median([kt[x] for x in others]))
            if ref < cfg.min_kernel_ms:
                continue
            excess_pct = 100.0 * (kt[r] - ref) / ref
            if excess_pct < cfg.min_excess_pct:
                continue
            excess_ms = kt[r] - ref
            peers_nccl = float(np.median([nccl[x] for x in others]))
            out.append(dict(
                rank=r, step_start=int(w["step_start"].iloc[0]), step_end=int(w["step_end"].iloc[0]), steps=steps,
                kernel_ms=kt[r], peers_kernel_ms=ref, ratio=kt[r] / ref, excess_ms=excess_ms, excess_pct=excess_pct,
                nccl_ms=nccl[r], peers_nccl_ms=peers_nccl,
                confirmed=peers_nccl - nccl[r] >= cfg.wait_fraction * excess_ms,
                victims={x: round(nccl[x], 3) for x in others}, trace=os.path.basename(files[r]),
                peers=len(others)))
    return out


def analyze(frame: AnalysisFrame, cfg: KernelTimeConfig | None = None) -> list[Finding]:
    cfg = cfg or KernelTimeConfig()
    ts = frame.data.trace_summaries
    if ts.empty:
        return []
    gpu = ts[ts["device"].astype(str) != "cpu"]
    by_rank: dict[int, list[dict]] = {}
    for w in _windows(gpu, cfg.min_ranks):
        for s in _judge_window(w, frame, cfg):
            by_rank.setdefault(s["rank"], []).append(s)
    return [_finding(frame, cfg, r, ws) for r, ws in sorted(by_rank.items())]


def _finding(frame: AnalysisFrame, cfg: KernelTimeConfig, rank: int, windows: list[dict]) -> Finding:
    confirmed = [w for w in windows if w["confirmed"]]
    worst = max(confirmed or windows, key=lambda w: w["ratio"])
    severity = ("critical" if worst["ratio"] >= cfg.critical_ratio else "warning") if confirmed else "info"
    node = frame.placement.rank_node.get(rank)
    where = f"rank {rank}" + (f" (node {node})" if node is not None and node >= 0 else "")
    s0, s1 = min(w["step_start"] for w in windows), max(w["step_end"] for w in windows)
    span = f"step {s0}" if s0 == s1 else f"steps {s0}-{s1}"
    wait = worst["peers_nccl_ms"] - worst["nccl_ms"]
    summary = (f"{where} runs {worst['kernel_ms']:.2f} ms of compute kernels per step in {span}, "
               f"{worst['excess_pct']:.0f}% over its {worst['peers']} peer(s)' median {worst['peers_kernel_ms']:.2f} ms "
               f"(device kernel time, from profiler traces)")
    if confirmed:
        summary += f"; its peers wait {wait:.2f} ms more per step inside NCCL kernels"
        rec = (f"{where} is slow on the device itself: check its GPU's clocks, temperature and power cap, and other "
               f"work on that GPU; if it persists, {frame.placement.evict_advice(node)}.")
    else:
        summary += "; its peers do not wait for it in NCCL kernels, so it does not hold the job back"
        rec = ("Nothing to act on yet: the extra kernel time is not on the path the other ranks wait for. Capture "
               "another trace if the step time grows.")
    evidence = dict(
        signal="device kernel time per step (profiler trace summaries)",
        kernel_ms_per_step=fnum(worst["kernel_ms"], 3), peers_kernel_ms_median=fnum(worst["peers_kernel_ms"], 3),
        ratio=fnum(worst["ratio"], 3), excess_pct=fnum(worst["excess_pct"], 1),
        nccl_ms_per_step=fnum(worst["nccl_ms"], 3), peers_nccl_ms_median=fnum(worst["peers_nccl_ms"], 3),
        peers_wait_more_ms=fnum(wait, 3), victims_nccl_ms_per_step=worst["victims"],
        windows=[dict(steps=f"{w['step_start']}-{w['step_end']}", kernel_ms_per_step=fnum(w["kernel_ms"], 3),
                      peers_kernel_ms_median=fnum(w["peers_kernel_ms"], 3), ratio=fnum(w["ratio"], 3),
                      confirmed=bool(w["confirmed"])) for w in windows],
        windows_confirmed=len(confirmed), windows_flagged=len(windows),
        thresholds=dict(min_excess_pct=cfg.min_excess_pct, wait_fraction=cfg.wait_fraction))
    return Finding(
        analyzer=NAME, kind="straggler", severity=severity, ranks=[rank], nodes=[node] if node is not None else [],
        step_start=s0, step_end=s1, evidence=evidence, confidence=0.9 if confirmed else 0.5, summary=summary,
        recommendation=rec, inputs=sorted({w["trace"] for w in windows}))


__all__ = ["NAME", "KernelTimeConfig", "analyze", "coverage"]
