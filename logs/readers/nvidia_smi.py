"""``nvidia-smi -q`` reports and ``nvidia-smi dmon`` tables.

``-q``: one or many ``==============NVSMI LOG==============`` snapshots (``-q -l``), each with one block per GPU
(``GPU 00000000:18:00.0``) of indented ``Key : Value`` lines under section headings. Read per GPU: performance state;
the active clock event reasons (``Clocks Event Reasons``, named ``Clocks Throttle Reasons`` before driver 530) and
their time counters where printed (``Clocks Event Reasons Counters``, in us); PCIe generation and width, max vs
current; SM clock vs max; temperature vs the slowdown/shutdown thresholds; power draw vs limit (``Power Readings`` or
``GPU Power Readings``; ``Power Draw`` or ``Average``/``Instantaneous Power Draw``); ECC error counts (SRAM/DRAM or
the older single/double bit), retired pages and remapped rows. nvidia-smi is closed source: the key names are those
its public documentation (``nvidia-smi -q`` section of the nvidia-smi man page) lists.

``dmon``: a header ``# gpu  pwr gtemp ...`` (``#Date Time gpu ...`` with ``-o DT``), a units line, then rows; the
columns depend on ``-s``, so rows are read by the header's names.

nvidia-smi prints no host name: the host of a report is the input's file name (without extension).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any

import numpy as np

from logs.inputs import InputFile
from logs.model import LineIndex, ReadResult, log_finding
from ranksight.schema import Finding

NAME = "nvidia_smi"

# a -q block's "GPU <bus id>" heading, or a dmon header ("# gpu ...", "#Date Time gpu ..."); each starts with a literal
# newline so the regex engine skips to candidates instead of trying every line start
_SNIFF = re.compile(rb"\nGPU [0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7][ \t]*\r?\n"
                    rb"|\n#[ \t]*(?:Date[ \t]+)?(?:Time[ \t]+)?gpu[ \t]+\w")
_GPU_HEAD = re.compile(rb"^[ \t]*GPU (?P<bdf>[0-9A-Fa-f]{8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])[ \t]*\r?$", re.MULTILINE)
_LOG_HEAD = re.compile(rb"^=+NVSMI LOG=+[ \t]*\r?$", re.MULTILINE)
_TIMESTAMP = re.compile(rb"^Timestamp[ \t]*:[ \t]*([^\n\r]*)", re.MULTILINE)
_DRIVER = re.compile(rb"^Driver Version[ \t]*:[ \t]*([^\n\r]*)", re.MULTILINE)
_KV = re.compile(r"^(?P<ind>[ \t]*)(?P<key>[^:\n]*?)[ \t]*(?::[ \t]*(?P<val>.*?))?[ \t]*$")
_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_DMON_HEAD = re.compile(rb"^#[ \t]*(?P<cols>(?:Date[ \t]+)?(?:Time[ \t]+)?gpu(?:[ \t]+[A-Za-z]\w*)+)[ \t]*\r?$", re.MULTILINE)
_DMON_ROW = re.compile(rb"^[ \t]*(?:\d{8}[ \t]+)?(?:\d\d:\d\d:\d\d[ \t]+)?\d+(?:[ \t]+(?:-?\d+(?:\.\d+)?|-|N/A))+"
                       rb"[ \t]*\r?$", re.MULTILINE)

HARMFUL = ("SW Power Cap", "HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown", "SW Thermal Slowdown")
TEMP_MARGIN_C = 5  # within this many degrees of the slowdown threshold is "near"
MAX_BLOCK_LINES = 1500  # a GPU block is ~200 lines; a longer one is torn: read its head
MAX_SNAPSHOTS = 5000
MAX_DMON_ROWS = 2_000_000


def sniff(data: bytes) -> bool:
    # literal tests first: a regex anchored at every line start costs a pass per line over a large job log
    if b"NVSMI LOG" in data:
        return True
    if b"GPU " not in data and b"gpu" not in data:
        return False
    return _SNIFF.match(b"\n" + data[:512]) is not None or _SNIFF.search(data) is not None  # the first line too


def _num(v: str | None) -> float | None:
    if not v:
        return None
    m = _NUM.search(v)
    return float(m.group(0)) if m else None


def _g(v: float | None) -> str:
    """A number for a summary ("?" where the report had none)."""
    return "?" if v is None else f"{v:.0f}"


def _int(v: str | None) -> int | None:
    n = _num(v)
    return int(n) if n is not None else None


def _flatten(block: str) -> dict[str, str]:
    """'Section/Sub/Key' -> value of one GPU block; a line without a value is a heading for deeper lines."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for ln in block.splitlines()[:MAX_BLOCK_LINES]:
        m = _KV.match(ln)
        if not m or not m.group("key"):
            continue
        ind = len(m.group("ind").expandtabs(4))
        while stack and stack[-1][0] >= ind:
            stack.pop()
        key = m.group("key").strip()
        if m.group("val") is None:
            stack.append((ind, key))
        else:
            out["/".join([s for _, s in stack] + [key])] = m.group("val").strip()
    return out


