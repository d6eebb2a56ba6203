"""Which link is slow: op instances' transfer times, compared communicator against communicator.

Used by the comm check (analyzers/checks/comm.py). The functions read the run's collective records
(``RunData.collectives``). Three questions, one per function:

- ``op_transfers``: for every op instance that all its participants recorded, how long its data took to
  move once everybody was there. A collective: the duration seen by the last rank to arrive (nobody is
  left to wait for, so what remains is the transfer, plus any delay of its own before its data leaves).
  A pipeline p2p transfer (the trainer records each send and recv on a directed link ``pp:<src>><dst>``):
  the receiver's completion minus the later of the two arrivals (the sender posting its data, the
  receiver starting to wait for it).
- ``slow_communicators``: a communicator whose transfers are persistently slower than those of the other
  communicators of its kind (tp against tp, dp against dp, a p2p link against the other p2p links) is
  slow; a rank is named when it is the one member common to the slow communicators (a rank on a slow
  link slows every communicator it is in: its TP group *and* its data-parallel group; of a p2p link only
  the sender is suspect, since its data is what arrives late).

- ``early_finishers``: whose collectives end before their peers'. Every member of a collective is done when the
  data of every other member has reached it. A rank whose outgoing link is slow (a degraded NIC, a slow
  node's egress) receives its peers' data on time, so it is done first, while they still wait for its data: in a
  two-member group its peer, in a ring its successors (the last chunk each of them receives has crossed the slow
  hop, except the one its sender receives). Where every communicator crosses the slow link (two nodes: each
  data-parallel group spans both), comparing communicators sees nothing, but the order in which the members of
  each op finish does.

Pooling every op of a communicator over a few steps is what makes this sensitive where one op's excess
is small: a median over tens of ops, against the same kind of communicator on the same job, is far steadier
than any one op (bench/signal_noise.py measures that noise). The noise a threshold is scaled by is measured
from differences between windows a window apart (``shift_robust_sigmas``): a spread over the whole run would
count the slow link's own level shift as noise when half the communicators shift together (every link out of
a slow node).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.changepoint import refine_onset
from analyzers.matrices import distinct_codes
from analyzers.checks.completion_leads import (CompletionLeads, completion_leads,  # noqa: F401 (tests read them here)
                                               most_in_cell_in_order, window_can_fill)
from analyzers.checks.op_instances import (P2P_OPS, SYMMETRIC_OPS,  # noqa: F401
                                           last_arriver_ops, op_instances, release_op_instances)
from analyzers.collectives import name_starts_with, stable_order
from analyzers.persistence import confirmation_step, persistent_runs
from analyzers.stats import leave_one_out_median, row_robust_sigmas, rows_with_window_count, windowed_medians

STRAGGLER_RATIO = 1.08  # a rank computing this much slower than its peers is the straggler check's ...
LINK_DOMINANCE = 2.0  # ... unless its transfers exceed its peers' by more than this many times its extra compute


class ComputeCheck:
    """Is a slow-link suspect really a slow computer? Per rank and step: its compute against its peers' (ratio and
    extra ms) and its transfers' extra ms over its peers' (from the step records, as the transfer-ratio signature
    measures them).

    Built from the frames (``ComputeCheck(ratio, extra, transfer_extra)``), or from the compute matrix and a way to
    get its reference (``of_matrix``): then a rank's ratio and extra ms are worked out for its row when asked (a
    few suspects are; the whole ranks x steps frames were two matrices of 80 MB at 1,024 x 10,000, each cell the
    same arithmetic as a row's)."""

    def __init__(self, comp_ratio: pd.DataFrame | None, comp_extra_ms: pd.DataFrame | None,
                 transfer_extra_ms: pd.DataFrame):
        self._comp_ratio, self._comp_extra_ms, self.transfer_extra_ms = comp_ratio, comp_extra_ms, transfer_extra_ms
        self._comp = self._reference = self._row_reference = None
        self._rows: dict = {}

    @classmethod
    def of_matrix(cls, comp: pd.DataFrame, reference, transfer_extra_ms: pd.DataFrame,
                  row_reference=None) -> "ComputeCheck":
        """From the compute matrix and ``reference()``, its leave-one-out reference (called on first need);
        ``row_reference(rank)``: that reference's row of one rank (``StepView.row_reference``), for the rows asked
        about, when the whole reference is not needed."""
        out = cls(None, None, transfer_extra_ms)
        out._comp, out._reference, out._row_reference = comp, reference, row_reference
        return out

    def _ref(self) -> pd.DataFrame:
        if callable(self._reference):
            self._reference = self._reference()
        return self._reference

    @property
    def comp_ratio(self) -> pd.DataFrame:
        """Every rank's compute ratio (a frame: worked out whole when asked for whole)."""
        if self._comp_ratio is None:
            with np.errstate(divide="ignore", invalid="ignore"):
                self._comp_ratio = self._comp / self._ref().replace(0, np.nan)
        return self._comp_ratio

    @property
    def comp_extra_ms(self) -> pd.DataFrame:
        if self._comp_extra_ms is None:
            self._comp_extra_ms = self._comp - self._ref()
        return self._comp_extra_ms

    def ratio_row(self, r: int) -> pd.Series | None:
        """Rank r's compute ratio per step (``comp_ratio.loc[r]``); None where it has no row."""
        return self._row("ratio", r)

    def _row(self, which: str, r: int) -> pd.Series | None:
        whole = self._comp_ratio if which == "ratio" else self._comp_extra_ms if which == "extra" else self.transfer_extra_ms
        if whole is not None:
            return whole.loc[r] if r in whole.index else None
        if (which, r) not in self._rows:
            if r not in self._comp.index:
                self._rows[which, r] = None
            else:
                own = self._comp.loc[r]
                ref = self._row_reference(r) if self._row_reference is not None else self._ref().loc[r]
                with np.errstate(divide="ignore", invalid="ignore"):
                    self._rows[which, r] = own / ref.replace(0, np.nan) if which == "ratio" else own - ref
        return self._rows[which, r]

    def _median(self, which: str, r: int, s0: int, s1: int) -> float:
        row = self._row(which, r)
        if row is None:
            return float("nan")
        vals = row.loc[[s for s in row.index if s0 <= s <= s1]].to_numpy(dtype=float)
        return float(np.nanmedian(vals)) if np.isfinite(vals).any() else float("nan")

    def compute_ratio(self, r: int, s0: int, s1: int) -> float:
        return self._median("ratio", r, s0, s1)

    def slow_computer(self, r: int, s0: int, s1: int) -> bool:
        """Rank r over [s0, s1] computes >= STRAGGLER_RATIO x its peers and that explains its transfers: they exceed
        its peers' by at most LINK_DOMINANCE x its extra compute. A slow link can cost its rank some compute too
        (its delays make its CPU time run cache-cold on a CPU host), but then its transfers' excess is many times
        that."""
        cr = self.compute_ratio(r, s0, s1)
        if not (np.isfinite(cr) and cr >= STRAGGLER_RATIO):
            return False
        comp_extra, tr_extra = self._median("extra", r, s0, s1), self._median("transfer", r, s0, s1)
        return not (np.isfinite(comp_extra) and np.isfinite(tr_extra) and tr_extra > LINK_DOMINANCE * max(comp_extra, 0.0))


