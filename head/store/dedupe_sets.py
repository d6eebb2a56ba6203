"""Dedupe indexes that keep exact keys: ``SetIndex`` (a set of key tuples, for the tables without an ordered
sequence key) and ``GpuIndex`` (GPU samples: per GPU the newest sample time and the exact keys of the last
``GPU_HORIZON_S`` seconds). The ordered indexes of steps and collectives, and ``make_index``, are in
``head/store/dedupe.py``, whose docstring says what every index answers.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pyarrow as pa

from ranksight import wire
from ranksight.tables import TableSpec

log = logging.getLogger("ranksight.store")


class SetIndex:
    """Seen keys as an exact set of tuples (tables without an ordered sequence key)."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.keys: set = set()

    def __len__(self) -> int:
        return len(self.keys)

    def nbytes(self) -> int:
        return 120 * len(self.keys)

    def new_rows(self, rows: list) -> list:
        """Struct rows whose key is new (recorded as seen); all of them for a table without a key."""
        if not self.spec.key:
            return list(rows)
        keys = self.keys
        ks = list(map(self.spec.key_fn, rows))
        if keys.isdisjoint(ks) and len(set(ks)) == len(ks):  # the common case: all new, no repeats
            keys.update(ks)
            return list(rows)
        new = []
        for k, r in zip(ks, rows):
            if k in keys:
                continue
            keys.add(k)
            new.append(r)
        return new

    def new_packed(self, arr: np.ndarray, layout: wire.PackedLayout) -> np.ndarray:
        """Bool mask of the packed records in ``arr`` seen for the first time; records them."""
        n = len(arr)
        if not self.spec.key:
            return np.ones(n, np.bool_)
        keycols = [_packed_values(arr, c, layout) if c in layout.codes else [layout.defaults.get(c)] * n
                   for c in self.spec.key]
        ks = list(zip(*keycols))
        keys = self.keys
        if keys.isdisjoint(ks) and len(set(ks)) == n:  # the common case: all new, no repeats (no Python per row)
            keys.update(ks)
            return np.ones(n, np.bool_)
        out = np.zeros(n, np.bool_)
        for i, k in enumerate(ks):
            if k not in keys:
                keys.add(k)
                out[i] = True
        return out

    def add_table(self, table: pa.Table) -> None:
        """Mark the keys of stored rows (a Parquet part file's key columns) as seen."""
        if not self.spec.key or table.num_rows == 0:
            return
        self.keys.update(self.spec.keys_from_table(table))


def _packed_values(arr: np.ndarray, c: str, layout: wire.PackedLayout) -> list:
    """A packed column as the Python values a decoded record holds (the key tuples of both paths must agree): str
    for strings, None for nulls."""
    code = layout.codes[c]
    col = arr[c]
    if code.startswith("S"):
        return [v.decode("utf-8", "replace") for v in col.tolist()]
    if code == "b1":
        return (col != 0).tolist()
    vals = col.tolist()
    if code == "f8" and np.isnan(col).any():
        return [None if v != v else v for v in vals]
    if code == "n8" and (col == wire.NULL_INT).any():
        return [None if v == wire.NULL_INT else v for v in vals]
    return vals


# How far below a GPU's newest sample time a sample may still arrive for the first time. One probe per agent samples
# each GPU in time order, and the agent ships in order: a fresh batch only once its outbox (node/outbox.py: oldest
# segment first, removed once acknowledged) is empty. So a sample older than its GPU's newest is a resend (an
# acknowledged export whose reply was lost, an outbox segment re-shipped after a crash); the exact keys of the last
# few minutes also keep samples that arrive a little out of order (a node clock stepped back, one batch split).
GPU_HORIZON_S = 300.0
_GPU_BITS = 20  # gpu index bits of a GPU code (node << 20 | gpu)


