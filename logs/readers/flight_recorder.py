"""PyTorch Flight Recorder dumps (pickle or JSON) and the text output of torch's ``fr_trace`` analyzer.

A dump is what each rank writes with ``TORCH_NCCL_TRACE_BUFFER_SIZE=N`` (alias ``TORCH_FR_BUFFER_SIZE``) and
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<prefix>`` (file ``<prefix><rank>``) when the watchdog fires, or what
``torch._C._distributed_c10d._dump_nccl_trace[_json]()`` returns. Field names and their meaning come from torch's
``torch/csrc/distributed/c10d/FlightRecorder.hpp`` / ``FlightRecorderDetail.hpp`` (``version``, ``pg_config``,
``pg_status``, ``comm_lib_version``, ``entries`` with ``record_id``, ``pg_id``, ``process_group`` = (name, desc),
``collective_seq_id`` (``seq_id`` before 2.0), ``p2p_seq_id``, ``op_id``, ``profiling_name``, ``time_created_ns``,
``time_discovered_started_ns``/``_completed_ns`` (null in pickle, 0 in JSON when unknown), ``duration_ms``,
``input_sizes``/``output_sizes``, ``input_dtypes``/``output_dtypes``, ``state`` scheduled|started|completed,
``retired``, ``timeout_ms``, ``is_p2p``, ``frames``). A dump holds no rank: torch's own loader
(``torch/distributed/flight_recorder/components/loader.py``) takes it from the file name's trailing digits; so do we.

Safety: a dump is dicts, lists, tuples, strings, numbers, booleans and None. It is never unpickled with
``pickle.load``: a restricted Unpickler refuses every global (a pickle naming one is reported, nothing imported or
run), and a torn pickle is replayed by a small stack machine over ``pickletools.genops`` that builds only those
builtin values and keeps what was complete before the tear.

Matching collectives across ranks (``logs/readers/fr_match.py``) follows fr_trace's rules (builder.py,
utils.py ``error_analysis``, types.py ``Op.match``) but is our own: torch's needs torch, asserts on partial input
and loads files with plain ``pickle.load``. The text ``fr_trace`` prints (its ``logger.info`` strings in
``components/utils.py``/``types.py``) is read here too.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
from typing import Any

from logs.model import LineIndex, ReadResult

NAME = "flight_recorder"

# Dump versions torch has written (FlightRecorder.hpp's version_val; "2.10" in torch 2.13). Newer ones are read
# for the fields we know, with a note.
KNOWN_VERSIONS = {"1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "2.0", "2.1", "2.2", "2.3", "2.4", "2.5", "2.6",
                  "2.7", "2.8", "2.9", "2.10"}
TORN_KEY = "__torn_before_complete__"  # marks a dict the tear cut short (never a key torch writes)
MAX_ENTRIES = 1_000_000  # per dump: beyond this the rest is dropped with a note

# fr_trace's print strings (torch/distributed/flight_recorder/components/utils.py, types.py, builder.py).
_FR_TEXT = re.compile(
    rb"Not all ranks joining collective, sequence number: *(?P<nj>\d+)"
    rb"|Collective sequence number: *(?P<er>\d+) has errors"
    rb"|Input/output mismatch in the collective sequence number: *(?P<io>\d+)"
    rb"|Too many mismatches for process_group (?P<tm>[^\r\n]*)"
    rb"|We cannot decide what's wrong with this collective entry because we missed FR dumps from ranks \((?P<cd>[^)]*)\)"
    rb"|(?P<ne>No errors found for this collective entry)"
    rb"|(?P<ri>internal record id|group info|collective|missing ranks|total input numel|total output numel"
    rb"|input sizes|output sizes|world size|expected ranks|collective state|error msg|collective stack trace)"
    rb": ?(?P<val>[^\r\n]*)")
_SNIFF_TEXT = re.compile(rb"Not all ranks joining collective|Collective sequence number: \d+ has errors"
                         rb"|Input/output mismatch in the collective sequence number|Culprit rank \d+; Error type")
_SNIFF_WORDS = (b"Not all ranks joining collective", b"has errors", b"Input/output mismatch", b"Culprit rank")
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin|dump|txt))*(?:\.gz)?$")
_CULPRIT = re.compile(r"Culprit rank (\d+); Error type: (\w+)(?:, ([^;]*?))?(?=, Culprit rank |$)")


def sniff(data: bytes) -> bool:
    head = data[:4096]
    if head[:1] == b"\x80" and (b"entries" in head or b"version" in head or b"pg_config" in head):
        return True
    stripped = head.lstrip()
    if stripped[:1] == b"{" and (b'"pg_config"' in head or b'"entries"' in head or b'"version"' in head):
        return True
    # literal tests first (an alternation of literals is one slow regex pass over a large log)
    return any(w in data for w in _SNIFF_WORDS) and _SNIFF_TEXT.search(data) is not None


# --- loading a dump safely ----------------------------------------------------------------------------------------

def _identity(x, *_):
    return x


# torch's jit pickler may tag aggregates or specialise lists (torch/csrc/jit/serialization/pickler.cpp); these are
# the only globals a dump may name, and they map to our own pure functions, never to torch's.
_ALLOWED_GLOBALS = {("torch.jit._pickle", n): _identity
                    for n in ("build_intlist", "build_doublelist", "build_boollist", "build_list", "restore_type_tag")}


class _RefusedGlobal(Exception):
    pass


class SafeUnpickler(pickle.Unpickler):
    """Builtin containers and scalars only: any other global is refused (nothing imported, nothing called)."""

    def find_class(self, module, name):
        fn = _ALLOWED_GLOBALS.get((module, name))
        if fn is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return fn

    def persistent_load(self, pid):
        raise _RefusedGlobal(f"persistent id {str(pid)[:40]}")


def _replay_torn_pickle(data: bytes) -> tuple[Any, str]:
    """Replay a pickle that ends early (or holds an opcode we refuse) and fold whatever containers were open into
    their parents, so entries completed before the tear are kept. Builds only builtin values."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    why = "pickle ends before its STOP opcode"
    mark = object()

    def pop_mark() -> list[Any]:
        k = marks.pop()
        items = stack[k + 1:]
        del stack[k:]
        return items

    def setitems(d, items):
        if isinstance(d, dict):
            for i in range(0, len(items) - 1, 2):
                try:
                    d[items[i]] = items[i + 1]
                except TypeError:  # an unhashable key: not a dump's shape
                    pass

    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            n = op.name
            if n in ("PROTO", "FRAME"):
                continue
            if n == "STOP":
                why = ""
                break
            if n == "MARK":
                marks.append(len(stack))
                stack.append(mark)
            elif n == "EMPTY_DICT":
                stack.append({})
            elif n == "EMPTY_LIST":
                stack.append([])
            elif n == "EMPTY_TUPLE":
                stack.append(())
            elif n in ("TUPLE1", "TUPLE2", "TUPLE3"):
                k = int(n[-1])
                vals = tuple(stack[-k:])
                del stack[-k:]
                stack.append(vals)
            elif n == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif n == "LIST":
                stack.append(pop_mark())
            elif n == "DICT":
                d: dict = {}
                setitems(d, pop_mark())
                stack.append(d)
            elif n == "APPEND":
                v = stack.pop()
                if isinstance(stack[-1], list):
                    stack[-1].append(v)
            elif n == "APPENDS":
                items = pop_mark()
                if isinstance(stack[-1], list):
                    stack[-1].extend(items)
            elif n == "SETITEM":
                v, k = stack.pop(), stack.pop()
                setitems(stack[-1], [k, v])
            elif n == "SETITEMS":
                items = pop_mark()
                setitems(stack[-1], items)
            elif n in ("NONE", "NEWTRUE", "NEWFALSE"):
                stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[n])
            elif n in ("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
                       "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                       "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8"):
                stack.append(arg)
            elif n in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif n == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif n in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif n == "POP":
                if stack.pop() is mark:
                    marks.pop()
            elif n == "POP_MARK":
                pop_mark()
            elif n == "DUP":
                stack.append(stack[-1])
            elif n == "GLOBAL":
                mod, _, name = str(arg).partition(" ")
                if (mod, name) not in _ALLOWED_GLOBALS:
                    why = f"refused global {mod}.{name}: read what came before it"
                    break
                stack.append(_identity)
            elif n == "REDUCE":
                args = stack.pop()
                fn = stack.pop()
                stack.append(args[0] if fn is _identity and isinstance(args, tuple) and args else None)
            else:
                why = f"opcode {n} is not in a dump: read what came before it"
                break
    except (ValueError, IndexError, KeyError, EOFError, TypeError, OverflowError, MemoryError) as e:
        why = f"torn pickle ({type(e).__name__}: {str(e)[:80]}): read what came before the tear"
    # fold the open containers, innermost first: a torn entry's complete fields are kept, its parent list gets it
    while marks:
        items = pop_mark()
        if items and isinstance(items[-1], dict) and why:
            items[-1][TORN_KEY] = True  # the innermost open entry may lack fields: dropped by normalize_entry
        if stack and isinstance(stack[-1], list):
            stack[-1].extend(items)
        elif stack and isinstance(stack[-1], dict):
            setitems(stack[-1], items)
            if why:
                stack[-1][TORN_KEY] = True
    top = next((s for s in stack if isinstance(s, dict)), None)
    return top, why


def load_pickle(data: bytes) -> tuple[Any, list[str]]:
    notes: list[str] = []
    try:
        return SafeUnpickler(io.BytesIO(data)).load(), notes
    except _RefusedGlobal as e:
        notes.append(f"pickle names {e}: refused (a dump holds only builtin values; nothing was imported or run)")
    except RecursionError:
        return None, ["pickle nested too deep: not a dump"]
    except Exception:  # torn or corrupt: replay what is there
        pass
    obj, why = _replay_torn_pickle(data)
    if why:
        notes.append(why)
    return obj, notes


def _json_salvage(text: str) -> tuple[dict, str]:
    """A torn JSON dump: the top-level values and every complete entry before the tear."""
    dec = json.JSONDecoder()
    out: dict[str, Any] = {}
    for key in ("version", "comm_lib_version", "pg_config", "pg_status"):
        m = re.search(r'"%s"\s*:\s*' % key, text)
        if m:
            try:
                out[key] = dec.raw_decode(text, m.end())[0]
            except ValueError:
                pass
    m = re.search(r'"entries"\s*:\s*\[', text)
    if m:
        entries, pos = [], m.end()
        while len(entries) < MAX_ENTRIES:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                break
            try:
                obj, pos = dec.raw_decode(text, pos)
            except (ValueError, RecursionError):
                break
            entries.append(obj)
        out["entries"] = entries
    return out, "torn JSON dump: read the fields and entries complete before the tear"


def load_dump(data: bytes) -> tuple[dict | None, str, list[str]]:
    """(the dump dict, "pickle"|"json", notes); None when nothing dump-shaped is there."""
    if data[:1] == b"\x80":
        obj, notes = load_pickle(data)
        fmt = "pickle"
    else:
        text = data.decode("utf-8", "replace")
        fmt, notes = "json", []
        try:
            obj = json.loads(text)
        except RecursionError:
            return None, fmt, ["JSON nested too deep: not a dump"]
        except ValueError:
            obj, why = _json_salvage(text)
            notes.append(why)
    if not isinstance(obj, dict) or not ({"entries", "version", "pg_config"} & set(k for k in obj if isinstance(k, str))):
        return None, fmt, notes
    return obj, fmt, notes


# --- normalising a dump -------------------------------------------------------------------------------------------

INT64 = 2**63 - 1  # a dump's counters and nanosecond times are int64 in torch: anything beyond is not a value


def _int(x) -> int | None:
    v = None
    if isinstance(x, bool):
        v = int(x)
    elif isinstance(x, int):
        v = x
    elif isinstance(x, float) and x == x and abs(x) < 1e30:
        v = int(x)
    elif isinstance(x, (str, bytes)):
        try:
            v = int(x)
        except ValueError:
            return None
    return v if v is not None and -INT64 <= v <= INT64 else None


def _str(x) -> str:
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    return x if isinstance(x, str) else ("" if x is None else str(x)[:200])


def _sizes(x) -> list[list[int]]:
    if not isinstance(x, (list, tuple)):
        return []
    out = []
    for s in x[:64]:
        if isinstance(s, (list, tuple)):
            out.append([v for v in (_int(d) for d in s[:16]) if v is not None])
    return out


def _ranks(x) -> list[int]:
    """pg_config's ranks: the string "[0, 1, 2]" (ranks_str in TraceUtils.h) or a list."""
    if isinstance(x, (list, tuple)):
        return sorted({v for v in (_int(r) for r in x) if v is not None})
    return sorted({int(r) for r in re.findall(r"\d+", _str(x))[:100000]})


def _frame(e: dict) -> str:
    fr = e.get("frames")
    if isinstance(fr, list):
        for f in fr[:1]:
            if isinstance(f, dict):
                return f"{_str(f.get('name'))} at {_str(f.get('filename'))}:{_int(f.get('line'))}"
    return ""


def normalize_entry(e: dict, i: int) -> dict[str, Any] | None:
    if not isinstance(e, dict) or TORN_KEY in e:
        return None
    pg = e.get("process_group")
    pg_name, pg_desc = ("", "")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        pg_name, pg_desc = _str(pg[0]), _str(pg[1])
    elif pg is not None:
        pg_name = _str(pg)
    if not pg_name:
        pg_name = str(_int(e.get("pg_id")))
    seq = _int(e.get("collective_seq_id", e.get("seq_id")))
    name = _str(e.get("profiling_name"))
    is_p2p = e.get("is_p2p")
    if not isinstance(is_p2p, bool):
        is_p2p = bool(re.search(r":(send|recv)\b", name))
    started = _int(e.get("time_discovered_started_ns")) or None  # JSON writes 0 for "not yet"
    completed = _int(e.get("time_discovered_completed_ns")) or None
    dur = e.get("duration_ms")
    state = _str(e.get("state")) or ("completed" if completed else "started" if started else "scheduled")
    return {"idx": i, "record_id": _int(e.get("record_id")), "pg_id": _int(e.get("pg_id")), "pg_name": pg_name,
            "pg_desc": pg_desc, "seq": seq, "p2p_seq": _int(e.get("p2p_seq_id")), "op_id": _int(e.get("op_id")),
            "is_p2p": is_p2p, "op": name.split(":", 1)[-1].split(" ")[0] if name else "", "profiling_name": name,
            "input_sizes": _sizes(e.get("input_sizes")), "output_sizes": _sizes(e.get("output_sizes")),
            "input_dtypes": [_str(d) for d in e.get("input_dtypes", [])[:64]] if isinstance(e.get("input_dtypes"), list) else [],
            "output_dtypes": [_str(d) for d in e.get("output_dtypes", [])[:64]] if isinstance(e.get("output_dtypes"), list) else [],
            "state": state, "created_ns": _int(e.get("time_created_ns")), "started_ns": started,
            "completed_ns": completed, "duration_ms": float(dur) if isinstance(dur, (int, float)) else None,
            "timeout_ms": _int(e.get("timeout_ms")), "retired": bool(e.get("retired")), "frame": _frame(e)}


def rank_from_path(path: str) -> int | None:
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def read_dump(inp, dump: dict, fmt: str, notes: list[str]) -> ReadResult:
    res = ReadResult(reader=NAME, source=inp.path, notes=list(notes))
    version = _str(dump.get("version"))
    if version not in KNOWN_VERSIONS:
        res.notes.append(f"Flight Recorder dump version {version or '(none)'} is not one we know "
                         f"(known up to 2.10): read the fields we know")
    raw = dump.get("entries")
    raw = raw if isinstance(raw, list) else []
    if len(raw) > MAX_ENTRIES:
        res.notes.append(f"{len(raw)} entries: read the first {MAX_ENTRIES}")
        raw = raw[:MAX_ENTRIES]
    entries = [n for n in (normalize_entry(e, i) for i, e in enumerate(raw)) if n is not None]
    pg_config = {}
    cfg = dump.get("pg_config")
    if isinstance(cfg, dict):
        for k, v in list(cfg.items())[:10000]:
            if isinstance(v, dict):
                pg_config[_str(k)] = {"desc": _str(v.get("desc")), "ranks": _ranks(v.get("ranks"))}
    pg_status = {}
    st = dump.get("pg_status")
    if isinstance(st, dict):
        for k, v in list(st.items())[:10000]:
            if isinstance(v, dict):
                pg_status[_str(k)] = {f: _int(v.get(f"last_{f}_collective")) for f in ("enqueued", "started", "completed")}
    rank = rank_from_path(inp.path)
    if rank is None:
        res.notes.append("no rank in the file name (torch names dumps <prefix><rank>): ranks numbered by input order")
    for e in entries:
        e["source"] = inp.path
    res.events = [{"source": inp.path, "type": "fr_dump"}] if not entries else entries
    res.summary = {"kind": "dump", "format": fmt, "version": version, "rank": rank, "entries": len(entries),
                   "pg_config": pg_config, "pg_status": pg_status,
                   "comm_lib_version": _str(dump.get("comm_lib_version")),
                   "torn": any("torn" in n or "ends before" in n for n in res.notes)}
    return res


# --- fr_trace's text output -----------------------------------------------------------------------------------------

def _set_of_ints(s: str) -> list[int]:
    return sorted({int(x) for x in re.findall(r"\d+", s)[:100000]})


def read_text(inp) -> ReadResult | None:
    data = inp.data
    idx = LineIndex(data)
    blocks: list[dict[str, Any]] = []
    claimed: set[int] = set()
    for m in _FR_TEXT.finditer(data):
        line = idx.line_of(m.start())
        g = next((k for k in ("nj", "er", "io", "tm", "cd", "ne", "ri") if m.group(k) is not None), None)
        if g in ("nj", "er", "io"):
            kind = {"nj": "not_all_joined", "er": "errors", "io": "io_mismatch"}[g]
            blocks.append({"source": inp.path, "line": line + 1, "type": "fr_trace", "kind": kind,
                           "seq": int(m.group(g))})
        elif g == "tm":
            blocks.append({"source": inp.path, "line": line + 1, "type": "fr_trace", "kind": "too_many",
                           "group": _str(m.group("tm")).strip()})
        elif g == "cd":
            blocks.append({"source": inp.path, "line": line + 1, "type": "fr_trace", "kind": "missing_dumps",
                           "ranks": _set_of_ints(_str(m.group("cd")))})
        elif g == "ne":
            blocks.append({"source": inp.path, "line": line + 1, "type": "fr_trace", "kind": "no_errors"})
        elif g == "ri" and blocks:
            key = _str(m.group("ri")).replace(" ", "_")
            val = _str(m.group("val")).strip()
            b = blocks[-1]
            if key in ("missing_ranks", "expected_ranks"):
                b[key] = _set_of_ints(val)
            elif key == "error_msg":
                b["culprits"] = [{"rank": int(c[0]), "error": c[1], "detail": c[2] or ""}
                                 for c in _CULPRIT.findall(val)]
            elif key in ("world_size", "total_input_numel", "total_output_numel", "internal_record_id"):
                b[key] = _int(val)
            else:
                b[key] = val[:500]
        else:
            continue
        claimed.add(line)
    if not blocks:
        return None
    return ReadResult(reader=NAME, source=inp.path, events=blocks, claimed_lines=claimed,
                      summary={"kind": "fr_trace", "blocks": len(blocks)})


def read(inp) -> ReadResult | None:
    data = inp.data
    head = data[:4096].lstrip()
    if data[:1] == b"\x80" or head[:1] == b"{":
        dump, fmt, notes = load_dump(data)
        if dump is not None:
            return read_dump(inp, dump, fmt, notes)
        if notes and data[:1] == b"\x80":
            return ReadResult(reader=NAME, source=inp.path, notes=notes, summary={"kind": "unreadable"})
    return read_text(inp)


def conclude(results: list[ReadResult]):
    from logs.readers.fr_match import conclude_dumps, conclude_text

    dumps = [r for r in results if r.summary.get("kind") == "dump"]
    texts = [r for r in results if r.summary.get("kind") == "fr_trace"]
    return conclude_dumps(dumps) + conclude_text(texts)


def summarize(results: list[ReadResult]) -> dict[str, Any]:
    dumps = [r for r in results if r.summary.get("kind") == "dump"]
    return {"dumps": [{k: r.summary.get(k) for k in ("rank", "format", "version", "entries", "torn")}
                      | {"source": r.source} for r in dumps],
            "fr_trace_blocks": sum(len(r.events) for r in results if r.summary.get("kind") == "fr_trace")}
