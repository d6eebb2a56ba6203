"""Stragglers: which rank (or node, or pipeline stage) is slow, since which step, and who only waits for it.

In synchronous training every rank's step time is the same: the fast ranks wait inside the
gradient all-reduce for the slowest. Step time therefore names nobody. This check uses

1. each rank's compute signal (``device_ms``, the device's busy time, when every step record has it, else
   ``compute_ms``: its own work, excluding time blocked in communication, data loading and pipeline
   waits; ``AnalysisFrame.compute_signal``) against the median of its comparable peers in the same
   step (leave-one-out median; peers = the ranks of the same pipeline stage when pp > 1,
   since stages do different work): score = own / peers, NVRx's relative score inverted;
2. a one-sided CUSUM over log(score) with drift log(min_ratio): it alarms when the accumulated
   excess exceeds h = max(h_sigma x sigma, 2 log(min_ratio)), sigma the robust (MAD) noise of the
   scores over time, after at least ``min_steps`` steps, most of them slow. A quiet run confirms a
   small steady slow-down in a few steps, a noisy one needs more evidence; one noisy step never alarms;
3. the onset is the least-squares change point of the CUSUM excursion that alarmed (CUSUM alone
   starts on the first noisy-high step), the end its last slow step;
4. arrival order as corroboration: the culprit arrives last at the step's gradient sync
   (``sync_arrival``; or ``CollectiveRecord.t_arrive``), late by about its extra compute, and waits
   least; its victims wait ``sync_wait_ms``, which is reported as evidence, never as a cause. A rank
   that computes longer but is not the last to arrive in most of those steps (or arrives less than
   half its extra compute late) is reported as info only: its slowness is after the sync point or
   host noise spread over the step, and it is not what the others wait for.

A node whose ranks are all flagged becomes one node finding; with pp > 1, a stage whose ranks
all slowed against their own baseline (while other stages did not) becomes a stage finding.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage, StepView, two_values
from analyzers.changepoint import cusum_runs_rows, refine_onset
from analyzers.evidence import fmt_ranks, fnum
from analyzers.persistence import confirmation_step, persistent_runs
from analyzers.checks.straggler_scores import RankScores, median_finite, with_baseline_noise
from analyzers.checks.straggler_tp import tp_evidence, tp_wait_frame  # noqa: F401 (tp_wait_frame re-exported)
from analyzers.stats import leave_one_out_median, median_rows, temporal_sigma
from ranksight.schema import Finding

NAME = "stragglers"


@dataclass
class StragglerConfig:
    min_ratio: float = 1.08  # own compute / peers' median: the slow CUSUM's drift (a step below it is evidence against)
    h_sigma: float = 8.0  # slow CUSUM alarm threshold in units of the scores' noise ...
    min_h_factor: float = 2.0  # ... and at least this many times its drift log(min_ratio)
    fast_ratio: float = 1.25  # the fast CUSUM's drift: large slow-downs are confirmed in min_steps steps ...
    fast_h_sigma: float = 3.0  # ... with a threshold of this many sigma ...
    fast_min_h_factor: float = 1.0  # ... and at least this many times its drift log(fast_ratio)
    few_peers_h_factor: float = 1.35  # both thresholds x this for a rank compared with a single peer (pp stage of 2 ranks):
    # the two scores mirror each other and no third rank says which one moved
    clip_h_share: float = 0.5  # one step adds at most this share of h to a CUSUM (a scheduling spike is one step)
    baseline_noise_weight: float = 0.75  # sigma >= this x the noise of the clean warm-up steps (all ranks pooled)
    min_steps: int = 3  # an alarm needs at least this many steps ...
    high_share: float = 0.6  # ... most of them above min_ratio
    mad_k: float = 4.0  # stage drift: threshold 1 + k * sigma
    persist: int = 3  # stage drift: flagged steps needed ...
    window: int = 5  # ... within this many consecutive steps
    warmup_steps: int = 1  # first steps of the run are not judged (compilation, allocator warm-up) ...
    restart_warmup_steps: int = 5  # ... nor the first steps after a restart or re-form (checkpoint load, bucket rebuild)
    short_uncorroborated_steps: int = 6  # a device-time episode that arrival order does not confirm is info unless it
    uncorroborated_ratio: float = 1.2  # lasts this many steps at this ratio or more ...
    long_uncorroborated_steps: int = 12  # ... or this many steps at any ratio: other processes sharing a rank's core
    # inflate its CPU time (cache, memory bandwidth) in spells shorter and smaller than that (bench/detect.py's host noise)
    critical_ratio: float = 2.0  # a rank at 2x its peers is critical
    baseline_steps: int = 5  # for stage/node drift: the first steps after warm-up form the baseline
    min_ranks: int = 2
    last_arrival_share: float = 0.5  # corroboration: the culprit is the last to arrive in this share of its slow steps ...
    lag_fraction: float = 0.5  # ... and arrives late by at least this fraction of its extra compute


def coverage(frame: AnalysisFrame, cfg: StragglerConfig | None = None) -> Coverage:
    """Can this check judge the run? It needs each rank's own compute apart from its waiting (``device_ms``, or a
    ``compute_ms`` that is not the step time): in synchronous training every rank's step time is the same, so from
    step times alone a slow rank cannot be seen. Sync arrival timing confirms who the others wait for."""
    cfg = cfg or StragglerConfig()
    sig = frame.signals
    if sig.ranks < cfg.min_ranks:
        return Coverage(NAME, "not_applicable", "one rank: no peers to compare it with")
    if not sig.compute_split:
        return Coverage(NAME, "not_run", (
            "no sync arrival or compute split in the step records (no device_ms, compute_ms, comm_ms or "
            "sync_wait_ms; compute is the step time, the same on every rank of a synchronous job): a slow rank "
            "cannot be seen; instrument the loop with ranksight.init, rs.step and rs.watch(model)"))
    if sig.steps - cfg.warmup_steps < cfg.persist:
        return Coverage(NAME, "not_run", f"only {sig.steps} step(s): it needs {cfg.warmup_steps + cfg.persist}")
    limits = []
    if not sig.sync_arrival:
        limits.append("no sync arrival timing (sync_arrival, collective t_arrive): a slow rank is named from its "
                      "compute alone, not confirmed by who waits for whom (rs.watch(model) records it)")
    if not sig.device_time:
        limits.append("judged on wall-clock compute (no device_ms in every step record), which host scheduling "
                      "stretches: ranksight.init measures device time (CUDA events, or CPU thread time)")
    return Coverage(NAME, "limited" if limits else "ran", "; ".join(limits))


def _arrival_evidence(frame: AnalysisFrame, rank: int, group: list[int], s0: int, s1: int) -> dict:
    """Arrival at the gradient sync over [s0, s1] of ``rank`` against the others of its group: how late it arrives
    (``arrival_lag_ms``), in which share of the steps it is the last (``last_arrival_share``), and the waits."""
    steps = frame.steps_from(s0)
    ev: dict = {}
    arr = steps.span_matrix("sync_arrival", group, s0, s1)
    if arr.empty and not steps.has_rows(group, s0, s1):  # a cell of the matrix is a row (the search over rows is
        return ev  # asked only when there is none)
    if rank in arr.index and arr.notna().values.any() and len(arr.index) > 1:
        own = arr.loc[rank]
        others = arr.drop(index=rank)
        lag = (own - _column_medians(others)) * 1000.0
        last = (arr.idxmax() == rank)
        ev["arrival_lag_ms"] = fnum(lag.median(), 1)
        ev["last_arrival_share"] = fnum(last.mean(), 2)
    elif not frame.data.collectives.empty:
        co = frame.data.collectives
        co = co[(co["step"] >= s0) & (co["step"] <= s1) & co["rank"].isin(group)]
        if not co.empty and co["rank"].nunique() > 1:
            last = co.loc[co.groupby(["gkey", "seq"])["t_arrive"].idxmax()]
            ev["last_arrival_share"] = fnum((last["rank"] == rank).mean(), 2)
    wait = steps.span_matrix("sync_wait_ms", group, s0, s1)
    if rank in wait.index and wait.notna().values.any():
        ev["own_wait_ms"] = fnum(wait.loc[rank].mean(), 1)
        others = wait.drop(index=rank)
        if not others.empty:
            ev["victims_mean_wait_ms"] = fnum(np.nanmean(others.to_numpy(dtype=float)), 1)
    return ev


def _data_extra_ms(frame: AnalysisFrame, rank: int, group: list[int], s0: int, s1: int) -> float | None:
    """Median over [s0, s1] of the rank's data wait minus its peers' median data wait, per step."""
    d = frame.steps_from(s0).span_matrix("data_ms", group, s0, s1)  # data_ms is never NaN: a cell for every row
    if d.shape[0] < 2 or rank not in d.index:
        return None
    return float(np.nanmedian((d.loc[rank] - _column_medians(d.drop(index=rank))).to_numpy(dtype=float)))


def _wait_evidence(frame: AnalysisFrame, rank: int, group: list[int], s0: int, s1: int) -> dict:
    """Total blocked time (sync wait + pipeline wait) of ``rank`` against the others of its group."""
    w = frame.steps_from(s0).span_matrix("total_wait_ms", group, s0, s1)  # never NaN: a cell for every row
    if w.shape[0] < 2 or rank not in w.index:
        return {}
    own = w.loc[rank]
    others = _column_medians(w.drop(index=rank))
    return dict(least_wait_share=fnum((w.idxmin() == rank).mean(), 2),
                own_total_wait_ms=fnum(own.median(), 1),
                peers_wait_minus_own_ms=fnum((others - own).median(), 1))


def _rank_findings(frame: AnalysisFrame, cfg: StragglerConfig, steps: StepView, signal: str,
                   scratch: dict | None = None) -> list[dict]:
    """Per-rank candidates from the ``signal`` column of ``steps``: dicts with rank, onset, end, counts, medians.

    Each step, a rank's score is log(its compute / the leave-one-out median of its peers). A one-sided
    CUSUM with drift log(min_ratio) accumulates the evidence; it alarms when the sum exceeds
    h = max(h_sigma x sigma, min_h_factor x log(min_ratio)) after at least ``min_steps`` steps, most of
    them slow. sigma is the robust noise of the scores over time (median across ranks), so a quiet run
    confirms a small steady slow-down in a few steps while a noisy one needs a larger or longer slow-down;
    one noisy step never does it.
    """
    out = []
    comp = steps.matrix(signal)
    groups = frame.placement.peer_groups(list(comp.index))
    judged = [m for m in groups.values() if len(m) >= cfg.min_ranks]
    if not judged:
        return out
    scores = RankScores(steps, signal, comp, judged, scratch)  # scratch: an array the candidates keep nothing of
    sigma, base_sigma = scores.noise_sigma(cfg)
    k = float(np.log(cfg.min_ratio))
    detectors = []  # (drift, threshold): slow (small, steady slow-downs) and fast (large ones, in min_steps)
    for drift, h_sig, floor in ((k, cfg.h_sigma, cfg.min_h_factor),
                                (float(np.log(cfg.fast_ratio)), cfg.fast_h_sigma, cfg.fast_min_h_factor)):
        detectors.append((drift, max(h_sig * sigma, floor * drift)))
    group_of = {r: m for m in groups.values() for r in m}
    rank_list = scores.ranks  # the judged ranks, group after group (an Index looked up per rank costs seconds)
    scale = np.array([cfg.few_peers_h_factor if len(group_of[r]) <= 2 else 1.0 for r in rank_list])
    step_list = list(comp.columns)
    runs_of: dict = {}
    for drift, h in detectors:
        h_r = h * scale
        # only the rows whose CUSUM can reach its threshold run it (a bound from cumulative sums: every other row's
        # sum stays below h, so it raises no alarm); their runs are those of the CUSUM over every row
        rows, x = scores.cusum_rows(drift, h_r, drift + cfg.clip_h_share * h_r)
        for i, rank_runs in zip(rows.tolist(), cusum_runs_rows(x, step_list, drift, h_r[rows], cfg.min_steps,
                                                                 cfg.high_share)):
            if rank_runs:
                runs_of.setdefault(i, []).extend(dict(run, drift=drift, h=float(h_r[i])) for run in rank_runs)
    for i in sorted(runs_of):
        r = rank_list[i]
        group = group_of[r]
        logr_r = pd.Series(scores.logr[i], index=comp.columns)
        own, peers = scores.own_and_peers(i)
        for run in merge_runs(runs_of[i]):
            s1 = run["end"]
            onset = min(refine_onset(logr_r, run["onset"], s1), run["detected"])
            lo, hi = int(comp.columns.searchsorted(onset, "left")), int(comp.columns.searchsorted(s1, "right"))
            with np.errstate(divide="ignore", invalid="ignore"):
                span = own[lo:hi] / np.where(peers[lo:hi] == 0, np.nan, peers[lo:hi])
            high = scores.logr[i, lo:hi] > k
            flag_steps = [int(x) for x in comp.columns[lo:hi][high]]
            out.append(dict(rank=r, onset=onset, end=s1, flagged=len(flag_steps), flag_steps=flag_steps,
                            ratio=float(np.nanmedian(span)), own_ms=float(np.nanmedian(own[lo:hi])),
                            peers_ms=float(np.nanmedian(peers[lo:hi])), threshold=float(np.exp(k)),
                            cusum_h=run["h"], cusum_drift=run["drift"], sigma=sigma, baseline_sigma=base_sigma,
                            group=group, confirmed_at=run["detected"]))
    return out


def noise_sigma(logr: pd.DataFrame, cfg: StragglerConfig) -> tuple[float, float | None]:
    """The scores' noise: each rank's robust spread over time (median over ranks), floored by
    ``baseline_noise_weight`` x the pooled robust spread of the first ``baseline_steps`` judged steps (the
    clean warm-up, when the run is long enough to have one after it). Both are per-step cross-rank log ratios,
    so noise that hits every rank in a step (the whole machine busy) is already cancelled."""
    return with_baseline_noise(temporal_sigma(logr), logr.to_numpy(dtype=float), cfg)


def merge_runs(runs: list[dict]) -> list[dict]:
    """Alarmed runs of the two CUSUMs on one rank: overlapping ones are one episode (the earliest alarm,
    the earliest onset, the latest end)."""
    out: list[dict] = []
    for run in sorted(runs, key=lambda r: r["onset"]):
        if out and run["onset"] <= out[-1]["end"] + 1:
            cur = out[-1]
            if run["detected"] < cur["detected"]:
                cur.update(detected=run["detected"], drift=run["drift"], h=run["h"])
            cur["end"] = max(cur["end"], run["end"])
            continue
        out.append(dict(run))
    return out


def _drift_candidates(cfg: StragglerConfig, comp: pd.DataFrame, key: dict[int, int], label: str) -> list[dict]:
    """Groups (stages/nodes) whose every rank slowed against its own baseline while the other groups did not."""
    groups: dict[int, list[int]] = {}
    for r in comp.index:
        groups.setdefault(key.get(r, 0), []).append(r)
    if len(groups) < 2 or comp.shape[1] < cfg.baseline_steps + cfg.persist:
        return []
    base_cols = comp.columns[: cfg.baseline_steps]
    values = comp.to_numpy(dtype=float)
    pos_of = {r: i for i, r in enumerate(comp.index.tolist())}
    rows_of = {g: _row_picker([pos_of[r] for r in m]) for g, m in groups.items()}  # a slice where consecutive
    # numpy's nanmedian is pandas' median (skipping NaN) on the arrays, without a frame per group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank or step without any value: NaN, as pandas gives
        base = np.nanmedian(values[:, : cfg.baseline_steps], axis=1)
        base = np.where(base == 0, np.nan, base)
        # each rank against its own baseline, a group's rows at a time: their median per step
        gser = pd.DataFrame(np.stack([_normed_median_down(values, rows_of[g], base) for g in groups]),
                            index=list(groups), columns=comp.columns)
    ref = leave_one_out_median(gser)
    rel = gser / ref.replace(0, np.nan)
    # noise of the per-rank relative drift, so quiet runs can flag small but steady slow-downs
    sigma = temporal_sigma(rel)
    thr = max(cfg.min_ratio, 1.0 + cfg.mad_k * sigma)
    out = []
    for g, members in groups.items():
        flags = (rel.loc[g] >= thr).fillna(False)
        if not flags.any():
            continue  # no step of the group above the others' drift: no run (the ranks' own flags are not needed)
        # every rank of the group must be slow against its own baseline
        with np.errstate(divide="ignore", invalid="ignore"):
            norm = values[rows_of[g]] / base[rows_of[g]][:, None]
            every = pd.Series((norm >= thr).all(axis=0), index=comp.columns)
        flags = flags & every.reindex(flags.index, fill_value=False)
        for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
            if s0 <= base_cols[-1]:
                continue  # an onset inside the baseline window cannot be measured this way
            in_group = set(members)
            others = [r for r in comp.index if r not in in_group]
            out.append(dict(group=g, label=label, ranks=members, onset=s0, end=s1, flagged=n,
                            ratio=float(np.nanmedian(rel.loc[g, s0:s1])),
                            own_ms=float(np.nanmedian(comp.loc[members, s0:s1].to_numpy(dtype=float))),
                            baseline_ms=float(np.nanmedian(comp.loc[members, base_cols].to_numpy(dtype=float))),
                            peers_ms=float(np.nanmedian(comp.loc[others, s0:s1].to_numpy(dtype=float))) if others else None,
                            threshold=thr, confirmed_at=confirmation_step(flags, s0, cfg.persist)))
    return out


def _normed_median_down(values: np.ndarray, rows: slice | np.ndarray, base: np.ndarray) -> np.ndarray:
    """``_median_rows_down(values[rows] / base[rows][:, None])``: the division written straight into the transposed
    layout the median partitions (no normalised matrix of every rank, no second copy of the group's)."""
    own = values[rows]
    out = np.empty((own.shape[1], own.shape[0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(own.T, base[rows][None, :], out=out)
    if out.shape[0] == 0 or out.shape[1] == 0 or np.isnan(out).any():
        return np.nanmedian(out.T, axis=0)
    return median_rows(out, overwrite_input=True)


def _row_picker(pos: list[int]) -> slice | np.ndarray:
    """An index of rows ``pos``: a slice (a view, not a copy) where they are consecutive."""
    if pos and pos == list(range(pos[0], pos[0] + len(pos))):
        return slice(pos[0], pos[0] + len(pos))
    return np.asarray(pos, dtype=np.int64)


def _column_medians(m: pd.DataFrame) -> pd.Series:
    """``m.median()`` (each step's median over the ranks, NaN left out) by ``_median_rows_down``: pandas' median of a
    few hundred ranks sorts masked arrays."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step without any value: NaN, as pandas gives
        return pd.Series(_median_rows_down(m.to_numpy(dtype=float)), index=m.columns)


def _median_rows_down(x: np.ndarray) -> np.ndarray:
    """np.nanmedian(x, axis=0): np.median's partition where there is no NaN (the same values; nanmedian sorts
    masked arrays along a short axis, seconds over 10,000 steps)."""
    return median_finite(x, axis=0) if not np.isnan(x).any() else np.nanmedian(x, axis=0)


def _severity(ratio: float, cfg: StragglerConfig) -> str:
    return "critical" if ratio >= cfg.critical_ratio else "warning"


def analyze(frame: AnalysisFrame, cfg: StragglerConfig | None = None) -> list[Finding]:
    cfg = cfg or StragglerConfig()
    st = frame.data.steps
    if st.empty or not has_ranks(st["rank"], cfg.min_ranks):
        return []
    findings: list[Finding] = []
    for steps in frame.attempts(cfg.warmup_steps, cfg.restart_warmup_steps):
        if has_ranks(steps.rows["rank"], cfg.min_ranks):
            findings += _analyze_attempt(frame, cfg, steps)
    return findings


def has_ranks(rank: pd.Series, n: int) -> bool:
    """``rank.nunique() >= n``, without a hash table of every row's rank where n <= 2 and the ranks are integers
    (n = 2: ``builder.two_values``, any rank unlike the first)."""
    if n <= 0:
        return True
    if n == 2:
        return two_values(rank)
    if n == 1 and isinstance(rank.dtype, np.dtype) and rank.dtype.kind in "iu":
        return len(rank) > 0
    return rank.nunique() >= n


def _analyze_attempt(frame: AnalysisFrame, cfg: StragglerConfig, steps: StepView) -> list[Finding]:
    """The findings of one attempt's steps (warm-up already left out)."""
    signal = frame.compute_signal
    comp = steps.matrix(signal)
    if comp.shape[1] < cfg.persist:
        return []
    place = frame.placement
    scratch: dict = {}  # the scores' array, the second signal's taking the first's
    cands = [dict(c, signal=signal) for c in _rank_findings(frame, cfg, steps, signal, scratch)]
    if signal == "device_ms":
        # The device is not the only place a rank can be slow: a starved host (CPU contention, a slow launch
        # path) stretches the wall-clock compute while the device's own time stays normal. Those episodes come
        # from the wall-clock signal, kept only where the device signal did not already explain the rank.
        for c in _rank_findings(frame, cfg, steps, "compute_ms", scratch):
            if not any(d["rank"] == c["rank"] and d["onset"] <= c["end"] and c["onset"] <= d["end"] for d in cands):
                cands.append(dict(c, signal="compute_ms"))
    pipelined = len(set(place.rank_stage.get(r, 0) for r in comp.index)) > 1
    findings, used = _node_findings(frame, cfg, cands, set(comp.index))
    for c in cands:
        if c["rank"] not in used:
            findings.append(_rank_finding(frame, cfg, c, signal, pipelined))
            used.add(c["rank"])
    if pipelined:
        # Stage drift: within-stage comparison cannot see a stage whose every rank slowed.
        findings += _stage_findings(frame, cfg, comp, findings, used)
    return findings


def _node_findings(frame: AnalysisFrame, cfg: StragglerConfig, cands: list[dict],
                   all_ranks: set[int]) -> tuple[list[Finding], set[int]]:
    """All ranks of a node flagged (and not every rank of the world): one node finding. Returns the findings and
    the ranks they name."""
    node_of, node_ranks = frame.placement.rank_node, frame.placement.node_ranks
    findings: list[Finding] = []
    used: set[int] = set()
    by_node: dict[int, list[dict]] = {}
    for c in cands:
        by_node.setdefault(node_of.get(c["rank"], 0), []).append(c)
    flagged_ranks = {c["rank"] for c in cands}
    for node, cs in by_node.items():
        members = set(node_ranks.get(node, []))
        if len(members) >= 2 and members <= {c["rank"] for c in cs} and flagged_ranks != all_ranks and len(node_ranks) > 1:
            onset = min(c["onset"] for c in cs)
            end = max(c["end"] for c in cs)
            ratio = float(np.median([c["ratio"] for c in cs]))
            # host-only: every rank's episode is in wall-clock compute while the run's device time stayed normal (CPU
            # contention on a shared host): info, as for one rank; a warning here once had the policy evict a healthy
            # node (bench/fault_injection.py)
            host_only = frame.compute_signal == "device_ms" and all(c["signal"] != "device_ms" for c in cs)
            ev = dict(scope="node", node=node, ranks=sorted(members), onset_step=onset, detected_at_step=max(c["confirmed_at"] for c in cs),
                      signal="compute_ms" if host_only else frame.compute_signal,
                      node_median_compute_ms=fnum(np.median([c["own_ms"] for c in cs]), 1),
                      peers_median_compute_ms=fnum(np.median([c["peers_ms"] for c in cs]), 1),
                      ratio=fnum(ratio, 3), steps_affected=int(max(c["flagged"] for c in cs)),
                      threshold_ratio=fnum(cs[0]["threshold"], 3))
            findings.append(Finding(
                analyzer=NAME, kind="straggler", severity="info" if host_only else _severity(ratio, cfg),
                ranks=sorted(members), nodes=[node], step_start=onset, step_end=end, evidence=ev,
                confidence=0.35 if host_only else 0.85,
                summary=f"node {node} is slow: all its ranks ({fmt_ranks(members)}) compute {ratio:.2f}x their peers since step {onset}"
                        + ("; their device time is normal: the slowness is on the host (CPU contention, launch or Python "
                           "overhead)" if host_only else ""),
                recommendation=(f"Check node {node} (GPU clocks/thermals, CPU contention, other jobs); if it persists, "
                                f"{frame.placement.evict_advice(node)}."),
            ))
            used |= members
    return findings, used


def _corroboration(frame: AnalysisFrame, cfg: StragglerConfig, c: dict, ev: dict,
                   pipelined: bool) -> tuple[bool | None, float | None, dict]:
    """Is candidate ``c`` what its peers wait for (None when nothing can tell)? Adds the evidence to ``ev``
    (arrival, waits, data, TP); returns the verdict, the arrival lag its compute accounts for, and the TP evidence.

    The culprit of a synchronous job arrives last at the sync, late by about its extra compute. A rank that
    computes longer but does not arrive later (slowness after the sync point, OS noise spread over the step) is
    not confirmed."""
    r, group, s0, s1 = c["rank"], c["group"], c["onset"], c["end"]
    ev.update(_arrival_evidence(frame, r, group, s0, s1))
    extra_ms = c["own_ms"] - c["peers_ms"]
    share, lag = ev.get("last_arrival_share"), ev.get("arrival_lag_ms")
    # a rank late because its data loader is late is a data stall (its own check): only the lag its extra
    # data wait does not explain counts for the compute
    data_extra = _data_extra_ms(frame, r, group, s0, s1)
    if data_extra is not None and data_extra > 0 and lag is not None:
        ev["data_extra_ms"] = fnum(data_extra, 1)
        lag = lag - data_extra
    corroborated = None
    if share is not None:
        corroborated = share >= cfg.last_arrival_share and (lag is None or lag >= cfg.lag_fraction * extra_ms)
    if not corroborated and pipelined:
        # With pipeline parallelism the p2p waits equalise arrival at the gradient sync: the victims wait
        # in pipeline_wait instead. The culprit is the rank of its stage that waits least in total.
        w = _wait_evidence(frame, r, group, s0, s1)
        ev.update(w)
        if w.get("least_wait_share") is not None:
            corroborated = (w["least_wait_share"] >= cfg.last_arrival_share
                            and w["peers_wait_minus_own_ms"] - max(data_extra or 0.0, 0.0) >= cfg.lag_fraction * extra_ms)
    tp_ev = tp_evidence(frame, r, s0, s1)
    if tp_ev:
        # Under tensor parallelism the TP partners of a slow rank wait for it inside the TP all-reduces (and
        # reach the gradient sync together with it, so sync arrival cannot tell them apart): the culprit is
        # the one of its TP group that waits least there, by at least lag_fraction of its extra compute.
        ev.update(tp_ev)
        corroborated = (tp_ev["tp_least_wait_share"] >= cfg.last_arrival_share
                        and tp_ev["tp_partners_wait_minus_own_ms"] >= cfg.lag_fraction * extra_ms)
    return corroborated, lag, tp_ev


def _rank_finding(frame: AnalysisFrame, cfg: StragglerConfig, c: dict, signal: str, pipelined: bool) -> Finding:
    """The finding of one rank's candidate: a warning (critical from ``critical_ratio``) when what it names is
    corroborated or stands on device time, info when it is likely host noise."""
    r = c["rank"]
    on_device = c["signal"] == "device_ms"
    ev = dict(scope="rank", signal=c["signal"], onset_step=c["onset"], detected_at_step=c["confirmed_at"],
              rank_median_compute_ms=fnum(c["own_ms"], 1), peers_median_compute_ms=fnum(c["peers_ms"], 1),
              ratio=fnum(c["ratio"], 3), steps_affected=int(c["flagged"]), threshold_ratio=fnum(c["threshold"], 3),
              cusum_threshold=fnum(c["cusum_h"], 3), cusum_drift_ratio=fnum(np.exp(c["cusum_drift"]), 3),
              noise_sigma=fnum(c["sigma"], 4), baseline_noise_sigma=fnum(c["baseline_sigma"], 4), compared_with=sorted(int(x) for x in c["group"] if x != r))
    corroborated, lag, tp_ev = _corroboration(frame, cfg, c, ev, pipelined)
    extra_ms = c["own_ms"] - c["peers_ms"]
    share = ev.get("last_arrival_share")
    ev["arrival_corroborated"] = corroborated
    conf = 0.7
    if corroborated:
        conf += 0.15
    if c["ratio"] >= 1.2:
        conf += 0.1
    if corroborated is False:
        # Device time cannot be stretched by host scheduling, so a device-time straggler stands (wall-clock
        # arrival is what is noisy then, on a shared host); a wall-clock one is likely host noise: info only.
        conf = 0.7 + (0.1 if c["ratio"] >= 1.2 else 0.0) if on_device else 0.35
    node = frame.placement.rank_node.get(r)
    lag_txt = f", arrives {lag:.0f} ms after its peers" if lag is not None else ""
    wait = ev.get("victims_mean_wait_ms")
    wait_txt = f"; peers wait {wait:.0f} ms per step for it" if wait is not None else ""
    if ev.get("tp_least_wait_share") is not None and corroborated:
        wait_txt += f"; its TP partners wait {ev['tp_partners_wait_minus_own_ms']:.0f} ms more per step in TP all-reduces"
    if ev.get("least_wait_share") is not None:  # pipeline: the victims wait in p2p, not at the sync
        lag_txt = ""
        wait_txt = (f"; its stage peers wait {ev['peers_wait_minus_own_ms']:.0f} ms more per step than it does "
                    f"(sync + pipeline waits)")
    what = frame.data.device_time_label() if on_device else "compute"
    # host-only: wall-clock compute alarmed while device time stayed normal (on a shared CPU, mostly the scheduler
    # moving a rank off its core for a few steps); blip: a short device-time episode nobody waited for
    host_only = signal == "device_ms" and not on_device
    # unconfirmed by arrival, a device-time episode must have lasted: so many slow steps (above min_ratio)
    n_steps = c["flagged"]
    needed = cfg.short_uncorroborated_steps if c["ratio"] >= cfg.uncorroborated_ratio else cfg.long_uncorroborated_steps
    blip = on_device and corroborated is False and n_steps < needed
    if on_device and corroborated is False and not blip and c.get("flag_steps"):
        # a warning only from the step its needed-th slow step came
        ev["detected_at_step"] = max(int(ev["detected_at_step"]), c["flag_steps"][needed - 1])
    host_txt = ("; its device time is normal: the slowness is on the host (CPU contention, launch or Python overhead)"
                if host_only else "")
    if host_only or blip or (corroborated is False and not on_device):
        sev = "info"
    else:
        sev = _severity(c["ratio"], cfg)
    note = ""
    if blip:
        conf = 0.4
        note = (f" (only {n_steps} slow steps at {c['ratio']:.2f}x, and wall-clock arrival order does not confirm it: last to "
                f"arrive in {(share or 0):.0%} of those steps; another process sharing its core inflates its CPU time "
                f"like this; unconfirmed, it takes {cfg.long_uncorroborated_steps} slow steps, or "
                f"{cfg.short_uncorroborated_steps} at {cfg.uncorroborated_ratio:.2f}x or more)")
    elif corroborated is False and on_device:
        note = (f" (its device time is {c['ratio']:.2f}x its peers'; wall-clock arrival order does not confirm it yet: "
                f"last to arrive in {(share or 0):.0%} of those steps)")
    elif corroborated is False and tp_ev:
        note = (f" (not confirmed: its TP partners do not wait for it; it waits least in the TP all-reduces in "
                f"{tp_ev['tp_least_wait_share']:.0%} of those steps)")
    elif corroborated is False:
        note = (f" (not confirmed by arrival order: last to arrive in {(share or 0):.0%} of those steps"
                + (f", {lag:.0f} ms late for {extra_ms:.0f} ms of extra compute" if lag is not None else "") + ")")
    return Finding(
        analyzer=NAME, kind="straggler", severity=sev, ranks=[r],
        nodes=[node] if node is not None else [], step_start=c["onset"], step_end=c["end"], evidence=ev,
        confidence=round(min(conf, 0.99), 2),
        summary=(f"rank {r} (node {node}) is the straggler since step {c['onset']}: {what} {c['own_ms']:.1f} ms vs "
                 f"peers {c['peers_ms']:.1f} ms ({c['ratio']:.2f}x){lag_txt}{wait_txt}{note}{host_txt}"),
        recommendation=(f"Inspect rank {r} on node {node}: GPU clocks/throttling, a noisy neighbour, data on a slow disk; "
                        f"if it persists, {frame.placement.evict_advice(node)}."),
    )


def _stage_findings(frame: AnalysisFrame, cfg: StragglerConfig, comp: pd.DataFrame, findings: list[Finding],
                    used: set[int]) -> list[Finding]:
    """Pipeline stages whose every rank slowed against its own baseline while the other stages did not (rank and
    node ``findings`` so far name ``used``)."""
    out: list[Finding] = []
    for c in _drift_candidates(cfg, comp, frame.placement.rank_stage, "stage"):
        if set(c["ranks"]) <= used:
            continue
        nodes = frame.placement.nodes_of(c["ranks"])
        ev = dict(scope="stage", pp_stage=c["group"], ranks=c["ranks"], onset_step=c["onset"], detected_at_step=c["confirmed_at"],
                  stage_median_compute_ms=fnum(c["own_ms"], 1), stage_baseline_compute_ms=fnum(c["baseline_ms"], 1),
                  ratio_vs_other_stages_drift=fnum(c["ratio"], 3), steps_affected=int(c["flagged"]),
                  threshold_ratio=fnum(c["threshold"], 3))
        severity, note = _severity(c["ratio"], cfg), ""
        # A member already named a straggler over that span pulls the stage's median up by itself (with two ranks a
        # stage the median is their mean): what is left is the rest of the stage's own drift, a symptom at most.
        named = sorted({r for f in findings + out if f.severity != "info" and f.step_start is not None
                        and f.step_start <= c["end"] and (f.step_end is None or f.step_end >= c["onset"])
                        for r in f.ranks if r in c["ranks"]})
        rest = [r for r in c["ranks"] if r not in named]
        if named and rest:
            base_cols = comp.columns[: cfg.baseline_steps]
            drift = (np.nanmedian(comp.loc[rest, c["onset"]:c["end"]].to_numpy(dtype=float))
                     / np.nanmedian(comp.loc[rest, base_cols].to_numpy(dtype=float)))
            ev |= dict(explained_by_ranks=named, rest_of_stage_drift=fnum(drift, 3))
            severity = "info"
            note = (f"; rank(s) {fmt_ranks(named)} of it are named stragglers over that span, the rest of the stage "
                    f"drifted {drift:.2f}x")
        out.append(Finding(
            analyzer=NAME, kind="straggler", severity=severity, ranks=c["ranks"], nodes=nodes,
            step_start=c["onset"], step_end=c["end"], evidence=ev, confidence=0.75 if not named else 0.35,
            summary=(f"pipeline stage {c['group']} (ranks {fmt_ranks(c['ranks'])}) slowed {c['ratio']:.2f}x against its own "
                     f"baseline since step {c['onset']} ({c['baseline_ms']:.1f} -> {c['own_ms']:.1f} ms) while other stages did not"
                     f"{note}"),
            recommendation=(f"Inspect the hosts of stage {c['group']} (nodes {fmt_ranks(nodes)}); "
                            + ("if one node holds the stage, checkpoint and evict it." if frame.placement.n_nodes > 1
                               else f"if it persists, {frame.placement.evict_advice(None)}.")),
        ))
        used |= set(c["ranks"])
    return out
