"""diagnose's columnar load path (analyzers/columnar.py) and the scale bench's generator (bench/scale_gen.py).

- the store's tables read column-wise equal what ``RunData.normalize`` makes of the same part files read by pandas
  (the path before), up to dtypes and the columns no analyzer reads: on the fixtures' real runs written into a
  store by the head's writer, on a generated store, and on a store with what an old or odd writer leaves (member
  lists per record, a record written at arrival and again when done, a restarted rank's steps, a damaged part);
- the generator's store, 64 ranks x 200 steps, through the real ``diagnose`` CLI, names the injected straggler;
- ``--progress`` draws a bar on stderr and never touches ``--json``'s stdout.
"""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from analyzers import columnar, run_all
from analyzers.loader import TABLE_TYPES, RunData, load_run
from bench import scale_gen
from head.store.run_store import RunStore
from ranksight import schema, tables
from ranksight.layout import RunDir
from ranksight.spool import read_spool

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "runs"
STORE_TABLE_OF = {t: name for name, t in TABLE_TYPES.items()}
ORDER = {"steps": ("rank", "step"), "collectives": ("rank", "attempt", "group", "seq"), "gpu": ("t", "node", "gpu"),
         "host": ("t", "node")}


def old_path(store: Path, run_id: str) -> RunData:
    """The run as the loader read a store before: every table by pandas, then ``RunData.normalize``."""
    rd = RunDir(store, run_id)
    frames = {}
    for name in TABLE_TYPES:
        df, _bad = tables.read_parts(tables.part_files(rd.table(name)))
        if not df.empty:
            frames[name] = df
    manifest = msgspec.json.decode(rd.manifest.read_bytes(), type=schema.Manifest) if rd.manifest.exists() else None
    return RunData(run_id=run_id, manifest=manifest, **frames)


