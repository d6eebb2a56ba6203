"""The footprint of the frames diagnose loads from a store (analyzers/columnar.py), and the scale bench's load-only
mode (bench/scale_diagnose.py --load-only).

- ranks, steps, sequence numbers and attempts are int32, durations float32, clocks float64, the collectives' op and
  group Categoricals: bytes per row well under what the float64 / int64 / Arrow-string frames took;
- collectives already in the order the head writes them (each rank's TP collective, then its DP one) keep that
  order: no reordering copy of every column;
- the load-only bench prints the load's time, peak RSS and frame sizes.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analyzers.loader import load_run
from bench import scale_gen
from ranksight import tables

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("footprint")
    scale_gen.generate(scale_gen.Job(ranks=64, steps=40, compact=True), path, log=None)
    return path


def test_frames_have_narrow_dtypes(store):
    data = load_run(store, scale_gen.RUN)
    st, co, gpu = data.steps, data.collectives, data.gpu
    for c in ("rank", "step", "attempt", "pp_stage"):
        assert st[c].dtype == np.int32, c
    for c in ("step_ms", "compute_ms", "data_ms", "sync_wait_ms", "device_ms"):
        assert st[c].dtype == np.float32, c
    for c in ("t_start", "t_end", "loss", "flops"):  # clocks (seconds since 1970) and the loss keep float64
        assert st[c].dtype == np.float64, c
    for c in ("rank", "step", "seq", "attempt", "ops"):
        assert co[c].dtype == np.int32, c
    assert co["duration_ms"].dtype == np.float32
    assert co["t_arrive"].dtype == np.float64 and co["t_done"].dtype == np.float64
    for c in ("op", "group", "gkey"):
        assert isinstance(co[c].dtype, pd.CategoricalDtype), c
    assert set(co["group"].cat.categories) == {"tp", "dp"}
    assert gpu["throttle_reasons"].dtype == np.int32 and gpu["t"].dtype == np.float64
    # what the checks do with them still works as on strings
    assert (co["group"] == "tp").sum() == 64 * 40 and co["group"].str.startswith("d").sum() == 64 * 40
    assert co["op"].isin(["all_reduce"]).all()


def test_frames_bytes_per_row(store):
    data = load_run(store, scale_gen.RUN)
    per_row = {n: getattr(data, n).memory_usage(deep=False, index=False).sum() / len(getattr(data, n))
               for n in ("steps", "collectives", "gpu")}
    # before: steps 199, collectives 108 (two Arrow string columns: ~28), GPU samples 77 bytes per row
    assert per_row["steps"] <= 135, per_row
    assert per_row["collectives"] <= 70, per_row
    assert per_row["gpu"] <= 70, per_row


def test_collectives_keep_the_writers_group_order(store):
    """The head writes each rank's TP collective before its DP one (not in the groups' alphabetical order): the frame
    keeps the file's order, so no column is copied into another order."""
    data = load_run(store, scale_gen.RUN)
    stored = tables.read_table(store, scale_gen.RUN, "collectives", columns=["step", "rank", "group", "seq"])
    got = data.collectives[["step", "rank", "group", "seq"]]
    assert len(got) == len(stored)
    assert list(got["group"].astype(str)[:4]) == ["tp", "dp", "tp", "dp"]
    assert (got["group"].astype(str).to_numpy() == stored["group"].astype(str).to_numpy()).all()
    assert (got["rank"].to_numpy() == stored["rank"].to_numpy()).all()
    assert (got["step"].to_numpy() == stored["step"].to_numpy()).all()


def test_duplicates_still_dropped_in_writer_group_order(tmp_path):
    """A run of 16 ranks whose parts hold every collective twice (a copy at arrival, then the completed one): one
    row per (attempt, step, rank, group, seq) is kept, the completed one, in the writer's order."""
    job = scale_gen.Job(ranks=16, steps=10, compact=True)
    scale_gen.generate(job, tmp_path, log=None)
    files = tables.part_files(tmp_path / scale_gen.RUN / "collectives")
    t = pq.read_table(files[0])
    arrived = t.set_column(t.schema.get_field_index("t_done"), "t_done", pa.nulls(t.num_rows, pa.float64()))
    pq.write_table(arrived, files[0].with_name("0-arrived.parquet"))
    assert len(tables.part_files(tmp_path / scale_gen.RUN / "collectives")) == len(files) + 1
    data = load_run(tmp_path, scale_gen.RUN)
    co = data.collectives
    assert len(co) == 16 * 10 * 2
    assert co["t_done"].notna().all()
    assert list(co["group"].astype(str)[:2]) == ["tp", "dp"]


def test_load_only_bench(tmp_path):
    r = subprocess.run([sys.executable, "bench/scale_diagnose.py", "--load-only", "--sizes", "16x20", "--rounds", "1",
                        "--baseline", "", "--cache", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "load wall min" in r.stdout and "peak RSS" in r.stdout and "frames steps" in r.stdout, r.stdout
    assert re.search(r"RSS after the load \d+\.\d\d GiB", r.stdout), r.stdout
