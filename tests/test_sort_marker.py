"""The sorted marker compaction writes (ranksight/sort_marker.py) and the loader's use of it: a marked store loads
to the same frames without the sort and dedupe; rows out of order, a key twice, a null key, files that overlap or
disagree on the groups' order get no marker (or are not trusted), and take the sort as before."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analyzers import columnar
from analyzers.loader import load_run
from bench import scale_gen
from head.store import compaction
from ranksight import sort_marker, store_layout, tables
from ranksight.layout import RunDir
from ranksight.tables import SPECS


def _keys(table: str, rows: list[tuple]) -> pa.Table:
    names = sort_marker.KEYS[table]
    cols = list(zip(*rows)) if rows else [[] for _ in names]
    return pa.table({n: pa.array(c, pa.string() if n == "group" else pa.int64()) for n, c in zip(names, cols)})


def _marker(table: str, *chunks: list[tuple]) -> dict | None:
    check = sort_marker.OrderCheck(table)
    for rows in chunks:
        check.add(_keys(table, rows))
    return sort_marker.read_marker(check.metadata(), table)


def test_order_check_marks_only_strictly_increasing_keys():
    m = _marker("steps", [(0, 0), (0, 1), (1, 0)], [(1, 1), (2, 0)])
    assert m is not None and m["first"] == [0, 0] and m["last"] == [2, 0]
    assert _marker("steps", [(0, 1), (0, 0)]) is None  # out of order
    assert _marker("steps", [(0, 0), (0, 0)]) is None  # a key twice (a duplicate the loader drops)
    assert _marker("steps", [(0, 0), (1, 0)], [(0, 5)]) is None  # out of order across chunks
    assert _marker("steps") is None  # no rows: nothing to say
    nulls = sort_marker.OrderCheck("steps")
    nulls.add(pa.table({"step": pa.array([0, None], pa.int64()), "rank": pa.array([0, 1], pa.int64())}))
    assert not nulls.metadata()
    assert not sort_marker.OrderCheck("gpu").metadata()  # a table without a key: never marked


def test_order_check_orders_groups_by_first_appearance():
    # (attempt, step, rank, group, seq): "tp" appears first, so it sorts before "dp" (the loader's first_seen_order)
    m = _marker("collectives", [(0, 0, 0, "tp", 0), (0, 0, 0, "dp", 0), (0, 0, 1, "tp", 0), (0, 0, 1, "dp", 0)])
    assert m is not None and m["groups"] == ["tp", "dp"] and m["last"] == [0, 0, 1, "dp", 0]
    assert _marker("collectives", [(0, 0, 0, "tp", 0), (0, 0, 0, "dp", 0), (0, 0, 1, "dp", 0),
                                   (0, 0, 1, "tp", 0)]) is None


def test_files_must_follow_each_other_and_agree_on_groups():
    a = _marker("steps", [(0, 0), (0, 1)])
    b = _marker("steps", [(1, 0), (1, 1)])
    assert sort_marker.in_key_order("steps", [a, b])
    assert not sort_marker.in_key_order("steps", [b, a])  # listed in the other order
    assert not sort_marker.in_key_order("steps", [a, a])  # the same keys twice
    assert not sort_marker.in_key_order("steps", [a, None])  # one file unmarked
    assert not sort_marker.in_key_order("steps", [])
    c1 = _marker("collectives", [(0, 0, 0, "tp", 0), (0, 0, 0, "dp", 0)])
    c2 = _marker("collectives", [(0, 1, 0, "tp", 0), (0, 1, 0, "dp", 0)])
    c3 = _marker("collectives", [(0, 1, 0, "dp", 0), (0, 1, 0, "tp", 0)])
    assert sort_marker.in_key_order("collectives", [c1, c2])
    assert not sort_marker.in_key_order("collectives", [c1, c3])  # dp before tp there: the loader's order differs
    assert sort_marker.read_marker({b"ranksight.sorted": b"not json"}, "steps") is None
    assert sort_marker.read_marker({b"ranksight.sorted": json.dumps(a).encode()}, "collectives") is None


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    store = tmp_path_factory.mktemp("marked")
    scale_gen.generate(scale_gen.Job(ranks=16, steps=60, straggler=3, factor=1.3, onset=20, compact=True), store,
                       log=None)
    return store


def _files(store: Path, table: str) -> list:
    return tables.part_files(RunDir(store, scale_gen.RUN).table(table))


def test_compaction_marks_a_store_in_order(compacted):
    for table in ("steps", "collectives"):
        files = _files(compacted, table)
        assert files and all(sort_marker.is_compacted_name(f) for f in files)
        metas = [pq.read_metadata(f).metadata for f in files]
        assert all(sort_marker.read_marker(m, table) is not None for m in metas), table
        assert columnar.marked_in_order(table, files)
    assert not columnar.marked_in_order("gpu", _files(compacted, "gpu"))


def test_marked_store_loads_the_same_frames_without_sorting(compacted, monkeypatch):
    def no_sort(*a, **k):
        raise AssertionError("sorted_last called on a marked store")

    with monkeypatch.context() as m:
        m.setattr(columnar, "sorted_last", no_sort)
        fast = load_run(compacted, scale_gen.RUN, progress=False)
    with monkeypatch.context() as m:
        m.setattr(columnar, "marked_in_order", lambda table, files: False)  # as an unmarked store: the sort
        slow = load_run(compacted, scale_gen.RUN, progress=False)
    for name in ("steps", "collectives", "gpu", "host"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert len(a) > 0
        if "group_ranks" in a.columns:  # arrays per row: compared as lists
            assert [list(x) for x in a["group_ranks"]] == [list(x) for x in b["group_ranks"]]
            a, b = a.drop(columns="group_ranks"), b.drop(columns="group_ranks")
        pd.testing.assert_frame_equal(a, b, obj=name)


def test_rows_out_of_order_get_no_marker_and_still_load_sorted(compacted, tmp_path, monkeypatch):
    monkeypatch.setattr(compaction, "SORT", False)  # a compaction that keeps the rows' order (as before session 13)
    src = _files(compacted, "steps")[0]
    t = pq.read_table(src)
    swapped = pa.concat_tables([t.slice(1, 1), t.slice(0, 1), t.slice(2)])  # the first two rows swapped
    part = tmp_path / "part-1-1-000001.parquet"
    pq.write_table(swapped, part)
    out = tmp_path / "merged.parquet"
    compaction.merge_to([store_layout.list_table(tmp_path)[0]], out, False, SPECS["steps"].schema, "steps")
    meta = pq.read_metadata(out).metadata
    assert b"ranksight.covers" in meta and sort_marker.read_marker(meta, "steps") is None
    # loaded through the sort: the same rows in (step, rank) order
    cols, _bad = columnar.read_columns("steps", [out])
    st = columnar.steps_frame(cols, columnar.marked_in_order("steps", [out]))
    assert list(zip(st["step"][:3], st["rank"][:3])) == [(0, 0), (0, 1), (0, 2)]
