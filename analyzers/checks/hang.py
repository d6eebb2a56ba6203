"""Hangs: ranks that stopped while others wait, said the way PyTorch's flight recorder says it.

- Collectives: for each (group, seq) the ranks that entered it (records with ``t_arrive``) and
  finished it (``t_done``). The first collective, in arrival time, that some ranks entered but
  did not finish while other members never joined names the missing ranks:
  "rank 3 never joined all_reduce seq 57 on group dp; ranks 0,1,2 waiting since <time>".
  Everybody joined but nobody finished: the collective itself hangs (network / NCCL).
- Live (``data.now`` set): a rank silent for more than max(min_stall_s, stall_factor x median step
  time) while others report, or the whole job silent; silence is measured on the head's clock (each rank's
  timestamps shifted by its measured clock offset, ``RunData.clock_offset_s``). A node whose clock is off from the
  head's by more than ``skew_s`` is reported as such (kind ``clock_skew``): cross-node timings compare its clock.
- Post-mortem: ranks whose last step is behind the others (without an exit/evicted event), and a
  run that ended before its planned steps without finishing.
- A rank that ended (its ``exit`` or ``evicted`` event after its last step) is never silent or behind, live or
  post-mortem; an op whose waiting ranks all went on to a clean exit (``finished``) is not stuck; and a run
  that ended as planned (every rank's exit says ``finished``, or the manifest's ``finished`` is set) did not end
  early.
- Watchdog lines from the NCCL/PyTorch logs (nccl_events category ``watchdog`` or error class ``timeout``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.builder import CLOCK_SKEW_S, AnalysisFrame, Coverage
from analyzers.evidence import fmt_ranks, fnum
from analyzers.loader import RunData
from ranksight.schema import Finding

NAME = "hang"


@dataclass
class HangConfig:
    min_stall_s: float = 60.0  # live: a rank silent this long ...
    stall_factor: float = 20.0  # ... or this many median step times, whichever is longer
    lag_steps: int = 2  # post-mortem: a rank this many steps behind the furthest one
    # live: a node's clock this far from the head's (its ranks' median offset) is reported. The offset measured is
    # the clock difference plus the quickest delivery of a step batch (about a ship interval); NTP keeps clocks
    # within milliseconds, so seconds of offset is a clock that is not synchronised
    skew_s: float = CLOCK_SKEW_S


def _fmt_t(t: float | None) -> str:
    if t is None or not np.isfinite(t):
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d} UTC"


# exit reasons of a rank that ended as planned (the trainer's and ranksight.init's ``exit`` event; an evicted node's
# ranks leave on purpose; the trainer's --stop-after)
CLEAN_EXIT_REASONS = ("finished", "evicted", "stop_after")


def exit_reason(detail) -> str:
    """The reason of an ``exit`` event's detail ("" when it gives none). The detail is a dict in records and a JSON
    string in the store's tables and the head's live window."""
    if isinstance(detail, (str, bytes)):
        try:
            detail = json.loads(detail)
        except ValueError:
            return ""
    return str(detail.get("reason", "")) if isinstance(detail, dict) else ""


def clean_exit(reason: str) -> bool:
    return reason in CLEAN_EXIT_REASONS or reason.startswith("finished")


def ended_ranks(data: RunData) -> dict[int, str]:
    """The ranks that ended, with their exit reason ("evicted" for an ``evicted`` event): those whose last ``exit``
    or ``evicted`` event came at or after the end of their last step. A rank that ran steps again after an exit (a
    restarted job) has not ended."""
    ev = data.events
    if ev.empty:
        return {}
    ex = ev[ev["event"].isin(["exit", "evicted"])]
    if ex.empty:
        return {}
    st = data.steps
    last = st.groupby("rank").agg(t=("t_end", "max"), step=("step", "max")) if not st.empty else None
    out: dict[int, str] = {}
    for row in ex.sort_values("t", kind="stable").itertuples(index=False):
        r = int(row.rank)
        if last is not None and r in last.index:
            t = pd.to_numeric(row.t, errors="coerce")
            # an exit of an earlier attempt: the rank ran steps after it (by the clock; by step where no time is given)
            if (t < last.at[r, "t"]) if t > 0 else (int(row.step) < last.at[r, "step"]):
                continue
        out[r] = "evicted" if row.event == "evicted" else exit_reason(row.detail)
    return out


def finished_run(data: RunData) -> bool:
    """The run ended as planned: its manifest says finished, or every rank that ran steps ended with a clean exit
    (``finished``, evicted) after its last step."""
    if data.manifest is not None and data.manifest.finished is not None:
        return True
    st = data.steps
    if st.empty:
        return False
    ended = ended_ranks(data)
    return all(int(r) in ended and clean_exit(ended[int(r)]) for r in st["rank"].unique())


def coverage(frame: AnalysisFrame, cfg: HangConfig | None = None) -> Coverage:
    """Can this check judge the run? It always can from the steps (silence, ranks behind); collective records name
    the op a hang is stuck in and the rank that never joined, and ``exit`` events tell a run that ended from one
    that hung."""
    sig = frame.signals
    limits = []
    if not sig.collectives:
        limits.append("no collective records: a hang shows only as ranks going silent or stopping early, without the "
                      "op it is stuck in or the rank that never joined (rs.watch(model) records them)")
    if not sig.exits and not finished_run(frame.data):
        limits.append("no exit events: a run that ended cannot be told from one that hung (rs.finish(), or "
                      "`with ranksight.init(...) as rs:`, records the end)")
    return Coverage(NAME, "limited" if limits else "ran", "; ".join(limits))


def _stall_s(data: RunData, cfg: HangConfig) -> float:
    st = data.steps
    med_step_s = float(st["step_ms"].median()) / 1000.0 if not st.empty else 1.0
    return max(cfg.min_stall_s, cfg.stall_factor * med_step_s)


class _GroupMembers:
    """Each communicator's members (by gkey): the union of its records' ``group_ranks``, else the ranks that
    recorded it. Computed on first use, for the communicators of an incomplete op only, and each distinct member
    list is converted once: a window holds one record per op and rank, all with the same list (the head runs this
    every round, and a set per record cost O(records x group size)). ``gk_code``/``gk_uniq``: the gkey column
    factorized (a communicator's records found by its code, not by comparing every row's name)."""

    def __init__(self, co: pd.DataFrame, gk_code: np.ndarray, gk_uniq: np.ndarray):
        self.co, self.gk_code, self.gk_uniq = co, gk_code, gk_uniq
        self.known: dict[str, set[int]] = {}

    def __getitem__(self, grp: str) -> set[int]:
        if grp not in self.known:
            codes = [i for i, u in enumerate(self.gk_uniq) if str(u) == grp]
            sub = self.co.iloc[np.flatnonzero(np.isin(self.gk_code, codes))]
            mem: set[int] = set()
            seen: set = set()
            for gr in sub["group_ranks"]:
                if isinstance(gr, (list, tuple, np.ndarray)):
                    try:
                        look = (gr.dtype.str, gr.tobytes()) if isinstance(gr, np.ndarray) else tuple(gr)
                        if look in seen:
                            continue
                        seen.add(look)
                    except TypeError:  # unhashable: convert it
                        pass
                    mem |= {int(x) for x in gr}
            self.known[grp] = mem or {int(x) for x in sub["rank"].unique()}
        return self.known[grp]


def _collective_hangs(frame: AnalysisFrame, cfg: HangConfig) -> list[Finding]:
    data = frame.data
    co = data.collectives
    if co.empty:
        return []
    out: list[Finding] = []
    incomplete = np.isnan(co["t_done"].to_numpy(dtype=float, na_value=np.nan))
    if not incomplete.any():
        return []
    # the records of every op instance (gkey, seq) with an incomplete record, found once by integer keys: a mask of
    # the whole frame per instance cost O(records) each, and a live window ends with every rank's ops in flight
    gk_code, gk_uniq = pd.factorize(co["gkey"])
    gk_uniq = np.asarray(gk_uniq, dtype=object)
    seq = co["seq"].to_numpy().astype(np.int64)
    seq0 = seq - int(seq.min())
    key = gk_code.astype(np.int64) * (int(seq0.max()) + 1) + seq0
    inc_keys = pd.unique(key[incomplete & (gk_code >= 0)])  # a record without a gkey is in no group (as groupby)
    rel = co.iloc[np.flatnonzero(np.isin(key, inc_keys))]
    members_by_group = _GroupMembers(co, gk_code, gk_uniq)
    problems = []
    for (grp, seq), allrec in rel.groupby(["gkey", "seq"]):
        sub = allrec[allrec["t_done"].isna()]
        if sub.empty:
            continue
        gr = allrec["group_ranks"].iloc[0]
        members = {int(x) for x in gr} if isinstance(gr, (list, tuple, np.ndarray)) and len(gr) else members_by_group[str(grp)]
        arrived = {int(r) for r in allrec["rank"]}
        waiting = sorted(int(r) for r in sub["rank"])
        missing = sorted(members - arrived)
        problems.append(dict(group=str(sub["group"].iloc[0]), gkey=str(grp), seq=int(seq), op=str(sub["op"].iloc[0]), missing=missing, waiting=waiting,
                             since=float(sub["t_arrive"].min()), step=int(sub["step"].min()),
                             since_head=float(min(t + data.clock_offset_s.get(int(r), 0.0)
                                                  for r, t in zip(sub["rank"], sub["t_arrive"])))))
    if data.now is not None:
        # live: a collective in flight right now is not a hang until it has waited long enough
        # (waited on the head's clock: each rank's arrival time plus its clock offset, so a skewed node does not
        # make a fresh op look old). Judged first: each test below is per op, and this one is the cheapest.
        stall_s = _stall_s(data, cfg)  # once: a median over every step row
        problems = [p for p in problems if data.now - p["since_head"] > stall_s]
    if not problems:
        return []
    # A waiting rank that later completed another collective on the same communicator was not stuck here:
    # the record is an op whose completion was never observed (e.g. an async tensor-parallel all-reduce the
    # trainer did not wait on through its timer), not a hang. (The latest arrival of each (communicator, rank) at
    # a completed op, for the communicators of these ops only.)
    code_of = {str(u): i for i, u in enumerate(gk_uniq)}
    want = np.flatnonzero(~incomplete & np.isin(gk_code, [code_of[p["gkey"]] for p in problems if p["gkey"] in code_of]))
    done_arrive = pd.Series(co["t_arrive"].to_numpy(dtype=float, na_value=np.nan)[want])
    moved_on = done_arrive.groupby([gk_code[want], co["rank"].to_numpy()[want]]).max().to_dict()
    problems = [p for p in problems
                if not all(moved_on.get((code_of.get(p["gkey"], -1), r), -np.inf) > p["since"] for r in p["waiting"])]
    # nor was a rank that went on to end as planned (an op it never waited on before a clean exit)
    ended = ended_ranks(data)
    problems = [p for p in problems if not all(clean_exit(ended.get(r, "?")) for r in p["waiting"])]
    if not problems:
        return []
    problems.sort(key=lambda p: (not p["missing"], p["since"]))
    first = problems[0]
    last_coll = _last_completed(co, ~incomplete)
    grp_code, grp_uniq = pd.factorize(co["group"])
    this = [i for i, g in enumerate(grp_uniq) if str(g) == first["group"]]
    names = len(set(pd.unique(gk_code[np.isin(grp_code, this)]).tolist()) - {-1}) if this else 1
    if names <= 1:
        first["gkey"] = first["group"]  # one communicator of that name: say it as the flight recorder does
    else:
        first["gkey"] = first["gkey"].replace("[", " [")
    wait_who = f"rank{'s' if len(first['waiting']) > 1 else ''} {fmt_ranks(first['waiting'])}"
    if first["missing"]:
        miss = first["missing"]
        who = f"rank{'s' if len(miss) > 1 else ''} {fmt_ranks(miss)}"
        summary = (f"{who} never joined {first['op']} seq {first['seq']} on group {first['gkey']}; "
                   f"{wait_who} waiting since {_fmt_t(first['since'])} (step {first['step']})")
        ranks = miss
        bad_nodes = frame.placement.nodes_of(miss)
        without = f" without node(s) {fmt_ranks(bad_nodes)}" if frame.placement.n_nodes > 1 else ""
        rec = (f"Dump the stacks of {who} (py-spy dump --pid, or the flight recorder) to see where it is stuck; "
               f"set TORCH_NCCL_DUMP_ON_TIMEOUT=1 and restart from the last checkpoint{without} if it does not "
               "recover.")
        cause = "missing_ranks"
    else:
        summary = (f"{first['op']} seq {first['seq']} on group {first['gkey']}: all ranks ({fmt_ranks(first['waiting'])}) joined "
                   f"at step {first['step']} but it never completed (since {_fmt_t(first['since'])})")
        ranks = first["waiting"]
        rec = "The collective itself is stuck: check the network (NCCL_DEBUG=INFO, ibstat), then restart from the last checkpoint."
        cause = "collective_stuck"
    out.append(Finding(
        analyzer=NAME, kind="hang", severity="critical", ranks=ranks, nodes=frame.placement.nodes_of(ranks),
        step_start=first["step"], step_end=first["step"],
        evidence=dict(cause=cause, group=first["group"], communicator=first["gkey"], seq=first["seq"], op=first["op"], missing_ranks=first["missing"],
                      waiting_ranks=first["waiting"], waiting_since=fnum(first["since"], 3),
                      incomplete_collectives=len(problems), last_completed_collective=last_coll,
                      onset_step=first["step"], detected_at_step=first["step"]),
        confidence=0.9 if first["missing"] else 0.7, summary=summary, recommendation=rec,
    ))
    return out


def _last_completed(co: pd.DataFrame, done: np.ndarray) -> dict[int, str]:
    """Per rank, its completed collective with the latest arrival (a record without an arrival time counts as the
    latest, as a sort puts it last; of equal ones the last record): "op seq N on group". One pass over the records,
    not a sort per rank."""
    rows = np.flatnonzero(done)
    if not len(rows):
        return {}
    rank = co["rank"].to_numpy()[rows].astype(np.int64)
    t = co["t_arrive"].to_numpy(dtype=float, na_value=np.nan)[rows]
    r_code, ranks = pd.factorize(rank)
    pos = np.arange(len(rows))
    nan = np.isnan(t)
    latest = np.full(len(ranks), -np.inf)
    np.fmax.at(latest, r_code, t)
    pick = np.full(len(ranks), -1, np.int64)
    at_latest = ~nan & (t == latest[r_code])
    np.maximum.at(pick, r_code[at_latest], pos[at_latest])
    # an unknown arrival sorts last: where a rank has one, its last such record
    has_nan = np.zeros(len(ranks), bool)
    has_nan[r_code[nan]] = True
    nan_pick = np.full(len(ranks), -1, np.int64)
    np.maximum.at(nan_pick, r_code[nan], pos[nan])
    pick = np.where(has_nan, nan_pick, pick)
    sel = co.iloc[rows[pick]]
    return {int(r): f"{op} seq {int(s)} on {g}"
            for r, op, s, g in zip(ranks, sel["op"].tolist(), sel["seq"].tolist(), sel["group"].tolist())}


def _step_hangs(frame: AnalysisFrame, cfg: HangConfig, have: bool) -> list[Finding]:
    data = frame.data
    st = data.steps
    out: list[Finding] = []
    if st.empty:
        return out
    last = st.groupby("rank").agg(step=("step", "max"), t=("t_end", "max"))
    left = set(ended_ranks(data))  # ranks that exited or were evicted after their last step
    node_of = frame.placement.rank_node
    if data.now is not None:
        # live: a rank that ended (its exit event after its last step) is quiet, not hung, however long ago it ended
        stall_s = _stall_s(data, cfg)
        # silence on the head's clock: a rank's last step end plus its clock offset (data.clock_offset_s; 0 where
        # unknown), so a node whose clock is behind is not "silent" by the difference
        offset = pd.Series(data.clock_offset_s, dtype=float).reindex(last.index).fillna(0.0)
        last = last.assign(t=last["t"] + offset)
        silent = last[(data.now - last["t"]) > stall_s]
        silent = silent[~silent.index.isin(list(left))]
        if not silent.empty:
            ranks = sorted(int(r) for r in silent.index)
            alive = sorted(int(r) for r in last.index if int(r) not in ranks and int(r) not in left)
            since = float(silent["t"].max())
            if alive:
                summary = (f"rank(s) {fmt_ranks(ranks)} stopped reporting {data.now - since:.0f} s ago (last step "
                           f"{int(silent['step'].max())}) while rank(s) {fmt_ranks(alive)} continue")
            else:
                summary = f"the whole job is silent: no rank reported for {data.now - since:.0f} s (last step {int(last['step'].max())})"
                if not left:
                    summary += ("; no rank recorded an exit, so a run that ended cannot be told from a hung one "
                                "(rs.finish(), or `with ranksight.init(...) as rs:`, records the end)")
            out.append(Finding(
                analyzer=NAME, kind="hang", severity="critical", ranks=ranks, nodes=sorted({node_of.get(r, 0) for r in ranks}),
                step_start=int(silent["step"].min()), step_end=int(last["step"].max()),
                evidence=dict(cause="silent", silent_s=fnum(data.now - since, 1), stall_threshold_s=fnum(stall_s, 1),
                              last_step={int(r): int(s) for r, s in last["step"].items()},
                              onset_step=int(silent["step"].min()) + 1, detected_at_step=int(silent["step"].min()) + 1),
                confidence=0.8 if alive else 0.6, summary=summary,
                recommendation="Dump the silent ranks' stacks (py-spy dump) and the flight recorder; restart from the last checkpoint if they do not recover.",
            ))
        return out  # live: agents deliver at different delays, so step lags alone are not judged
    if have:
        return out
    top = int(last["step"].max())
    behind = last[(top - last["step"]) >= cfg.lag_steps]
    behind = behind[~behind.index.isin(list(left))]
    if not behind.empty:
        ranks = sorted(int(r) for r in behind.index)
        out.append(Finding(
            analyzer=NAME, kind="hang", severity="critical", ranks=ranks, nodes=sorted({node_of.get(r, 0) for r in ranks}),
            step_start=int(behind["step"].min()) + 1, step_end=top,
            evidence=dict(cause="stopped_early", last_step={int(r): int(s) for r, s in last["step"].items()},
                          onset_step=int(behind["step"].min()) + 1, detected_at_step=int(behind["step"].min()) + 1),
            confidence=0.7,
            summary=f"rank(s) {fmt_ranks(ranks)} stopped at step {int(behind['step'].min())} while others reached step {top}",
            recommendation=("Read the stopped ranks' logs for a crash or hang; restart from the last checkpoint"
                            + (" without their node if it is faulty." if frame.placement.n_nodes > 1 else ".")),
        ))
        return out
    crash = _crash(frame)
    if crash is not None:
        out.append(crash)
        return out
    m = data.manifest
    planned = (m.config or {}).get("steps") if m is not None else None
    if (m is not None and not finished_run(data) and isinstance(planned, int) and top + 1 < planned
            and data.until is None):
        out.append(Finding(
            analyzer=NAME, kind="hang", severity="warning", ranks=sorted(int(r) for r in last.index), nodes=frame.placement.nodes_of(last.index),
            step_start=top + 1, step_end=top + 1,
            evidence=dict(cause="ended_early", last_step=top, planned_steps=planned, onset_step=top + 1, detected_at_step=top + 1),
            confidence=0.4,
            summary=f"the run stopped after step {top} of {planned} planned and never finished (hang, crash or kill)",
            recommendation="Check the launcher's exit status and each rank's log; if it hung, rerun with TORCH_NCCL_DUMP_ON_TIMEOUT=1 to get flight-recorder dumps.",
        ))
    return out


def _crash(frame: AnalysisFrame) -> Finding | None:
    """Ranks that exited with an error (the trainer's ``exit`` event with a reason other than finished):
    the first one to fail is the likely origin; the others usually fail on a broken connection after it."""
    data = frame.data
    ev = data.events
    if ev.empty:
        return None
    ex = ev[ev["event"] == "exit"].copy()
    if ex.empty:
        return None
    ex["reason"] = [exit_reason(d) for d in ex["detail"]]  # also from the store and the live window (JSON text)
    bad = ex[(ex["reason"] != "") & ~ex["reason"].map(clean_exit)]
    if bad.empty:
        return None
    bad = bad.sort_values("t")
    first = bad.iloc[0]
    reason = " ".join(first["reason"].split())[:200]
    # the ranks that failed with the same first error (peers failing on a closed connection come later)
    origin = sorted(int(r) for r in bad.loc[bad["reason"] == first["reason"], "rank"].unique())
    others = sorted(int(r) for r in bad["rank"].unique() if int(r) not in origin)
    step = int(first["step"])
    return Finding(
        analyzer=NAME, kind="hang", severity="critical", ranks=origin, nodes=frame.placement.nodes_of(origin), step_start=step, step_end=step,
        evidence=dict(cause="crashed", first_error=reason, failed_ranks=sorted(int(r) for r in bad["rank"].unique()),
                      followers=others, onset_step=step, detected_at_step=step),
        confidence=0.8,
        summary=(f"rank{'s' if len(origin) > 1 else ''} {fmt_ranks(origin)} failed first at step {step}: {reason[:120]}"
                 + (f"; rank(s) {fmt_ranks(others)} failed after it" if others else "")),
        recommendation="Fix the error in the first failing rank's log (the others failed on the broken connection), then resume from the last checkpoint.",
    )


def _watchdog(frame: AnalysisFrame) -> list[Finding]:
    data = frame.data
    ne = data.nccl_events
    if ne.empty:
        return []
    cat = ne["category"].fillna("").astype(str)
    ecl = ne["error_class"].fillna("").astype(str)
    wd = ne[(cat == "watchdog") | (ecl == "timeout")]
    if wd.empty:
        return []
    ranks = sorted({int(r) for r in pd.to_numeric(wd["rank"], errors="coerce").dropna()})
    hosts = sorted(set(wd["host"].fillna("").astype(str)) - {""})
    if not ranks:
        by_host: dict[str, list[int]] = {}
        for r, h in frame.placement.rank_host.items():
            by_host.setdefault(h, []).append(r)
        ranks = sorted({r for h in hosts for r in by_host.get(h, [])})
    msg = str(wd["message"].iloc[0])[:300]
    return [Finding(
        analyzer=NAME, kind="hang", severity="critical", ranks=ranks, nodes=frame.placement.nodes_of(ranks),
        evidence=dict(cause="watchdog_timeout", lines=int(len(wd)), hosts=hosts, example=msg),
        confidence=0.9,
        summary=f"collective watchdog timed out on {', '.join(hosts) or 'some host'} ({len(wd)} line(s)): {msg[:120]}",
        recommendation="A collective did not complete within the timeout: find the rank that never joined (flight recorder dumps), then restart from the last checkpoint.",
    )]


def analyze(frame: AnalysisFrame, cfg: HangConfig | None = None) -> list[Finding]:
    cfg = cfg or HangConfig()
    out = _collective_hangs(frame, cfg)
    out += _step_hangs(frame, cfg, have=bool(out))
    out += _watchdog(frame)
    out += _clock_skew(frame, cfg)
    return out


def _clock_skew(frame: AnalysisFrame, cfg: HangConfig) -> list[Finding]:
    """Live: nodes whose clock is off from the head's by more than ``skew_s`` (the median of their ranks' measured
    offsets, ``RunData.clock_offset_s``). One finding for all of them: a run's clocks are one problem."""
    data = frame.data
    if data.now is None or not data.clock_offset_s:
        return []
    node_of = frame.placement.rank_node
    by_node: dict[int, list[float]] = {}
    for r, off in data.clock_offset_s.items():
        by_node.setdefault(int(node_of.get(int(r), 0)), []).append(float(off))
    skewed = {n: float(np.median(v)) for n, v in by_node.items() if abs(float(np.median(v))) > cfg.skew_s}
    if not skewed:
        return []
    parts = [f"node {n}'s clock is {abs(o):.1f} s {'behind' if o > 0 else 'ahead of'} the head's" for n, o in sorted(skewed.items())]
    ranks = sorted(int(r) for r in data.clock_offset_s if int(node_of.get(int(r), 0)) in skewed)
    return [Finding(
        analyzer=NAME, kind="clock_skew", severity="warning", ranks=ranks, nodes=sorted(skewed),
        evidence=dict(offset_s_by_node={int(n): fnum(o, 2) for n, o in sorted(skewed.items())},
                      offset_s_by_rank={int(r): fnum(o, 2) for r, o in sorted(data.clock_offset_s.items())},
                      threshold_s=cfg.skew_s,
                      measured_as="per node, the smallest (head receive time - the agent's heartbeat send time)"),
        confidence=0.8, summary="; ".join(parts) + " (liveness is judged on the head's clock; cross-node timings are not comparable)",
        recommendation="Synchronise the nodes' clocks (chrony/NTP or PTP) and check with `chronyc tracking`; until then "
                       "arrival order and completion leads across nodes compare skewed clocks.",
    )]
