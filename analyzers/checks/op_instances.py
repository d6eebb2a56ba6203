"""A round's collective records grouped by op instance (communicator, seq), in numpy: which records make up each
op, which ops every member recorded and completed together, and what the comm check reads off them: the last rank
to arrive at each op (``last_arriver_ops``) and how long each rank waited at each op for a later peer
(``collective_wait_ms``); how far before the other members each member was done is in completion_leads.py.

Used by analyzers/checks/links.py and comm.py. A post-mortem run of 1,024 ranks x 10,000 steps has 20 million
collective records: nothing here runs Python or builds a string per record, integers per record are 32 bits where
they fit, and the instances built for a round are released when the comm check is done (``release_op_instances``).
"""

from __future__ import annotations

import weakref

import numpy as np
import pandas as pd

from analyzers.matrices import distinct_codes
from analyzers.collectives import member_counts

SYMMETRIC_OPS = {"all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall", "barrier",
                 "all_gather_into_tensor", "reduce_scatter_tensor"}
P2P_OPS = {"send", "recv"}

class _OpInstances:
    """The completed collectives of ``co`` from ``first_step`` on, grouped by op instance (communicator, seq), with
    numpy: the rows (positions in ``co``), the communicator of each (``gcode``: its gkey's place in sorted order, as
    groupby orders them), the instance of each (numbered in (gkey, seq) order), and per instance its record count,
    member count, spread of completion times and longest duration. ``kind``: "symmetric" (the ``SYMMETRIC_OPS``,
    with a duration) or "not_p2p" (every op but a p2p send/recv, with or without a duration).

    Per-record arrays are only what the callers read, and per-instance figures stay per instance (an instance holds
    8 to 32 records of a generated job): at 1,024 ranks x 10,000 steps there are 20 million records, and each
    per-record float64 array is 160 MB. (pandas groupby-transform over them, and a boolean mask of a frame with
    Arrow string columns, cost tens of seconds a round at 4,096 ranks.)"""

    def __init__(self, co: pd.DataFrame, first_step: int | None, kind: str = "symmetric"):
        t_done = float_values(co["t_done"])
        # the ops, factorized in bulk (an Arrow string column converted to Python strings costs seconds)
        op_col = co["op"]
        if isinstance(op_col.dtype, pd.CategoricalDtype):  # its own codes (-1: missing), not a recode of every row
            op_code, op_uniq = op_col.cat.codes.to_numpy(), np.asarray(op_col.cat.categories, dtype=object)
        else:
            op_code, op_uniq = pd.factorize(op_col)
        self.kind = kind
        self.keep = None  # a mask of the records these instances are made of (None: all; ``symmetric_from``)
        # durations in the column's own float width (the store reads them as float32): a float64 copy of 20 M
        # records is 160 MB, and a max or a NaN test gives the same in either width (``CompletionLeads.frame``
        # hands them out as float64)
        dur_col = co["duration_ms"]
        dur_all = dur_col.to_numpy() if isinstance(dur_col.dtype, np.dtype) and dur_col.dtype.kind == "f" \
            else dur_col.to_numpy(dtype=float, na_value=np.nan)
        symmetric = np.r_[np.array([str(o).lower() in SYMMETRIC_OPS for o in op_uniq], dtype=bool), False]  # -1: none
        if kind == "symmetric":
            keep = ~np.isnan(t_done) & ~np.isnan(dur_all) & symmetric[op_code]
        else:  # every op but p2p (a missing op name included, as ``~isin`` keeps it)
            wanted = np.r_[np.array([o not in P2P_OPS for o in op_uniq], dtype=bool), True]  # the last: code -1
            keep = ~np.isnan(t_done) & wanted[op_code]
        step = co["step"].to_numpy()
        if first_step is not None:
            keep &= step >= first_step
        # the communicators, numbered in sorted order over the whole column (an Arrow string or categorical column
        # factorizes in bulk; a code no kept row has is never used)
        codes, uniq = _factorize_sorted(co["gkey"])
        keep &= codes >= 0
        every = bool(keep.all())
        self.rows = EveryRow(len(keep)) if every else _narrow(np.flatnonzero(keep))
        # every record kept (one kind of op, all of it timed): the columns' arrays as they are, not copies of them
        # (read only: the frame is shared, analyzers/builder.py)
        pick = (lambda a: a) if len(self.rows) == len(co) else (lambda a: a[self.rows])  # noqa: E731
        del keep
        self.gcode, self.gkeys = pick(codes).astype(np.int32, copy=False), np.asarray(uniq, dtype=object)
        del codes
        self.seq = _narrow(pick(co["seq"].to_numpy()))
        self.rank = _narrow(pick(co["rank"].to_numpy()))
        self.step = _narrow(pick(step))
        self.t_done = pick(t_done)
        del t_done
        self.dur = pick(dur_all)
        del dur_all
        # a symmetric op (not_p2p: to derive the symmetric instances from these, ``symmetric_from``)
        self.symmetric = symmetric[pick(op_code)] if kind != "symmetric" else None
        del op_code
        self.t_arrive = pick(float_values(co["t_arrive"]))
        self.weight = _op_weights(co, self.rows)  # ops per record (a node agent's fold: its ops' mean)
        n = len(self.rows)
        # each communicator's member count: its records all carry the same members (gkey names them)
        first_of_key = first_positions(self.gcode, len(self.gkeys))  # each communicator's first kept record
        key_codes = np.flatnonzero(first_of_key < n)
        size_of_key = np.zeros(len(self.gkeys), np.int64)  # by gcode (codes of keys no kept row has stay 0)
        if n:
            size_of_key[key_codes] = member_counts(co["group_ranks"].iloc[self.rows[first_of_key[key_codes]]]).to_numpy()
        # op instances: (communicator, seq), numbered in (gkey, seq) order: hashed (pd.factorize), then only the
        # distinct instances sorted (np.unique sorted every record)
        self.inst, m, inst_gcode = _instances(self.gcode, self.seq)
        self.n_inst = m
        # per instance: its communicator, record count, member count, spread of completion times, longest duration
        if inst_gcode is None:
            inst_gcode = np.zeros(m, np.int64)
            inst_gcode[self.inst] = self.gcode
        self.inst_size = size_of_key[inst_gcode]
        self._instance_figures()

    def symmetric_from(self, first_step: int | None) -> "_OpInstances":
        """The symmetric instances from ``first_step`` on, derived from these ("not_p2p" ones from every step): what
        ``_OpInstances(co, first_step, "symmetric")`` gives to its callers (``complete`` and the per-record arrays
        at its positions), without factorizing the columns again and without a copy of any per-record array. The
        records stay these; those of other ops, without a duration or before ``first_step`` are masked out
        (``keep``), and the figures of an instance that loses a record are recomputed from the ones it keeps (an
        instance that keeps them all has these figures). Instances keep their numbers ((gkey, seq) order)."""
        keep = self.symmetric & ~np.isnan(self.dur)
        if self.keep is not None:
            keep &= self.keep
        if first_step is not None:
            keep &= self.step >= first_step
        new = object.__new__(_OpInstances)
        new.__dict__.update(self.__dict__)
        # each instance's count less its records left out (few: the first step's, other ops'), not a count of
        # every record kept
        drop = np.flatnonzero(~keep if self.keep is None else self.keep & ~keep)
        new.kind, new.symmetric, new.keep = "symmetric", None, keep if len(drop) else self.keep
        count = self.inst_count - np.bincount(self.inst[drop], minlength=self.n_inst) if len(drop) else self.inst_count
        partial = count != self.inst_count
        new.inst_count = count
        new.inst_spread_ms, new.inst_dur_max = self.inst_spread_ms.copy(), self.inst_dur_max.copy()
        if partial.any():
            recs = np.flatnonzero(keep & partial[self.inst])
            new._instance_figures(recs, np.flatnonzero(partial))
        return new

    def _instance_figures(self, recs: np.ndarray | None = None, insts: np.ndarray | None = None) -> None:
        """Per instance: record count, spread of completion times, longest duration. ``recs``, ``insts``: those of
        the instances ``insts`` only, from the records at ``recs`` (``symmetric_from``)."""
        m = self.n_inst
        inst = self.inst if recs is None else self.inst[recs]
        t_done = self.t_done if recs is None else self.t_done[recs]
        dur = self.dur if recs is None else self.dur[recs]
        if recs is None:
            self.inst_count = counts(inst, m)
        tmax = np.full(m, -np.inf)
        tmin = np.full(m, np.inf)
        np.maximum.at(tmax, inst, t_done)
        np.minimum.at(tmin, inst, t_done)
        # in the durations' own width (the store reads them as float32): ufunc.at converting each value to a wider
        # accumulator takes a slow generic loop, ten times the time; the max of float32 values widened after is the
        # max of them widened before
        dmax = np.full(m, -np.inf, dtype=dur.dtype if dur.dtype.kind == "f" else np.float64)
        with np.errstate(invalid="ignore"):  # NaN where a record has none (not_p2p; only symmetric ones read it)
            np.maximum.at(dmax, inst, dur)
        dmax = dmax.astype(np.float64, copy=False)
        if recs is None:
            self.inst_spread_ms, self.inst_dur_max = (tmax - tmin) * 1000.0, dmax
        else:
            self.inst_spread_ms[insts] = (tmax[insts] - tmin[insts]) * 1000.0
            self.inst_dur_max[insts] = dmax[insts]

    @property
    def size(self) -> np.ndarray:
        """Each record's member count."""
        return self.inst_size[self.inst]

    def complete(self, tol_ms: float, longest: bool = False) -> np.ndarray:
        """Positions (into the instance arrays) of the records of instances every member recorded, done within
        ``tol_ms`` of each other (with ``longest``: within the longer of ``tol_ms`` and the instance's longest
        duration)."""
        return np.flatnonzero(self.complete_mask(tol_ms, longest))

    def complete_mask(self, tol_ms: float, longest: bool = False) -> np.ndarray:
        """``complete`` as a mask over the records."""
        ok = self.complete_instances(tol_ms, longest)
        return ok[self.inst] & self.keep if self.keep is not None else ok[self.inst]

    def complete_instances(self, tol_ms: float, longest: bool = False) -> np.ndarray:
        """``complete`` as a mask over the instances (each has a record: its count is its member count, 2 or more)."""
        tol = np.maximum(tol_ms, self.inst_dur_max) if longest else tol_ms
        return (self.inst_count == self.inst_size) & (self.inst_size >= 2) & (self.inst_spread_ms <= tol)


