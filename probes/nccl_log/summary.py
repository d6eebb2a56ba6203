"""NcclLogSummary: events of any number of log files aggregated into one picture of the job.

Versions, processes and their ranks, communicators with their rings, trees and init times,
transports per peer pair, networks and plugins, errors/warnings/watchdog lines, per-call
COLL counters. :func:`summarize` reads a set of files into it and returns the JSON-able dict
that ``ranksight nccl-log --json`` prints.
"""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from typing import Any, Iterable

from probes.nccl_log.parser import READ_CHUNK, NcclLogParser, open_log
from ranksight.schema import NcclEvent

_MAX_LISTED = 500  # errors/warnings kept verbatim per class; the counts stay exact


class NcclLogSummary:
    """Aggregates events from any number of files into one picture of the job."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.file_errors: dict[str, str] = {}
        self.lines = 0
        self.events = 0
        self.categories: Counter[str] = Counter()
        self.versions: dict[str, set[str]] = defaultdict(set)  # version -> {"host:pid"}
        self.procs: dict[tuple[str, int], dict[str, Any]] = {}
        self.comms: dict[str, dict[str, Any]] = {}
        self.transports: dict[tuple, dict[str, Any]] = {}
        self.plugins: list[dict[str, Any]] = []
        self.nets: dict[str, set[str]] = defaultdict(set)
        self.errors: list[dict[str, Any]] = []
        self.warnings: list[dict[str, Any]] = []
        self.watchdog: list[dict[str, Any]] = []
        self.error_classes: Counter[str] = Counter()
        self.unclassified_where: dict[str, int] = {}  # file -> lines no recogniser claimed (counted, never echoed)
        self.notes: list[str] = []
        self.collectives: dict[str, dict[str, Any]] = {}
        self._pending_topo: dict[tuple[str, int, int], list[NcclEvent]] = defaultdict(list)

    def _proc(self, host: str, pid: int) -> dict[str, Any]:
        p = self.procs.get((host, pid))
        if p is None:
            p = self.procs[(host, pid)] = {"host": host, "pid": pid, "rank": None, "nranks": None,
                                           "cudaDev": None, "busId": None, "version": None, "files": set()}
        return p

    def _comm(self, cid: str) -> dict[str, Any]:
        c = self.comms.get(cid)
        if c is None:
            c = self.comms[cid] = {"comm_id": cid, "nranks": None, "ranks": {}, "rings": {}, "trees": {},
                                   "ring_neighbors": {}, "ring_fields": [], "nbr_fields": [],
                                   "nchannels": None, "init_time_s": {}, "complete": set()}
        return c

    def add(self, ev: NcclEvent) -> None:
        self.events += 1
        cat = ev.category
        self.categories[cat] += 1
        f = ev.fields
        proc = self._proc(ev.host, ev.pid) if (ev.host or ev.pid) else None
        if proc is not None and ev.source_file:
            proc["files"].add(ev.source_file)
        if cat == "version":
            v = f.get("full")
            if v:
                self.versions[v].add(f"{ev.host}:{ev.pid}" if ev.host else ev.source_file)
                if proc is not None:
                    proc["version"] = v
            if f.get("note") and f["note"] not in self.notes:
                self.notes.append(f["note"])
        elif cat == "init" and "comm" in f:
            c = self._comm(ev.comm_id)
            c["nranks"] = ev.nranks
            r = c["ranks"].setdefault(ev.rank, {})
            r.update({"host": ev.host, "pid": ev.pid, "cudaDev": f.get("cudaDev"), "busId": f.get("busId"),
                      "comm": f.get("comm")})
            if str(f.get("phase", "")).endswith("COMPLETE") or "phase" not in f:
                if f.get("phase", "Init COMPLETE") == "Init COMPLETE":
                    c["complete"].add(ev.rank)
            if "init_time_s" in f:
                c["init_time_s"][ev.rank] = f["init_time_s"]
            if proc is not None and (proc["nranks"] is None or (ev.nranks or 0) > proc["nranks"]):
                proc.update(rank=ev.rank, nranks=ev.nranks, cudaDev=f.get("cudaDev"), busId=f.get("busId"))
            # Topology lines printed before this comm line on the same thread belong to it (old
            # NCCL prints "comm ... Init COMPLETE" only after the rings and transports).
            key = (ev.host, ev.pid, f.get("tid", 0))
            for tev in self._pending_topo.pop(key, []):
                tev.comm_id = ev.comm_id
                self._topology(tev, ev.rank)
        elif cat == "init" and "init_time_s" in f and ev.comm_id:
            self._comm(ev.comm_id)["init_time_s"][ev.rank] = f["init_time_s"]
        elif cat in ("ring", "tree", "transport"):
            if not ev.comm_id:
                self._pending_topo[(ev.host, ev.pid, f.get("tid", 0))].append(ev)
            else:
                self._topology(ev, None)
        elif cat == "plugin":
            if len(self.plugins) < _MAX_LISTED:
                item = {"host": ev.host, "plugin": f.get("plugin", ""), "detail": f.get("detail", ev.message)}
                if item not in self.plugins:
                    self.plugins.append(item)
        elif cat == "net":
            if f.get("net"):
                self.nets[f["net"]].add(f.get("devices", ""))
        elif cat == "collective":
            c = self.collectives.setdefault(f"{ev.host}:{ev.pid}:{f.get('comm')}", {"count": 0})
            c["count"] += 1
            c.update(last_op=f.get("op"), last_opCount=f.get("opCount"), rank=ev.rank)
        elif cat in ("error", "warn", "trace", "watchdog"):
            self.error_classes[ev.error_class or cat] += 1
            item = {"category": cat, "error_class": ev.error_class, "host": ev.host, "pid": ev.pid,
                    "rank": ev.rank, "peer": ev.peer, "peer_addr": f.get("peer_addr"), "message": ev.message,
                    "file": ev.source_file, "line": ev.line_no}
            for k in ("status", "status_name", "cuda_error", "call", "SeqNum", "OpType", "NumelIn",
                      "Timeout(ms)", "ran_for_ms", "reason", "hca"):
                if k in f:
                    item[k] = f[k]
            target = self.watchdog if cat == "watchdog" else self.warnings if cat in ("warn", "trace") else self.errors
            if len(target) < _MAX_LISTED:
                target.append(item)
        elif cat == "unclassified":
            self.unclassified_where[ev.source_file] = self.unclassified_where.get(ev.source_file, 0) + 1

    def _topology(self, ev: NcclEvent, rank_hint: int | None) -> None:
        c = self._comm(ev.comm_id)
        f = ev.fields
        rank = ev.rank if ev.rank is not None else rank_hint
        if ev.category == "ring":
            if "order" in f:
                c["ring_fields"].append(f)  # channels may still grow (shared list): expand in to_dict
                if f.get("nchannels"):
                    c["nchannels"] = f["nchannels"]
            elif "prev" in f:
                c["nbr_fields"].append((rank, f))
        elif ev.category == "tree":
            for ch, node in f.get("trees", {}).items():
                c["trees"].setdefault(ch, {})[node.get("rank", rank)] = {
                    k: node[k] for k in ("parent", "children", "spec") if k in node}
        elif ev.category == "transport" and "src" in f:
            key = (ev.comm_id, f["src"], f["dst"], ev.transport, f.get("direction", ""))
            t = self.transports.get(key)
            if t is None:
                t = self.transports[key] = {
                    "comm_id": ev.comm_id, "src": f["src"], "dst": f["dst"], "transport": ev.transport,
                    "direction": f.get("direction", ""), "via": f.get("via", ""), "gdrdma": f.get("gdrdma"),
                    "net_dev": f.get("net_dev"), "pxn": bool(f.get("pxn")), "_lists": [], "host": ev.host}
            t["_lists"].append(f.get("channels") or [f.get("channel")])

    def add_collectives(self, parser: NcclLogParser) -> None:
        """Fold a parser's COLL-line counters (lines that became no events) into the summary."""
        counts = parser.collective_counts
        for (host, pid, comm), info in parser.last_collective.items():
            key = f"{host}:{pid}:{comm}"
            c = self.collectives.setdefault(key, {"count": 0})
            c["count"] += counts.get((host, pid, comm), 0)
            c.update(last_op=info.get("op"), last_opCount=info.get("opCount"),
                     rank=parser.proc_rank.get((host, pid), (None,))[0])

    def finish(self) -> None:
        # Topology lines whose comm never announced itself still count, under "unknown".
        for key, evs in self._pending_topo.items():
            for tev in evs:
                tev.comm_id = f"unknown@{key[0]}:{key[1]}"
                self._topology(tev, None)
        self._pending_topo.clear()
        # Errors printed before the process's first "comm ... rank" line get its rank now.
        for lst in (self.errors, self.warnings, self.watchdog):
            for item in lst:
                if item["rank"] is None:
                    p = self.procs.get((item["host"], item["pid"]))
                    if p and p["rank"] is not None:
                        item["rank"] = p["rank"]

    def to_dict(self) -> dict[str, Any]:
        self.finish()
        # A process's rank is its rank in the largest communicator it joined (the world, usually).
        procs: list[dict[str, Any]] = []
        hosts: dict[str, dict[str, Any]] = {}
        for (host, pid), p in sorted(self.procs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if not host and not pid:
                continue
            h = hosts.setdefault(host, {"pids": [], "ranks": []})
            h["pids"].append(pid)
            if p["rank"] is not None:
                h["ranks"].append(p["rank"])
            procs.append({"host": host, "pid": pid, "rank": p["rank"], "nranks": p["nranks"], "cudaDev": p["cudaDev"],
                          "busId": p["busId"], "version": p["version"], "files": sorted(p["files"])})
        comms = {}
        for cid, c in self.comms.items():
            for f in c["ring_fields"]:
                for ch in f.get("channels") or [f.get("channel")]:
                    c["rings"].setdefault(ch, f["order"])
            for rank, f in c["nbr_fields"]:
                for ch in f.get("channels") or [f.get("channel")]:
                    c["ring_neighbors"].setdefault(ch, {})[rank] = {"prev": f["prev"], "next": f["next"]}
            comms[cid] = {
                "nranks": c["nranks"], "ranks_seen": sorted(r for r in c["ranks"] if r is not None),
                "ranks": {str(r): v for r, v in sorted(c["ranks"].items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
                "init_complete": sorted(c["complete"]), "nchannels": c["nchannels"],
                "init_time_s": {str(k): v for k, v in c["init_time_s"].items()},
                "rings": {str(k): v for k, v in c["rings"].items()},
                "ring_neighbors": {str(k): {str(r): n for r, n in v.items()} for k, v in c["ring_neighbors"].items()},
                "trees": {str(k): {str(r): n for r, n in v.items()} for k, v in c["trees"].items()},
            }
        transports = []
        for t in sorted(self.transports.values(), key=lambda t: (t["comm_id"], t["src"], t["dst"], t["transport"])):
            row = {k: v for k, v in t.items() if k != "_lists"}
            row["channels"] = sorted({ch for lst in t["_lists"] for ch in lst if ch is not None})
            transports.append(row)
        tcount = Counter(t["transport"] for t in transports)
        return {
            "files": self.files,
            "file_errors": self.file_errors,
            "lines": self.lines,
            "events": self.events,
            "categories": dict(self.categories),
            "versions": {v: sorted(s) for v, s in self.versions.items()},
            "ranks": sorted({p["rank"] for p in procs if p["rank"] is not None}),
            "processes": procs,
            "hosts": hosts,
            "comms": comms,
            "transports": transports,
            "transport_counts": dict(tcount),
            "networks": {k: sorted(v) for k, v in self.nets.items()},
            "plugins": self.plugins,
            "errors": self.errors,
            "warnings": self.warnings,
            "watchdog": self.watchdog,
            "error_classes": dict(self.error_classes),
            "collectives": self.collectives,
            "unclassified_by_file": self.unclassified_where,
            "notes": self.notes,
        }


def summarize(paths: Iterable[str], **kw: Any) -> dict[str, Any]:
    """Parse a set of log files and aggregate them. Unreadable files are listed in
    ``file_errors`` (path -> reason), never raised."""
    s = NcclLogSummary()
    for path in paths:
        p = NcclLogParser(source_file=path, **kw)
        try:
            with open_log(path) as f:
                # read1: a truncated .gz hands out what it could decompress before EOFError
                read = getattr(f, "read1", f.read)
                while True:
                    chunk = read(READ_CHUNK)
                    if not chunk:
                        break
                    for ev in p.feed(chunk):
                        s.add(ev)
                for ev in p.close():
                    s.add(ev)
        except (OSError, EOFError, zlib.error) as e:  # EOFError: truncated .gz; what was read still counts
            s.file_errors[path] = f"{type(e).__name__}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
            if p.line_no == 0:
                continue
        s.files.append(path)
        s.lines += p.line_no
        s.add_collectives(p)
        for n in p.notes:
            if n not in s.notes:
                s.notes.append(n)
    return s.to_dict()
