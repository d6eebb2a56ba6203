"""How far before the other members of its op each collective record's rank was done (``completion_leads``,
``CompletionLeads``: worked out for the records a signature reads), from a round's op instances
(analyzers/checks/op_instances.py). The early-finisher and wait-deficit signatures of a slow link read them: peers
done after a rank waited for its data. ``window_can_fill``: whether the records could fill the early-finisher
signature's window at all (a bound that spares working out the leads where they cannot).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzers.checks.op_instances import op_instances
from analyzers.collectives import stable_order


LEAD_COLUMNS = ["gkey", "seq", "rank", "step", "lead_ms", "duration_ms"]


def completion_leads(co: pd.DataFrame, first_step: int | None = None, match_tol_ms: float = 10.0) -> pd.DataFrame:
    """One row per member of every completed symmetric collective that all its members recorded: ``lead_ms``, how
    long before the median of the other members it was done (negative: after them), and its ``duration_ms``.

    The members of one op are all done within the longest member's duration of each other (nobody is done before
    the last one arrived); records of one (communicator, seq) further apart than that (and ``match_tol_ms``) are
    not one op (a rank recorded an op its peers did not, and the sequence numbers drifted apart): dropped. Across
    nodes the completion times are compared on the nodes' clocks, as every arrival time is.

    Rows by communicator (gkey order), records in their order within one; ``gcode``: the communicator's place in
    that order, ``row``: the record's position in ``co`` (integer keys for joins). ``CompletionLeads``: the same
    figures for the records a caller reads."""
    leads = CompletionLeads(co, first_step, match_tol_ms)
    if leads.empty:
        return pd.DataFrame(columns=LEAD_COLUMNS + ["gcode"])
    pos = leads.positions()
    return leads.frame(pos[stable_order(leads.gcode[pos])])  # by communicator, records in their order (radix passes)


class CompletionLeads:
    """``completion_leads``' figures, worked out for the records a caller reads when it reads them. A record's lead
    needs the completion times of every member of its op (a sort of each op's members), and the comm check reads
    the leads of a few ranks, of the last arrivers, and of the (rank, communicator) pairs with enough ops in a
    window: at 20 M records the whole frame cost seconds and a GiB, mostly never read.

    A position (``sel``) indexes the records of the op instances (in the order of ``co``); ``complete`` marks those
    of ops every member recorded and completed together, the only ones with a lead. The per-record arrays (``rank``,
    ``gcode``, ``step``, ``weight``) are the instances' own, over every record (a gather of the complete ones would
    be 80 MB each at 20 M records)."""

    _COLUMNS = ("rows", "gcode", "seq", "rank", "step", "t_done", "dur", "weight", "inst")

    def __init__(self, co: pd.DataFrame, first_step: int | None = None, match_tol_ms: float = 10.0):
        ops = op_instances(co, first_step) if not co.empty else None
        self.complete = ops.complete_mask(match_tol_ms, longest=True) if ops is not None else np.zeros(0, bool)
        self.n_complete = int(self.complete.sum())
        self.gkeys = ops.gkeys if ops is not None else np.asarray([], dtype=object)
        # the instances' arrays these read (not the arrival times): they outlive ``release_op_instances``
        self._arrays = {k: getattr(ops, k) for k in self._COLUMNS} if ops is not None else {}
        self._inst_size = ops.inst_size if ops is not None else np.zeros(0, np.int64)
        self._n_inst = ops.n_inst if ops is not None else 0
        self._ranks = None
        self._lead = None  # every record's lead, once most of them were asked for (``lead_ms``)

    @property
    def empty(self) -> bool:
        return self.n_complete == 0

    rank = property(lambda self: self._arrays["rank"])
    gcode = property(lambda self: self._arrays["gcode"])
    step = property(lambda self: self._arrays["step"])
    weight = property(lambda self: self._arrays["weight"])

    def positions(self) -> np.ndarray:
        """The positions of every complete record."""
        return np.flatnonzero(self.complete)

    def lead_ms(self, sel: np.ndarray) -> np.ndarray:
        """The leads of the (complete) records at ``sel``, from the completion times of their ops' members. Asked
        about the ops of most records (ops many per step: the self-delay and early-finisher signatures read most of
        them, each), every record's lead is worked out once and kept (a float per record); else those ops' only."""
        sel = np.asarray(sel, dtype=np.int64)
        if self._lead is not None:
            return self._lead[sel]
        inst = self._arrays["inst"]
        want = np.zeros(self._n_inst, dtype=bool)
        want[inst[sel]] = True
        sub = np.flatnonzero(want[inst] & self.complete)  # every member record of those ops
        if 4 * len(sub) >= self.n_complete:
            sub = self.positions()
            self._lead = np.full(len(inst), np.nan)
            self._lead[sub] = _leads_ms(inst[sub], self._arrays["t_done"][sub], self._inst_size)
            return self._lead[sel]
        lead = _leads_ms(inst[sub], self._arrays["t_done"][sub], self._inst_size)
        return lead[np.searchsorted(sub, sel)]

    def frame(self, sel: np.ndarray) -> pd.DataFrame:
        """``completion_leads``' columns for the complete records at ``sel``, in that order."""
        a = self._arrays
        gcode = a["gcode"][sel]
        # gkey as a categorical over the communicators (an Arrow string or object column of millions of rows costs
        # seconds to build and to mask, and a pointer per row); copy=False: the arrays become the columns as they are
        return pd.DataFrame({"gkey": pd.Categorical.from_codes(gcode, categories=pd.Index(self.gkeys, dtype=object)),
                             "seq": a["seq"][sel], "rank": a["rank"][sel], "step": a["step"][sel],
                             "lead_ms": self.lead_ms(sel), "duration_ms": a["dur"][sel].astype(np.float64),
                             "gcode": gcode, "ops": a["weight"][sel], "row": a["rows"][sel]}, copy=False)

    def of_rank(self, r: int) -> pd.DataFrame:
        """The frame of rank ``r``'s complete records, in their order."""
        if self._ranks is None:
            pos = self.positions()
            self._ranks = (pos, RankPositions(self.rank[pos]))
        pos, by_rank = self._ranks
        return self.frame(pos[by_rank.of(r)])

    def at_rows(self, rows: np.ndarray) -> np.ndarray:
        """The lead of the record at each position ``rows`` of ``co``; NaN for one that is not a complete record."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.full(len(rows), np.nan)
        if self.empty or not len(rows):
            return out
        all_rows = self._arrays["rows"]  # sorted: the kept records' positions in co
        p = np.minimum(all_rows.searchsorted(rows), len(all_rows) - 1)
        found = (all_rows[p] == rows) & self.complete[p]
        out[found] = self.lead_ms(p[found])
        return out


LEAD_BLOCK_CELLS = 1 << 20  # _leads_ms: the members' times of this many records at a time


def _leads_ms(inst: np.ndarray, done: np.ndarray, inst_size: np.ndarray) -> np.ndarray:
    """For each record (of instances every member recorded, all of whose records are given): the median completion
    time of the other members of its op minus its own, in ms. ``stats.group_loo_median``'s arithmetic, on a dense
    instance x member matrix per member count (a complete instance has exactly its member count of records): one
    short sort per instance instead of a lexsort of every record."""
    size = inst_size[inst]
    out = np.empty(len(inst))
    for s in np.unique(size):
        sel = np.flatnonzero(size == s)
        # each instance's records together (their order within it does not matter: each row is sorted next)
        at = sel[np.argsort(inst[sel], kind="quicksort")]
        del sel
        # a block of instances at a time: the sorted rows and the medians' temporaries stay a block's (each is the
        # size of every record's times otherwise: 160 MB at 20 M records); each row's medians are its own
        rows = max(1, LEAD_BLOCK_CELLS // int(s))
        for r0 in range(0, len(at) // int(s), rows):
            block = at[r0 * int(s):(r0 + rows) * int(s)]
            mat = done[block].reshape(-1, int(s))
            out[block] = ((_row_loo_median(mat) - mat) * 1000.0).ravel()
    return out


def _row_loo_median(mat: np.ndarray) -> np.ndarray:
    """Each cell's leave-one-out median over its row (no NaN; rows of 2 or more): the sorted row's middle one or
    two of the other values, (low + high) / 2 as np.median gives. Which of them those are depends only on where the
    removed value sits against the middle (removing either of two equal values leaves the same values): at or below
    the low middle, between the two middles, or above the high one; so a row has three medians, and each cell takes
    one by comparing its value with the row's middle values (no argsort of the rows, no scatter of places)."""
    s = mat.shape[1]
    srt = np.sort(mat, axis=1)
    m = s - 1  # values left
    lo, hi = (m - 1) // 2, m // 2
    below = (srt[:, lo + 1] + srt[:, hi + 1]) / 2.0  # the removed value at or below the low middle
    between = (srt[:, lo] + srt[:, hi + 1]) / 2.0
    above = (srt[:, lo] + srt[:, hi]) / 2.0
    return np.where(mat <= srt[:, lo:lo + 1], below[:, None],
                    np.where(mat <= srt[:, hi:hi + 1], between[:, None], above[:, None]))


