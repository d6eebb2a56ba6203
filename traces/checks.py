"""Across ranks: what HTA leaves to the user, as ``ranksight.schema.Finding``s with their evidence.

- straggler (kernel time): per step, each rank's compute kernel time (sum of durations of the compute kernels
  it launched in that step); the rank whose median over steps is highest, when it exceeds the median of the
  others by ``STRAGGLER_MIN_PCT``. Kernel time is the GPU signal host noise cannot fake. Confirmed by who waits:
  NCCL kernels on the ranks that arrive early run longer (they wait inside the kernel for the late one), so the
  culprit has the least NCCL time and arrives last at the collectives. Only the culprit is named; the ranks
  that wait for it (victims, with more NCCL time) are in the evidence, never in ``ranks``.
- straggler (arrival): when no rank's kernel time stands out but one rank arrives last at most collectives
  (host-side slowness: late launches), that rank, from the collectives' start times (clocks assumed aligned).
- slow collective: collectives are matched across ranks by (process group, its ranks, collective, kernel name,
  ordinal on the rank); an instance's transfer time is its shortest duration over the ranks (the last arrival
  waits least). Same-shape collectives (name, bytes) of different groups are compared; a group whose median
  transfer time is ``SLOW_GROUP_FACTOR`` times the others' is a comm_bottleneck finding naming the group.
- pipeline bubbles: on traces with point-to-point (send/recv) NCCL kernels, per stage (rank) the time within
  the steps' window without compute; a finding when the mean stage bubble exceeds ``BUBBLE_MIN_PCT``.
- exposed communication: per step, communication not overlapped by compute over the step's window, the mean
  over ranks; a finding when the mean over steps exceeds ``EXPOSED_MIN_PCT``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ranksight.schema import Finding
from traces.model import RankTrace

STRAGGLER_MIN_PCT = 5.0
SLOW_GROUP_FACTOR = 1.5
BUBBLE_MIN_PCT = 20.0
EXPOSED_MIN_PCT = 15.0
ANALYZER = "trace"


def _common_steps(ranks: list[dict[str, Any]]) -> list[int]:
    sets = [set(s["step"] for s in r["steps"]) for r in ranks]
    return sorted(set.intersection(*sets)) if sets else []


def _step_matrix(ranks: list[dict[str, Any]], steps: list[int], key: str) -> np.ndarray:
    out = np.zeros((len(ranks), len(steps)))
    for i, r in enumerate(ranks):
        by = {s["step"]: s[key] for s in r["steps"]}
        out[i] = [by[s] for s in steps]
    return out


def match_collectives(traces: list[RankTrace]) -> dict[tuple, dict[int, tuple[float, float, int]]]:
    """{(pg, pg ranks, collective, kernel name, ordinal): {rank: (start us, dur us, bytes)}}."""
    out: dict[tuple, dict[int, tuple[float, float, int]]] = {}
    for t in traces:
        c = t.coll
        if not len(c):
            continue
        g = t.gpu
        ts, dur, nid = g.ts[c.op].tolist(), g.dur[c.op].tolist(), g.name_id[c.op].tolist()
        for k, (pg, pgr, co, seq, nb) in enumerate(zip(c.pg_id.tolist(), c.pg_ranks_id.tolist(), c.coll_id.tolist(),
                                                       c.seq.tolist(), c.nbytes.tolist())):
            key = (t.names[pg], t.names[pgr], t.names[co], t.names[nid[k]], seq)
            out.setdefault(key, {})[t.rank] = (ts[k], dur[k], nb)
    return out


def _arrivals(matched: dict[tuple, dict[int, tuple[float, float, int]]], rank_ids: list[int]) -> dict[str, Any]:
    """Per rank: how often it arrived last at a collective of 2+ ranks, and its mean lateness (ms)."""
    last = {r: 0 for r in rank_ids}
    late = {r: [] for r in rank_ids}
    n = 0
    for key, per in matched.items():
        if len(per) < 2 or key[2] in ("send", "recv"):
            continue
        n += 1
        starts = {r: v[0] for r, v in per.items()}
        first = min(starts.values())
        lr = max(starts, key=starts.get)
        last[lr] += 1
        for r, s in starts.items():
            late[r].append(s - first)
    return {"n": n, "last": last, "late_ms": {r: round(float(np.mean(v)) / 1000.0, 4) if v else 0.0
                                                for r, v in late.items()}}


def straggler(ranks: list[dict[str, Any]], traces: list[RankTrace], inputs: list[str]) -> list[Finding]:
    if len(ranks) < 2:
        return []
    rank_ids = [r["rank"] for r in ranks]
    steps = _common_steps(ranks)
    if steps:
        kt = _step_matrix(ranks, steps, "compute_kernel_ms")
        nt = _step_matrix(ranks, steps, "nccl_kernel_ms")
    else:
        kt = np.asarray([[sum(k["total_ms"] for k in r["kernels"] if k["kind"] == "compute")] for r in ranks])
        nt = np.asarray([[r["overlap"]["comm_total_ms"]] for r in ranks])
    med = np.median(kt, axis=1)
    i = int(med.argmax())
    others = np.delete(med, i)
    base = float(np.median(others))
    excess = 100.0 * (med[i] - base) / base if base > 0 else 0.0
    arr = _arrivals(match_collectives(traces), rank_ids)
    nccl_med = np.median(nt, axis=1)
    culprit = rank_ids[i]
    waits_least = bool(int(nccl_med.argmin()) == i)
    step_is_max = float((kt.argmax(axis=0) == i).mean()) if kt.shape[1] else 0.0
    victims = {rank_ids[j]: round(float(nccl_med[j]), 4) for j in range(len(ranks)) if j != i}
    ev_common = {"nccl_kernel_ms_median": {rank_ids[j]: round(float(nccl_med[j]), 4) for j in range(len(ranks))},
                 "collectives_matched": arr["n"], "arrived_last": arr["last"], "mean_lateness_ms": arr["late_ms"]}
    out = []
    if excess >= STRAGGLER_MIN_PCT:
        conf = 0.6 + 0.2 * waits_least + 0.2 * (arr["n"] > 0 and max(arr["last"], key=arr["last"].get) == culprit)
        sev = "critical" if excess >= 25 else "warning"
        out.append(Finding(
            analyzer=ANALYZER, kind="straggler", severity=sev, ranks=[culprit],
            step_start=steps[0] if steps else None, step_end=steps[-1] if steps else None,
            summary=(f"rank {culprit} is the straggler: its compute kernels take {med[i]:.2f} ms per step, "
                     f"{excess:.1f}% over the other ranks' median {base:.2f} ms"
                     + ("; the others wait for it inside NCCL kernels" if waits_least else "")),
            evidence={"compute_kernel_ms_median": {rank_ids[j]: round(float(med[j]), 4) for j in range(len(ranks))},
                      "excess_pct": round(excess, 2), "others_median_ms": round(base, 4),
                      "steps": len(steps), "steps_where_slowest_pct": round(100 * step_is_max, 1),
                      "culprit_waits_least_in_nccl": waits_least, "victims_nccl_kernel_ms": victims, **ev_common},
            recommendation=(f"Look at rank {culprit}'s GPU (clocks, thermals, NVML/DCGM health) and its kernels' "
                            "inputs (uneven sharding, dynamic shapes); its peers' NCCL time is waiting, not slow links."),
            confidence=round(min(1.0, conf), 2), inputs=inputs))
        return out
    if arr["n"] >= 3:
        lr = max(arr["last"], key=arr["last"].get)
        share = arr["last"][lr] / arr["n"]
        if share >= 0.6 and len(ranks) > 2 or share >= 0.8:
            out.append(Finding(
                analyzer=ANALYZER, kind="straggler", severity="warning", ranks=[lr],
                step_start=steps[0] if steps else None, step_end=steps[-1] if steps else None,
                summary=(f"rank {lr} arrives last at {100 * share:.0f}% of {arr['n']} collectives, "
                         f"{arr['late_ms'][lr]:.2f} ms late on average, with no slower kernels: a host-side delay"),
                evidence={"compute_kernel_ms_median": {rank_ids[j]: round(float(med[j]), 4)
                                                       for j in range(len(ranks))}, **ev_common},
                recommendation=f"Look at rank {lr}'s host: data loading, CPU contention, Python overhead before launches.",
                confidence=0.6, inputs=inputs))
    return out


def slow_collective(traces: list[RankTrace], inputs: list[str]) -> tuple[dict[str, Any] | None, list[Finding]]:
    matched = match_collectives(traces)
    if not matched:
        return None, []
    rows = []
    for key, per in matched.items():
        durs = [v[1] for v in per.values()]
        rows.append((min(durs), key, per))
    xfer, key, per = max(rows, key=lambda r: r[0])
    nbytes = max(v[2] for v in per.values())
    slowest = {"collective": key[2] or key[3], "kernel": key[3], "process_group": key[0], "group_ranks": key[1],
               "ordinal": key[4], "transfer_ms": round(xfer / 1000.0, 4), "bytes": nbytes,
               "ranks_seen": sorted(per), "duration_ms_by_rank": {r: round(v[1] / 1000.0, 4) for r, v in per.items()}}
    # Same shape, different groups: median transfer time per group.
    shapes: dict[tuple, dict[tuple, list[float]]] = {}
    for x, k, p in rows:
        if k[2] in ("send", "recv") or len(p) < 2:
            continue
        nb = max(v[2] for v in p.values())
        shapes.setdefault((k[3], nb, len(p)), {}).setdefault((k[0], k[1]), []).append(x)
    findings = []
    for (kname, nb, size), groups in shapes.items():
        if len(groups) < 2:
            continue
        meds = {g: float(np.median(v)) for g, v in groups.items()}
        g_slow = max(meds, key=meds.get)
        rest = float(np.median([m for g, m in meds.items() if g != g_slow]))
        if rest > 0 and meds[g_slow] >= SLOW_GROUP_FACTOR * rest:
            ranks = _parse_ranks(g_slow[1])
            findings.append(Finding(
                analyzer=ANALYZER, kind="comm_bottleneck", severity="warning", ranks=ranks,
                summary=(f"process group {g_slow[0]} (ranks {g_slow[1]}): its collectives take {meds[g_slow] / 1000:.3f} ms"
                         f", {meds[g_slow] / rest:.1f}x the {rest / 1000:.3f} ms of other groups' same-size ones"),
                evidence={"kernel": kname, "bytes": nb, "group_size": size, "median_transfer_ms_by_group":
                          {f"{g[0]} {g[1]}": round(m / 1000.0, 4) for g, m in meds.items()},
                          "instances": len(groups[g_slow])},
                recommendation="Check the links between these ranks (NCCL_DEBUG=INFO transports, IB counters, "
                               "nccl-tests within the group).", confidence=0.7, inputs=inputs))
    return slowest, findings


def _parse_ranks(s: str) -> list[int]:
    try:
        return [int(x) for x in s.strip("[]").split(",") if x.strip()]
    except ValueError:
        return []


def pipeline_bubbles(ranks: list[dict[str, Any]], traces: list[RankTrace], inputs: list[str]) -> list[Finding]:
    p2p = any(t.names[c] in ("send", "recv") or "SendRecv" in t.names[n]
              for t in traces for c, n in zip(t.coll.coll_id[:200].tolist(), t.gpu.name_id[t.coll.op[:200]].tolist()))
    if not p2p:
        return []
    bub = {}
    for r in ranks:
        w = r["temporal"]["window_ms"]
        bub[r["rank"]] = (round(w - r["temporal"]["compute_ms"], 4), round(100 * (1 - r["temporal"]["compute_ms"] / w), 2)
                          if w > 0 else 0.0)
    mean_pct = float(np.mean([v[1] for v in bub.values()]))
    if mean_pct < BUBBLE_MIN_PCT:
        return []
    worst = max(bub, key=lambda k: bub[k][1])
    return [Finding(
        analyzer=ANALYZER, kind="pipeline_bubble", severity="warning" if mean_pct < 40 else "critical",
        ranks=[worst], summary=(f"pipeline bubbles: the stages compute {100 - mean_pct:.1f}% of the time; "
                                f"rank {worst} idles most ({bub[worst][1]:.1f}%)"),
        evidence={"bubble_ms_by_rank": {k: v[0] for k, v in bub.items()},
                  "bubble_pct_by_rank": {k: v[1] for k, v in bub.items()}, "mean_bubble_pct": round(mean_pct, 2)},
        recommendation="More microbatches per step, or an interleaved (1F1B / virtual stages) schedule.",
        confidence=0.7, inputs=inputs)]


def exposed_comm(ranks: list[dict[str, Any]], inputs: list[str]) -> list[Finding]:
    steps = _common_steps(ranks)
    if not steps:
        return []
    ex = _step_matrix(ranks, steps, "exposed_comm_ms")
    win = _step_matrix(ranks, steps, "window_ms")
    pct = 100 * ex.mean(axis=0) / np.maximum(win.mean(axis=0), 1e-9)
    if float(pct.mean()) < EXPOSED_MIN_PCT:
        return []
    worst = int(pct.argmax())
    return [Finding(
        analyzer=ANALYZER, kind="comm_bottleneck", severity="warning", ranks=[],
        step_start=steps[0], step_end=steps[-1],
        summary=(f"exposed communication: {pct.mean():.1f}% of each step on average is communication with no "
                 f"compute under it (step {steps[worst]}: {pct[worst]:.1f}%, {ex[:, worst].mean():.2f} ms)"),
        evidence={"exposed_comm_pct_by_step": {s: round(float(p), 2) for s, p in zip(steps, pct)},
                  "exposed_comm_ms_by_step": {s: round(float(x), 4) for s, x in zip(steps, ex.mean(axis=0))},
                  "exposed_comm_ms_by_rank": {r["rank"]: round(float(ex[i].mean()), 4) for i, r in enumerate(ranks)}},
        recommendation="Overlap communication with compute (DDP bucket size, FSDP prefetch), or cut its volume.",
        confidence=0.7, inputs=inputs)]


def run_checks(ranks: list[dict[str, Any]], traces: list[RankTrace]) -> tuple[list[Finding], dict[str, Any]]:
    """All checks; returns (findings, extra figures for the report: the slowest collective)."""
    inputs = [t.path for t in traces]
    findings = straggler(ranks, traces, inputs)
    slowest, f2 = slow_collective(traces, inputs)
    findings += f2 + pipeline_bubbles(ranks, traces, inputs) + exposed_comm(ranks, inputs)
    return findings, {"slowest_collective": slowest}


__all__ = ["run_checks", "straggler", "slow_collective", "pipeline_bubbles", "exposed_comm", "match_collectives"]
