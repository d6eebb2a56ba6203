"""NCCL_DEBUG logs, PyTorch ProcessGroupNCCL watchdog/desync lines and ncclras reports: the ``ranksight logs`` reader.

Reading is :class:`probes.nccl_log.NcclLogParser` (the parser the node agent tails with); this module turns its
events into structured facts (no raw lines) and draws the conclusions across every input:

- ``nccl_error``: per failure class and kind (an ibv_wc_status, a socket failure, CUDA out of memory ...): ranks,
  hosts, peers, GPUs, first/last time, NCCL's call trace, what it means and what to do.
- ``network_fallback``: NET/Socket in use while IB devices exist or were looked for; GPU Direct RDMA disabled.
- ``topology`` (info): nodes, ranks, transports, NICs, GDR, bootstrap interface, versions, plugins.
- ``collective_mismatch``: different OpType or sizes at one SeqNum of one process group.
- ``hang``: watchdog timeouts across ranks (who is behind, who never reported, how late the watchdog was) and RAS
  operation-count mismatches (who is ahead, who is behind).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from logs.inputs import InputFile
from logs.model import ReadResult, log_finding
from probes.nccl_log import NcclLogParser
from probes.nccl_log.summary import NcclLogSummary

NAME = "nccl"

_SNIFF = re.compile(rb" NCCL (?:INFO|WARN|TRACE|ERROR|ABORT|CALL) |^(?:[^\n]{0,40}\s)?NCCL (?:INFO|WARN|version) |"
                    rb"Watchdog caught|WorkNCCL\(|ProcessGroupNCCL|NCCL error|^Job summary|"
                    rb"Communicator ranks have different|enqueued NCCL work", re.M)
_MAX_EVENTS_PER_CLASS = 2000  # events kept per (class, kind) per input; counts stay exact
_BOOTSTRAP_RE = re.compile(r"Bootstrap ?: ?Using\s*\[?\d*\]?\s*([\w.:-]+?)[:<]")
_IFNAME_RE = re.compile(r"NCCL_SOCKET_IFNAME set (?:by environment )?to (\S+)")
_GDR_RE = re.compile(r"GPU Direct RDMA (Enabled|Disabled) for (?:HCA (\d+) '([^']*)'|(.*))")
_NIC_RE = re.compile(r"\[\d+\]([^\s:/\[]+)(?::(\d+)(?=/))?(?:/(\w+))?")


def sniff(data: bytes) -> bool:
    return _SNIFF.search(data) is not None


def _fact(ev, source: str) -> dict[str, Any]:
    f = ev.fields
    d: dict[str, Any] = {"source": source, "line": ev.line_no, "type": ev.category, "class": ev.error_class,
                         "kind": f.get("kind", ""), "host": ev.host, "pid": ev.pid, "rank": ev.rank, "t": ev.t}
    if ev.peer is not None:
        d["peer"] = ev.peer
    if f.get("cudaDev", -1) >= 0:
        d["gpu"] = f"{ev.host}:{f['cudaDev']}"
    for k, v in f.items():
        if k not in ("tid", "cudaDev", "source", "kind", "level") and isinstance(v, (int, float, str, list)):
            d[k] = v
    return d


def read(inp: InputFile) -> ReadResult | None:
    p = NcclLogParser(source_file=inp.path, keep_unclassified=False)
    p.unclassified_lines = []
    events = p.feed(inp.data)
    events += p.close()
    s = NcclLogSummary()
    res = ReadResult(reader=NAME, source=inp.path)
    kept: Counter = Counter()
    counts: Counter = Counter()
    info: dict[str, Any] = {"bootstrap": set(), "ifname": set(), "gdr_enabled": set(), "gdr_disabled": set(),
                            "no_ib_device": set(), "nics": set(), "plugins": set(), "nnodes": 0}
    unknown = list(p.unclassified_lines)
    for ev in events:
        cat = ev.category
        if cat == "unclassified":
            unknown.append(ev.line_no)
            continue
        s.add(ev)
        if cat in ("error", "warn", "trace", "watchdog", "ras"):
            key = (cat, ev.error_class, ev.fields.get("kind", ""))
            counts[key] += 1
            if kept[key] < _MAX_EVENTS_PER_CLASS:
                kept[key] += 1
                res.events.append(_fact(ev, inp.path))
        elif cat in ("info", "net", "plugin", "init"):
            _collect_info(ev, info)
    s.add_collectives(p)
    d = s.to_dict()
    total = p.line_no
    res.claimed_lines = set(range(total)).difference(n - 1 for n in unknown) if total else set()
    if len(res.events) < sum(counts.values()):
        res.notes.append(f"{inp.path}: kept {len(res.events)} of {sum(counts.values())} NCCL failure/watchdog lines "
                         f"(at most {_MAX_EVENTS_PER_CLASS} per kind); counts are exact")
    res.notes.extend(p.notes)
    res.summary = {
        "lines": total, "unknown_lines": len(unknown),
        "versions": sorted(d["versions"]),
        "processes": [{k: pr[k] for k in ("host", "pid", "rank", "nranks", "cudaDev", "busId")}
                      for pr in d["processes"]],
        "comms": {cid: {"nranks": c["nranks"], "ranks_seen": c["ranks_seen"], "init_complete": c["init_complete"]}
                  for cid, c in d["comms"].items()},
        "transports": d["transport_counts"],
        "gdrdma_connections": sum(1 for t in d["transports"] if t.get("gdrdma")),
        "networks": sorted(d["networks"]),
        "nics": sorted(info["nics"]), "bootstrap": sorted(info["bootstrap"]), "socket_ifname": sorted(info["ifname"]),
        "gdr_enabled": sorted(info["gdr_enabled"]), "gdr_disabled": sorted(info["gdr_disabled"]),
        "no_ib_device_hosts": sorted(info["no_ib_device"]), "plugins": sorted(info["plugins"]),
        "nnodes": info["nnodes"],
        "counts": {"/".join(x for x in k if x): n for k, n in sorted(counts.items())},
    }
    return res


def _collect_info(ev, info: dict[str, Any]) -> None:
    msg, f = ev.message, ev.fields
    if ev.category == "init":
        if isinstance(f.get("nNodes"), int):
            info["nnodes"] = max(info["nnodes"], f["nNodes"])
        return
    if ev.category == "net" and f.get("devices"):
        net = f.get("net", "")
        for m in _NIC_RE.finditer(f["devices"]):
            info["nics"].add(f"{m.group(1)}{':' + m.group(2) if m.group(2) else ''}/{m.group(3) or net}")
        return
    if ev.category == "plugin":
        detail = f.get("detail", "")
        if detail:
            info["plugins"].add(f"{f.get('plugin', '')}: {detail[:120]}")
        return
    if msg.startswith("Bootstrap"):
        m = _BOOTSTRAP_RE.search(msg)
        if m:
            info["bootstrap"].add(m.group(1))
    elif msg.startswith("NCCL_SOCKET_IFNAME"):
        m = _IFNAME_RE.search(msg)
        if m:
            info["ifname"].add(m.group(1))
    elif "GPU Direct RDMA" in msg:
        m = _GDR_RE.search(msg)
        if m:
            what = m.group(3) or (m.group(4) or "").strip()
            info["gdr_enabled" if m.group(1) == "Enabled" else "gdr_disabled"].add(f"{ev.host}:{what}")
    elif "No device found" in msg and "IB" in msg:
        info["no_ib_device"].add(ev.host)


def conclude(results: list[ReadResult]) -> list:
    from functools import partial

    from probes.nccl_log.conclusions import errors, fallback, ras, topology, watchdog

    finding = partial(log_finding, NAME)
    events = [e for r in results for e in r.events]
    topo = merge_summaries(results)
    summaries = [r.summary for r in results]
    sources = [r.source for r in results]
    return (errors(finding, events) + ras(finding, events) + watchdog(finding, events, topo)
            + fallback(finding, summaries, sources, topo) + topology(finding, sources, topo, events))


def summarize(results: list[ReadResult]) -> dict[str, Any]:
    """The job as the NCCL lines describe it (JSON-safe; no raw lines)."""
    t = merge_summaries(results)
    return {"hosts": t["hosts"], "ranks": t["ranks"], "world_size": t["world"], "nodes": t["nnodes"],
            "versions": t["versions"], "transports": t["transports"], "networks": t["networks"], "nics": t["nics"],
            "bootstrap": t["bootstrap"], "gdr_disabled": t["gdr_disabled"], "plugins": t["plugins"],
            "counts": dict(sum((Counter(r.summary.get("counts", {})) for r in results), Counter())),
            "unknown_lines": sum(r.summary.get("unknown_lines", 0) for r in results)}


def merge_summaries(results: list[ReadResult]) -> dict[str, Any]:
    """One picture of the job across inputs: ranks, hosts, world size, transports, NICs, versions."""
    procs: dict[tuple[str, int], dict[str, Any]] = {}
    world = 0
    comms: dict[str, dict[str, Any]] = defaultdict(lambda: {"nranks": 0, "ranks": set(), "complete": set()})
    transports: Counter = Counter()
    out: dict[str, Any] = {k: set() for k in ("versions", "networks", "nics", "bootstrap", "socket_ifname",
                                              "gdr_enabled", "gdr_disabled", "no_ib_device_hosts", "plugins")}
    nnodes, gdr_conns = 0, 0
    for r in results:
        s = r.summary
        for pr in s.get("processes", []):
            procs[(pr["host"], pr["pid"])] = pr
            world = max(world, pr.get("nranks") or 0)
        for cid, c in s.get("comms", {}).items():
            cc = comms[cid]
            cc["nranks"] = max(cc["nranks"], c["nranks"] or 0)
            cc["ranks"].update(c["ranks_seen"])
            cc["complete"].update(c["init_complete"])
        transports.update(s.get("transports", {}))
        for k in out:
            out[k].update(s.get(k, []))
        nnodes = max(nnodes, s.get("nnodes", 0))
        gdr_conns += s.get("gdrdma_connections", 0)
    hosts = sorted({h for h, _ in procs if h})
    ranks = sorted({p["rank"] for p in procs.values() if p.get("rank") is not None})
    res = {k: sorted(v) for k, v in out.items()}
    res.update(procs={f"{h}:{p}": v for (h, p), v in procs.items()}, world=world, comms=comms, transports=dict(transports), hosts=hosts, ranks=ranks,
               nnodes=nnodes or len(hosts), gdrdma_connections=gdr_conns)
    return res