class GpuIndex(SetIndex):
    """Seen GPU sample keys (node, gpu, t) with memory bounded by GPUs x ``horizon`` seconds, not by samples.

    Per GPU (``node << 20 | gpu``): the newest sample time seen (``hwm``) and, in numpy chunks, the (gpu, t) keys of
    the samples within ``horizon`` seconds below it. A sample newer than its GPU's newest is new (the common case,
    answered for a whole batch with a few vectorized operations); one within the horizon is looked up exactly; one
    older than the horizon is taken for a resend, not stored, and counted in ``stale`` (logged): it cannot be told
    apart exactly any more. Rows whose node, gpu or time is missing or out of range keep the exact key set."""

    def __init__(self, spec: TableSpec, horizon: float = GPU_HORIZON_S):
        super().__init__(spec)
        self.horizon = float(horizon)
        # per GPU code, the newest sample time: two arrays sorted by code (a flush holds every GPU's samples: a
        # look-up and an update per GPU in Python cost more than the rest of the dedupe)
        self._hw_codes = np.zeros(0, np.int64)
        self._hw_t = np.zeros(0, np.float64)
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []  # (codes, times) of the samples kept exactly
        self._recent = 0
        self._after_prune = 0
        self.stale = 0  # samples older than their GPU's newest by more than the horizon: dropped, counted

    def __len__(self) -> int:
        return self._recent + len(self._hw_codes) + len(self.keys)

    def nbytes(self) -> int:
        return 16 * self._recent + 16 * len(self._hw_codes) + 120 * len(self.keys)

    def new_rows(self, rows: list) -> list:
        n = len(rows)
        if n == 0:
            return []
        node = np.array([r.node if isinstance(r.node, int) else -1 for r in rows], np.int64)
        gpu = np.array([r.gpu if isinstance(r.gpu, int) else -1 for r in rows], np.int64)
        t = np.array([float(r.t) if isinstance(r.t, (int, float)) else math.nan for r in rows], np.float64)
        ok = _regular(node, gpu, t)
        out = np.zeros(n, np.bool_)
        out[ok] = self._new_mask(_code(node[ok], gpu[ok]), t[ok])
        if not ok.all():
            odd = [rows[i] for i in np.flatnonzero(~ok)]
            fresh = {id(r) for r in super().new_rows(odd)}
            out[~ok] = [id(r) in fresh for r in odd]
        return [r for r, k in zip(rows, out) if k]

    def new_packed(self, arr: np.ndarray, layout: wire.PackedLayout) -> np.ndarray:
        n = len(arr)

        def col(c, null, dtype):
            if c not in layout.codes:
                d = layout.defaults.get(c)
                return np.full(n, null if d is None else d, dtype)
            v = arr[c].astype(dtype)
            if layout.codes[c] == "n8":
                v[arr[c] == wire.NULL_INT] = null
            return v

        node, gpu, t = col("node", -1, np.int64), col("gpu", -1, np.int64), col("t", math.nan, np.float64)
        ok = _regular(node, gpu, t)
        out = np.zeros(n, np.bool_)
        out[ok] = self._new_mask(_code(node[ok], gpu[ok]), t[ok])
        if not ok.all():
            out[~ok] = super().new_packed(arr[~ok], layout)
        return out

    def add_table(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return

        def col(c, null, dtype):
            return np.nan_to_num(table.column(c).to_numpy(zero_copy_only=False).astype(np.float64), nan=null).astype(dtype)

        node, gpu, t = col("node", -1, np.int64), col("gpu", -1, np.int64), col("t", math.nan, np.float64)
        ok = _regular(node, gpu, t)
        self._new_mask(_code(node[ok], gpu[ok]), t[ok], stored=True)
        if not ok.all():
            super().add_table(table.filter(pa.array(~ok)))

    def _new_mask(self, code: np.ndarray, t: np.ndarray, stored: bool = False) -> np.ndarray:
        """Which of these samples (all with a regular key) are seen for the first time; records them."""
        n = len(code)
        if n == 0:
            return np.zeros(0, np.bool_)
        uniq, inv = np.unique(code, return_inverse=True)
        hw = self._hwm_of(uniq)
        h = hw[inv]
        # a key repeated within the batch: its first row only
        order = np.lexsort((t, code))
        rep = np.zeros(n, np.bool_)
        rep[1:] = (code[order][1:] == code[order][:-1]) & (t[order][1:] == t[order][:-1])
        first = np.ones(n, np.bool_)
        first[order[rep]] = False
        new = t > h
        stale = t <= h - self.horizon
        middle = np.flatnonzero(~new & ~stale)
        if len(middle):
            seen = self._recent_keys(np.unique(code[middle]))
            new[middle] = [k not in seen for k in zip(code[middle].tolist(), t[middle].tolist())]
        new &= first
        if stale.any() and not stored:
            k = int(stale.sum())
            if self.stale == 0 or (self.stale + k) // 10_000 > self.stale // 10_000:
                log.warning("gpu samples older than their GPU's newest by over %.0f s: %d taken for resends and "
                            "not stored (%d so far)", self.horizon, k, self.stale + k)
            self.stale += k
        if new.any():
            c, tt = code[new], t[new]
            self._chunks.append((c, tt))
            self._recent += len(c)
            top = np.full(len(uniq), -math.inf)
            np.maximum.at(top, inv[new], tt)
            up = top > hw
            self._raise_hwm(uniq[up], top[up])
            if self._recent > max(2 * self._after_prune, 1 << 16):
                self._prune()
        return new

    @property
    def hwm(self) -> dict[int, float]:
        """Each GPU code's newest sample time (a copy, for inspection)."""
        return dict(zip(self._hw_codes.tolist(), self._hw_t.tolist()))

    def _hwm_of(self, codes: np.ndarray) -> np.ndarray:
        """The newest sample time of each of these distinct, sorted codes (-inf for a GPU not seen yet)."""
        out = np.full(len(codes), -math.inf)
        if len(self._hw_codes):
            pos = np.minimum(np.searchsorted(self._hw_codes, codes), len(self._hw_codes) - 1)
            hit = self._hw_codes[pos] == codes
            out[hit] = self._hw_t[pos[hit]]
        return out

    def _raise_hwm(self, codes: np.ndarray, newest: np.ndarray) -> None:
        """Set the newest sample time of these distinct, sorted codes (each >= its old value)."""
        if len(self._hw_codes):
            pos = np.minimum(np.searchsorted(self._hw_codes, codes), len(self._hw_codes) - 1)
            hit = self._hw_codes[pos] == codes
            self._hw_t[pos[hit]] = newest[hit]
            codes, newest = codes[~hit], newest[~hit]
            if not len(codes):
                return
            all_codes = np.concatenate([self._hw_codes, codes])
            order = np.argsort(all_codes, kind="stable")
            self._hw_codes, self._hw_t = all_codes[order], np.concatenate([self._hw_t, newest])[order]
        else:
            self._hw_codes, self._hw_t = codes.astype(np.int64), newest.astype(np.float64)

    def _recent_keys(self, codes: np.ndarray) -> set:
        """The exactly kept (code, t) keys of these GPUs."""
        out: set = set()
        for c, t in self._chunks:
            m = np.isin(c, codes)
            if m.any():
                out.update(zip(c[m].tolist(), t[m].tolist()))
        return out

    def _prune(self) -> None:
        """Keep exactly only the keys within the horizon below their GPU's newest time."""
        code = np.concatenate([c for c, _ in self._chunks])
        t = np.concatenate([x for _, x in self._chunks])
        uniq, inv = np.unique(code, return_inverse=True)
        hw = self._hwm_of(uniq)
        keep = t > hw[inv] - self.horizon
        self._chunks = [(code[keep], t[keep])]
        self._recent = self._after_prune = int(keep.sum())


def _regular(node: np.ndarray, gpu: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Rows whose key fits a GPU code and a finite time."""
    return (node >= 0) & (node < (1 << 42)) & (gpu >= 0) & (gpu < (1 << _GPU_BITS)) & np.isfinite(t)


def _code(node: np.ndarray, gpu: np.ndarray) -> np.ndarray:
    return (node << _GPU_BITS) | gpu