def shift_robust_sigmas(frame: pd.DataFrame, lag: int) -> pd.Series:
    """Each row's noise over time, robust to a level shift: the robust sigma of x[s] - x[s - lag] (windows ``lag``
    steps apart do not overlap), over sqrt(2); NaN for a row with fewer than two differences. A persistent shift
    (a link that became slow) moves only ``lag`` of those differences, so unlike a spread of the values themselves it
    does not raise the threshold it should cross."""
    values = frame.to_numpy(dtype=float)
    out = np.full(values.shape[0], np.nan)
    if values.shape[1] > lag:
        diffs = values[:, lag:] - values[:, :-lag]
        enough = np.isfinite(diffs).sum(axis=1) >= 2
        out[enough] = row_robust_sigmas(diffs[enough]) / np.sqrt(2.0)
    return pd.Series(out, index=frame.index)


def reference_sigma(frame: pd.DataFrame, lag: int, quietest: bool = False) -> pd.Series:
    """Per row, the noise its excess is judged against: that of the *other* rows (those its reference is the median
    of), their median ``shift_robust_sigmas`` or, with ``quietest``, the smallest. A slow link is noisier than a quiet
    one (its queue comes and goes, and so do the acknowledgements queued behind it: the reverse link's transfers
    jitter too); neither must raise the bar it is measured by. A single row: its own."""
    sig = shift_robust_sigmas(frame, lag)
    if len(sig) < 2:
        return sig.fillna(0.0)
    if quietest:
        v = sig.to_numpy(dtype=float)
        others = [np.nanmin(np.delete(v, i)) if np.isfinite(np.delete(v, i)).any() else np.nan for i in range(len(v))]
        ref = pd.Series(others, index=sig.index)
    else:
        ref = leave_one_out_median(sig.to_frame()).iloc[:, 0]
    return ref.fillna(sig).fillna(0.0)


