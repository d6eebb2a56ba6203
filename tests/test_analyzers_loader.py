"""The loader: spool and store sources, step bounds, and clear errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from analyzer_fixtures import build, write_run

from analyzers.loader import EmptyRunError, LoadError, NewerSchemaError, RunData, UnknownRunError, load_run
from ranksight.layout import RunDir
from ranksight.schema import SCHEMA_VERSION


def test_spool_roundtrip_and_bounds(tmp_path):
    data = build(world=4, steps=20)
    write_run(data, tmp_path, "r1")
    got = load_run(tmp_path, "r1")
    assert got.source == "spool" and got.truncated_lines == 0
    assert len(got.steps) == 80 and len(got.collectives) == 80
    assert got.manifest.layout["dp"] == 4
    cut = load_run(tmp_path, "r1", since=5, until=9)
    assert sorted(cut.steps["step"].unique()) == [5, 6, 7, 8, 9]
    assert set(cut.collectives["step"].unique()) == {5, 6, 7, 8, 9}


def test_truncated_last_line_is_tolerated_and_counted(tmp_path):
    write_run(build(world=2, steps=10), tmp_path, "r2", truncate_last=True)
    got = load_run(tmp_path, "r2")
    assert got.truncated_lines == 1 and got.bad_lines == 0 and len(got.steps) == 20


def test_store_tables_preferred(tmp_path):
    data = build(world=2, steps=10)
    write_run(data, tmp_path, "r3")
    rd = RunDir(tmp_path, "r3")
    (rd.table("steps")).mkdir()
    # the store has only steps 0..4: proves the store, not the spool, was read
    data.steps[data.steps["step"] < 5].to_parquet(rd.table("steps") / "part-0.parquet")
    got = load_run(tmp_path, "r3")
    assert got.source == "store" and sorted(got.steps["step"].unique()) == [0, 1, 2, 3, 4]
    assert load_run(tmp_path, "r3", source="spool").steps["step"].max() == 9


def test_unknown_run_lists_known(tmp_path):
    write_run(build(world=2, steps=3), tmp_path, "alpha")
    with pytest.raises(UnknownRunError) as e:
        load_run(tmp_path, "beta")
    assert "beta" in str(e.value) and "alpha" in str(e.value)
    with pytest.raises(UnknownRunError):
        load_run(tmp_path, "../etc")


def test_empty_run(tmp_path):
    rd = RunDir(tmp_path, "empty")
    rd.spool_dir.mkdir(parents=True)
    rd.spool(0).write_bytes(b"")
    with pytest.raises(EmptyRunError, match="no step records"):
        load_run(tmp_path, "empty")
    write_run(build(world=2, steps=3), tmp_path, "short")
    with pytest.raises(EmptyRunError, match="range"):
        load_run(tmp_path, "short", since=10)


def test_newer_schema_refused(tmp_path):
    write_run(build(world=2, steps=3), tmp_path, "new")
    rd = RunDir(tmp_path, "new")
    m = json.loads(rd.manifest.read_text())
    m["schema_version"] = SCHEMA_VERSION + 1
    rd.manifest.write_text(json.dumps(m))
    with pytest.raises(NewerSchemaError, match="schema version"):
        load_run(tmp_path, "new")


def test_newer_store_table_refused(tmp_path):
    data = build(world=2, steps=3)
    write_run(data, tmp_path, "newstore")
    rd = RunDir(tmp_path, "newstore")
    rd.table("steps").mkdir()
    table = pa.Table.from_pandas(data.steps).replace_schema_metadata({b"ranksight.schema_version": str(SCHEMA_VERSION + 1).encode()})
    pq.write_table(table, rd.table("steps") / "part-0.parquet")
    with pytest.raises(NewerSchemaError):
        load_run(tmp_path, "newstore")


def test_garbage_manifest_is_a_load_error(tmp_path):
    write_run(build(world=2, steps=3), tmp_path, "bad")
    RunDir(tmp_path, "bad").manifest.write_text("{not json")
    with pytest.raises(LoadError, match="not valid JSON"):
        load_run(tmp_path, "bad")


def test_restart_keeps_newest_attempt():
    data = build(world=2, steps=4)
    again = data.steps[data.steps["step"] == 3].copy()
    again["attempt"] = 1
    again["compute_ms"] = 999.0
    import pandas as pd

    d = RunData(run_id="x", manifest=data.manifest, steps=pd.concat([data.steps, again]))
    assert len(d.steps) == 8
    assert d.steps[d.steps["step"] == 3]["compute_ms"].tolist() == [999.0, 999.0]


def test_reads_the_heads_store_tables(tmp_path):
    """Contract with head.store: what the head writes, the loader reads (steps, collectives, xid)."""
    store_mod = pytest.importorskip("head.store")
    import msgspec

    from analyzers import run_all
    from ranksight.schema import CollectiveRecord, StepRecord, XidEvent

    data = build(world=4, steps=20, compute_factor=lambda r, s: 1.5 if (r == 2 and s >= 8) else 1.0)
    rs = store_mod.Store(tmp_path).run("headrun")
    steps = [msgspec.convert({k: v for k, v in row.items() if k in StepRecord.__struct_fields__ and v == v}
                             | {"run_id": "headrun"}, StepRecord, strict=False) for row in data.steps.to_dict("records")]
    colls = [msgspec.convert({k: v for k, v in row.items() if k in CollectiveRecord.__struct_fields__ and (not isinstance(v, float) or v == v)}
                             | {"run_id": "headrun"}, CollectiveRecord, strict=False) for row in data.collectives.to_dict("records")]
    rs.add("steps", steps)
    rs.add("collectives", colls)
    rs.add("xid", [XidEvent(node=0, host="node0", gpu=1, t=float(data.steps["t_start"].max()), code=79,
                           source="simulated-nvml", simulated=True)])
    rs.write_manifest(msgspec.structs.replace(data.manifest, run_id="headrun"), None)
    rs.flush()
    rs.close()
    got = load_run(tmp_path, "headrun")
    assert got.source == "store" and len(got.steps) == 80 and len(got.collectives) == 80 and len(got.xid) == 1
    kinds = {(f.kind, tuple(f.ranks)) for f in run_all(got) if f.severity != "info"}
    assert ("straggler", (2,)) in kinds and ("gpu_health", (1,)) in kinds


def test_collectives_of_two_attempts_are_two_communicators():
    from ranksight.schema import CollectiveRecord, StepRecord

    recs = []
    for attempt in (0, 1):
        for r in (0, 1):
            recs.append(StepRecord(run_id="x", rank=r, step=1, node=0, host="h", world_size=2, attempt=attempt,
                                   t_start=attempt, t_end=attempt + 0.5, step_ms=500.0))
            recs.append(CollectiveRecord(run_id="x", rank=r, step=1, seq=0, op="all_reduce", group="dp", group_ranks=[0, 1],
                                         t_arrive=attempt + 0.1, t_done=attempt + 0.2, attempt=attempt))
    data = RunData.from_records("x", recs)
    co = data.collectives
    assert len(co) == 4  # same (rank, group, seq) in both attempts: both kept
    assert sorted(set(co["gkey"])) == ["dp[0,1]", "dp[0,1] attempt 1"]
