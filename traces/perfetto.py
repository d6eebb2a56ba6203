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

Reading: one rank after another, in chunks of events decoded by a typed msgspec decoder (unknown fields skipped in
C, args kept raw), so memory holds one chunk, never a whole rank. A truncated input (a crashed job, a torn ``.gz``)
is merged as far as its complete events go, with a note. The output is written to ``OUT.tmp`` and renamed;
``.gz`` when OUT ends with ``.gz``.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import msgspec
from msgspec import Raw

_READ = 1 << 20
_CHUNK = 4 << 20  # bytes of events decoded at once
_SLACK = 64 << 10  # bytes buffered past the chunk size before a split is looked for
_MAX_TRIES = 16  # split points tried before a chunk is judged corrupt (a wrong split fails to decode)
_HEAD_MAX = 64 << 20  # bytes read looking for "traceEvents" before the input is judged not a trace
_TAIL = 256 << 10  # bytes of the file's end searched for baseTimeNanoseconds / distributedInfo
_FLOW_SHIFT = 40

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "Kernel", "Memcpy", "Memset"})
KEPT_PH = frozenset({"X", "B", "E", "i", "I", "C", "s", "t", "f", "b", "n", "e", "M"})
_FLOW_PH = frozenset({"s", "t", "f", "b", "n", "e"})
_PROCESS_META = frozenset({"process_name", "process_labels", "process_sort_index"})

_EVENTS_RE = re.compile(rb'"traceEvents"\s*:\s*\[')
_SPLIT_RE = re.compile(rb"\}\s*,\s*\{")
_BASE_RE = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')
# distributedInfo's own "rank" (its pg_config entries say "ranks"), wherever it comes among its keys.
_DIST_RANK_RE = re.compile(rb'"distributedInfo"\s*:\s*\{.{0,65536}?"rank"\s*:\s*(-?\d+)', re.S)
_WS = frozenset(b" \t\r\n")
_RANK_IN_NAME_RE = re.compile(r"rank[_-]?(\d+)", re.I)
_KINETO_NAME_RE = re.compile(r"^(?P<host>.+)_(?P<pid>\d+)\.\d+\.pt\.trace\.json")
_STEP_RE = re.compile(r"ProfilerStep#(\d+)$")


class _Event(msgspec.Struct, omit_defaults=True):
    """The fields Perfetto reads; decoded from and encoded to the same shape. Raw fields pass through untouched."""

    ph: str = ""
    name: str = ""
    cat: str = ""
    ts: float | None = None
    dur: Raw = Raw()
    pid: int | str = 0
    tid: Raw = Raw()
    s: Raw = Raw()
    id: int | str | None = None
    bp: Raw = Raw()
    args: Raw = Raw()


def _plain(o: Any) -> Any:
    """Numbers from numpy (findings' evidence often holds them) as Python numbers; anything else as text."""
    item = getattr(o, "item", None)
    return item() if callable(item) else str(o)


_DECODE_EVENTS = msgspec.json.Decoder(list[_Event])
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
# Reading: bytes of a plain or gzipped file, torn gzip tolerated
# ----------------------------------------------------------------------------------------------------------------


def _is_gz(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _read_blocks(path: str, state: dict) -> Iterator[bytes]:
    """Decompressed blocks of the file; a torn gzip stream ends the blocks and sets ``state["torn"]``."""
    gz = _is_gz(path)
    with open(path, "rb") as f:
        if not gz:
            while block := f.read(_READ):
                yield block
            return
        d = zlib.decompressobj(wbits=47)
        while True:
            raw = f.read(_READ)
            if not raw:
                if not d.eof:
                    state["torn"] = True
                return
            try:
                out = d.decompress(raw)
            except zlib.error:
                state["torn"] = True
                return
            if out:
                yield out
            while d.eof and d.unused_data:  # concatenated gzip members
                rest = d.unused_data
                d = zlib.decompressobj(wbits=47)
                try:
                    out = d.decompress(rest)
                except zlib.error:
                    state["torn"] = True
                    return
                if out:
                    yield out


def _head_and_tail(path: str) -> tuple[bytes, bytes]:
    """The first bytes up to the events array (or ``_HEAD_MAX``) and the last ``_TAIL`` bytes, decompressed."""
    head = b""
    tail = b""
    state: dict = {}
    if not _is_gz(path):
        with open(path, "rb") as f:
            head = f.read(_READ)
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - _TAIL))
            tail = f.read()
        return head, tail
    for block in _read_blocks(path, state):
        if len(head) < _READ:
            head += block
        tail = (tail + block)[-_TAIL:]
    return head, tail


def _trace_meta(path: str) -> tuple[int | None, int | None]:
    """(rank from distributedInfo, baseTimeNanoseconds) from the file's head and tail, without reading events."""
    head, tail = _head_and_tail(path)
    m = _EVENTS_RE.search(head)
    pre = head[: m.start()] if m else head[:4096]
    rank = base = None
    for part in (pre, tail):
        d = _DIST_RANK_RE.search(part)
        if rank is None and d:
            rank = int(d.group(1))
        b = _BASE_RE.search(part)
        if base is None and b:
            base = int(b.group(1))
    return rank, base


