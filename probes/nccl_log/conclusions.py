"""Conclusions across every NCCL log a user brought: failures by class, network fallback, the topology, watchdog
hangs and collective mismatches, RAS reports.

Inputs are the structured facts ``logs.readers.nccl`` made of the parser's events (dicts with ``source``, ``line``,
``type``, ``class``, ``kind``, host/pid/rank and the parsed fields); ``finding`` builds a Finding (the reader passes
``logs.model.log_finding`` bound to its name), so this module needs nothing from ``logs``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Callable

from probes.nccl_log.meanings import meaning

Finding = Any
_CRITICAL = {"ib_completion", "ibv_failure", "socket", "cuda", "system", "remote", "internal", "proxy", "bootstrap",
             "ib_async", "nccl_error", "invalid_usage"}
_LATE_FACTOR = 1.5  # a watchdog that fired this much after its timeout was itself blocked


def _where(evs: list[dict[str, Any]], n: int = 5) -> list[str]:
    return [f"{e['source']}:{e['line']}" for e in evs[:n]]


def _ranks(evs) -> list[int]:
    return sorted({e["rank"] for e in evs if e.get("rank") is not None})


def _fmt(xs: list, n: int = 8) -> str:
    xs = list(xs)
    return ", ".join(map(str, xs[:n])) + (f" (+{len(xs) - n} more)" if len(xs) > n else "")


def errors(finding: Callable[..., Finding], events: list[dict[str, Any]]) -> list[Finding]:
    """One nccl_error per (class, kind): where, who, when, the call trace, what it means and what to do."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    traces: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["type"] == "trace":
            traces[(e["host"], e["pid"])].append(e)
        elif e["type"] in ("error", "warn") and e["class"] not in ("timeout",):
            groups[(e["class"] or "warn", e["kind"])].append(e)
    out = []
    for (cls, kind), evs in sorted(groups.items()):
        evs.sort(key=lambda e: (e["t"] is None, e["t"] or 0, e["source"], e["line"]))
        what, todo = meaning(cls, kind)
        hosts = sorted({e["host"] for e in evs if e["host"]})
        peers = sorted({e["peer_addr"] for e in evs if e.get("peer_addr")} | {f"rank {e['peer']}" for e in evs
                                                                              if e.get("peer") is not None})
        gpus = sorted({e["gpu"] for e in evs if e.get("gpu")})
        ts = [e["t"] for e in evs if e["t"] is not None]
        first = evs[0]
        chain = [f"{t['file']}:{t['src_line']} -> {t['result'] or t['code']}" for t in traces.get((first["host"],
                 first["pid"]), []) if t["line"] > first["line"] and t["source"] == first["source"]][:8]
        ev: dict[str, Any] = {"class": cls, "kind": kind, "count": len(evs), "meaning": what, "lines": _where(evs),
                              "peers": peers, "nccl_source": sorted({e["src"] for e in evs if e.get("src")})}
        if ts:
            ev.update(first_t=min(ts), last_t=max(ts))
        if chain:
            ev["call_trace"] = chain
        for k in ("status", "status_name", "vendor_err", "hca", "magic", "magic_ascii", "cuda_error", "call",
                  "reason", "bytes", "errno", "detail", "event"):
            vals = sorted({str(e[k]) for e in evs if k in e})
            if vals:
                ev[k] = vals if len(vals) > 1 else vals[0]
        label = kind if kind and kind != cls else ""
        sev = "critical" if cls in _CRITICAL else "warning"
        if cls == "ib_completion" and kind == "IBV_WC_WR_FLUSH_ERR" and len(groups) > 1:
            sev = "warning"  # a flushed request follows another error: that one is the cause
        if cls == "ib_async" and kind == "non_fatal":
            sev = "warning"
        who = f"rank {_fmt(_ranks(evs))}" if _ranks(evs) else f"host {_fmt(hosts)}" if hosts else "a process"
        extra = f" (received magic reads {ev['magic_ascii']!r})" if kind == "wrong_magic" and "magic_ascii" in ev else ""
        summary = (f"NCCL {cls.replace('_', ' ')}{' ' + label if label else ''} x{len(evs)} on {who}"
                   f"{' with peers ' + _fmt(peers, 4) if peers else ''}{extra}: {what}")
        out.append(finding("nccl_error", sev, summary, inputs=[e["source"] for e in evs], evidence=ev,
                           recommendation=todo, ranks=_ranks(evs), hosts=hosts, gpus=gpus))
    return out


