"""Communication bottlenecks: exposed communication, bus bandwidth against a baseline, slow links, transport anomalies.

- Exposed communication: a rank's ``comm_ms`` is time blocked in collectives, which includes
  waiting for the slowest peer. The *transfer* part is ``comm_ms`` minus (its ``sync_wait_ms``
  minus the step's smallest ``sync_wait_ms``, the last arriver's, which is pure transfer); its share
  of step time is the exposed (non-overlapped) communication. Reported as info, a warning when
  very high or when it grew against the run's own baseline.
- Slow link / node: a rank whose transfer time is persistently above its peers' (leave-one-out
  median) while its compute is normal, or whose communicators are slower than others of their kind, or
  that finishes its collectives persistently before its peers, who wait for its data (analyzers/checks/links.py).
  All ranks of a node -> a node finding.
- Bus bandwidth: per collective (group, seq) the true duration is the *shortest* one among its
  ranks (the last arriver does not wait); busbw = bytes / time x nccl-tests' factor (all_reduce
  2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce, send/recv 1),
  compared with the nccl_tests baseline at the nearest message size.
- Transport anomalies from parsed NCCL logs: socket fallback where IB was expected, P2P disabled,
  IB errors, other NCCL warnings/errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import AnalysisFrame, Coverage, StepView
from analyzers.checks.busbw import BUSBW_FACTOR, busbw_findings, busbw_gbs  # noqa: F401 (the comm check's API)
from ranksight.allocator import reuse_freed_pages
from analyzers.checks.links import STRAGGLER_RATIO, ComputeCheck, early_finishers, slow_communicators
from analyzers.checks.wait_deficit import wait_deficit
from analyzers.checks.completion_leads import CompletionLeads
from analyzers.checks.op_instances import (collective_wait_ms, collective_wait_ms_of, last_arriver_ops,
                                           release_op_instances)
from analyzers.evidence import fmt_ranks, fnum
from analyzers.persistence import confirmation_step, persistent_runs, rows_with_runs
from analyzers.stats import leave_one_out_median, rows_with_window_count, temporal_sigma, windowed_medians
from ranksight.schema import Finding

NAME = "comm"
REUSE_PAGES_ROWS = 1_000_000  # step and collective records from which the check's temporaries reuse freed pages
WAIT_BY_RANK = 64  # up to this many ranks asked about, their collective waits from their own ops' records only


@dataclass
class CommConfig:
    exposed_info: float = 0.15  # exposed comm share of step time reported (info)
    exposed_warn: float = 0.60  # ... and a warning above this
    growth_factor: float = 2.0  # exposed comm grew this much against the run's baseline ...
    growth_min_share: float = 0.20  # ... and now costs at least this share of step time ...
    growth_persist: int = 5  # ... in this many steps of growth_window: world-wide transfer time on a shared host jumps
    growth_window: int = 7  # for 3-4 steps at a time (CPU contention); a degraded fabric stays degraded
    rank_ratio: float = 1.3  # a rank's transfer time / peers' median
    min_extra_ms: float = 2.0  # ... and at least this many ms more
    mad_k: float = 4.0
    persist: int = 3
    window: int = 5
    warmup_steps: int = 1
    baseline_steps: int = 5
    deficit_k: float = 2.0  # slow link by wait deficit: unexplained wait above k sigma (and 10 % of the step)
    last_window: int = 3  # slow link by self-delay: steps pooled per judgement ...
    last_min_ops: int = 6  # ... with at least this many ops where the rank was the last to arrive
    last_k: float = 6.0  # ... its median duration there exceeds its peers' by k sigma ...
    last_min_extra_ms: float = 4.0  # ... and by at least this much per op
    link_window: int = 3  # slow communicator: steps pooled per judgement ...
    link_min_ops: int = 4  # ... with at least this many of its ops ...
    p2p_quantile: float = 0.25  # ... the level of its transfers there: their median, for p2p links this quantile (a
    # rate limit sets a floor under every transfer of the same message, which it shows without the queueing above) ...
    link_k: float = 4.0  # ... its median transfer exceeds its kind's by k sigma ...
    link_min_extra_ms: float = 1.0  # ... and by at least this much ...
    link_ratio: float = 1.5  # ... and this factor ...
    link_persist: int = 8  # ... in this many steps of link_persist_window: on a shared host one rank's transfers
    link_persist_window: int = 10  # slow down for 3-6 steps at a time (its core busy); a slow link stays slow
    link_corroborate_k: float = 1.0  # the named rank's other communicators are slower than their kind by k sigma
    lead_k: float = 4.0  # early finisher: its ops end before its peers' by k sigma (link_window, link_persist as above)
    match_tol_ms: float = 10.0  # records of one op complete within this on every member (else seq numbers disagree)
    busbw_warn_frac: float = 0.5  # achieved busbw below this fraction of the nccl-tests baseline
    size_match: float = 4.0  # baseline row within this factor of the message size
    expect_ib: bool | None = None  # None: expected when any host uses NET/IB


def coverage(frame: AnalysisFrame, cfg: CommConfig | None = None) -> Coverage:
    """Can this check judge the run? It needs communication timing: ``comm_ms`` / ``sync_wait_ms`` in the step
    records or timed collective records; the wait for a slower peer (``sync_wait_ms``) to tell it from transfer."""
    sig = frame.signals
    if sig.ranks < 2 and not sig.collectives:
        return Coverage(NAME, "not_applicable", "one rank: no communication between ranks")
    if not (sig.comm_time or sig.sync_wait):
        return Coverage(NAME, "not_run", (
            "no communication timing: no comm_ms or sync_wait_ms in the step records and no timed collective "
            "records; rs.watch(model) times the gradient sync and the collectives"))
    limits = []
    if not sig.sync_wait:
        limits.append("no sync_wait_ms: time waiting for a slower peer cannot be told from transfer time")
    if not sig.collectives:
        limits.append("no collective records: bus bandwidth and per-communicator links are not judged")
    return Coverage(NAME, "limited" if limits else "ran", "; ".join(limits))


def _exposed(frame: AnalysisFrame, cfg: CommConfig, view: StepView) -> tuple[list[Finding], pd.Series]:
    """The exposed-communication findings, and the exposed share of step time per step they were judged on."""
    out: list[Finding] = []
    st = view.rows
    per_step = view.per_step_means({"transfer": view.column("transfer_ms"), "step_ms": st["step_ms"]})
    per_step = per_step[per_step["step_ms"] > 0]
    if per_step.empty:
        return out, pd.Series(dtype=float)
    share = per_step["transfer"] / per_step["step_ms"]
    med = float(share.median())
    ranks = view.distinct("rank")
    nodes = frame.placement.nodes_of(ranks)
    growth_found = False
    if len(share) >= cfg.baseline_steps + cfg.growth_persist:
        base = float(share.iloc[: cfg.baseline_steps].median())
        flags = (share >= max(base * cfg.growth_factor, cfg.growth_min_share)) & (share >= cfg.growth_min_share)
        for s0, s1, n in persistent_runs(flags, cfg.growth_persist, cfg.growth_window):
            if s0 <= share.index[cfg.baseline_steps - 1]:
                continue
            now = float(share.loc[s0:s1].median())
            growth_found = True
            out.append(Finding(
                analyzer=NAME, kind="comm_bottleneck", severity="warning", ranks=ranks, nodes=nodes, step_start=s0, step_end=s1,
                evidence=dict(scope="world", cause="comm_growth", exposed_share_baseline=fnum(base, 3), exposed_share=fnum(now, 3),
                              growth=fnum(now / base if base > 0 else None, 2), steps_affected=n, onset_step=s0,
                              detected_at_step=confirmation_step(flags, s0, cfg.growth_persist),
                              transfer_ms_median=fnum(per_step.loc[s0:s1, "transfer"].median(), 1)),
                confidence=0.7,
                summary=f"exposed communication grew from {base:.0%} to {now:.0%} of step time since step {s0}",
                recommendation="Look for a degraded link or congested fabric (run nccl-tests), and for new unoverlapped collectives.",
            ))
    if med >= cfg.exposed_info and not growth_found:
        sev = "warning" if med >= cfg.exposed_warn else "info"
        out.append(Finding(
            analyzer=NAME, kind="comm_bottleneck", severity=sev, ranks=ranks, nodes=nodes,
            step_start=int(share.index.min()), step_end=int(share.index.max()),
            evidence=dict(scope="world", cause="exposed_comm", exposed_share=fnum(med, 3),
                          transfer_ms_median=fnum(per_step["transfer"].median(), 1), step_ms_median=fnum(per_step["step_ms"].median(), 1)),
            confidence=0.8,
            summary=f"exposed (non-overlapped) communication is {med:.0%} of step time",
            recommendation="Overlap communication with compute (DDP bucket sizes, FSDP prefetch), or raise the per-rank batch.",
        ))
    return out, share


def _slow_links(frame: AnalysisFrame, cfg: CommConfig, view: StepView) -> list[Finding]:
    out: list[Finding] = []
    st = view.rows
    signal = frame.compute_signal
    tr = view.matrix("transfer_ms")
    comp = view.matrix(signal)
    if tr.shape[0] < 2 or tr.shape[1] < cfg.persist:
        return out
    ref = view.reference("transfer_ms")
    extra = tr - ref
    with np.errstate(divide="ignore", invalid="ignore"):
        # tr / ref.replace(0, NaN): a division by zero's cells set to NaN after it (one matrix, not two)
        ref_values = ref.to_numpy()
        ratio_values = tr.to_numpy() / ref_values
        ratio_values[ref_values == 0] = np.nan
        ratio = pd.DataFrame(ratio_values, index=tr.index, columns=tr.columns, copy=False)
        del ref_values, ratio_values
    # the compute ratio of a suspect's row, when one is asked about (the straggler check reads the same reference)
    compute = ComputeCheck.of_matrix(comp, lambda: view.reference(signal), extra, view.row_reference(signal))
    cands = []
    flag_rows, min_extra = _transfer_ratio_flags(cfg, ratio, extra, view.matrix("sync_wait_ms"),
                                                 view.reference("sync_wait_ms"))
    spans = []  # (rank, its flags, run): those of ranks that do not compute slowly, in the order found
    for r in rows_with_runs(flag_rows, cfg.persist):
        flags = flag_rows.loc[r]
        for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
            if compute.slow_computer(r, s0, s1):
                continue  # a slow computer, not a slow link: the straggler check owns it
            spans.append((r, flags, s0, s1, n))
    del flag_rows  # before the op instances are built (82 MB a matrix at 1,024 x 10,000)
    # each span's transfer figures, read now: the ratios, the transfer times and their references go before the
    # op instances are built (82 MB a matrix at 1,024 ranks x 10,000 steps; no other check reads them; the compute
    # check keeps the excess)
    figures = [(float(np.nanmedian(tr.loc[r, s0:s1])), float(np.nanmedian(ref.loc[r, s0:s1])),
                float(np.nanmedian(ratio.loc[r, s0:s1]))) for r, _, s0, s1, _ in spans]
    judged_steps = sorted(int(x) for x in tr.columns)
    all_ranks = set(tr.index)
    del ratio, tr, ref
    view.release("transfer_ms")
    # the wait at every collective, of those ranks only (the TP partners of a straggler: a few); many: every rank's
    ranks_asked = {r for r, *_ in spans}
    late_wait = None if not spans else (
        collective_wait_ms_of(frame.data.collectives, ranks_asked, cfg.match_tol_ms) if len(ranks_asked) <= WAIT_BY_RANK
        else collective_wait_ms(frame.data.collectives, cfg.match_tol_ms))
    for (r, flags, s0, s1, n), (own, peers, ratio_median) in zip(spans, figures):
        cr = compute.compute_ratio(r, s0, s1)
        if r in late_wait.index:
            waited = float(np.nanmedian(late_wait.loc[r, s0:s1].reindex(range(s0, s1 + 1)).fillna(0.0)))
            if waited >= 0.5 * float(np.nanmedian(extra.loc[r, s0:s1])):
                continue  # its long collectives wait for a late peer (FSDP all-gathers behind a stalled rank)
        cands.append(dict(rank=int(r), onset=s0, end=s1, n=n, own=own, peers=peers, ratio=ratio_median,
                          comp_ratio=cr, confirmed=confirmation_step(flags, s0, cfg.persist)))
    del late_wait
    co = frame.data.collectives
    # the completion leads, worked out for the records each signature reads (at 20 M records, few or none)
    leads = CompletionLeads(co, int(st["step"].min()), cfg.match_tol_ms)
    cands += wait_deficit(cfg, view, {c["rank"] for c in cands}, leads)
    # the waits' reference: read by the transfer-ratio and wait-deficit signatures only (the data-stall check reads
    # the waits' matrix, which stays)
    view.release_reference("sync_wait_ms")
    # the last arriver of every collective: the self-delay and communicators signatures both start from it
    last = last_arriver_ops(co, int(st["step"].min()), cfg.match_tol_ms)
    release_op_instances()  # leads and last arrivers are all the rest reads of them (a GiB at 20 M records)
    cands += _self_delay(cfg, view, {c["rank"] for c in cands}, last, compute, leads)
    cands = _merge_direct(cands, slow_communicators(co, cfg, judged_steps, compute, last), cfg)
    del last  # a row per op instance (2 M at 20 M records), read by the two signatures above only
    cands = _merge_direct(cands, early_finishers(co, cfg, judged_steps, compute, leads), cfg)
    del leads
    cands = _drop_link_partners(cands, frame)
    node_ranks = frame.placement.node_ranks
    node_of = frame.placement.rank_node
    used: set[int] = set()
    flagged = {c["rank"] for c in cands}
    for node, members in node_ranks.items():
        cs = [c for c in cands if c["rank"] in members]
        if len(members) >= 2 and set(members) <= flagged and len(node_ranks) > 1 and flagged != all_ranks:
            out.append(_node_link_finding(node, members, cs))
            used |= set(members)
    for c in cands:
        if c["rank"] not in used:
            out.append(_rank_link_finding(c, node_of.get(c["rank"]), min_extra))
    return out


def _transfer_ratio_flags(cfg: CommConfig, ratio: pd.DataFrame, extra: pd.DataFrame, wait: pd.DataFrame,
                          wait_ref: pd.DataFrame) -> tuple[pd.DataFrame, float]:
    """The transfer-ratio signature's flags (rank x step, over ``ratio``'s cells) and the excess floor they passed:
    ``((ratio >= rank_ratio) & (extra >= floor) & ((wait_ref >= wait) | wait.isna())).fillna(False)``, the waits
    aligned with the ratios, floor = max(min_extra_ms, mad_k x the excess's noise) where a cell passes min_extra_ms
    (else min_extra_ms). In numpy (NaN compares False, as in pandas): no boolean frame per operand."""
    aligned = wait.index.equals(ratio.index) and wait.columns.equals(ratio.columns)
    if not aligned:
        wait = wait.reindex(index=ratio.index, columns=ratio.columns)
        wait_ref = wait_ref.reindex(index=ratio.index, columns=ratio.columns)
    # a slow link makes its peers wait for it: its own sync wait is not above theirs (none recorded: no objection)
    extra_values = extra.to_numpy()
    with np.errstate(invalid="ignore"):
        wait_values = wait.to_numpy()
        flag_values = wait_ref.to_numpy() >= wait_values
        flag_values |= np.isnan(wait_values)
        flag_values &= ratio.to_numpy() >= cfg.rank_ratio
        flag_values &= extra_values >= cfg.min_extra_ms
    min_extra = cfg.min_extra_ms
    if flag_values.any():
        # the threshold's noise (a median over every rank's row) only where a cell passes its floor: above it the
        # flags are those cells' that pass the threshold too; none passing, no flag can (and no finding reads it)
        min_extra = max(cfg.min_extra_ms, cfg.mad_k * temporal_sigma(extra))
        with np.errstate(invalid="ignore"):
            flag_values &= extra_values >= min_extra
    flag_rows = pd.DataFrame(flag_values, index=ratio.index, columns=ratio.columns, copy=False)
    return flag_rows, min_extra


def _link_clause(c: dict) -> str:
    """What one rank's slow-link candidate showed, in a few words (for a node finding's summary)."""
    method = c.get("method")
    if method == "completion_lead":
        return f"rank {c['rank']} finishes its collectives {c['own']:.1f} ms before its peers, who wait for its data"
    if method == "communicators":
        slow = c["slow"][0]
        return (f"rank {c['rank']}'s ops on {slow['communicator']} take {slow['transfer_ms']:.1f} ms vs "
                f"{slow['kind_transfer_ms']:.1f} ms on the other {slow['kind']} communicators")
    if method == "self_delay":
        return f"rank {c['rank']}'s collectives take {c['own'] - c['peers']:.1f} ms more even when nobody is left to wait for"
    if method == "wait_deficit":
        return f"rank {c['rank']}'s peers wait {c['unexplained']:.0f} ms per step for data it sent on time"
    return f"rank {c['rank']} spends {c['ratio']:.1f}x its peers' time in transfers"


def _node_link_finding(node, members, cs: list[dict]) -> Finding:
    """Every rank of ``node`` has a slow link: one finding for the node, with what each rank's signature showed."""
    s0 = min(c["onset"] for c in cs)
    ratios = [c["ratio"] for c in cs if np.isfinite(c["ratio"])]
    per_rank = [dict(rank=c["rank"], method=c.get("method") or "transfer_ratio", own=fnum(c["own"], 2),
                     peers=fnum(c["peers"], 2), onset_step=c["onset"]) for c in sorted(cs, key=lambda c: c["rank"])]
    clauses = "; ".join(dict.fromkeys(_link_clause(c) for c in sorted(cs, key=lambda c: c["rank"])))
    return Finding(
        analyzer=NAME, kind="comm_bottleneck", severity="warning", ranks=sorted(members), nodes=[node],
        step_start=s0, step_end=max(c["end"] for c in cs),
        evidence=dict(scope="node", cause="slow_link", onset_step=s0, detected_at_step=max(c["confirmed"] for c in cs),
                      ranks=per_rank, ratio=fnum(np.median(ratios), 2) if ratios else None,
                      compute_ratio=fnum(np.nanmedian([c["comp_ratio"] for c in cs]) if any(np.isfinite(c["comp_ratio"]) for c in cs) else None, 3),
                      steps_affected=max(c["n"] for c in cs)),
        confidence=0.75,
        summary=f"node {node}'s communication is slow since step {s0} while its ranks compute normally: {clauses}",
        recommendation=f"Check node {node}'s NIC and cabling (nccl-tests between it and a healthy node); evict it if it persists.",
    )


