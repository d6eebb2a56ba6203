"""One merged multi-rank trace that opens in Perfetto (ui.perfetto.dev reads Chrome JSON traces), findings marked.

``write_merged(paths, findings, out)`` streams each rank's Kineto trace into one Chrome JSON trace:

- **Kept**: every event whose ``ph`` Perfetto draws (complete ``X``, ``B``/``E``, instants, counters, flows ``s``/``t``/
  ``f``, async ``b``/``n``/``e``, thread metadata), with only the fields it reads: ph, name, cat, ts, dur, pid, tid,
  args (passed through as raw JSON: never decoded), s (instant scope), id, bp. Other phases are dropped and counted.
- **Processes**: each (rank, original pid) gets a new pid, so ranks never collide (Kineto puts every rank's GPU
  on pid = device index, often 0). Each is named by ``process_name`` metadata: ``rank N (GPU d)`` for pids with GPU
  events (kernels, copies, sets), ``rank N (host <host>: <name> pid P)`` for the rest; ``process_sort_index``
  orders ranks, host above GPU. The traces' own process_name/process_labels/process_sort_index events are replaced.
- **Flows**: ids are per trace (correlation ids), so they are made unique per rank: ``(slot << 40) | id``.
- **Clocks**: a trace that carries ``baseTimeNanoseconds`` has ts relative to it (unix ns = base + ts * 1000);
  every such rank is shifted by ``(base - reference) / 1000`` us, the reference being the smallest base among the
  inputs, written out as the merged trace's ``baseTimeNanoseconds``. Traces without one (older Kineto: ts already in
  the host's clock, us) are kept as written. Ranks on different hosts are then aligned only as well as their host
  clocks (NTP) are; the alignment used is stated in the output's ``ranksight`` object and in the result.
- **Findings**: per finding, an instant event (``ph: "i"``) at the time its first step starts: process-scoped on each
  of its ranks' host process, global when it names no rank; and on a "ranksight findings" process a slice spanning
  its steps (from its first step's start to its last step's end, over its ranks, from ``ProfilerStep#N``
  annotations). The finding's text (summary, kind, severity, ranks, steps, evidence, recommendation) is in args.
  A finding whose steps no trace annotates is marked at its ranks' first event, with a note in its args.

Reading (``traces.perfetto_read``): one rank after another, in chunks of events decoded by a typed msgspec decoder
(unknown fields skipped in C, args kept raw), so memory holds one chunk, never a whole rank. A truncated input (a crashed job, a torn ``.gz``)
is merged as far as its complete events go, with a note. The output is written to ``OUT.tmp`` and renamed;
``.gz`` when OUT ends with ``.gz``.
"""

from __future__ import annotations

import gzip
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgspec

from traces.perfetto_read import CHUNK, EventChunks, trace_meta

_FLOW_SHIFT = 40

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy", "Memset"})
KEPT_PH = frozenset({"X", "B", "E", "i", "I", "C", "s", "t", "f", "b", "n", "e", "M"})
_FLOW_PH = frozenset({"s", "t", "f", "b", "n", "e"})
_PROCESS_META = frozenset({"process_name", "process_labels", "process_sort_index"})

_RANK_IN_NAME_RE = re.compile(r"rank[_-]?(\d+)", re.I)
_KINETO_NAME_RE = re.compile(r"^(?P<host>.+)_(?P<pid>\d+)\.\d+\.pt\.trace\.json")
_STEP_RE = re.compile(r"ProfilerStep#(\d+)$")



def _plain(o: Any) -> Any:
    """Numbers from numpy (findings' evidence often holds them) as Python numbers; anything else as text."""
    item = getattr(o, "item", None)
    return item() if callable(item) else str(o)


_ENCODE = msgspec.json.Encoder(enc_hook=_plain)


@dataclass
class RankMerged:
    """What became of one input."""

    path: str
    rank: int
    label: str  # "rank N" (+ " #k" when two inputs claim the same rank)
    host: str = ""
    base_time_ns: int | None = None
    offset_us: float = 0.0  # added to every ts of this rank
    pids: dict[str, int] = field(default_factory=dict)  # original pid (as text) -> merged pid
    kept: dict[str, int] = field(default_factory=dict)  # "ph/cat" -> events written
    dropped: dict[str, int] = field(default_factory=dict)  # "ph/cat" or "M/process_name"... -> events left out
    steps: int = 0  # ProfilerStep annotations seen
    truncated: bool = False
    note: str = ""