def plain(df: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """``df[cols]`` with Categoricals as objects, ints as int64, member arrays as tuples: compared by value."""
    out = {}
    for c in cols:
        s = df[c].reset_index(drop=True)
        if isinstance(s.dtype, pd.CategoricalDtype) or s.dtype == object or pd.api.types.is_string_dtype(s.dtype):
            vals = s.astype(object).where(s.notna(), None).tolist()
            s = pd.Series([tuple(int(x) for x in v) if isinstance(v, (np.ndarray, list)) else v for v in vals],
                          dtype=object)
        elif pd.api.types.is_integer_dtype(s.dtype):
            s = s.astype(np.int64)
        out[c] = s
    return pd.DataFrame(out)


def assert_same_frames(new: RunData, old: RunData) -> None:
    for name in columnar.TABLES:
        a, b = getattr(new, name), getattr(old, name)
        assert a.empty == b.empty, name
        if b.empty:
            continue
        skipped = set(columnar.SKIPPED[name])
        assert set(a.columns) == set(b.columns) - skipped, (name, set(a.columns) ^ (set(b.columns) - skipped))
        cols = [c for c in b.columns if c not in skipped]
        pa_, pb = plain(a, cols), plain(b, cols)
        # the row order differs (the columnar frames keep the head's (step, rank) order; the old path sorted by rank)
        key = [c for c in ORDER[name] if c in cols]
        pa_ = pa_.sort_values(key, kind="stable").reset_index(drop=True)
        pb = pb.sort_values(key, kind="stable").reset_index(drop=True)
        pd.testing.assert_frame_equal(pa_, pb, check_dtype=False, obj=name, rtol=1e-6)
    # each rank's steps in step order, each step's rows in rank order, as before
    st = new.steps
    assert (st.groupby("rank")["step"].diff().dropna() > 0).all()
    assert (st.groupby("step")["rank"].diff().dropna() > 0).all()


def spool_to_store(run_dir: Path, store: Path, run_id: str) -> None:
    """A fixture run (spool files) written into a store by the head's writer (``RunStore.add``), as its agents would
    have shipped it."""
    rs = RunStore(store / run_id, run_id, flush_rows=400)  # small parts: many of them, as a head leaves
    by_table: dict[str, list] = {}
    for sp in sorted((run_dir / "spool").glob("rank-*.jsonl")):
        for rec in read_spool(sp).records:
            name = STORE_TABLE_OF.get(type(rec))
            if name is not None:
                by_table.setdefault(name, []).append(rec)
    for name, recs in by_table.items():
        for i in range(0, len(recs), 300):
            rs.add(name, recs[i:i + 300])
    rs.close()
    (store / run_id / "run.json").write_bytes((run_dir / "run.json").read_bytes())


@pytest.mark.parametrize("run", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_columnar_equals_old_path_on_fixture_runs(tmp_path, run):
    spool_to_store(FIXTURES / run, tmp_path, run)
    new = load_run(tmp_path, run, source="store")
    assert new.source == "store" and new.prepared == {n for n in columnar.TABLES if not getattr(new, n).empty}
    assert_same_frames(new, old_path(tmp_path, run))
    # the same findings either way
    kinds = lambda fs: sorted((f.kind, f.severity, tuple(f.ranks), f.step_start) for f in fs)  # noqa: E731
    assert kinds(run_all(new)) == kinds(run_all(old_path(tmp_path, run)))


def _coll(rank, step, seq, group, t, done=True, members=(), comm_id="", attempt=0):
    return schema.CollectiveRecord(run_id="odd", rank=rank, step=step, seq=seq, op="all_reduce", group=group,
                                   group_ranks=list(members), t_arrive=t, t_done=t + 0.01 if done else None,
                                   attempt=attempt, comm_id=comm_id)


def _step(rank, step, t, attempt=0, compute=10.0):
    return schema.StepRecord(run_id="odd", rank=rank, step=step, node=rank // 2, host=f"n{rank // 2}", world_size=4,
                             t_start=t, t_end=t + 0.1 + attempt * 0.01, step_ms=100.0, compute_ms=compute,
                             forward_ms=3.0, backward_ms=4.0, attempt=attempt)


def test_columnar_equals_old_path_on_odd_writers(tmp_path):
    """What the old normalize handled: member lists per record (an older writer) beside comm_ids, a comm_id whose
    communicator was never stored, a record written at arrival then again when done, a restarted rank re-running
    steps, a step without compute_ms (derived) -- and a damaged part file, skipped and counted."""
    rs = RunStore(tmp_path / "odd", "odd", flush_rows=10**9)
    dp = schema.communicator_id("dp", [0, 1, 2, 3])
    rs.add("communicators", [schema.CommunicatorRecord(run_id="odd", comm_id=dp, group="dp", ranks=[3, 1, 2, 0],
                                                       rank=0)])
    steps, colls = [], []
    for s in range(12):
        for r in range(4):
            t = 1000.0 + s
            steps.append(_step(r, s, t, compute=0.0 if (r, s) == (2, 3) else 10.0))
            colls.append(_coll(r, s, s, "dp", t, comm_id=dp))
            colls.append(_coll(r, s, s, "tp", t, members=[r - r % 2 + 1, r - r % 2]))  # own lists, unsorted
            colls.append(_coll(r, s, s, "pp", t, comm_id="feedfacefeedface"))  # never stored
    colls.append(_coll(1, 11, 12, "dp", 1011.5, done=False, comm_id=dp))  # arrival only
    rs.add("steps", steps)
    rs.add("collectives", colls)
    rs.flush()
    rs.add("steps", [_step(3, s, 2000.0 + s, attempt=1) for s in (9, 10, 11)])  # rank 3 restarted at step 9
    rs.close()
    # rows the head's dedupe never lets through twice, as another writer (a second head, a merge) may leave them:
    # the collective again when done, a step again (its later copy wins)
    for name, rows in (("collectives", [_coll(1, 11, 12, "dp", 1011.5, done=True, comm_id=dp)]),
                       ("steps", [_step(0, 5, 1005.0, compute=11.0)])):
        where = tables.part_files(tmp_path / "odd" / name)[-1].parent  # beside the head's files, listed after them
        pq.write_table(tables.SPECS[name].to_table("odd", rows), where / "part-9999999999999999998-0-000001.parquet")
    bad = tables.part_files(tmp_path / "odd" / "steps")[-1].parent / "part-9999999999999999999-0-000001.parquet"
    bad.write_bytes(b"PAR1 not really parquet PAR1")
    new, old = load_run(tmp_path, "odd"), old_path(tmp_path, "odd")
    assert new.damaged_parts == 1
    assert_same_frames(new, old)
    st = new.steps
    assert len(st) == 48 and st.loc[(st["rank"] == 3) & (st["step"] == 10), "attempt"].tolist() == [1]
    assert st.loc[(st["rank"] == 2) & (st["step"] == 3), "compute_ms"].tolist() == [7.0]
    assert st.loc[(st["rank"] == 0) & (st["step"] == 5), "compute_ms"].tolist() == [11.0]
    co = new.collectives
    assert co.loc[(co["rank"] == 1) & (co["seq"] == 12), "t_done"].notna().all()
    assert set(co.loc[co["group"] == "dp", "gkey"].astype(str)) == {"dp[0,1,2,3]"}
    assert set(co.loc[co["group"] == "tp", "gkey"].astype(str)) == {"tp[0,1]", "tp[2,3]"}
    assert set(co.loc[co["group"] == "pp", "gkey"].astype(str)) == {"pp"}


def test_skipped_columns_are_read_by_no_analyzer():
    """A column the columnar reader leaves out must be one no check or report names."""
    sources = {p: p.read_text() for p in (ROOT / "analyzers").rglob("*.py")
               if p.name not in ("columnar.py", "loader.py")}
    for table, cols in columnar.SKIPPED.items():
        for c in cols:
            hits = [str(p.relative_to(ROOT)) for p, s in sources.items() if re.search(rf"[\"']{c}[\"']", s)
                    # the report's summary names its run_id (RunData.run_id), no frame's column
                    and not (c == "run_id" and "report" in p.parts)]
            assert not hits, f"{table}.{c} is skipped by analyzers/columnar.py but read by {hits}"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    store = tmp_path_factory.mktemp("scale")
    job = scale_gen.Job(ranks=64, steps=200, straggler=13, factor=1.3, onset=80, compact=False)
    scale_gen.generate(job, store, log=None)
    return store, job


def test_generated_store_layout(generated):
    store, job = generated
    rd = RunDir(store, scale_gen.RUN)
    assert (job.tp, job.pp, job.dp) == (8, 4, 2)
    # parts as a head flushing every 5 simulated seconds leaves them
    assert len(tables.part_files(rd.table("collectives"))) == job.steps // 5
    comms = tables.read_table(store, scale_gen.RUN, "communicators")
    assert len(comms) == 64 // 8 + 64 // 2 and set(comms["group"]) == {"tp", "dp"}
    co = tables.read_table(store, scale_gen.RUN, "collectives", columns=["comm_id", "group_ranks"])
    assert len(co) == 64 * 200 * 2 and (co["comm_id"] != "").all() and (co["group_ranks"].map(len) == 0).all()
    gpu = tables.read_table(store, scale_gen.RUN, "gpu", columns=["t"])
    assert len(gpu) == 64 * 200  # one sample per GPU per second at one step per second
    m = msgspec.json.decode((rd.root / "run.json").read_bytes(), type=schema.Manifest)
    assert m.faults[0].rank == 13 and m.layout["tp"] == 8


def test_generated_store_columnar_equals_old_path(generated, tmp_path):
    store, job = generated
    assert_same_frames(load_run(store, scale_gen.RUN), old_path(store, scale_gen.RUN))
    # the same run as the head leaves it when it closes: each table's hour partition compacted into one file
    compacted = dataclasses.replace(job, steps=40, compact=True)
    scale_gen.generate(compacted, tmp_path, log=None)
    assert len(tables.part_files(RunDir(tmp_path, scale_gen.RUN).table("steps"))) == 1
    assert_same_frames(load_run(tmp_path, scale_gen.RUN), old_path(tmp_path, scale_gen.RUN))


def test_diagnose_cli_names_the_injected_straggler(generated):
    store, job = generated
    r = subprocess.run([sys.executable, "-m", "cli.diagnose", scale_gen.RUN, "--store", str(store), "--json",
                        "--progress"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    obj = json.loads(r.stdout)  # --progress leaves --json's stdout a single JSON object
    stragglers = [f for f in obj["findings"] if f["kind"] == "straggler" and f["severity"] != "info"]
    assert [f["ranks"] for f in stragglers] == [[job.straggler]], obj["findings"]
    assert abs(stragglers[0]["step_start"] - job.start) <= 5
    assert obj["faults"][0]["found"]
    accused = {r for f in obj["findings"] if f["severity"] != "info" for r in f["ranks"]}
    assert accused == {job.straggler}
    assert "loading" in r.stderr  # the bar, asked for, on stderr


def test_json_report_does_not_need_the_plot_series(generated):
    """diagnose --json (and the text report) skip the HTML page's plot series: the same JSON either way."""
    from analyzers.report.model import build_report
    from analyzers.report.render_json import render_json

    store, _job = generated
    data = load_run(store, scale_gen.RUN)
    errors, coverage = [], []
    findings = run_all(data, errors=errors, coverage=coverage)
    lean = build_report(data, findings, errors, coverage, with_plots=False)
    full = build_report(data, findings, errors, coverage)
    assert lean.plots.gpu == {} and full.plots.gpu  # the series were left out ...
    assert render_json(lean) == render_json(full)  # ... and the JSON does not miss them
