"""The run store's big tables read column-wise: part files -> Arrow -> the normalized frames ``RunData`` holds.

``RunData.normalize`` makes a frame of any origin analysable (every column, numbers as numbers, duplicates dropped,
each collective's members and communicator key). On the store's tables (steps, collectives, GPU and host samples:
millions of rows at 1,024 ranks x 10,000 steps) this module gives the same frames without a Python object per row:

- only the columns the analyzers read (``SKIPPED``: the ones no check or report reads are left out);
- the part files read by pyarrow's dataset scanner on all cores, page checksums verified, a damaged or foreign
  file skipped and counted as before (``read_arrow``); strings stay dictionary-encoded (pandas Categoricals with
  their categories in sorted order, so a sort by them is the sort by the string);
- the sort and the duplicate drop on one integer key per row (``sorted_last``) instead of pandas' multi-column sort;
- each collective's members attached per communicator, not per row: the ``communicators`` table's members (one
  shared sorted array per communicator, joined by ``comm_id`` code) or the row's own member list (an older writer),
  and its communicator key ``gkey`` computed once per distinct (group, members, attempt) (``attach_members``).

The frames equal ``RunData.normalize``'s up to dtypes (int32 placement columns, Categorical strings) and the
skipped columns (``tests/test_scale_diagnose.py`` checks it on the fixtures' runs and a generated store).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ranksight.tables import SPECS

# The tables read here; the others are small and go through ``ranksight.tables.read_parts`` and ``normalize``.
TABLES = ("steps", "collectives", "gpu", "host")

# Columns no analyzer or report reads (tests/test_scale_diagnose.py checks that no module under analyzers/ names
# them): left out of the read. A check that needs one takes it off this list.
SKIPPED: dict[str, tuple[str, ...]] = {
    "steps": ("tokens", "lr"),
    "collectives": (),
    "gpu": ("uuid", "mem_util_pct", "mem_used_bytes", "power_limit_w", "mem_clock_mhz", "throttle_names",
            "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes_s", "nvlink_rx_bytes_s"),
    "host": ("cpu_pct", "load1", "net_rx_bytes", "net_tx_bytes", "disk_read_bytes", "disk_write_bytes"),
}

# How each column becomes a numpy array, as ``RunData.normalize`` converts it: (dtype, value for nulls or None
# to keep them as NaN). Columns not listed keep their stored type (numbers) or become Categoricals (strings).
_F0 = (np.float64, 0.0)
_FN = (np.float64, None)
_I0 = (np.int64, 0)
_I32 = (np.int32, 0)  # placement columns: small numbers, read by comparisons and group-bys only
_B = (np.bool_, False)
CONVERT: dict[str, dict[str, tuple]] = {
    "steps": {**{c: _F0 for c in ("step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms",
                                  "pipeline_wait_ms", "compute_ms", "flops", "mem_bytes")},
              **{c: _FN for c in ("sync_arrival", "sync_wait_ms", "loss", "loss_scale", "grad_norm", "t_start",
                                  "t_end", "device_ms")},
              **{c: _I0 for c in ("rank", "step", "attempt")},
              **{c: _I32 for c in ("node", "world_size", "pp_stage", "dp_rank", "tp_rank", "microbatches")},
              **{c: _B for c in ("loss_nonfinite", "overflow", "skipped", "profiling")}},
    "collectives": {**{c: _FN for c in ("t_arrive", "t_done", "duration_ms")}, "nbytes": _F0,
                    **{c: _I0 for c in ("rank", "step", "seq", "attempt")}},
    "gpu": {"t": _FN},
    "host": {"t": _FN},
}

FILES_PER_SCAN = 256  # part files per dataset scan: the progress bar moves between scans


def wanted_columns(table: str) -> list[str]:
    """The stored columns of ``table`` the analyzers read, in the store's order."""
    skip = set(SKIPPED.get(table, ()))
    return [n for n in SPECS[table].schema.names if n not in skip]


def _read_schema(table: str, columns: list[str]) -> pa.Schema:
    """The store schema of ``columns``, strings as dictionaries (read as such from the Parquet pages)."""
    fields = []
    for c in columns:
        f = SPECS[table].schema.field(c)
        fields.append(pa.field(c, pa.dictionary(pa.int32(), pa.string())) if f.type == pa.string() else f)
    return pa.schema(fields)


def _file_format(dict_cols: list[str]) -> ds.ParquetFileFormat:
    return ds.ParquetFileFormat(
        read_options=ds.ParquetReadOptions(dictionary_columns=dict_cols),
        # page checksums (the head writes them) are verified: a corrupted page fails instead of reading back as
        # garbage numbers, and its file is skipped
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True))