P2P_CLASS = "pp link"  # every directed pipeline link is compared with the others

TRANSFER_COLUMNS = ["gkey", "cls", "seq", "rank", "step", "transfer_ms", "suspects"]


def p2p_transfers(co: pd.DataFrame, first_step: int | None = None) -> pd.DataFrame:
    """One row per pipeline p2p transfer both ends recorded: the link (gkey), its sequence number, the sender, the
    step, and the transfer time: receiver's completion - max(sender's arrival, receiver's arrival), in ms."""
    if co.empty:
        return pd.DataFrame(columns=TRANSFER_COLUMNS)
    p = co[co["op"].isin(P2P_OPS).to_numpy(dtype=bool) & name_starts_with(co["group"], "pp:")]
    if first_step is not None:
        p = p[p["step"] >= first_step]
    send = p[p["op"] == "send"][["gkey", "seq", "rank", "step", "t_arrive"]]
    recv = p[(p["op"] == "recv") & p["t_done"].notna()][["gkey", "seq", "t_arrive", "t_done"]]
    if send.empty or recv.empty:
        return pd.DataFrame(columns=TRANSFER_COLUMNS)
    j = send.merge(recv, on=["gkey", "seq"], suffixes=("", "_recv"))
    if j.empty:
        return pd.DataFrame(columns=TRANSFER_COLUMNS)
    xfer = (j["t_done"] - np.maximum(j["t_arrive"], j["t_arrive_recv"])) * 1000.0
    return pd.DataFrame({"gkey": j["gkey"], "cls": P2P_CLASS, "seq": j["seq"], "rank": j["rank"], "step": j["step"],
                         "transfer_ms": xfer.clip(lower=0.0), "suspects": [(int(r),) for r in j["rank"]], "ops": 1})