def _rank_link_finding(c: dict, node, min_extra: float) -> Finding:
    """One rank's slow link, with the evidence of the method that found it (``c["method"]``)."""
    r, s0 = c["rank"], c["onset"]
    where = f"rank {r} (node {node}) has a slow link since step {s0}"
    method = c.get("method")
    if method == "communicators":
        slow = c["slow"][0]
        evidence = dict(slow_communicators=c["slow"], corroborating_communicators=c["corroborating"],
                        transfer_ms=fnum(c["own"], 2), kind_transfer_ms=fnum(c["peers"], 2), compute_ratio=fnum(c["comp_ratio"], 3))
        also = ", ".join(f"{k} +{v:.1f} ms" for k, v in c["corroborating"].items() if k != slow["communicator"])
        summary = (f"{where}: its ops on {slow['communicator']} move their data in {slow['transfer_ms']:.1f} ms vs "
                   f"{slow['kind_transfer_ms']:.1f} ms on the other {slow['kind']} communicators (median of {slow['ops']} ops)"
                   + (f", and its other communicators are slower than their kind too ({also})" if also else "")
                   + "; its partners are slow only where they share a communicator with it")
        confidence = 0.75
    elif method == "completion_lead":
        evidence = dict(lead_ms=fnum(c["own"], 2), op_ms=fnum(c["peers"], 2), ops=c["ops"], communicators=c["groups_keys"],
                        threshold_lead_ms=fnum(c["threshold"], 2), compute_ratio=fnum(c["comp_ratio"], 3))
        summary = (f"{where}: its collectives on {', '.join(c['groups_keys'])} end {c['own']:.1f} ms before its peers' "
                   f"(median of {c['ops']} ops of {c['peers']:.1f} ms): its peers' data reaches it on time while its own "
                   "reaches them late")
        confidence = 0.7
    elif method == "self_delay":
        evidence = dict(last_arriver_op_ms=fnum(c["own"], 2), peers_last_arriver_op_ms=fnum(c["peers"], 2),
                        extra_ms_per_op=fnum(c["own"] - c["peers"], 2), ops_per_step=fnum(c["ops_per_step"], 1),
                        threshold_extra_ms=fnum(c["threshold"], 2), groups=c["groups"])
        summary = (f"{where}: when it is the last to arrive at a collective, nobody is left to wait for, yet the op takes "
                   f"{c['own']:.1f} ms vs {c['peers']:.1f} ms when a peer is last ({c['own'] - c['peers']:.1f} ms more per op, "
                   f"~{c['ops_per_step']:.0f} ops a step)")
        confidence = 0.7
    elif method == "wait_deficit":
        evidence = dict(rank_sync_wait_ms=fnum(c["own"], 1), peers_sync_wait_ms=fnum(c["peers"], 1),
                        unexplained_wait_ms=fnum(c["unexplained"], 1), arrival_lag_ms=fnum(c["lag"], 1))
        summary = (f"{where}: it arrives on time (lag {c['lag']:.0f} ms) yet its peers wait {c['peers']:.0f} ms per step vs its own "
                   f"{c['own']:.0f} ms, {c['unexplained']:.0f} ms unexplained by its arrival: its data reaches them late")
        confidence = 0.7
    else:  # the rank's transfer time per step against its peers'
        evidence = dict(rank_transfer_ms=fnum(c["own"], 1), peers_transfer_ms=fnum(c["peers"], 1), ratio=fnum(c["ratio"], 2),
                        extra_ms=fnum(c["own"] - c["peers"], 1), compute_ratio=fnum(c["comp_ratio"], 3),
                        threshold_extra_ms=fnum(min_extra, 1))
        cr = c["comp_ratio"]
        compute_txt = ("with normal compute" if not np.isfinite(cr) or cr < STRAGGLER_RATIO else
                       f"while computing {cr:.2f}x its peers, far less than its transfers' excess")
        summary = f"{where}: {c['own']:.1f} ms in transfers per step vs peers {c['peers']:.1f} ms ({c['ratio']:.1f}x) {compute_txt}"
        confidence = 0.75
    head = dict(scope="rank", cause="slow_link") | (dict(method=method) if method else {})
    return Finding(
        analyzer=NAME, kind="comm_bottleneck", severity="warning", ranks=[r], nodes=[node] if node is not None else [],
        step_start=s0, step_end=c["end"],
        evidence=head | dict(onset_step=s0, detected_at_step=c["confirmed"]) | evidence | dict(steps_affected=c["n"]),
        confidence=confidence, summary=summary,
        recommendation=f"Check the network path of rank {r} on node {node} (NIC, PCIe, NCCL transport); run nccl-tests on that node.",
    )


