"""The column builders ``analyzers.columnar`` fills as a table's part files are decoded: each column allocated once at
its full length and filled chunk by chunk (``put(arr, at)``), then handed over (``done(n)``).

- ``Numbers``: a numeric column, nulls as a fill value or NaN;
- ``Strings``: a string column as a Categorical, categories in sorted order;
- ``Lists``/``MemberLists``: the collectives' own member lists (an older writer's), kept only where one is not empty.

A column is filled by one thread at a time (``fill_columns`` gives each column to one converting thread), into its
own rows: the builders hold no lock.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc


class Numbers:
    """A numeric column filled chunk by chunk into one array; nulls become ``fill`` (None: NaN)."""

    def __init__(self, n: int, dtype, fill):
        self.out = np.empty(n, dtype)
        self.fill = fill

    def put(self, arr: pa.ChunkedArray, at: int) -> None:
        for chunk in arr.chunks:  # chunk by chunk: each one's numbers copied once, straight into the column
            if chunk.null_count and self.fill is not None:
                chunk = pc.fill_null(chunk, pa.scalar(self.fill, chunk.type))
            v = chunk.to_numpy(zero_copy_only=False)
            if v.dtype == object:  # booleans with nulls and no fill: False
                v = np.array([bool(x) for x in v], dtype=np.bool_)
            self.out[at:at + len(v)] = v
            at += len(v)

    def done(self, n: int) -> np.ndarray:
        return self.out[:n] if n < len(self.out) else self.out


class Strings:
    """A string column as Categorical codes: each chunk's dictionary mapped into one growing set of categories;
    at the end the categories sorted (a sort by the Categorical is the sort by the string)."""

    def __init__(self, n: int):
        # codes as narrow as the categories allow, widened when they grow past it (a run's strings are few: hosts,
        # groups, ops, communicator ids), so the column in the making is not 4 bytes a row
        self.codes = np.empty(n, np.int8)
        self.index: dict[str, int] = {}

    def put(self, arr: pa.ChunkedArray, at: int) -> None:
        if not pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_encode()
        arr = arr.unify_dictionaries()  # the chunks' dictionaries as one
        if not arr.num_chunks:
            return
        lut = [self.index.setdefault(s, len(self.index)) if s is not None else -1
               for s in arr.chunk(0).dictionary.to_pylist()] + [-1]  # the last slot: null
        while len(self.index) >= np.iinfo(self.codes.dtype).max:
            self.codes = self.codes.astype(np.int16 if self.codes.dtype == np.int8 else np.int32)
        lut = np.array(lut, dtype=self.codes.dtype)
        for chunk in arr.chunks:  # each chunk's indices mapped straight into the column (null: -1, the last slot)
            idx = chunk.indices
            codes = pc.fill_null(idx, -1).to_numpy() if idx.null_count else idx.to_numpy()
            np.take(lut, codes, out=self.codes[at:at + len(codes)], mode="wrap")
            at += len(codes)

    def done(self, n: int) -> pd.Categorical:
        cats = sorted(self.index)
        width = np.int8 if len(cats) < 127 else np.int16 if len(cats) < 32767 else np.int32
        lut = np.full(len(cats) + 1, -1, width)
        for new, s in enumerate(cats):
            lut[self.index[s]] = new
        codes = self.codes[:n]
        if codes.dtype != width or not np.array_equal(lut[:-1], np.arange(len(cats))):
            codes = np.take(lut, codes, mode="wrap")  # (null, -1: the last slot, -1)
        # else the strings came in sorted order (one host, group, op...): the codes are already the Categorical's
        return pd.Categorical.from_codes(codes, categories=pd.Index(cats, dtype=object), validate=False)


class Lists:
    """A list column (collectives' ``group_ranks``): each row's length; the lists themselves only where one is not
    empty (records of an older writer that carry their member list)."""

    def __init__(self, n: int):
        self.lengths = np.empty(n, np.int32)
        self.pieces: list[tuple[int, pa.ChunkedArray]] = []

    def put(self, arr: pa.ChunkedArray, at: int) -> None:
        if all(len(c.values) == 0 for c in arr.chunks):  # every list empty or null (a writer with comm_ids)
            self.lengths[at:at + len(arr)] = 0
            return
        ln = pc.fill_null(pc.list_value_length(arr), 0).to_numpy()
        self.lengths[at:at + len(arr)] = ln
        if ln.any():
            self.pieces.append((at, arr))

    def done(self, n: int) -> "MemberLists":
        return MemberLists(self.lengths[:n], self.pieces)


class MemberLists:
    """Rows' own member lists: their lengths, and (only where one is not empty) the arrays."""

    def __init__(self, lengths: np.ndarray, pieces: list[tuple[int, pa.Array]]):
        self.lengths = lengths
        self.pieces = pieces
        self._rows: np.ndarray | None = None  # the row each of ``lengths`` came from, after ``take``

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, idx: np.ndarray) -> "MemberLists":
        out = MemberLists(self.lengths[idx], self.pieces)
        out._rows = (self._rows[idx] if self._rows is not None else idx)
        return out

    def arrays(self, rows: np.ndarray) -> list[np.ndarray]:
        """The member arrays of ``rows`` (positions in this column)."""
        src = self._rows[rows] if self._rows is not None else rows
        starts = np.array([s for s, _ in self.pieces], dtype=np.int64)
        out = []
        for r in src:
            k = int(np.searchsorted(starts, r, side="right")) - 1
            at, arr = self.pieces[k]
            out.append(np.asarray(arr[int(r) - at].values.to_numpy(zero_copy_only=False)))
        return out
