"""Cross-rank conclusions over Flight Recorder dumps, and findings from fr_trace's text output.

Per process group, collectives are matched by ``collective_seq_id`` across the ranks' dumps (fr_trace's rule:
torch/distributed/flight_recorder/components/builder.py ``build_collectives``, utils.py ``error_analysis``, types.py
``Op.match``). Each dump is a ring buffer of the last N entries, so only sequence numbers every rank still holds
are compared. Conclusions:

- mismatch: at the first sequence number where ranks disagree on the op, the sizes or the dtypes
  (``collective_mismatch``); the culprits are the ranks outside the majority;
- hang: the first collective not completed everywhere; ranks that never enqueued it are the culprits ("not all
  ranks joining collective"), else ranks where it is only scheduled (their GPU never reached it), else none (all
  ranks are inside it: the transport is stuck). A collective younger than its timeout is in flight, not a hang;
- ranks that wait inside collectives far longer than the others (completed - started);
- an info finding when every collective matched and nothing is stuck.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from logs.model import ReadResult, log_finding

NAME = "flight_recorder"
HANG_AGE_WITHOUT_TIMEOUT_S = 60.0  # an entry with no timeout_ms counts as stuck after this long
WAIT_RATIO = 3.0  # a rank's median time inside collectives this many times the others' median ...
WAIT_MIN_MS = 5.0  # ... and this much longer, is flagged


def span(ranks) -> str:
    """[0,1,2,3,5] -> "0-3,5"."""
    rs = sorted(set(ranks))
    out, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def _signature(entries: list[dict]) -> tuple:
    """What every rank must agree on at one sequence number (types.py Op.match: type, then sizes, then dtypes)."""
    sig = []
    for e in entries:
        op = e["op"]
        ins = () if op in ("all_to_all", "scatter", "all_to_all_single", "all_to_all_v_single") else \
            tuple(map(tuple, e["input_sizes"]))
        outs = () if op in ("all_to_all", "gather", "all_to_all_single", "all_to_all_v_single") else \
            tuple(map(tuple, e["output_sizes"]))
        sig.append((op, ins, outs, tuple(sorted(set(e["input_dtypes"])))))
    return tuple(sig)


def _describe(sig: tuple) -> str:
    return "; ".join(f"{op} in={list(map(list, i))} out={list(map(list, o))}" + (f" {','.join(d)}" if d else "")
                     for op, i, o, d in sig)


def _state(entries: list[dict]) -> str:
    states = {e["state"] for e in entries}
    for s in ("scheduled", "started"):
        if s in states:
            return s
    return "completed" if states == {"completed"} else (sorted(states)[0] if states else "")


def _assign_ranks(dumps: list[ReadResult]) -> tuple[dict[int, ReadResult], list[str]]:
    by_rank: dict[int, ReadResult] = {}
    notes = []
    taken = {r.summary.get("rank") for r in dumps if r.summary.get("rank") is not None}
    nxt = 0
    for r in dumps:
        rank = r.summary.get("rank")
        if rank is None:
            while nxt in taken:
                nxt += 1
            rank = nxt
            taken.add(rank)
        if rank in by_rank:
            keep = max((by_rank[rank], r), key=lambda x: len(x.events))
            notes.append(f"two dumps for rank {rank} ({by_rank[rank].source}, {r.source}): used {keep.source}")
            by_rank[rank] = keep
        else:
            by_rank[rank] = r
    return by_rank, notes


def _groups(by_rank: dict[int, ReadResult]) -> dict[str, dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for rank, r in by_rank.items():
        for name, cfg in r.summary.get("pg_config", {}).items():
            g = groups.setdefault(name, {"desc": cfg["desc"], "ranks": set(), "per_rank": {}})
            g["ranks"].update(cfg["ranks"])
        for e in r.events:
            if e.get("seq") is None or "pg_name" not in e:
                continue
            g = groups.setdefault(e["pg_name"], {"desc": e["pg_desc"], "ranks": set(), "per_rank": {}})
            g["desc"] = g["desc"] or e["pg_desc"]
            g["pg_id"] = e["pg_id"]
            g["per_rank"].setdefault(rank, []).append(e)
    for g in groups.values():
        if not g["ranks"]:
            g["ranks"] = set(g["per_rank"])
    return groups


def _now_ns(by_rank) -> int:
    t = 0
    for r in by_rank.values():
        for e in r.events:
            t = max(t, e.get("created_ns") or 0, e.get("started_ns") or 0, e.get("completed_ns") or 0)
    return t


def _cite(e: dict) -> str:
    return f"{e['source']}#record_id={e['record_id']}"


def _pg_evidence(name: str, g: dict) -> dict[str, Any]:
    return {"pg_name": name, "pg_desc": g["desc"], "pg_id": g.get("pg_id"), "pg_ranks": span(g["ranks"]),
            "pg_size": len(g["ranks"])}


def _analyze_group(name: str, g: dict, dump_ranks: set[int], now_ns: int, inputs: list[str],
                   torn: set[int] = frozenset()) -> list:
    findings = []
    coll: dict[int, dict[int, list[dict]]] = {}  # rank -> seq -> entries (coalesced ops share a seq)
    for rank, entries in g["per_rank"].items():
        d: dict[int, list[dict]] = defaultdict(list)
        for e in entries:
            if not e["is_p2p"]:
                d[e["seq"]].append(e)
        if d:
            coll[rank] = d
    members = g["ranks"]
    no_dump = sorted(members - dump_ranks)
    if not coll:
        return findings
    lo = max(min(d) for d in coll.values())  # ring buffers: compare only what every rank still holds
    # a torn dump ends at its tear, not at the rank's last collective: compare only up to the earliest tear
    hi = min((max(coll[r]) for r in torn & set(coll)), default=None)
    seqs = sorted({s for d in coll.values() for s in d if s >= lo and (hi is None or s <= hi)})
    if not seqs:
        return findings
    pg_ev = _pg_evidence(name, g)
    where = f"process group {name}" + (f" ({g['desc']})" if g["desc"] and g["desc"] != "undefined" else "")

    # 1. mismatch: first seq where the ranks that hold it disagree
    mismatch_seq = None
    for s in seqs:
        sigs = {r: _signature(d[s]) for r, d in coll.items() if s in d}
        if len(set(sigs.values())) <= 1:
            continue
        mismatch_seq = s
        counts = Counter(sigs.values())
        (major, n_major), = counts.most_common(1)
        tie = sum(1 for c in counts.values() if c == n_major) > 1
        culprits = sorted(r for r, sg in sigs.items() if sg != major)
        by_sig = defaultdict(list)
        for r, sg in sigs.items():
            by_sig[sg].append(r)
        e0 = coll[culprits[0]][s][0]
        findings.append(log_finding(
            NAME, "collective_mismatch", "critical",
            f"Flight Recorder: ranks disagree on collective #{s} in {where}: rank(s) {span(culprits)} ran "
            f"{_describe(sigs[culprits[0]])} while {n_major} rank(s) ran {_describe(major)}",
            inputs=inputs, ranks=culprits, confidence=0.5 if tie else 0.9,
            evidence={**pg_ev, "seq": s, "variants": [{"ranks": span(rs), "collective": _describe(sg)}
                                                      for sg, rs in sorted(by_sig.items(), key=lambda x: -len(x[1]))],
                      "culprit_ranks": culprits, "tie": tie, "first_culprit_entry": _cite(e0),
                      "culprit_stack": e0["frame"]},
            recommendation="The ranks called different collectives (or different shapes/dtypes) at the same point: "
                           "look for a rank-dependent branch around the culprit's call site (the stack in the dump), "
                           "e.g. a condition on rank, data-dependent shapes, or a skipped step."))
        break

    # 2. hang: the first collective not completed on every rank that holds it
    stuck = [s for s in seqs if any(s in d and _state(d[s]) != "completed" for d in coll.values())]
    if stuck and (mismatch_seq is None or stuck[0] <= mismatch_seq):
        s = stuck[0]
        states: dict[str, list[int]] = defaultdict(list)
        held = []
        for r in sorted((members & dump_ranks) | set(coll)):
            d = coll.get(r)
            if not d or (max(d) < s and r not in torn):
                states["absent"].append(r)  # never enqueued it
            elif s in d:
                states[_state(d[s])].append(r)
                held.extend(d[s])
            else:
                states["unknown"].append(r)
        e0 = min(held, key=lambda e: e["created_ns"] or 0)
        ages = [(now_ns - e["created_ns"]) / 1e9 for e in held if e["created_ns"]]
        age_s = max(ages) if ages else 0.0
        timeout_ms = max((e["timeout_ms"] or 0) for e in held) if held else 0
        timed_out = any(e["retired"] and e["state"] != "completed" for e in held)
        limit_s = timeout_ms / 1000 if timeout_ms else HANG_AGE_WITHOUT_TIMEOUT_S
        last_done = {}
        for r, d in coll.items():
            done = [q for q, es in d.items() if _state(es) == "completed"]
            last_done[r] = max(done) if done else None
        behind = defaultdict(list)
        for r, q in last_done.items():
            behind[str(q)].append(r)
        ev = {**pg_ev, "seq": s, "op": e0["profiling_name"], "input_sizes": e0["input_sizes"],
              "output_sizes": e0["output_sizes"], "states": {k: span(v) for k, v in states.items()},
              "age_s": round(age_s, 1), "timeout_ms": timeout_ms, "timed_out_retired": timed_out,
              "last_completed_seq": {k: span(v) for k, v in sorted(behind.items())},
              "ranks_without_dump": span(no_dump), "entry": _cite(e0), "stack": e0["frame"]}
        if age_s >= limit_s or timed_out:
            if states.get("absent"):
                culprits, how = states["absent"], "never joined it"
                conf = 0.9
            elif states.get("scheduled") and (states.get("started") or states.get("completed")):
                culprits, how = states["scheduled"], "enqueued it but their GPU never started it"
                conf = 0.7
            else:
                culprits, how = [], "all entered it and none finished (stuck inside the collective)"
                conf = 0.6
            waiting = sorted(set(members & dump_ranks) - set(culprits))
            summary = (f"Flight Recorder: hang at collective #{s} {e0['profiling_name']} in {where}: "
                       + (f"rank(s) {span(culprits)} {how}; {len(waiting)} rank(s) wait in it"
                          if culprits else f"{len(waiting)} rank(s) {how}")
                       + f" for {age_s:.0f} s (timeout {timeout_ms / 1000:.0f} s)")
            if no_dump:
                summary += f"; no dump from rank(s) {span(no_dump)}"
            findings.append(log_finding(
                NAME, "hang", "critical", summary, inputs=inputs, ranks=culprits or waiting, confidence=conf,
                evidence={**ev, "culprit_ranks": culprits},
                recommendation=("Look at what the culprit ranks were doing instead (their stack, their last "
                                "completed collective, their training log: an exception, a data-loader stall, a "
                                "rank-dependent branch)." if culprits else
                                "Every rank is inside the collective: check the NCCL logs of these ranks for a "
                                "network error (IB completion errors, a dead link) or a GPU fault (Xid).")))
        else:
            findings.append(log_finding(
                NAME, "hang", "info",
                f"Flight Recorder: collective #{s} {e0['profiling_name']} in {where} was in flight when dumped "
                f"({age_s:.1f} s old, timeout {timeout_ms / 1000:.0f} s): not a hang",
                inputs=inputs, ranks=[], evidence=ev, confidence=0.8))
    elif mismatch_seq is None:
        findings.append(log_finding(
            NAME, "collective_mismatch", "info",
            f"Flight Recorder: {where}: all {len(seqs)} collectives #{seqs[0] if seqs else '-'}"
            f"..#{seqs[-1] if seqs else '-'} matched and completed on {len(coll)} rank(s)",
            inputs=inputs, ranks=[], evidence={**pg_ev, "seqs": len(seqs), "ranks_without_dump": span(no_dump)}))

    # 3. time inside collectives far beyond the others'
    med = {}
    for r, d in coll.items():
        durs = []
        for s in seqs:
            for e in d.get(s, []):
                if e["state"] != "completed":
                    continue
                ms = e["duration_ms"]
                if ms is None and e["started_ns"] and e["completed_ns"]:
                    ms = (e["completed_ns"] - e["started_ns"]) / 1e6
                if ms is not None and ms >= 0:
                    durs.append(ms)
        if durs:
            med[r] = statistics.median(durs)
    if len(med) >= 3:
        typical = statistics.median(med.values())
        slow = sorted(r for r, m in med.items() if m > WAIT_RATIO * max(typical, 1e-3) and m - typical > WAIT_MIN_MS)
        if slow and len(slow) <= len(med) // 2:
            findings.append(log_finding(
                NAME, "comm_bottleneck", "warning",
                f"Flight Recorder: rank(s) {span(slow)} spend {max(med[r] for r in slow):.1f} ms (median) inside "
                f"collectives of {where}, against {typical:.1f} ms on the median rank",
                inputs=inputs, ranks=slow, confidence=0.6,
                evidence={**pg_ev, "median_ms_by_rank": {str(r): round(m, 2) for r, m in sorted(med.items())},
                          "typical_ms": round(typical, 2), "ratio": WAIT_RATIO},
                recommendation="A rank that waits long inside every collective reached it early and waited for the "
                               "others (they arrive late: compare their compute), or its own link is slow (check "
                               "its NIC/NVLink counters and NCCL transport)."))
    return findings


def conclude_dumps(dumps: list[ReadResult]) -> list:
    if not dumps:
        return []
    by_rank, notes = _assign_ranks(dumps)
    inputs = sorted(r.source for r in by_rank.values())
    groups = _groups(by_rank)
    now_ns = _now_ns(by_rank)
    findings = []
    torn_ranks = {rank for rank, r in by_rank.items() if r.summary.get("torn")}
    for name, g in sorted(groups.items()):
        findings.extend(_analyze_group(name, g, set(by_rank), now_ns, inputs, torn_ranks))
    versions = sorted({r.summary.get("version") or "?" for r in by_rank.values()})
    torn = sorted(r.source for r in by_rank.values() if r.summary.get("torn"))
    if len(versions) > 1 or torn or notes:
        findings.append(log_finding(
            NAME, "topology", "info",
            f"Flight Recorder: {len(by_rank)} dump(s), versions {', '.join(versions)}"
            + (f"; {len(torn)} torn (read up to the tear)" if torn else ""),
            inputs=inputs, evidence={"versions": versions, "torn": torn, "notes": notes}))
    return findings


def conclude_text(texts: list[ReadResult]) -> list:
    """fr_trace's report: one finding per (kind, seq, group) across inputs."""
    merged: dict[tuple, dict[str, Any]] = {}
    for r in texts:
        for b in r.events:
            key = (b["kind"], b.get("seq"), b.get("group_info"), b.get("collective"))
            m = merged.setdefault(key, {**b, "cites": []})
            m["cites"].append(f"{b['source']}:{b['line']}")
            m.setdefault("inputs", set()).add(b["source"])
    findings = []
    for b in merged.values():
        ev = {k: b[k] for k in ("seq", "group_info", "collective", "missing_ranks", "expected_ranks", "input_sizes",
                                "output_sizes", "collective_state", "world_size", "culprits", "ranks",
                                "total_input_numel", "total_output_numel", "group") if k in b}
        ev["lines"] = b["cites"][:20]
        inputs = sorted(b["inputs"])
        what = f"collective #{b.get('seq')} {b.get('collective', '')} in group {b.get('group_info', '?')}"
        kind = b["kind"]
        if kind == "not_all_joined":
            miss = b.get("missing_ranks", [])
            findings.append(log_finding(
                NAME, "hang", "critical",
                f"fr_trace: not all ranks joined {what}: rank(s) {span(miss) or '?'} missing "
                f"(state {b.get('collective_state', '?')})", inputs=inputs, ranks=miss, evidence=ev, confidence=0.9,
                recommendation="The missing ranks never called this collective: look at what they were doing (their "
                               "stack, training log)."))
        elif kind in ("errors", "io_mismatch"):
            culprits = [c["rank"] for c in b.get("culprits", [])]
            types = sorted({c["error"] for c in b.get("culprits", [])}) or ["SIZE_OR_SYNTAX_MISMATCH"]
            findings.append(log_finding(
                NAME, "collective_mismatch", "critical",
                f"fr_trace: {what} has errors ({', '.join(types)})"
                + (f": culprit rank(s) {span(culprits)}" if culprits else ""),
                inputs=inputs, ranks=culprits, evidence=ev, confidence=0.8,
                recommendation="The ranks disagree on this collective's type, sizes, dtypes or state: find the "
                               "rank-dependent call in the culprit's stack."))
        elif kind == "missing_dumps":
            findings.append(log_finding(
                NAME, "hang", "warning",
                f"fr_trace could not decide: no Flight Recorder dumps from rank(s) {span(b.get('ranks', []))}",
                inputs=inputs, ranks=b.get("ranks", []), evidence=ev, confidence=0.5,
                recommendation="Collect the dumps of those ranks (TORCH_NCCL_DEBUG_INFO_TEMP_FILE on every node)."))
        elif kind == "too_many":
            findings.append(log_finding(
                NAME, "collective_mismatch", "warning", f"fr_trace gave up: too many mismatches for process group "
                f"{b.get('group', '')}", inputs=inputs, evidence=ev, confidence=0.7))
        elif kind == "no_errors":
            findings.append(log_finding(
                NAME, "hang", "info", "fr_trace found no errors in a collective entry (a timeout with another "
                "cause)", inputs=inputs, evidence=ev, confidence=0.5))
    return findings
