"""Compaction writes steps and collectives in the loader's key order (head/store/sorted_merge.py): parts whose rows
arrive out of order come out sorted and marked, the same rows; a key twice stays twice and is not marked; a crash
mid-compaction leaves the parts readable and nothing lost; the sort holds the keys in memory, not the rows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analyzers import columnar
from analyzers.loader import load_run
from bench import scale_gen
from cli.compact import compact_run
from head.store import compaction, sorted_merge
from ranksight import sort_marker, store_layout, tables
from ranksight.layout import RunDir
from ranksight.tables import SPECS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parts_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("parts")
    scale_gen.generate(scale_gen.Job(ranks=16, steps=60, straggler=3, factor=1.3, onset=20, compact=False), store,
                       log=None)
    return store


def _shuffled_copy(src: Path, dst: Path, seed: int = 7, pieces: int = 5) -> Path:
    """The store with each steps/collectives partition's rows shuffled into ``pieces`` new part files (ranks that
    ship independently: no row in key order, groups first seen in another order)."""
    shutil.copytree(src, dst)
    rng = np.random.default_rng(seed)
    for table in ("steps", "collectives"):
        tdir = RunDir(dst, scale_gen.RUN).table(table)
        by_part: dict[str, list] = {}
        for f in store_layout.table_files(tdir):
            by_part.setdefault(f.partition, []).append(f)
        for part, fs in by_part.items():
            t = pa.concat_tables([pq.read_table(f.path) for f in fs])
            for f in fs:
                os.unlink(f.path)
            t = t.take(pa.array(rng.permutation(t.num_rows)))
            for i, chunk in enumerate(np.array_split(np.arange(t.num_rows), pieces)):
                pq.write_table(t.take(pa.array(chunk)), Path(tdir) / part / f"part-{i + 1}-1-{i:06d}.parquet")
    return dst


def _files(store: Path, table: str) -> list:
    return tables.part_files(RunDir(store, scale_gen.RUN).table(table))


def _keys_sorted(frame: pd.DataFrame, table: str) -> pd.DataFrame:
    key = list(sort_marker.KEYS[table])
    out = frame.drop(columns=[c for c in ("group_ranks", "gkey") if c in frame.columns])
    out = out.assign(group=out["group"].astype(str)) if "group" in out.columns else out
    return out.sort_values(key, kind="stable").reset_index(drop=True)


def test_rows_out_of_order_come_out_sorted_marked_and_the_same(parts_store, tmp_path, monkeypatch):
    store = _shuffled_copy(parts_store, tmp_path / "s")
    for table in ("steps", "collectives"):
        assert not columnar.marked_in_order(table, _files(store, table))
    before = load_run(store, scale_gen.RUN, progress=False)  # the parts, through the loader's sort
    rows_before = {t: pa.concat_tables([pq.read_table(f) for f in _files(store, t)]) for t in ("steps", "collectives")}
    counts = compact_run(RunDir(store, scale_gen.RUN).root)
    assert counts["steps"]["marked"] == counts["steps"]["partitions"] >= 1
    assert counts["collectives"]["marked"] == counts["collectives"]["partitions"] >= 1
    for table in ("steps", "collectives"):
        files = _files(store, table)
        assert all(sort_marker.is_compacted_name(f) for f in files)
        assert columnar.marked_in_order(table, files), table
        after = pa.concat_tables([pq.read_table(f) for f in files])
        # the same rows (as a multiset), now in key order
        a = after.to_pandas().drop(columns="group_ranks", errors="ignore")
        b = rows_before[table].to_pandas().drop(columns="group_ranks", errors="ignore")
        assert len(a) == len(b)
        key = list(sort_marker.KEYS[table])
        pd.testing.assert_frame_equal(a.sort_values(list(a.columns)).reset_index(drop=True),
                                      b[a.columns].sort_values(list(a.columns)).reset_index(drop=True))
        if table == "steps":
            assert list(zip(a["step"], a["rank"])) == sorted(zip(a["step"], a["rank"]))
        else:
            assert a[key[:3]].apply(tuple, axis=1).is_monotonic_increasing
    marked = load_run(store, scale_gen.RUN, progress=False)
    with monkeypatch.context() as m:  # the compacted file read as if unmarked: the sort finds nothing to move
        m.setattr(columnar, "marked_in_order", lambda table, files: False)
        sorted_again = load_run(store, scale_gen.RUN, progress=False)
    for name in ("steps", "collectives"):
        a, b = getattr(marked, name), getattr(sorted_again, name)
        if "group_ranks" in a.columns:
            assert [list(x) for x in a["group_ranks"]] == [list(x) for x in b["group_ranks"]]
            a, b = a.drop(columns="group_ranks"), b.drop(columns="group_ranks")
        pd.testing.assert_frame_equal(a, b, obj=name)
        # and the frames the shuffled parts gave, up to the order of a rank's groups within a step
        pd.testing.assert_frame_equal(_keys_sorted(getattr(before, name), name), _keys_sorted(a, name), obj=name)


def test_a_key_twice_stays_twice_sorted_and_unmarked(parts_store, tmp_path):
    src = _files(parts_store, "steps")
    t = pa.concat_tables([pq.read_table(f) for f in src])
    again = t.slice(5, 1)
    again = again.set_column(again.schema.get_field_index("t_end"), "t_end",
                             pa.array([again["t_end"][0].as_py() + 1.0]))
    d = tmp_path / "p"
    d.mkdir()
    pq.write_table(t.slice(0, t.num_rows // 2), d / "part-2-1-000002.parquet")
    pq.write_table(pa.concat_tables([again, t.slice(t.num_rows // 2)]), d / "part-1-1-000001.parquet")
    inputs = store_layout.list_table(d)
    out = tmp_path / "merged.parquet"
    covers, rows = compaction.merge_to(inputs, out, False, SPECS["steps"].schema, "steps")
    assert rows == t.num_rows + 1 and len(covers) == 2
    got = pq.read_table(out)
    assert sort_marker.read_marker(pq.read_metadata(out).metadata, "steps") is None  # a key twice: no marker
    keys = list(zip(got["step"].to_pylist(), got["rank"].to_pylist()))
    assert keys == sorted(keys) and len(keys) == t.num_rows + 1
    # the loader keeps the newer copy (its t_end later), as from the parts
    from_parts = columnar.steps_frame(columnar.read_columns("steps", [Path(f.path) for f in inputs])[0])
    from_merged = columnar.steps_frame(columnar.read_columns("steps", [out])[0])
    pd.testing.assert_frame_equal(from_parts.reset_index(drop=True), from_merged.reset_index(drop=True))


def test_group_order_is_the_sorted_rows_own():
    # rank 1's rows arrive first (its groups "tp1", "dp"), rank 0's after ("tp0", "dp"): sorted, rank 0 comes first,
    # with dp (seen in the input before tp0) first, so the groups' order in the output is dp, tp0, tp1, and the rows
    # are in that order (the marker's check); in the input's own first-seen order (tp1, dp, tp0) they would not be
    keys = sorted_merge.Keys("collectives")
    rows = [(0, 0, 1, "tp1", 0), (0, 0, 1, "dp", 1), (0, 0, 0, "tp0", 0), (0, 0, 0, "dp", 1)]
    names = sort_marker.KEYS["collectives"]
    t = pa.table({n: pa.array(c, pa.string() if n == "group" else pa.int64()) for n, c in zip(names, zip(*rows))})
    keys.add(t)
    order = sorted_merge.row_order("collectives", keys)
    out = t.take(pa.array(order))
    assert out["group"].to_pylist() == ["dp", "tp0", "dp", "tp1"]
    check = sort_marker.OrderCheck("collectives")
    check.add(out)
    m = sort_marker.read_marker(check.metadata(), "collectives")
    assert m is not None and m["groups"] == ["dp", "tp0", "tp1"]


def test_a_crash_mid_sort_leaves_the_parts_readable(parts_store, tmp_path, monkeypatch):
    store = _shuffled_copy(parts_store, tmp_path / "s", pieces=3)
    tdir = Path(RunDir(store, scale_gen.RUN).table("collectives"))
    before = _files(store, "collectives")
    rows = sum(pq.read_metadata(f).num_rows for f in before)

    def crash(self, idx):
        raise OSError("disk full")

    monkeypatch.setattr(sorted_merge.Spill, "take", crash)
    with pytest.raises(OSError):
        compaction.recompact_table(tdir, "collectives", SPECS["collectives"].schema)
    after = _files(store, "collectives")
    assert after == before and sum(pq.read_metadata(f).num_rows for f in after) == rows
    assert not [p for p in tdir.rglob(".*")]  # neither the output's nor the spill's dot-file left
    # a process killed mid-sort leaves dot-files: invisible to readers, cleared by the next round
    part = before[0].parent
    (part / f".compacted-1-1.parquet{compaction.SPILL_SUFFIX}").write_bytes(b"half")
    (part / ".compacted-1-1.parquet.tmp").write_bytes(b"half")
    assert _files(store, "collectives") == before
    monkeypatch.undo()
    counts = compaction.recompact_table(tdir, "collectives", SPECS["collectives"].schema)
    assert counts["marked"] == counts["partitions"] >= 1 and counts["rows"] == rows
    assert not [p for p in tdir.rglob(".*")]


def test_head_round_compacts_sorted(tmp_path):
    # the head's own compaction (RunStore.compact) writes rows that arrive out of order sorted and marked
    from head.store import Store
    from ranksight import schema

    st = Store(tmp_path, flush_rows=10)
    rs = st.run("r1")
    recs = [schema.StepRecord(run_id="r1", rank=r, step=s, node=0, host="h", world_size=4, t_start=1000.0 + s,
                              t_end=1000.5 + s, step_ms=500.0)
            for s in (2, 0, 1) for r in (3, 1, 2, 0)]  # ranks and steps arrive out of order, a part per flush
    for i in range(0, len(recs), 4):
        rs.add("steps", recs[i:i + 4])
        rs.flush()
    rs.compact(everything=True, cleanup_delay=0)
    files = tables.part_files(RunDir(tmp_path, "r1").table("steps"))
    assert len(files) == 1 and columnar.marked_in_order("steps", files)
    got = pq.read_table(files[0], columns=["step", "rank"])
    assert list(zip(got["step"].to_pylist(), got["rank"].to_pylist())) == [(s, r) for s in range(3) for r in range(4)]
    st.close()


MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    from head.store import compaction
    from ranksight import store_layout
    from ranksight.tables import SPECS

    d, ranks, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    compaction.SORT = sys.argv[4] == "1"
    schema = SPECS["collectives"].schema
    rng = np.random.default_rng(1)
    part = 0
    for s0 in range(0, steps, 25):  # a part per 25 steps; the ranks' rows in a random order inside it
        s = np.repeat(np.arange(s0, min(s0 + 25, steps)), ranks * 2)
        r = np.tile(np.repeat(np.arange(ranks), 2), len(s) // (ranks * 2))
        g = np.where(np.arange(len(s)) % 2 == 0, "dp", np.char.add("tp", (r // 8).astype(str)))
        perm = rng.permutation(len(s))
        n = len(s)
        cols = {"run_id": pa.array(["run"] * n), "rank": r[perm], "step": s[perm], "seq": np.arange(n) % 2,
                "op": pa.array(["all_reduce"] * n), "group": pa.array(g[perm]),
                "group_ranks": pa.array([[]] * n, pa.list_(pa.int64())), "nbytes": np.full(n, 1 << 20),
                "t_arrive": rng.random(n) + s[perm], "t_done": rng.random(n) + s[perm] + 1,
                "duration_ms": rng.random(n) * 10, "attempt": np.zeros(n, np.int64),
                "comm_id": pa.array(g[perm]), "ops": np.ones(n, np.int64)}
        t = pa.Table.from_pydict(cols).cast(schema)
        part += 1
        pq.write_table(t, d / f"part-{part:06d}-1-{part:06d}.parquet")
    del t, cols
    pa.default_memory_pool().release_unused()
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith(("VmHWM", "RssAnon")):
                yield int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here
    start = dict(zip(("hwm", "anon"), hwm()))
    inputs = store_layout.visible(store_layout.list_table(d))
    rows = sum(pq.read_metadata(f.path).num_rows for f in inputs)
    covers, got = compaction.merge_to(inputs, d / "out.parquet", False, schema, "collectives")
    peak = list(hwm())[0]
    size = sum(pq.read_metadata(f.path).num_rows for f in inputs)
    table_bytes = pq.read_table(d / "out.parquet").nbytes
    print(json.dumps({"rows": got, "start": start["hwm"], "peak": peak, "table_bytes": table_bytes,
                      "marked": b"ranksight.sorted" in pq.read_metadata(d / "out.parquet").metadata}))
""")