def _read_one(f: Path, schema: pa.Schema, dict_cols: list[str]) -> pa.Table:
    """One part file in ``schema`` (columns it predates as nulls); raises on a damaged or foreign file."""
    have = set(pq.read_schema(f).names)
    cols = [c for c in schema.names if c in have]
    t = pq.read_table(f, columns=cols, read_dictionary=[c for c in dict_cols if c in have],
                      page_checksum_verification=True)
    arrays = [t.column(c).cast(schema.field(c).type) if c in have else pa.nulls(t.num_rows, schema.field(c).type)
              for c in schema.names]
    return pa.Table.from_arrays(arrays, schema=schema)


def read_arrow(table: str, files: list[Path], on_files: Callable[[list[Path]], None] | None = None
               ) -> tuple[pa.Table | None, int]:
    """The part files of ``table`` as one Arrow table of ``wanted_columns`` (None when no row), and how many files
    could not be read. Files are scanned in groups on all cores, in name order; a group with a damaged or foreign
    file is read again file by file, skipping (and counting) the bad ones. ``on_files`` is called after each
    group."""
    columns = wanted_columns(table)
    schema = _read_schema(table, columns)
    dict_cols = [f.name for f in schema if pa.types.is_dictionary(f.type)]
    fmt = _file_format(dict_cols)
    parts, bad = [], 0
    for i in range(0, len(files), FILES_PER_SCAN):
        group = files[i:i + FILES_PER_SCAN]
        try:
            parts.append(ds.dataset([str(f) for f in group], schema=schema, format=fmt).to_table(use_threads=True))
        except (pa.ArrowException, OSError, ValueError, TypeError):
            for f in group:
                try:
                    parts.append(_read_one(f, schema, dict_cols))
                except Exception:  # noqa: BLE001 - a damaged or foreign file: skip it and count it
                    bad += 1
        if on_files is not None:
            on_files(group)
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return None, bad
    return (parts[0] if len(parts) == 1 else pa.concat_tables(parts)), bad


# --------------------------------------------------------------------------
# Arrow columns to numpy / pandas
# --------------------------------------------------------------------------


def to_numpy(col: pa.ChunkedArray, dtype, fill) -> np.ndarray:
    """A column as one numpy array of ``dtype``; nulls become ``fill`` (None: NaN, for floats)."""
    if fill is not None and col.null_count:
        col = pc.fill_null(col, pa.scalar(fill, col.type) if not pa.types.is_null(col.type) else fill)
    if pa.types.is_null(col.type):  # a column no part file has
        return np.full(len(col), np.nan if fill is None else fill, dtype=dtype)
    a = col.to_numpy()  # one copy out of the chunks
    if a.dtype == object:  # bools with nulls and fill None: not wanted here
        a = np.array([fill if v is None else v for v in a], dtype=dtype)
    return a.astype(dtype, copy=False)


def to_categorical(col: pa.ChunkedArray) -> pd.Categorical:
    """A dictionary-encoded string column as a Categorical whose categories are sorted (nulls: NaN)."""
    if pa.types.is_null(col.type):
        return pd.Categorical.from_codes(np.full(len(col), -1, np.int8), categories=pd.Index([], dtype=object))
    cat = col.to_pandas()
    cat = cat.array if isinstance(cat, pd.Series) else cat
    if not isinstance(cat, pd.Categorical):
        cat = pd.Categorical(cat)
    cats = cat.categories
    if len(cats) > 1 and not cats.is_monotonic_increasing:
        cat = cat.reorder_categories(sorted(cats))
    return cat


def frame_of(table: str, t: pa.Table) -> pd.DataFrame:
    """The Arrow table as a pandas frame, column by column (each freed from the Arrow table once converted)."""
    convert = CONVERT.get(table, {})
    cols: dict[str, object] = {}
    for name in t.column_names:
        col = t.column(name)
        if name in convert:
            cols[name] = to_numpy(col, *convert[name])
        elif pa.types.is_dictionary(col.type) or pa.types.is_string(col.type):
            cols[name] = to_categorical(col if pa.types.is_dictionary(col.type) else col.dictionary_encode())
        elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            cols[name] = col  # handled by the caller (collectives' group_ranks)
        else:
            cols[name] = col.to_numpy() if not col.null_count or not pa.types.is_boolean(col.type) else \
                col.to_pandas().to_numpy()
    return cols  # type: ignore[return-value]


# --------------------------------------------------------------------------
# Sort and duplicate drop on one integer key
# --------------------------------------------------------------------------


