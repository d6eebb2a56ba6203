"""Dedupe indexes: "was this natural key seen before?" for every row of a run's table.

Exactly-once needs that answer for every row. A set of key tuples answers it but grows with
every row for the life of the head. Step keys are not random: each (rank, attempt) writes its
steps in order, so the steps seen form one contiguous range almost always. ``SeqIndex`` keeps,
per group (rank, attempt), that range [lo, hi] (with a stride: a node agent's folded collective records are their
first ops' sequence numbers, a step's ops apart) in sorted numpy arrays, plus a short list of
extra intervals for the rare group that had a gap (a spool line lost to garbage, a step number
skipped) or got steps below its range. Memory is bounded by groups and gaps, not rows (four
numbers per (rank, attempt)), and the check is vectorized: a whole flush of rows is sorted by
(group, step), looked up with one searchsorted, and the common case (every new step is hi+1,
hi+2, ... of its group) extends ``hi`` without any Python per row. Anything irregular takes a
per-group Python path that merges intervals exactly; nothing is ever approximated.

Collectives are ordered the same way (``CollectiveIndex``: per rank, attempt and group, their sequence numbers).
GPU samples, the fleet-rate table (a sample per GPU per second), are ordered by time per GPU: ``GpuIndex`` keeps
per (node, gpu) the newest sample time seen and the exact keys of the last ``GPU_HORIZON_S`` seconds below it.
Other tables (lower volume, keys without such an order: GPU sample times, NCCL lines, ...)
keep an exact set of key tuples (``SetIndex``). ``SetIndex`` and ``GpuIndex`` live in ``dedupe_sets``; this module
has the ordered indexes and ``make_index``, which picks a table's.

Both index classes answer the same three questions: ``new_rows`` (decoded records),
``new_packed`` (a numpy structured array of packed records) and ``add_table`` (the rows of a
stored part file, marked seen at start).
"""

from __future__ import annotations

import bisect
import logging

import numpy as np
import pyarrow as pa

from ranksight import wire
from head.store.dedupe_sets import GpuIndex, SetIndex
from ranksight.tables import SPECS

log = logging.getLogger("ranksight.store")

_GBITS = 20  # attempt bits in the packed group key (rank << 20 | attempt)
_MAX_RANK = 1 << 42


def _in_intervals(iv: list[list[int]], s: int) -> bool:
    i = bisect.bisect_right(iv, [s, 1 << 63]) - 1
    return i >= 0 and iv[i][0] <= s <= iv[i][1]


def _merge(iv: list[list[int]], steps) -> list[list[int]]:
    """Intervals ``iv`` (sorted, disjoint) with the integers ``steps`` added, merged."""
    pts = sorted([a, b] for a, b in iv) + [[int(s), int(s)] for s in steps]
    pts.sort()
    out: list[list[int]] = []
    for a, b in pts:
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


