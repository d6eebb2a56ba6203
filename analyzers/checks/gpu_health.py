"""GPU health: XID events (counted right), ECC errors, thermal/power throttling, clocks under nominal.

XIDs are counted from two sources and never double-counted: ``XidEvent`` rows, deduplicated on
(node, gpu, code, time), and the increases of ``GpuSample.xid_total`` per (node, gpu) (a counter
that resets when a probe restarts: a decrease starts a new segment, its value counts as new events).
The count per GPU is the larger of the two. Unlike dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS``
gauge (the last XID code, never reset), repeated identical XIDs count each time.

Severity: XIDs that mean the GPU or its memory is gone (48 DBE, 63/64 row remap, 74 NVLink,
79 fallen off the bus, 92/94/95 ECC, 119/120 GSP, 140) are critical, others warnings; any
double-bit ECC error is critical; single-bit growth, retired pages and remapped rows are warnings.
Throttling: the share of a GPU's samples with a harmful throttle reason
(``ranksight.simgpu.THROTTLE_HARMFUL``: power cap, HW slowdown, SW/HW thermal, power brake) or an SM
clock under ``clock_frac`` of its max while busy; a persistent share is a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage
from analyzers.evidence import fmt_ranks, fnum
from ranksight.schema import Finding
from ranksight.simgpu import THROTTLE_HARMFUL, throttle_names

NAME = "gpu_health"

CRITICAL_XIDS = {48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140}
XID_MEANING = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing", 45: "preemptive cleanup",
    48: "double-bit ECC error", 61: "internal micro-controller breakpoint", 62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping", 64: "ECC page retirement / row remap failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error",
}


@dataclass
class GpuHealthConfig:
    throttle_share: float = 0.3  # share of busy samples throttled ...
    min_samples: int = 3  # ... and at least this many of them
    clock_frac: float = 0.85  # SM clock under this fraction of max counts as under nominal
    busy_util: float = 30.0  # only busy samples are judged for clocks (idle GPUs clock down)


def count_xids(xe: pd.DataFrame, gp: pd.DataFrame) -> pd.DataFrame:
    """Per (node, gpu): XID count, codes, first time; from XidEvent rows (``xe``: the xid table) and the
    xid_total increases of the GPU samples (``gp``: the gpu table)."""
    rows: dict[tuple[int, int], dict] = {}
    if not xe.empty:
        x = xe.dropna(subset=["node", "gpu"]).copy()
        x["t_ms"] = (pd.to_numeric(x["t"], errors="coerce") * 1000).round()
        x = x.drop_duplicates(["node", "gpu", "code", "t_ms"])
        for (node, gpu), sub in x.groupby(["node", "gpu"]):
            rows[(int(node), int(gpu))] = dict(events=int(len(sub)), codes=sorted({int(c) for c in sub["code"]}),
                                               first_t=float(sub["t"].min()), counter=0)
    if not gp.empty:
        # a GPU whose counter reads 0 in every sample adds nothing: only the others are walked sample by sample
        counted = pd.to_numeric(gp["xid_total"], errors="coerce").fillna(0) != 0
        for (node, gpu), sub in _gpu_groups(gp, counted):
            v = pd.to_numeric(sub.sort_values("t")["xid_total"], errors="coerce").fillna(0).to_numpy()
            if v.size == 0:
                continue
            inc, first_t = 0, None
            ts = sub.sort_values("t")["t"].to_numpy()
            for i in range(1, len(v)):
                d = v[i] - v[i - 1]
                add = d if d >= 0 else v[i]  # counter reset: the new value is all new events
                if add > 0 and first_t is None:
                    first_t = float(ts[i])
                inc += add
            if v[0] > 0:  # present at the probe's first sample: counted once
                inc += v[0]
                first_t = first_t if first_t is not None else float(ts[0])
            if inc > 0:
                r = rows.setdefault((int(node), int(gpu)), dict(events=0, codes=[], first_t=first_t, counter=0))
                r["counter"] = int(inc)
                if r["first_t"] is None or (first_t is not None and first_t < r["first_t"]):
                    r["first_t"] = first_t
    out = [dict(node=k[0], gpu=k[1], count=max(v["events"], v["counter"]), **v) for k, v in rows.items()]
    return pd.DataFrame(out)


def _gpu_groups(gp: pd.DataFrame, rows: pd.Series):
    """``gp.groupby(["node", "gpu"])``'s (key, sub-frame) pairs, in its order, of the GPUs with at least one of
    ``rows`` true. The check judges every GPU every round; the per-GPU work (a dozen pandas operations) is
    spent only on the GPUs that can produce a finding, which the row-wise tests in ``rows`` tell at once."""
    flag = rows.to_numpy(dtype=bool)
    if not flag.any():
        return
    code = _gpu_codes(gp)
    if code is not None:  # grouped: only the samples of those GPUs (a handful of a fleet's million), in their order
        hit = np.zeros(int(code.max()) + 1, np.bool_)
        hit[code[flag]] = True
        keep = hit[code]
        if not keep.all():
            gp, flag = gp[keep], flag[keep]
    for key, idx in sorted(gp.groupby(["node", "gpu"]).indices.items()):
        if flag[idx].any():
            yield key, gp.iloc[idx]


def _may_find(gp: pd.DataFrame, cfg: GpuHealthConfig) -> pd.Series:
    """Per sample: could its GPU produce a finding? A double-bit ECC error; a memory-error counter that differs
    from another sample of its GPU (growth needs its last value above its first); a throttled or under-clocked
    busy sample (a throttle finding needs ``min_samples`` of them). Necessary conditions only: the per-GPU
    code decides."""
    code = _gpu_codes(gp)
    cols = ("ecc_dbe", "throttle_reasons", "util_pct", "sm_clock_mhz", "max_sm_clock_mhz")
    if code is not None and all(isinstance(gp[c].dtype, np.dtype) and gp[c].dtype.kind in "fiu" for c in cols):
        # the same row-wise tests on the columns' arrays (pandas' operators cost a second at 16 million samples)
        dbe, thr, util = gp["ecc_dbe"].to_numpy(), gp["throttle_reasons"].to_numpy(), gp["util_pct"].to_numpy()
        sm, max_sm = gp["sm_clock_mhz"].to_numpy(), gp["max_sm_clock_mhz"].to_numpy()
        with np.errstate(invalid="ignore"):
            busy_np = (util >= cfg.busy_util) | (np.isnan(util) if util.dtype.kind == "f" else False)
            bad_np = ((thr & THROTTLE_HARMFUL) != 0) | ((sm < cfg.clock_frac * max_sm) & busy_np)
            dbe_np = dbe > 0
        return _may_find_coded(gp, cfg, code, dbe_np, bad_np)
    keys = [gp["node"], gp["gpu"]]
    may = (gp["ecc_dbe"] > 0).fillna(False)
    harm = (gp["throttle_reasons"] & THROTTLE_HARMFUL) != 0
    busy = gp["util_pct"].isna() | (gp["util_pct"] >= cfg.busy_util)
    low_clock = (gp["sm_clock_mhz"] < cfg.clock_frac * gp["max_sm_clock_mhz"]).fillna(False) & busy
    bad = (harm | low_clock).astype(int)
    if code is None:  # keys that are not plain integers: pandas' groupby
        for c in ("ecc_sbe", "retired_pages", "remapped_rows"):
            g = gp[c].groupby(keys)
            may |= (g.transform("max") > g.transform("min")).fillna(False)
        may |= (bad.groupby(keys).transform("sum") >= cfg.min_samples).fillna(False)
        return may
    return _may_find_coded(gp, cfg, code, may.to_numpy(dtype=bool), bad.to_numpy(dtype=bool))


def _may_find_coded(gp: pd.DataFrame, cfg: GpuHealthConfig, code: np.ndarray, may: np.ndarray,
                    bad: np.ndarray) -> pd.Series:
    """``_may_find`` with the GPUs numbered (``code``), given its row-wise tests (``may``: a double-bit error;
    ``bad``: throttled or under-clocked while busy)."""
    # the same per-GPU max / min / sum with the GPUs numbered once (a groupby per column numbered them each time:
    # seconds at 10 million samples)
    m = int(code.max()) + 1 if len(code) else 0
    out = np.array(may, dtype=bool)
    for c in ("ecc_sbe", "retired_pages", "remapped_rows"):
        raw = gp[c].to_numpy()
        if raw.dtype.kind == "f" and (not len(raw) or np.isnan(raw).all() or np.nanmax(raw) == np.nanmin(raw)):
            continue  # one value in every sample (all 0 on a healthy fleet): no GPU's can have grown (tested on the
            # stored width: the same values, without a float64 copy of every sample)
        v = gp[c].to_numpy(dtype=float, na_value=np.nan)
        if not len(v) or np.isnan(v).all() or np.nanmax(v) == np.nanmin(v):
            continue
        hi, lo = np.full(m, -np.inf), np.full(m, np.inf)
        np.fmax.at(hi, code, v)  # NaN left out, as groupby max / min do (a GPU without values: never moved)
        np.fmin.at(lo, code, v)
        out |= (hi > lo)[code]
    out |= (np.bincount(code[bad], minlength=m) >= cfg.min_samples)[code]
    return pd.Series(out, index=gp.index)


def _gpu_codes(gp: pd.DataFrame) -> np.ndarray | None:
    """Each sample's GPU as one integer (node, gpu), or None where node or gpu is not a non-negative integer."""
    node, gpu = gp["node"].to_numpy(), gp["gpu"].to_numpy()
    if node.dtype.kind not in "iu" or gpu.dtype.kind not in "iu" or not len(node) or node.min() < 0 or gpu.min() < 0:
        return None
    width = int(gpu.max()) + 1
    # int32 where every code fits (half the memory traffic of int64 over a fleet's samples): the same numbers
    dtype = np.int32 if (int(node.max()) + 1) * width < 2**31 else np.int64
    return node.astype(dtype, copy=False) * dtype(width) + gpu.astype(dtype, copy=False)