class EveryRow:
    """The positions of every record of a frame of ``n``, what ``np.arange(n)`` holds, without the array (80 MB at
    20 M records): indexing it gives the arange's values (in its width: int32 where n fits), ``searchsorted`` its
    places; anything else converts it (``__array__``)."""

    def __init__(self, n: int):
        self.n = n
        self.dtype = np.dtype(np.int32 if n < 2**31 else np.int64)

    def __len__(self) -> int:
        return self.n

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.arange(self.n, dtype=dtype or self.dtype)

    def __getitem__(self, at):
        if isinstance(at, slice):
            return np.arange(*at.indices(self.n), dtype=self.dtype)
        at = np.asarray(at)
        if at.dtype == bool:
            if at.shape != (self.n,):
                raise IndexError(f"boolean index of shape {at.shape} for {self.n} rows")
            return np.flatnonzero(at).astype(self.dtype)
        if at.size and (int(at.min()) < -self.n or int(at.max()) >= self.n):
            raise IndexError(f"index out of bounds for {self.n} rows")
        at = at.astype(self.dtype) if at.ndim else self.dtype.type(at)
        return np.where(at < 0, at + self.dtype.type(self.n), at) if at.size and (at < 0).any() else at

    def searchsorted(self, v, side: str = "left") -> np.ndarray:
        """``np.arange(n).searchsorted(v, side)`` of integers ``v``."""
        v = np.asarray(v)
        return np.clip(v + (1 if side == "right" else 0), 0, self.n).astype(np.intp)