class SeqIndex:
    """Seen (rank, attempt, step) keys as intervals of steps per (rank, attempt); see the module docstring."""

    def __init__(self, group_cols: tuple[str, str] = ("rank", "attempt"), seq_col: str = "step"):
        self.group_cols = group_cols
        self.seq_col = seq_col
        self.gk = np.empty(0, np.int64)  # sorted group keys: rank << 20 | attempt
        self.lo = np.empty(0, np.int64)  # the highest contiguous range of steps seen: [lo, hi]
        self.hi = np.empty(0, np.int64)
        # the range's stride: its keys are lo, lo + d, ..., hi. 1 for steps and per-op collectives; a node agent's
        # folded collectives (ranksight/collective_fold.py) carry their first op's seq, n ops apart each step
        self.stride = np.empty(0, np.int64)
        self.irregular = np.empty(0, np.bool_)  # has intervals below [lo, hi] (in ``extra``)
        self.extra: dict[int, list[list[int]]] = {}
        self.progressions: dict[int, list[tuple[int, int, int]]] = {}  # older strided ranges: (lo, hi, stride)
        self.other: set = set()  # keys outside the packed range (negative rank, huge attempt): exact

    def __len__(self) -> int:
        return len(self.gk)

    def nbytes(self) -> int:
        return int(self.gk.nbytes * 4 + self.irregular.nbytes) + 64 * sum(len(v) for v in self.extra.values()) \
            + 80 * sum(len(v) for v in self.progressions.values()) \
            + 120 * len(self.other)

    def new_rows(self, rows: list) -> list:
        """Struct rows whose key is new (recorded as seen)."""
        if not rows:
            return []
        g0, g1 = self.group_cols
        try:
            a = np.fromiter((getattr(r, g0) for r in rows), np.int64, len(rows))
            b = np.fromiter((getattr(r, g1) for r in rows), np.int64, len(rows))
            s = np.fromiter((getattr(r, self.seq_col) for r in rows), np.int64, len(rows))
        except (OverflowError, TypeError, ValueError):  # beyond int64: exact set (Parquet drops them later)
            out = []
            for r in rows:
                k = (getattr(r, g0), getattr(r, g1), getattr(r, self.seq_col))
                if k not in self.other:
                    self.other.add(k)
                    out.append(r)
            return out
        mask = self.new_mask(a, b, s)
        return [r for r, m in zip(rows, mask.tolist()) if m]

    def new_packed(self, arr: np.ndarray, layout: wire.PackedLayout) -> np.ndarray:
        """Bool mask of the packed records in ``arr`` seen for the first time; records them. A key column the
        sender's layout does not carry takes its default (0 when it has none)."""
        n = len(arr)
        cols = [arr[c].astype(np.int64) if c in layout.codes else np.full(n, layout.defaults.get(c) or 0, np.int64)
                for c in (*self.group_cols, self.seq_col)]
        return self.new_mask(*cols)

    def add_table(self, table: pa.Table) -> None:
        """Mark the keys of stored rows (a Parquet part file's key columns) as seen."""
        if table.num_rows == 0:
            return
        cols = [table.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
                for c in (*self.group_cols, self.seq_col)]
        self.new_mask(*cols)

    def new_mask(self, a: np.ndarray, b: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Bool mask of rows (group columns a, b; sequence s) seen for the first time; records them."""
        n = len(s)
        out = np.zeros(n, np.bool_)
        if n == 0:
            return out
        ok = (a >= 0) & (a < _MAX_RANK) & (b >= 0) & (b < (1 << _GBITS))
        if not ok.all():
            for i in np.nonzero(~ok)[0].tolist():
                k = (int(a[i]), int(b[i]), int(s[i]))
                if k not in self.other:
                    self.other.add(k)
                    out[i] = True
            okidx = np.nonzero(ok)[0]
            out[okidx] = self.new_mask(a[okidx], b[okidx], s[okidx])
            return out
        g = (a << _GBITS) | b
        if len(self.gk):
            nxt = self._next_keys(g, s)
            if nxt is not None:
                if nxt.all():
                    return nxt
                rest = np.nonzero(~nxt)[0]  # other groups than the rows taken: independent of them
                nxt[rest] = self._sorted_mask(g[rest], s[rest])
                return nxt
        return self._sorted_mask(g, s)

    def _next_keys(self, g: np.ndarray, s: np.ndarray) -> np.ndarray | None:
        """The steady state without a sort: rows whose group is known, appears once in this call, and whose key is
        the next of its range (``hi + stride``: a rank's next step, a group's next folded collective) are new; their
        ranges are extended here. Returns the mask of those rows (None when there are none); the caller takes the
        other rows through ``_sorted_mask``."""
        k = len(self.gk)
        idx = np.searchsorted(self.gk, g)
        np.minimum(idx, k - 1, out=idx)
        hit = self.gk[idx] == g
        take = hit & (s == self.hi[idx] + self.stride[idx])
        if not take.any():
            return None
        take &= np.bincount(idx[hit], minlength=k)[idx] == 1  # a group with two rows here: the general path
        if not take.any():
            return None
        self.hi[idx[take]] = s[take]
        return take

    def _sorted_mask(self, g: np.ndarray, s: np.ndarray) -> np.ndarray:
        """``new_mask`` for group keys ``g`` (rank << 20 | attempt) in the packed range: sorted by (group, key),
        looked up with one searchsorted, recorded by ``_record``."""
        n = len(s)
        out = np.zeros(n, np.bool_)
        order = np.lexsort((s, g))
        gs, ss = g[order], s[order]
        first = np.ones(n, np.bool_)
        first[1:] = (gs[1:] != gs[:-1]) | (ss[1:] != ss[:-1])  # repeats inside this call
        if len(self.gk):
            idx = np.minimum(np.searchsorted(self.gk, gs), len(self.gk) - 1)
            found = self.gk[idx] == gs
            d = self.stride[idx]
            seen = found & (ss >= self.lo[idx]) & (ss <= self.hi[idx]) & ((ss - self.lo[idx]) % d == 0)
            # the extra intervals and older progressions all lie below the range
            check = found & ~seen & self.irregular[idx] & (ss < self.lo[idx])
            if check.any():
                for i in np.nonzero(check)[0].tolist():
                    seen[i] = self._seen_below(int(gs[i]), int(ss[i]))
        else:
            idx = np.zeros(n, np.int64)
            found = np.zeros(n, np.bool_)
            seen = found
        new = first & ~seen
        if new.any():
            ni = np.nonzero(new)[0]
            self._record(gs[ni], ss[ni], found[ni], idx[ni])
        out[order] = new
        return out

    def _record(self, gs: np.ndarray, ss: np.ndarray, found: np.ndarray, idx: np.ndarray) -> None:
        """Add new keys (sorted by (group, step), unique, none seen before)."""
        k = len(gs)
        gstart = np.ones(k, np.bool_)
        gstart[1:] = gs[1:] != gs[:-1]
        starts = np.nonzero(gstart)[0]
        ends = np.append(starts[1:], k) - 1
        gid = np.cumsum(gstart) - 1
        pos = np.arange(k) - starts[gid]
        # The in-order fast path: a group's new keys continue its range's progression, hi + d, hi + 2d, ... (or,
        # for a group not seen before, first, first + d, ... with d the first difference). A range of one key
        # takes its stride from the next key.
        gfound = found[starts]
        gidx = idx[starts]
        nxt = np.where(ends > starts, ss[np.minimum(starts + 1, k - 1)] - ss[starts], 1)  # a new group's stride
        if len(self.hi):
            single = self.lo[gidx] == self.hi[gidx]
            d_found = np.where(single, ss[starts] - self.hi[gidx], self.stride[gidx])
        else:
            d_found = np.ones(len(starts), np.int64)
        d = np.where(gfound, d_found, np.maximum(nxt, 1))
        first_key = np.where(gfound, self.hi[gidx] + d if len(self.hi) else 0, ss[starts])
        grp_ok = np.logical_and.reduceat(ss == first_key[gid] + d[gid] * pos, starts) & (d >= 1)
        upd = grp_ok & gfound
        if upd.any():
            self.hi[gidx[upd]] = ss[ends[upd]]
            self.stride[gidx[upd]] = d[upd]
        new_g, new_lo, new_hi, new_irr, new_d = [], [], [], [], []
        add = grp_ok & ~gfound
        if add.any():
            new_g.append(gs[starts[add]])
            new_lo.append(ss[starts[add]])
            new_hi.append(ss[ends[add]])
            new_irr.append(np.zeros(int(add.sum()), np.bool_))
            new_d.append(d[add])
        for j in np.nonzero(~grp_ok)[0].tolist():  # gaps, steps below the range: exact interval merge
            g = int(gs[starts[j]])
            steps = ss[starts[j]:ends[j] + 1].tolist()
            if gfound[j] and self._restride(int(idx[starts[j]]), g, steps):
                continue
            if gfound[j]:
                i = int(idx[starts[j]])
                lo_i, hi_i, d_i = int(self.lo[i]), int(self.hi[i]), int(self.stride[i])
                # a strided range as its keys (rare: a key off a folded progression)
                main_iv = [[lo_i, hi_i]] if d_i == 1 else [[x, x] for x in range(lo_i, hi_i + 1, d_i)]
                iv = self.extra.get(g, []) + main_iv
            else:
                iv = []
            iv = _merge(iv, steps)
            main = iv.pop()
            if iv:
                self.extra[g] = iv
            else:
                self.extra.pop(g, None)
            if gfound[j]:
                self.lo[i], self.hi[i], self.stride[i] = main[0], main[1], 1
                self.irregular[i] = bool(iv) or g in self.progressions
            else:
                new_g.append(np.array([g], np.int64))
                new_lo.append(np.array([main[0]], np.int64))
                new_hi.append(np.array([main[1]], np.int64))
                new_irr.append(np.array([bool(iv)]))
                new_d.append(np.ones(1, np.int64))
        if new_g:
            gk = np.concatenate([self.gk] + new_g)
            o = np.argsort(gk, kind="stable")
            self.gk = gk[o]
            self.stride = np.concatenate([self.stride] + new_d)[o]
            self.lo = np.concatenate([self.lo] + new_lo)[o]
            self.hi = np.concatenate([self.hi] + new_hi)[o]
            self.irregular = np.concatenate([self.irregular] + new_irr)[o]

    def _restride(self, i: int, g: int, keys: list[int]) -> bool:
        """In-order keys above group ``i``'s range with another stride (a step of folded collective records with a
        different op count, a cycle's read that cut a step in two): the range is kept whole as a progression in
        ``progressions`` and the new keys start the next one. False (nothing done) unless every key is above the
        range and they make one progression."""
        hi, lo, d = int(self.hi[i]), int(self.lo[i]), int(self.stride[i])
        step = keys[1] - keys[0] if len(keys) > 1 else 1
        if keys[0] <= hi or step < 1 or any(b - a != step for a, b in zip(keys, keys[1:])):
            return False
        if d == 1:
            self.extra.setdefault(g, []).append([lo, hi])  # a contiguous range is an ordinary interval
        else:
            self.progressions.setdefault(g, []).append((lo, hi, d))
        self.lo[i], self.hi[i], self.stride[i], self.irregular[i] = keys[0], keys[-1], step, True
        return True

    def _seen_below(self, g: int, s: int) -> bool:
        """Key ``s`` of group ``g`` in an interval or a progression below the group's range."""
        if _in_intervals(self.extra.get(g, []), s):
            return True
        return any(a <= s <= b and (s - a) % d == 0 for a, b, d in self.progressions.get(g, ()))


_MIX = np.uint64(0x9E3779B97F4A7C15)


def _hash_words(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(one 64-bit hash per value, the values padded to whole words) of a fixed-width bytes array; None when empty."""
    w = values.dtype.itemsize
    if len(values) == 0 or w == 0:
        return None
    padded = -(-w // 8) * 8
    v = np.ascontiguousarray(values if padded == w else values.astype(f"S{padded}"))
    words = v.view("<u8").reshape(len(v), padded // 8)
    h = words[:, 0].copy()
    for j in range(1, padded // 8):
        h *= _MIX
        h ^= words[:, j]
    return h, v


def _factorize_bytes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(codes, distinct values) of a fixed-width bytes array, like ``np.unique(values, return_inverse=True)`` but
    several times faster on a flush's group names (tens of thousands of rows, thousands of names): the names are
    hashed to one 64-bit word each, the words factorized, and every row checked against its code's value, so a hash
    collision is caught (None: the caller takes the exact ``np.unique``) and nothing is approximated."""
    hv = _hash_words(values)
    if hv is None:
        return None
    h, v = hv
    hu, first, codes = np.unique(h, return_index=True, return_inverse=True)
    codes = codes.ravel()
    uniq = v[first]
    if not np.array_equal(uniq[codes], v):  # two names with one hash: not seen in practice, but never trusted
        return None
    return codes, uniq


class CollectiveIndex(SeqIndex):
    """Seen collective keys. A collective is one (rank, attempt, group, seq) (its step follows from them), and the
    sequence numbers of one (rank, attempt, group) come in order, as steps do: the same intervals, with the group's
    name mapped to a number kept for the index's life and folded into the group key (attempt << 15 | name's number;
    beyond those bits, the exact set of ``SeqIndex.other``). Bounded by ranks x groups, not by records."""

    _NAME_BITS = 15

    def __init__(self):
        super().__init__(("rank", "attempt"), "seq")
        self.names: dict[bytes, int] = {}
        # the same numbers as ``names``, sorted by name, for ``_name_ids``'s vectorized look-up
        self._sorted_names = np.array([], "S1")
        self._sorted_ids = np.zeros(0, np.int64)
        self._no_sorted = False  # two names that differ only in trailing NULs: the dict alone, always
        # per name width: the known names by hash (hashes sorted, the names, their numbers), made again when names
        # are added
        self._hashes: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _b(self, attempt: np.ndarray, groups: np.ndarray) -> np.ndarray:
        ids = self._known_name_ids(groups) if groups.dtype.kind == "S" else None
        if ids is not None:
            return (attempt.astype(np.int64) << self._NAME_BITS) | ids
        inv_uniq = _factorize_bytes(groups) if groups.dtype.kind == "S" else None
        if inv_uniq is None:
            uniq, inv = np.unique(groups, return_inverse=True)
        else:
            inv, uniq = inv_uniq
        return (attempt.astype(np.int64) << self._NAME_BITS) | self._name_ids(uniq)[inv.ravel()]

    def _known_name_ids(self, groups: np.ndarray) -> np.ndarray | None:
        """The numbers of a flush's group names when every one is numbered already (the steady state: a job's
        groups are made at its start), without sorting the flush: each name hashed to one word and looked up among
        the known names' hashes, and checked byte for byte against the name found. None when any name is new or a
        hash repeats among the known names (``_b``'s general path)."""
        if self._no_sorted or not len(self._sorted_names) or len(groups) == 0:
            return None
        width = -(-max(groups.dtype.itemsize, self._sorted_names.dtype.itemsize) // 8) * 8
        got = self._hashes.get(width)
        if got is None or len(got[0]) != len(self._sorted_names):
            h, names = _hash_words(self._sorted_names.astype(f"S{width}"))
            order = np.argsort(h, kind="stable")
            hs = h[order]
            if len(hs) > 1 and (hs[1:] == hs[:-1]).any():  # a collision among known names: the general path
                return None
            if len(self._hashes) > 4:
                self._hashes.clear()
            got = self._hashes[width] = (hs, names[order], self._sorted_ids[order])
        hs, names, ids = got
        h, v = _hash_words(groups.astype(f"S{width}", copy=False))
        pos = np.searchsorted(hs, h)
        np.minimum(pos, len(hs) - 1, out=pos)
        if not (names[pos] == v).all():
            return None
        return ids[pos]

    def _name_ids(self, uniq: np.ndarray) -> np.ndarray:
        """The number of each distinct group name: names already numbered are looked up in one sorted array (a
        flush names thousands of p2p groups: one Python call per name cost more than the rest of the dedupe); only
        names seen for the first time go through the dict."""
        if uniq.dtype.kind == "S" and len(self._sorted_names):
            width = max(uniq.dtype.itemsize, self._sorted_names.dtype.itemsize)
            known = self._sorted_names.astype(f"S{width}", copy=False)
            u = uniq.astype(f"S{width}", copy=False)
            pos = np.minimum(np.searchsorted(known, u), len(known) - 1)
            hit = known[pos] == u
            if hit.all():
                return self._sorted_ids[pos]
        ids = np.array([self.names.setdefault(g.encode() if isinstance(g, str) else bytes(g), len(self.names))
                        for g in uniq.tolist()], np.int64)
        if len(self.names) != len(self._sorted_ids) and not self._no_sorted:  # new names (rare: names are few)
            keys = list(self.names)
            if any(k.endswith(b"\0") for k in keys):  # numpy's S dtype cuts trailing NULs: the dict alone, always
                self._no_sorted = True
                self._sorted_names, self._sorted_ids = np.array([], "S1"), np.zeros(0, np.int64)
            else:
                names = np.array(keys, dtype=f"S{max(1, max(len(k) for k in keys))}")
                order = np.argsort(names, kind="stable")
                self._sorted_names = names[order]
                self._sorted_ids = np.fromiter(self.names.values(), np.int64, len(keys))[order]
        return ids

    def new_rows(self, rows: list) -> list:
        if not rows:
            return []
        try:
            a = np.fromiter((r.rank for r in rows), np.int64, len(rows))
            att = np.fromiter((r.attempt for r in rows), np.int64, len(rows))
            s = np.fromiter((r.seq for r in rows), np.int64, len(rows))
        except (OverflowError, TypeError, ValueError):  # beyond int64: exact set (Parquet drops them later)
            out = []
            for r in rows:
                k = (r.rank, r.attempt, r.group, r.seq)
                if k not in self.other:
                    self.other.add(k)
                    out.append(r)
            return out
        b = self._b(att, np.array([r.group for r in rows], dtype=object))
        mask = self.new_mask(a, b, s)
        return [r for r, m in zip(rows, mask.tolist()) if m]

    def new_packed(self, arr: np.ndarray, layout: wire.PackedLayout) -> np.ndarray:
        n = len(arr)

        def col(c):
            return arr[c].astype(np.int64) if c in layout.codes else np.full(n, layout.defaults.get(c) or 0, np.int64)
        return self.new_mask(col("rank"), self._b(col("attempt"), arr["group"]), col("seq"))

    def add_table(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return

        def col(c):
            return table.column(c).to_numpy(zero_copy_only=False)
        self.new_mask(col("rank").astype(np.int64), self._b(col("attempt"), col("group").astype(object)),
                      col("seq").astype(np.int64))


def make_index(table: str) -> SeqIndex | SetIndex:
    """The dedupe index of a store table: intervals for ``steps`` and ``collectives``, an exact key set for the
    others."""
    if table == "steps":
        return SeqIndex()
    if table == "gpu":
        return GpuIndex(SPECS[table])
    return CollectiveIndex() if table == "collectives" else SetIndex(SPECS[table])