def _first(d: dict[str, str], *keys: str) -> str | None:
    for k in keys:
        if d.get(k) not in (None, "", "N/A", "[N/A]"):
            return d[k]
    return None


def _gpu_facts(d: dict[str, str]) -> dict[str, Any]:
    f: dict[str, Any] = {"name": _first(d, "Product Name"), "pstate": _first(d, "Performance State")}
    reasons, counters = [], {}
    for k, v in d.items():
        sec, _, leaf = k.rpartition("/")
        if sec in ("Clocks Event Reasons", "Clocks Throttle Reasons") and v == "Active":
            reasons.append(leaf)
        elif sec in ("Clocks Event Reasons Counters", "Clocks Throttle Reasons Counters"):
            n = _num(v)
            if n is not None:
                counters[leaf] = n / 1e6  # us -> s
    f["reasons"], f["reason_seconds"] = reasons, counters
    link = "PCI/GPU Link Info/"
    gmax = [_num(_first(d, link + "PCIe Generation/" + k)) for k in ("Host Max", "Device Max")]
    gmax = [g for g in gmax if g] or [_num(_first(d, link + "PCIe Generation/Max"))]
    f["gen_max"] = min([g for g in gmax if g], default=None)
    f["gen_cur"] = _num(_first(d, link + "PCIe Generation/Current", link + "PCIe Generation/Device Current"))
    f["width_max"] = _num(_first(d, link + "Link Width/Max", link + "Link Width/Host Max"))
    f["width_cur"] = _num(_first(d, link + "Link Width/Current"))
    f["replays"] = _num(_first(d, "PCI/Replays Since Reset", "PCI/Replay Number"))
    f["util"] = _num(_first(d, "Utilization/Gpu", "Utilization/GPU"))
    f["sm_clock"] = _num(_first(d, "Clocks/SM", "Clocks/Graphics"))
    f["sm_max"] = _num(_first(d, "Max Clocks/SM", "Max Clocks/Graphics"))
    f["temp"] = _num(_first(d, "Temperature/GPU Current Temp"))
    f["temp_slowdown"] = _num(_first(d, "Temperature/GPU Slowdown Temp"))
    f["temp_shutdown"] = _num(_first(d, "Temperature/GPU Shutdown Temp"))
    for sec in ("GPU Power Readings/", "Power Readings/"):
        draw = _num(_first(d, sec + "Power Draw", sec + "Average Power Draw", sec + "Instantaneous Power Draw"))
        limit = _num(_first(d, sec + "Current Power Limit", sec + "Enforced Power Limit", sec + "Power Limit"))
        if draw is not None or limit is not None:
            f["power"], f["power_limit"] = draw, limit
            break
    for scope in ("Volatile", "Aggregate"):
        for kind, words in (("uncorrectable", ("Uncorrectable", "Double Bit")), ("correctable", ("Correctable",
                                                                                                "Single Bit"))):
            keys = [k for k in d if k.startswith(f"ECC Errors/{scope}/") and any(w in k for w in words)
                    and not (kind == "correctable" and "Uncorrectable" in k)]
            totals = [k for k in keys if k.endswith("/Total")]
            f[f"ecc_{scope.lower()}_{kind}"] = int(sum(_num(d[k]) or 0 for k in (totals or keys)))
    f["retired_sbe"] = _num(_first(d, "Retired Pages/Single Bit ECC"))
    f["retired_dbe"] = _num(_first(d, "Retired Pages/Double Bit ECC"))
    f["remap_uncorrectable"] = _int(_first(d, "Remapped Rows/Uncorrectable Error"))
    f["remap_pending"] = _first(d, "Remapped Rows/Pending") == "Yes"
    f["remap_failure"] = _first(d, "Remapped Rows/Remapping Failure Occurred") == "Yes"
    return f