def ras(finding: Callable[..., Finding], events: list[dict[str, Any]]) -> list[Finding]:
    """ncclras reports: operation-count mismatches (who is ahead, who behind), dead/missing processes, errors."""
    evs = [e for e in events if e["type"] == "ras"]
    out = []
    ops: dict[tuple[str, str], dict[str, Any]] = defaultdict(lambda: {"ranks": {}, "groups": [], "evs": []})
    for e in evs:
        if e["kind"] in ("op_rank", "op_group") and e.get("op"):
            o = ops[(e.get("comm_hash", ""), e["op"])]
            o["evs"].append(e)
            if e["kind"] == "op_rank" and e.get("rank") is not None:
                o["ranks"][e["rank"]] = e.get("opcount", 0)
            elif e["kind"] == "op_group":
                o["groups"].append((e["count"], e["opcount"]))
    for (comm, op), o in sorted(ops.items()):
        counts = sorted({c for _, c in o["groups"]} | set(o["ranks"].values()))
        if len(counts) < 2:
            continue
        lo, hi = counts[0], counts[-1]
        behind = sorted(r for r, c in o["ranks"].items() if c == lo)
        ahead = sorted(r for r, c in o["ranks"].items() if c == hi)
        n_behind = sum(n for n, c in o["groups"] if c == lo) or len(behind)
        n_ahead = sum(n for n, c in o["groups"] if c == hi) or len(ahead)
        nodes = sorted({e["node"] for e in o["evs"] if e.get("node") and e.get("opcount") == lo})
        summary = (f"RAS: communicator {comm} {op} operation counts differ: {n_behind} rank(s)"
                   f"{' (' + _fmt(behind) + ')' if behind else ''} behind at operation {lo}, {n_ahead} rank(s)"
                   f"{' (' + _fmt(ahead) + ')' if ahead else ''} ahead at {hi}: the ones behind are the likely culprits")
        out.append(finding("hang", "critical", summary, inputs=[e["source"] for e in o["evs"]],
                           evidence={"comm": comm, "op": op, "behind_opcount": lo, "ahead_opcount": hi,
                                     "behind_ranks": behind, "ahead_ranks": ahead, "ranks_behind": n_behind,
                                     "ranks_ahead": n_ahead, "groups": sorted(o["groups"]), "behind_nodes": nodes,
                                     "lines": _where(o["evs"])},
                           recommendation="look at what the ranks behind are doing (py-spy dump, their logs): they "
                                          "stopped launching collectives the others already launched",
                           ranks=behind, hosts=nodes))
    for kind, cls, sev in (("dead", "ras_dead", "critical"), ("missing", "ras_missing", "warning"),
                           ("errors_on", "ras_error", "critical")):
        hit = [e for e in evs if e["kind"] == kind]
        if not hit:
            continue
        state = {"dead": "dead", "missing": "missing"}.get(kind)
        listed = [e for e in evs if (e["kind"] == "process_listed" and e.get("state") == state)
                  or (kind == "missing" and e["kind"] == "missing_rank") or (kind == "errors_on" and e["kind"] ==
                                                                              "error_rank")]
        what, todo = meaning(cls)
        ranks = _ranks(listed)
        nodes = sorted({e["node"] for e in listed if e.get("node")})
        ev = {"count": sum(e["count"] for e in hit), "processes": [f"pid {e['pid']} on {e['node']}" for e in listed
                                                                   if e.get("pid")][:20],
              "errors": sorted({e["error"] for e in evs if e.get("error")}), "lines": _where(hit + listed)}
        summary = f"RAS: {ev['count']} {'process(es) dead' if kind == 'dead' else 'rank(s)/process(es) missing' if kind == 'missing' else 'rank(s) with errors'}" + (
            f" (ranks {_fmt(ranks)})" if ranks else "") + (f" on {_fmt(nodes, 4)}" if nodes else "") + f": {what}"
        out.append(finding("nccl_error", sev, summary, inputs=[e["source"] for e in hit], evidence=ev,
                           recommendation=todo, ranks=ranks, hosts=nodes))
    return out


