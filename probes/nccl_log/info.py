"""INFO and TRACE messages: a table of first words -> recognisers, then the generic ones.

:data:`FIRST_WORDS` maps how a message starts to the recogniser of that kind of line;
:func:`info_message` tries only the entries whose word the message starts with (indexed by
first byte), so each recogniser runs only where it can match. A line no first word claims
(or whose recogniser returns DECLINED) goes to the generic recognisers: per-call COLL lines,
``file.cc:123 -> N`` call traces, plugin lines, known informational lines, else
``unclassified``. A new kind of INFO line is one more entry in the table.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from probes.nccl_log import topology
from probes.nccl_log.patterns import (
    CALL_TRACE_RE,
    COLL_RE,
    INFO_PREFIXES,
    KNOWN_MINOR,
    NCCL_RESULT,
    NET_USING_RE,
    PLUGIN_RE,
    USING_NETWORK_RE,
    VERSION_RE,
    Prefix,
    text,
)
from probes.nccl_log.stream import DECLINED, StreamState
from ranksight.schema import NcclEvent

def trace_fields(m: re.Match) -> dict[str, Any]:
    """Fields of a CALL_TRACE_RE match: where, the ncclResult_t it returned, and strerror when printed."""
    code = int(m.group(4))
    f: dict[str, Any] = {"file": text(m.group(1)), "src_line": int(m.group(2)), "code": code,
                         "result": NCCL_RESULT.get(code, "")}
    if m.group(3):
        f["func"] = text(m.group(3))
    if m.group(5):
        f["reason"] = text(m.group(5))
    return f


Recogniser = Callable[[StreamState, Prefix, bytes], Any]  # -> NcclEvent | None | DECLINED


def version(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``NCCL version 2.18.5+cuda12.2``; versions outside 2.5-2.29 get a note, never an error."""
    m = VERSION_RE.match(msg)
    if not m:
        return st.event(pre, "version", msg)
    major, minor, patch = int(m.group(1)), int(m.group(2)), int(m.group(3))
    suffix = text(m.group(4))
    f: dict[str, Any] = {"version": f"{major}.{minor}.{patch}", "full": f"{major}.{minor}.{patch}{suffix}"}
    if suffix.startswith("+cuda"):
        f["cuda"] = suffix[5:]
    if major != 2 or minor not in KNOWN_MINOR:
        note = f"NCCL version {f['full']} is outside the formats this parser was written for (2.5-2.29); parsed with the same rules"
        f["note"] = note
        st.note(note)
    return st.event(pre, "version", msg, fields=f)


def plugin(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``NET/Plugin ...``, ``TUNER/Plugin: ...``, ``PROFILER/Plugin: ...``, ``ENV/Plugin: ...``."""
    m = PLUGIN_RE.match(msg)
    f: dict[str, Any] = {}
    if m:
        f = {"plugin": text(m.group(1)).lower(), "detail": text(m.group(2)).strip()}
    elif msg.startswith(b"TUNER/"):
        f = {"plugin": "tuner", "detail": text(msg)}
    return st.event(pre, "plugin", msg, fields=f)


def net_devices(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ; OOB ...``."""
    m = NET_USING_RE.match(msg)
    if m is None:
        return DECLINED
    return st.event(pre, "net", msg, transport="NET/" + text(m.group(1)),
                    fields={"net": text(m.group(1)), "devices": text(m.group(2))})


def using_network(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``Using network IB``."""
    m = USING_NETWORK_RE.match(msg)
    net = text(m.group(1)) if m else ""
    return st.event(pre, "net", msg, transport="NET/" + net if net else "", fields={"net": net})


def collective(st: StreamState, pre: Prefix, msg: bytes, m: re.Match) -> NcclEvent | None:
    """A per-call COLL line (``m``: its COLL_RE match): counted and kept as its communicator's
    last call; an event only with ``emit_collectives``."""
    st.recognised_collective_lines += 1
    op, opc, count, dt, redop, root, comm_b, nr = m.groups()
    comm = comm_b.decode("utf-8", "replace")
    info = {
        "op": op.decode("utf-8", "replace"), "opCount": int(opc, 16), "count": int(count),
        "datatype": int(dt), "redop": int(redop), "root": int(root), "comm": comm,
    }
    if nr:
        info["nranks"] = int(nr)
    st.recognised_last_collective[(pre[0], pre[1], comm)] = info
    if not st.emit_collectives:
        return None
    return st.event(pre, "collective", msg, fields=info)


# How a message starts -> its recogniser, tried in this order among those sharing a first byte.
FIRST_WORDS: tuple[tuple[bytes, Recogniser], ...] = (
    (b"Channel", topology.channel),
    (b"CollNet", topology.collnet),
    (b"Connected", topology.connected),
    (b"comm ", topology.comm),
    (b"Trees", topology.trees),
    (b"TUNER/", plugin),
    (b"Ring", topology.ring),
    (b"NCCL version", version),
    (b"NET/Plugin", plugin),
    (b"NET/", net_devices),
    (b"NVLS", topology.nvls_comm),
    (b"Using network", using_network),
    (b"PROFILER/", plugin),
    (b"ENV/", plugin),
    (b"Init timings", topology.init_timings),
    (b"n", topology.comm_after_api),  # "ncclCommInitRankConfig comm 0x..." and the like
)




def _by_first_byte() -> dict[bytes, tuple[tuple[bytes, Recogniser], ...]]:
    """Every possible ``msg[:1]`` (b"" included) -> the FIRST_WORDS entries starting with it."""
    out: dict[bytes, list[tuple[bytes, Recogniser]]] = {bytes([b]): [] for b in range(256)}
    out[b""] = []
    for word, recognise in FIRST_WORDS:
        out[word[:1]].append((word, recognise))
    return {b: tuple(entries) for b, entries in out.items()}


_BY_FIRST_BYTE = _by_first_byte()

# First byte -> the words of FIRST_WORDS starting with it (for bytes.startswith), only bytes
# some word starts with: a message no word claims goes straight to the generic recognisers
# (the parser's emit_collectives fast path).
CLAIMED_BY_FIRST_BYTE: dict[bytes, tuple[bytes, ...]] = {
    b: tuple(w for w, _ in entries) for b, entries in _BY_FIRST_BYTE.items() if entries}


def info_message(st: StreamState, pre: Prefix, level: str, msg: bytes) -> NcclEvent | None:
    """An INFO or TRACE message: the first-word recogniser that claims it, else the generic ones."""
    for word, recognise in _BY_FIRST_BYTE[msg[:1]]:
        if msg.startswith(word):
            ev = recognise(st, pre, msg)
            if ev is not DECLINED:
                return ev
            break
    if b": opCount " in msg:  # the literal COLL_RE needs
        m = COLL_RE.match(msg)
        if m is not None:
            return collective(st, pre, msg, m)
    if b" -> " in msg:
        m = CALL_TRACE_RE.search(msg)
        if m is not None:
            return st.event(pre, "trace", msg, error_class="call_trace", fields=trace_fields(m))
    if msg.find(b"Plugin", 0, 24) >= 0:
        return plugin(st, pre, msg)
    if msg.startswith(INFO_PREFIXES) or msg[:1].isdigit():
        return st.event(pre, "info", msg, fields={"level": level})
    if not st.keep_unclassified:
        st.count_unclassified()
        return None
    return st.event(pre, "unclassified", msg, fields={"level": level})
