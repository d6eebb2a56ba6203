"""The loader's sort and duplicate drop of a table's rows on one integer key per row (``sorted_last``), and the
columns' rows taken in that order (``take``): part of the columnar reader (analyzers/columnar.py), apart because of
its size.
"""

from __future__ import annotations

import numpy as np


def composite_key(keys: list[np.ndarray]) -> tuple[np.ndarray, list[int]] | None:
    """One int64 per row ordering as the tuple of ``keys`` (integer arrays), and each key's span; None when the
    spans' product does not fit in 62 bits."""
    spans, los = [], []
    total = 1
    for k in keys:
        lo, hi = (int(k.min()), int(k.max())) if len(k) else (0, 0)
        span = hi - lo + 1
        total *= span
        if total >= 2**62:
            return None
        spans.append(span)
        los.append(lo)
    code = keys[0].astype(np.int64)  # one array, the others added into it in place
    if los[0]:
        code -= los[0]
    for k, lo, span in zip(keys[1:], los[1:], spans[1:]):
        code *= span
        code += k
        if lo:
            code -= lo
    return code, spans


def sorted_last(keys: list[np.ndarray], n_unique: int, tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Row indices sorted by ``keys`` (integer arrays) then ``tiebreak`` (floats, NaN last), stable, keeping the
    last row of each distinct ``keys[:n_unique]``: ``sort_values(keys + [tiebreak]).drop_duplicates(keys[:n_unique],
    keep="last")``'s rows. Rows already in that order (a store's parts in time order) are not sorted again."""
    comp = composite_key(keys)
    if comp is None:
        order = np.lexsort(([tiebreak] if tiebreak is not None else []) + keys[::-1])
        ks = [k[order] for k in keys[:n_unique]]
        same = np.ones(max(len(order) - 1, 0), np.bool_)
        for k in ks:
            same &= k[1:] == k[:-1]
    else:
        code, spans = comp
        order = None  # None: already in order (the head's parts), nothing moves
        if not bool((code[1:] >= code[:-1]).all()):
            order = np.argsort(code, kind="stable")
            code = code[order]
        if tiebreak is not None and len(code) > 1 and bool((code[1:] == code[:-1]).any()):
            base = comp[0]
            order = np.lexsort((tiebreak, base))  # equal keys: the tiebreak decides which row is last
            code = base[order]
        div = int(np.prod(spans[n_unique:], dtype=object)) if n_unique < len(keys) else 1
        if div > 1:
            code = code // div
        same = code[1:] == code[:-1]
        del code, comp
        if order is None:
            keep = np.ones(len(same) + 1, np.bool_)
            keep[:-1] = ~same
            return np.flatnonzero(keep)
    keep = np.ones(len(order), np.bool_)
    keep[:-1] = ~same
    return order[keep]


def take(cols: dict[str, object], idx: np.ndarray) -> None:
    """In place: every column's rows ``idx`` (one column copied at a time). Nothing when ``idx`` is every row in
    order."""
    n = len(next(iter(cols.values())))
    if len(idx) == n and bool((idx[1:] > idx[:-1]).all()):
        return
    for name in list(cols):
        v = cols[name]
        cols[name] = v[idx] if isinstance(v, np.ndarray) else v.take(idx)