def _merge_direct(cands: list[dict], comms: list[dict], cfg: CommConfig) -> list[dict]:
    """Add the candidates of a signature read from the collectives (communicators, early finishers). Where the rank
    already has a candidate of a direct signature overlapping it in time (within ``window`` steps), that episode goes
    on as long as this one does (one signature's flags can stop while the link stays slow: the partners must still
    not be blamed then); a wait-deficit candidate of that rank it overlaps gives way to it (direct evidence)."""
    for c in comms:
        near = [a for a in cands if a["rank"] == c["rank"] and a["onset"] <= c["end"] + cfg.window and c["onset"] <= a["end"] + cfg.window]
        direct = [a for a in near if a.get("method") != "wait_deficit"]
        if direct:
            for a in direct:
                a["end"] = max(a["end"], c["end"])
            continue
        cands = [a for a in cands if not any(a is b for b in near)] + [c]
    return cands


def _drop_link_partners(cands: list[dict], frame: AnalysisFrame) -> list[dict]:
    """Of two self-delay candidates that share a communicator and overlap in time, keep the one with the longer
    last-arriver ops: its partner arriving last still waits out the rest of the culprit's delay (so its own ops look
    long too), but by less than the delay itself. A tensor- or pipeline-parallel partner of a culprit with direct
    evidence (its own ops or transfers are long: self-delay, transfer ratio) is dropped when it was found only by the
    indirect wait-deficit signature: held up in the TP ops or the p2p sends, it reaches its own gradient sync late,
    which its data-parallel peers see as a wait deficit."""
    direct = [c for c in cands if c.get("method") != "wait_deficit"]
    sd = [c for c in cands if c.get("method") == "self_delay"]
    drop = set()
    if direct and not frame.data.collectives.empty:
        part_keys = _communicators_by_rank(frame.collectives_of(("tp", "pp")))
        for c in cands:
            if c.get("method") != "wait_deficit" and c.get("method") is not None:
                continue
            for a in direct:
                if a is c or (c.get("method") is None and a.get("method") != "self_delay"):
                    continue  # a transfer-ratio candidate is dropped only for a self-delay one (as before)
                if (part_keys.get(c["rank"], set()) & part_keys.get(a["rank"], set()) and a["onset"] <= c["end"]
                        and c["onset"] <= a["end"]):
                    drop.add(id(c))
    for a in sd:
        for b in sd:
            if a is b or id(b) in drop or not (set(a["groups_keys"]) & set(b["groups_keys"])):
                continue
            if a["onset"] <= b["end"] and b["onset"] <= a["end"] and (a["own"] - a["peers"]) < (b["own"] - b["peers"]):
                drop.add(id(a))
    return [c for c in cands if id(c) not in drop]