_NUMERIC = ("ecc_dbe", "ecc_sbe", "retired_pages", "remapped_rows", "sm_clock_mhz", "max_sm_clock_mhz", "util_pct",
            "temp_c")


def _judged_columns(gp: pd.DataFrame) -> pd.DataFrame:
    """The columns of the GPU samples this check reads, as numbers (anything else NaN; throttle reasons 0), in a new
    frame that shares the sample columns instead of copying the whole table (a million samples at 16,384 GPUs)."""
    cols = {c: gp[c] for c in ("node", "gpu", "t")}
    cols.update({c: gp[c] if gp[c].dtype.kind in "fiu" else pd.to_numeric(gp[c], errors="coerce") for c in _NUMERIC})
    cols["throttle_reasons"] = pd.to_numeric(gp["throttle_reasons"], errors="coerce").fillna(0).astype(int)
    return pd.DataFrame(cols, copy=False)


def _xid_advice(place, node: int) -> str:
    """What to do about a critical XID on ``node``: drain it, or, where it is the job's only node, stop and test it."""
    if place.can_evict(node):
        return (f"Drain node {node}: checkpoint and evict it, then run the NVIDIA field diagnostics (dcgmi diag -r 3) "
                "before returning it.")
    return (f"Checkpoint and stop the job, run the NVIDIA field diagnostics (dcgmi diag -r 3) on node {node}, then "
            f"{place.evict_advice(node).removeprefix('checkpoint and ')}.")


