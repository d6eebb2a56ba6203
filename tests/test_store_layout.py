"""The store's layout (Hive partitions run=/hour=), compaction by the head and its crash windows, object storage
(S3 API of moto's server on 127.0.0.1), and the fleet query of docs/store.md in DuckDB."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import duckdb
import msgspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from head.store import RunStore, Store, compaction
from ranksight import schema, store_layout
from ranksight.tables import part_files, read_table

H0 = 1_795_000_000.0 - (1_795_000_000.0 % 3600)  # the start of a UTC hour
LABEL0 = store_layout.hour_label(H0)
LABEL1 = store_layout.hour_label(H0 + 3600)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def step(run, rank, s, ms=100.0):
    return schema.StepRecord(run_id=run, rank=rank, step=s, node=rank // 2, host="h", world_size=4,
                             t_start=H0 + s, t_end=H0 + s + ms / 1000, step_ms=ms)


def fill(rs: RunStore, run: str, steps: range, ranks=range(2), ms=100.0) -> None:
    """One flush (one part) per step, as a head flushing every second does."""
    for s in steps:
        rs.add("steps", [step(run, r, s, ms * (1 + r)) for r in ranks])
        rs.flush()


def files_of(root: Path, run="r1", table="steps") -> list[str]:
    return sorted(str(p.relative_to(root / run / table)) for p in (root / run / table).rglob("*.parquet"))


def keys(df: pd.DataFrame) -> list[tuple]:
    return sorted(zip(df["rank"], df["step"]))


def expected(steps, ranks=range(2)) -> list[tuple]:
    return sorted((r, s) for s in steps for r in ranks)


# -- layout ------------------------------------------------------------------------------------------------


def test_parts_land_in_hive_partitions_of_run_and_hour_and_every_row_keeps_run_id(tmp_path):
    clock = Clock(H0 + 10)
    rs = Store(tmp_path, clock=clock).run("r1")
    fill(rs, "r1", range(3))
    clock.t = H0 + 3600 + 5
    fill(rs, "r1", range(3, 4))
    got = files_of(tmp_path)
    assert len(got) == 4
    assert {str(Path(f).parent) for f in got} == {f"run=r1/hour={LABEL0}", f"run=r1/hour={LABEL1}"}
    assert all(Path(f).name.startswith("part-") for f in got)
    # pandas (pyarrow datasets) reads the table directory with the partition keys as columns; run_id stays a column
    df = pd.read_parquet(tmp_path / "r1" / "steps")
    assert len(df) == 8 and set(df["run_id"]) == {"r1"} and set(df["run"].astype(str)) == {"r1"}
    assert set(df["hour"].astype(str)) == {LABEL0, LABEL1}
    rs.close()


def test_flat_parts_of_an_older_store_still_read_beside_partitions(tmp_path):
    d = tmp_path / "old" / "steps"
    d.mkdir(parents=True)
    pq.write_table(schema_table([step("old", 0, 0), step("old", 1, 0)]), d / "part-0001-old.parquet")
    assert keys(read_table(tmp_path, "old", "steps")) == [(0, 0), (1, 0)]
    # a head that continues the run writes partitions beside the flat part; the flat part is never rewritten
    clock = Clock(H0)
    rs = Store(tmp_path, clock=clock).run("old")
    assert rs.add("steps", [step("old", 0, 0)]) == []  # deduplicated against the flat part
    fill(rs, "old", range(1, 3))
    rs.close()
    assert (d / "part-0001-old.parquet").exists()
    assert keys(read_table(tmp_path, "old", "steps")) == expected(range(3))


def schema_table(rows) -> pa.Table:
    from ranksight.tables import SPECS

    return SPECS["steps"].to_table(rows[0].run_id, rows)


# -- compaction --------------------------------------------------------------------------------------------


def test_a_closed_hour_is_compacted_into_one_file_and_the_open_one_is_not(tmp_path):
    clock = Clock(H0 + 1)
    st = Store(tmp_path, clock=clock, cleanup_delay=0.0)
    rs = st.run("r1")
    fill(rs, "r1", range(20))
    clock.t = H0 + 3600 + 1
    fill(rs, "r1", range(20, 23))
    assert st.compact_all()["partitions"] == 0  # the hour closed less than the grace period ago
    clock.t = H0 + 3600 + 120
    out = st.compact_all()
    assert out == {"partitions": 1, "files": 20, "rows": 40, "removed": 20}
    got = files_of(tmp_path)
    assert [f for f in got if LABEL0 in f] and len([f for f in got if LABEL0 in f]) == 1
    assert Path([f for f in got if LABEL0 in f][0]).name.startswith("compacted-")
    assert len([f for f in got if LABEL1 in f]) == 3  # the open hour keeps its parts
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(23))
    assert st.compact_all()["partitions"] == 0  # nothing left to do in the closed hour
    # at head stop, every partition ends as one file
    st.close()
    assert len(files_of(tmp_path)) == 2
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(23))


def test_the_run_end_compacts_the_open_hour_too(tmp_path):
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(5))
    assert rs.compact()["partitions"] == 0
    rs.write_manifest(schema.Manifest(run_id="r1", created=H0, start_time=H0, finished=H0 + 6), None)
    assert rs.compact()["partitions"] == 1
    assert len(files_of(tmp_path)) == 1


def test_compaction_keeps_the_dedupe_indexes_and_a_restart_dedupes_against_compacted_files(tmp_path):
    clock = Clock(H0 + 1)
    st = Store(tmp_path, clock=clock, cleanup_delay=0.0)
    rs = st.run("r1")
    fill(rs, "r1", range(10))
    st.close()
    assert len(files_of(tmp_path)) == 1
    rs2 = Store(tmp_path, clock=clock).run("r1")
    assert rs2.rows_stored["steps"] == 20
    assert rs2.add("steps", [step("r1", 0, 3), step("r1", 1, 9)]) == []


# -- crash windows -------------------------------------------------------------------------------------------


def partition_files(root: Path, label=LABEL0, run="r1", table="steps"):
    return [f for f in store_layout.list_table(root / run / table) if f.partition.endswith(label)]


def test_crash_while_writing_the_merged_file_leaves_only_a_dot_file_readers_ignore(tmp_path):
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(6))
    pdir = tmp_path / "r1" / "steps" / f"run=r1/hour={LABEL0}"
    half = pdir / ".compacted-1-1.parquet.tmp"
    good = (next(pdir.glob("part-*.parquet"))).read_bytes()
    half.write_bytes(good[: len(good) // 2])  # what a kill -9 in the middle of the write leaves
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(6))
    con = duckdb.connect()
    n = con.execute("select count(*) from read_parquet(?, hive_partitioning=true)",
                    [str(tmp_path / "*" / "steps" / "*" / "*" / "*.parquet")]).fetchone()[0]
    assert n == 12
    clock.t = H0 + 7300
    assert rs.compact()["partitions"] == 1
    assert not half.exists() and len(files_of(tmp_path)) == 1
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(6))


def test_crash_between_the_merged_file_and_the_cleanup_never_shows_a_row_twice(tmp_path):
    """The merged file is in place and names the parts; the parts are still there (the head died before removing
    them). The old reader (every .parquet under the table) read each row twice here."""
    from analyzers.loader import load_run

    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock).run("r1")
    fill(rs, "r1", range(8))
    inputs = partition_files(tmp_path)
    new, rows = compaction.compact_partition(inputs, "steps", f"run=r1/hour={LABEL0}", tmp_path / "r1" / "steps",
                                             None, tmp_path / "scratch")
    assert rows == 16 and len(files_of(tmp_path)) == 9  # 8 parts + the merged file: the crash window
    assert store_layout.read_covers(new) == {f.name for f in inputs}
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(8))
    assert len(part_files(tmp_path / "r1" / "steps")) == 1
    data = load_run(tmp_path, "r1")
    assert len(data.steps) == 16 and data.damaged_parts == 0
    # half the cleanup done, then another crash
    for f in inputs[:4]:
        os.unlink(f.path)
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(8))
    # the head starts again: the covered parts go, the rows stay once, the keys are still known
    rs2 = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    assert len(files_of(tmp_path)) == 1
    assert rs2.rows_stored["steps"] == 16 and rs2.add("steps", [step("r1", 1, 7)]) == []
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(8))


def test_a_compacted_file_covers_what_the_files_it_merged_covered(tmp_path):
    """A crash left compacted file A beside the parts it covers; new parts arrive in the same hour; B merges A and
    the new parts. Removing A first must not bring A's parts back: B names them too."""
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock).run("r1")
    fill(rs, "r1", range(4))
    part = f"run=r1/hour={LABEL0}"
    a, _ = compaction.compact_partition(partition_files(tmp_path), "steps", part, tmp_path / "r1" / "steps", None,
                                        tmp_path / "scratch")
    old_parts = [f.name for f in partition_files(tmp_path) if not f.compacted]
    fill(rs, "r1", range(4, 6))
    visible = store_layout.visible(partition_files(tmp_path))
    assert len(visible) == 3  # A and the two new parts
    b, rows = compaction.compact_partition(visible, "steps", part, tmp_path / "r1" / "steps", None,
                                           tmp_path / "scratch")
    assert rows == 12 and set(old_parts) | {a.name} <= store_layout.read_covers(b)
    os.unlink(a.path)  # the cleanup removes A before the parts it covered (then the head dies)
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(6))