def float_values(col: pd.Series) -> np.ndarray:
    """A column's values as float64 with NaN for a missing one: a float64 numpy column's own array (read only, as every
    array of the op instances is; a copy of 20 M records is 160 MB), else converted."""
    if isinstance(col.dtype, np.dtype) and col.dtype == np.float64:
        return col.to_numpy()
    return col.to_numpy(dtype=float, na_value=np.nan)


RECORD_CHUNK = 1 << 22  # per-record temporaries (counts, the last arrivers' latest arrivals): this many records at a time


def counts(codes: np.ndarray, n_codes: int) -> np.ndarray:
    """``np.bincount(codes, minlength=n_codes)`` (codes 0 .. n_codes - 1), a chunk of records at a time: bincount
    converts 32-bit codes to 64-bit ones first, a temporary of the chunk's size (of 20 M records: 160 MB)."""
    if len(codes) <= RECORD_CHUNK:
        return np.bincount(codes, minlength=n_codes)
    out = np.zeros(n_codes, np.int64)
    for lo in range(0, len(codes), RECORD_CHUNK):
        out += np.bincount(codes[lo:lo + RECORD_CHUNK], minlength=n_codes)
    return out


FIRST_CHUNK = 1 << 20  # first_positions looks at this many records at a time


def first_positions(codes: np.ndarray, n_codes: int) -> np.ndarray:
    """Each code's first position in ``codes`` (``len(codes)`` for a code that does not occur), without a sort: a
    chunk of records at a time, until every code has been seen (a run's communicators all appear in its first
    steps: one chunk of 20 M records, not a scatter of all of them)."""
    n = len(codes)
    first = np.full(n_codes, n, np.int64)
    for lo in range(0, n, FIRST_CHUNK):
        hi = min(n, lo + FIRST_CHUNK)
        np.minimum.at(first, codes[lo:hi], np.arange(lo, hi, dtype=np.int64))
        if bool((first < n).all()):
            break
    return first