def watchdog(finding: Callable[..., Finding], events: list[dict[str, Any]], topo: dict[str, Any]) -> list[Finding]:
    """Watchdog timeouts across ranks, per process group: mismatched collectives at one SeqNum; who is behind."""
    wd = [e for e in events if e["type"] == "watchdog"]
    if not wd:
        return []
    out = []
    by_pg: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    lines: dict[int, list[dict[str, Any]]] = defaultdict(list)
    stuck, lagging = [], set()
    for e in wd:
        pg = e.get("pg", 0)
        if e["kind"] == "watchdog_stuck":
            stuck.append(e)
            continue
        if e["kind"] == "desync_report":
            lagging.update(e.get("lagging_ranks", []))
        if e.get("rank") is None:
            continue
        lines[pg].append(e)
        r = by_pg[pg].setdefault(e["rank"], {})
        for k in ("seq", "OpType", "NumelIn", "NumelOut", "Timeout(ms)", "ran_for_ms", "last_enqueued",
                  "last_completed", "pg_name"):
            if k in e and k not in r:
                r[k] = e[k]
    for pg, ranks in sorted(by_pg.items()):
        src = [e["source"] for e in lines[pg]]
        # 1. One SeqNum, different collectives: a mismatch (every rank must call the same collective in order).
        at_seq: dict[int, dict[tuple, list[int]]] = defaultdict(lambda: defaultdict(list))
        for rank, r in ranks.items():
            if "OpType" in r and "seq" in r:
                at_seq[r["seq"]][(r["OpType"], r.get("NumelIn"), r.get("NumelOut"))].append(rank)
        for seq, variants in sorted(at_seq.items()):
            if len(variants) < 2:
                continue
            desc = sorted(([f"{op} NumelIn={ni} NumelOut={no}", sorted(rs)] for (op, ni, no), rs in variants.items()),
                          key=lambda x: -len(x[1]))
            odd = sorted(r for _, rs in desc[1:] for r in rs)
            summary = (f"collective mismatch at SeqNum {seq} of process group {pg}: "
                       + "; ".join(f"rank(s) {_fmt(rs)} ran {d}" for d, rs in desc))
            out.append(finding("collective_mismatch", "critical", summary, inputs=src,
                               evidence={"pg": pg, "seq": seq, "variants": desc, "lines": _where(lines[pg])},
                               recommendation="the ranks called different collectives (or sizes) at the same point: "
                                              "look for rank-dependent control flow or shapes before this collective",
                               ranks=odd))
        # 2. Who is behind, who never reported, how late the watchdog was.
        seqs = {rank: r.get("last_enqueued", r.get("seq")) for rank, r in ranks.items()
                if r.get("last_enqueued", r.get("seq")) is not None}
        behind = []
        ev: dict[str, Any] = {"pg": pg, "reporting_ranks": sorted(ranks), "lines": _where(lines[pg])}
        if ranks and any("pg_name" in r for r in ranks.values()):
            ev["pg_name"] = next(r["pg_name"] for r in ranks.values() if "pg_name" in r)
        if seqs:
            ev["seq_by_rank"] = {str(k): v for k, v in sorted(seqs.items())}
            lo = min(seqs.values())
            if lo != max(seqs.values()):
                behind = sorted(r for r, s in seqs.items() if s == lo)
                ev.update(behind_ranks=behind, behind_seq=lo, ahead_seq=max(seqs.values()))
        pending = {str(k): r["last_enqueued"] - r["last_completed"] for k, r in ranks.items()
                   if "last_enqueued" in r and "last_completed" in r}
        if pending:
            ev["pending_by_rank"] = pending
        world = topo.get("world", 0) if pg == 0 else 0
        missing = sorted(set(range(world)) - set(ranks)) if world else []
        if missing:
            ev.update(world_size=world, never_reported=missing)
        late = [(r["ran_for_ms"] / r["Timeout(ms)"], rank) for rank, r in ranks.items()
                if r.get("Timeout(ms)") and r.get("ran_for_ms")]
        if late:
            ev["timeout_ms"] = sorted({ranks[rk]["Timeout(ms)"] for _, rk in late})
            ev["max_ran_for_ms"] = max(ranks[rk]["ran_for_ms"] for _, rk in late)
            worst = max(late)
            if worst[0] >= _LATE_FACTOR:
                ev["late_watchdog"] = {"rank": worst[1], "factor": round(worst[0], 2)}
        if lagging:
            ev["desync_lagging_ranks"] = sorted(lagging)
        if stuck:
            ev["watchdog_stuck_s"] = max(e["stuck_s"] for e in stuck)
        culprits = sorted(lagging) or behind or missing
        parts = [f"watchdog timeout on process group {pg}{' (' + ev['pg_name'] + ')' if 'pg_name' in ev else ''}: "
                 f"{len(ranks)} rank(s) reported"]
        if behind:
            parts.append(f"rank(s) {_fmt(behind)} behind at SeqNum {ev['behind_seq']} (others at {ev['ahead_seq']}): "
                         "likely culprit")
        if missing:
            parts.append(f"rank(s) {_fmt(missing)} of {world} never reported (stuck outside the collective or dead)")
        if lagging:
            parts.append(f"desync report names rank(s) {_fmt(sorted(lagging))} as lagging")
        if "late_watchdog" in ev:
            parts.append(f"the watchdog fired {ev['late_watchdog']['factor']}x its timeout on rank "
                         f"{ev['late_watchdog']['rank']} (the process itself was blocked)")
        out.append(finding("hang", "critical", "; ".join(parts), inputs=src, evidence=ev,
                           recommendation="inspect the culprit ranks first (py-spy dump, their own logs, GPU health); "
                                          "TORCH_NCCL_DESYNC_DEBUG=1 and the Flight Recorder name the collective",
                           ranks=culprits or sorted(ranks), confidence=0.8 if culprits else 0.5))
    if stuck and not by_pg:
        out.append(finding("hang", "critical", f"ProcessGroupNCCL's watchdog got stuck for {max(e['stuck_s'] for e in stuck)} s",
                           inputs=[e["source"] for e in stuck],
                           evidence={"lines": _where(stuck), "ranks": _ranks(stuck)},
                           recommendation="a CUDA or NCCL call hung the watchdog thread: check GPU health and py-spy",
                           ranks=_ranks(stuck)))
    return out