def test_a_failed_rename_keeps_the_parts_and_the_next_round_compacts(tmp_path, monkeypatch):
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(5))
    clock.t = H0 + 7300
    real = os.replace

    def fail(src, dst):
        if ".compacted-" in str(src):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(compaction.os, "replace", fail)
    assert rs.compact()["partitions"] == 0
    assert len(files_of(tmp_path)) == 5 and not list((tmp_path / "r1").rglob(".compacted-*"))
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(5))
    monkeypatch.setattr(compaction.os, "replace", real)
    assert rs.compact()["partitions"] == 1 and len(files_of(tmp_path)) == 1


def test_a_damaged_part_is_not_merged_nor_covered(tmp_path):
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(4))
    bad = sorted((tmp_path / "r1" / "steps").rglob("part-*.parquet"))[1]
    bad.write_bytes(b"not parquet")
    clock.t = H0 + 7300
    assert rs.compact()["files"] == 3
    assert bad.exists()
    df = read_table(tmp_path, "r1", "steps")
    assert keys(df) == expected([0, 2, 3])


# -- object storage (moto's S3 server on 127.0.0.1) ----------------------------------------------------------


@pytest.fixture
def s3_uri(monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    import pyarrow.fs as pafs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    fs = pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                           allow_bucket_creation=True)
    bucket = f"fleet-{uuid.uuid4().hex[:12]}"  # moto keeps its buckets per process, across servers: one per test
    fs.create_dir(bucket)
    try:
        yield f"s3://{bucket}/ranksight?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    finally:
        server.stop()