def read(inp: InputFile) -> ReadResult | None:
    data = inp.data
    res = ReadResult(reader=NAME, source=inp.path)
    idx = LineIndex(data)
    host = os.path.basename(inp.path).split(".", 1)[0] or inp.path
    heads = [m for m in _GPU_HEAD.finditer(data)][:MAX_SNAPSHOTS * 16]
    logs = [m.start() for m in _LOG_HEAD.finditer(data)]
    stamps = [(m.start(), m.group(1).decode("utf-8", "replace").strip()) for m in _TIMESTAMP.finditer(data)]
    drv = _DRIVER.search(data)
    claimed: set[int] = set()
    bounds = sorted({m.start() for m in heads} | set(logs) | {len(data)})
    for m in heads:
        end = next(b for b in bounds if b > m.start())
        end = min(end, next((s for s, _ in stamps if s > m.start()), len(data)))
        block = data[m.end():end].decode("utf-8", "replace")
        d = _flatten(block)
        if not d:
            continue
        facts = _gpu_facts(d)
        stamp = next((s for off, s in reversed(stamps) if off < m.start()), None)
        snap = sum(1 for off in logs if off < m.start())
        res.events.append({"type": "smi_q", "source": inp.path, "line": idx.line_of(m.start()) + 1, "host": host,
                           "gpu": m.group("bdf").decode().lower()[4:], "snapshot": snap, "time": stamp, **facts})
        first, last = idx.line_of(m.start()), idx.line_of(max(m.start(), end - 1))
        claimed.update(range(first, min(last, first + MAX_BLOCK_LINES) + 1))
    for off in logs:
        claimed.add(idx.line_of(off))
    if heads:  # the header lines of each snapshot (Timestamp, Driver/CUDA Version, Attached GPUs)
        hdr = re.compile(rb"^(?:Timestamp|Driver Version|CUDA Version|Attached GPUs)[ \t]*:[^\n]*", re.MULTILINE)
        claimed.update(idx.lines_of(m.start() for m in hdr.finditer(data)) if hdr.search(data) else set())
    _read_dmon(data, idx, res, host, claimed)
    if not res.events:
        return None
    if drv:
        res.summary["driver"] = drv.group(1).decode("utf-8", "replace").strip()
    res.claimed_lines = claimed
    res.summary.update(host=host, snapshots=len(logs) or (1 if heads else 0),
                       gpus=sorted({e["gpu"] for e in res.events if e["type"] == "smi_q"}),
                       dmon_rows=sum(1 for e in res.events if e["type"] == "dmon"))
    return res


def _read_dmon(data: bytes, idx: LineIndex, res: ReadResult, host: str, claimed: set[int]) -> None:
    heads = list(_DMON_HEAD.finditer(data))
    if not heads:
        return
    rows = 0
    for i, h in enumerate(heads):
        cols = h.group("cols").decode("ascii", "replace").split()
        claimed.add(idx.line_of(h.start()))
        unit = re.compile(rb"^#[^\n]*", re.MULTILINE).match(data, h.end() + 1)
        if unit and b"Idx" in unit.group(0):
            claimed.add(idx.line_of(unit.start()))
        end = heads[i + 1].start() if i + 1 < len(heads) else len(data)
        offs = []
        for m in _DMON_ROW.finditer(data, h.end(), end):
            vals = m.group(0).split()
            if len(vals) != len(cols) or rows >= MAX_DMON_ROWS:
                continue
            rows += 1
            offs.append(m.start())
            row = dict(zip(cols, vals))
            ev = {"type": "dmon", "source": res.source, "host": host, "gpu": row.pop("gpu").decode()}
            for k, v in row.items():
                if k in ("Date", "Time"):
                    ev[k.lower()] = v.decode()
                else:
                    try:
                        ev[k] = float(v)
                    except ValueError:
                        ev[k] = None
            res.events.append(ev)
        if offs:
            lines = np.searchsorted(idx.newlines, np.asarray(offs, dtype=np.int64), side="left").tolist()
            for ev, ln in zip(res.events[-len(offs):], lines):
                ev["line"] = ln + 1
            claimed |= idx.lines_of(offs)
    if rows >= MAX_DMON_ROWS:
        res.notes.append(f"{NAME}: dmon rows capped at {MAX_DMON_ROWS}")


