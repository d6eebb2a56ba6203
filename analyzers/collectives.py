"""A collective record's communicator, as the analyzers see it: its key (``group_key``: name, members, attempt), its
members (``with_members``: from the ``communicators`` table when the record names its group by ``comm_id``), its
member count, and how many ops the record stands for (``op_counts``: a node agent's folded records). Used by the
loader (``RunData.normalize``, ``analyzers.columnar``) and by the checks that compare the members of an op."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def group_key(group: Any, members: Any, attempt: int = 0) -> str:
    """One communicator: the group's name, its member ranks, and the attempt (a job re-formed after a restart or an
    eviction has new process groups whose sequence numbers start again at 0)."""
    try:
        ranks = sorted(int(x) for x in members) if members is not None and len(members) else []
    except TypeError:
        ranks = []
    key = f"{group}[{','.join(map(str, ranks))}]" if ranks else str(group)
    return key + (f" attempt {attempt}" if attempt else "")


def group_keys(groups: list, members: list, attempts: list) -> list[str]:
    """``group_key`` of every collective row. The rows of one communicator repeat the same (group, members,
    attempt) thousands of times in a window (a record per op and rank), and sorting the member list of each row
    cost O(rows x group size) every analysis round: each distinct combination is computed once.

    The head's live window hands equal member lists over as one shared array object (head/live_frames.py
    ``to_pandas_shared_lists``): then the combinations are told apart in bulk by the objects' identity (with
    string groups and int attempts, which factorize keeps apart exactly). Otherwise (a run read from disk: an
    array per row) a lookup per row by the members' raw bytes or tuple."""
    n = len(members)
    if n and set(map(type, groups)) <= {str} and set(map(type, attempts)) <= {int}:
        m_code, m_uniq = pd.factorize(np.fromiter(map(id, members), dtype=np.int64, count=n))
        if len(m_uniq) <= max(1000, n // 8):
            g_code, g_uniq = pd.factorize(np.array(groups, dtype=object))
            a_code, a_uniq = pd.factorize(np.array(attempts, dtype=np.int64))
            if len(g_uniq) * len(a_uniq) * len(m_uniq) >= 2**62:  # the combined code would overflow
                return _group_keys_by_row(groups, members, attempts)
            code = (g_code.astype(np.int64) * len(a_uniq) + a_code) * len(m_uniq) + m_code
            _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
            keys = np.array([group_key(groups[i], members[i], attempts[i]) for i in first], dtype=object)
            return keys[inverse.ravel()].tolist()
    return _group_keys_by_row(groups, members, attempts)


def _group_keys_by_row(groups: list, members: list, attempts: list) -> list[str]:
    """``group_key`` of every row, each distinct combination computed once (looked up by the members' raw bytes
    or tuple)."""
    cache: dict[Any, str] = {}
    out = []
    for g, m, a in zip(groups, members, attempts):
        try:
            look = (g, a, m.dtype.str, m.tobytes()) if isinstance(m, np.ndarray) else (
                g, a, type(m), tuple(m) if isinstance(m, (list, tuple)) else m)
            key = cache.get(look)
            if key is None:
                key = cache[look] = group_key(g, m, a)
        except TypeError:  # unhashable: compute it for this row
            key = group_key(g, m, a)
        out.append(key)
    return out


def with_members(co: pd.DataFrame, communicators: pd.DataFrame) -> pd.Series:
    """The collectives' ``group_ranks``, each record that names its group by ``comm_id`` (and carries no member list)
    given its communicator's members: one shared sorted int64 array per communicator, so the analyzers see every
    record's members as before, at the cost of one dictionary lookup per record. A record whose communicator was
    never stored (its writer's node lost) keeps an empty list: the checks then take the group's members from the
    ranks that have records of it."""
    if co.empty or communicators.empty or "comm_id" not in co.columns:
        return co["group_ranks"]
    members = {str(cid): np.asarray(sorted(int(x) for x in rk), dtype=np.int64)
               for cid, rk in zip(communicators["comm_id"], communicators["ranks"])
               if isinstance(rk, (list, tuple, np.ndarray)) and len(rk)}
    # each distinct comm_id looked up once (Series.map over an Arrow string column converts every row)
    codes, uniq = pd.factorize(co["comm_id"])
    by_code = np.empty(len(uniq) + 1, dtype=object)  # the last slot (code -1): no comm_id
    for i, u in enumerate(uniq):  # one by one: a list of equal-length arrays would be taken as a 2-D block
        by_code[i] = members.get(str(u))
    mapped = by_code[codes]
    want = pd.notna(mapped) & (member_counts(co["group_ranks"]).to_numpy() == 0)
    if not want.any():
        return co["group_ranks"]
    return pd.Series(np.where(want, mapped, co["group_ranks"].to_numpy(dtype=object)), index=co.index, dtype=object)


def member_counts(members: pd.Series) -> pd.Series:
    """The number of members of each collective record's ``group_ranks`` (0 when it is not a list)."""
    values = members.tolist()
    if set(map(type, values)) <= {np.ndarray, list, tuple}:
        counts = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    else:
        counts = np.array([len(gr) if isinstance(gr, (list, tuple, np.ndarray)) else 0 for gr in values], dtype=np.int64)
    return pd.Series(counts, index=members.index)


def op_counts(co: pd.DataFrame) -> pd.Series:
    """How many op instances each collective record stands for: its ``ops`` (more than 1 where a node agent folded
    a step's ops into one record, ranksight/collective_fold.py; such a record reads as its mean op), 1 for records
    without the column (older ones)."""
    if "ops" not in co.columns:
        return pd.Series(1, index=co.index, dtype=np.int64)
    return pd.to_numeric(co["ops"], errors="coerce").fillna(1).clip(lower=1).astype(np.int64)


def name_starts_with(names: pd.Series, prefix: str | tuple[str, ...]) -> np.ndarray:
    """Which of a column of communicator (or op) names start with ``prefix``, as ``names.astype(str).str.startswith``
    gives, without converting every row: a categorical column is tested on its categories, a string column in bulk
    (a categorical's ``astype(str)`` costs seconds at 20 M rows)."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        cats = np.asarray([str(c).startswith(prefix) for c in names.cat.categories] + [False], dtype=bool)
        return cats[names.cat.codes.to_numpy()]  # code -1: a missing name starts with nothing
    if pd.api.types.is_string_dtype(names.dtype) and names.dtype != object:
        return names.str.startswith(prefix).fillna(False).to_numpy(dtype=bool)
    return names.astype(str).str.startswith(prefix).to_numpy(dtype=bool)


def stable_order(*keys: np.ndarray) -> np.ndarray:
    """The stable order of rows sorted by ``keys`` (the first the primary key), as ``np.lexsort(keys[::-1])`` gives,
    for non-negative integer keys: numpy sorts 16-bit integers stably by radix sort in linear time, so each key
    goes in 16-bit digits, least significant first (a stable comparison sort of tens of millions of wider keys is
    several times slower). A key with negative values or over 48 bits falls back to lexsort."""
    n = len(keys[0]) if keys else 0
    order = np.arange(n)
    for key in reversed(keys):
        key = np.asarray(key)
        if not n:
            break
        if key.dtype.kind not in "iu" or (key.dtype.kind == "i" and key.min() < 0) or int(key.max()) >= 2**48:
            return np.lexsort(tuple(np.asarray(k) for k in reversed(keys)))
        top = int(key.max())
        shift = 0
        while True:
            digit = ((key[order] >> shift) & 0xFFFF).astype(np.uint16) if top >= 2**16 or shift else key[order].astype(np.uint16)
            order = order[np.argsort(digit, kind="stable")]
            shift += 16
            if top >> shift == 0:
                break
    return order
