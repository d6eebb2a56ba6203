"""Summarize a PyTorch profiler (Kineto / Chrome trace JSON) trace per rank, streaming.

Traces reach hundreds of MB, so the file is never loaded whole: ``probes.trace_events`` hands the events over in
chunks of a few MB (plain or gzip, object or bare-array form), each decoded by a typed msgspec decoder of only the
fields used here (other fields are skipped in C), and each chunk is reduced on the spot to interval unions and
per-name totals. Events whose fields have other types (a list ``pid``, a numeric name, non-object args, invalid
UTF-8) are decoded one by one, loosely: coerced as before or counted and skipped. A truncated trace (a crashed
job, a copy in progress) is summarized as far as it goes and marked ``truncated=True`` with a note.

Definitions (all in milliseconds, within the *window*):

- **window**: CPU traces: from the first ``ProfilerStep#N`` start to the last one's end
  (all complete events when there are none). GPU traces: from the first GPU kernel, memcpy or
  memset start to the last one's end (the device timeline). HTA's own default window differs: it
  drops the last ProfilerStep (``include_last_profiler_step=False``); ``ranksight trace`` offers both
  (``--window steps-hta``).
- **communication**: the union of the time intervals of collective activity.
  GPU: kernels (cat ``kernel``) named ``ncclKernel_*`` / ``ncclDevKernel_*``, on any stream.
  CPU/gloo: ``gloo:*`` (and ``nccl:*``) ``user_annotation`` events, which run on the
  ``pt_gloo_runloop`` threads, united with the ``c10d::*`` ``cpu_op`` events on the
  calling threads (issue, and for blocking ops the wait).
- **compute**: GPU: the union of all other kernels on all streams. CPU: the union of
  ``cpu_op`` events that are not communication ops, on threads that are not gloo
  runloop threads.
- **overlap**: |compute ∩ communication| (communication hidden under compute).
- **copy** (GPU): memcpy/memset time under no kernel: the device is busy, neither computing nor
  communicating.
- **idle**: window − |compute ∪ communication ∪ copies|.
- **wall_ms**: the window's length. Hence wall = compute + comm − overlap + copy + idle.
- **top_ops**: per name, inclusive total time and count of ``cpu_op`` events (CPU) or
  kernels (GPU); nested operators are each counted, as in the profiler's own tables.
- **collectives**: each communication event as listed above, in trace order:
  name, ts (µs, trace clock), dur_ms, bytes (from the args when present: NCCL kernels'
  ``In msg nelems`` × dtype size, or gloo's ``Input Dims`` × ``Input type`` size with
  ``record_shapes=True``), kind (``exec`` for gloo:*/NCCL kernels, ``issue`` for c10d::*),
  and tid (CPU) or stream (GPU).

Public API: :func:`summarize_trace` (one file -> :class:`~ranksight.schema.TraceSummary`),
:func:`summarize_traces`.
"""

from __future__ import annotations

import os
import re
from array import array
from typing import Any, Iterable

import msgspec

from probes.trace_events import CHUNK, RAW_LIST, TraceEvents, distributed_info
from ranksight.schema import TraceSummary

_COMPACT_AT = 1 << 20  # intervals kept before an in-place sort+merge (bounds memory)

# Element sizes for the byte counts, keyed by the dtype names Kineto writes
# ("Float", "BFloat16", "c10::Half", "float", "long int", ...), lower-cased.
_DTYPE_SIZE = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
    "c10::half": 2, "c10::bfloat16": 2, "long": 8, "long int": 8, "int64": 8, "int": 4, "int32": 4,
    "short": 2, "int16": 2, "char": 1, "signed char": 1, "int8": 1, "byte": 1, "unsigned char": 1, "uint8": 1,
    "bool": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "c10::complex<float>": 8, "c10::complex<double>": 16,
}
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
_RANK_IN_NAME_RE = re.compile(r"rank[_-]?(\d+)", re.I)


class TraceError(ValueError):
    """The file is not a readable trace at all (no events could be read)."""


_NO_STREAM = object()  # args without a "stream" key (a null one is kept as None)


class _Args(msgspec.Struct, gc=False):
    """The args keys read here; the rest of an event's args is skipped by the decoder."""

    stream: Any = _NO_STREAM
    dtype: Any = None
    nelems: Any = msgspec.field(default=None, name="In msg nelems")
    dims: Any = msgspec.field(default=None, name="Input Dims")
    types: Any = msgspec.field(default=None, name="Input type")
    name: Any = ""  # thread_name metadata: the thread's name


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    name: str | None = None
    cat: str | None = None
    ts: float | None = None
    dur: float | None = None
    pid: int | str | None = None
    tid: int | str | None = None
    args: _Args | None = None