# ---------------------------------------------------------------------------------------------------------------------
# Conclusions
# ---------------------------------------------------------------------------------------------------------------------

def conclude(results: list[ReadResult]) -> list[Finding]:
    findings: list[Finding] = []
    q: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    dm: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        for e in r.events:
            (q if e["type"] == "smi_q" else dm)[(e["host"], e["gpu"])].append(e)
    if q:
        findings.extend(_conclude_q(q))
    if dm:
        findings.extend(_conclude_dmon(dm))
    return findings


def _where(evs: list[dict[str, Any]]) -> str:
    return f"{evs[0]['source']}:{evs[0].get('line', '?')}"


def _conclude_q(q: dict[tuple[str, str], list[dict[str, Any]]]) -> list[Finding]:
    out: list[Finding] = []
    throttled, downgraded, idle_links, hot, mem = [], [], [], [], []
    for (host, gpu), evs in sorted(q.items()):
        harmful = [e for e in evs if any(r in HARMFUL for r in e["reasons"])]
        if harmful:
            reasons = sorted({r for e in harmful for r in e["reasons"] if r in HARMFUL})
            secs = {k: v for e in evs[-1:] for k, v in e["reason_seconds"].items() if v}
            throttled.append({"host": host, "gpu": gpu, "reasons": reasons, "snapshots": len(harmful),
                              "of": len(evs), "counter_seconds": secs, "at": _where(harmful),
                              "power_w": harmful[-1].get("power"), "power_limit_w": harmful[-1].get("power_limit"),
                              "sm_mhz": harmful[-1].get("sm_clock"), "sm_max_mhz": harmful[-1].get("sm_max")})
        low = [e for e in evs if (e["gen_cur"] and e["gen_max"] and e["gen_cur"] < e["gen_max"])
               or (e["width_cur"] and e["width_max"] and e["width_cur"] < e["width_max"])]
        if low:
            e = low[-1]
            item = {"host": host, "gpu": gpu, "gen": [e["gen_cur"], e["gen_max"]], "width": [e["width_cur"],
                    e["width_max"]], "util_pct": e["util"], "pstate": e["pstate"], "at": _where(low),
                    "snapshots": len(low), "of": len(evs)}
            busy = (e["util"] or 0) >= 30 or (e["pstate"] == "P0" and (e["util"] or 0) > 0)
            (downgraded if busy or (e["width_cur"] or 99) < (e["width_max"] or 0) else idle_links).append(item)
        for e in evs:
            if e["temp"] is not None and e["temp_slowdown"] and e["temp"] >= e["temp_slowdown"] - TEMP_MARGIN_C:
                hot.append({"host": host, "gpu": gpu, "temp_c": e["temp"], "slowdown_c": e["temp_slowdown"],
                            "shutdown_c": e["temp_shutdown"], "at": _where([e])})
                break
        e = evs[-1]
        bad = {k: e[k] for k in ("ecc_volatile_uncorrectable", "ecc_aggregate_uncorrectable", "retired_dbe",
                                 "remap_uncorrectable") if e.get(k)}
        if bad or e["remap_failure"] or e["remap_pending"]:
            mem.append({"host": host, "gpu": gpu, **bad, "remap_pending": e["remap_pending"],
                        "remap_failure": e["remap_failure"], "at": _where([e])})
    inputs = sorted({e["source"] for evs in q.values() for e in evs})
    hosts = sorted({h for h, _ in q})
    if throttled:
        names = sorted({r for t in throttled for r in t["reasons"]})
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"{len(throttled)} of {len(q)} GPUs with a clock-lowering reason active ({', '.join(names)}): "
            + "; ".join(f"{t['host']} {t['gpu']} in {t['snapshots']}/{t['of']} snapshots"
                        + (f", {sum(t['counter_seconds'].values()):.0f} s counted" if t["counter_seconds"] else "")
                        for t in throttled[:6]),
            inputs=inputs, evidence={"gpus": throttled[:64]}, hosts=[t["host"] for t in throttled],
            gpus=[t["gpu"] for t in throttled],
            recommendation="Power cap: check the power limit (nvidia-smi -q -d POWER) and the rack's power budget; "
                           "thermal: check airflow/fans and inlet temperature; HW slowdown/power brake: the PSU or "
                           "board signalled an external limit; check the BMC event log."))
    if downgraded:
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"{len(downgraded)} GPU(s) running a downgraded PCIe link: " + "; ".join(
                f"{d['host']} {d['gpu']} Gen{_g(d['gen'][0])} x{_g(d['width'][0])} of Gen{_g(d['gen'][1])} "
                f"x{_g(d['width'][1])} at {d['util_pct'] or 0:.0f}% utilisation" for d in downgraded[:6]),
            inputs=inputs, evidence={"gpus": downgraded[:64]}, hosts=[d["host"] for d in downgraded],
            gpus=[d["gpu"] for d in downgraded],
            recommendation="Under load (or with fewer lanes) the link did not train to its maximum: reseat the GPU or "
                           "riser, check the slot's BIOS link settings, look for AER errors in the kernel log."))
    if idle_links:
        out.append(log_finding(
            NAME, "gpu_health", "info",
            f"{len(idle_links)} idle GPU(s) with the PCIe generation lowered (power saving, not a fault): "
            + "; ".join(f"{d['host']} {d['gpu']} Gen{_g(d['gen'][0])} of Gen{_g(d['gen'][1])} at "
                        f"{d['util_pct'] or 0:.0f}% ({d['pstate']})" for d in idle_links[:6]),
            inputs=inputs, evidence={"gpus": idle_links[:64]}, hosts=[d["host"] for d in idle_links],
            gpus=[d["gpu"] for d in idle_links],
            recommendation="Nothing to do: the link returns to its maximum generation under load; check it again "
                           "while a job runs."))
    if hot:
        crit = [h for h in hot if h["shutdown_c"] and h["temp_c"] >= h["shutdown_c"] - TEMP_MARGIN_C]
        out.append(log_finding(
            NAME, "gpu_health", "critical" if crit else "warning",
            f"{len(hot)} GPU(s) within {TEMP_MARGIN_C} C of their slowdown temperature: " + "; ".join(
                f"{h['host']} {h['gpu']} {_g(h['temp_c'])} C (slowdown {_g(h['slowdown_c'])} C)" for h in hot[:6]),
            inputs=inputs, evidence={"gpus": hot[:64]}, hosts=[h["host"] for h in hot], gpus=[h["gpu"] for h in hot],
            recommendation="Check the node's fans, airflow and inlet temperature before the GPU slows its clocks."))
    if mem:
        crit = [m for m in mem if m["remap_failure"] or m.get("ecc_volatile_uncorrectable")]
        out.append(log_finding(
            NAME, "gpu_health", "critical" if crit else "warning",
            f"{len(mem)} GPU(s) with memory errors: " + "; ".join(
                f"{m['host']} {m['gpu']} " + ", ".join(f"{k}={v}" for k, v in m.items()
                                                       if k not in ("host", "gpu", "at") and v) for m in mem[:6]),
            inputs=inputs, evidence={"gpus": mem[:64]}, hosts=[m["host"] for m in mem], gpus=[m["gpu"] for m in mem],
            recommendation="Remap pending: reset the GPU when idle; remapping failure or new uncorrectable errors: "
                           "drain the node and replace the GPU (run dcgmi diag -r 3 first)."))
    if not (throttled or downgraded or hot or mem):
        temps = [e["temp"] for evs in q.values() for e in evs if e["temp"] is not None]
        out.append(log_finding(
            NAME, "gpu_health", "info",
            f"{len(q)} GPUs on {len(hosts)} host(s) healthy in nvidia-smi -q: PCIe at max link"
            + (" (or lowered only while idle)" if idle_links else "") + ", no throttle reason active, no ECC errors"
            + (f", max {max(temps):.0f} C" if temps else ""),
            inputs=inputs, evidence={"gpus": len(q), "hosts": hosts, "snapshots": sum(len(v) for v in q.values()),
                                     "max_temp_c": max(temps) if temps else None}, hosts=hosts,
            gpus=sorted({g for _, g in q})))
    return out