@dataclass
class MergeResult:
    out: str
    alignment: str
    ranks: list[RankMerged]
    findings_marked: int = 0
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------


class _Out:
    """The output file: ``{"traceEvents": [`` events ``], ...}``, events appended in encoded batches."""

    def __init__(self, path: str):
        self.tmp = path + ".tmp"
        self.path = path
        self.f = gzip.open(self.tmp, "wb", compresslevel=1) if path.endswith(".gz") else open(self.tmp, "wb")
        self.f.write(b'{"displayTimeUnit": "ms", "traceEvents": [\n')
        self.first = True

    def events(self, events: list) -> None:
        if not events:
            return
        body = _ENCODE.encode(events)[1:-1]
        if not self.first:
            self.f.write(b",\n")
        self.first = False
        self.f.write(body)

    def close(self, trailer: dict[str, Any]) -> None:
        self.f.write(b"\n],\n")
        self.f.write(_ENCODE.encode(trailer)[1:])
        self.f.write(b"\n")
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def _meta(name: str, pid: int, args: dict[str, Any], tid: int = 0) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "ts": 0, "args": args}


def _host_from_name(path: str) -> str:
    m = _KINETO_NAME_RE.match(os.path.basename(path))
    return m.group("host") if m else ""


@dataclass
class _RankState:
    merged: RankMerged
    slot: int
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (start, end) in merged clock
    gpu_steps: dict[int, tuple[float, float]] = field(default_factory=dict)
    first_ts: float | None = None
    host_pid: int | None = None  # merged pid of the process with the ProfilerStep annotations / CPU events
    gpu_pids: set = field(default_factory=set)
    orig_names: dict[Any, str] = field(default_factory=dict)  # original pid -> the trace's own process name


def _merge_rank(path: str, st: _RankState, out: _Out, next_pid: list[int], chunk: int) -> None:
    rm = st.merged
    off = rm.offset_us
    pidmap: dict[Any, int] = {}
    kept = rm.kept
    dropped = rm.dropped
    flow_base = st.slot << _FLOW_SHIFT
    reader = EventChunks(path, chunk)
    for events in reader:
        keep = []
        for ev in events:
            ph = ev.ph
            key = ph + "/" + (ev.name if ph == "M" else ev.cat)
            if ph not in KEPT_PH:
                dropped[key] = dropped.get(key, 0) + 1
                continue
            p = ev.pid
            if ph == "M" and ev.name in _PROCESS_META:  # replaced by ours; a pid with nothing else gets no process
                if ev.name == "process_name":
                    try:
                        st.orig_names[p] = str(msgspec.json.decode(ev.args).get("name", ""))
                    except (msgspec.DecodeError, AttributeError):
                        pass
                dropped[key] = dropped.get(key, 0) + 1
                continue
            newpid = pidmap.get(p)
            if newpid is None:
                newpid = pidmap[p] = next_pid[0]
                next_pid[0] += 1
            ev.pid = newpid
            if ph != "M" and ev.ts is not None:
                if off:
                    ev.ts += off
                if st.first_ts is None or ev.ts < st.first_ts:
                    st.first_ts = ev.ts
            if ev.cat in GPU_CATS:
                st.gpu_pids.add(newpid)
            if ph in _FLOW_PH and ev.id is not None:
                i = ev.id
                ev.id = (flow_base | i) if isinstance(i, int) and 0 <= i < (1 << _FLOW_SHIFT) else "%d:%s" % (st.slot, i)
            if ph == "X" and ev.name.startswith("ProfilerStep#") and ev.ts is not None:
                m = _STEP_RE.match(ev.name)
                if m:
                    try:
                        dur = float(msgspec.json.decode(ev.dur)) if ev.dur else 0.0
                    except (msgspec.DecodeError, TypeError, ValueError):
                        dur = 0.0
                    (st.gpu_steps if ev.cat == "gpu_user_annotation" else st.steps)[int(m.group(1))] = (
                        ev.ts, ev.ts + dur)
                    if ev.cat != "gpu_user_annotation":
                        st.host_pid = newpid
            kept[key] = kept.get(key, 0) + 1
            keep.append(ev)
        out.events(keep)
    rm.truncated = reader.truncated
    rm.note = reader.note
    rm.pids = {str(k): v for k, v in pidmap.items()}
    if not st.steps:
        st.steps = st.gpu_steps
    rm.steps = len(st.steps)
    # Process names and order: rank by rank, host processes above GPUs.
    metas = []
    for orig, newpid in pidmap.items():
        if newpid in st.gpu_pids:
            name = "%s (GPU %s)" % (rm.label, orig)
            sub = 5
        else:
            own = st.orig_names.get(orig, "")
            where = "host %s: " % rm.host if rm.host else "host: "
            name = "%s (%s%s pid %s)" % (rm.label, where, own or "process", orig) if isinstance(orig, int) else \
                "%s (%s)" % (rm.label, orig or "trace")
            sub = 1 if isinstance(orig, int) else 8
            if st.host_pid is None and isinstance(orig, int):
                st.host_pid = newpid
        metas.append(_meta("process_name", newpid, {"name": name}))
        metas.append(_meta("process_sort_index", newpid, {"sort_index": 10 * (st.slot + 1) + sub}))
    out.events(metas)


