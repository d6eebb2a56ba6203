"""The store reader's conversion threads (analyzers/columnar.py ``fill_columns(workers=N)``): a chunk's columns
converted side by side give the very columns one thread gives, on batches whose string dictionaries differ from
chunk to chunk, with nulls in numbers, strings and booleans, list columns, and many chunks; an error raised in a
worker still reaches the caller (the loader's one-by-one fallback rests on it)."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from analyzers import columnar
from analyzers.loader import load_run
from bench import scale_gen


def _batches(n_batches: int, rows: int, seed: int) -> list[pa.RecordBatch]:
    """Collectives batches in the store's schema: strings whose dictionary differs per batch (new groups appear
    late), nulls here and there, some rows with their own member lists."""
    rng = np.random.default_rng(seed)
    schema = pa.schema([columnar.SPECS["collectives"].schema.field(c)
                        for c in columnar.wanted_columns("collectives")])
    out = []
    for b in range(n_batches):
        cols = {}
        for f in schema:
            t = f.type
            if pa.types.is_string(t):
                vals = [None if rng.random() < 0.05 else f"{f.name}-{int(v)}"
                        for v in rng.integers(0, 3 + b, rows)]
                cols[f.name] = pa.array(vals, t)
            elif pa.types.is_list(t):
                cols[f.name] = pa.array([[int(x) for x in rng.integers(0, 8, 3)] if rng.random() < 0.1 else []
                                         for _ in range(rows)], t)
            elif pa.types.is_floating(t):
                v = rng.normal(10, 3, rows)
                cols[f.name] = pa.array(v, t, mask=rng.random(rows) < 0.05)
            elif pa.types.is_boolean(t):
                cols[f.name] = pa.array(rng.random(rows) < 0.5, t, mask=rng.random(rows) < 0.05)
            else:
                cols[f.name] = pa.array(rng.integers(0, 1000, rows), t, mask=rng.random(rows) < 0.05)
        out.append(pa.RecordBatch.from_pydict(cols, schema=schema))
    return out


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, pd.Categorical):
            assert list(x.categories) == list(y.categories), name
            np.testing.assert_array_equal(x.codes, y.codes, err_msg=name)
        elif isinstance(x, columnar.MemberLists):
            np.testing.assert_array_equal(x.lengths, y.lengths, err_msg=name)
            rows = np.flatnonzero(x.lengths)
            for p, q in zip(x.arrays(rows), y.arrays(rows)):
                np.testing.assert_array_equal(p, q, err_msg=name)
        else:
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("workers", [2, 4])
def test_threads_convert_as_one_thread(monkeypatch, workers):
    monkeypatch.setattr(columnar, "CHUNK_ROWS", 1000)  # many chunks: each flush converts in the threads
    batches = _batches(12, 700, seed=workers)
    n = sum(b.num_rows for b in batches)
    one = columnar.fill_columns("collectives", n, iter(batches), workers=1)
    many = columnar.fill_columns("collectives", n, iter(batches), workers=workers)
    _same(one, many)


def test_an_error_in_a_worker_reaches_the_caller(monkeypatch):
    def broken(self, arr, at):
        raise pa.ArrowInvalid("a damaged page")

    monkeypatch.setattr(columnar.Numbers, "put", broken)
    batches = _batches(2, 50, seed=1)
    with pytest.raises(pa.ArrowInvalid):
        columnar.fill_columns("collectives", 100, iter(batches), workers=3)


def test_store_load_is_the_same_with_one_thread(tmp_path, monkeypatch):
    scale_gen.generate(scale_gen.Job(ranks=64, steps=30, compact=True), tmp_path, log=None)
    monkeypatch.setattr(columnar, "CHUNK_ROWS", 512)
    assert 1 <= columnar.conversion_workers() <= 4
    monkeypatch.setattr(columnar, "conversion_workers", lambda: 3)  # threads even on a one-CPU machine
    many = load_run(tmp_path, scale_gen.RUN, progress=False)
    monkeypatch.setattr(columnar, "conversion_workers", lambda: 1)
    one = load_run(tmp_path, scale_gen.RUN, progress=False)
    for name in ("steps", "collectives", "gpu", "host"):
        pd.testing.assert_frame_equal(getattr(one, name), getattr(many, name), check_exact=True, obj=name)