def _composite(keys: list[np.ndarray]) -> tuple[np.ndarray, list[int]] | None:
    """One int64 per row ordering as the tuple of ``keys`` (integer arrays), and each key's span; None when the
    spans' product does not fit in 62 bits."""
    spans, los = [], []
    total = 1
    for k in keys:
        lo, hi = (int(k.min()), int(k.max())) if len(k) else (0, 0)
        span = hi - lo + 1
        total *= span
        if total >= 2**62:
            return None
        spans.append(span)
        los.append(lo)
    code = np.zeros(len(keys[0]), np.int64)
    for k, lo, span in zip(keys, los, spans):
        code *= span
        code += k.astype(np.int64, copy=False) - lo
    return code, spans


def sorted_last(keys: list[np.ndarray], n_unique: int, tiebreak: np.ndarray | None = None) -> np.ndarray:
    """Row indices sorted by ``keys`` (integer arrays) then ``tiebreak`` (floats, NaN last), stable, keeping the
    last row of each distinct ``keys[:n_unique]``: ``sort_values(keys + [tiebreak]).drop_duplicates(keys[:n_unique],
    keep="last")``'s rows."""
    comp = _composite(keys)
    if comp is None:
        order = np.lexsort(([tiebreak] if tiebreak is not None else []) + keys[::-1])
        ks = [k[order] for k in keys[:n_unique]]
        same = np.ones(max(len(order) - 1, 0), np.bool_)
        for k in ks:
            same &= k[1:] == k[:-1]
    else:
        code, spans = comp
        order = np.argsort(code, kind="stable")
        c = code[order]
        if tiebreak is not None and len(c) > 1 and bool((c[1:] == c[:-1]).any()):
            order = np.lexsort((tiebreak, code))  # equal keys: the tiebreak decides which row is last
            c = code[order]
        div = int(np.prod(spans[n_unique:], dtype=object)) if n_unique < len(keys) else 1
        g = c // div if div > 1 else c
        same = g[1:] == g[:-1]
    keep = np.ones(len(order), np.bool_)
    keep[:-1] = ~same
    return order[keep]


