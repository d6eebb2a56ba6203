"""The live window's GPU samples as Arrow: batches brought to one schema, each sample's GPU as one integer.

``head.live.RunLive`` keeps a run's GPU samples as the Arrow batches they arrived in, trimmed to each GPU's last
samples; its views (the analysis round's frame, every GPU's newest sample, the runs list) read them with these.
"""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pyarrow as pa

from head.live_frames import numpy_column
from ranksight import schema
from ranksight.tables import SPECS

log = logging.getLogger("ranksight.live")

# the GPU samples' string columns kept dictionary-encoded in the window (head.live.DICT_COLUMNS)
GPU_DICT_COLUMNS = ("run_id", "host", "source", "name", "uuid")


def dense_gpu_keys(chunks: list[pa.Table]) -> list[np.ndarray]:
    """Each batch's samples' GPU as a small integer, (node + 1) * (largest gpu + 2) + gpu + 1 (a null node or gpu as
    -1): one per (node, gpu), dense enough to count per GPU with ``np.bincount``."""
    def col(t, name):
        return np.nan_to_num(numpy_column(t, name).astype(np.float64), nan=-1).astype(np.int64)

    nodes = [col(t, "node") for t in chunks]
    gpus = [col(t, "gpu") for t in chunks]
    width = max((int(g.max()) for g in gpus if len(g)), default=0) + 2
    return [(n + 1) * width + g + 1 for n, g in zip(nodes, gpus)]


def _window_schema() -> pa.Schema:
    """The GPU window's schema: the store's, with GPU_DICT_COLUMNS dictionary-encoded."""
    s = SPECS["gpu"].schema
    for name in GPU_DICT_COLUMNS:
        i = s.get_field_index(name)
        s = s.set(i, pa.field(name, pa.dictionary(pa.int32(), pa.string())))
    return s


_GPU_WINDOW_SCHEMA = _window_schema()


def concat_gpu(chunks: list) -> pa.Table:
    """GPU sample batches as one table in the store's schema, or the window's (its batches are kept with their strings
    dictionary-encoded); a batch from decoded records and one that arrived packed may differ in column types."""
    schema_ = SPECS["gpu"].schema
    out = []
    for t in chunks:
        if not (t.schema.equals(schema_) or t.schema.equals(_GPU_WINDOW_SCHEMA)):
            t = t.select([n for n in schema_.names if n in t.column_names]).cast(
                pa.schema([schema_.field(n) for n in schema_.names if n in t.column_names]))
        out.append(t)
    return pa.concat_tables(out, promote_options="default") if len(out) > 1 else out[0]


def gpu_codes(t: pa.Table) -> np.ndarray:
    """Each sample's (node, gpu) as one integer (node << 20 | gpu; -1 parts for nulls)."""
    node = np.nan_to_num(numpy_column(t, "node").astype(np.float64), nan=-1).astype(np.int64)
    gpu = np.nan_to_num(numpy_column(t, "gpu").astype(np.float64), nan=-1).astype(np.int64)
    return (node << 20) | (gpu & 0xFFFFF)


def gpu_records(t: pa.Table, run_id: str) -> list[schema.GpuSample]:
    """GPU sample rows as records for the views. A null where the record has a default (a sender that left a list or
    a count out) takes the default; a row that still does not convert is left out and logged, never the whole view."""
    rows = t.to_pylist()
    try:
        return msgspec.convert(rows, list[schema.GpuSample], strict=False)
    except (msgspec.ValidationError, TypeError):
        pass
    out, bad = [], 0
    for row in rows:
        try:
            out.append(msgspec.convert({k: v for k, v in row.items() if v is not None}, schema.GpuSample,
                                       strict=False))
        except (msgspec.ValidationError, TypeError):
            bad += 1
    if bad:
        log.error("live %s: %d gpu row(s) not shown live: they do not convert to GPU samples", run_id, bad)
    return out
