"""Read a Kineto trace file (plain or ``.gz``, possibly truncated) into a ``model.RankTrace``.

How: ``probes.trace_events`` (the reader the agent's summarizer shares) cuts the events array into chunks of about
``CHUNK`` bytes at event boundaries and each chunk is decoded by ``msgspec`` into small typed Structs that name only
the fields the analyses use (unknown fields are skipped at C speed). Each chunk becomes numpy columns and is
dropped, so memory holds one chunk of events plus the columns. A chunk whose types do not match the typed Structs
(a string ``ts``, say) is decoded again loosely and coerced, event by event; an event that cannot be is dropped.

A truncated file (a crashed job, a copy in progress, a gzip member cut short) is read up to its last complete
event, with a note; a bare event array may leave out its closing ``]`` (the format allows it). Rank: ``distributedInfo.rank``, else ``rank-3`` / ``rank3`` / ``rank_3`` in the file name,
else the order the files were given in (each with a note).
"""

from __future__ import annotations

import os
import re
from array import array
from typing import Any, Callable, Union

import msgspec
import numpy as np

from probes.trace_events import RAW_LIST, TraceEvents, json_object_after

from traces.model import (DTYPE_SIZE, KIND_COMM, KIND_COMPUTE, KIND_MEMCPY, KIND_MEMSET, Collectives, GpuOps,
                          RankTrace, Steps, is_nccl_kernel)

CHUNK = 8 << 20
_STEP_RE = re.compile(r"ProfilerStep#(\d+)$")
_RANK_IN_NAME_RE = re.compile(r"rank[_-]?(\d+)", re.I)
_GPU_CATS = {"kernel": KIND_COMPUTE, "Kernel": KIND_COMPUTE, "gpu_memcpy": KIND_MEMCPY, "Memcpy": KIND_MEMCPY,
             "gpu_memset": KIND_MEMSET, "Memset": KIND_MEMSET}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "Driver"}


class TraceError(ValueError):
    """The file is not a readable trace at all (no events could be read)."""


class Args(msgspec.Struct):
    stream: int | None = None
    correlation: int | None = None
    coll: str | None = msgspec.field(default=None, name="Collective name")
    nelems: int | None = msgspec.field(default=None, name="In msg nelems")
    dtype: str | None = None
    pg: str | None = msgspec.field(default=None, name="Process Group Name")
    pg_ranks: Union[str, list[int], None] = msgspec.field(default=None, name="Process Group Ranks")


