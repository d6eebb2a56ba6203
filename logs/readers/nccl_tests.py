"""The stdout of NVIDIA's nccl-tests binaries (all_reduce_perf, all_gather_perf, ...), old and current formats.

Formats (NVIDIA/nccl-tests; printf strings in src/common.cu before 2025-10, src/util.cu after):
- header: ``# nccl-tests version V nccl-headers=N nccl-library=N`` and ``# Collective test starting: PROG`` (2025-10+),
  ``# nThread T nGpus G minBytes A maxBytes B step: S(factor|bytes) warmup iters: W iters: I [agg iters: K]
  validation: V [graph: X] [unalign: U]``;
- device lines: ``#  Rank %2d Group %2d Pid %6d on %10s device %2d [%04x:%02x:%02x] NAME`` (bus id ``[0x%02x]``
  and no ``Group`` in older builds; ``#   Rank %2d Pid ...`` in the 2020 ones);
- rows: ``%12li  %12li  %8s  %6s  %6s`` (size, count, type, redop, root; old per-test headers omit redop and/or root)
  then per placement (out-of-place, in-place) ``time algbw busbw #wrong`` (``#wrong`` an int, ``N/A`` without -c,
  a float ``0e+00`` "error" in 2020 builds), plus ``i_min i_max i_p99 i_cv%`` with per-iteration timing (-I 1) and a
  ``YYYY-MM-DD HH:MM:SS`` suffix with timestamps;
- footer: ``# Out of bounds values : N OK|FAILED``, ``# Avg bus bandwidth    : X [OK|FAILED]``,
  ``# Collective test concluded: PROG``.

The project's own nccl-tests writer (``nccl_tests/output.py``) parses only its own 13-column rows line by line,
so this module has its own whole-buffer regex. Conclusions (kind ``benchmark``): peak busbw by size, small-message
latency, ``#wrong`` (data corruption), an invalid run (each node ran its own test), busbw against what the
interconnect named by the device lines should give.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from logs.model import LineIndex, ReadResult, log_finding

NAME = "nccl_tests"

_TYPES = rb"int8|uint8|int32|uint32|int64|uint64|half|float|double|bfloat16|f8e4m3|f8e5m2|char|int"
_NUM = rb"[-+0-9.eE]+|N/A|nan|inf|-nan"
_PAT = re.compile(
    rb"# nccl-tests version (?P<ver>\S+) nccl-headers=(?P<hdr>\d+) nccl-library=(?P<lib>\d+)"
    rb"|# Collective test (?P<se>starting|concluded): (?P<prog>\S+)"
    rb"|# nThread (?P<nth>\d+) nGpus (?P<ngpu>\d+) minBytes (?P<minb>\d+) maxBytes (?P<maxb>\d+) step: (?P<step>\d+)"
    rb"\((?P<stepk>\w+)\) warmup iters: (?P<warm>\d+) iters: (?P<iters>\d+)(?: agg iters: \d+)? validation: (?P<val>\d+)"
    rb"|#\s+Rank\s+(?P<rank>\d+)(?:\s+Group\s+(?P<grp>\d+))?\s+Pid\s+(?P<pid>\d+)\s+on\s+(?P<host>\S+)\s+device\s+"
    rb"(?P<dev>\d+)\s+\[(?P<bus>[0-9a-fA-Fx:]+)\]\s+(?P<gpu>[^\r\n]*)"
    rb"|# Out of bounds values\s*: (?P<oob>\d+)"
    rb"|# Avg bus bandwidth\s*: (?P<avg>[-+0-9.eEnaif]+) ?(?P<avgok>OK|FAILED)?"
    rb"|\bnRanks (?P<nranks>\d+) nNodes (?P<nnodes>\d+)"
    rb"|^(?P<pre>[^\r\n#]{0,80}?)[ \t]*(?P<size>\d+)[ \t]+(?P<count>\d+)[ \t]+(?P<type>" + _TYPES + rb")[ \t]+"
    rb"(?P<rest>(?:[A-Za-z]+[ \t]+)?(?:-?\d+[ \t]+)?(?:" + _NUM + rb")(?:[ \t]+(?:" + _NUM + rb"))+[^\r\n]*)",
    re.M)
_SNIFF = re.compile(rb"# Avg bus bandwidth|# nThread \d+ nGpus|#\s+Rank\s+\d+\s+(?:Group\s+\d+\s+)?Pid|"
                    rb"# Collective test starting|#\s+size\s+count\s+type")
_STREAM = re.compile(r"^\s*(?:\[(\d+),(\d+)\]<std(?:out|err)>:|\[rank(\d+)\]:|(\d+):(?:\s|$))")
_TS = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")
MiB = 1 << 20

# Per-GPU bandwidth of the interconnect a GPU model has, one direction, GB/s (NVIDIA's datasheets give NVLink as the
# bidirectional total: halved here; PCIe per direction per x16 link: Gen3 16, Gen4 32, Gen5 64). First match wins.
GPU_LINKS: list[tuple[str, str, float]] = [
    ("GB200", "NVLink 5 (1800 GB/s bidirectional per GPU)", 900.0),
    ("B200", "NVLink 5 (1800 GB/s bidirectional per GPU)", 900.0),
    ("H100 PCIe", "PCIe Gen5 x16 (64 GB/s per direction)", 64.0),
    ("H800", "NVLink 4 as in H800 (400 GB/s bidirectional per GPU)", 200.0),
    ("H100", "NVLink 4 (900 GB/s bidirectional per GPU)", 450.0),
    ("H200", "NVLink 4 (900 GB/s bidirectional per GPU)", 450.0),
    ("A800", "NVLink 3 as in A800 (400 GB/s bidirectional per GPU)", 200.0),
    ("A100-PCIE", "PCIe Gen4 x16 (32 GB/s per direction)", 32.0),
    ("A100 PCIe", "PCIe Gen4 x16 (32 GB/s per direction)", 32.0),
    ("A100", "NVLink 3 (600 GB/s bidirectional per GPU)", 300.0),
    ("V100-PCIE", "PCIe Gen3 x16 (16 GB/s per direction)", 16.0),
    ("V100", "NVLink 2 (300 GB/s bidirectional per GPU)", 150.0),
    ("L40", "PCIe Gen4 x16 (32 GB/s per direction)", 32.0),
    ("L4", "PCIe Gen4 x16 (32 GB/s per direction)", 32.0),
    ("A10", "PCIe Gen4 x16 (32 GB/s per direction)", 32.0),
    ("T4", "PCIe Gen3 x16 (16 GB/s per direction)", 16.0),
]
EXPECT_FRACTION = 0.5  # peak busbw below this share of the link is flagged
MIN_SIZE_FOR_BW = 64 * MiB  # bandwidth is judged only on runs that reach this size
SLOW_LATENCY_US = 500.0  # small-message time above this is flagged (NVLink/IB give tens of us)
SLOWEST_NIC_GBPS = 12.5  # a 100 Gb/s NIC: multi-host busbw under half of this suggests TCP sockets


def sniff(data: bytes) -> bool:
    return _SNIFF.search(data) is not None


def _num(s: str) -> float | None:
    try:
        v = float(s)
    except ValueError:
        return None
    return v if v == v else None


def _placement(toks: list[str]) -> dict[str, Any]:
    out = {"time_us": _num(toks[0]), "algbw": _num(toks[1]), "busbw": _num(toks[2]),
           "wrong": None if toks[3] == "N/A" else (int(_num(toks[3]) or 0) if _num(toks[3]) is not None else None)}
    if len(toks) >= 8:
        out.update({"i_min_us": _num(toks[4]), "i_max_us": _num(toks[5]), "i_p99_us": _num(toks[6]),
                    "i_cv_pct": _num(toks[7])})
    return out


def parse_row(rest: str) -> dict[str, Any] | None:
    """redop/root/placements from what follows the type column."""
    rest = _TS.sub("", rest)
    toks = rest.split()
    row: dict[str, Any] = {"redop": None, "root": None}
    if toks and toks[0].isalpha() and toks[0] != "N":
        row["redop"] = toks.pop(0)
    if len(toks) % 4 == 1:
        try:
            row["root"] = int(toks.pop(0))
        except ValueError:
            return None
    if len(toks) not in (4, 8, 16):
        return None
    width = 8 if len(toks) == 16 else 4
    blocks = [toks[i:i + width] for i in range(0, len(toks), width)]
    if any(_num(b[0]) is None or _num(b[2]) is None for b in blocks):
        return None
    if len(blocks) == 2:
        row["out_of_place"], row["in_place"] = _placement(blocks[0]), _placement(blocks[1])
    else:  # trace replay prints only the in-place block
        row["out_of_place"], row["in_place"] = None, _placement(blocks[0])
    return row


def _stream(prefix: str) -> str:
    m = _STREAM.match(prefix)
    if not m:
        return ""
    if m.group(1):
        return f"mpi:{m.group(2)}"
    return f"rank:{m.group(3)}" if m.group(3) else f"task:{m.group(4)}"


def _new_run(source: str, stream: str, line: int) -> dict[str, Any]:
    return {"source": source, "stream": stream, "line": line, "version": None, "program": None, "config": {},
            "devices": [], "rows": [], "oob": None, "avg_busbw": None, "avg_status": None, "nnodes": [],
            "footer": False, "footer_line": None}


def read(inp) -> ReadResult | None:
    data = inp.data
    idx = LineIndex(data)
    runs: list[dict[str, Any]] = []
    current: dict[str, dict[str, Any]] = {}
    claimed: set[int] = set()
    pending_nnodes: dict[str, list[int]] = defaultdict(list)  # NCCL INFO lines before a run's header

    for m in _PAT.finditer(data):
        g = m.groupdict()
        line = idx.line_of(m.start())
        if g["size"] is not None:
            prefix = g["pre"].decode("utf-8", "replace")
        else:
            ls = data.rfind(b"\n", 0, m.start()) + 1
            prefix = data[ls:m.start()].decode("utf-8", "replace")
        stream = _stream(prefix)
        run = current.get(stream)
        is_header = g["ver"] is not None or g["nth"] is not None or (g["se"] == b"starting")
        if is_header and (run is None or run["rows"] or run["footer"]):
            run = current[stream] = _new_run(inp.path, stream, line + 1)
            run["nnodes"] = pending_nnodes.pop(stream, [])
            runs.append(run)
        if g["nnodes"] is not None:  # an NCCL INFO line in the same output: not ours to claim
            (run["nnodes"] if run is not None else pending_nnodes[stream]).append(int(g["nnodes"]))
            continue
        if run is None or (g["size"] is not None and run["footer"]):
            run = current[stream] = _new_run(inp.path, stream, line + 1)
            runs.append(run)
        if g["ver"] is not None:
            run["version"] = g["ver"].decode("utf-8", "replace")
        elif g["se"] is not None:
            if g["se"] == b"starting":
                run["program"] = g["prog"].decode("utf-8", "replace")
        elif g["nth"] is not None:
            run["config"] = {"nthread": int(g["nth"]), "ngpus": int(g["ngpu"]), "min_bytes": int(g["minb"]),
                             "max_bytes": int(g["maxb"]), "step": int(g["step"]), "step_kind": g["stepk"].decode("utf-8", "replace"),
                             "warmup_iters": int(g["warm"]), "iters": int(g["iters"]), "validation": int(g["val"])}
        elif g["rank"] is not None:
            run["devices"].append({"rank": int(g["rank"]), "group": int(g["grp"]) if g["grp"] else None,
                                   "pid": int(g["pid"]), "host": g["host"].decode("utf-8", "replace"),
                                   "device": int(g["dev"]), "bus": g["bus"].decode("utf-8", "replace"),
                                   "gpu": g["gpu"].decode("utf-8", "replace").strip(), "line": line + 1})
        elif g["oob"] is not None:
            run["oob"] = int(g["oob"])
        elif g["avg"] is not None:
            run["avg_busbw"] = _num(g["avg"].decode("utf-8", "replace"))
            run["avg_status"] = g["avgok"].decode("utf-8", "replace") if g["avgok"] else None
            run["footer"], run["footer_line"] = True, line + 1
        elif g["size"] is not None:
            row = parse_row(g["rest"].decode("utf-8", "replace"))
            if row is None:
                continue
            row.update({"size": int(g["size"]), "count": int(g["count"]), "type": g["type"].decode("utf-8", "replace"),
                        "line": line + 1})
            run["rows"].append(row)
        claimed.add(line)
    runs = [r for r in runs if r["rows"] or r["devices"] or r["footer"]]
    if not runs:
        return None
    notes = []
    torn = [r for r in runs if r["rows"] and not r["footer"]]
    if torn:
        notes.append(f"{len(torn)} nccl-tests run(s) without a footer (output cut short): read the rows there")
    return ReadResult(reader=NAME, source=inp.path, events=[{"source": inp.path, "line": r["line"], **r} for r in runs],
                      claimed_lines=claimed, notes=notes, summary={"runs": len(runs)})


# --- conclusions ----------------------------------------------------------------------------------------------------

def _fmt_size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def _op(run) -> str:
    p = run["program"] or ""
    return p[:-5] if p.endswith("_perf") else (p or "(test not named)")


def _hosts(run) -> list[str]:
    return sorted({d["host"] for d in run["devices"]})


def _link(gpus: list[str]) -> tuple[str, float, str] | None:
    names = set(gpus)
    if len(names) != 1:
        return None
    name = next(iter(names))
    for key, what, gbps in GPU_LINKS:
        if key.lower() in name.lower():
            return name, gbps, what
    return None


def _best(row) -> tuple[float, str]:
    cands = [(p["busbw"], k) for k in ("out_of_place", "in_place") if (p := row.get(k)) and p["busbw"] is not None]
    return max(cands) if cands else (0.0, "")


def _run_findings(run, inputs) -> list:
    out = []
    where = f"{run['source']}:{run['line']}"
    op = _op(run)
    rows = run["rows"]
    hosts = _hosts(run)
    gpus = [d["gpu"] for d in run["devices"]]
    ranks = sorted({d["rank"] for d in run["devices"]})
    wrong = [(r["size"], k, r[k]["wrong"], r["line"]) for r in rows for k in ("out_of_place", "in_place")
             if r.get(k) and r[k]["wrong"]]
    if wrong or (run["oob"] or 0) > 0:
        out.append(log_finding(
            NAME, "benchmark", "critical",
            f"nccl-tests {op}: data corruption: {sum(w[2] for w in wrong) or run['oob']} wrong element(s) in "
            f"{len(wrong)} result(s)" + (f", first at {_fmt_size(wrong[0][0])} {wrong[0][1]}" if wrong else "")
            + (f"; out of bounds values {run['oob']}" if run["oob"] else ""),
            inputs=inputs, hosts=hosts, ranks=ranks, gpus=sorted(set(gpus)),
            evidence={"wrong": [{"size": s, "placement": k, "wrong": n, "line": f"{run['source']}:{ln}"}
                                for s, k, n, ln in wrong[:20]], "out_of_bounds": run["oob"], "run": where},
            recommendation="Results were checked (-c 1) and differ from the expected values: a GPU, NVLink or NIC is "
                           "corrupting data. Rerun on subsets of GPUs/hosts to isolate it; check Xid and PCIe AER "
                           "errors on those hosts."))
    if not rows:
        return out
    peak_row = max(rows, key=lambda r: _best(r)[0])
    peak, peak_place = _best(peak_row)
    small = min(rows, key=lambda r: r["size"])
    small_p = small.get("out_of_place") or small.get("in_place")
    lat = small_p["time_us"] if small_p else None
    nranks = len(ranks) or (run["config"].get("nthread", 1) * run["config"].get("ngpus", 1))
    ev: dict[str, Any] = {
        "run": where, "test": op, "version": run["version"], "ranks": nranks, "hosts": hosts,
        "peak_busbw_gbps": peak, "peak_at_bytes": peak_row["size"], "peak_placement": peak_place,
        "busbw_by_size": {str(r["size"]): _best(r)[0] for r in rows},
        "small_message_bytes": small["size"], "small_message_time_us": lat,
        "avg_busbw_gbps": run["avg_busbw"], "max_bytes": max(r["size"] for r in rows)}
    severity, notes = "info", []
    expect = None
    big_enough = ev["max_bytes"] >= MIN_SIZE_FOR_BW
    if len(hosts) == 1 and nranks >= 2 and (lk := _link(gpus)):
        name, gbps, what = lk
        expect = EXPECT_FRACTION * gbps
        ev.update({"gpu": name, "link": what, "link_gbps_per_direction": gbps, "expected_min_busbw_gbps": expect,
                   "expectation_source": f"{what} for '{name}' (NVIDIA datasheet); flagged below "
                                         f"{EXPECT_FRACTION:.0%} of it"})
        if big_enough and peak < expect:
            severity = "warning"
            notes.append(f"below the {expect:.0f} GB/s expected from {what}")
    elif len(hosts) > 1:
        ev["expectation_source"] = ("across hosts busbw is bounded by the per-GPU NIC line rate, which this log does "
                                    f"not name; flagged below half of a 100 Gb/s NIC ({SLOWEST_NIC_GBPS / 2} GB/s)")
        if big_enough and peak < SLOWEST_NIC_GBPS / 2:
            severity = "warning"
            notes.append(f"below half of even a 100 Gb/s NIC across {len(hosts)} hosts (TCP sockets instead of "
                         "RDMA?)")
    if not big_enough:
        notes.append(f"largest size {_fmt_size(ev['max_bytes'])} is too small to judge bandwidth")
    if lat is not None and lat > SLOW_LATENCY_US and nranks >= 2:
        severity = "warning"
        notes.append(f"small-message time {lat:g} us above {SLOW_LATENCY_US:g} us")
    if run["avg_status"] == "FAILED":
        severity = "warning"
        notes.append("its own average bus bandwidth check FAILED")
    on = f"{nranks} rank(s)" + (f" on {len(hosts)} host(s)" if hosts else "") + \
        (f", {len(gpus)} x {gpus[0]}" if gpus and len(set(gpus)) == 1 else "")
    summary = (f"nccl-tests {op} ({on}): peak busbw {peak:g} GB/s at {_fmt_size(peak_row['size'])}"
               + (f" (expected >= {expect:.0f} GB/s)" if expect else "")
               + (f", {lat:g} us at {_fmt_size(small['size'])}" if lat is not None else "")
               + (": " + "; ".join(notes) if notes else ""))
    out.append(log_finding(
        NAME, "benchmark", severity, summary, inputs=inputs, hosts=hosts, ranks=ranks, gpus=sorted(set(gpus)),
        evidence=ev, confidence=0.8 if severity == "warning" else 1.0,
        recommendation="" if severity == "info" else
        "Check the transport NCCL picked for this run (NCCL_DEBUG=INFO: P2P/NVLink vs SHM/PCIe, NET/IB vs "
        "NET/Socket), nvidia-smi topo -m, and the NVLink/PCIe link state (nvidia-smi nvlink -s, -q)."))
    return out


def _invalid_runs(runs) -> list:
    """Each node ran its own copy (a launcher without MPI support, or mpirun per node): the same test repeated, each
    copy with its own ranks from 0 on its own host(s)."""
    out = []
    by_test: dict[tuple, list] = defaultdict(list)
    for r in runs:
        key = (_op(r), tuple(sorted(r["config"].items())), tuple(row["size"] for row in r["rows"]))
        by_test[key].append(r)
    for (op, _cfg, _sizes), rs in by_test.items():
        if len(rs) < 2:
            continue
        host_sets = [tuple(_hosts(r)) for r in rs]
        all_hosts = sorted({h for hs in host_sets for h in hs})
        from_zero = all(not r["devices"] or min(d["rank"] for d in r["devices"]) == 0 for r in rs)
        streams = {(r["source"], r["stream"]) for r in rs}
        disjoint = len(all_hosts) >= 2 and sum(len(h) for h in host_sets) == len(all_hosts)
        nnodes_one = all(r["nnodes"] and max(r["nnodes"]) == 1 for r in rs)
        interleaved = len(streams) > 1 and len({r["source"] for r in rs}) < len(rs)
        if not from_zero or not (disjoint or interleaved or (nnodes_one and len(all_hosts) != 1)):
            continue
        out.append(log_finding(
            NAME, "benchmark", "warning",
            f"nccl-tests {op}: the job did not span nodes: {len(rs)} separate runs"
            + (f" on hosts {', '.join(all_hosts)}" if all_hosts else "")
            + ", each with its own ranks from 0: the numbers measure each node alone, not the network between them",
            inputs=sorted({r["source"] for r in rs}), hosts=all_hosts,
            evidence={"runs": [f"{r['source']}:{r['line']}" for r in rs], "hosts_per_run": [list(h) for h in host_sets],
                      "ranks_per_run": [len(r["devices"]) for r in rs], "nnodes_reported": [r["nnodes"][:1] for r in rs],
                      "streams": sorted(s for _, s in streams)},
            recommendation="Build nccl-tests with MPI=1 and launch one job over all nodes (mpirun -np <nodes*gpus> "
                           "or srun --mpi=pmix), then check the header lists every rank on every host.", confidence=0.8))
    return out


def conclude(results: list[ReadResult]) -> list:
    runs = [e for r in results for e in r.events]
    findings = []
    for run in runs:
        findings.extend(_run_findings(run, [run["source"]]))
        ranks = [d["rank"] for d in run["devices"]]
        if len(ranks) != len(set(ranks)) and len({d["host"] for d in run["devices"]}) > 1:
            findings.append(log_finding(
                NAME, "benchmark", "warning",
                f"nccl-tests {_op(run)}: the same rank numbers appear on several hosts in one header: the processes "
                "did not join one job", inputs=[run["source"]], hosts=_hosts(run),
                evidence={"run": f"{run['source']}:{run['line']}", "ranks": ranks}, confidence=0.8))
    findings.extend(_invalid_runs(runs))
    return findings


def summarize(results: list[ReadResult]) -> dict[str, Any]:
    out = []
    for r in results:
        for run in r.events:
            best = max(run["rows"], key=lambda x: _best(x)[0]) if run["rows"] else None
            out.append({"source": run["source"], "line": run["line"], "test": _op(run), "version": run["version"],
                        "rows": len(run["rows"]), "hosts": _hosts(run), "ranks": len(run["devices"]),
                        "peak_busbw_gbps": _best(best)[0] if best else None, "avg_busbw_gbps": run["avg_busbw"],
                        "out_of_bounds": run["oob"]})
    return {"runs": out}