def _conclude_dmon(dm: dict[tuple[str, str], list[dict[str, Any]]]) -> list[Finding]:
    out: list[Finding] = []
    inputs = sorted({e["source"] for evs in dm.values() for e in evs})
    viol, ecc, stats = [], [], []
    for (host, gpu), evs in sorted(dm.items()):
        n = len(evs)
        pv = sum(1 for e in evs if (e.get("pviol") or 0) > 0)
        tv = sum(1 for e in evs if (e.get("tviol") or 0) > 0)
        if pv or tv:
            viol.append({"host": host, "gpu": gpu, "power_violation_samples": pv, "thermal_violation_samples": tv,
                         "samples": n, "first": _where([next(e for e in evs if (e.get("pviol") or 0) > 0
                                                              or (e.get("tviol") or 0) > 0)])})
        dbe = max((e.get("dbecc") or 0 for e in evs), default=0)
        if dbe:
            ecc.append({"host": host, "gpu": gpu, "dbecc": dbe})
        temps = [e["gtemp"] for e in evs if e.get("gtemp") is not None]
        sm = [e["sm"] for e in evs if e.get("sm") is not None]
        stats.append({"host": host, "gpu": gpu, "samples": n, "max_temp_c": max(temps) if temps else None,
                      "mean_sm_pct": round(sum(sm) / len(sm), 1) if sm else None})
    if viol:
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"nvidia-smi dmon: {len(viol)} of {len(dm)} GPUs throttled: " + "; ".join(
                f"{v['host']} gpu {v['gpu']} power {v['power_violation_samples']}/{v['samples']} samples, thermal "
                f"{v['thermal_violation_samples']}/{v['samples']}" for v in viol[:6]),
            inputs=inputs, evidence={"gpus": viol[:64]}, hosts=[v["host"] for v in viol],
            gpus=[f"{v['host']}:{v['gpu']}" for v in viol],
            recommendation="Check the power limit and cooling of these GPUs (nvidia-smi -q -d PERFORMANCE names the "
                           "active reasons)."))
    if ecc:
        out.append(log_finding(NAME, "gpu_health", "critical",
                               f"nvidia-smi dmon: double-bit ECC errors on {len(ecc)} GPU(s): " + "; ".join(
                                   f"{x['host']} gpu {x['gpu']} dbecc={x['dbecc']:.0f}" for x in ecc[:6]),
                               inputs=inputs, evidence={"gpus": ecc}, hosts=[x["host"] for x in ecc],
                               gpus=[f"{x['host']}:{x['gpu']}" for x in ecc],
                               recommendation="Drain the node; reset the GPU and run dcgmi diag -r 3."))
    if not viol and not ecc:
        temps = [s["max_temp_c"] for s in stats if s["max_temp_c"] is not None]
        out.append(log_finding(
            NAME, "gpu_health", "info",
            f"nvidia-smi dmon: {len(dm)} GPUs, {sum(s['samples'] for s in stats)} samples, no power or thermal "
            "violation, no double-bit ECC error" + (f", max {max(temps):.0f} C" if temps else ""),
            inputs=inputs, evidence={"gpus": stats[:64]}, hosts=sorted({s["host"] for s in stats})))
    return out


def summarize(results: list[ReadResult]) -> dict[str, Any]:
    return {"inputs": len(results), "gpus": sum(len(r.summary.get("gpus", [])) for r in results),
            "dmon_rows": sum(r.summary.get("dmon_rows", 0) for r in results),
            "drivers": sorted({r.summary["driver"] for r in results if r.summary.get("driver")})}