def _probe(d: Path, sort: bool) -> dict:
    d.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(d), "2048", "250", "1" if sort else "0"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_sort_memory_is_the_keys_not_the_rows(tmp_path):
    # 2,048 ranks x 250 steps x 2 collectives, rows shuffled within each part: ~1 M rows. The sort's peak (VmHWM
    # reset before the compaction) exceeds an unsorted compaction's by less than 64 bytes a row (the key columns,
    # one int64 code and the order), where holding the rows to sort them would take their ~113 bytes a row, twice
    rows = 2048 * 250 * 2
    plain, srt = _probe(tmp_path / "plain", False), _probe(tmp_path / "sorted", True)
    assert plain["rows"] == srt["rows"] == rows and srt["marked"] and not plain["marked"]
    assert srt["table_bytes"] > 100 * rows
    extra = (srt["peak"] - srt["start"]) - (plain["peak"] - plain["start"])
    assert extra < 64 * rows, (plain, srt)


def test_compacted_encodings_read_by_duckdb(parts_store, tmp_path):
    # dictionaries for strings and integers, BYTE_STREAM_SPLIT for floats, snappy pages: DuckDB reads the same
    # values pyarrow does
    duckdb = pytest.importorskip("duckdb")
    store = _shuffled_copy(parts_store, tmp_path / "s", pieces=2)
    compact_run(RunDir(store, scale_gen.RUN).root)
    for table in ("steps", "collectives", "gpu"):
        (f,) = _files(store, table)
        meta = pq.ParquetFile(f).metadata
        encodings = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i).encodings
                     for i in range(meta.num_columns)}
        assert {meta.row_group(0).column(i).compression for i in range(meta.num_columns)} == {"SNAPPY"}
        codecs = duckdb.connect().execute(f"select distinct compression from parquet_metadata('{f}')").fetchall()
        assert codecs == [("SNAPPY",)]
        floats = [n for n in SPECS[table].schema.names if pa.types.is_floating(SPECS[table].schema.field(n).type)]
        assert floats and all("BYTE_STREAM_SPLIT" in encodings[n] for n in floats), encodings
        want = pq.read_table(f).to_pandas()
        got = duckdb.connect().execute(f"select * from read_parquet('{f}')").df()
        for c in floats + ["rank" if "rank" in want.columns else "node"]:
            np.testing.assert_array_equal(got[c].to_numpy(dtype=float), want[c].to_numpy(dtype=float))