def _communicators_by_rank(part: pd.DataFrame) -> dict[int, set[str]]:
    """rank -> the names (``str``) of the communicators its records are of: ``part.groupby("rank")["gkey"]`` as sets,
    from the distinct (rank, communicator) pairs (a string per record cost seconds at 8 M tensor-parallel records)."""
    if part.empty:
        return {}
    rank = part["rank"].to_numpy()
    if rank.dtype.kind not in "iu" or bool(part["gkey"].isna().any()):  # (a missing name: str of what it is)
        return part.groupby("rank")["gkey"].agg(lambda x: set(map(str, x))).to_dict()
    codes, uniq = pd.factorize(part["gkey"])
    names = [str(u) for u in uniq]
    pairs = pd.unique(rank.astype(np.int64) * len(names) + codes)
    out: dict[int, set[str]] = {}
    for r, c in zip((pairs // len(names)).tolist(), (pairs % len(names)).tolist()):
        out.setdefault(r, set()).add(names[c])
    return out


def _self_delay(cfg: CommConfig, view: StepView, skip: set[int], last: pd.DataFrame, compute: ComputeCheck,
                leads: CompletionLeads | None = None) -> list[dict]:
    """A slow link seen per collective: ops in which the rank arrived last (nobody left to wait for) still take
    longer than ops in which a peer arrived last. Per step, each rank's median last-arriver duration over the last
    ``last_window`` steps (at least ``last_min_ops`` ops) against the leave-one-out median of the other ranks';
    flagged when the excess is >= max(min_extra_ms, last_k x the noise of those medians over time), in ``persist``
    of ``window`` steps.
    Sensitive where ops are many and quick (tensor-parallel all-reduces); with a few long gloo all-reduces per
    step their duration noise keeps the threshold high. ``last``: ``last_arriver_ops`` from the view's first step;
    ``compute``: the ranks' compute against their peers'. An op whose last arriver is done ``min_extra_ms`` or more
    after the other members (``leads``) is left out: it was waiting for a peer's late data after all."""
    if last.empty or last["rank"].nunique() < 2:
        return []
    steps = view.distinct("step")
    ranks = view.distinct("rank")
    weights = last["ops"] if "ops" in last.columns else None
    last_step = last["step"].to_numpy()
    code = pd.Index(ranks).get_indexer(last["rank"].astype(int).to_numpy())
    # the ranks that can have a median (a window of last_min_ops ops) before any op is left out: leaving ops out
    # only removes medians, and fewer than two ranks with one leave nothing to compare
    w = None if weights is None else weights.to_numpy(dtype=float)
    can = rows_with_window_count(code, last_step, len(ranks), np.asarray(steps, dtype=np.int64), cfg.last_window,
                                 max(cfg.last_min_ops, 1), w if w is not None and len(w) and np.nanmax(w) > 1 else None) \
        if np.issubdtype(last_step.dtype, np.integer) else np.ones(len(ranks), dtype=bool)
    if can.sum() < 2:
        return []
    # a last arriver that is done after the other members was still waiting, for a peer's data that left late:
    # the op says nothing about its own sending. Its lead is looked up by its record's position, for the ops read
    # (those of the ranks that can have a median, then those of a flagged span's window)
    lead = np.full(len(last), np.nan)
    known = np.zeros(len(last), dtype=bool)
    rows = last["row"].to_numpy() if leads is not None and not leads.empty else None

    def kept(mask: np.ndarray) -> np.ndarray:
        """``mask`` less the ops whose last arriver was done min_extra_ms after the other members."""
        if rows is None:
            return mask
        todo = mask & ~known
        if todo.any():
            lead[todo] = leads.at_rows(rows[todo])
            known[todo] = True
        return mask & ~(lead <= -cfg.min_extra_ms)

    with np.errstate(invalid="ignore"):
        judged = last[kept(np.r_[can, False][code])]
    if judged.empty:
        return []
    # per rank, the median duration of the ops it was last at in steps (s - last_window, s]
    med = windowed_medians(judged["rank"].astype(int), judged["step"], judged["duration_ms"], ranks, steps,
                           cfg.last_window, cfg.last_min_ops, weights=judged["ops"] if "ops" in judged.columns else None)
    if med.notna().sum(axis=0).max() < 2:
        return []
    ref = leave_one_out_median(med)
    excess = med - ref
    # noise: each rank's own windowed median over time (median over ranks). Not the excess: with few ranks
    # the peers' references contain the culprit, so their excess shifts with it and would inflate sigma.
    sigma = temporal_sigma(med)
    threshold = max(cfg.last_min_extra_ms, cfg.last_k * sigma)
    out = []
    flag_rows = (excess >= threshold).fillna(False)
    for r in rows_with_runs(flag_rows, cfg.persist):
        if r in skip:
            continue
        flags = flag_rows.loc[r]
        for s0, s1, n in persistent_runs(flags, cfg.persist, cfg.window):
            row = compute.ratio_row(r)
            cr = float(np.nanmedian(row.loc[s0:s1])) if row is not None else float("nan")
            # the window reaches back last_window - 1 steps: the delay began at most that much before the first flag
            onset = max(steps[0], s0 - cfg.last_window + 1)
            with np.errstate(invalid="ignore"):
                win = last[kept((last_step >= onset) & (last_step <= s1))]
            out.append(dict(rank=int(r), onset=onset, end=s1, n=n, method="self_delay",
                            own=float(win.loc[win["rank"] == r, "duration_ms"].median()),
                            peers=float(win.loc[win["rank"] != r, "duration_ms"].median()),
                            ratio=float("nan"), comp_ratio=cr, threshold=threshold,
                            ops_per_step=float(len(win) / max(1, s1 - onset + 1)),
                            groups=sorted({str(g) for g in win.loc[win["rank"] == r, "group"]}),
                            groups_keys=sorted({str(g) for g in judged.loc[judged["rank"] == r, "gkey"]}),
                            confirmed=confirmation_step(flags, s0, cfg.persist)))
    return out


P2P_DISABLED = re.compile(r"P2P (?:is )?disabled|NCCL_P2P_DISABLE\s*=\s*1|P2P.*not (?:supported|available)", re.I)


def _transport(frame: AnalysisFrame, cfg: CommConfig) -> list[Finding]:
    out: list[Finding] = []
    ne = frame.data.nccl_events
    if ne.empty:
        return out
    ne = ne.copy()
    for c in ("transport", "error_class", "message", "category", "host"):
        ne[c] = ne[c].fillna("").astype(str)
    host_ranks: dict[str, list[int]] = {}
    for r, h in frame.placement.rank_host.items():
        host_ranks.setdefault(h, []).append(r)
    node_of = frame.placement.rank_node

    def placement(hosts) -> tuple[list[int], list[int]]:
        ranks = sorted({r for h in hosts for r in host_ranks.get(h, [])})
        return ranks, sorted({node_of[r] for r in ranks if r in node_of})

    def transport_finding(rows, severity: str, cause: str, confidence: float, summary: str, recommendation: str,
                          **evidence) -> Finding:
        """One finding about the NCCL log lines ``rows``; ``{hosts}`` in the summary names their hosts."""
        hosts = sorted(set(rows["host"]))
        ranks, nodes = placement(hosts)
        return Finding(
            analyzer=NAME, kind="comm_bottleneck", severity=severity, ranks=ranks, nodes=nodes,
            evidence=dict(scope="transport", cause=cause, hosts=hosts, lines=int(len(rows)), **evidence),
            confidence=confidence, summary=summary.format(hosts=", ".join(hosts)), recommendation=recommendation)

    uses_ib = ne["transport"].str.contains("NET/IB", regex=False)
    expect_ib = cfg.expect_ib if cfg.expect_ib is not None else bool(uses_ib.any())
    sock = ne[ne["transport"].str.contains("NET/Socket", regex=False)]
    if expect_ib and not sock.empty:
        out.append(transport_finding(
            sock, "warning", "socket_fallback", 0.9,
            "NCCL fell back to TCP sockets on {hosts} where InfiniBand was expected",
            "Check the IB HCA is up (ibstat), NCCL_IB_HCA/NCCL_SOCKET_IFNAME, and that the container sees /dev/infiniband.",
            ib_hosts=sorted(set(ne.loc[uses_ib, "host"]))))
    p2p = ne[ne["message"].str.contains(P2P_DISABLED)]
    if not p2p.empty:
        out.append(transport_finding(
            p2p, "warning", "p2p_disabled", 0.8,
            "NCCL peer-to-peer is disabled on {hosts}: intra-node traffic goes through host memory",
            "Unset NCCL_P2P_DISABLE, check ACS/IOMMU settings and nvidia-smi topo -m.",
            example=p2p["message"].iloc[0][:200]))
    ib_err = ne[ne["error_class"].str.startswith("ib") | (ne["message"].str.contains(r"ibv_|IB.*(?:error|fail)", regex=True)
                                                          & ne["category"].isin(["warn", "error"]))]
    if not ib_err.empty:
        out.append(transport_finding(
            ib_err, "critical", "ib_error", 0.9,
            f"InfiniBand errors on {{hosts}} ({len(ib_err)} lines)",
            "Check the HCA and link (ibstat, ibv_devinfo, switch port counters); "
            + ("evict the node if errors continue." if frame.placement.n_nodes > 1 else
               f"if errors continue, {frame.placement.evict_advice(None)}."),
            error_classes=sorted(set(ib_err["error_class"]) - {""}), example=ib_err["message"].iloc[0][:200]))
    other = ne[(ne["category"] == "error") & ~ne.index.isin(ib_err.index) & (ne["error_class"] != "timeout")
               & (ne["category"] != "watchdog")]
    if not other.empty:
        out.append(transport_finding(
            other, "warning", "nccl_error", 0.7,
            f"NCCL reported {len(other)} error line(s) on {{hosts}}",
            "Read the NCCL log lines in the evidence; rerun with NCCL_DEBUG=INFO for context.",
            error_classes=sorted(set(other["error_class"]) - {""}), example=other["message"].iloc[0][:200]))
    return out


def analyze(frame: AnalysisFrame, cfg: CommConfig | None = None) -> list[Finding]:
    # its temporaries (dozens of rank x step matrices, per-record arrays of 20 M records) reuse freed pages; a small
    # run's (a live round of a small job, in the head's own process) leave the allocator as it is
    big = len(frame.data.collectives) + len(frame.data.steps) >= REUSE_PAGES_ROWS
    with reuse_freed_pages(big):
        try:
            return _analyze(frame, cfg or CommConfig())
        finally:
            release_op_instances()  # the op instances of the round's collectives: over a GiB at 20 M records


def _analyze(frame: AnalysisFrame, cfg: CommConfig) -> list[Finding]:
    findings: list[Finding] = []
    judged = frame.judged(cfg.warmup_steps)
    if not judged.rows.empty:
        exposed, share = _exposed(frame, cfg, judged)
        links = _slow_links(frame, cfg, judged)
        for f in exposed:
            if f.severity != "warning" or f.evidence.get("cause") not in ("comm_growth", "exposed_comm"):
                continue
            causes = [g for g in links if g.step_start is not None and f.step_end is not None and g.step_start <= f.step_end + cfg.window
                      and (g.step_end is None or g.step_end >= f.step_start - cfg.window)]
            if not causes:
                continue
            if f.evidence["cause"] == "exposed_comm":
                # a high share over the whole run that a slow link explains: the share outside its span is not high
                outside = [float(v) for k, v in share.items()
                           if not any(g.step_start <= k <= (g.step_end if g.step_end is not None else k) for g in causes)]
                if outside and float(np.median(outside)) >= cfg.exposed_warn:
                    continue
                f.evidence["exposed_share_outside_slow_link"] = fnum(np.median(outside), 3) if outside else None
            # the job's communication grew (or is high) because of a slow link already named: a symptom, reported as info
            f.severity = "info"
            f.evidence["explained_by"] = [f"slow link of rank(s) {fmt_ranks(g.ranks)}" for g in causes]
            f.summary += f" (explained by the slow link of rank(s) {fmt_ranks(causes[0].ranks)})"
        findings += exposed + links
    findings += busbw_findings(frame, cfg)
    findings += _transport(frame, cfg)
    return findings
