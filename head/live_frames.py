"""The live window's tables cut per rank and turned into the analyzers' DataFrames.

``RunLive.run_data`` builds each analysis round's input with these: ``window_rows`` cuts the steps and
collectives to each rank's last rows in one filter, ``to_pandas_shared_lists`` converts the collectives with
one array object per distinct member list, and ``ConvertedWindow`` turns the GPU and host sample deques into
Arrow tables, converting each sample once across rounds.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ranksight.tables import SPECS

if TYPE_CHECKING:
    import pandas as pd


def numpy_column(t: pa.Table, name: str) -> np.ndarray:
    """Column ``name`` of ``t`` as one numpy array."""
    return t.column(name).to_numpy(zero_copy_only=False)


class ConvertedWindow:
    """A deque of records (appended at the right, evicted at the left) as an Arrow table, converting each record
    once. The head's analysis round turns the GPU and host sample deques into DataFrames every round; they hold
    minutes of samples, almost all of them converted the round before.

    ``table(rows)``: ``rows`` is the deque's snapshot now. The previous snapshot's records still in it are found
    by identity (its first record's position in the previous snapshot, then every one checked), their rows
    sliced from the previous table, and only the records after them converted. Anything else (the deque
    replaced, records inserted elsewhere) converts the whole snapshot."""

    def __init__(self, run_id: str, table: str):
        self.run_id, self.name = run_id, table
        self.rows: list = []
        self.tbl: pa.Table | None = None
        self.lock = threading.Lock()  # run_data() may run on more than one thread

    def table(self, rows: list) -> pa.Table:
        with self.lock:
            return self._table(rows)

    def _table(self, rows: list) -> pa.Table:
        spec = SPECS[self.name]
        prev, tbl = self.rows, self.tbl
        kept = _kept_prefix(prev, rows) if tbl is not None else 0
        if kept:
            new = rows[kept:]
            parts = [tbl.slice(len(prev) - kept)] + ([spec.to_table(self.run_id, new)] if new else [])
            out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        else:
            out = spec.to_table(self.run_id, rows)
        self.rows, self.tbl = rows, out
        return out


def _kept_prefix(prev: list, cur: list) -> int:
    """How many records at the start of ``cur`` are the last ones of ``prev`` (the same objects, in order); 0 when
    ``cur`` does not continue ``prev`` that way."""
    if not prev or not cur:
        return 0
    first = cur[0]
    try:
        d = next(i for i, r in enumerate(prev) if r is first)
    except StopIteration:
        return 0
    kept = len(prev) - d
    if kept > len(cur) or not all(a is b for a, b in zip(prev[d:], cur)):
        return 0
    return kept


def to_pandas_shared_lists(t: pa.Table, col: str) -> pd.DataFrame:
    """``t.to_pandas()``, with the rows of ``col`` (a list column) that hold equal lists sharing one numpy array.

    A collective record carries its communicator's member ranks, so the window holds the same list once per op
    and rank (at 1024 ranks, half a million of them). ``to_pandas`` makes an array per row; the analyzers'
    loader then derives a communicator key from each. Equal lists are found here in bulk (each list's raw bytes
    as one Arrow binary value, dictionary-encoded), and each distinct list is one array object, which the loader
    recognises by identity. Other list types convert as usual."""
    if col not in t.column_names or t.num_rows == 0:
        return t.to_pandas()
    lists = t.column(col).combine_chunks()
    if not (pa.types.is_list(lists.type) and pa.types.is_integer(lists.type.value_type)) or lists.flatten().null_count:
        return t.to_pandas()
    flat = lists.flatten().to_numpy()
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy().astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    raw = np.ascontiguousarray(flat).view(np.uint8)
    as_bytes = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(lengths), [None, pa.py_buffer(offsets * flat.dtype.itemsize), pa.py_buffer(raw)])
    code = pc.dictionary_encode(as_bytes).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    _, first = np.unique(code, return_index=True)
    shared = np.empty(len(first) + 1, dtype=object)  # the last slot: None, for a null list
    for j, i in enumerate(first):
        shared[j] = flat[offsets[i]:offsets[i + 1]].copy()
    null = lists.is_null().to_numpy(zero_copy_only=False)
    code[null] = len(first)
    df = t.drop_columns([col]).to_pandas()
    df.insert(t.column_names.index(col), col, shared[code])
    return df


def tail_per_rank(t: pa.Table, k: int) -> pa.Table:
    """The last ``k`` rows (arrival order) of each rank."""
    if t.num_rows == 0:
        return t
    keep = _tail_mask(numpy_column(t, "rank"), k)
    return t if keep.all() else t.filter(pa.array(keep))


def window_rows(t: pa.Table, k: int, steps_k: int | None = None) -> pa.Table:
    """The rows among the last ``k`` (arrival order) of their rank that are also of that rank's last ``steps_k``
    steps (no step cut when ``steps_k`` is None), with one filter: the masks come from the rank and step columns
    alone, and the other columns (a collective's member list among them) are copied once, kept rows only."""
    if t.num_rows == 0:
        return t
    rank = numpy_column(t, "rank")
    keep = _tail_mask(rank, k)
    if steps_k is not None:
        kept = np.flatnonzero(keep)
        keep[kept] = _last_steps_mask(rank[kept], numpy_column(t, "step")[kept], steps_k)
    return t if keep.all() else t.filter(pa.array(keep))


def _tail_mask(rank: np.ndarray, k: int) -> np.ndarray:
    """Rows among the last ``k`` (arrival order) of their rank."""
    n = len(rank)
    # position from the end within each rank: stable sort by rank keeps arrival order
    order = np.argsort(rank, kind="stable")
    rs = rank[order]
    ends = np.ones(n, np.bool_)
    ends[:-1] = rs[1:] != rs[:-1]
    end_idx = np.nonzero(ends)[0]
    grp = np.searchsorted(end_idx, np.arange(n))
    from_end = end_idx[grp] - np.arange(n)
    keep = np.zeros(n, np.bool_)
    keep[order[from_end < k]] = True
    return keep


def _last_steps_mask(rank: np.ndarray, step: np.ndarray, k: int) -> np.ndarray:
    """Rows of their rank's last ``k`` steps (step > that rank's newest step - k)."""
    rank, step = rank.astype(np.int64), step.astype(np.int64)
    if len(rank) == 0:
        return np.zeros(0, np.bool_)
    order = np.argsort(rank, kind="stable")
    rs = rank[order]
    starts = np.ones(len(rs), np.bool_)
    starts[1:] = rs[1:] != rs[:-1]
    grp = np.cumsum(starts) - 1
    newest = np.maximum.reduceat(step[order], np.nonzero(starts)[0])
    keep = np.empty(len(rs), np.bool_)
    keep[order] = step[order] > newest[grp] - k
    return keep