# ----------------------------------------------------------------------------------------------------------------
# Findings
# ----------------------------------------------------------------------------------------------------------------


def _finding_dict(f: Any) -> dict[str, Any]:
    if isinstance(f, dict):
        return dict(f)
    return msgspec.to_builtins(f, enc_hook=_plain)


def _finding_events(findings: list[dict[str, Any]], states: list[_RankState], findings_pid: int,
                    notes: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Instant events at each finding's start and slices on the findings process; (events, findings marked)."""
    events: list[dict[str, Any]] = [
        _meta("process_name", findings_pid, {"name": "ranksight findings"}),
        _meta("process_sort_index", findings_pid, {"sort_index": 0}),
    ]
    lanes_end: list[float] = []
    marked = 0
    for i, f in enumerate(findings):
        ranks = [int(r) for r in f.get("ranks") or []]
        sts = [s for s in states if s.merged.rank in ranks] if ranks else list(states)
        if ranks and not sts:
            notes.append("finding %d (%s): its ranks %s are in none of the traces; marked globally"
                         % (i, f.get("kind", ""), ranks))
            sts = list(states)
        s0 = f.get("step_start")
        s1 = f.get("step_end")
        if s1 is None:
            s1 = s0
        starts = [s.steps[s0][0] for s in sts if s0 is not None and s0 in s.steps]
        ends = [s.steps[s1][1] for s in sts if s1 is not None and s1 in s.steps]
        where = ""
        if starts:
            t0 = min(starts)
        else:
            firsts = [s.first_ts for s in sts if s.first_ts is not None]
            if not firsts:
                notes.append("finding %d (%s): no event in its ranks' traces; not marked" % (i, f.get("kind", "")))
                continue
            t0 = min(firsts)
            where = ("step %s is annotated in none of its ranks' traces: marked at their first event" % s0
                     if s0 is not None else "no step: marked at its ranks' first event")
        t1 = max(ends) if ends and max(ends) > t0 else None
        sev = f.get("severity", "")
        title = "%s: %s" % (sev, f.get("kind", "finding"))
        args = {"summary": f.get("summary", ""), "kind": f.get("kind", ""), "severity": sev, "ranks": ranks,
                "step_start": s0, "step_end": f.get("step_end"), "evidence": f.get("evidence") or {},
                "recommendation": f.get("recommendation", ""), "analyzer": f.get("analyzer", "")}
        if where:
            args["placement"] = where
        if ranks:
            for s in sts:
                t = s.steps[s0][0] if s0 is not None and s0 in s.steps else (s.first_ts if s.first_ts is not None else t0)
                pid = s.host_pid if s.host_pid is not None else findings_pid
                events.append({"ph": "i", "s": "p", "name": title, "cat": "ranksight", "pid": pid, "tid": 0,
                               "ts": t, "args": args})
        else:
            events.append({"ph": "i", "s": "g", "name": title, "cat": "ranksight", "pid": findings_pid, "tid": 0,
                           "ts": t0, "args": args})
        if t1 is not None:
            lane = next((k for k, e in enumerate(lanes_end) if e <= t0), None)
            if lane is None:
                lane = len(lanes_end)
                lanes_end.append(t1)
                events.append(_meta("thread_name", findings_pid, {"name": "findings %d" % (lane + 1)}, tid=lane + 1))
            lanes_end[lane] = t1
            events.append({"ph": "X", "name": title, "cat": "ranksight", "pid": findings_pid, "tid": lane + 1,
                           "ts": t0, "dur": t1 - t0, "args": args})
        marked += 1
    return events, marked


# ----------------------------------------------------------------------------------------------------------------
# The entry point
# ----------------------------------------------------------------------------------------------------------------


def write_merged(paths: Iterable[str], findings: Iterable[Any] = (), out: str = "merged.json.gz", *,
                 chunk_bytes: int = CHUNK) -> MergeResult:
    """Merge per-rank traces (plain or ``.gz``; paths or objects with a ``path``, e.g. ``RankTrace``) into ``out``
    (``.gz`` when it ends so), findings marked.

    ``findings``: :class:`ranksight.schema.Finding` objects or their dicts. Returns what was merged per rank, the
    clock alignment used and notes (truncated inputs, findings that could not be placed).
    """
    # Paths, or loaded traces (traces.model.RankTrace) that say which file they came from.
    paths = [os.fspath(getattr(p, "path", p)) for p in paths]
    fdicts = [_finding_dict(f) for f in findings]
    notes: list[str] = []
    metas = []
    for i, p in enumerate(paths):
        try:
            rank, base = trace_meta(p)
        except OSError as e:
            notes.append("%s: unreadable (%s)" % (p, e))
            rank, base = None, None
        if rank is None:
            m = _RANK_IN_NAME_RE.search(os.path.basename(p))
            rank = int(m.group(1)) if m else i
        metas.append((p, rank, base))
    bases = [b for _, _, b in metas if b is not None]
    ref = min(bases) if bases else None
    if not bases:
        alignment = "none: no trace carries baseTimeNanoseconds; ts kept as written (each host's clock, us)"
    elif len(bases) == len(metas):
        alignment = ("baseTimeNanoseconds: each rank shifted by (its base - %d ns) / 1000 us; merged ts are relative "
                     "to baseTimeNanoseconds %d" % (ref, ref))
    else:
        alignment = ("partial: ranks with baseTimeNanoseconds shifted to the reference %d ns; ranks without one kept "
                     "as written (they may not line up)" % ref)
    states: list[_RankState] = []
    seen: dict[int, int] = {}
    for slot, (p, rank, base) in enumerate(sorted(metas, key=lambda m: m[1])):
        seen[rank] = seen.get(rank, 0) + 1
        label = "rank %d" % rank if seen[rank] == 1 else "rank %d #%d" % (rank, seen[rank])
        if seen[rank] == 2:
            notes.append("two or more inputs claim rank %d: labelled 'rank %d #k'" % (rank, rank))
        off = (base - ref) / 1000.0 if base is not None and ref is not None else 0.0
        states.append(_RankState(RankMerged(path=p, rank=rank, label=label, host=_host_from_name(p),
                                            base_time_ns=base, offset_us=off), slot))
    out_f = _Out(out)
    next_pid = [1]
    try:
        for st in states:
            try:
                _merge_rank(st.merged.path, st, out_f, next_pid, chunk_bytes)
            except OSError as e:
                st.merged.truncated = True
                st.merged.note = "unreadable: %s" % e
            if st.merged.note:
                notes.append("%s (%s): %s" % (st.merged.label, st.merged.path, st.merged.note))
        findings_pid = next_pid[0]
        fevents, marked = _finding_events(fdicts, states, findings_pid, notes)
        out_f.events(fevents)
        trailer: dict[str, Any] = {"ranksight": {
            "alignment": alignment, "notes": notes,
            "ranks": [{"rank": s.merged.rank, "label": s.merged.label, "path": s.merged.path,
                       "offset_us": s.merged.offset_us, "pids": s.merged.pids, "truncated": s.merged.truncated,
                       "note": s.merged.note} for s in states]}}
        if ref is not None:
            trailer["baseTimeNanoseconds"] = ref
        out_f.close(trailer)
    except BaseException:
        out_f.abort()
        raise
    return MergeResult(out=out, alignment=alignment, ranks=[s.merged for s in states], findings_marked=marked,
                       notes=notes)
