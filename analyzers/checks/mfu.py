"""MFU over time, drops against the run's own baseline, and the likely cause of each drop.

MFU (PaLM convention) per step = mean over ranks of flops / step time / peak, where
``StepRecord.flops`` is the rank's model FLOPs (6N + 12*L*H*Q*T per token) and the peak is the
manifest's per-device ``peak_flops`` (``peak_source`` says which: a device table on GPUs, a
measured matmul peak on CPUs). Without a peak the same method runs on achieved FLOP/s.

Change-point: the reference is the 90th percentile of the series (the run's good level; robust
to a drop that starts early); a step is low when below reference * (1 - max(drop_frac, k*sigma)),
sigma the robust relative noise; ``persist`` low steps out of ``window`` make a drop, its first
low step the onset.

Attribution: the step-time increase of the drop window over the baseline (the steps before it)
is split into data wait, compute of the median rank, extra compute of the slowest rank (straggler),
exposed communication, and pipeline wait; the largest share is the cause, refined by GPU telemetry
(harmful throttle reasons or clocks under max in the window: clock throttle) and the profiler flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage, transfer_ms
from analyzers.evidence import fnum
from analyzers.loader import RunData
from analyzers.persistence import confirmation_step, persistent_runs
from analyzers.stats import robust_sigma
from ranksight.schema import Finding
from ranksight.simgpu import THROTTLE_HARMFUL

NAME = "mfu"


@dataclass
class MfuConfig:
    drop_frac: float = 0.15  # a drop is at least this far below the run's reference level
    critical_frac: float = 0.50
    mad_k: float = 4.0
    persist: int = 3
    window: int = 5
    warmup_steps: int = 1
    ref_quantile: float = 0.9
    clock_frac: float = 0.90  # SM clock below this fraction of max counts as throttled


def series(data: RunData) -> pd.DataFrame:
    """Per step: step_ms (max over ranks), tflops per rank (mean), mfu (mean; NaN without a peak)."""
    st = data.steps
    if st.empty:
        return pd.DataFrame(columns=["step_ms", "tflops", "mfu"])
    # the check and the report both ask (a pass over every step record): kept while the tables are the same frames
    memo = data.__dict__.get("_mfu_series")
    if memo is not None and memo[0] is st and memo[1] is data.gpu and memo[2] == len(st):
        return memo[3].copy()
    out = _series(data, st)
    data.__dict__["_mfu_series"] = (st, data.gpu, len(st), out)
    return out.copy()


def _series(data: RunData, st: pd.DataFrame) -> pd.DataFrame:
    fps = flops_per_s(st["step_ms"], st["flops"])
    out = _per_step_max_mean(st["step"], st["step_ms"], fps)
    if out is None:
        g = st.assign(fps=fps)
        out = g.groupby("step").agg(step_ms=("step_ms", "max"), fps=("fps", "mean"))
    peak = data.peak.flops
    out["tflops"] = out["fps"] / 1e12
    out["mfu"] = out["fps"] / peak if peak > 0 else np.nan
    return out.drop(columns="fps")


def flops_per_s(step_ms: pd.Series, flops: pd.Series) -> np.ndarray:
    """Each row's FLOP/s, ``flops / (step_ms / 1000)``, NaN where the step time is not positive: on numpy float
    columns the same operations in the same widths on their arrays (a float32 step time divided by 1000 stays
    float32, as pandas keeps it), without a Series per operation."""
    ms, fl = step_ms.to_numpy(), flops.to_numpy()
    if not (isinstance(step_ms.dtype, np.dtype) and isinstance(flops.dtype, np.dtype) and ms.dtype.kind == "f"
            and fl.dtype.kind == "f"):
        return np.where(step_ms > 0, flops / (step_ms.where(step_ms > 0, 1) / 1000.0), np.nan)
    pos = ms > 0
    return np.where(pos, fl / (np.where(pos, ms, ms.dtype.type(1)) / 1000.0), np.nan)


def _per_step_max_mean(step: pd.Series, step_ms: pd.Series, fps: np.ndarray) -> pd.DataFrame | None:
    """``groupby("step").agg(step_ms=max, fps=mean)`` where the rows are in step order and neither column has NaN:
    each step's rows are one segment, and pandas takes such a group's max and mean as ``np.maximum.reduceat`` and
    ``np.add.reduceat`` over the segments (the mean: the sum over the segment's size): the same calls here, without
    numbering 16 M rows' groups. None where that does not hold (pandas' groupby then)."""
    s = step.to_numpy()
    ms = step_ms.to_numpy()
    if (len(s) == 0 or s.dtype.kind not in "iu" or ms.dtype.kind != "f" or fps.dtype != np.float64
            or not bool((s[1:] >= s[:-1]).all()) or np.isnan(ms).any() or np.isnan(fps).any()):
        return None
    starts = np.concatenate(([0], np.flatnonzero(s[1:] != s[:-1]) + 1))
    sizes = np.diff(np.append(starts, len(s))).astype(np.float64)
    return pd.DataFrame({"step_ms": np.maximum.reduceat(ms, starts), "fps": np.add.reduceat(fps, starts) / sizes},
                        index=pd.Index(s[starts], name="step"))


def peak_label(data: RunData) -> tuple[str, bool]:
    """What MFU is measured against, as reports say it (without a peak: why MFU is n/a and how to give one), and
    whether that peak is simulated (measured on a CPU)."""
    p = data.peak
    if not p.known:
        return f"no peak FLOPs known, MFU n/a (achieved FLOP/s used): {p.missing}", False
    return f"{p.flops / 1e12:.2f} TFLOP/s per device ({p.source})", p.simulated


def _attribute(frame: AnalysisFrame, cfg: MfuConfig, s0: int, s1: int) -> tuple[str, dict]:
    data = frame.data
    st = data.steps
    first = int(st["step"].min()) + cfg.warmup_steps
    win = st[(st["step"] >= s0) & (st["step"] <= s1)]
    base = st[(st["step"] >= first) & (st["step"] < s0)]
    if base.empty:
        base = st[st["step"] > s1]
    ev: dict = {}
    if base.empty or win.empty:
        return "unknown", ev

    def per_step(df: pd.DataFrame) -> dict:
        tr = transfer_ms(df)
        g = df.assign(transfer=tr).groupby("step")
        comp = g["compute_ms"]
        return dict(step=g["step_ms"].max().median(), data=g["data_ms"].max().median(),
                    compute=comp.median().median(), straggle=(comp.max() - comp.median()).median(),
                    comm=g["transfer"].mean().median(), pipe=g["pipeline_wait_ms"].min().median(),
                    profiling=float(df["profiling"].mean()))

    b, w = per_step(base), per_step(win)
    deltas = {k: float(w[k] - b[k]) for k in ("data", "compute", "straggle", "comm", "pipe")}
    if frame.compute_signal == "device_ms":
        # the device's own time over the same steps: wall-clock compute that grew while it did not is the host
        dev_b = base.groupby("step")["device_ms"].median().median()
        dev_w = win.groupby("step")["device_ms"].median().median()
        ev["device_ms_delta"] = fnum(dev_w - dev_b, 1)
    ev.update(step_ms_baseline=fnum(b["step"], 1), step_ms_drop=fnum(w["step"], 1),
              delta_ms={k: fnum(v, 1) for k, v in deltas.items()},
              profiling_share=fnum(w["profiling"], 2), profiling_share_baseline=fnum(b["profiling"], 2))
    # GPU telemetry in the window
    throttled_gpus: list[dict] = []
    if not data.gpu.empty:
        t0, t1 = float(win["t_start"].min()), float(win["t_end"].max())
        tb0, tb1 = float(base["t_start"].min()), float(base["t_end"].max())
        gp = data.gpu.copy()
        harm = (pd.to_numeric(gp["throttle_reasons"], errors="coerce").fillna(0).astype(int) & THROTTLE_HARMFUL) != 0
        clk = pd.to_numeric(gp["sm_clock_mhz"], errors="coerce")
        mx = pd.to_numeric(gp["max_sm_clock_mhz"], errors="coerce")
        low = (clk < cfg.clock_frac * mx).fillna(False)
        gp = gp.assign(bad=harm | low)
        inw = gp[(gp["t"] >= t0) & (gp["t"] <= t1)]
        inb = gp[(gp["t"] >= tb0) & (gp["t"] <= tb1)]
        for (node, gpu), sub in inw.groupby(["node", "gpu"]):
            frac = float(sub["bad"].mean())
            bsub = inb[(inb["node"] == node) & (inb["gpu"] == gpu)]
            bfrac = float(bsub["bad"].mean()) if not bsub.empty else 0.0
            if frac >= 0.5 and frac - bfrac >= 0.3:
                throttled_gpus.append(dict(node=int(node), gpu=int(gpu), throttled_share=fnum(frac, 2),
                                           ranks=frame.placement.gpu_ranks(int(node), int(gpu)),
                                           sm_clock_mhz=fnum(pd.to_numeric(sub["sm_clock_mhz"], errors="coerce").median(), 0)))
    if throttled_gpus:
        ev["throttled_gpus"] = throttled_gpus
    main = max(deltas, key=lambda k: deltas[k])
    if deltas[main] <= 0:
        return "unknown", ev
    if w["profiling"] - b["profiling"] >= 0.5:
        return "profiler_on", ev
    if main in ("compute", "straggle") and throttled_gpus:
        return "clock_throttle", ev
    dev_delta = ev.get("device_ms_delta")
    if main == "compute" and dev_delta is not None and dev_delta < 0.25 * deltas["compute"]:
        return "host_contention", ev
    return {"data": "data_stall", "compute": "compute_slowdown", "straggle": "straggler", "comm": "comm_growth",
            "pipe": "pipeline_wait"}[main], ev


RECOMMEND = {
    "clock_throttle": "GPU clocks are throttled (thermal/power): check cooling, power caps and the node's health; evict the node if it persists.",
    "data_stall": "The input pipeline cannot keep up: more DataLoader workers, pinned memory, prefetching, or faster storage.",
    "straggler": "One rank slowed down and the rest wait for it: see the straggler finding for the culprit.",
    "comm_growth": "Communication got slower: check the links (nccl-tests) and the NCCL transport in use.",
    "pipeline_wait": "Pipeline stages wait more for each other: check stage balance and inter-stage links.",
    "compute_slowdown": "Every rank computes slower: look for CPU/GPU contention on the hosts or a changed workload.",
    "host_contention": ("Every rank's wall-clock compute grew while the devices' own time did not: the hosts' CPUs are "
                        "contended (other processes, data loader workers, Python overhead); pin or move them."),
    "profiler_on": "The profiler was active during the drop: expected overhead; keep traces short.",
    "unknown": "No other signal explains the drop; capture a profiler trace over the affected steps.",
}


def coverage(frame: AnalysisFrame, cfg: MfuConfig | None = None) -> Coverage:
    """Can this check judge the run? MFU needs each step's model FLOPs (``StepRecord.flops``) and the device's peak
    (``RunData.peak``); without them drops are judged on achieved FLOP/s or steps per second."""
    cfg = cfg or MfuConfig()
    sig = frame.signals
    if sig.steps - cfg.warmup_steps < cfg.persist + 2:
        return Coverage(NAME, "not_run", f"only {sig.steps} step(s): it needs {cfg.warmup_steps + cfg.persist + 2}")
    if not sig.flops:
        return Coverage(NAME, "limited", ("no flops in the step records (s.report(flops=...)): MFU n/a, drops judged "
                                          "on steps per second"))
    if not sig.peak:
        return Coverage(NAME, "limited", f"MFU n/a, drops judged on achieved FLOP/s: {frame.data.peak.missing}")
    return Coverage(NAME, "ran")


def _recommendation(frame: AnalysisFrame, cause: str) -> str:
    """``RECOMMEND[cause]``; a single-node job is not told to evict its node."""
    if cause == "clock_throttle" and frame.placement.n_nodes <= 1:
        return ("GPU clocks are throttled (thermal/power): check cooling, power caps and the machine's health; if it "
                f"persists, {frame.placement.evict_advice(None)}.")
    return RECOMMEND[cause]


def analyze(frame: AnalysisFrame, cfg: MfuConfig | None = None) -> list[Finding]:
    cfg = cfg or MfuConfig()
    data = frame.data
    st = data.steps
    if st.empty:
        return []
    ser = series(data)
    first = int(ser.index.min()) + cfg.warmup_steps
    ser = ser[ser.index >= first]
    use_mfu = ser["mfu"].notna().any()
    if use_mfu:
        y = ser["mfu"]
    elif (ser["tflops"] > 0).any():
        y = ser["tflops"]
    else:
        y = 1000.0 / ser["step_ms"].replace(0, np.nan)  # steps/s: no FLOPs recorded
    y = y.dropna()
    if len(y) < cfg.persist + 2:
        return []
    ref = float(y.quantile(cfg.ref_quantile))
    if ref <= 0:
        return []
    rel = y / ref
    sigma = robust_sigma(rel[rel >= rel.median()].to_numpy() if len(rel) else [])
    drop_thr = max(cfg.drop_frac, cfg.mad_k * sigma)
    flags = rel < (1 - drop_thr)
    label, peak_sim = peak_label(data)
    out: list[Finding] = []
    for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
        level = float(y.loc[s0:s1].median())
        drop = 1 - level / ref
        cause, ev = _attribute(frame, cfg, s0, s1)
        ranks = sorted(int(r) for r in st["rank"].unique())
        if cause == "clock_throttle":
            ranks = sorted({r for g in ev["throttled_gpus"] for r in g["ranks"]}) or ranks
        elif cause in ("straggler", "data_stall"):
            col = "compute_ms" if cause == "straggler" else "data_ms"
            win = st[(st["step"] >= s0) & (st["step"] <= s1)]
            ranks = [int(win.groupby("rank")[col].median().idxmax())]
        # a drop with a named cause is actionable; one that only says "every rank got slower" (another job
        # on the host, a changed workload) or "the profiler was on" is reported as info
        if cause in ("compute_slowdown", "host_contention", "unknown", "profiler_on"):
            sev = "info"
        else:
            sev = "critical" if drop >= cfg.critical_frac else "warning"
        metric = "MFU" if use_mfu else "throughput"
        fmt = (lambda v: f"{v:.1%}") if use_mfu else (lambda v: f"{v:.3g}")
        ev.update(metric=metric, reference=fnum(ref, 4), level=fnum(level, 4), drop=fnum(drop, 3), threshold_drop=fnum(drop_thr, 3),
                  steps_affected=n, onset_step=s0, detected_at_step=confirmation_step(flags, s0, cfg.persist),
                  peak=label, cause=cause)
        out.append(Finding(
            analyzer=NAME, kind="mfu_drop", severity=sev, ranks=ranks, nodes=frame.placement.nodes_of(ranks), step_start=s0, step_end=s1,
            evidence=ev, confidence=0.6 if cause == "unknown" else 0.75,
            summary=f"{metric} fell {drop:.0%} ({fmt(ref)} -> {fmt(level)}) from step {s0} to {s1}; likely cause: {cause.replace('_', ' ')}",
            recommendation=_recommendation(frame, cause),
            simulated=peak_sim or (cause == "clock_throttle" and data.simulated_gpu),
        ))
    return out
