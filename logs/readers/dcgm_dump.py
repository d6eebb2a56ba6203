"""dcgm-exporter text dumps: the Prometheus exposition of ``DCGM_FI_*`` / ``DCGM_EXP_*`` metrics (a saved
``curl :9400/metrics``), possibly after the exporter's own startup log in the same file.

Forms, from NVIDIA/dcgm-exporter: the series line is ``internal/pkg/rendermetrics/render_metrics.go``'s template
(``NAME{gpu="0",UUID="GPU-...",pci_bus_id="...",device="nvidia0",modelName="...",[GPU_I_PROFILE="1g.10gb",
GPU_I_ID="3",]Hostname|hostname="..."[,extra labels]} VALUE``; the host label was renamed ``Hostname`` ->
``hostname``), metric names from ``etc/default-counters.csv``; the startup log is logrus
(``time="..." level=info msg="Starting dcgm-exporter"``) in older releases, slog text (``time=... level=INFO
msg="..."``) in newer ones (``pkg/cmd/app.go``).

Series are read with a regex, not ``probes.dcgm.parse_exposition`` (which drops MIG series and fails the whole text
on one torn line): a dump here may be cut anywhere. MIG instances (``GPU_I_ID``) are counted under their physical GPU
(host, UUID or index). Each metric family's GPUs are counted against all GPUs the dump names: a GPU missing from a
family is flagged, and a family with ``# HELP``/``# TYPE`` but no samples is "no samples", never healthy.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from logs.inputs import InputFile
from logs.model import LineIndex, ReadResult, log_finding
from logs.readers.kernel import describe, severity
from ranksight.schema import Finding
from ranksight.simgpu import THROTTLE_HARMFUL, throttle_names

NAME = "dcgm"

_SNIFF = re.compile(rb"DCGM_(?:FI|EXP)_")
_SERIES = re.compile(rb"^(?P<name>DCGM_\w+)\{(?P<labels>[^}\n]*)\}[ \t]+(?P<val>[-+0-9.eEaNInf]+)[ \t]*(?:\d+)?[ \t]*\r?$",
                     re.MULTILINE)
_META = re.compile(rb"^# (?P<kind>HELP|TYPE) (?P<name>DCGM_\w+)[^\n]*", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LOG = re.compile(rb'^[^\n]*?\blevel=(?P<level>"?\w+"?) msg=(?P<msg>"(?:[^"\\\n]|\\.)*"|\S+)(?P<rest>[^\n]*)', re.MULTILINE)
_VERSION = re.compile(r'Version[=:]\s*"?([\w.\-]+)')

THROTTLE_FIELDS = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
VIOLATION_FIELDS = {"DCGM_FI_DEV_POWER_VIOLATION": "power", "DCGM_FI_DEV_THERMAL_VIOLATION": "thermal"}
MAX_SERIES = 500_000


def sniff(data: bytes) -> bool:
    return _SNIFF.search(data) is not None


def _gpu_key(lab: dict[str, str]) -> tuple[str, str]:
    host = lab.get("hostname") or lab.get("Hostname") or ""
    return host, lab.get("UUID") or lab.get("gpu_uuid") or f"gpu{lab.get('gpu', '?')}"


def read(inp: InputFile) -> ReadResult | None:
    data = inp.data
    res = ReadResult(reader=NAME, source=inp.path)
    idx = LineIndex(data)
    offs: list[int] = []
    families: dict[str, dict[str, Any]] = {}
    for m in _META.finditer(data):
        offs.append(m.start())
        fam = families.setdefault(m.group("name").decode(), {"declared": True, "line": idx.line_of(m.start()) + 1})
        if m.group("kind") == b"TYPE":
            fam["type"] = m.group(0).split()[-1].decode("ascii", "replace")
    values: dict[str, dict[tuple[str, str], dict[str, Any]]] = defaultdict(dict)
    gpus: dict[tuple[str, str], dict[str, Any]] = {}
    seen: set[str] = set()  # families with at least one series (a MIG instance's included)
    n = 0
    for m in _SERIES.finditer(data):
        if n >= MAX_SERIES:
            res.notes.append(f"{NAME}: more than {MAX_SERIES} series; the rest not read")
            break
        try:
            v = float(m.group("val"))
        except ValueError:
            continue
        n += 1
        offs.append(m.start())
        lab = dict(_LABEL.findall(m.group("labels").decode("utf-8", "replace")))
        name = m.group("name").decode()
        seen.add(name)
        families.setdefault(name, {"declared": False, "line": idx.line_of(m.start()) + 1})
        key = _gpu_key(lab)
        g = gpus.setdefault(key, {"gpu": lab.get("gpu"), "model": lab.get("modelName") or lab.get("model_name"),
                                  "pci": lab.get("pci_bus_id"), "mig": set()})
        if lab.get("GPU_I_ID"):
            g["mig"].add(f"{lab['GPU_I_ID']}:{lab.get('GPU_I_PROFILE', '')}")
            continue  # the physical GPU's own series carry its value; the instance's are counted, not judged
        cur = values[name].get(key)
        # the last sample wins (a file with several scrapes); an Xid series per err_code keeps the worst
        if cur is None or name != "DCGM_FI_DEV_XID_ERRORS" or v:
            values[name][key] = {"v": v, "line": idx.line_of(m.start()) + 1, "labels": {
                k: lab[k] for k in ("err_code", "err_msg", "xid") if k in lab}}
    for name, per in values.items():
        families[name]["gpus"] = len(per)
    startup = []
    for m in _LOG.finditer(data):
        offs.append(m.start())
        level = m.group("level").decode("ascii", "replace").strip('"').lower()
        msg = m.group("msg").decode("utf-8", "replace").strip('"')
        ver = _VERSION.search(m.group("rest").decode("utf-8", "replace"))
        if ver and "Starting" in msg:
            res.summary["exporter_version"] = ver.group(1)
        if level in ("error", "fatal", "warning", "warn", "panic"):
            startup.append({"level": level, "msg": msg[:200], "line": idx.line_of(m.start()) + 1})
    if not families and not startup:
        return None
    res.claimed_lines = idx.lines_of(offs) if offs else set()
    res.events.append({"type": "dcgm_dump", "source": inp.path, "line": min(
        (f["line"] for f in families.values()), default=1),
        "values": {k: {f"{h}|{u}": s for (h, u), s in per.items()} for k, per in values.items()},
        "families": families, "gpus": {f"{h}|{u}": {**g, "mig": sorted(g["mig"])} for (h, u), g in gpus.items()},
        "seen": sorted(seen),
        "startup_problems": startup[:50]})
    res.summary.update(series=n, families=len(families), gpus=len(gpus),
                       hosts=sorted({h for h, _ in gpus if h}))
    return res


def _label(key: str, g: dict[str, Any]) -> str:
    host, uuid = key.split("|", 1)
    return f"{host + ' ' if host else ''}gpu {g.get('gpu')}" + (f" ({uuid[:12]}...)" if uuid.startswith("GPU-") else "")


def conclude(results: list[ReadResult]) -> list[Finding]:
    out: list[Finding] = []
    dumps = [e for r in results for e in r.events if e["type"] == "dcgm_dump"]
    if not dumps:
        return out
    gpus: dict[str, dict[str, Any]] = {}
    values: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    families: dict[str, dict[str, Any]] = {}
    where: dict[str, str] = {}
    for d in dumps:
        for k, g in d["gpus"].items():
            gpus.setdefault(k, g)
            where.setdefault(k, d["source"])
        for name, per in d["values"].items():
            for k, s in per.items():
                values[name][k] = {**s, "source": d["source"]}
        for name, f in d["families"].items():
            families.setdefault(name, dict(f, source=d["source"]))
    inputs = sorted({d["source"] for d in dumps})
    hosts = sorted({k.split("|", 1)[0] for k in gpus if k.split("|", 1)[0]})
    problems = False

    seen = {n for d in dumps for n in d["seen"]}
    empty = sorted(n for n in families if n not in seen)
    if empty:
        problems = True
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"dcgm-exporter: {len(empty)} metric famil{'y' if len(empty) == 1 else 'ies'} declared with no samples "
            f"({', '.join(empty[:5])}): their state is unknown, not healthy",
            inputs=inputs, evidence={"no_samples": empty[:100], "lines": {n: f"{families[n]['source']}:"
                                                                             f"{families[n]['line']}" for n in empty[:20]}},
            recommendation="The exporter could not read these fields (not supported on this GPU, a DCGM profiling "
                           "module not loaded, or a field group limit): check the exporter's log and its counters "
                           "csv; do not read their absence as health."))
    # per host: exporters on different hosts may be configured with different counters
    whole = [k for k in gpus if any(k in per for per in values.values())]
    missing: dict[str, list[str]] = {}
    for name, per in sorted(values.items()):
        on_hosts = {k.split("|", 1)[0] for k in per}
        lack = [k for k in whole if k not in per and k.split("|", 1)[0] in on_hosts]
        if lack:
            missing[name] = lack
    if missing:
        problems = True
        worst = max(missing, key=lambda n: len(missing[n]))
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"dcgm-exporter: {len(missing)} metric(s) missing for some GPUs, e.g. {worst} reported for "
            f"{len(values[worst])} of {len(values[worst]) + len(missing[worst])} GPUs (missing: "
            f"{', '.join(_label(k, gpus[k]) for k in missing[worst][:4])})",
            inputs=inputs, evidence={"gpus": len(whole), "missing": {n: [_label(k, gpus[k]) for k in ks][:32]
                                                                      for n, ks in list(missing.items())[:40]}},
            hosts=sorted({k.split("|")[0] for ks in missing.values() for k in ks if k.split("|")[0]}),
            recommendation="A GPU that stops reporting a metric is often the one in trouble: check it with "
                           "nvidia-smi -q and the kernel log (Xid) on that host."))
    out.extend(_health(values, gpus, inputs))
    problems = problems or any(f.severity != "info" for f in out)
    startup = [(d["source"], p) for d in dumps for p in d["startup_problems"]]
    if startup:
        problems = True
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"dcgm-exporter logged {len(startup)} warning/error line(s) before its metrics: {startup[0][1]['msg']}",
            inputs=sorted({s for s, _ in startup}),
            evidence={"lines": [f"{s}:{p['line']} {p['level']}: {p['msg']}" for s, p in startup[:20]]},
            recommendation="Metrics the exporter failed to set up are missing from the dump; fix the exporter's "
                           "configuration (counters csv, DCGM host engine) and scrape again."))
    if not problems:
        mig = sum(len(g["mig"]) for g in gpus.values())
        out.append(log_finding(
            NAME, "gpu_health", "info",
            f"dcgm-exporter: {len(gpus)} GPUs on {len(hosts) or 1} host(s)"
            + (f" ({mig} MIG instances counted under their GPUs)" if mig else "")
            + f" report all {len(values)} metric families, no Xid, no ECC error, no harmful throttle reason",
            inputs=inputs, evidence={"gpus": len(gpus), "hosts": hosts, "families": len(values), "mig_instances": mig},
            hosts=hosts))
    return out


def _health(values, gpus, inputs) -> list[Finding]:
    out: list[Finding] = []
    xids = [(k, s) for k, s in values.get("DCGM_FI_DEV_XID_ERRORS", {}).items() if s["v"]]
    if xids:
        codes = sorted({int(s["v"]) for _, s in xids})
        sev = "critical" if any(severity(c) == "critical" for c in codes) else "warning"
        out.append(log_finding(
            NAME, "gpu_health", sev,
            f"dcgm-exporter: last Xid non-zero on {len(xids)} GPU(s): " + "; ".join(
                f"{_label(k, gpus[k])} Xid {int(s['v'])} ({describe(int(s['v']))[0]})" for k, s in xids[:6]),
            inputs=inputs, evidence={"gpus": {_label(k, gpus[k]): {"xid": int(s["v"]), "at": f"{s['source']}:"
                                                                    f"{s['line']}", **s["labels"]} for k, s in xids}},
            hosts=[k.split("|")[0] for k, _ in xids if k.split("|")[0]],
            recommendation="The gauge holds the LAST Xid and never resets: confirm its time in the kernel log; "
                           + describe(codes[-1])[2] + "."))
    mem = []
    for name, what in (("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "double-bit ECC"), ("DCGM_FI_DEV_ROW_REMAP_FAILURE",
                                                                             "row remap failure"),
                       ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "uncorrectable remapped rows")):
        mem += [(k, what, s) for k, s in values.get(name, {}).items() if s["v"] > 0]
    if mem:
        crit = any(w != "uncorrectable remapped rows" for _, w, _ in mem)
        out.append(log_finding(
            NAME, "gpu_health", "critical" if crit else "warning",
            f"dcgm-exporter: memory errors on {len({k for k, _, _ in mem})} GPU(s): " + "; ".join(
                f"{_label(k, gpus[k])} {w}={s['v']:.0f}" for k, w, s in mem[:6]),
            inputs=inputs, evidence={"errors": [{"gpu": _label(k, gpus[k]), "what": w, "value": s["v"],
                                                 "at": f"{s['source']}:{s['line']}"} for k, w, s in mem[:64]]},
            hosts=[k.split("|")[0] for k, _, _ in mem if k.split("|")[0]],
            recommendation="Drain the GPU: reset it; a remap failure or repeated DBEs mean replacing it."))
    thr = []
    for name in THROTTLE_FIELDS:
        for k, s in values.get(name, {}).items():
            mask = int(s["v"]) if s["v"] == s["v"] and 0 <= s["v"] < 2 ** 32 else 0
            if mask & THROTTLE_HARMFUL:
                viol = {w: values[f][k]["v"] / 1e9 for f, w in VIOLATION_FIELDS.items() if k in values.get(f, {})}
                thr.append((k, throttle_names(mask & THROTTLE_HARMFUL), viol))
    if thr:
        out.append(log_finding(
            NAME, "gpu_health", "warning",
            f"dcgm-exporter: {len(thr)} of {len(gpus)} GPUs with a harmful clock event reason: " + "; ".join(
                f"{_label(k, gpus[k])} {', '.join(n)}" + (", " + ", ".join(f"{w} {v:.0f} s" for w, v in viol.items())
                                                         if viol else "") for k, n, viol in thr[:6]),
            inputs=inputs, evidence={"gpus": {_label(k, gpus[k]): {"reasons": n, "violation_s": v}
                                              for k, n, v in thr}},
            hosts=[k.split("|")[0] for k, _, _ in thr if k.split("|")[0]],
            recommendation="Power cap: check power limits and rack budget; thermal: airflow and inlet temperature."))
    return out


def summarize(results: list[ReadResult]) -> dict[str, Any]:
    return {"inputs": len(results), "series": sum(r.summary.get("series", 0) for r in results),
            "gpus": sum(r.summary.get("gpus", 0) for r in results),
            "exporter_versions": sorted({r.summary["exporter_version"] for r in results
                                         if r.summary.get("exporter_version")})}
