"""The live window's tables cut per rank and turned into the analyzers' DataFrames.

``RunLive.run_data`` builds each analysis round's input with these: ``analysis_frame`` cuts the steps and
collectives (a deque of Arrow batches) to each rank's last rows without sorting the window (``window_chunks``)
and converts what is left column by column into the frames ``RunData.normalize`` would give
(``analyzers.columnar``, as ``diagnose`` reads a store), ``samples_frame_of`` does the same for the GPU samples
(each GPU's last ones, cut by ``window_chunks`` on a GPU key), and ``ConvertedWindow`` turns the host sample deque
into an Arrow table, converting each sample once across rounds. ``window_rows`` and
``to_pandas_shared_lists`` are the row-wise way (a window whose batches lack a column the columnar reader
wants).
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


# a column's shared dictionary starts anew past this many values (a GPU's uuid: one per GPU; a communicator's id: one
# per communicator), so values that churn do not pile up in it
DICT_MAX = 1 << 18


class SharedDictionaries:
    """The string columns ``columns`` of a live window's batches, dictionary-encoded (int32 indices) against one
    dictionary per column that the batches share: a value (a run id, host, op, group, communicator id, device name)
    is held once, not once per row. A batch's values not in the dictionary yet are appended to it (a new dictionary
    array, which the next batches share); past ``DICT_MAX`` values the dictionary starts anew. ``encode`` runs under
    the window's lock (one batch at a time)."""

    def __init__(self, columns: tuple[str, ...]):
        self.columns = columns
        self.values: dict[str, pa.Array] = {}

    def encode(self, t: pa.Table) -> pa.Table:
        for name in self.columns:
            i = t.schema.get_field_index(name)
            if i < 0:
                continue
            col = t.column(i).combine_chunks()
            if pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            if not pa.types.is_string(col.type):
                continue
            known = self.values.get(name)
            if known is None or len(known) >= DICT_MAX:
                known = pa.array([], pa.string())
            idx = pc.index_in(col, value_set=known)
            if idx.null_count > col.null_count:  # values not in the dictionary yet
                new = pc.unique(col.filter(pc.and_(pc.is_null(idx), pc.is_valid(col))))
                known = pa.concat_arrays([known, new])
                idx = pc.index_in(col, value_set=known)
            self.values[name] = known
            t = t.set_column(i, name, pa.DictionaryArray.from_arrays(idx.cast(pa.int32()), known))
        return t


def plain_strings(t: pa.Table) -> pa.Table:
    """``t`` with its dictionary-encoded columns as plain ones (the row-wise conversion's input)."""
    for i, f in enumerate(t.schema):
        if pa.types.is_dictionary(f.type):
            t = t.set_column(i, f.name, t.column(i).cast(f.type.value_type))
    return t


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
    order, _, from_end = _from_end(rank)
    keep = np.zeros(len(rank), np.bool_)
    keep[order[from_end < k]] = True
    return keep


