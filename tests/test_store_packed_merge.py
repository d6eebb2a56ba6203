"""``head.store.arrow.merge_packed`` of chunks in several layouts (one per request and layout in a flush) gives the
rows of the chunk-by-chunk merge it replaced: arrival order kept across layouts, each string as wide as its widest,
a field a layout lacks at its default."""

import random

import numpy as np

from head.store.arrow import packed_default, merge_packed, packed_to_table
from ranksight import schema, wire
from ranksight.tables import SPECS


def _reference(kind, chunks):
    """The chunk-by-chunk merge (one slice per chunk and field), with the union layout ``merge_packed`` picks."""
    _, union = merge_packed(kind, chunks)
    arrs = [np.frombuffer(body, lay.dtype) for lay, body in chunks]
    out = np.empty(sum(len(a) for a in arrs), union.dtype)
    pos = 0
    for (lay, _), a in zip(chunks, arrs):
        k = len(a)
        for name in union.dtype.names:
            out[name][pos:pos + k] = a[name] if name in lay.codes else packed_default(union.codes[name],
                                                                                        lay.defaults.get(name))
        pos += k
    return out


def _steps(rng, n, variant):
    rows = []
    for i in range(n):
        kw = dict(run_id="r1", rank=rng.randrange(64), step=rng.randrange(1000), node=1,
                  host="h" * (1 + variant * 5), world_size=64, t_start=1.0 + i, t_end=2.0 + i, step_ms=500.0 + i)
        if variant % 2:
            kw.update(pp_stage=variant, dp_rank=i, loss=None if i % 3 else 2.5)
        if variant == 2:
            kw.update(grad_norm=1.5, overflow=bool(i % 2))
        rows.append(schema.StepRecord(**kw))
    return rows


def test_many_chunks_of_several_layouts_merge_as_chunk_by_chunk():
    rng = random.Random(7)
    chunks = []
    for _ in range(60):
        variant = rng.randrange(4)
        layout, body = wire.pack_records("step", "r1", _steps(rng, rng.randrange(1, 9), variant))
        chunks.append((wire.packed_layout_of("step", layout), body))
    assert len({lay for lay, _ in chunks}) >= 3
    got, union = merge_packed("step", chunks)
    want = _reference("step", chunks)
    assert got.dtype == want.dtype and len(got) == sum(len(b) // lay.dtype.itemsize for lay, b in chunks)
    for name in got.dtype.names:
        a, b = got[name], want[name]
        same = (a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind == "f" else a == b
        assert same.all(), name
    # arrival order: the first chunk's rows first, the last chunk's last
    first = np.frombuffer(chunks[0][1], chunks[0][0].dtype)
    assert (got["rank"][:len(first)] == first["rank"]).all()
    last = np.frombuffer(chunks[-1][1], chunks[-1][0].dtype)
    assert (got["step"][-len(last):] == last["step"]).all()
    assert set(union.dtype.names) <= {f.name for f in SPECS["steps"].schema}
    # what the store takes of it (the new rows) reads as the same rows of the merged records
    mask = np.arange(len(want)) % 3 != 1
    kept = got[mask]
    assert len(kept) == int(mask.sum())
    for name in ("rank", "step", "host", "dp_rank"):
        assert (kept[name] == want[mask][name]).all(), name


def test_a_flush_of_several_layouts_is_stored_as_the_records_merged(tmp_path):
    rng = random.Random(3)
    chunks = []
    for v in (0, 1, 2, 3, 1, 0):
        layout, body = wire.pack_records("step", "r1", _steps(rng, 5, v))
        chunks.append((wire.packed_layout_of("step", layout), body))
    got, union = merge_packed("step", chunks)
    a = packed_to_table("steps", "r1", got, union)
    b = packed_to_table("steps", "r1", _reference("step", chunks), union)
    assert a.num_rows == 30 and a.equals(b)