class RankPositions:
    """Positions of the records of each rank: by a mask for the first few ranks asked, then grouped once (one
    stable radix sort), not a pass over every record per lookup (20 M at 1,024 ranks x 10,000 steps). A rank's
    positions in their order."""

    FEW = 16  # ranks looked up with a mask each (one pass over the rows) before the rows are sorted by rank

    def __init__(self, rank: np.ndarray):
        self.rank = rank
        self.seen: dict[int, np.ndarray] = {}
        self.order = self.sorted_rank = None

    def of(self, r: int) -> np.ndarray:
        if r in self.seen:
            return self.seen[r]
        if len(self.seen) < self.FEW:
            self.seen[r] = np.flatnonzero(self.rank == r)
            return self.seen[r]
        if self.order is None:
            rank = self.rank
            self.order = stable_order(rank.astype(np.int64) - int(rank.min())) if len(rank) else np.zeros(0, np.int64)
            self.sorted_rank = rank[self.order]
        lo, hi = np.searchsorted(self.sorted_rank, [r, r + 1])
        return self.order[lo:hi]


def window_can_fill(leads: CompletionLeads, window: int, min_ops: float, chunk: int = 1 << 22,
                    cheaper_only: bool = True) -> bool:
    """Can any (rank, communicator) have ``min_ops`` complete ops (their weight, where records stand for several) in
    ``window`` steps? False only where a bound rules it out, cheaper than pairing every record with its rank and
    communicator: a pair's records in one step are at most those of its (rank, step) cell, and one where no cell
    holds two records of one communicator; each weighs at most the heaviest record. With one op per communicator
    and step (the generated scale stores) no 3-step window holds 4, and ``early_finishers`` has nothing to judge.
    Two records of one communicator in a cell of two are told apart by their codes' sum (a + b = 2a only if b = a);
    a cell of three or more is not looked into (the bound is then its record count). Records in (step, rank) order
    (``most_in_cell_in_order``): the same bound from neighbouring records, always. Otherwise worked out only where
    the ranks x communicators table the pairing needs is larger than the ranks x steps one this needs (16,384 ranks
    in 2,080 communicators), unless ``cheaper_only`` is False; else True."""
    complete = leads.complete
    rank, step, gcode = leads.rank, leads.step, leads.gcode
    if not len(rank) or step.dtype.kind not in "iu" or rank.dtype.kind not in "iu":
        return True
    weights = leads.weight
    heaviest = max(float(np.nanmax(weights)) if len(weights) else 1.0, 1.0)
    every = bool(complete.all())
    if every:
        most = most_in_cell_in_order(rank, step, gcode)
    else:  # the complete records; where they are one stretch (the first step's left out), a slice of each array
        lo = int(np.argmax(complete))
        hi = len(complete) - int(np.argmax(complete[::-1]))
        at = slice(lo, hi) if bool(complete[lo:hi].all()) else complete
        most = most_in_cell_in_order(rank[at], step[at], gcode[at])
    if most is not None:  # records in (step, rank) order: the bound from neighbours, one pass
        return most * heaviest * max(int(window), 1) >= max(min_ops, 1)
    r0, s0 = int(rank.min()), int(step.min())
    n_s = int(step.max()) - s0 + 1
    n_cells = (int(rank.max()) - r0 + 1) * n_s
    if n_cells > 4 * len(rank) + 1024 or len(leads.gkeys) >= 2**26:
        return True
    if cheaper_only and (int(rank.max()) - r0 + 1) * len(leads.gkeys) <= n_cells:
        return True  # pairing the records (a table over ranks x communicators) costs no more than this bound
    wide = np.int64 if n_cells >= 2**31 else np.int32

    def cells(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The (rank, step) cells of the complete records in [lo, hi), and where those records are."""
        at = slice(lo, hi) if every else lo + np.flatnonzero(complete[lo:hi])
        cell = rank[at].astype(wide)
        cell -= r0
        cell *= n_s
        cell += step[at]
        cell -= s0
        return cell, at

    count = np.zeros(n_cells, np.int64)
    total = np.zeros(n_cells)  # the communicators' codes summed per cell
    for lo in range(0, len(rank), chunk):  # a chunk of records at a time: no per-record temporaries of them all
        cell, at = cells(lo, lo + chunk)
        count += np.bincount(cell, minlength=n_cells)
        total += np.bincount(cell, weights=gcode[at], minlength=n_cells)
    most = int(count.max()) if n_cells else 0
    if most == 2:
        same = False
        for lo in range(0, len(rank), chunk):
            cell, at = cells(lo, lo + chunk)
            same = same or bool(((count[cell] == 2) & (2.0 * gcode[at] == total[cell])).any())
        most = 2 if same else 1
    return most * heaviest * max(int(window), 1) >= max(min_ops, 1)


def most_in_cell_in_order(rank: np.ndarray, step: np.ndarray, gcode: np.ndarray) -> int | None:
    """For records in (step, rank) order (a store compacted in key order holds them so): an upper bound on the records
    one (rank, communicator) has in one step, from neighbouring records only (a (rank, step) cell's records are
    adjacent): 1 where no cell holds two records of one communicator, 2 where a cell of two does, and a cell's
    length where one holds three or more. None where the records are not in that order (``window_can_fill`` then
    counts the cells)."""
    n = len(rank)
    if n < 2:
        return n
    same_step = step[1:] == step[:-1]
    if not bool((same_step | (step[1:] > step[:-1])).all()):
        return None
    same_rank = rank[1:] == rank[:-1]
    if not bool((~same_step | same_rank | (rank[1:] > rank[:-1])).all()):
        return None
    same_rank &= same_step  # record i + 1 is in record i's cell
    if not bool(same_rank.any()):
        return 1
    if not bool((same_rank[1:] & same_rank[:-1]).any()):  # no cell of three: cells of two, told apart by neighbours
        same_rank &= gcode[1:] == gcode[:-1]
        return 2 if bool(same_rank.any()) else 1
    at = np.flatnonzero(same_rank)
    breaks = np.flatnonzero(np.diff(at) != 1)
    return int(np.diff(np.r_[-1, breaks, len(at) - 1]).max()) + 1  # records in the longest cell
