"""The run store's big tables read column-wise: part files -> Arrow -> the normalized frames ``RunData`` holds.

``RunData.normalize`` makes a frame of any origin analysable (every column, numbers as numbers, duplicates dropped,
each collective's members and communicator key). On the store's tables (steps, collectives, GPU and host samples:
millions of rows at 1,024 ranks x 10,000 steps) this module gives the same frames without a Python object per row:

- only the columns the analyzers read (``SKIPPED``: the ones no check or report reads are left out);
- a column whose Parquet statistics say it holds one value in every row (a run's attempt 0, its flags False, a GPU's
  XID count 0, a loss scale never set) made from the footers, not decoded (``footer_constants``); zeros as zeroed
  memory the system hands out on first write, so a column no one writes to costs no memory;
- the part files read by one pyarrow dataset scan on all cores, page checksums verified, into columns allocated
  once at their full length, a chunk's columns converted by a thread per CPU (``read_columns``); a damaged or
  foreign file skipped and counted as before;
- strings dictionary-encoded (pandas Categoricals with their categories in sorted order, so a sort by them is the
  sort by the string), the collectives' ``op`` and ``group`` too (a byte per row instead of an Arrow string's ~14;
  code that needs them as strings uses ``.str`` or the categories, never a per-row ``.astype(str)``);
- the sort and the duplicate drop on one integer key per row (``row_order.sorted_last``) instead of pandas' multi-column sort,
  in the order the head writes rows (steps by (step, rank), collectives by (attempt, step, rank, group, seq)): each
  rank's rows and each step's rows are in the order ``normalize`` gives them, and rows already in order (the head's
  parts) are not moved;
- each collective's members attached per communicator, not per row: the ``communicators`` table's members (one
  shared sorted array per communicator, joined by ``comm_id`` code) or the row's own member list (an older writer),
  and its communicator key ``gkey`` computed once per distinct (group, members, attempt) (``attach_members``).

The frames equal ``RunData.normalize``'s up to row order, dtypes (``CONVERT``: int32 ranks, steps and placements,
float32 durations, 32-bit GPU and host telemetry, Categorical strings) and the skipped columns (``tests/test_scale_diagnose.py`` checks it on the fixtures'
runs, on what odd writers leave, and on a generated store).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from analyzers.cpus import available_cpus
from analyzers.column_sinks import Lists, MemberLists, Numbers, Strings
from analyzers.footer_stats import NULL, one_value
from analyzers.row_order import composite_key, sorted_last, take
from ranksight import sort_marker
from ranksight.tables import SPECS

# The tables read here; the others are small and go through ``ranksight.tables.read_parts`` and ``normalize``.
TABLES = ("steps", "collectives", "gpu", "host")

# Columns no analyzer or report reads (tests/test_scale_diagnose.py checks that no module under analyzers/ names
# them): left out of the read. A check that needs one takes it off this list.
# ``run_id``: one run per load, ``RunData.run_id`` says which (a byte per row and a pass over it saved).
SKIPPED: dict[str, tuple[str, ...]] = {
    "steps": ("run_id", "tokens", "lr"),
    "collectives": ("run_id",),
    "gpu": ("run_id", "uuid", "mem_util_pct", "mem_used_bytes", "power_w", "power_limit_w", "mem_clock_mhz",
            "throttle_names", "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes_s", "nvlink_rx_bytes_s"),
    "host": ("run_id", "cpu_pct", "load1", "mem_used_bytes", "net_rx_bytes", "net_tx_bytes", "disk_read_bytes",
             "disk_write_bytes"),
}

# How each column becomes a numpy array: (dtype, value for nulls or None to keep them as NaN), with the values
# ``RunData.normalize`` gives, in narrower types where the checks lose nothing (a frame of 1,024 ranks x 10,000 steps
# holds 10 M step rows and 20 M collective rows):
# - durations in ms as float32 (7 significant digits: a 100,000 ms step to the hundredth of a ms); clocks (t_start,
#   t_end, t_arrive, t_done, sync_arrival: seconds since 1970, which float32 would round to minutes), the loss (a
#   diverging loss past float32's range must stay finite) and FLOPs stay float64;
# - ranks, steps, sequence numbers, attempts, placements as int32 (code that combines them into one key casts to
#   int64 first).
# Columns not listed keep their stored type (numbers) or become Categoricals (strings).
_F0 = (np.float64, 0.0)
_FN = (np.float64, None)
_F32_0 = (np.float32, 0.0)
_F32N = (np.float32, None)
_I32 = (np.int32, 0)
_B = (np.bool_, False)
STEP_MS = ("step_ms", "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "pipeline_wait_ms",
           "compute_ms")
CONVERT: dict[str, dict[str, tuple]] = {
    "steps": {**{c: _F32_0 for c in STEP_MS + ("mem_bytes",)}, "flops": _F0,
              **{c: _F32N for c in ("sync_wait_ms", "device_ms", "loss_scale", "grad_norm")},
              **{c: _FN for c in ("sync_arrival", "loss", "t_start", "t_end")},
              **{c: _I32 for c in ("rank", "step", "attempt", "node", "world_size", "pp_stage", "dp_rank", "tp_rank",
                                   "microbatches")},
              **{c: _B for c in ("loss_nonfinite", "overflow", "skipped", "profiling")}},
    "collectives": {**{c: _FN for c in ("t_arrive", "t_done")}, "duration_ms": _F32N, "nbytes": _F0,
                    **{c: _I32 for c in ("rank", "step", "seq", "attempt")},
                    "ops": (np.int32, 1)},  # a part written before ops was a field: one op per record
    "gpu": {"t": _FN},
    "host": {"t": _FN},
}

# Columns whose record field may be None: integers among them are read as floats (NaN), as pandas reads them.
NULLABLE: dict[str, frozenset[str]] = {
    name: frozenset(f.name for f in msgspec.inspect.type_info(SPECS[name].type).fields
                    if isinstance(f.type, msgspec.inspect.UnionType)) for name in TABLES}


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


def _file_format(dict_cols: list[str], local: bool) -> ds.ParquetFileFormat:
    return ds.ParquetFileFormat(
        read_options=ds.ParquetReadOptions(dictionary_columns=dict_cols),
        # page checksums (the head writes them) are verified: a corrupted page fails instead of reading back as
        # garbage numbers, and its file is skipped. On local disk no pre-buffering: it reads a file's column chunks
        # ahead into a cache kept until the file is done, i.e. a compacted file's whole compressed size on top of
        # the frames; on object storage the coalesced reads are worth it.
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True,
                                                                    pre_buffer=not local))


def _where(f) -> tuple[str, object]:
    """(path, pyarrow filesystem or None for local disk) of a listed file: a ``Path`` or a
    ``ranksight.store_layout.StoreFile`` (a partition a head compacted to object storage)."""
    fs = getattr(f, "fs", None)
    return (f.path, fs) if fs is not None else (os.fspath(f), None)


def _read_one(f, schema: pa.Schema, dict_cols: list[str]) -> pa.Table:
    """One part file in ``schema`` (columns it predates as nulls); raises on a damaged or foreign file."""
    path, fs = _where(f)
    have = set(pq.read_schema(path, filesystem=fs).names)
    cols = [c for c in schema.names if c in have]
    t = pq.read_table(path, columns=cols, read_dictionary=[c for c in dict_cols if c in have],
                      page_checksum_verification=True, filesystem=fs)
    arrays = [t.column(c).cast(schema.field(c).type) if c in have else pa.nulls(t.num_rows, schema.field(c).type)
              for c in schema.names]
    return pa.Table.from_arrays(arrays, schema=schema)


def _dataset(files: list, schema: pa.Schema, dict_cols: list[str]) -> ds.Dataset:
    """One dataset over the files in order: a run of files on one filesystem is one file list (local disk, or the
    object storage a head compacted partitions to)."""
    runs: list[tuple[object, list[str]]] = []
    for f in files:
        path, fs = _where(f)
        if runs and runs[-1][0] is fs:
            runs[-1][1].append(path)
        else:
            runs.append((fs, [path]))
    parts = [ds.dataset(paths, schema=schema, format=_file_format(dict_cols, local=fs is None), filesystem=fs)
             for fs, paths in runs]
    return parts[0] if len(parts) == 1 else ds.dataset(parts)


# How far the scan decodes ahead of the conversion (pyarrow's defaults: 4 files, 16 batches each): the batches
# decoded ahead wait in memory, and on a big run (part files of millions of rows) they were a good part of the peak.
SCAN_READAHEAD = {"fragment_readahead": 1, "batch_readahead": 2}


def _batches(table: str, files: list, on_file: Callable[[Path], None] | None, bad: list[int] | None
             ) -> tuple[int, Iterator[pa.RecordBatch], dict[str, object]]:
    """(rows, their record batches in file order, the constant columns) of the part files of ``table``,
    ``wanted_columns`` only: read on all cores by one dataset scan (``bad`` None: a damaged or foreign file raises),
    or file by file, the bad ones skipped and counted in ``bad[0]``. The columns the footers say hold one value
    throughout (``footer_constants``; dataset scan only) are left out of the scan. ``on_file`` is called as each
    file is read."""
    columns = wanted_columns(table)
    schema = _read_schema(table, columns)
    dict_cols = [f.name for f in schema if pa.types.is_dictionary(f.type)]
    if bad is not None:
        return (*_one_by_one(files, schema, dict_cols, on_file, bad), {})
    dataset = _dataset(files, schema, dict_cols)
    constants = footer_constants(table, dataset)
    rows = dataset.count_rows()  # the footers: the columns are allocated once, at their full length
    by_path = {_where(f)[0]: f for f in files}
    scan_columns = [c for c in columns if c not in constants]

    def scanned() -> Iterator[pa.RecordBatch]:
        seen: set[str] = set()
        last = None
        for tagged in dataset.scanner(columns=scan_columns, use_threads=True, **SCAN_READAHEAD).scan_batches():
            path = tagged.fragment.path
            if path != last:
                if last is not None and on_file is not None:
                    on_file(by_path.get(last, Path(last)))
                seen.add(path)
                last = path
            yield tagged.record_batch
        if last is not None and on_file is not None:
            on_file(by_path.get(last, Path(last)))
        if on_file is not None:
            for path, f in by_path.items():
                if path not in seen:  # a file without rows
                    on_file(f)

    return rows, scanned(), constants


def footer_constants(table: str, dataset: ds.Dataset) -> dict[str, object]:
    """The numeric columns of ``table`` the footers of ``dataset`` show to hold one value in every row
    (``analyzers.footer_stats.one_value``): made from the footer instead of decoded (a run's attempt 0, its flags
    False, a GPU's XID count 0, a count of ops 1, a loss scale never set...). At least one column is left to the scan
    (its batches carry the row counts)."""
    spec = SPECS[table].schema
    kinds = {}
    for c in wanted_columns(table):
        t = spec.field(c).type
        if _numbers(table, spec.field(c)) is not None and (
                pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t)):
            kinds[c] = pa.types.is_floating(t)
    out = one_value(dataset, kinds)
    if out and len(out) == len(wanted_columns(table)):
        out.pop(next(iter(out)))
    return out


def constant_column(table: str, field: pa.Field, value: object, n: int) -> np.ndarray:
    """``n`` rows of ``value`` (``footer_constants``') as ``Numbers`` would convert them. Zero (0, False): zeroed
    memory the system hands out on first write, so a column never written costs no memory."""
    dtype, fill = _numbers(table, field)
    if value is NULL:
        value = fill if fill is not None else np.nan
    # the stored value cast as a decoded column is (an int64 to float32 rounds as numpy's cast does)
    v = np.asarray([value]).astype(dtype)[0]
    return np.zeros(n, dtype) if v == 0 else np.full(n, v, dtype)


def _one_by_one(files: list, schema: pa.Schema, dict_cols: list[str], on_file, bad: list[int]
                ) -> tuple[int, Iterator[pa.RecordBatch]]:
    tables = []
    for f in files:
        try:
            tables.append(_read_one(f, schema, dict_cols))
        except Exception:  # noqa: BLE001 - a damaged or foreign file: skip it and count it
            bad[0] += 1
        if on_file is not None:
            on_file(f)
    return sum(t.num_rows for t in tables), (b for t in tables for b in t.to_batches())


def _numbers(table: str, field: pa.Field) -> tuple | None:
    """(numpy dtype, value for nulls or None for NaN) of a numeric column; None for strings and lists."""
    how = CONVERT.get(table, {}).get(field.name)
    if how is not None:
        return how
    t = field.type
    if pa.types.is_dictionary(t) or pa.types.is_string(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        return None
    if pa.types.is_boolean(t):
        return np.bool_, False
    small = table in ("gpu", "host")  # telemetry: percentages, clocks, watts, counters hold in 32 bits
    if pa.types.is_floating(t) or field.name in NULLABLE.get(table, ()):
        return np.float32 if small else np.float64, None
    # telemetry counters (throttle reason bits, XID and ECC totals, node and GPU numbers) hold in 32 bits
    return np.int32 if small and "bytes" not in field.name else np.int64, 0


def _sink(table: str, field: pa.Field, n: int):
    how = _numbers(table, field)
    if how is not None:
        return Numbers(n, *how)
    t = field.type
    if pa.types.is_dictionary(t) or pa.types.is_string(t):
        return Strings(n)
    return Lists(n)


def read_columns(table: str, files: list[Path], on_file: Callable[[Path], None] | None = None
                 ) -> tuple[dict[str, object] | None, int]:
    """The part files of ``table`` as columns (numpy arrays, Categoricals, ``MemberLists``), None when no row, and
    how many files could not be read. Each column is allocated once at its full length and filled batch by batch
    as the files are decoded: the peak holds the columns and the batches in flight, not the table twice."""
    workers = conversion_workers()
    try:
        return fill_columns(table, *_batches(table, files, on_file, None), workers=workers,
                            release_each_chunk=RELEASE_EACH_CHUNK), 0
    except (pa.ArrowException, OSError, ValueError, TypeError):  # a damaged or foreign file: one by one
        bad = [0]
        return fill_columns(table, *_batches(table, files, on_file, bad), workers=workers,
                            release_each_chunk=RELEASE_EACH_CHUNK), bad[0]


# diagnose's load: Arrow's freed pages are reused chunk after chunk within a table and given back after each table
# (``read_tables``). The load's peak is then ~0.35 GiB higher, still ~0.5 GiB under the run's (the collective checks
# on the loaded frames), for ~1-2 s less kernel time at 1,024 x 10,000.
RELEASE_EACH_CHUNK = False


def conversion_workers() -> int:
    """Threads that convert a chunk's columns side by side (``fill_columns``): the CPUs this process may use, at
    most 4. The conversion is numpy copies and casts and Arrow kernels, which run without the GIL; one thread left
    a second core idle while the load's main thread converted and Arrow's threads waited for it."""
    return min(4, available_cpus())


CHUNK_ROWS = 1 << 18  # batches (a part file's each) gathered into this many rows before they are converted


def fill_columns(table: str, n: int, batches: Iterator[pa.RecordBatch], constants: dict[str, object] | None = None,
                 workers: int = 1, release_each_chunk: bool = True) -> dict[str, object] | None:
    """``n`` rows of ``table`` from ``batches`` (a store's part files, or the head's live window) into the columns
    the analyzers read (``wanted_columns``), each converted once into a preallocated numpy/Categorical column; None
    when there is no row. ``constants``: columns not in the batches, one value in every row (``footer_constants``).
    ``workers`` > 1: a chunk's columns are converted by that many threads side by side (each column by one thread,
    into its own part of its own array: the values are the same whichever thread converts which).
    ``release_each_chunk``: Arrow's freed pages go back to the system after each chunk (a lower peak), else the next
    chunk's decoding reuses them (less kernel time: fresh pages are faulted in and zeroed)."""
    constants = constants or {}
    fields = _read_schema(table, wanted_columns(table))
    sinks = {f.name: _sink(table, f, n) for f in fields if f.name not in constants} if n else {}
    at = 0
    buf: list[pa.RecordBatch] = []
    rows = 0
    pool = None
    if workers > 1 and len(sinks) > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ranksight-convert")

    def flush() -> None:
        nonlocal at, rows
        if rows > n - at:
            raise ValueError("more rows than the part files' footers said")  # read again, one by one
        def put(name: str, start: int) -> None:
            sinks[name].put(pa.chunked_array([b.column(name) for b in buf], type=buf[0].schema.field(name).type),
                            start)

        if pool is None:
            for name in sinks:
                put(name, at)
        else:  # list(): waits for every column, and raises the first error a column's conversion raised
            list(pool.map(put, list(sinks), [at] * len(sinks)))
        at += rows
        buf.clear()
        rows = 0
        if release_each_chunk:
            # the converted batches are freed: their pages go back to the system now, not when the allocator gets
            # round to it (kept per chunk, a load's peak RSS is ~0.3 GiB higher at 1,024 x 10,000)
            pa.default_memory_pool().release_unused()

    try:
        for b in batches:  # (consumed even without rows: it calls the progress back)
            if b.num_rows:
                buf.append(b)
                rows += b.num_rows
                if rows >= CHUNK_ROWS:  # one conversion per column for many small part files
                    flush()
        if buf:
            flush()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    if not at:
        return None
    return {f.name: constant_column(table, f, constants[f.name], at) if f.name in constants else sinks[f.name].done(at)
            for f in fields}


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
    own: MemberLists | None = cols.pop("group_ranks", None)  # type: ignore[assignment]
    own_len = own.lengths if own is not None else np.zeros(n, np.int32)
    members: list[np.ndarray] = [np.zeros(0, np.int64)]  # 0: no members known
    mid = np.zeros(n, np.int32)  # which of ``members`` each row has
    comm = cols.get("comm_id")
    known = _members_of(communicators)
    if isinstance(comm, pd.Categorical) and known:
        cat_mid = np.zeros(len(comm.categories) + 1, np.int32)  # the last slot: null comm_id
        for i, cid in enumerate(comm.categories):
            m = known.get(str(cid))
            if m is not None:
                members.append(m)
                cat_mid[i] = len(members) - 1
        mid = cat_mid[comm.codes]  # (code -1, no comm_id: the last slot)
        mid[own_len > 0] = 0  # a record's own member list wins, as before
    rows = np.flatnonzero(own_len > 0)
    if len(rows):  # records that carry their member list (an older writer): one array per distinct list
        seen: dict[bytes, int] = {}
        for r, a in zip(rows, own.arrays(rows)):
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
    gcode = group.codes  # (composite_key widens to int64 once)
    att = cols["attempt"]
    combo = composite_key([gcode, mid, att])
    span = int(np.prod(combo[1], dtype=object)) if combo is not None else 0
    if combo is None or span > 4 * n + 1024:
        code, uniq = pd.factorize(pd.MultiIndex.from_arrays([gcode, mid, att]))
        firsts = [(int(a), int(b), int(c)) for a, b, c in uniq]
    else:  # few combinations: a lookup table over the composite code (no hashing), decoded back into its parts
        code, spans = combo
        del combo
        present = np.flatnonzero(np.bincount(code, minlength=span))
        lut = np.zeros(span, np.int32)
        lut[present] = np.arange(len(present), dtype=np.int32)
        code = lut[code]  # (the int64 composite freed here)
        s_mid, s_att = spans[1], spans[2]
        lo = (int(gcode.min()), int(mid.min()), int(att.min()))
        firsts = [(int(v // (s_mid * s_att)) + lo[0], int(v // s_att % s_mid) + lo[1], int(v % s_att) + lo[2])
                  for v in present]
    names = [group_key(group.categories[g] if g >= 0 else None, members[m], a) for g, m, a in firsts]
    cats = sorted(set(names))
    pos = {k: i for i, k in enumerate(cats)}
    width = np.int8 if len(cats) < 127 else np.int16 if len(cats) < 32767 else np.int32
    remap = np.array([pos[k] for k in names], dtype=width)  # the codes made once, in the Categorical's own width
    cols["gkey"] = pd.Categorical.from_codes(remap[code], categories=pd.Index(cats, dtype=object), validate=False)


# --------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------


def marked_in_order(table: str, files: list) -> bool:
    """Whether ``files`` (in the order read) are compacted files whose markers say their rows come strictly in
    ``table``'s key order, one file after the other (``ranksight.sort_marker``): then the sort and the duplicate
    drop have nothing to do. Parts (not compacted) and unmarked files: False, without opening any."""
    if table not in sort_marker.KEYS or not files:
        return False
    if not all(sort_marker.is_compacted_name(_where(f)[0]) for f in files):
        return False
    markers = []
    for f in files:
        path, fs = _where(f)
        try:
            meta = pq.read_metadata(path, filesystem=fs).metadata
        except (pa.ArrowException, OSError, ValueError):
            return False
        markers.append(sort_marker.read_marker(meta, table))
        if markers[-1] is None:
            return False
    return sort_marker.in_key_order(table, markers)


def steps_frame(cols: dict[str, object], in_order: bool = False) -> pd.DataFrame:
    st = cols
    # compute_ms: the rank's own work; derive it where the writer left it out (as ``normalize``)
    comp = st["compute_ms"]
    missing = comp <= 0
    if missing.any():
        parts = st["forward_ms"] + st["backward_ms"] + st["optimizer_ms"]
        derived = np.clip(st["step_ms"] - st["data_ms"] - st["comm_ms"] - st["pipeline_wait_ms"], 0, None)
        comp[missing] = np.where(parts[missing] > 0, parts[missing], derived[missing])
    # a restarted rank re-runs steps: keep the newest attempt of each (rank, step). Rows in (step, rank) order:
    # the order the head writes them in (no reordering to do), and each rank's rows in step order as before.
    # ``in_order``: the files' markers say so already (and no (step, rank) twice).
    if not in_order:
        take(cols, sorted_last([st["step"], st["rank"], st["attempt"]], 2, tiebreak=st["t_end"]))
    return pd.DataFrame(cols, copy=False)


def first_seen_order(codes: np.ndarray) -> np.ndarray:
    """Categorical ``codes`` renumbered (int64) in the order each first appears, no value (-1) last."""
    seen = pd.unique(codes[codes >= 0]) if len(codes) else codes
    lut = np.full(int(codes.max(initial=0)) + 2, len(seen), np.int64)  # the last slot: -1, after every group
    lut[seen] = np.arange(len(seen))
    return lut[codes]


def collectives_frame(cols: dict[str, object], communicators: pd.DataFrame, group_key, in_order: bool = False
                      ) -> pd.DataFrame:
    dur, done = cols["duration_ms"], cols["t_done"]
    need = np.isnan(dur) & ~np.isnan(done)
    if need.any():
        dur[need] = (done[need] - cols["t_arrive"][need]) * 1000.0
    # a collective may be written at arrival and again when done: keep the completed one
    # Rows in (attempt, step, rank, group, seq) order, the groups in the order they first appear: the order the head
    # writes them in (nothing moves), and each rank's and each communicator's rows in sequence order as before. (A
    # duplicate is the same (attempt, step, rank, group, seq): the step is part of the key here, a copy that names
    # another step is a different record.) ``in_order``: the files' markers say so already (and no key twice).
    if not in_order:
        gcode = first_seen_order(cols["group"].codes)  # type: ignore[union-attr]
        take(cols, sorted_last([cols["attempt"], cols["step"], cols["rank"], gcode, cols["seq"],
                                (~np.isnan(done)).astype(np.int8)], 5))
        del gcode
    attach_members(cols, communicators, group_key)
    return pd.DataFrame(cols, copy=False)


def samples_frame(cols: dict[str, object]) -> pd.DataFrame:
    t = cols["t"]
    if not bool((t[1:] >= t[:-1]).all()):  # NaN compares False: sorted (NaN last) by argsort
        take(cols, np.argsort(t, kind="stable"))
    return pd.DataFrame(cols, copy=False)


def read_tables(table_files: dict[str, list[Path]], communicators: pd.DataFrame, group_key,
                on_files: Callable[[str, Path], None] | None = None) -> tuple[dict[str, pd.DataFrame], int]:
    """The normalized frames of ``TABLES`` that have rows, and the number of part files that could not be read."""
    frames, bad = {}, 0
    for name in TABLES:
        files = table_files.get(name) or []
        if not files:
            continue
        in_order = marked_in_order(name, files)
        cols, nbad = read_columns(name, files, (lambda f, name=name: on_files(name, f)) if on_files else None)
        bad += nbad
        if cols is None:
            continue
        if name == "steps":
            frames[name] = steps_frame(cols, in_order)
        elif name == "collectives":
            frames[name] = collectives_frame(cols, communicators, group_key, in_order)
        else:
            frames[name] = samples_frame(cols)
        del cols
        # the decoded pages are freed by now; hand the allocator's cached pages back before the next table
        pa.default_memory_pool().release_unused()
    return frames, bad
