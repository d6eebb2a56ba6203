"""Columns the Parquet footers say hold one value throughout are made from the footer, not decoded
(``analyzers.columnar.footer_constants``): the frames equal the decoded ones exactly (dtypes and values), whatever
the files say -- one value in every row group of every file, a value that changes between files or row groups, null
everywhere or only somewhere, a file written before the column existed, a file without statistics, a big integer
held as float32 -- and a zero column takes no memory until written."""

import resource

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from analyzers import columnar
from analyzers.loader import load_run
from ranksight import schema, tables

RUN = "const"
# held as float32: rounded once from the integer (as the decoded column is), not through a float64 (which would
# round it to another float32)
BIG = 2**60 + 2**36 + 1


def _step(rank, step, **kw):
    base = dict(run_id=RUN, rank=rank, step=step, node=rank // 2, host=f"n{rank // 2}", world_size=4,
                t_start=1000.0 + step, t_end=1000.1 + step, step_ms=100.0, compute_ms=90.0 + rank,
                mem_bytes=BIG)
    base.update(kw)
    return schema.StepRecord(**base)


def _gpu(node, gpu, t, **kw):
    base = dict(node=node, host=f"n{node}", gpu=gpu, t=t, source="nvml", simulated=False, util_pct=50.0 + gpu)
    base.update(kw)
    return schema.GpuSample(**base)


def _write(store, table, name, rows, drop=(), **opts):
    t = tables.SPECS[table].to_table(RUN, rows)
    t = t.drop_columns([c for c in drop if c in t.column_names])
    d = store / RUN / table
    d.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, d / name, row_group_size=8, **opts)  # several row groups a file


@pytest.fixture()
def store(tmp_path):
    steps_a = [_step(r, s, microbatches=1, overflow=(r, s) == (1, 2), grad_norm=1.0) for s in range(4) for r in range(4)]
    # grad_norm 1.0 throughout but NaN once: a float's statistics do not show the NaN
    steps_b = [_step(r, s, microbatches=2, grad_norm=float("nan") if (r, s) == (2, 6) else 1.0)
               for s in range(4, 8) for r in range(4)]
    _write(tmp_path, "steps", "part-0000000000000000001-0-000001.parquet", steps_a)
    _write(tmp_path, "steps", "part-0000000000000000002-0-000001.parquet", steps_b)
    gpu_a = [_gpu(n, g, 1000.0 + i, ecc_dbe=0, xid_total=0, throttle_reasons=0, mem_total_bytes=80 * 2**30)
             for i in range(4) for n in range(2) for g in range(4)]
    # file b: ecc_dbe null in its last row group, an XID counted once, no throttle_reasons column (an older writer)
    gpu_b = [_gpu(n, g, 1004.0 + i, ecc_dbe=None if i == 3 else 0, xid_total=int((n, g, i) == (1, 2, 2)),
                  mem_total_bytes=80 * 2**30) for i in range(4) for n in range(2) for g in range(4)]
    _write(tmp_path, "gpu", "part-0000000000000000001-0-000001.parquet", gpu_a)
    _write(tmp_path, "gpu", "part-0000000000000000002-0-000001.parquet", gpu_b, drop=("throttle_reasons",))
    return tmp_path


def _decoded(store, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(columnar, "footer_constants", lambda table, dataset: {})
        return load_run(store, RUN)


def _constants(store, table):
    files = tables.part_files(store / RUN / table)
    schema_ = columnar._read_schema(table, columnar.wanted_columns(table))
    return columnar.footer_constants(table, columnar._dataset(files, schema_, []))


def _assert_same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns)
    pd.testing.assert_frame_equal(a, b, check_exact=True)


def test_constants_are_what_every_row_group_says(store):
    st = _constants(store, "steps")
    # one value in every row group of both files; microbatches changes between files, overflow within one
    assert st["attempt"] == 0 and st["world_size"] == 4 and st["mem_bytes"] == BIG
    assert st["skipped"] is False and st["profiling"] is False
    assert st["loss_scale"] is columnar.NULL and st["sync_arrival"] is columnar.NULL  # floats null throughout
    for c in ("microbatches", "overflow", "rank", "step", "node", "t_start"):
        assert c not in st, c  # varies
    # a float of one value is decoded all the same: its statistics leave NaN out
    assert "step_ms" not in st and "optimizer_ms" not in st and "grad_norm" not in st
    gp = _constants(store, "gpu")
    assert gp["ecc_sbe"] is columnar.NULL and gp["retired_pages"] is columnar.NULL  # null in every row
    assert gp["mem_total_bytes"] == 80 * 2**30 and gp["simulated"] is False
    for c in ("ecc_dbe", "xid_total", "throttle_reasons", "node", "gpu"):
        assert c not in gp, c  # null somewhere only, one row differs, a file without the column, varies


def test_frames_equal_the_decoded_ones(store, monkeypatch):
    got, want = load_run(store, RUN), _decoded(store, monkeypatch)
    for name in ("steps", "gpu"):
        _assert_same(getattr(got, name), getattr(want, name))
    assert got.steps["mem_bytes"].dtype == np.float32
    assert got.steps["mem_bytes"].iloc[0] == np.int64(BIG).astype(np.float32)
    assert got.gpu["ecc_sbe"].isna().all() and got.gpu["ecc_sbe"].dtype == np.float32
    assert got.steps["loss_scale"].isna().all() and got.steps["sync_arrival"].dtype == np.float64
    assert (got.steps["optimizer_ms"] == 0).all() and got.steps["optimizer_ms"].dtype == np.float32
    assert got.steps["grad_norm"].isna().sum() == 1
    assert (got.gpu.loc[got.gpu["t"] < 1004, "throttle_reasons"] == 0).all()


def test_files_without_statistics_are_decoded(tmp_path, monkeypatch):
    _write(tmp_path, "steps", "part-0000000000000000001-0-000001.parquet",
           [_step(r, s) for s in range(3) for r in range(4)], write_statistics=False)
    assert _constants(tmp_path, "steps") == {}
    _assert_same(load_run(tmp_path, RUN).steps, _decoded(tmp_path, monkeypatch).steps)


def test_every_column_constant_still_counts_rows(tmp_path):
    """A scan reads at least one column (the rows' count comes with it)."""
    _write(tmp_path, "steps", "part-0000000000000000001-0-000001.parquet", [_step(0, 0)] * 3)
    assert len(_constants(tmp_path, "steps")) < len(columnar.wanted_columns("steps"))


def test_a_zero_column_takes_no_memory_until_written():
    n = 64 * 2**20  # 256 MiB of int32
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    col = columnar.constant_column("collectives", columnar._read_schema("collectives", ["attempt"]).field(0), 0, n)
    assert col.dtype == np.int32 and len(col) == n
    assert int(col[::4096].sum()) == 0  # read (every page): zero pages, not the process's own
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < n * 4 // 4, grown
    ones = columnar.constant_column("collectives", columnar._read_schema("collectives", ["ops"]).field(0), 1, 10)
    assert ones.tolist() == [1] * 10 and ones.dtype == np.int32
