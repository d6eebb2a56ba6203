"""Recognisers of communicator and topology lines: comm init, rings, trees, transports.

Each takes the stream state, the line's prefix and its message (the bytes after
"NCCL INFO ") and returns an event, None (a per-channel repeat folded into an earlier event)
or DECLINED. Topology lines name no communicator: they get the one their thread is
initialising (:meth:`StreamState.comm_context`).
"""

from __future__ import annotations

import re
from typing import Any

from probes.nccl_log.patterns import (
    COLLNET_RE,
    COMM_RE,
    CONN_RE,
    INIT_TIME_RE,
    INIT_TIMINGS_RE,
    KV_TAIL_RE,
    NVLS_COMM_RE,
    PHASE_RE,
    RING_ORDER_RE,
    RING_TRIPLE_RE,
    TREE_ITEM_RE,
    Prefix,
    text,
)
from probes.nccl_log.stream import DECLINED, StreamState
from ranksight.schema import NcclEvent

_INT_KEYS = ("cudaDev", "nvmlDev", "nNodes", "localRanks", "localRank", "MNNVL")


def comm(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``comm 0x.. rank R nranks N cudaDev .. busId .. commId .. - Init START|COMPLETE`` (and Abort)."""
    m = COMM_RE.match(msg)
    if m is None:
        return st.event(pre, "unclassified", msg)
    ptr = text(m.group(1))
    rank, nranks = int(m.group(2)), int(m.group(3))
    tail = m.group(4)
    f: dict[str, Any] = {"comm": ptr}
    for k, v in KV_TAIL_RE.findall(tail):
        key = text(k)
        val = text(v)
        if key in _INT_KEYS:
            try:
                f[key] = int(val)
            except ValueError:
                f[key] = val
        else:
            f[key] = val
    ph = PHASE_RE.search(tail)
    category = "init"
    error_class = ""
    if ph:
        f["phase"] = f"{text(ph.group(1))} {text(ph.group(2))}"
        if ph.group(1) == b"Abort":
            category, error_class = "error", "abort"
    it = INIT_TIME_RE.search(tail)
    if it:
        f["init_time_s"] = float(it.group(1))
    comm_id = st.enter_comm(pre, ptr, f.get("commId"), rank, nranks)
    pre_ev = (pre[0], pre[1], pre[2], pre[3] if "cudaDev" not in f else f["cudaDev"], pre[4], pre[5])
    return st.event(pre_ev, category, msg, rank=rank, nranks=nranks, comm_id=comm_id,
                    error_class=error_class, fields=f)


def comm_after_api(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """NCCL >= 2.19 prefixes the comm line with the API: ``ncclCommInitRankConfig comm 0x...``."""
    k = msg.find(b" comm 0x")
    if not 0 < k < 40:
        return DECLINED
    ev = comm(st, pre, msg[k + 1 :])
    ev.message = text(msg)
    ev.fields["api"] = text(msg[:k])
    return ev


def init_timings(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``Init timings - ncclCommInitRankConfig: rank 0 nranks 8 total 1.94 (kernels 0.21, ...)``."""
    m = INIT_TIMINGS_RE.match(msg)
    if not m:
        return st.event(pre, "init", msg)
    f: dict[str, Any] = {"init_time_s": float(m.group(4)), "phase": "Init timings"}
    if m.group(1):
        f["api"] = text(m.group(1))
    if m.group(5):
        for part in text(m.group(5)).split(","):
            k, _, v = part.strip().partition(" ")
            try:
                f[f"t_{k}"] = float(v)
            except ValueError:
                pass
    return st.event(pre, "init", msg, rank=int(m.group(2)), nranks=int(m.group(3)),
                    comm_id=st.thread_comm.get(pre[:3], ""), fields=f)


def connected(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``Connected all rings`` / ``Connected all trees``: info, with the thread's communicator."""
    return st.event(pre, "info", msg, comm_id=st.thread_comm.get(pre[:3], ""))


def channel(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent | None:
    """``Channel 00/0 : 0[7000] -> 1[f000] via ...`` (a transport) or ``Channel 00/32 : 0 1 2 3`` (a ring order)."""
    return st.first_of_channels(pre, msg, _channel_event)


def _channel_event(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    m = CONN_RE.match(msg)
    if m is not None:
        return _connection(st, pre, msg, m)
    m = RING_ORDER_RE.match(msg)
    if m is not None:
        cid, crank = st.comm_context(pre)
        order = [int(x) for x in m.group(3).split()]
        f = {"channel": int(m.group(1)), "order": order}
        if m.group(2) is not None:
            f["nchannels"] = int(m.group(2))
        kw: dict[str, Any] = {"rank": crank} if crank is not None else {}
        return st.event(pre, "ring", msg, comm_id=cid, fields=f, **kw)
    cid, _ = st.comm_context(pre)
    return st.event(pre, "channel", msg, comm_id=cid)


def ring(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent | None:
    """2.4-2.6 ring lines: ``Ring 00 : 3 -> 0 -> 1`` (neighbours), ``Ring 00 : 3[3] -> 0[0] via ...``, ring orders."""
    return st.first_of_channels(pre, msg, _ring_event)


def _ring_event(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    m = CONN_RE.match(msg)
    if m is not None:
        return _connection(st, pre, msg, m)
    m = RING_TRIPLE_RE.match(msg)
    cid, crank = st.comm_context(pre)
    if m is not None:
        prev, me, nxt = int(m.group(2)), int(m.group(3)), int(m.group(4))
        return st.event(pre, "ring", msg, rank=me, comm_id=cid,
                        fields={"channel": int(m.group(1)), "prev": prev, "next": nxt})
    m = RING_ORDER_RE.match(msg.replace(b"Ring", b"Channel", 1))
    if m is not None:
        kw: dict[str, Any] = {"rank": crank} if crank is not None else {}
        return st.event(pre, "ring", msg, comm_id=cid,
                        fields={"channel": int(m.group(1)), "order": [int(x) for x in m.group(3).split()]}, **kw)
    return st.event(pre, "ring", msg, comm_id=cid)


def _connection(st: StreamState, pre: Prefix, msg: bytes, m: re.Match) -> NcclEvent:
    src, dst = int(m.group(4)), int(m.group(6))
    direction = text(m.group(8)) if m.group(8) else ""
    via = text(m.group(9))
    transport, f = transport_of(via)
    f["channel"] = int(m.group(2))
    if m.group(3) is not None:
        f["conn_index"] = int(m.group(3))
    f["src"] = src
    f["dst"] = dst
    if m.group(5):
        f["src_bus"] = text(m.group(5))
    if m.group(7):
        f["dst_bus"] = text(m.group(7))
    if direction:
        f["direction"] = direction
    # The logging process is the sender unless the line says [receive].
    me, peer = (dst, src) if direction == "receive" else (src, dst)
    cid, _ = st.comm_context(pre)
    return st.event(pre, "transport", msg, rank=me, peer=peer, transport=transport, comm_id=cid, fields=f)


def trees(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``Trees [0] 1/-1/-1->0->-1 [1] ...``: per channel the children, this rank and the parent."""
    cid, crank = st.comm_context(pre)
    found: dict[str, Any] = {}
    me = crank
    for ch, spec in TREE_ITEM_RE.findall(msg):
        s = text(spec)
        # "c1/c2/c3->me->parent" (2.7+), possibly "|"-joined up/down halves (2.4 double tree)
        node: dict[str, Any] = {"spec": s}
        first = s.split("|")[0]
        parts = first.split("->")
        try:
            if len(parts) == 3:
                node["children"] = [int(x) for x in parts[0].split("/") if x != "-1"]
                node["rank"] = int(parts[1])
                node["parent"] = int(parts[2])
                me = node["rank"]
        except ValueError:
            pass
        found[text(ch)] = node
    kw: dict[str, Any] = {"rank": me} if me is not None else {}
    return st.event(pre, "tree", msg, comm_id=cid, fields={"trees": found}, **kw)


def collnet(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``CollNet 00/0 : 0 [send] via COLLNET/SHARP/0/GDRDMA``."""
    m = COLLNET_RE.match(msg)
    cid, _ = st.comm_context(pre)
    if m is None:
        return st.event(pre, "transport", msg, transport="CollNet", comm_id=cid)
    _, f = transport_of(text(m.group(5)))
    f.update({"channel": int(m.group(1)), "direction": text(m.group(4))})
    return st.event(pre, "transport", msg, rank=int(m.group(3)), transport="CollNet", comm_id=cid, fields=f)


def nvls_comm(st: StreamState, pre: Prefix, msg: bytes) -> NcclEvent:
    """``NVLS comm 0x.. headRank 0 nHeads 8 ...``: an NVLS transport."""
    m = NVLS_COMM_RE.match(msg)
    if m is None:
        return DECLINED
    f = {"comm": text(m.group(1)), "headRank": int(m.group(2)), "nHeads": int(m.group(3))}
    return st.event(pre, "transport", msg, transport="NVLS", fields=f, comm_id=st.thread_comm.get(pre[:3], ""))


def transport_of(via: str) -> tuple[str, dict[str, Any]]:
    """Normalise a 'via ...' string to a transport name plus details (GDRDMA, NET device, PXN)."""
    extra: dict[str, Any] = {"via": via}
    parts = via.split("/")
    head = parts[0].upper()
    if head == "P2P":
        kind = parts[1] if len(parts) > 1 else ""
        if kind.upper() == "IPC":
            t = "P2P/IPC"
        elif kind.upper() == "CUMEM":
            t = "P2P/CUMEM"
        elif kind.startswith("direct"):
            t = "P2P/direct"
        else:
            t = "P2P"
        if parts[-1] == "read":
            extra["read"] = True
        return t, extra
    if head == "SHM":
        return "SHM", extra
    if head in ("NET", "COLLNET"):
        name = parts[1] if len(parts) > 1 else ""
        if len(parts) > 2:
            m = re.match(r"(\d+)(?:\((\d+)\))?", parts[2])
            if m:
                extra["net_dev"] = int(m.group(1))
                if m.group(2) is not None:  # NET/IB/0(1): routed through local rank 1's NIC = PXN
                    extra["pxn"] = True
                    extra["proxy_rank"] = int(m.group(2))
        extra["gdrdma"] = "GDRDMA" in parts
        if "Shared" in parts:
            extra["shared"] = True
        if head == "COLLNET":
            extra["net"] = name
            return "CollNet", extra
        low = name.lower()
        if low == "ib":
            return "NET/IB", extra
        if low == "socket":
            return "NET/Socket", extra
        return f"NET/{name}", extra
    if head == "NVLS":
        return "NVLS", extra
    return parts[0], extra