_DECODE = msgspec.json.Decoder(list[_Event])
_DECODE_ONE = msgspec.json.Decoder()


def _decode_chunk(doc: bytes) -> tuple[list, bool]:
    """(events, loose): typed events, or, when some field has another type, the raw events to decode one by one.
    Raises msgspec.DecodeError when ``doc`` is not a JSON array (the reader then tries another cut point)."""
    try:
        return _DECODE.decode(doc), False
    except (msgspec.ValidationError, UnicodeDecodeError):
        return RAW_LIST.decode(doc), True


def _float(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):
        return None


def _loose(raw: msgspec.Raw) -> _Event | None | bool:
    """One event decoded loosely and coerced as the summary reads it: an _Event, None (not an object: not an event
    the summary reads), or False (fields of the wrong type, or not decodable: counted and skipped)."""
    try:
        ev = _DECODE_ONE.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    if not isinstance(ev, dict):
        return None
    name, cat, args = ev.get("name") or "", ev.get("cat") or "", ev.get("args")
    if not isinstance(name, str) or not isinstance(cat, str) or not (args is None or isinstance(args, dict)):
        return False
    a = None
    if args:
        a = _Args(stream=args.get("stream", _NO_STREAM), dtype=args.get("dtype"), nelems=args.get("In msg nelems"),
                  dims=args.get("Input Dims"), types=args.get("Input type"), name=args.get("name", ""))
    ph = ev.get("ph")
    return _Event(ph=ph if isinstance(ph, str) else None, name=name, cat=cat, ts=_float(ev.get("ts")),
                  dur=_float(ev.get("dur")), pid=_key_part(ev.get("pid")), tid=_key_part(ev.get("tid")), args=a)


class IntervalUnion:
    """Union of [start, end) intervals, streamed. Merges on the fly while events arrive in
    order (the usual case per category) and keeps the rest in compact float arrays."""

    __slots__ = ("cs", "ce", "starts", "ends", "limit")

    def __init__(self) -> None:
        self.cs = self.ce = None
        self.starts = array("d")
        self.ends = array("d")
        self.limit = _COMPACT_AT

    def add(self, s: float, e: float) -> None:
        cs = self.cs
        if cs is not None and cs <= s <= self.ce:
            if e > self.ce:
                self.ce = e
            return
        if cs is not None:
            self.starts.append(cs)
            self.ends.append(self.ce)
            if len(self.starts) >= self.limit:
                self._compact()
        self.cs, self.ce = s, e

    def compact_if_large(self) -> None:
        """Merge in place once many intervals are held (callers may append to ``starts``/``ends`` directly, in any
        order: the union does not depend on it)."""
        if len(self.starts) >= self.limit:
            self._compact()

    def _compact(self) -> None:
        st, en = _merge(self.starts, self.ends)
        self.starts, self.ends = array("d", st.tobytes()), array("d", en.tobytes())
        # disjoint intervals do not shrink: the next merge waits until they have doubled (no merge per append)
        self.limit = max(_COMPACT_AT, 2 * len(self.starts))

    def intervals(self):
        """Sorted, disjoint intervals as two numpy arrays."""
        import numpy as np

        if self.cs is not None:
            self.starts.append(self.cs)
            self.ends.append(self.ce)
            self.cs = self.ce = None
        if not self.starts:
            return np.zeros(0), np.zeros(0)
        return _merge(self.starts, self.ends)