def test_compacted_partitions_go_to_object_storage_and_every_reader_finds_them(tmp_path, s3_uri):
    clock = Clock(H0 + 1)
    st = Store(tmp_path, clock=clock, compact_to=s3_uri, cleanup_delay=0.0)
    rs = st.run("r1")
    rs.write_manifest(schema.Manifest(run_id="r1", created=H0, start_time=H0), None)
    fill(rs, "r1", range(6))
    clock.t = H0 + 3600 + 1
    fill(rs, "r1", range(6, 8))
    clock.t = H0 + 3600 + 120
    assert st.compact_all()["partitions"] == 1
    # the closed hour left the local disk; the open one is still local
    assert [Path(f).parent.name for f in files_of(tmp_path)] == [f"hour={LABEL1}"] * 2
    assert (tmp_path / "r1" / "remote.json").exists()
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(8))  # local store: local + remote
    assert keys(read_table(s3_uri, "r1", "steps")) == expected(range(6))  # the bucket: what was compacted
    fs, base = store_layout.open_location(s3_uri)
    with fs.open_input_stream(f"{base}/r1/run.json") as f:  # the manifest beside the tables
        assert msgspec.json.decode(f.read(), type=schema.Manifest).run_id == "r1"
    st.close()
    assert files_of(tmp_path) == []
    assert keys(read_table(s3_uri, "r1", "steps")) == expected(range(8))
    remote = part_files(store_layout.join(s3_uri, "r1", "steps"))
    assert len(remote) == 2 and all(f.name.startswith("compacted-") for f in remote)
    # a restarted head dedupes against the rows in the bucket
    rs2 = Store(tmp_path, clock=clock, compact_to=s3_uri).run("r1")
    assert rs2.rows_stored["steps"] == 16 and rs2.add("steps", [step("r1", 0, 2)]) == []
    # diagnose's loader reads the local store (and what it compacted to the bucket)
    from analyzers.loader import load_run

    assert len(load_run(tmp_path, "r1").steps) == 16


