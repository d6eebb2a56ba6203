"""The "rows in key order" marker a compacted part file carries, so readers can skip their sort and dedupe.

The loader (``analyzers.columnar``) sorts each big table by a key and keeps one row per key. The head's compaction
(``head.store.compaction``) sees every row of a partition as it writes it; when those rows are already strictly
increasing by that key (the order the head writes them in, and no key twice), it says so in the file's Parquet
metadata under ``SORTED_KEY``: the key's columns, the file's first and last key, and (collectives) the groups in the
order they first appear, which is how the key orders groups. A reader whose files are all marked, whose files'
key ranges follow each other and whose group orders agree can take the rows as they are. Files without the marker
(older stores, uncompacted parts, a partition that was not in order) take the sort as before.

The key's order is lexicographic over the columns; a group compares by where it first appears in the rows read
(the loader's ``first_seen_order``), so the marker records each file's own first-seen order and the reader checks
that the files' orders agree with the order over all of them.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SORTED_KEY = "ranksight.sorted"
VERSION = 1
GROUP = "group"  # the one string column of a key: ordered by first appearance

# The key each table is deduplicated on by the loader (``analyzers.columnar``), in its sort order.
KEYS: dict[str, tuple[str, ...]] = {
    "steps": ("step", "rank"),
    "collectives": ("attempt", "step", "rank", GROUP, "seq"),
}


class OrderCheck:
    """Fed a table's rows chunk by chunk (as a writer writes them): whether every row's key is strictly greater than
    the row's before (so the rows are sorted by the key and no key repeats). Any null in a key column: not in
    order (the loader would read it as 0)."""

    def __init__(self, table: str):
        self.key = KEYS.get(table)
        self.ok = self.key is not None
        self.first: list | None = None
        self.last: list | None = None  # the last row's key (a group by its first-seen position)
        self.groups: dict[str, int] = {}

    def add(self, t: pa.Table) -> None:
        if not self.ok or not t.num_rows:
            return
        try:
            cols = [self._column(t, c) for c in self.key]
        except (KeyError, ValueError, pa.ArrowException):
            self.ok = False
            return
        if self.last is not None:  # the boundary with the previous chunk
            cols = [np.concatenate(([p], c)) for p, c in zip(self.last, cols)]
        gt = np.zeros(len(cols[0]) - 1, np.bool_)
        eq = np.ones(len(cols[0]) - 1, np.bool_)
        for c in cols:
            gt |= eq & (c[1:] > c[:-1])
            eq &= c[1:] == c[:-1]
        if not bool(gt.all()):
            self.ok = False
            return
        if self.first is None:
            self.first = [c[0].item() for c in cols]
        self.last = [c[-1].item() for c in cols]

    def _column(self, t: pa.Table, name: str) -> np.ndarray:
        col = t.column(name)
        if col.null_count:
            raise ValueError(f"nulls in {name}")
        if name != GROUP:
            return col.to_numpy().astype(np.int64, copy=False)
        arr = col.combine_chunks()
        if pa.types.is_dictionary(arr.type):
            arr = arr.cast(arr.type.value_type)
        enc = pc.dictionary_encode(arr)  # its dictionary in the order of first appearance
        lut = np.array([self.groups.setdefault(s, len(self.groups)) for s in enc.dictionary.to_pylist()] + [0],
                       dtype=np.int64)
        return lut[enc.indices.to_numpy()]

    def metadata(self) -> dict[bytes, bytes]:
        """The marker to add to the file's key-value metadata; empty when the rows are not in order."""
        if not self.ok or self.first is None:
            return {}
        names = list(self.groups)
        pos = self.key.index(GROUP) if GROUP in self.key else -1

        def named(k: list) -> list:
            return [names[v] if i == pos else v for i, v in enumerate(k)]

        body = {"version": VERSION, "key": list(self.key), "first": named(self.first), "last": named(self.last),
                "groups": names}
        return {SORTED_KEY.encode(): json.dumps(body).encode()}


def read_marker(metadata: dict | None, table: str) -> dict | None:
    """A file's marker for ``table`` from its key-value metadata, None when absent, of another key or unreadable."""
    raw = (metadata or {}).get(SORTED_KEY.encode())
    if raw is None:
        return None
    try:
        m = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(m, dict) or m.get("version") != VERSION or tuple(m.get("key") or ()) != KEYS.get(table):
        return None
    if not all(isinstance(m.get(k), list) for k in ("first", "last", "groups")):
        return None
    return m


def in_key_order(table: str, markers: list[dict | None]) -> bool:
    """Whether files with these markers, read in this order, give rows strictly increasing by the table's key."""
    if not markers or any(m is None for m in markers):
        return False
    key = KEYS[table]
    pos = key.index(GROUP) if GROUP in key else -1
    order: dict[str, int] = {}  # the groups' first-seen order over all the files
    for m in markers:
        for g in m["groups"]:
            order.setdefault(g, len(order))
    for m in markers:  # a file's own order must agree with it
        at = [order[g] for g in m["groups"]]
        if at != sorted(at):
            return False

    def comparable(k: list) -> tuple | None:
        if len(k) != len(key):
            return None
        try:
            return tuple(order[v] if i == pos else int(v) for i, v in enumerate(k))
        except (KeyError, TypeError, ValueError):
            return None

    prev = None
    for m in markers:
        first, last = comparable(m["first"]), comparable(m["last"])
        if first is None or last is None or first > last or (prev is not None and not prev < first):
            return False
        prev = last
    return True


def is_compacted_name(path: str | os.PathLike) -> bool:
    from ranksight.store_layout import COMPACTED_PREFIX

    return os.path.basename(os.fspath(path)).startswith(COMPACTED_PREFIX)