def fallback(finding: Callable[..., Finding], summaries: list[dict[str, Any]], sources: list[str],
             topo: dict[str, Any]) -> list[Finding]:
    """NET/Socket where IB exists or was looked for; GPU Direct RDMA disabled."""
    out = []
    nets = set(topo["networks"])
    socket_used = "Socket" in nets or any(t.startswith("NET/Socket") for t in topo["transports"])
    ib_nics = [n for n in topo["nics"] if n.endswith(("/IB", "/RoCE"))]
    if socket_used and (ib_nics or topo["no_ib_device_hosts"] or "IB" in nets):
        src = [s for s, m in zip(sources, summaries) if "Socket" in m.get("networks", []) or m.get("no_ib_device_hosts")]
        why = (f"IB NICs {_fmt(ib_nics, 4)} exist" if ib_nics else
               f"NCCL looked for IB and found none on {_fmt(topo['no_ib_device_hosts'], 4)}")
        out.append(finding("network_fallback", "warning",
                           f"NCCL uses NET/Socket (TCP) between nodes while {why}: inter-node bandwidth is a fraction "
                           "of what RDMA gives", inputs=src or sources,
                           evidence={"networks": sorted(nets), "ib_nics": ib_nics,
                                     "no_ib_device_hosts": topo["no_ib_device_hosts"],
                                     "socket_connections": sum(v for k, v in topo["transports"].items()
                                                               if k.startswith("NET/Socket"))},
                           recommendation="check the IB stack on the hosts without a device (rdma-core, ibv_devices, "
                                          "the container's /dev/infiniband), NCCL_IB_DISABLE is unset, and the net "
                                          "plugin loads", hosts=topo["no_ib_device_hosts"]))
    if topo["gdr_disabled"]:
        out.append(finding("network_fallback", "warning",
                           f"GPU Direct RDMA disabled for {_fmt(topo['gdr_disabled'], 4)}: IB traffic is staged "
                           "through host memory", inputs=sources,
                           evidence={"gdr_disabled": topo["gdr_disabled"], "gdr_enabled": topo["gdr_enabled"]},
                           recommendation="load nvidia-peermem (or use dma-buf, CUDA >= 11.7 with a recent kernel) "
                                          "and check NCCL_NET_GDR_LEVEL",
                           hosts=sorted({g.split(":", 1)[0] for g in topo["gdr_disabled"]})))
    return out