def test_credentials_in_a_store_uri_are_refused_and_not_echoed():
    with pytest.raises(store_layout.StoreLocationError) as e:
        Store("/tmp/unused-store", compact_to="s3://AKIAEXAMPLE:s3cr3t@bucket/prefix")
    assert "s3cr3t" not in str(e.value) and "AKIAEXAMPLE" not in str(e.value)
    with pytest.raises(store_layout.StoreLocationError) as e:
        store_layout.open_location("s3://bucket/prefix?region=x&session_token=t0k3n")
    assert "t0k3n" not in str(e.value)


# -- a fleet query across runs (docs/store.md) ---------------------------------------------------------------


def test_fleet_query_median_step_time_per_run_and_rank_in_duckdb(tmp_path):
    clock = Clock(H0 + 1)
    st = Store(tmp_path, clock=clock, cleanup_delay=0.0)
    fill(st.run("a"), "a", range(6), ranks=range(2), ms=100.0)
    fill(st.run("b-0042"), "b-0042", range(4), ranks=range(3), ms=200.0)
    clock.t = H0 + 3600 + 1
    fill(st.run("a"), "a", range(6, 9), ranks=range(2), ms=100.0)
    st.close()
    fill(Store(tmp_path, clock=clock).run("c"), "c", range(3), ranks=range(1), ms=50.0)  # a live run: parts only
    sql = """
        SELECT run, rank, median(step_ms) AS median_step_ms, count(*) AS steps
        FROM read_parquet(?, hive_partitioning = true, hive_types = {'run': VARCHAR})
        WHERE hour >= ?
        GROUP BY run, rank ORDER BY run, rank
    """
    got = duckdb.connect().execute(sql, [str(tmp_path / "*" / "steps" / "*" / "*" / "*.parquet"), LABEL0]).fetchall()
    assert got == [("a", 0, 100.0, 9), ("a", 1, 200.0, 9), ("b-0042", 0, 200.0, 4), ("b-0042", 1, 400.0, 4),
                   ("b-0042", 2, 600.0, 4), ("c", 0, 50.0, 3)]
    # partition pruning: a query for one run opens that run's files only
    plan = duckdb.connect().execute(
        "EXPLAIN ANALYZE SELECT count(*) FROM read_parquet(?, hive_partitioning = true) WHERE run = 'a'",
        [str(tmp_path / "*" / "steps" / "*" / "*" / "*.parquet")]).fetchall()
    assert "Scanning Files: 2/" in str(plan)