def _from_end(rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the rows in rank order, their ranks, each row's position from the end of its rank's rows): a stable sort by
    rank keeps arrival order within a rank."""
    n = len(rank)
    order = np.argsort(rank, kind="stable")
    rs = rank[order]
    ends = np.ones(n, np.bool_)
    ends[:-1] = rs[1:] != rs[:-1]
    end_idx = np.nonzero(ends)[0]
    grp = np.searchsorted(end_idx, np.arange(n))
    return order, rs, end_idx[grp] - np.arange(n)


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


def window_chunks(chunks: list[pa.Table], k: int, steps_k: int | None = None,
                  keys: list[np.ndarray] | None = None) -> list[pa.Table]:
    """``window_rows(pa.concat_tables(chunks), k, steps_k)`` as a list of the chunks' kept rows, without sorting
    the window by rank: the chunks (in arrival order) are walked from the newest, counting each rank's rows
    (``np.bincount``), so a chunk whose every row is still within its rank's last ``k`` is kept whole, one whose
    ranks all have their ``k`` already is dropped, and only a chunk that straddles a rank's cut is ranked row by
    row. The step cut takes each rank's newest step in one ``np.maximum.at``. At 16,384 ranks a stable sort of the
    window by rank costs about a second; this is a few passes over the rank column.

    ``keys``: each chunk's rows' key (an integer array per chunk) to cut by instead of the rank column (the GPU
    samples' window: each GPU's last ``k``; no step cut then)."""
    if keys is None:
        ranks = [numpy_column(c, "rank").astype(np.int64, copy=False) if c.num_rows else np.zeros(0, np.int64)
                 for c in chunks]
    else:
        ranks = [np.asarray(r, np.int64) for r in keys]
    some = [r for r in ranks if len(r)]
    if not some:
        return []
    lo = min(int(r.min()) for r in some)
    n_ranks = max(int(r.max()) for r in some) - lo + 1
    if n_ranks > 4 * sum(len(r) for r in some) + 4096:  # ranks spread far wider than the rows: counts per rank would
        if keys is not None:  # dwarf the window; the sort is cheaper then
            t = pa.concat_tables(chunks)
            keep = _tail_mask(np.concatenate(ranks), k)
            return [t if keep.all() else t.filter(pa.array(keep))]
        return [window_rows(pa.concat_tables(chunks), k, steps_k)]
    remaining = np.full(n_ranks, k, np.int64)
    keeps: list[np.ndarray | bool] = [False] * len(chunks)
    for i in range(len(chunks) - 1, -1, -1):
        r = ranks[i] - lo
        if not len(r):
            continue
        cnt = np.bincount(r, minlength=n_ranks)
        here = cnt > 0
        if (cnt[here] <= remaining[here]).all():
            keeps[i] = True  # every row of this chunk is among its rank's last k
        elif remaining[here].any():
            keeps[i] = _tail_mask_by(r, remaining)
        remaining -= np.minimum(cnt, remaining)
    if steps_k is not None:
        newest = np.full(n_ranks, np.iinfo(np.int64).min, np.int64)
        steps = []
        for c, r, keep in zip(chunks, ranks, keeps):
            if keep is False:
                steps.append(None)
                continue
            s = numpy_column(c, "step").astype(np.int64, copy=False)
            steps.append(s)
            if keep is True:
                np.maximum.at(newest, r - lo, s)
            else:
                np.maximum.at(newest, r[keep] - lo, s[keep])
        for i, (r, s, keep) in enumerate(zip(ranks, steps, keeps)):
            if keep is False:
                continue
            recent = s > newest[r - lo] - steps_k
            keeps[i] = recent if keep is True else (keep & recent)
    out = []
    for c, keep in zip(chunks, keeps):
        if keep is True:
            out.append(c)
        elif keep is not False and keep.all():
            out.append(c)
        elif keep is not False and keep.any():
            out.append(c.filter(pa.array(keep)))
    return out


def _tail_mask_by(rank: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Rows among the last ``room[rank]`` (arrival order) of their rank in one chunk (``rank``: 0-based)."""
    order, rs, from_end = _from_end(rank)
    keep = np.zeros(len(rank), np.bool_)
    keep[order[from_end < room[rs]]] = True
    return keep


def analysis_frame(table: str, chunks: list[pa.Table], k: int, steps_k: int | None = None,
                   communicators: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """The rows of ``chunks`` (the live window of ``table``: steps or collectives, Arrow batches in the store's
    schema, arrival order) among each rank's last ``k`` (and of its last ``steps_k`` steps), as the frame
    ``RunData.normalize`` gives (``RunData(prepared=...)`` leaves it as it is): converted column by column by
    ``analyzers.columnar``, the reader ``diagnose`` uses on a store (numbers as numpy arrays, strings as
    Categoricals, duplicates dropped, each collective's members and communicator key per communicator, not per
    row). None when the window has no rows, or a batch lacks a column that reader wants (a window from an older
    writer): the caller converts row-wise then."""
    from analyzers import columnar  # imported on use: the head runs (without live analysis) without the analyzers
    from analyzers.collectives import group_key

    want = columnar.wanted_columns(table)
    if any(name not in c.column_names for c in chunks for name in want):
        return None
    kept = [c.select(want) for c in window_chunks(chunks, k, steps_k)]
    n = sum(c.num_rows for c in kept)
    if n == 0:
        return None
    cols = columnar.fill_columns(table, n, (b for c in kept for b in c.to_batches()))
    if table == "steps":
        return columnar.steps_frame(cols)
    return columnar.collectives_frame(cols, communicators, group_key)


def samples_frame_of(table: str, chunks: list[pa.Table]) -> pd.DataFrame | None:
    """The GPU (or host) samples in ``chunks`` (Arrow batches in the store's schema, arrival order) as the frame the
    store's columnar reader gives ``diagnose`` (``analyzers.columnar``: the columns the analyzers read, numbers as
    numpy arrays, strings as Categoricals, sorted by time), converted column by column with no Python object per
    row. None when there is no row or a batch lacks one of those columns (the caller converts row-wise then)."""
    from analyzers import columnar  # imported on use: the head runs (without live analysis) without the analyzers

    want = columnar.wanted_columns(table)
    if any(name not in c.column_names for c in chunks for name in want):
        return None
    n = sum(c.num_rows for c in chunks)
    if n == 0:
        return None
    cols = columnar.fill_columns(table, n, (b for c in chunks for b in c.select(want).to_batches()))
    return None if cols is None else columnar.samples_frame(cols)
