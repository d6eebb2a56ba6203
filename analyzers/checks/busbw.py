"""Bus bandwidth of the run's collectives against the nccl-tests baseline (the comm check's ``busbw`` findings).

Per op instance (communicator, seq) the true duration is the *shortest* one among its ranks (the last arriver does
not wait); busbw = bytes / time x nccl-tests' factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
(n-1)/n; broadcast, reduce, send/recv 1), compared with the nccl_tests baseline at the nearest message size.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame
from analyzers.collectives import op_counts
from analyzers.evidence import fnum
from ranksight.schema import Finding

NAME = "comm"  # the findings are the comm check's

BUSBW_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


def busbw_gbs(op: str, nbytes: float, duration_ms: float, nranks: int) -> float | None:
    f = BUSBW_FACTOR.get(op.lower().replace("nccl:", ""))
    if f is None or duration_ms <= 0 or nbytes <= 0 or nranks < 1:
        return None
    algbw = nbytes / (duration_ms / 1000.0) / 1e9
    return algbw * (f(nranks) if nranks > 1 else 1.0)


def busbw_rows(co: pd.DataFrame, base: pd.DataFrame, cfg) -> pd.DataFrame | None:
    """One row per op instance (communicator, seq, op) with a duration and bytes whose op has a bus bandwidth factor
    and an nccl-tests baseline row within ``size_match`` of its message size: group, op, step, nbytes (per op), busbw,
    ops, baseline, baseline_size. Per instance: the shortest duration among its ranks (the last arriver does not
    wait), the largest per-op bytes, its member count (its first record's members, else the ranks that recorded it).
    In numpy over the records; Python only per distinct op and message size (a communicator runs the same few
    messages thousands of times: a Python loop over instances cost minutes at 1,024 ranks x 10,000 steps)."""
    dur_all = co["duration_ms"].to_numpy(dtype=float, na_value=np.nan)
    nbytes_all = co["nbytes"].to_numpy(dtype=float, na_value=np.nan)
    gk_code, _ = pd.factorize(co["gkey"])
    grp_code, grp_uniq = pd.factorize(co["group"])
    op_code, op_uniq = pd.factorize(co["op"])
    keep = ~np.isnan(dur_all) & (nbytes_all > 0) & (gk_code >= 0) & (grp_code >= 0) & (op_code >= 0)
    rows = np.flatnonzero(keep)
    if not len(rows):
        return None
    weight = op_counts(co).to_numpy()[rows]
    seq = co["seq"].to_numpy()[rows].astype(np.int64)
    gk, grp, opc = gk_code[rows].astype(np.int64), grp_code[rows].astype(np.int64), op_code[rows].astype(np.int64)
    seq0 = seq - seq.min()
    # (gkey, seq): the members' lookup; (gkey, group, seq, op): the instance (gkey names its group)
    gs_code, _ = pd.factorize(gk * (int(seq0.max()) + 1) + seq0)
    inst, _ = pd.factorize(gs_code.astype(np.int64) * (len(grp_uniq) * len(op_uniq)) + grp * len(op_uniq) + opc)
    m = int(inst.max()) + 1
    dur = np.full(m, np.inf)
    np.minimum.at(dur, inst, dur_all[rows])
    nbytes = np.full(m, -np.inf)
    np.maximum.at(nbytes, inst, nbytes_all[rows] / weight)  # a folded record's bytes are its ops' total
    ops = np.zeros(m, np.int64)
    np.maximum.at(ops, inst, weight)
    step = np.full(m, np.iinfo(np.int64).max)
    np.minimum.at(step, inst, co["step"].to_numpy()[rows].astype(np.int64))
    first = np.full(m, len(rows))
    np.minimum.at(first, inst, np.arange(len(rows)))
    i_grp, i_op, i_gs = grp[first], opc[first], gs_code[first]
    # ranks that recorded it (distinct (instance, rank) pairs)
    rk = co["rank"].to_numpy()[rows].astype(np.int64)
    pairs = pd.unique(inst.astype(np.int64) * (int(rk.max()) + 1) + rk)  # hashed, not sorted: only counted
    n_ranks = np.bincount(pairs // (int(rk.max()) + 1), minlength=m)
    # members: the first non-null group_ranks of its (gkey, seq), as groupby.first takes it
    gr = co["group_ranks"]
    present = np.flatnonzero(gr.notna().to_numpy()[rows])
    first_gr = np.full(int(gs_code.max()) + 1, -1)
    if len(present):
        first_gr[:] = len(rows)
        np.minimum.at(first_gr, gs_code[present], present)
        first_gr[first_gr == len(rows)] = -1
    n_members = np.zeros(len(first_gr), np.int64)
    has = first_gr >= 0
    n_members[has] = [len(x) if isinstance(x, (list, np.ndarray)) else 0 for x in gr.to_numpy(dtype=object)[rows[first_gr[has]]]]
    n = np.where(n_members[i_gs] > 0, n_members[i_gs], n_ranks)
    parts = []
    for oc, op_name in enumerate(op_uniq):
        sel = np.flatnonzero(i_op == oc)
        op = str(op_name).lower().replace("nccl:", "")
        f = BUSBW_FACTOR.get(op)
        b = base[base["op"].str.replace("_", "") == op.replace("_", "")]
        if not len(sel) or f is None or b.empty:
            continue
        sel = sel[(dur[sel] > 0) & (nbytes[sel] > 0) & (n[sel] >= 1)]
        factor = np.array([f(int(k)) if k > 1 else 1.0 for k in range(int(n[sel].max()) + 1)] if len(sel) else [])
        algbw = nbytes[sel] / (dur[sel] / 1000.0) / 1e9
        bw = algbw * factor[n[sel]]
        # the baseline row nearest each message size (log scale), once per distinct size
        sizes, size_of = np.unique(nbytes[sel], return_inverse=True)
        ref_size, ref_bw = np.full(len(sizes), np.nan), np.full(len(sizes), np.nan)
        for i, nb in enumerate(sizes):
            idx = (np.log(b["size_bytes"].clip(lower=1)) - np.log(max(nb, 1))).abs().idxmin()
            ref = b.loc[idx]
            if max(ref["size_bytes"], nb) / max(min(ref["size_bytes"], nb), 1) <= cfg.size_match:
                ref_size[i], ref_bw[i] = float(ref["size_bytes"]), float(ref["busbw"])
        matched = ~np.isnan(ref_size[size_of])
        sel, bw, size_of = sel[matched], bw[matched], size_of[matched]
        parts.append(pd.DataFrame({"group": np.asarray(grp_uniq, dtype=object)[i_grp[sel]], "op": op,
                                   "step": step[sel], "nbytes": nbytes[sel], "busbw": bw, "ops": ops[sel],
                                   "baseline": ref_bw[size_of], "baseline_size": ref_size[size_of]}))
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else None


def busbw_findings(frame: AnalysisFrame, cfg) -> list[Finding]:
    """The busbw findings, one per (group, op); ``cfg``: the comm check's ``CommConfig``."""
    out: list[Finding] = []
    data = frame.data
    co, base = data.collectives, data.nccl_tests
    if co.empty or base is None or base.empty:
        return out
    df = busbw_rows(co, base, cfg)
    if df is None:
        return out
    for (grp, op), sub in df.groupby(["group", "op"]):
        achieved, baseline = float(sub["busbw"].median()), float(sub["baseline"].median())
        frac = achieved / baseline if baseline > 0 else None
        sev = "warning" if frac is not None and frac < cfg.busbw_warn_frac else "info"
        ranks = sorted(int(r) for r in data.collectives[data.collectives["group"] == grp]["rank"].unique())
        out.append(Finding(
            analyzer=NAME, kind="comm_bottleneck", severity=sev, ranks=ranks, nodes=frame.placement.nodes_of(ranks),
            step_start=int(sub["step"].min()), step_end=int(sub["step"].max()),
            evidence=dict(scope="collective", cause="busbw", group=grp, op=op, achieved_busbw_gbs=fnum(achieved, 3),
                          baseline_busbw_gbs=fnum(baseline, 3), fraction_of_baseline=fnum(frac, 3),
                          message_bytes_median=fnum(sub["nbytes"].median(), 0), collectives=int(sub["ops"].sum())),
            confidence=0.7,
            summary=f"{op} on group {grp}: {achieved:.2f} GB/s bus bandwidth, {frac:.0%} of the nccl-tests baseline ({baseline:.2f} GB/s)",
            recommendation=("Below baseline: check the transport NCCL chose and the links (nccl-tests, NCCL_DEBUG=INFO); larger buckets help small messages."
                            if sev == "warning" else "Bandwidth is in line with the nccl-tests baseline."),
        ))
    return out