def sorted_members(members: pd.Series) -> list[tuple]:
    """Each row's member ranks as a sorted tuple; each distinct member list object converted once (a communicator's
    ops all carry the same shared array, analyzers/collectives.py ``with_members``) and handed to its rows by one
    gather of an object array (a Python lookup per row cost a third of a second at 1.6 M last arrivers), else each
    distinct numpy member list by its bytes."""
    values = members.tolist()
    if not values:
        return []
    code, first = pd.factorize(np.fromiter(map(id, values), dtype=np.int64, count=len(values)))
    if len(first) <= max(1000, len(values) // 8):  # shared objects: one conversion per object
        firsts = np.full(len(first), len(values), np.int64)
        np.minimum.at(firsts, code, np.arange(len(values)))
        conv = _sorted_members_by_value([values[i] for i in firsts])
        by_code = np.empty(len(conv), dtype=object)
        for i, members_of in enumerate(conv):  # one by one: a list of tuples would be taken as a 2-D block
            by_code[i] = members_of
        return by_code[code].tolist()
    return _sorted_members_by_value(values)


def _sorted_members_by_value(values: list) -> list[tuple]:
    cache: dict = {}
    out = []
    for gr in values:
        look = (gr.dtype.str, gr.tobytes()) if isinstance(gr, np.ndarray) else None
        got = cache.get(look) if look is not None else None
        if got is None:
            got = tuple(sorted(int(x) for x in gr))
            if look is not None:
                cache[look] = got
        out.append(got)
    return out


def op_transfers(co: pd.DataFrame, first_step: int | None = None, match_tol_ms: float = 10.0,
                 last: pd.DataFrame | None = None, p2p: pd.DataFrame | None = None) -> pd.DataFrame:
    """Collectives' last-arriver durations and p2p transfers, one frame: gkey, cls (the kind of communicator it is
    compared with), seq, rank (collective: the last arriver; p2p: the sender), step, transfer_ms, suspects (the
    ranks a slow transfer points at: a collective's members, a p2p link's sender). ``last``: ``last_arriver_ops`` of the
    same arguments, ``p2p``: their ``p2p_transfers``, when the caller has them already."""
    if last is None:
        last = last_arriver_ops(co, first_step, match_tol_ms)
    parts = []
    if not last.empty:
        parts.append(pd.DataFrame({
            "gkey": last["gkey"], "cls": last["group"].astype(str), "seq": last["seq"], "rank": last["rank"], "step": last["step"],
            "transfer_ms": last["duration_ms"].astype(float),
            "suspects": sorted_members(last["group_ranks"]),
            "ops": last["ops"] if "ops" in last.columns else 1}))
    if p2p is None:
        p2p = p2p_transfers(co, first_step)
    if not p2p.empty:
        parts.append(p2p)
    if not parts:
        return pd.DataFrame(columns=TRANSFER_COLUMNS)
    return pd.concat(parts, ignore_index=True)


def communicator_medians(tr: pd.DataFrame, steps: list[int], window: int, min_ops: int, q: float = 0.5) -> pd.DataFrame:
    """communicator x step: the median (or the ``q`` quantile) transfer of the communicator's ops (``op_transfers``
    rows) in steps (s - window, s], NaN with fewer than ``min_ops`` ops there."""
    return windowed_medians(tr["gkey"], tr["step"], tr["transfer_ms"], sorted(tr["gkey"].unique()), steps, window,
                            min_ops, q, weights=tr["ops"] if "ops" in tr.columns else None)


def level_quantile(cls: str, cfg) -> float:
    """The quantile of a communicator's transfers that stands for its level: the median, and for pipeline p2p links
    ``p2p_quantile``. A p2p link carries the same activation (or gradient) message again and again, and a slow link
    sets a floor under every one of them (message size / rate), while the queueing above that floor (its own, and the
    acknowledgements the reverse direction waits for) comes and goes."""
    return cfg.p2p_quantile if cls == P2P_CLASS else 0.5


def kind_windowed_medians(tr: pd.DataFrame, steps: list[int], cfg):
    """Per kind of communicator (``cls``) with at least two communicators: (kind, its ops, each communicator's
    windowed level of transfer: ``level_quantile`` of its ops over ``link_window`` steps, at least ``link_min_ops``
    ops). A kind whose levels never have two communicators in one step is left out: there is nothing to compare."""
    for cls, sub in tr.groupby("cls"):
        if sub["gkey"].nunique() < 2:
            continue
        med = communicator_medians(sub, steps, cfg.link_window, cfg.link_min_ops, level_quantile(str(cls), cfg))
        if med.notna().sum(axis=0).max() < 2:
            continue
        yield cls, sub, med


def slow_communicators(co: pd.DataFrame, cfg, steps: list[int], compute: ComputeCheck,
                       last: pd.DataFrame | None = None) -> list[dict]:
    """Slow-link candidates (dicts, as comm._slow_links collects them) from communicators slower than their kind.

    Per kind with at least two communicators: each communicator's windowed median transfer (``link_window`` steps,
    at least ``link_min_ops`` ops) against the leave-one-out median of the others of its kind (its excess).

    - A communicator is *slow* where its excess is >= max(``link_min_extra_ms``, ``link_k`` x the noise of the
      kind's medians over time) and its median >= ``link_ratio`` x the reference, in ``persist`` of ``window`` steps.
    - A suspect of a slow communicator (a collective's members, a p2p link's sender) is named when it is the only
      suspect whose *other* communicators are all slower than their kind too over that span (median excess >=
      ``link_corroborate_k`` sigma of their kind): a rank with a slow link slows every communicator it is in, its
      partners only the one they share with it. A rank whose only compared communicator is a slow p2p link it sends
      on is named on that alone.
    - A rank that computes slowly (``ComputeCheck.slow_computer``) is the straggler check's, not a slow link.
    """
    if not steps:
        return []
    if last is None:
        last = last_arriver_ops(co, steps[0], cfg.match_tol_ms)
    p2p = p2p_transfers(co, steps[0])
    if not communicators_can_fill([last, p2p], cfg.link_window, cfg.link_min_ops):
        return []  # no communicator has a window of link_min_ops ops: no level to compare
    tr = op_transfers(co, steps[0], cfg.match_tol_ms, last, p2p)
    if tr.empty:
        return []
    excess_of: dict[str, pd.Series] = {}  # communicator -> its excess per step
    sigma_of: dict[str, float] = {}  # communicator -> the noise of its kind
    info: dict[str, dict] = {}
    slow: list[dict] = []
    for cls, sub, med in kind_windowed_medians(tr, steps, cfg):
        per_step = communicator_medians(sub, steps, 1, 1, level_quantile(str(cls), cfg))  # for the onset: windows smear it
        step_excess = per_step - leave_one_out_median(per_step)
        ref = leave_one_out_median(med)
        excess = med - ref
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = med / ref.where(ref > 0)
        sigmas = reference_sigma(med, cfg.link_window, quietest=True)
        for key, g in sub.groupby("gkey"):
            sigma = float(sigmas.loc[key])
            threshold = max(cfg.link_min_extra_ms, cfg.link_k * sigma)
            excess_of[str(key)], sigma_of[str(key)] = excess.loc[key], sigma
            flags = ((excess.loc[key] >= threshold) & (ratio.loc[key] >= cfg.link_ratio)).fillna(False)
            key = str(key)
            info[key] = dict(cls=str(cls), suspects=tuple(g["suspects"].iloc[0]))
            for s0, s1, n in persistent_runs(flags, cfg.link_persist, cfg.link_persist_window):
                # the window reaches back link_window - 1 steps; within that, the change point of the per-step excess
                # (a noisy spell just before a slow link began can chain onto it: the change point skips it)
                confirmed = confirmation_step(flags, s0, cfg.link_persist)
                onset = max(steps[0], s0 - cfg.link_window + 1)
                onset = min(max(onset, refine_onset(step_excess.loc[key], onset, s1)), confirmed)
                slow.append(dict(gkey=key, onset=onset, end=s1, n=n, threshold=threshold, confirmed=confirmed))
    # each rank's compared communicators: those it is a suspect of
    mine: dict[int, list[str]] = {}
    for key, i in info.items():
        for r in i["suspects"]:
            mine.setdefault(int(r), []).append(key)

    def corroborated(r: int, f: dict) -> list[dict] | None:
        """r's other communicators over f's span that are slower than their kind; None when r is not singled out:
        a collective's member needs all of them slower (and at least one), a p2p link's sender none."""
        sender = info[f["gkey"]]["suspects"] == (r,)
        rows = []
        for key in mine.get(r, []):
            if key == f["gkey"]:
                continue
            ex = excess_of[key].loc[f["onset"]:f["end"]]
            level = float(np.nanmedian(ex.to_numpy(dtype=float))) if ex.notna().any() else float("nan")
            if np.isfinite(level) and level > 0 and level >= cfg.link_corroborate_k * sigma_of[key]:
                rows.append(dict(communicator=key, excess_ms=round(level, 2)))
            elif not sender:
                return None
        if not rows and not sender:
            return None  # one collective communicator alone cannot say which of its members is slow
        return rows

    by_rank: dict[int, dict] = {}
    for f in sorted(slow, key=lambda f: (f["onset"], f["gkey"])):
        named = {r: rows for r in info[f["gkey"]]["suspects"] if (rows := corroborated(int(r), f)) is not None}
        if len(named) != 1:
            continue
        (r, rows), = named.items()
        r = int(r)
        ops = tr[(tr["gkey"] == f["gkey"]) & (tr["step"] >= f["onset"]) & (tr["step"] <= f["end"])]
        kind = tr[(tr["cls"] == info[f["gkey"]]["cls"]) & (tr["gkey"] != f["gkey"]) & (tr["step"] >= f["onset"]) & (tr["step"] <= f["end"])]
        ev = dict(communicator=f["gkey"], kind=info[f["gkey"]]["cls"], transfer_ms=round(float(ops["transfer_ms"].median()), 2),
                  kind_transfer_ms=round(float(kind["transfer_ms"].median()), 2), ops=int(len(ops)), from_step=f["onset"],
                  threshold_extra_ms=round(f["threshold"], 2))
        c = by_rank.get(r)
        if c is None or f["onset"] > c["end"] + cfg.window:
            c = by_rank[r] = dict(rank=r, onset=f["onset"], end=f["end"], n=f["n"], method="communicators", confirmed=f["confirmed"],
                                  slow=[], corroborating={}, ratio=float("nan"))
        c["end"], c["n"] = max(c["end"], f["end"]), max(c["n"], f["n"])
        c["slow"].append(ev)
        for row in rows:
            c["corroborating"].setdefault(row["communicator"], row["excess_ms"])
    out = []
    for r, c in by_rank.items():
        if compute.slow_computer(r, c["onset"], c["end"]):
            continue  # a slow computer, not a slow link: the straggler check owns it
        c["comp_ratio"] = compute.compute_ratio(r, c["onset"], c["end"])
        c["own"] = float(np.median([e["transfer_ms"] for e in c["slow"]]))
        c["peers"] = float(np.median([e["kind_transfer_ms"] for e in c["slow"]]))
        c["groups_keys"] = sorted({e["communicator"] for e in c["slow"]} | set(c["corroborating"]))
        out.append(c)
    return out


def communicators_can_fill(parts: list[pd.DataFrame], window: int, min_ops: float) -> bool:
    """Can any communicator have ``min_ops`` ops (their weight, where records stand for several) in ``window`` steps
    among the transfers of ``parts`` (``op_transfers``' parts: the last arrivers, the p2p transfers)? False only where
    a bound rules it out: the heaviest (communicator, step) of each part, summed over the parts, times the window,
    is below ``min_ops`` (with one op per communicator and step, the generated stores, no 3-step window holds 4:
    ``slow_communicators`` then has no level to compare, and its transfers are not built). True where steps are
    not integers or a communicator is unnamed."""
    heaviest = 0.0
    for part in parts:
        if part.empty:
            continue
        step = part["step"].to_numpy()
        if step.dtype.kind not in "iu":
            return True
        codes = part["gcode"].to_numpy() if "gcode" in part.columns else pd.factorize(part["gkey"])[0]
        if codes.dtype.kind not in "iu" or bool((codes < 0).any()):
            return True
        w = part["ops"].to_numpy(dtype=float) if "ops" in part.columns else np.ones(len(part))
        w = np.where(np.isnan(w) | (w < 1), 1.0, w)  # a record counts at least once, however its weight reads
        s0 = int(step.min())
        span = int(step.max()) - s0 + 1
        cell = codes.astype(np.int64) * span + (step.astype(np.int64) - s0)
        if (int(codes.max()) + 1) * span > 4 * len(cell) + 1024:  # sparse cells: numbered by a hash
            cell = pd.factorize(cell)[0]
        heaviest += float(np.bincount(cell, weights=w).max())
    return heaviest * max(int(window), 1) >= max(min_ops, 1)


def latest_finish_ms(leads: pd.DataFrame, rank: int, s0: int, s1: int) -> float:
    """How far behind its peers rank ``rank`` finished over steps [s0, s1], on the communicator where it was furthest
    behind: minus the lowest of its communicators' median ``lead_ms`` (``completion_leads`` rows); NaN without ops."""
    mine = leads[(leads["rank"] == rank) & (leads["step"] >= s0) & (leads["step"] <= s1)]
    if mine.empty:
        return float("nan")
    return float(-mine.groupby("gkey")["lead_ms"].median().min())


def early_finishers(co: pd.DataFrame, cfg, steps: list[int], compute: ComputeCheck,
                    leads: CompletionLeads | None = None) -> list[dict]:
    """Slow-link candidates (dicts, as comm._slow_links collects them) from ranks that finish their collectives
    before their peers (``completion_leads``; ``leads``: its ``CompletionLeads``, when the caller has them).

    Per rank and communicator: the median lead of its ops in each window of ``link_window`` steps (at least
    ``link_min_ops`` ops). A rank is flagged in a step where, on any of its communicators, that median is
    >= max(``link_min_extra_ms``, ``lead_k`` x the leads' noise over time (``shift_robust_sigma``)), in
    ``link_persist`` of ``link_persist_window`` steps: on a shared host a member held up by its core finishes late
    for a few steps at a time, which makes its peers lead for as long; a slow link stays slow. A rank that computes
    slowly (``ComputeCheck.slow_computer``) is the straggler check's, and so are the peers of one (they finish first
    because it arrives last)."""
    if not steps:
        return []
    if leads is None:
        leads = CompletionLeads(co, steps[0], cfg.match_tol_ms)
    if leads.empty or not window_can_fill(leads, cfg.link_window, cfg.link_min_ops):
        return []
    # one row per (rank, communicator), numbered in ("rank|gkey") order: the rank, then its communicators by name.
    # The arrays are over every record of the op instances; ``complete`` marks those with a lead (the others get a
    # pair code past every real one, and no row)
    complete = leads.complete
    rank = leads.rank
    gkey_code = leads.gcode
    gkey_names = np.asarray(leads.gkeys, dtype=object)
    nk = max(len(gkey_names), 1)
    wide = (int(rank.max()) + 2) * nk >= 2**31 or int(rank.min()) < 0
    pair = rank.astype(np.int64 if wide else np.int32)  # 32 bits where they fit: 80 MB a copy at 20 M records
    pair *= nk
    pair += gkey_code
    none = (int(rank.max()) + 1) * nk  # the pair code of a record without a lead
    pair[~complete] = none
    pairs, pair_code = distinct_codes(pair)  # sorted; without a sort where the span allows
    pairs = pairs.astype(np.int64)
    del pair
    n_real = len(pairs) - int(pairs[-1] == none)
    pairs = pairs[:n_real]
    pair_rank, pair_key = pairs // nk, pairs % nk
    label_order = np.asarray(sorted(range(len(pairs)), key=lambda i: f"{pair_rank[i]}|{gkey_names[pair_key[i]]}"),
                             dtype=np.int64)
    labels = pairs[label_order].tolist()  # the old string labels' order, as integers
    row_of_pair = np.full(n_real + 1, -1, np.int64)
    row_of_pair[label_order] = np.arange(len(pairs))
    pos = row_of_pair.astype(np.int32 if len(pairs) < 2**31 else np.int64)[pair_code]  # each record's row; -1: none
    del pair_code
    step = leads.step
    weights = leads.weight
    weighted = len(weights) and np.nanmax(weights) > 1
    # the records of the rows that have a window of link_min_ops ops: only their leads are worked out (the other
    # rows' medians are NaN); none such: nothing to compare
    need = rows_with_window_count(pos, step, len(labels), np.asarray(steps, dtype=np.int64), cfg.link_window,
                                  max(cfg.link_min_ops, 1), weights if weighted else None)
    sel = np.flatnonzero(np.r_[need, False][pos])
    if not len(sel):
        return []
    label_arr = np.asarray(labels, dtype=np.int64)
    med = _label_windowed_medians(label_arr[pos[sel]], step[sel], leads.lead_ms(sel), labels, steps, cfg.link_window,
                                  cfg.link_min_ops, weights[sel])
    if med.notna().sum(axis=0).max() < 2:
        return []
    thresholds = np.maximum(cfg.link_min_extra_ms, cfg.lead_k * reference_sigma(med, cfg.link_window))
    over = med.ge(thresholds, axis=0).fillna(False)
    any_over = over.to_numpy().any(axis=1)
    per_step_of: dict[int, pd.DataFrame] = {}
    mine_of: dict[int, list[int]] = {}  # rank -> its labels, in label order
    for lab in labels:
        mine_of.setdefault(int(lab // nk), []).append(lab)
    flagged = {int(lab // nk) for lab, a in zip(labels, any_over) if a}
    key_of = lambda lab: str(gkey_names[int(lab % nk)])  # noqa: E731
    out = []
    for r in sorted(flagged):
        mine = mine_of[r]
        flags = over.loc[mine].any(axis=0)
        for s0, s1, n in persistent_runs(flags, cfg.link_persist, cfg.link_persist_window):
            if r not in per_step_of:  # for the onset: the rank's per-step medians (windows smear it)
                at = np.flatnonzero((rank == r) & complete)
                per_step_of[r] = _label_windowed_medians(label_arr[pos[at]], step[at], leads.lead_ms(at), mine, steps,
                                                         1, 1, None)
            per_step = per_step_of[r]
            confirmed = confirmation_step(flags, s0, cfg.link_persist)
            onset = max(steps[0], s0 - cfg.link_window + 1)
            # its communicators that were ahead over most of the run of flags
            slow = [lab for lab in mine if 2 * int(over.loc[lab, s0:s1].sum()) >= n] or mine
            onset = min(max(onset, refine_onset(per_step.loc[slow].median(axis=0), onset, s1)), confirmed)
            if compute.slow_computer(r, onset, s1):
                continue
            keys = sorted(key_of(lab) for lab in slow)
            of_keys = np.isin(gkey_code, [int(lab % nk) for lab in slow]) & complete
            peers = set(rank[of_keys].tolist()) - {r}
            if any(compute.slow_computer(m, onset, s1) for m in peers):
                # a peer computes slowly: it arrives last, so it finishes last and this rank "leads" (the victim of
                # a straggler, which the straggler check names), not a rank whose link is slow
                continue
            ops = leads.frame(np.flatnonzero((rank == r) & of_keys & (step >= onset) & (step <= s1)))
            out.append(dict(rank=int(r), onset=int(onset), end=int(s1), n=n, method="completion_lead", confirmed=confirmed,
                            own=float(ops["lead_ms"].median()), peers=float(ops["duration_ms"].median()),
                            ratio=float("nan"), comp_ratio=compute.compute_ratio(r, onset, s1),
                            threshold=float(thresholds.loc[slow].median()),
                            ops=int(len(ops)), groups_keys=keys))
    return out


CHUNK_ROWS = 1 << 22  # records per windowed_medians call: bounds its working arrays (~10 per record)


def _label_windowed_medians(labels: np.ndarray, step: np.ndarray, values: np.ndarray, index: list, steps: list,
                            window: int, min_ops: int, weights: np.ndarray | None) -> pd.DataFrame:
    """``stats.windowed_medians`` of integer ``labels`` (rows ``index``, in that order), over the records sorted by
    (row, step) and in slices of whole rows of about ``CHUNK_ROWS`` records: the same medians (each row's are its
    own records'), with its working arrays bounded by a slice instead of every record (a GiB and more at 20 M
    records), and its own stable sort of the records by cell fast on records already in order."""
    pos = pd.Index(index).get_indexer(labels)
    keep = pos >= 0
    if not keep.all():
        pos, labels, step, values = pos[keep], labels[keep], step[keep], values[keep]
        weights = weights[keep] if weights is not None else None
    steps_arr = np.asarray(steps)
    g0 = int(steps_arr.min()) - max(int(window), 1) + 1 if len(steps_arr) else 0
    # records no window reaches are left out first (as windowed_medians does); the step as an offset from g0
    inside = (step >= g0) & (step <= (int(steps_arr.max()) if len(steps_arr) else -1))
    if not inside.all():
        pos, labels, step, values = pos[inside], labels[inside], step[inside], values[inside]
        weights = weights[inside] if weights is not None else None
    # rows with no window of enough ops are NaN throughout: their records are left out before any sort (with one op
    # per communicator and step, every row of a 3-step window of at least 4 ops)
    weighted = weights is not None and len(weights) and np.nanmax(weights) > 1
    need = rows_with_window_count(pos, step, len(index), steps_arr, window, max(min_ops, 1),
                                  weights if weighted else None)[pos] if len(pos) else np.zeros(0, bool)
    if not need.all():
        pos, labels, step, values = pos[need], labels[need], step[need], values[need]
        weights = weights[need] if weights is not None else None
    if not len(pos):
        return pd.DataFrame(np.full((len(index), len(steps)), np.nan), index=index, columns=steps)
    if len(pos) <= CHUNK_ROWS:
        return windowed_medians(labels, step, values, index, steps, window, min_ops, weights=weights)
    order = stable_order(pos, step.astype(np.int64) - g0)
    pos, labels, step, values = pos[order], labels[order], step[order], values[order]
    weights = weights[order] if weights is not None else None
    parts = []
    lo = 0
    while lo < len(pos):
        hi = min(len(pos), lo + CHUNK_ROWS)
        hi = int(np.searchsorted(pos, pos[hi - 1], side="right"))  # whole rows
        p0, p1 = int(pos[lo]), int(pos[hi - 1]) + 1
        parts.append((p0, p1, windowed_medians(labels[lo:hi], step[lo:hi], values[lo:hi], index[p0:p1], steps, window,
                                               min_ops, weights=weights[lo:hi] if weights is not None else None)))
        lo = hi
    out = np.full((len(index), len(steps)), np.nan)
    for p0, p1, med in parts:
        out[p0:p1] = med.to_numpy()
    return pd.DataFrame(out, index=index, columns=steps)