class _Events:
    """Chunks of decoded events of one file, in order; ``truncated``/``note`` say how the file ended."""

    def __init__(self, path: str, chunk: int = _CHUNK):
        self.path = path
        self.chunk = chunk
        self.truncated = False
        self.note = ""
        self.offset = 0  # bytes of event text consumed

    def __iter__(self) -> Iterator[list[_Event]]:
        state: dict = {}
        blocks = _read_blocks(self.path, state)
        buf = b""
        eof = False
        # The events array: after "traceEvents": [ (object form), or the file's first [ (bare array form).
        while True:
            m = _EVENTS_RE.search(buf)
            if m:
                buf = buf[m.end():]
                break
            stripped = buf.lstrip()
            if stripped[:1] == b"[":
                buf = stripped[1:]
                break
            if stripped[:1] not in (b"", b"{"):
                self._end(True, "not a JSON trace (starts with neither { nor [)")
                return
            if len(buf) > _HEAD_MAX:
                self._end(True, "no traceEvents array in the first %d MB" % (_HEAD_MAX >> 20))
                return
            block = next(blocks, None)
            if block is None:
                self._end(True, "no traceEvents array: not a trace, or cut before its events")
                return
            buf += block
        buf = buf.lstrip()
        tries = 0
        pos = self.chunk  # a split is looked for past this many bytes: chunks of about that size
        search_from = pos
        while True:
            if not eof and len(buf) < pos + _SLACK:
                block = next(blocks, None)
                if block is None:
                    eof = True
                else:
                    buf += block
                continue
            if eof:
                yield from self._last(buf, state.get("torn", False))
                return
            m = _SPLIT_RE.search(buf, search_from)
            if m is None:  # no split in what is buffered: read on
                search_from = max(search_from, len(buf) - 64)
                block = next(blocks, None)
                if block is None:
                    eof = True
                else:
                    buf += block
                continue
            try:
                events = _DECODE_EVENTS.decode(b"[" + buf[: m.start() + 1] + b"]")
            except msgspec.DecodeError:
                # The split was inside a string or a nested value (or the data is corrupt): try the next one.
                tries += 1
                if tries > _MAX_TRIES:
                    self._end(True, "unreadable events after byte %d of the events array: merged up to there"
                              % self.offset)
                    return
                search_from = m.end()
                continue
            tries = 0
            self.offset += m.end() - 1
            buf = buf[m.end() - 1:]
            search_from = pos
            yield events

    def _last(self, buf: bytes, torn: bool) -> Iterator[list[_Event]]:
        """The end of the array: its last events and the closing ``]``; or, cut short, its complete events.

        All but the last event are decoded as a chunk (the longest prefix ending at a split that decodes: splits
        in a trailer after the array fail); the rest, one event and the trailer, is small, so trying each ``]``
        that follows a ``}`` there is cheap.
        """
        how = "torn gzip stream" if torn else "cut short (no closing ']')"
        splits = [m for m in _SPLIT_RE.finditer(buf)]
        rest = buf
        for m in reversed(splits[-_MAX_TRIES * 4:]):
            try:
                events = _DECODE_EVENTS.decode(b"[" + buf[: m.start() + 1] + b"]")
            except msgspec.DecodeError:
                continue
            self.offset += m.end() - 1
            rest = buf[m.end() - 1:]
            yield events
            break
        for m in re.finditer(rb"\]", rest):
            b = m.start() - 1
            while b >= 0 and rest[b] in _WS:
                b -= 1
            a = m.end()
            while a < len(rest) and rest[a] in _WS:
                a += 1
            if (b >= 0 and rest[b] != 0x7D) or (a < len(rest) and rest[a] not in (0x2C, 0x7D)):  # } , }
                continue
            try:
                events = _DECODE_EVENTS.decode(b"[" + rest[: b + 1] + b"]")
            except msgspec.DecodeError:
                continue
            if torn:
                self._end(True, "gzip stream torn after the events array")
            yield events
            return
        # No closing bracket: the file was cut. Its last event counts if it is whole.
        body = rest.rstrip().rstrip(b",").rstrip()
        if body.endswith(b"}"):
            try:
                events = _DECODE_EVENTS.decode(b"[" + body + b"]")
            except msgspec.DecodeError:
                pass
            else:
                self.offset += len(body)
                self._end(True, "%s: merged its complete events, up to byte %d of the events array"
                          % (how, self.offset))
                yield events
                return
        self._end(True, "%s: merged its complete events, up to byte %d of the events array" % (how, self.offset))

    def _end(self, truncated: bool, note: str) -> None:
        self.truncated = truncated
        self.note = note


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
    reader = _Events(path, chunk)
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
                 chunk_bytes: int = _CHUNK) -> MergeResult:
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
            rank, base = _trace_meta(p)
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