def test_read_table_lists_again_when_a_compaction_removed_files_it_had_listed(tmp_path, monkeypatch):
    from ranksight import tables

    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(5))
    stale = tables.part_files(tmp_path / "r1" / "steps")  # listed by a reader, then the head compacts
    clock.t = H0 + 7300
    assert rs.compact()["removed"] == 5
    real, calls = tables.part_files, []

    def listing(d):
        calls.append(d)
        return stale if len(calls) == 1 else real(d)

    monkeypatch.setattr(tables, "part_files", listing)
    assert keys(tables.read_table(tmp_path, "r1", "steps")) == expected(range(5)) and len(calls) == 2


def test_parts_of_an_older_writer_merge_by_union_of_schemas_and_still_dedupe(tmp_path):
    """A part that predates a column (``attempt``) and one with a column this version does not know, in one hour:
    the merge keeps every row and column (missing values null); a restarted head still sees the old row's key
    (attempt 0, not null) and drops its resend."""
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(2))
    pdir = tmp_path / "r1" / "steps" / f"run=r1/hour={LABEL0}"
    old = schema_table([step("r1", 0, 7)]).drop_columns(["attempt"])
    pq.write_table(old, pdir / "part-0000000000000000001-1-000001.parquet")
    newer = schema_table([step("r1", 1, 7)]).append_column("future_ms", pa.array([1.5]))
    pq.write_table(newer, pdir / "part-0000000000000000002-1-000001.parquet")
    rs.close()
    got = files_of(tmp_path)
    assert len(got) == 1 and Path(got[0]).name.startswith("compacted-")
    df = read_table(tmp_path, "r1", "steps")
    assert keys(df) == sorted(expected(range(2)) + [(0, 7), (1, 7)])
    assert df["future_ms"].notna().sum() == 1 and df["attempt"].isna().sum() == 1
    meta = pq.read_metadata(tmp_path / "r1" / "steps" / got[0]).metadata
    assert b"ranksight.schema_version" in meta and b"ranksight.covers" in meta
    rs2 = Store(tmp_path, clock=clock).run("r1")
    assert rs2.add("steps", [step("r1", 0, 7), step("r1", 1, 7)]) == []


def test_a_merged_file_has_few_large_row_groups_not_one_per_part(tmp_path, monkeypatch):
    monkeypatch.setattr(compaction, "ROW_GROUP_ROWS", 16)
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")
    fill(rs, "r1", range(40))  # 40 parts of 2 rows
    rs.close()
    meta = pq.read_metadata(next((tmp_path / "r1" / "steps").rglob("compacted-*.parquet")))
    assert meta.num_rows == 80 and meta.num_row_groups == 5


def test_a_run_compacted_to_object_storage_stays_there_when_the_head_restarts_without_it(tmp_path, s3_uri):
    """A crash left local parts that a compacted file in the bucket covers; the head restarts without --compact-to.
    Merging those parts locally would store their rows twice."""
    clock = Clock(H0 + 1)
    rs = Store(tmp_path, clock=clock, compact_to=s3_uri).run("r1")
    fill(rs, "r1", range(4))
    fs, base = store_layout.open_location(s3_uri)
    new, _ = compaction.compact_partition(partition_files(tmp_path), "steps", f"run=r1/hour={LABEL0}",
                                          tmp_path / "r1" / "steps", compaction.Target(fs, f"{base}/r1"),
                                          tmp_path / "scratch")
    assert len(files_of(tmp_path)) == 4  # the crash: local parts still there, the bucket has the merged hour
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(4))
    rs2 = Store(tmp_path, clock=clock, cleanup_delay=0.0).run("r1")  # no compact_to
    fill(rs2, "r1", range(4, 6))
    rs2.close()
    assert files_of(tmp_path) == []
    assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(6))
    assert keys(read_table(s3_uri, "r1", "steps")) == expected(range(6))


def test_compacted_partitions_may_go_to_another_directory(tmp_path):
    archive = tmp_path / "archive"
    clock = Clock(H0 + 1)
    st = Store(tmp_path / "store", clock=clock, compact_to=str(archive), cleanup_delay=0.0)
    fill(st.run("r1"), "r1", range(3))
    st.close()
    assert files_of(tmp_path / "store") == []
    assert len(files_of(archive)) == 1
    assert keys(read_table(tmp_path / "store", "r1", "steps")) == expected(range(3))
    assert keys(read_table(archive, "r1", "steps")) == expected(range(3))