class Event(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float | None = None
    dur: float | None = None
    tid: Union[int, str, None] = None
    args: Args | None = None


class LooseEvent(msgspec.Struct):
    ph: Any = None
    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    tid: Any = None
    args: Any = None


class DistInfo(msgspec.Struct):
    rank: Any = None
    world_size: Any = None
    backend: Any = None
    pg_config: Any = None


_dec = msgspec.json.Decoder(list[Event])
_loose_dec = msgspec.json.Decoder(LooseEvent)
_dist_dec = msgspec.json.Decoder(DistInfo)


_I64 = 2**63 - 1


def _i64(x) -> int:
    """An int64 column value: -1 for a missing one or one no int64 holds (a trace may hold anything)."""
    return x if isinstance(x, int) and -_I64 <= x <= _I64 else -1


class _Columns:
    """Accumulates the columns of one rank, chunk by chunk."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {"": 0}
        # typed arrays, 8 bytes a value (a list holds a Python object per value: ~4x the memory on a large trace)
        self.g: dict[str, array] = {"ts": array("d"), "dur": array("d"), "kind": array("b"), "stream": array("q"),
                                    "name": array("i"), "corr": array("q")}
        self.c: dict[str, array] = {"gi": array("q"), "coll": array("i"), "pg": array("i"), "pgr": array("i"),
                                    "nel": array("q"), "nby": array("q")}
        self.n_gpu = 0
        self.l_corr = array("q")
        self.l_ts = array("d")
        self.l_end = array("d")
        self.steps: dict[int, tuple[float, float]] = {}
        self.n_events = 0
        self.skipped = 0

    def nid(self, s: str) -> int:
        i = self.names.get(s)
        if i is None:
            i = self.names[s] = len(self.names)
        return i

    def add(self, evs: list) -> None:
        self.n_events += len(evs)
        gpu = []
        for e in evs:
            if e.ph != "X" or e.ts is None or e.dur is None:
                continue
            cat = e.cat
            if cat in _GPU_CATS:
                gpu.append(e)
            elif cat in _LAUNCH_CATS:
                a = e.args
                if a is not None and a.correlation is not None and 0 < a.correlation <= _I64:
                    self.l_corr.append(a.correlation)
                    self.l_ts.append(e.ts)
                    self.l_end.append(e.ts + e.dur)
            elif e.name.startswith("ProfilerStep#"):
                m = _STEP_RE.match(e.name)
                if m:
                    self.steps[int(m.group(1))] = (e.ts, e.ts + e.dur)
        g = self.g
        nid = self.nid
        base = self.n_gpu
        for k, e in enumerate(gpu):
            a = e.args
            kind = _GPU_CATS[e.cat]
            name = e.name
            if kind == KIND_COMPUTE and is_nccl_kernel(name):
                kind = KIND_COMM
                c = self.c
                c["gi"].append(base + k)
                c["coll"].append(nid(a.coll or "") if a is not None else 0)
                c["pg"].append(nid(a.pg or "") if a is not None else 0)
                pgr = a.pg_ranks if a is not None else None
                if isinstance(pgr, list):
                    pgr = "[" + ", ".join(str(x) for x in pgr) + "]"
                c["pgr"].append(nid(pgr or ""))
                nel = _i64(a.nelems) if a is not None else -1
                c["nel"].append(nel)
                size = DTYPE_SIZE.get((a.dtype or "").lower()) if a is not None else None
                c["nby"].append(_i64(nel * size) if size and nel >= 0 else -1)
            g["ts"].append(e.ts)
            g["dur"].append(e.dur)
            g["kind"].append(kind)
            g["stream"].append(_i64(a.stream) if a is not None and a.stream is not None else
                               (_i64(e.tid) if isinstance(e.tid, int) else -1))
            g["name"].append(nid(name))
            g["corr"].append(_i64(a.correlation) if a is not None else -1)
        self.n_gpu += len(gpu)


def _coerce(loose: list) -> list:
    """Loosely decoded events -> typed ones; an event whose fields cannot be read is dropped."""
    out = []
    for e in loose:
        try:
            a = e.args if isinstance(e.args, dict) else {}
            args = Args(stream=_int(a.get("stream")), correlation=_int(a.get("correlation")),
                        coll=_str(a.get("Collective name")), nelems=_int(a.get("In msg nelems")),
                        dtype=_str(a.get("dtype")), pg=_str(a.get("Process Group Name")),
                        pg_ranks=_str(a.get("Process Group Ranks")))
            out.append(Event(ph=_str(e.ph) or "", cat=_str(e.cat) or "", name=_str(e.name) or "",
                             ts=_float(e.ts), dur=_float(e.dur), tid=e.tid if isinstance(e.tid, (int, str)) else None,
                             args=args))
        except (TypeError, ValueError):
            continue
    return out


def _float(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def _int(x: Any) -> int | None:
    v = _float(x)
    return int(v) if v is not None and abs(v) < 2**62 else None


def _str(x: Any) -> str | None:
    return x if isinstance(x, str) else (None if x is None else str(x))


def _decode(doc: bytes) -> list:
    """A JSON array of events -> typed events (loosely decoded and coerced when some field has another type).
    Raises msgspec.DecodeError when ``doc`` is not a JSON array (the reader then tries another cut point)."""
    try:
        return _dec.decode(doc)
    except (msgspec.ValidationError, UnicodeDecodeError):
        loose = []
        for raw in RAW_LIST.decode(doc):
            try:
                loose.append(_loose_dec.decode(raw))
            except (msgspec.DecodeError, UnicodeDecodeError):
                continue  # not an event object, or not decodable: dropped
        return _coerce(loose)


def load_trace(path: str, *, order: int = 0) -> RankTrace:
    """Read one rank's trace. Raises OSError when the file cannot be opened, TraceError when no event is read."""
    notes: list[str] = []
    cols = _Columns()
    reader = TraceEvents(path, CHUNK)
    for evs in reader.chunks(_decode):
        cols.add(evs)
    notes.extend(reader.notes)
    if cols.n_events == 0:
        raise TraceError(f"{path}: no trace events could be read" + (f" ({notes[-1]})" if notes else ""))
    if reader.truncated:
        notes.insert(0, f"truncated: read the {cols.n_events} events before the trace ended")
    return _build(path, order, cols, reader.header, reader.trailer, reader.truncated, notes)


def _build(path: str, order: int, cols: _Columns, header: bytes, trailer: bytes, truncated: bool,
           notes: list[str]) -> RankTrace:
    dist = None
    for text in (header, trailer):
        obj = json_object_after(text, b"distributedInfo") if text else None
        if obj is not None:
            try:
                dist = _dist_dec.decode(obj)
                break
            except msgspec.DecodeError:
                pass
    rank = _int(dist.rank) if dist is not None else None
    if rank is not None:
        source = "distributedInfo"
    else:
        m = _RANK_IN_NAME_RE.search(os.path.basename(path))
        if m:
            rank, source = int(m.group(1)), "file name"
            notes.append("rank taken from the file name (no distributedInfo.rank)")
        else:
            rank, source = order, "order"
            notes.append(f"rank unknown (no distributedInfo.rank, none in the file name): rank {order}, the file's "
                         "place in the list")
    g = cols.g
    ts = np.asarray(g["ts"], dtype=np.float64)
    dur = np.asarray(g["dur"], dtype=np.float64)
    neg = dur < 0
    if neg.any():
        notes.append(f"{int(neg.sum())} GPU events with a negative duration counted as 0")
        dur = np.where(neg, 0.0, dur)
    corr = np.asarray(g["corr"], dtype=np.int64)
    launch_ts = np.full(len(ts), np.nan)
    launch_end = np.full(len(ts), np.nan)
    lc = np.asarray(cols.l_corr, dtype=np.int64)
    if len(lc) and len(corr):
        o = np.argsort(lc, kind="stable")
        lc_s = lc[o]
        pos = np.searchsorted(lc_s, corr)
        pos_c = np.minimum(pos, len(lc_s) - 1)
        hit = (corr >= 0) & (lc_s[pos_c] == corr)
        lts = np.asarray(cols.l_ts, dtype=np.float64)[o]
        lend = np.asarray(cols.l_end, dtype=np.float64)[o]
        launch_ts[hit] = lts[pos_c[hit]]
        launch_end[hit] = lend[pos_c[hit]]
    order_idx = np.argsort(ts, kind="stable")
    inv = np.empty_like(order_idx)
    inv[order_idx] = np.arange(len(order_idx))
    gpu = GpuOps(ts=ts[order_idx], dur=dur[order_idx], kind=np.asarray(g["kind"], dtype=np.int8)[order_idx],
                 stream=np.asarray(g["stream"], dtype=np.int64)[order_idx],
                 name_id=np.asarray(g["name"], dtype=np.int32)[order_idx], corr=corr[order_idx],
                 launch_ts=launch_ts[order_idx], launch_end=launch_end[order_idx])
    c = cols.c
    gi = inv[np.asarray(c["gi"], dtype=np.int64)] if c["gi"] else np.zeros(0, dtype=np.int64)
    co = np.argsort(gi, kind="stable")
    coll_id = np.asarray(c["coll"], dtype=np.int32)[co]
    pg_id = np.asarray(c["pg"], dtype=np.int32)[co]
    gi = gi[co]
    # Sequence within (process group and its ranks, collective, kernel name) on this rank: how ranks' collectives are matched.
    seq = np.zeros(len(gi), dtype=np.int64)
    counters: dict[tuple[int, int, int, int], int] = {}
    names_of_op = gpu.name_id[gi] if len(gi) else np.zeros(0, dtype=np.int32)
    pgr_id = np.asarray(c["pgr"], dtype=np.int32)[co]
    for k, key in enumerate(zip(pg_id.tolist(), pgr_id.tolist(), coll_id.tolist(), names_of_op.tolist())):
        n = counters.get(key, 0)
        seq[k] = n
        counters[key] = n + 1
    coll = Collectives(op=gi, coll_id=coll_id, pg_id=pg_id,
                       pg_ranks_id=pgr_id,
                       nelems=np.asarray(c["nel"], dtype=np.int64)[co],
                       nbytes=np.asarray(c["nby"], dtype=np.int64)[co], seq=seq)
    snums = sorted(cols.steps)
    steps = Steps(num=np.asarray(snums, dtype=np.int64),
                  ts=np.asarray([cols.steps[s][0] for s in snums], dtype=np.float64),
                  end=np.asarray([cols.steps[s][1] for s in snums], dtype=np.float64))
    names = [""] * len(cols.names)
    for s, i in cols.names.items():
        names[i] = s
    n_nolaunch = int(np.isnan(gpu.launch_ts).sum())
    if len(gpu) and n_nolaunch:
        notes.append(f"{n_nolaunch} of {len(gpu)} GPU events have no launch event (kept and counted; HTA drops "
                     "kernels without one)")
    if not len(gpu):
        notes.append("no GPU events (kernel, gpu_memcpy, gpu_memset): a CPU-only trace")
    pg_config = dist.pg_config if dist is not None and isinstance(dist.pg_config, list) else []
    return RankTrace(path=path, rank=int(rank), rank_source=source,
                     world_size=_int(dist.world_size) if dist is not None else None, gpu=gpu, coll=coll,
                     steps=steps, names=names, pg_config=[p for p in pg_config if isinstance(p, dict)],
                     backend=_str(dist.backend) or "" if dist is not None else "", truncated=truncated,
                     n_events=cols.n_events, n_launches=len(lc), notes=notes)


def trace_files(paths: list[str]) -> list[str]:
    """Files as given, directories expanded to their trace files (``*.json``, ``*.json.gz``, ``*.pt.trace*``)."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for root, _dirs, files in os.walk(p):
                for f in sorted(files):
                    if f.endswith((".json", ".json.gz", ".gz")) and not f.startswith("."):
                        out.append(os.path.join(root, f))
        else:
            out.append(p)
    return out


def load_traces(paths: list[str], each: Callable[[RankTrace], None] | None = None
                ) -> tuple[list[RankTrace], dict[str, str]]:
    """Load every file (directories expanded); returns (traces sorted by rank, {path: error}). ``each`` is called on
    every trace as soon as it is loaded (``ranksight trace`` analyses it there, then slims it: one large trace in
    memory at a time)."""
    out: list[RankTrace] = []
    errors: dict[str, str] = {}
    for i, p in enumerate(trace_files(paths)):
        try:
            t = load_trace(p, order=i)
        except (OSError, TraceError) as e:
            errors[p] = f"{type(e).__name__}: {e}"
            continue
        if each is not None:
            each(t)
        out.append(t)
    seen: dict[int, str] = {}
    for t in out:
        if t.rank in seen:
            t.notes.append(f"rank {t.rank} also in {seen[t.rank]}")
        seen.setdefault(t.rank, t.path)
    out.sort(key=lambda t: (t.rank, t.path))
    return out, errors


__all__ = ["load_trace", "load_traces", "trace_files", "TraceError", "CHUNK"]