def dense_codes(code: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """``code`` (ints in 0..span-1) renumbered 0..k-1 in increasing order, and the first row of each."""
    present = np.zeros(span, np.bool_)
    present[code] = True
    lut = np.cumsum(present, dtype=np.int64) - 1
    dense = lut[code]
    first = np.empty(int(present.sum()), np.int64)
    first[dense[::-1]] = np.arange(len(code) - 1, -1, -1)  # the last write wins: the first row of each
    return dense, first


def take(cols: dict[str, object], idx: np.ndarray) -> dict[str, object]:
    out = {}
    for name, v in cols.items():
        out[name] = v.take(idx) if not isinstance(v, np.ndarray) else v[idx]
    return out


# --------------------------------------------------------------------------
# Members and communicator keys of collectives
# --------------------------------------------------------------------------


def _members_of(communicators: pd.DataFrame) -> dict[str, np.ndarray]:
    """comm_id -> its members (sorted int64 array), from the communicators table; groups without members left out."""
    if communicators is None or communicators.empty or "comm_id" not in communicators.columns:
        return {}
    out = {}
    for cid, rk in zip(communicators["comm_id"], communicators["ranks"]):
        if isinstance(rk, (list, tuple, np.ndarray)) and len(rk):
            out[str(cid)] = np.asarray(sorted(int(x) for x in rk), dtype=np.int64)
    return out


def attach_members(cols: dict[str, object], communicators: pd.DataFrame, group_key) -> None:
    """In place: ``group_ranks`` (object column, one shared array per distinct member list) and ``gkey`` (a
    Categorical) of the collectives' columns, as ``RunData.normalize`` gives them (``with_members``, ``group_keys``):
    a record that names its group by ``comm_id`` (and carries no member list) gets its communicator's members."""
    n = len(cols["rank"])
    own: pa.ChunkedArray | None = cols.pop("group_ranks", None)  # type: ignore[assignment]
    own_len = (pc.fill_null(pc.list_value_length(own), 0).to_numpy().astype(np.int64) if own is not None
               else np.zeros(n, np.int64))
    members: list[np.ndarray] = [np.zeros(0, np.int64)]  # 0: no members known
    mid = np.zeros(n, np.int64)
    comm = cols.get("comm_id")
    known = _members_of(communicators)
    if isinstance(comm, pd.Categorical) and known:
        cat_mid = np.zeros(len(comm.categories) + 1, np.int64)  # the last slot: null comm_id
        for i, cid in enumerate(comm.categories):
            m = known.get(str(cid))
            if m is not None:
                members.append(m)
                cat_mid[i] = len(members) - 1
        mid = cat_mid[comm.codes.astype(np.int64)]
        mid[own_len > 0] = 0  # a record's own member list wins, as before
    rows = np.flatnonzero(own_len > 0)
    if len(rows):  # records that carry their member list (an older writer): one array per distinct list
        seen: dict[bytes, int] = {}
        for r, arr in zip(rows, own.take(pa.array(rows)).to_pandas()):
            a = np.asarray(arr)
            k = a.astype(np.int64).tobytes()
            j = seen.get(k)
            if j is None:
                members.append(a)
                j = seen[k] = len(members) - 1
            mid[r] = j
    obj = np.empty(len(members), dtype=object)
    for i, m in enumerate(members):
        obj[i] = m
    cols["group_ranks"] = obj[mid]
    # gkey: once per distinct (group, members, attempt)
    group: pd.Categorical = cols["group"]  # type: ignore[assignment]
    gcode = group.codes.astype(np.int64)
    att = cols["attempt"]
    combo = _composite([gcode, mid, att])
    if combo is None or int(np.prod(combo[1], dtype=object)) > 4 * n + 1024:
        code, uniq = pd.factorize(pd.MultiIndex.from_arrays([gcode, mid, att]))
        firsts = [(int(a), int(b), int(c)) for a, b, c in uniq]
    else:  # few combinations: a lookup table over the composite code, no hashing
        code, first = dense_codes(combo[0], int(np.prod(combo[1], dtype=object)))
        firsts = [(int(gcode[i]), int(mid[i]), int(att[i])) for i in first]
    names = [group_key(group.categories[g] if g >= 0 else None, members[m], a) for g, m, a in firsts]
    cats = sorted(set(names))
    pos = {k: i for i, k in enumerate(cats)}
    remap = np.array([pos[k] for k in names], dtype=np.int32)
    cols["gkey"] = pd.Categorical.from_codes(remap[code], categories=pd.Index(cats, dtype=object))


# --------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------


def steps_frame(t: pa.Table) -> pd.DataFrame:
    cols = frame_of("steps", t)
    st = cols
    # compute_ms: the rank's own work; derive it where the writer left it out (as ``normalize``)
    comp = st["compute_ms"]
    missing = comp <= 0
    if missing.any():
        parts = st["forward_ms"] + st["backward_ms"] + st["optimizer_ms"]
        derived = np.clip(st["step_ms"] - st["data_ms"] - st["comm_ms"] - st["pipeline_wait_ms"], 0, None)
        comp = comp.copy()
        comp[missing] = np.where(parts[missing] > 0, parts[missing], derived[missing])
        st["compute_ms"] = comp
    # a restarted rank re-runs steps: keep the newest attempt of each (rank, step)
    keep = sorted_last([st["rank"], st["step"], st["attempt"]], 2, tiebreak=st["t_end"])
    return pd.DataFrame(take(cols, keep), copy=False)


def collectives_frame(t: pa.Table, communicators: pd.DataFrame, group_key) -> pd.DataFrame:
    cols = frame_of("collectives", t)
    dur, done = cols["duration_ms"], cols["t_done"]
    need = np.isnan(dur) & ~np.isnan(done)
    if need.any():
        dur = dur.copy()
        dur[need] = (done[need] - cols["t_arrive"][need]) * 1000.0
        cols["duration_ms"] = dur
    # a collective may be written at arrival and again when done: keep the completed one
    group: pd.Categorical = cols["group"]  # type: ignore[assignment]
    gcode = group.codes.astype(np.int64)
    gcode[gcode < 0] = len(group.categories)  # no group name sorts last, as NaN does
    keep = sorted_last([cols["rank"], cols["attempt"], gcode, cols["seq"], (~np.isnan(done)).astype(np.int64)], 4)
    if len(keep) < len(cols["rank"]) or not np.array_equal(keep, np.arange(len(keep))):
        cols = take(cols, keep)
    attach_members(cols, communicators, group_key)
    return pd.DataFrame(cols, copy=False)


def samples_frame(table: str, t: pa.Table) -> pd.DataFrame:
    cols = frame_of(table, t)
    order = np.argsort(cols["t"], kind="stable")
    return pd.DataFrame(take(cols, order), copy=False)


def read_tables(table_files: dict[str, list[Path]], communicators: pd.DataFrame, group_key,
                on_files: Callable[[str, list[Path]], None] | None = None) -> tuple[dict[str, pd.DataFrame], int]:
    """The normalized frames of ``TABLES`` that have rows, and the number of part files that could not be read."""
    frames, bad = {}, 0
    for name in TABLES:
        files = table_files.get(name) or []
        if not files:
            continue
        t, nbad = read_arrow(name, files, (lambda fs, name=name: on_files(name, fs)) if on_files else None)
        bad += nbad
        if t is None:
            continue
        if name == "steps":
            frames[name] = steps_frame(t)
        elif name == "collectives":
            frames[name] = collectives_frame(t, communicators, group_key)
        else:
            frames[name] = samples_frame(name, t)
        del t
    return frames, bad