def _merge(starts, ends):
    import numpy as np

    s = np.frombuffer(starts, dtype=np.float64) if isinstance(starts, array) else np.asarray(starts, dtype=np.float64)
    e = np.frombuffer(ends, dtype=np.float64) if isinstance(ends, array) else np.asarray(ends, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run_end = np.maximum.accumulate(e)
    # A new merged interval starts where the start is past every earlier end.
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    out_s = s[idx]
    out_e = np.maximum.reduceat(e, idx) if len(idx) else e[:0]
    # reduceat gives the max end within each group; groups are contiguous in sorted order.
    return out_s.copy(), out_e.copy()


def _clip(s, e, lo: float, hi: float):
    import numpy as np

    s = np.clip(s, lo, hi)
    e = np.clip(e, lo, hi)
    keep = e > s
    return s[keep], e[keep]


def _length(s, e) -> float:
    return float((e - s).sum()) if len(s) else 0.0


def _intersection(a_s, a_e, b_s, b_e) -> float:
    """Total length of the intersection of two sorted disjoint interval sets."""
    i = j = 0
    total = 0.0
    na, nb = len(a_s), len(b_s)
    a_s, a_e, b_s, b_e = a_s.tolist(), a_e.tolist(), b_s.tolist(), b_e.tolist()
    while i < na and j < nb:
        lo = a_s[i] if a_s[i] > b_s[j] else b_s[j]
        hi = a_e[i] if a_e[i] < b_e[j] else b_e[j]
        if hi > lo:
            total += hi - lo
        if a_e[i] < b_e[j]:
            i += 1
        else:
            j += 1
    return total


def _nbytes(a: _Args | None) -> int | None:
    if a is None:
        return None
    dt = a.dtype
    n = a.nelems
    if n is not None and dt is not None:
        size = _DTYPE_SIZE.get(str(dt).lower())
        try:
            return int(n) * size if size else None
        except (TypeError, ValueError, OverflowError):
            return None
    dims = a.dims
    types = a.types
    if isinstance(dims, list) and isinstance(types, list):
        total = 0
        found = False
        for d, t in zip(dims, types):
            size = _DTYPE_SIZE.get(str(t).lower())
            if not size or not isinstance(d, list):
                continue
            # A tensor list arrives as a list of dims lists; a tensor as a list of ints.
            shapes = d if d and isinstance(d[0], list) else [d]
            for shp in shapes:
                try:
                    k = 1
                    for x in shp:
                        k *= int(x)
                except (TypeError, ValueError, OverflowError):
                    continue
                total += k * size
                found = True
        return total if found else None
    return None


def _key_part(x: Any) -> Any:
    """A pid/tid usable as a dict key: Kineto writes ints or strings; anything else (a list, a dict) by its repr."""
    return repr(x) if isinstance(x, (list, dict)) else x


def _is_comm_cpu_op(name: str) -> bool:
    return name.startswith(("c10d::", "nccl:", "gloo:")) or name == "record_param_comms"


def summarize_trace(
    path: str,
    *,
    run_id: str = "",
    rank: int | None = None,
    top_k: int = 15,
    max_collectives: int = 10_000,
) -> TraceSummary:
    """Summarize one rank's trace file (``.json`` or ``.json.gz``) in one streaming pass.

    Rank: ``distributedInfo.rank`` when the trace has it, else ``rank``, else ``rankN`` in
    the file name. Raises OSError when the file cannot be opened and :class:`TraceError`
    when not a single event can be read; a trace cut short returns what was read with
    ``truncated=True``.
    """
    notes: list[str] = []
    thread_names: dict[tuple[Any, Any], str] = {}
    gloo_tids: set[tuple[Any, Any]] = set()

    cpu_compute = IntervalUnion()
    cpu_comm = IntervalUnion()
    gpu_compute = IntervalUnion()
    gpu_comm = IntervalUnion()
    gpu_copy = IntervalUnion()  # memcpy / memset: the device is busy, neither computing nor communicating
    steps: dict[int, tuple[float, float]] = {}
    cpu_span = [float("inf"), float("-inf")]
    gpu_span = [float("inf"), float("-inf")]
    cpu_ops: dict[str, list[float]] = {}
    kernels: dict[str, list[float]] = {}
    # listed apart so CPU-side communication events cannot fill the cap of a GPU trace's list (they are dropped there)
    collectives: list[dict[str, Any]] = []  # CPU: gloo/c10d events
    gpu_collectives: list[dict[str, Any]] = []  # GPU: NCCL kernels
    n_coll = 0
    n_gpu_coll = 0
    n_events = 0
    n_malformed = 0  # events skipped for fields of the wrong type
    truncated = False
    # Events on gloo runloop threads are only known as such once the thread_name metadata
    # event is seen, which may come after them: such cpu_ops are held per thread until then.
    held: dict[tuple[Any, Any], IntervalUnion] = {}

    reader = TraceEvents(path, CHUNK)

    def handle(evs: list) -> None:
        nonlocal n_coll, n_gpu_coll
        # the intervals of a chunk are appended as they come (a union does not depend on the order) and merged in
        # numpy once many are held
        gm_s, gm_e = gpu_comm.starts.append, gpu_comm.ends.append
        gc_s, gc_e = gpu_compute.starts.append, gpu_compute.ends.append
        gy_s, gy_e = gpu_copy.starts.append, gpu_copy.ends.append
        cm_s, cm_e = cpu_comm.starts.append, cpu_comm.ends.append
        cc_s, cc_e = cpu_compute.starts.append, cpu_compute.ends.append
        for ev in evs:
            ph = ev.ph
            if ph != "X":
                if ph == "M" and ev.name == "thread_name":
                    a = ev.args
                    tname = str(a.name) if a is not None else ""
                    key = (ev.pid, ev.tid)
                    thread_names[key] = tname
                    if "gloo" in tname:
                        gloo_tids.add(key)
                        held.pop(key, None)
                continue
            ts = ev.ts
            dur = ev.dur
            if ts is None or dur is None or dur < 0:
                continue
            end = ts + dur
            cat = ev.cat or ""
            name = ev.name or ""
            if cat == "kernel":
                if ts < gpu_span[0]:
                    gpu_span[0] = ts
                if end > gpu_span[1]:
                    gpu_span[1] = end
                k = kernels.get(name)
                if k is None:
                    kernels[name] = [dur, 1]
                else:
                    k[0] += dur
                    k[1] += 1
                if name.startswith(("ncclKernel", "ncclDevKernel")):
                    gm_s(ts)
                    gm_e(end)
                    n_gpu_coll += 1
                    if len(gpu_collectives) < max_collectives:
                        a = ev.args
                        stream = a.stream if a is not None else _NO_STREAM
                        gpu_collectives.append({"name": name, "ts": ts, "dur_ms": dur / 1000.0, "bytes": _nbytes(a),
                                                "kind": "exec", "stream": ev.tid if stream is _NO_STREAM else stream,
                                                "device": "gpu"})
                else:
                    gc_s(ts)
                    gc_e(end)
                continue
            if cat == "gpu_memcpy" or cat == "gpu_memset":
                if ts < gpu_span[0]:
                    gpu_span[0] = ts
                if end > gpu_span[1]:
                    gpu_span[1] = end
                gy_s(ts)
                gy_e(end)
                continue
            if ts < cpu_span[0]:
                cpu_span[0] = ts
            if end > cpu_span[1]:
                cpu_span[1] = end
            if cat == "cpu_op":
                k = cpu_ops.get(name)
                if k is None:
                    cpu_ops[name] = [dur, 1]
                else:
                    k[0] += dur
                    k[1] += 1
                if _is_comm_cpu_op(name):
                    cm_s(ts)
                    cm_e(end)
                    n_coll += 1
                    if len(collectives) < max_collectives:
                        collectives.append({"name": name, "ts": ts, "dur_ms": dur / 1000.0, "bytes": _nbytes(ev.args),
                                            "kind": "issue", "tid": ev.tid, "device": "cpu"})
                    continue
                key = (ev.pid, ev.tid)
                if key in gloo_tids:
                    continue
                if key not in thread_names:
                    u = held.get(key)
                    if u is None:
                        u = held[key] = IntervalUnion()
                    u.starts.append(ts)
                    u.ends.append(end)
                else:
                    cc_s(ts)
                    cc_e(end)
                continue
            if cat == "user_annotation" or cat == "":
                if name.startswith("ProfilerStep#"):
                    m = _STEP_RE.match(name)
                    if m:
                        steps[int(m.group(1))] = (ts, end)
                    continue
                if name.startswith(("gloo:", "nccl:")):
                    cm_s(ts)
                    cm_e(end)
                    n_coll += 1
                    if len(collectives) < max_collectives:
                        collectives.append({"name": name, "ts": ts, "dur_ms": dur / 1000.0, "bytes": _nbytes(ev.args),
                                            "kind": "exec" if name.startswith("gloo:") else "issue",
                                            "tid": ev.tid, "device": "cpu"})

    for evs, loose in reader.chunks(_decode_chunk):
        n_events += len(evs)
        if loose:
            typed = []
            for raw in evs:
                ev = _loose(raw)
                if ev is False:
                    n_malformed += 1
                elif ev is not None:
                    typed.append(ev)
            evs = typed
        handle(evs)
        for u in (gpu_compute, gpu_comm, gpu_copy, cpu_compute, cpu_comm, *held.values()):
            u.compact_if_large()
    truncated = reader.truncated
    notes.extend(reader.notes)
    if n_malformed:
        notes.append(f"{n_malformed} event(s) with fields of the wrong type (a non-string name, non-object args) skipped")
    if n_events == 0:
        raise TraceError(f"{path}: no trace events could be read" + (f" ({notes[-1]})" if notes else ""))
    if truncated:
        notes.insert(0, f"truncated: summarized the {n_events} events read before the trace ended")
    distributed = distributed_info(reader.header, reader.trailer)

    # cpu_ops of threads never named: they are compute (no gloo runloop name was ever given).
    for key, u in held.items():
        if key in gloo_tids:
            continue
        hs, he = u.intervals()
        cpu_compute.starts.frombytes(hs.tobytes())
        cpu_compute.ends.frombytes(he.tobytes())

    if rank is None or distributed.get("rank") is not None:
        r = distributed.get("rank")
        if r is not None:
            try:
                rank = int(r)
            except (TypeError, ValueError, OverflowError):
                rank = None
        if rank is None:
            m = _RANK_IN_NAME_RE.search(os.path.basename(path))
            if m:
                rank = int(m.group(1))
                notes.append("rank taken from the file name (no distributedInfo.rank)")
            else:
                rank = 0
                notes.append("rank unknown (no distributedInfo.rank, none given, none in the file name): reported as 0")

    is_gpu = gpu_span[0] <= gpu_span[1]
    if is_gpu:
        lo, hi = gpu_span
        comp, comm = gpu_compute, gpu_comm
        device = "gpu"
    else:
        comp, comm = cpu_compute, cpu_comm
        device = "cpu"
        if steps:
            lo = min(s for s, _ in steps.values())
            hi = max(e for _, e in steps.values())
        else:
            lo, hi = cpu_span
            notes.append("no ProfilerStep#N events: window = all events")
    if not lo <= hi:
        lo = hi = 0.0
    cs, ce = _clip(*comp.intervals(), lo, hi)
    ms, me = _clip(*comm.intervals(), lo, hi)
    compute_us = _length(cs, ce)
    comm_us = _length(ms, me)
    overlap_us = _intersection(cs, ce, ms, me)
    busy_us = compute_us + comm_us - overlap_us
    copy_us = 0.0
    if is_gpu:
        # copies and sets keep the device busy: idle is what no kernel, memcpy or memset covers
        import numpy as np

        ks, ke = _merge(np.concatenate([cs, ms]), np.concatenate([ce, me]))
        ys, ye = _clip(*gpu_copy.intervals(), lo, hi)
        copy_us = _length(ys, ye) - _intersection(ys, ye, ks, ke)
        busy_us += copy_us
    wall_us = hi - lo
    idle_us = max(0.0, wall_us - busy_us)

    table = kernels if is_gpu else cpu_ops
    top = sorted(table.items(), key=lambda kv: kv[1][0], reverse=True)[:top_k]
    top_ops = [{"name": n, "total_ms": round(v[0] / 1000.0, 6), "count": int(v[1]),
                "kind": "kernel" if is_gpu else "cpu_op"} for n, v in top]
    if is_gpu:
        collectives, n_coll = gpu_collectives, n_gpu_coll
    collectives.sort(key=lambda c: c["ts"])
    if n_coll > len(collectives):
        notes.append(f"listed {len(collectives)} of {n_coll} {'NCCL kernels' if is_gpu else 'communication events'} "
                     f"(max_collectives={max_collectives}); the times above count all of them")
    step_start = min(steps) if steps else -1
    step_end = max(steps) if steps else -1
    if distributed.get("backend"):
        notes.append(f"backend {distributed.get('backend')}, world_size {distributed.get('world_size')}")
    return TraceSummary(
        run_id=run_id, rank=int(rank), step_start=step_start, step_end=step_end, trace_file=path,
        wall_ms=wall_us / 1000.0, compute_ms=compute_us / 1000.0, comm_ms=comm_us / 1000.0,
        overlap_ms=overlap_us / 1000.0, idle_ms=idle_us / 1000.0, copy_ms=copy_us / 1000.0, top_ops=top_ops,
        collectives=collectives,
        device=device, truncated=truncated, notes=notes,
    )


def summarize_traces(paths: Iterable[str], **kw: Any) -> tuple[list[TraceSummary], dict[str, str]]:
    """Summarize several rank traces; returns (summaries, {path: error}) and never raises on one bad file."""
    out: list[TraceSummary] = []
    errors: dict[str, str] = {}
    for p in paths:
        try:
            out.append(summarize_trace(p, **kw))
        except (OSError, TraceError) as e:
            errors[p] = f"{type(e).__name__}: {e}"
    return out, errors


__all__ = ["summarize_trace", "summarize_traces", "TraceError", "IntervalUnion"]