def test_the_heads_compactor_thread_merges_a_closed_hour(tmp_path):
    import time as _time

    from head.service import Head

    h = Head(tmp_path, "tok", flush_interval=0.1, analyzer_interval=0, compact_interval=0.1)
    clock = Clock(H0 + 1)
    rs = h.store.run("r1")
    rs.clock, rs.cleanup_delay = clock, 0.0
    h.start_background()
    try:
        fill(rs, "r1", range(5))
        clock.t = H0 + 7300  # the hour closed: the compactor's next round merges it
        deadline = _time.monotonic() + 30
        while len(files_of(tmp_path)) != 1 and _time.monotonic() < deadline:
            _time.sleep(0.1)
        assert len(files_of(tmp_path)) == 1 and Path(files_of(tmp_path)[0]).name.startswith("compacted-")
        assert keys(read_table(tmp_path, "r1", "steps")) == expected(range(5))
    finally:
        h.close()


SPARK_QUERY = """
import sys
from functools import reduce
from pyspark.sql import DataFrame, SparkSession, functions as F

spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
store = sys.argv[1]
# every run at once: each row's run_id (Spark infers no partitions across several table roots)
steps = spark.read.option("recursiveFileLookup", "true").option("pathGlobFilter", "*.parquet").parquet(f"{store}/*/steps")
for r in (steps.groupBy("run_id", "rank").agg(F.percentile_approx("step_ms", 0.5).alias("m"), F.count("*").alias("n"))
          .orderBy("run_id", "rank").collect()):
    print("A", r.run_id, r.rank, r.m, r.n)
# run by run, unioned: the partition columns run and hour
spark.conf.set("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
import glob
steps = reduce(DataFrame.unionByName, [spark.read.parquet(d) for d in sorted(glob.glob(f"{store}/*/steps"))])
for r in (steps.where(F.col("hour") >= sys.argv[2]).groupBy("run", "rank")
          .agg(F.percentile_approx("step_ms", 0.5).alias("m"), F.count("*").alias("n")).orderBy("run", "rank").collect()):
    print("B", r.run, r.rank, r.m, r.n)
"""


def test_fleet_query_in_spark(tmp_path):
    """docs/store.md's Spark queries on a real Spark. pyspark (and Java) is not a dev dependency (hundreds of MB):
    set RANKSIGHT_SPARK_PYTHON to a Python that has it, e.g. a separate virtualenv with `pip install pyspark`."""
    import subprocess

    py = os.environ.get("RANKSIGHT_SPARK_PYTHON")
    if not py:
        pytest.skip("RANKSIGHT_SPARK_PYTHON is not set (a Python with pyspark)")
    clock = Clock(H0 + 1)
    st = Store(tmp_path / "store", clock=clock, cleanup_delay=0.0)
    fill(st.run("a"), "a", range(6), ranks=range(2), ms=100.0)
    fill(st.run("0042"), "0042", range(4), ranks=range(3), ms=200.0)
    clock.t = H0 + 3600 + 1
    fill(st.run("a"), "a", range(6, 9), ranks=range(2), ms=100.0)
    st.close()
    fill(Store(tmp_path / "store", clock=clock).run("c"), "c", range(3), ranks=range(1), ms=50.0)
    script = tmp_path / "query.py"
    script.write_text(SPARK_QUERY)
    out = subprocess.run([py, str(script), str(tmp_path / "store"), LABEL0], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    want = ["0042 0 200.0 4", "0042 1 400.0 4", "0042 2 600.0 4", "a 0 100.0 9", "a 1 200.0 9", "c 0 50.0 3"]
    lines = out.stdout.splitlines()
    assert [x[2:] for x in lines if x.startswith("A ")] == want
    assert [x[2:] for x in lines if x.startswith("B ")] == want