def coverage(frame: AnalysisFrame, cfg: GpuHealthConfig | None = None) -> Coverage:
    """Can this check judge the run? It needs GPU telemetry: samples (NVML, DCGM) or XID events, which a node agent
    collects."""
    sig = frame.signals
    if sig.gpu_telemetry:
        return Coverage(NAME, "ran")
    if sig.device == "cpu":
        return Coverage(NAME, "not_applicable", "a CPU run without GPU samples (its simulated GPUs are sampled by a "
                                                "node agent)")
    return Coverage(NAME, "not_run", ("no GPU samples or XID events: run a node agent (ranksight agent) on each node; "
                                      "it reads NVML or DCGM"))


def analyze(frame: AnalysisFrame, cfg: GpuHealthConfig | None = None) -> list[Finding]:
    cfg = cfg or GpuHealthConfig()
    out: list[Finding] = []
    data, place = frame.data, frame.placement
    sim = data.simulated_gpu
    st = data.steps
    last_step = int(st["step"].max()) if not st.empty else None
    xids = count_xids(data.xid, data.gpu)
    # one finding per node and set of codes: a node-wide event (all its GPUs) is one event to act on
    groups: dict[tuple, list] = {}
    for _, x in xids.iterrows():
        groups.setdefault((int(x["node"]), tuple(x["codes"])), []).append(x)
    for (node, codes_t), rows in sorted(groups.items()):
        codes = list(codes_t)
        gpus = sorted(int(x["gpu"]) for x in rows)
        ranks = sorted({r for g in gpus for r in place.gpu_ranks(node, g)})
        crit = bool(set(codes) & CRITICAL_XIDS) or not codes
        firsts = [x["first_t"] for x in rows if x["first_t"] is not None]
        first_t = min(firsts) if firsts else None
        onset = frame.step_of_time(first_t) if first_t is not None else None
        count = int(sum(int(x["count"]) for x in rows))
        meaning = "; ".join(f"{c}: {XID_MEANING.get(c, 'see NVIDIA XID catalog')}" for c in codes) or "codes unknown (counter only)"
        where = f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {fmt_ranks(gpus)}"
        out.append(Finding(
            analyzer=NAME, kind="gpu_health", severity="critical" if crit else "warning", ranks=ranks, nodes=[node],
            step_start=onset, step_end=last_step,
            evidence=dict(cause="xid", node=node, gpus=gpus, xid_count=count, xid_events=int(sum(int(x["events"]) for x in rows)),
                          xid_counter_increase=int(sum(int(x["counter"]) for x in rows)),
                          per_gpu={int(x["gpu"]): int(x["count"]) for x in rows}, codes=codes,
                          first_t=fnum(first_t, 3), onset_step=onset, detected_at_step=onset),
            confidence=0.95, simulated=sim,
            summary=f"{count} XID event(s) on node {node} {where} (ranks {fmt_ranks(ranks)}): {meaning}" + (" [simulated]" if sim else ""),
            recommendation=(_xid_advice(place, node) if crit else f"Check the application on ranks {fmt_ranks(ranks)} and the driver log (dmesg) for XID {codes}."),
        ))
    gp = data.gpu
    if gp.empty:
        return out
    gp = _judged_columns(gp)
    for (node, gpu), sub in _gpu_groups(gp, _may_find(gp, cfg)):
        node, gpu = int(node), int(gpu)
        ranks = place.gpu_ranks(node, gpu)
        sub = sub.sort_values("t")
        dbe = sub["ecc_dbe"].dropna()
        if not dbe.empty and dbe.max() > 0:
            first_t = float(sub.loc[sub["ecc_dbe"] > 0, "t"].min())
            onset = frame.step_of_time(first_t)
            out.append(Finding(
                analyzer=NAME, kind="gpu_health", severity="critical", ranks=ranks, nodes=[node], step_start=onset, step_end=last_step,
                evidence=dict(cause="ecc_dbe", node=node, gpu=gpu, ecc_dbe=int(dbe.max()), first_t=fnum(first_t, 3), onset_step=onset),
                confidence=0.95, simulated=sim,
                summary=f"{int(dbe.max())} uncorrectable (double-bit) ECC error(s) on node {node} GPU {gpu}" + (" [simulated]" if sim else ""),
                recommendation=(f"Results computed on node {node} GPU {gpu} may be corrupt: checkpoint, "
                                + ("evict the node" if place.can_evict(node) else "stop the job")
                                + " and reset/RMA the GPU."),
            ))
        growth = {}
        for c in ("ecc_sbe", "retired_pages", "remapped_rows"):
            v = sub[c].dropna()
            if len(v) >= 2 and v.iloc[-1] > v.iloc[0]:
                growth[c] = int(v.iloc[-1] - v.iloc[0])
        if growth:
            out.append(Finding(
                analyzer=NAME, kind="gpu_health", severity="warning", ranks=ranks, nodes=[node], step_end=last_step,
                evidence=dict(cause="memory_errors", node=node, gpu=gpu, **{f"{k}_increase": v for k, v in growth.items()}),
                confidence=0.8, simulated=sim,
                summary=f"GPU memory errors growing on node {node} GPU {gpu}: " + ", ".join(f"{k} +{v}" for k, v in growth.items()),
                recommendation=f"Watch node {node} GPU {gpu}; schedule a field diagnostic at the next maintenance window.",
            ))
        harm = (sub["throttle_reasons"] & THROTTLE_HARMFUL) != 0
        busy = sub["util_pct"].isna() | (sub["util_pct"] >= cfg.busy_util)
        low_clock = (sub["sm_clock_mhz"] < cfg.clock_frac * sub["max_sm_clock_mhz"]).fillna(False) & busy
        bad = harm | low_clock
        n_busy = int(busy.sum()) or len(sub)
        share = float(bad.sum()) / n_busy if n_busy else 0.0
        if bad.sum() >= cfg.min_samples and share >= cfg.throttle_share:
            bits = int(np.bitwise_or.reduce(sub.loc[harm, "throttle_reasons"].to_numpy())) if harm.any() else 0
            names = [n for n in throttle_names(bits & THROTTLE_HARMFUL)]
            bad_rows = sub[bad]
            first_t = float(bad_rows["t"].min())
            onset = frame.step_of_time(first_t)
            clk = float(bad_rows["sm_clock_mhz"].median()) if bad_rows["sm_clock_mhz"].notna().any() else None
            mx = float(sub["max_sm_clock_mhz"].max()) if sub["max_sm_clock_mhz"].notna().any() else None
            temp = float(bad_rows["temp_c"].max()) if bad_rows["temp_c"].notna().any() else None
            reason = ", ".join(names) if names else "clocks under nominal"
            clk_txt = f"; SM clock {clk:.0f} of {mx:.0f} MHz ({clk / mx:.0%})" if clk and mx else ""
            out.append(Finding(
                analyzer=NAME, kind="gpu_health", severity="warning", ranks=ranks, nodes=[node], step_start=onset,
                step_end=frame.step_of_time(float(bad_rows["t"].max())),
                evidence=dict(cause="throttle", node=node, gpu=gpu, throttled_share=fnum(share, 3), throttled_samples=int(bad.sum()),
                              samples=int(len(sub)), reasons=names, sm_clock_mhz=fnum(clk, 0), max_sm_clock_mhz=fnum(mx, 0),
                              temp_c_max=fnum(temp, 1), first_t=fnum(first_t, 3), onset_step=onset, detected_at_step=onset),
                confidence=0.85, simulated=sim,
                summary=f"node {node} GPU {gpu} (ranks {fmt_ranks(ranks)}) throttled in {share:.0%} of busy samples: {reason}{clk_txt}" + (" [simulated]" if sim else ""),
                recommendation=(f"Check cooling and power on node {node} (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER); "
                                f"if it persists, {place.evict_advice(node)}."),
            ))
    return out
