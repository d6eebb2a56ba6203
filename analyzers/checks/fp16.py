"""fp16 overflow: skipped steps, loss-scale collapse, NaN/inf losses.

- NaN/inf loss (``loss_nonfinite``) on any rank: critical, from the first such step.
- Overflow runs: GradScaler found inf/nan gradients (``overflow``/``skipped``). The first steps of
  a run calibrate the scale (it starts high and halves until gradients fit), so overflow steps
  before the first clean step are ignored unless that run is longer than ``calibration_max``.
  After that, ``persist`` overflow steps within ``window`` make a finding; the skipped-step rate over
  the run and the scale trajectory are the evidence.
- Collapse: the scale halved ``collapse_halvings`` times from its peak, or fell to ``min_scale``:
  critical, training is not progressing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analyzers.builder import AnalysisFrame, Coverage
from analyzers.evidence import fmt_ranks, fnum
from analyzers.persistence import confirmation_step, persistent_runs
from ranksight.schema import Finding

NAME = "fp16"


@dataclass
class Fp16Config:
    persist: int = 3
    window: int = 5
    calibration_max: int = 8  # overflow steps tolerated while the scale calibrates at the start
    skip_rate_warn: float = 0.05  # skipped-step rate over the run after calibration
    collapse_halvings: int = 8  # scale fell 2^8 below its peak ...
    min_scale: float = 1.0  # ... or down to this


def coverage(frame: AnalysisFrame, cfg: Fp16Config | None = None) -> Coverage:
    """Can this check judge the run? It needs the loss (non-finite losses) and, on fp16 runs, GradScaler's
    ``loss_scale`` or ``overflow``/``skipped`` flags."""
    sig = frame.signals
    st = frame.data.steps
    flags = bool(st["overflow"].any() or st["skipped"].any()) if not st.empty else False
    if not (sig.loss or sig.loss_scale or flags):
        return Coverage(NAME, "not_run", ("no loss, loss_scale or overflow in the step records: "
                                          "s.report(loss=..., loss_scale=..., overflow=...)"))
    if sig.loss_scale or flags:
        return Coverage(NAME, "ran")
    if sig.precision == "fp16":
        return Coverage(NAME, "limited", ("an fp16 run without loss_scale or overflow in its step records: overflow "
                                          "runs and loss-scale collapse are not judged, only non-finite losses"))
    if sig.precision:
        return Coverage(NAME, "ran")  # not an fp16 run: no loss scale to watch
    return Coverage(NAME, "ran",
                    "non-finite losses judged; no loss_scale recorded (fp16 runs: s.report(loss_scale=...))")


def analyze(frame: AnalysisFrame, cfg: Fp16Config | None = None) -> list[Finding]:
    cfg = cfg or Fp16Config()
    st = frame.data.steps
    if st.empty:
        return []
    out: list[Finding] = []
    node_of = frame.placement.rank_node
    # NaN / inf losses. The first recorded step is not judged: a pipeline schedule's shape inference
    # computes a throw-away loss there; a real divergence at step 1 stays non-finite afterwards.
    nf = st[st["loss_nonfinite"] & (st["step"] > int(st["step"].min()))]
    if not nf.empty:
        ranks = sorted(int(r) for r in nf["rank"].unique())
        s0, s1 = int(nf["step"].min()), int(nf["step"].max())
        per_rank = {int(r): int(s) for r, s in nf.groupby("rank")["step"].min().items()}
        out.append(Finding(
            analyzer=NAME, kind="fp16_overflow", severity="critical", ranks=ranks, nodes=sorted({node_of.get(r, 0) for r in ranks}),
            step_start=s0, step_end=s1,
            evidence=dict(cause="nonfinite_loss", nonfinite_steps=int(nf["step"].nunique()), first_step_per_rank=per_rank,
                          onset_step=s0, detected_at_step=s0),
            confidence=0.95,
            summary=f"non-finite (NaN/inf) loss on rank(s) {fmt_ranks(ranks)} since step {s0} ({nf['step'].nunique()} step(s))",
            recommendation="Lower the learning rate or add warm-up, clip gradients (max_norm 1.0), and prefer bf16 over fp16; check the data of that step.",
        ))
    # Overflow / skipped steps: GradScaler is synchronised, so look at the world per step. A run without a single
    # overflow or skipped record has none to find (no per-step pass over every record)
    if not (st["overflow"].any() or st["skipped"].any()):
        return out
    per_step = st.groupby("step").agg(overflow=("overflow", "any"), skipped=("skipped", "any"), scale=("loss_scale", "min"),
                                      nonfinite=("loss_nonfinite", "any"))
    # steps skipped because the loss itself was NaN/inf are the non-finite finding's, not overflow
    ov = (per_step["overflow"] | per_step["skipped"]) & ~per_step["nonfinite"]
    if not ov.any():
        return out
    clean_steps = per_step.index[~ov]
    first_clean = int(clean_steps.min()) if len(clean_steps) else None
    calib_len = int(ov.loc[: first_clean - 1].sum()) if first_clean is not None else int(ov.sum())
    flags = ov.copy()
    if first_clean is not None and calib_len <= cfg.calibration_max:
        flags.loc[: first_clean - 1] = False  # the scale's calibration at the start of the run
    after = ov.loc[first_clean:] if first_clean is not None else ov
    skip_rate = float(after.mean()) if len(after) else 1.0
    scale = per_step["scale"].dropna()
    peak = float(scale.max()) if not scale.empty else None
    low = float(scale.min()) if not scale.empty else None
    halvings = int(round(math.log2(peak / low))) if peak and low and low > 0 else None
    collapsed = bool(scale.size and ((low is not None and low <= cfg.min_scale) or (halvings or 0) >= cfg.collapse_halvings))
    ranks = sorted(int(r) for r in st["rank"].unique())
    for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
        sub = scale.loc[s0:s1]
        # critical when the collapse (the scale's lowest point) happened in this run
        sev = "critical" if collapsed and not sub.empty and low is not None and float(sub.min()) <= low else "warning"
        ev = dict(cause="loss_scale_collapse" if sev == "critical" else "overflow_run", overflow_steps=n,
                  skipped_rate=fnum(skip_rate, 3), scale_peak=fnum(peak, 4), scale_min=fnum(low, 6),
                  scale_at_onset=fnum(scale.get(s0, np.nan), 4), scale_at_end=fnum(scale.get(s1, np.nan), 6),
                  halvings_from_peak=halvings, onset_step=s0, detected_at_step=confirmation_step(flags, s0, cfg.persist))
        out.append(Finding(
            analyzer=NAME, kind="fp16_overflow", severity=sev, ranks=ranks, nodes=frame.placement.nodes_of(ranks), step_start=s0, step_end=s1,
            evidence=ev, confidence=0.9,
            summary=(f"fp16 overflow: {n} skipped step(s) from step {s0} to {s1}, loss scale "
                     f"{ev['scale_at_onset']} -> {ev['scale_at_end']}" + (" (collapsed)" if sev == "critical" else "")),
            recommendation="Switch to bf16 autocast if the hardware has it; otherwise lower the learning rate, clip gradients, and look for the layer that overflows (activations growing).",
        ))
    if not out and skip_rate >= cfg.skip_rate_warn and len(after) >= cfg.window:
        out.append(Finding(
            analyzer=NAME, kind="fp16_overflow", severity="warning", ranks=ranks, nodes=frame.placement.nodes_of(ranks),
            step_start=int(after.index.min()), step_end=int(after.index.max()),
            evidence=dict(cause="skip_rate", skipped_rate=fnum(skip_rate, 3), skipped_steps=int(after.sum()),
                          steps=int(len(after)), scale_min=fnum(low, 6), scale_peak=fnum(peak, 4)),
            confidence=0.7,
            summary=f"fp16: {skip_rate:.0%} of steps skipped for overflow after calibration",
            recommendation="Frequent overflow wastes steps: prefer bf16, or lower the learning rate / clip gradients.",
        ))
    return out