def _factorize_sorted(col: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """``pd.factorize(col, sort=True)``: codes numbering the values present in sorted order, and those values. A
    categorical column (the store's ``gkey``) sorts by its categories' order: its codes are mapped to the count of
    categories present before theirs (a bincount; pandas recodes every row, a quarter second per 6 M)."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        codes, uniq = pd.factorize(col, sort=True)
        return codes, np.asarray(uniq, dtype=object)
    cat_codes = col.cat.codes.to_numpy()
    cats = col.cat.categories
    # the categories present: marked in a table (a bincount converts every code to a 64-bit integer first); a
    # missing value's code (-1) marks the extra last slot
    present = np.zeros(len(cats) + 1, dtype=bool)
    present[cat_codes] = True
    present = present[:-1]
    if present.all():  # every category present: the codes are the numbers (no gather)
        return cat_codes.astype(np.int32 if len(cats) < 2**31 else np.int64), np.asarray(cats, dtype=object)
    number = np.full(len(cats) + 1, -1, dtype=np.int32 if len(cats) < 2**31 else np.int64)  # the last: code -1
    number[:-1][present] = np.arange(int(present.sum()))
    return number[cat_codes], np.asarray(cats[present], dtype=object)


def _instance_numbers(gcode: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, int]:
    """Each record's op instance (communicator, seq), numbered in (gkey, seq) order, and the number of instances.
    Where the (communicator, seq) span is not much wider than the records (sequence numbers count a communicator's
    ops), each present key is marked in a table over the span and numbered by a running count (no hash, no sort);
    else the keys are hashed (pd.factorize) and only the distinct ones sorted."""
    inst, m, _ = _instances(gcode, seq)
    return inst, m


def _instances(gcode: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, int, np.ndarray | None]:
    """``_instance_numbers``, and each instance's communicator (its gcode) where the table numbered them: read off
    the present keys (an instance's key is its communicator x the span + its seq), not scattered from every record;
    None where the keys were hashed."""
    n = len(gcode)
    if n and seq.dtype.kind not in "iu":
        seq = seq - seq.min()  # (as the keys were before: a float column's values as they are)
    s_lo = int(seq.min()) if n else 0
    s_span = int(seq.max()) - s_lo + 1 if n else 1
    width = np.int32 if n < 2**31 else np.int64
    span = (int(gcode.max()) + 1 if n else 1) * s_span
    if span <= 2 * n + 1024 and seq.dtype.kind in "iu":
        key = gcode.astype(np.int64 if span >= 2**31 else np.int32)
        key *= s_span
        key += seq
        key -= s_lo
        present = np.zeros(span, dtype=bool)
        present[key] = True
        if bool(present.all()):  # every key of the span present (each communicator's sequence numbers without a
            # gap): a key is its own number
            return key.astype(width, copy=False), span, np.arange(span, dtype=np.int64) // s_span
        number = np.cumsum(present, dtype=np.int64 if span >= 2**31 else np.int32)
        m = int(number[-1]) if span else 0
        number -= 1
        inst = number[key]
        return inst.astype(width, copy=False), m, np.flatnonzero(present).astype(np.int64) // s_span
    key = gcode.astype(np.int64) * s_span + (seq - s_lo)
    code, uniq_key = pd.factorize(key)
    order = np.argsort(uniq_key, kind="stable")
    rank_of = np.empty(len(uniq_key), width)
    rank_of[order] = np.arange(len(uniq_key))
    return rank_of[code], len(uniq_key), None  # gathered in its final width (no int64 copy of every record)


def _narrow(values: np.ndarray) -> np.ndarray:
    """An int64 array as int32 where its values fit (half the memory per record; the values unchanged)."""
    if values.dtype == np.int64 and len(values) and -2**31 <= values.min() and values.max() < 2**31:
        return values.astype(np.int32)
    return values


def _op_weights(co: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """``op_counts`` of the records at ``rows`` (computed for those rows only)."""
    if "ops" not in co.columns:
        return np.ones(len(rows), np.int32)
    ops = co["ops"].to_numpy()
    ops = ops if len(rows) == len(ops) else ops[rows]  # every record (rows: all of them, in order): no gather
    if ops.dtype.kind in "iu":  # no NaN to fill, nothing to parse: only the clip
        if ops.dtype == np.int32 and (not len(ops) or ops.min() >= 1):
            return ops  # nothing to clip: the column's own int32 array (read only, as every array of these is)
        return np.maximum(ops, 1).astype(np.int32 if len(ops) and ops.max() < 2**31 else np.int64)
    ops = pd.Series(ops)
    return pd.to_numeric(ops, errors="coerce").fillna(1).clip(lower=1).astype(np.int64).to_numpy()


_LAST_OPS: list = []  # [(weakref to co, first_step, kind, _OpInstances)]: the last one built


def op_instances(co: pd.DataFrame, first_step: int | None, kind: str = "symmetric") -> _OpInstances:
    """``_OpInstances(co, first_step, kind)``, built once for a round's collectives (``last_arriver_ops`` and
    ``completion_leads`` both start from it; the frame is shared and never modified, see analyzers/builder.py)."""
    derived = None
    if _LAST_OPS:
        ref, first, k, ops = _LAST_OPS[0]
        if ref() is co and first == first_step and k == kind:
            return ops
        if ref() is co and first is None and k == "not_p2p" and kind == "symmetric":
            derived = ops.symmetric_from(first_step)  # the symmetric ones are a subset of every non-p2p one
    _LAST_OPS.clear()  # the old one's arrays go before the new one's are built
    if derived is None and kind == "symmetric" and first_step is not None:
        # the non-p2p ones of every step, masked: where every record is kept (one kind of op, all of it timed) they
        # are the columns' own arrays, where a first step cuts records off the symmetric ones are copies of them
        derived = _OpInstances(co, None, "not_p2p").symmetric_from(first_step)
    ops = derived if derived is not None else _OpInstances(co, first_step, kind)
    _LAST_OPS[:] = [(weakref.ref(co), first_step, kind, ops)]
    return ops


def release_op_instances() -> None:
    """Drop the cached op instances (a check's end: at 20 million records they hold over a GiB)."""
    _LAST_OPS.clear()


def last_arriver_ops(co: pd.DataFrame, first_step: int | None = None, match_tol_ms: float = 10.0) -> pd.DataFrame:
    """One row per completed collective whose every member recorded it: the last rank to arrive, its duration, the step.

    The last arriver has nobody left to wait for: its duration is the op's own time (transfer), plus any delay of
    its own before its data leaves (a slow link). Records of one (communicator, seq) must complete within
    ``match_tol_ms`` of each other; where a rank records an op its peers do not, sequence numbers drift apart and the
    pairing is wrong, so such ops are dropped. Rows in (gkey, seq) order; of ties, the first record."""
    cols = ["gkey", "seq", "rank", "step", "duration_ms", "group", "group_ranks"]
    if co.empty:
        return pd.DataFrame(columns=cols + ["ops"])
    ops = op_instances(co, first_step)
    has = ops.complete_instances(match_tol_ms)  # the instances with complete records
    if not has.any():
        return pd.DataFrame(columns=cols + ["ops"])
    # per instance, the latest arrival; of equal ones the first record (groupby idxmax): each instance's latest
    # arrival, then the first of its records that has it (a lexsort of every record cost seconds at 20 M records;
    # the latest arrival of each record's instance is gathered a chunk of records at a time, not 160 MB at once).
    # Over every record, those that are not complete records sent to an extra instance past the real ones (no
    # gathers of the complete ones' arrays); where every record of a complete instance is kept (records left out,
    # the first step's, are of other instances), the instances as they are: the others' figures are never read
    m = ops.n_inst
    whole = ops.keep is None or not has[ops.inst[np.flatnonzero(~ops.keep)]].any()
    inst = ops.inst if whole else np.where(ops.complete_mask(match_tol_ms), ops.inst, m)
    t = ops.t_arrive
    n = len(inst)
    latest = np.full(m + 1, -np.inf)
    np.fmax.at(latest, inst, t)  # NaN arrivals left out, as idxmax does
    at_latest = np.concatenate([lo + np.flatnonzero(t[lo:lo + RECORD_CHUNK] == latest[inst[lo:lo + RECORD_CHUNK]])
                                for lo in range(0, len(inst), RECORD_CHUNK)] or [np.zeros(0, np.intp)])
    first = np.full(m + 1, n, np.int64)
    np.minimum.at(first, inst[at_latest], at_latest)
    first = first[:m]
    unknown = has & (first >= n)
    if unknown.any():  # an instance whose every arrival is unknown: its first record
        first_any = np.full(m + 1, n, np.int64)
        np.minimum.at(first_any, inst, np.arange(n))
        first = np.where(unknown, first_any[:m], first)
    pick = first[has]  # by instance: (gkey, seq) order
    rows = ops.rows[pick]
    out = co.iloc[rows, [co.columns.get_loc(c) for c in cols]].reset_index(drop=True)
    # gcode: the communicator's place in gkey order; row: the record's position in ``co`` (an integer key for joins)
    return out.assign(ops=ops.weight[pick], gcode=ops.gcode[pick], row=rows)


def collective_wait_ms(co: pd.DataFrame, match_tol_ms: float = 10.0) -> pd.DataFrame:
    """Per rank and step, the time spent in collectives waiting for a peer that arrived later (ms): for each op all
    members recorded (and completed within ``match_tol_ms`` of each other), last member's arrival - own arrival.
    Covers every collective, not only the gradient sync (FSDP all-gathers, TP all-reduces). ``co``: the run's
    collective records."""
    if co.empty:
        return pd.DataFrame()
    # p2p sends complete locally (their t_done says nothing about the peer): collectives only; grouped by op
    # instance in numpy (op_instances), summed into a rank x step grid (a groupby-transform per column and a
    # pivot_table over every record cost seconds and several copies of the records at 1,024 ranks x 10,000 steps)
    return _wait_grid(op_instances(co, None, kind="not_p2p"), match_tol_ms)


def collective_wait_ms_of(co: pd.DataFrame, ranks, match_tol_ms: float = 10.0) -> pd.DataFrame:
    """``collective_wait_ms``'s rows of ``ranks`` only, from the records of the ops those ranks took part in (each
    op whole: its other members' records too). The comm check asks it about a few ranks. The op instances are the
    round's own (``op_instances``: built once, and the comm check's completion leads derive theirs from them); the
    grid is summed over those ranks' records of those ops only. The same sums (the same records, added in the same
    order); the columns: the steps those ranks' records have (a missing column reads as no wait)."""
    if co.empty or not len(ranks):
        return pd.DataFrame()
    wanted = np.asarray(sorted({int(r) for r in ranks}), dtype=np.int64)
    ops = op_instances(co, None, kind="not_p2p")
    mine = np.isin(ops.rank, wanted)
    if not mine.any():
        return pd.DataFrame()
    theirs = np.zeros(ops.n_inst, dtype=bool)  # the instances with a record of theirs
    theirs[ops.inst[mine]] = True
    grid = _wait_grid(ops, match_tol_ms, theirs, wanted)
    return grid.loc[grid.index.intersection(wanted)] if not grid.empty else grid


def _wait_grid(ops: "_OpInstances", match_tol_ms: float, instances: np.ndarray | None = None,
               ranks: np.ndarray | None = None) -> pd.DataFrame:
    """``collective_wait_ms`` of the records of ``ops`` (of the ``instances`` marked, a mask over them); with
    ``ranks``, the rows of those ranks only, over the steps their records have: each op's latest arrival is that of
    all its members, and a cell's sum is that of the same records in the same order (no grid of every rank's and
    step's cells, 160 MB at 1,024 x 10,000, for a few rows of it)."""
    if instances is None:
        ok = ops.complete(match_tol_ms)
    else:
        ok = np.flatnonzero((ops.complete_instances(match_tol_ms) & instances)[ops.inst]
                            & (ops.keep if ops.keep is not None else True))
    if not len(ok):
        return pd.DataFrame()
    # every record complete (the common case): the arrays as they are, no gathers
    take = (lambda a: a) if len(ok) == len(ops.rows) else (lambda a: a[ok])  # noqa: E731
    inst = take(ops.inst)
    t = take(ops.t_arrive)
    latest = np.full(ops.n_inst, np.nan)
    np.fmax.at(latest, inst, t)  # NaN arrivals left out (groupby max); NaN where an instance has none
    # a folded record's times are its ops' means: its wait counts once per op it stands for; (latest - t) x 1000 x
    # ops, in place (each temporary of 20 M records is 160 MB)
    late = latest[inst]
    del latest
    late -= t
    late *= 1000.0
    late *= take(ops.weight)
    np.nan_to_num(late, copy=False, nan=0.0)  # sums as pivot_table's: NaN values left out (0 where a cell has only those)
    rank, step = take(ops.rank), take(ops.step)
    if ranks is not None:
        theirs = np.isin(rank, ranks)
        if not theirs.any():
            return pd.DataFrame()
        rank, step, late = rank[theirs], step[theirs], late[theirs]
    r_lo, r_hi, s_lo, s_hi = int(rank.min()), int(rank.max()), int(step.min()), int(step.max())
    n_r, n_s = r_hi - r_lo + 1, s_hi - s_lo + 1
    if n_r * n_s <= 4 * len(rank) + 1024:
        # a grid over the span of ranks and steps, then only the ranks and steps with a record (distinct_codes'
        # codes without its two passes and int64 copies of every record)
        cell = rank.astype(np.int64)
        cell -= r_lo
        cell *= n_s
        cell += step
        cell -= s_lo
        sums = np.bincount(cell, weights=late, minlength=n_r * n_s).reshape(n_r, n_s)
        counts = np.bincount(cell, minlength=n_r * n_s).reshape(n_r, n_s)
        del cell, late
        has_r, has_s = counts.any(axis=1), counts.any(axis=0)
        sums, counts = sums[has_r][:, has_s], counts[has_r][:, has_s]
        ranks = np.flatnonzero(has_r).astype(np.int64) + r_lo
        steps = np.flatnonzero(has_s).astype(np.int64) + s_lo
        sums[counts == 0] = np.nan  # NaN where a cell has no record
    else:
        ranks, rank_code = distinct_codes(rank)
        steps, step_code = distinct_codes(step)
        ranks, steps = ranks.astype(np.int64), steps.astype(np.int64)  # the index as pivot_table's (records: int32)
        cell = rank_code.astype(np.int64) * len(steps) + step_code
        sums = np.bincount(cell, weights=late, minlength=len(ranks) * len(steps))
        sums[np.bincount(cell, minlength=len(ranks) * len(steps)) == 0] = np.nan
        sums = sums.reshape(len(ranks), len(steps))
    return pd.DataFrame(sums, index=pd.Index(ranks, name="rank"), columns=pd.Index(steps, name="step"))