def topology(finding: Callable[..., Finding], sources: list[str], topo: dict[str, Any],
             events: list[dict[str, Any]]) -> list[Finding]:
    """What the init lines say about the job, as info; a healthy init says so."""
    if not topo["procs"] and not topo["versions"]:
        return []
    comms = topo["comms"]
    incomplete = {cid: sorted(set(range(c["nranks"])) - c["complete"]) for cid, c in comms.items()
                  if c["complete"] and c["nranks"] and len(c["complete"]) < c["nranks"]
                  and len(c["ranks"]) >= c["nranks"]}
    n_fail = sum(1 for e in events if e["type"] in ("error", "warn"))
    trans = Counter(topo["transports"])
    ev = {"nodes": topo["nnodes"], "hosts": topo["hosts"], "ranks_seen": len(topo["ranks"]),
          "world_size": topo["world"], "versions": topo["versions"], "transports": dict(trans),
          "networks": topo["networks"], "nics": topo["nics"], "gdrdma_connections": topo["gdrdma_connections"],
          "bootstrap_interfaces": topo["bootstrap"], "socket_ifname": topo["socket_ifname"],
          "plugins": topo["plugins"], "communicators": len(comms), "failure_lines": n_fail}
    if incomplete:
        ev["init_incomplete"] = incomplete
    healthy = not n_fail and not incomplete
    summary = (f"NCCL {_fmt(topo['versions'], 3) or '(version not logged)'}: {len(topo['ranks'])} rank(s)"
               f"{' of ' + str(topo['world']) if topo['world'] else ''} on {topo['nnodes']} node(s); "
               f"transports {_fmt([f'{k} x{v}' for k, v in trans.most_common()], 5) or 'not logged'}; "
               f"networks {_fmt(topo['networks']) or 'none logged'}"
               f"{'; GDR on ' + str(topo['gdrdma_connections']) + ' connection(s)' if topo['gdrdma_connections'] else ''}"
               f"{'; bootstrap on ' + _fmt(topo['bootstrap']) if topo['bootstrap'] else ''}"
               + ("; healthy init, no NCCL warnings" if healthy else ""))
    return [finding("topology", "info", summary, inputs=sources, evidence=ev, hosts=topo["hosts"],
                    ranks=topo["ranks"])]