def test_snappy_and_lz4_compacted_files_load_the_same(parts_store, tmp_path, monkeypatch):
    """A store compacted with snappy pages loads the same frames as one compacted with LZ4 (``COMPRESSION``'s other
    choice)."""
    frames = {}
    for codec in ("snappy", "lz4"):
        store = _shuffled_copy(parts_store, tmp_path / codec, pieces=2)
        with monkeypatch.context() as m:
            m.setattr(compaction, "COMPRESSION", codec)
            compact_run(RunDir(store, scale_gen.RUN).root)
        (f,) = _files(store, "steps")
        assert pq.ParquetFile(f).metadata.row_group(0).column(0).compression == codec.upper()
        frames[codec] = load_run(store, scale_gen.RUN)
    for table in ("steps", "collectives", "gpu", "host"):
        pd.testing.assert_frame_equal(getattr(frames["lz4"], table), getattr(frames["snappy"], table),
                                      check_exact=True, obj=table)


def test_a_big_unsorted_compacted_file_is_sorted_a_row_group_at_a_time(parts_store, tmp_path, monkeypatch):
    # a store an earlier head compacted without sorting: one big file per partition, compacted again (sorted) while
    # read a row group at a time
    store = _shuffled_copy(parts_store, tmp_path / "s")
    with monkeypatch.context() as m:
        m.setattr(compaction, "SORT", False)
        compact_run(RunDir(store, scale_gen.RUN).root)
    (old,) = _files(store, "collectives")
    assert not columnar.marked_in_order("collectives", [old])
    want = pq.read_table(old).to_pandas().drop(columns="group_ranks")
    monkeypatch.setattr(compaction, "BIG_INPUT_ROWS", 100)
    monkeypatch.setattr(compaction, "ROW_GROUP_ROWS", 100)
    read_whole = []
    monkeypatch.setattr(pq.ParquetFile, "read", lambda self, *a, **k: read_whole.append(1))
    counts = compact_run(RunDir(store, scale_gen.RUN).root)
    assert counts["collectives"]["marked"] == 1 and not read_whole
    (new,) = _files(store, "collectives")
    got = pq.read_table(new).to_pandas().drop(columns="group_ranks")
    assert len(got) == len(want) > 100
    pd.testing.assert_frame_equal(got.sort_values(list(got.columns)).reset_index(drop=True),
                                  want.sort_values(list(got.columns)).reset_index(drop=True))
