"""Kernel logs: NVIDIA driver (NVRM) Xid lines, a GPU fallen off the bus, PCIe AER reports.

Reads dmesg (plain and ``-T``), syslog/journalctl (``host kernel: ...``) and anything prefixed before those. An Xid
is tied to its host (syslog prefix, else the input), GPU PCI address, process and time; Xids on one GPU close in time
form an incident whose first Xid (or the one a "caused by previous Xid N" names) is the root cause. AER reports are
counted per device and severity (corrected / uncorrected non-fatal / fatal, Surprise Down) and tied to the GPU that is
that device, or behind that port where the log's bridge lines say so.

The Xid table: meanings and actions in our words after NVIDIA's public Xid catalogue (docs.nvidia.com "Xid Errors"),
starting from ``analyzers.checks.gpu_health.XID_MEANING`` (the live check's table), extended here.
"""

from __future__ import annotations

import os
import re
from bisect import bisect_right
from collections import Counter, defaultdict
from datetime import UTC, datetime
from typing import Any

from analyzers.checks.gpu_health import CRITICAL_XIDS, XID_MEANING
from logs.inputs import InputFile
from logs.model import LineIndex, ReadResult, log_finding
from ranksight.schema import Finding

NAME = "kernel"

_SNIFF_WORDS = (b"NVRM", b"AER: ", b"PCIe Bus Error", b"fallen off the bus")


def sniff(data: bytes) -> bool:
    return any(w in data for w in _SNIFF_WORDS)

_RESET = "drain the node, reset the GPU (nvidia-smi -r) or reboot, then run dcgmi diag -r 3 before returning it"
_NVLINK = ("NVLink fabric error: check the NVLink/NVSwitch state (nvidia-smi nvlink -s, fabric manager log), reset "
           "the GPU; if it recurs, run dcgmi diag -r 3 and open a support case")

# code -> (meaning, class, recommended action)
XID_INFO: dict[int, tuple[str, str, str]] = {
    13: ("graphics engine exception (e.g. out-of-range address, illegal instruction in a kernel)", "app",
         "usually a bug in the application's kernels: rerun under compute-sanitizer; only if it follows the GPU "
         "across applications suspect the hardware"),
    31: ("GPU memory page fault (an illegal memory access)", "app",
         "usually the application (or a library) touched an invalid address: rerun with CUDA_LAUNCH_BLOCKING=1 / "
         "compute-sanitizer; repeated on one GPU only across jobs, test that GPU"),
    43: ("GPU stopped processing (the channel was reset after a fault)", "app",
         "a consequence of an application fault or kill; look at the Xid before it on the same GPU"),
    45: ("preemptive cleanup: the driver tore down the channels of a process (after an earlier error or a kill)",
         "app", "not a fault in itself: the earlier Xid on the same GPU is the cause"),
    48: ("double-bit (uncorrectable) ECC error", "hw", _RESET + "; repeated DBEs mean replacing the GPU"),
    61: ("internal micro-controller breakpoint/warning", "hw", _RESET),
    62: ("internal micro-controller halt", "hw", _RESET),
    63: ("ECC page retirement or row remapping recorded (a row is pending remap)", "hw",
         "reset the GPU when it is idle so the remap takes effect; watch the remapped-row counts"),
    64: ("ECC page retirement or row remapping failure (no spare rows left)", "hw",
         "the GPU's memory cannot be repaired: replace the GPU"),
    68: ("video decoder (NVDEC) exception", "app", "application or driver issue with the video decoder"),
    69: ("graphics engine class error", "app", "usually the application or driver; update the driver if it repeats"),
    74: ("NVLink error", "hw", _NVLINK),
    79: ("GPU has fallen off the bus (it stopped answering on PCIe)", "hw",
         "reboot the node; check the PCIe slot, riser, power and cooling (the AER lines in the same log name the "
         "link); if it recurs, replace the GPU or the riser"),
    92: ("high single-bit ECC error rate", "hw", "the memory is degrading: schedule a reset/diagnostics; replace if it "
         "persists"),
    94: ("contained ECC error (only the process that used the bad memory was killed)", "hw",
         "other processes are unaffected; reset the GPU when convenient so the row is remapped"),
    95: ("uncontained ECC error (every process on the GPU is affected)", "hw", "reset the GPU now; " + _RESET),
    119: ("GSP firmware RPC timeout (the GPU's system processor did not answer)", "hw",
          _RESET + "; update the driver/firmware if it repeats"),
    120: ("GSP firmware error", "hw", _RESET + "; update the driver/firmware if it repeats"),
    121: ("C2C (chip-to-chip) link error", "hw", _RESET),
    136: ("NVLink ALI training failure", "hw", _NVLINK),
    137: ("NVLink privileged-register error", "hw", _NVLINK),
    140: ("unrecovered ECC error", "hw", _RESET),
    143: ("GPU initialization failure", "hw", "reset or reseat the GPU; check the firmware and driver versions"),
    144: ("NVLink SAW error", "hw", _NVLINK),
    145: ("NVLink RLW error", "hw", _NVLINK),
    146: ("NVLink TLW error", "hw", _NVLINK),
    147: ("NVLink TREX error", "hw", _NVLINK),
    148: ("NVLink NVLPW control error", "hw", _NVLINK),
    149: ("NVLink NETIR error", "hw", _NVLINK),
    150: ("NVLink MSE error", "hw", _NVLINK),
    154: ("GPU recovery action changed (the message names the action the driver wants: reset, reboot, drain)", "hw",
          "do what the message says (GPU reset, node reboot or drain)"),
    155: ("NVLink software-defined error", "hw", _NVLINK),
    156: ("resource retirement event", "hw", "watch for repeats; reset the GPU when idle"),
    157: ("resource retirement failure", "hw", "replace the GPU"),
    158: ("GPU fatal timeout", "hw", _RESET),
}

for _code, _meaning in XID_MEANING.items():  # codes the live check knows and this table does not
    XID_INFO.setdefault(_code, (_meaning, "hw" if _code in CRITICAL_XIDS else "other", "look up the Xid in NVIDIA's "
                                                                                       "catalogue"))

CRITICAL = frozenset(CRITICAL_XIDS) | {c for c, (_, cls, _) in XID_INFO.items() if cls == "hw"}
APP_LEVEL = frozenset(c for c, (_, cls, _) in XID_INFO.items() if cls == "app")


def describe(code: int) -> tuple[str, str, str]:
    """(meaning, class, action) of an Xid; an unknown code says so."""
    return XID_INFO.get(code, (f"Xid {code} (not in our table)", "other",
                               "look the code up in NVIDIA's Xid catalogue; read the message after it"))


def severity(code: int) -> str:
    return "critical" if code in CRITICAL else "warning"

# ---------------------------------------------------------------------------------------------------------------------
# Line forms.
#
# NVRM Xid: NVIDIA/open-gpu-kernel-modules src/nvidia/src/kernel/gpu/rc/kernel_rc.c
#   "NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[ GPU-CI:%02u]]): %d, pid=%s, name=%s, %s%s"  (with a process)
#   "NVRM: Xid (PCI:%04x:%02x:%02x): %d, %s%s"                                           (without; older drivers)
#   the trailing "%s" is " caused by previous Xid %d" on Xid 45 (preemptive removal) when the driver knows the cause.
# Fallen off the bus: src/nvidia/arch/nvalloc/unix/src/osinit.c ("NVRM: GPU %04x:%02x:%02x.%x: GPU has fallen off
#   the bus.", NV_DEV_PRINTF in os-interface.h) and osapi.c (three lines: "NVRM: The NVIDIA GPU %04x:%02x:%02x.%x" /
#   "NVRM: (PCI ID: %04x:%04x) installed in this system has" / "NVRM: fallen off the bus and is not responding...").
# PCIe AER: Linux drivers/pci/pcie/aer.c format strings (the tree is too large to fetch here; the forms are those of
#   its public source across 4.x-6.x): "AER: %s error message received from %s" / older "AER: %s error received:
#   %s" or "id=%04x", "PCIe Bus Error: severity=%s, type=%s, (%s)", "  device [%04x:%04x] error status/mask=%08x/%08x",
#   "   [%2d] %-22s%s" (bit name, " (First)"); the bit names short (RxErr, BadTLP, SDES...) since 4.16, long ("Receiver
#   Error", "Surprise Down Error") before. Bridges: drivers/pci/probe.c "PCI bridge to %pR" ("[bus 3b]" or
#   "[bus 3b-3c]").
# Prefixes: dmesg "[12345.678901] ", dmesg -T "[Tue Mar  5 10:22:13 2024] ", syslog "Mar  5 10:22:13 host kernel: ",
#   journalctl short-iso "2024-03-05T10:22:13+0000 host kernel: ", and anything before those (launcher prefixes).
# ---------------------------------------------------------------------------------------------------------------------

_BDF = rb"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
_XID = re.compile(
    rb"^(?P<pre>[^\n]*?)NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?P<mig>[^)\n]*)\): "
    rb"(?P<xid>\d+),[ \t]*(?:pid=(?P<pid>[^,\n]*),[ \t]*(?:name=(?P<name>[^,\n]*),[ \t]*)?)?(?P<msg>[^\n]*)", re.MULTILINE)
_CAUSED_BY = re.compile(rb"caused by previous Xid (\d+)")
_FALLEN_ONE = re.compile(rb"^(?P<pre>[^\n]*?)NVRM: GPU (?:at PCI:)?(?P<pci>" + _BDF[:-7] + rb")(?:\.[0-7])?: "
                         rb"GPU has fallen off the bus", re.MULTILINE)
_FALLEN_THREE = re.compile(rb"^(?P<pre>[^\n]*?)NVRM: The NVIDIA GPU (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:"
                           rb"[0-9a-fA-F]{2})(?:\.[0-7])?[ \t]*\n(?:[^\n]*NVRM: \(PCI ID: [^\n]*\n)?"
                           rb"[^\n]*NVRM: fallen off the bus", re.MULTILINE)
_DRIVER = re.compile(rb"NVRM: loading NVIDIA UNIX [^\n]*?Kernel Module\s+(\d+\.\d+(?:\.\d+)?)")
_CONT = re.compile(rb"(?:[ \t]{2,}[^ \t\n][^\n]*(?:\n|\Z))+")  # indented continuation lines of a multi-line record

_AER_RECV = re.compile(
    rb"^(?P<pre>[^\n]*?)(?P<drv>[\w-]+) (?P<port>" + _BDF + rb"): (?:AER: )?(?P<multi>Multiple )?"
    rb"(?P<sev>Corrected|Correctable|Uncorrected \((?:Non-)?Fatal\)|Uncorrectable \((?:Non-)?Fatal\)) error "
    rb"(?:message )?received(?: from|:)[ \t]*(?:(?P<src>" + _BDF + rb")|id=(?P<id>[0-9a-fA-F]{4}))", re.MULTILINE)
_AER_BUS = re.compile(
    rb"^(?P<pre>[^\n]*?)(?P<drv>[\w-]+) (?P<dev>" + _BDF + rb"): (?:AER: )?PCIe Bus Error: severity=(?P<sev>[^,\n]+),"
    rb"[ \t]*type=(?P<type>[^,\n]+)(?:,[ \t]*\((?P<agent>[^)\n]*)\))?", re.MULTILINE)
_AER_STATUS = re.compile(rb"^[^\n]*?(?P<dev>" + _BDF + rb"): (?:AER: )?[ \t]*device \[(?P<vid>[0-9a-fA-F]{4}):"
                         rb"(?P<did>[0-9a-fA-F]{4})\] error status/mask=(?P<status>[0-9a-fA-F]+)/", re.MULTILINE)
_AER_BIT = re.compile(rb"^[^\n]*?(?P<dev>" + _BDF + rb"): (?:AER: )?[ \t]*\[[ \t]*(?P<bit>\d+)\][ \t]*"
                      rb"(?P<name>[A-Za-z][^\n(]*?)[ \t]*(?P<first>\(First\))?[ \t]*$", re.MULTILINE)
_AER_OTHER = re.compile(rb"^[^\n]*?" + _BDF + rb": (?:AER: (?:Error of this Agent|Multiple|Root Port link|Device "
                        rb"recovery|device recovery|TLP Header|[ \t]*TLP Header)|DPC: |pciehp[^\n]*Link Down|"
                        rb"Slot\(\S+\): (?:Link Down|Card not present))[^\n]*", re.MULTILINE)
_PCIEHP_DOWN = re.compile(rb"^(?P<pre>[^\n]*?)pciehp (?P<port>" + _BDF + rb"): Slot\(\S+\): Link Down", re.MULTILINE)
_BRIDGE = re.compile(rb"^[^\n]*?pci (?P<port>" + _BDF + rb"): PCI bridge to \[bus (?P<lo>[0-9a-fA-F]{2})"
                     rb"(?:-(?P<hi>[0-9a-fA-F]{2}))?\]", re.MULTILINE)
_NV_DEV_LINE = re.compile(rb"^[^\n]*?(?:nvidia (?P<a>" + _BDF + rb"):|pci (?P<b>" + _BDF + rb"): \[10de:"
                          rb"[0-9a-fA-F]{4}\] type 00 class 0x03)", re.MULTILINE)

# Literal-led finders: a regex that starts with a literal is scanned at C speed; the full (line-anchored) forms
# above are then matched only at the start of the lines these find.
_FINDERS = {
    "xid": re.compile(rb"NVRM: Xid \("), "fallen_one": re.compile(rb"GPU has fallen off the bus"),
    "fallen_three": re.compile(rb"NVRM: The NVIDIA GPU"), "aer_recv": re.compile(rb"error (?:message )?received"),
    "aer_bus": re.compile(rb"PCIe Bus Error: "), "aer_status": re.compile(rb"error status/mask="),
    "aer_bit": re.compile(rb"\[[ \t]*\d{1,2}\][ \t]+[A-Za-z]"), "link_down": re.compile(rb"Link Down"),
    "bridge": re.compile(rb"PCI bridge to \["), "nvrm": re.compile(rb"NVRM:"),
    "aer_other": re.compile(rb"AER: "), "dpc": re.compile(rb"DPC: "), "nodev": re.compile(rb"Card not present"),
    "nv_dev": re.compile(rb"nvidia [0-9a-fA-F]{4}:"), "nv_pci": re.compile(rb"\[10de:[0-9a-fA-F]{4}\] type 00"),
}


def _at_lines(full: re.Pattern, finder: str, data: bytes):
    """``full``'s matches at the start of each line holding ``finder``'s literal (each line once)."""
    last = -1
    for f in _FINDERS[finder].finditer(data):
        ls = data.rfind(b"\n", 0, f.start()) + 1
        if ls == last:
            continue
        last = ls
        m = full.match(data, ls)
        if m:
            yield m


_SURPRISE = re.compile(r"SDES|Surprise Down", re.IGNORECASE)
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
                                       "Dec"), 1)}
_PRE_MONO = re.compile(r"\[\s*(\d+\.\d+)\]")
_PRE_DMESG_T = re.compile(r"\[(?:\w{3} )?(\w{3}) +(\d+) (\d\d):(\d\d):(\d\d)(?: (\d{4}))?\]")
_PRE_SYSLOG = re.compile(r"(?:^|\s)(\w{3}) +(\d+) (\d\d):(\d\d):(\d\d)(?:\.\d+)? (\S+) kernel:")
_PRE_ISO = re.compile(r"(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)? (\S+) kernel:")

CHAIN_GAP_S = 120.0  # Xids on one GPU closer than this belong to one incident (its first Xid is the root cause)
CORRECTED_BURST = 10  # this many corrected AER errors on one device in one input make a warning, fewer an info
MAX_EVENTS = 20000  # per input; beyond, counted only


def _prefix(pre: bytes) -> dict[str, Any]:
    """Host and time of a kernel line from what precedes the message: {"host", "t" (seconds, comparable within one
    clock kind), "clock" ("mono" | "wall"), "time" (as printed)}."""
    s = pre.decode("utf-8", "replace")
    out: dict[str, Any] = {}
    m = _PRE_ISO.search(s)
    if m:
        y, mo, d, hh, mm, ss = (int(x) for x in m.groups()[:6])
        out.update(host=m.group(7), clock="wall", time=m.group(0).rsplit(" ", 2)[0],
                   t=_wall(y, mo, d, hh, mm, ss))
    else:
        m = _PRE_SYSLOG.search(s)
        if m and m.group(1) in _MONTHS:
            out.update(host=m.group(6), clock="wall", time=m.group(0).strip().rsplit(" ", 2)[0],
                       t=_wall(2000, _MONTHS[m.group(1)], int(m.group(2)), *(int(x) for x in m.group(3, 4, 5))))
        else:
            m = _PRE_DMESG_T.search(s)
            if m and m.group(1) in _MONTHS:
                out.update(clock="wall", time=m.group(0)[1:-1],
                           t=_wall(int(m.group(6) or 2000), _MONTHS[m.group(1)], int(m.group(2)),
                                   *(int(x) for x in m.group(3, 4, 5))))
    mono = _PRE_MONO.search(s)
    if mono and "t" not in out:
        out.update(clock="mono", time=mono.group(1), t=float(mono.group(1)))
    return out


def _wall(y: int, mo: int, d: int, hh: int, mm: int, ss: int) -> float | None:
    try:
        return datetime(y, mo, d, hh, mm, ss, tzinfo=UTC).timestamp()
    except ValueError:
        return None


def _bdf(b: bytes | str) -> str:
    s = b.decode("ascii", "replace") if isinstance(b, bytes) else b
    return s.lower()


def _dev(bdf: str) -> str:
    """domain:bus:device, the part an Xid's "PCI:" names (function dropped)."""
    return bdf.split(".", 1)[0]


def _aer_class(sev: str) -> str:
    s = sev.lower()
    if "non-fatal" in s:
        return "nonfatal"
    if "fatal" in s:
        return "fatal"
    return "corrected"


def read(inp: InputFile) -> ReadResult | None:
    data = inp.data
    res = ReadResult(reader=NAME, source=inp.path)
    idx = LineIndex(data)
    claimed_offsets: list[int] = []
    events = res.events

    def add(ev: dict[str, Any], off: int, pre: bytes | None = None) -> None:
        claimed_offsets.append(off)
        if len(events) >= MAX_EVENTS:
            res.summary["events_dropped"] = res.summary.get("events_dropped", 0) + 1
            return
        ev.update(source=inp.path, line=idx.line_of(off) + 1)
        if pre is not None:
            ev.update(_prefix(pre))
        events.append(ev)

    for m in _at_lines(_XID, "xid", data):
        msg = m.group("msg").decode("utf-8", "replace").strip()
        cont = _CONT.match(data, m.end() + 1) if m.end() < len(data) else None
        if cont:  # a multi-line record: its indented continuation lines belong to this Xid
            msg = " ".join([msg] + [ln.strip() for ln in cont.group(0).decode("utf-8", "replace").splitlines()])
            claimed_offsets.extend(cont.start() + i for i, c in enumerate(cont.group(0)) if c == 10)
        caused = _CAUSED_BY.search(m.group("msg") + (cont.group(0) if cont else b""))
        pid = m.group("pid")
        mig = m.group("mig").decode("ascii", "replace").strip()
        add({"type": "xid", "xid": int(m.group("xid")[:6]), "gpu": _bdf(m.group("pci")), "msg": msg[:300],
             "pid": pid.decode("utf-8", "replace").strip("' ") if pid is not None else None,
             "process": m.group("name").decode("utf-8", "replace").strip() if m.group("name") is not None else None,
             "mig": mig or None, "caused_by": int(caused.group(1)[:6]) if caused else None}, m.start(), m.group("pre"))
    for rx, fd in ((_FALLEN_ONE, "fallen_one"), (_FALLEN_THREE, "fallen_three")):
        for m in _at_lines(rx, fd, data):
            add({"type": "fallen_off_bus", "gpu": _bdf(m.group("pci"))}, m.start(), m.group("pre"))
            if rx is _FALLEN_THREE:
                claimed_offsets.extend(m.start() + i + 1 for i, c in enumerate(m.group(0)) if c == 10)
    gpus: set[str] = {e["gpu"] for e in events}
    for fd in ("nv_dev", "nv_pci"):
        for m in _at_lines(_NV_DEV_LINE, fd, data):
            gpus.add(_dev(_bdf(m.group("a") or m.group("b"))))
    drv = _DRIVER.search(data)
    if drv:
        res.summary["driver"] = drv.group(1).decode()

    for m in _at_lines(_AER_RECV, "aer_recv", data):
        src = m.group("src")
        port = _bdf(m.group("port"))
        if src is None:  # pre-4.x kernels print the requester id: bus<<8 | dev<<3 | fn, in the port's domain
            rid = int(m.group("id"), 16)
            src_s = f"{port[:4]}:{rid >> 8:02x}:{(rid >> 3) & 0x1f:02x}.{rid & 7}"
        else:
            src_s = _bdf(src)
        add({"type": "aer_received", "port": port, "device": src_s, "class": _aer_class(m.group("sev").decode()),
             "multiple": m.group("multi") is not None}, m.start(), m.group("pre"))
    for m in _at_lines(_AER_BUS, "aer_bus", data):
        add({"type": "aer", "device": _bdf(m.group("dev")), "driver": m.group("drv").decode("utf-8", "replace"),
             "class": _aer_class(m.group("sev").decode("utf-8", "replace")),
             "severity_text": m.group("sev").decode("utf-8", "replace").strip(),
             "layer": m.group("type").decode("utf-8", "replace").strip(), "bits": []}, m.start(), m.group("pre"))
    # the status and bit lines that follow a "PCIe Bus Error" line name its device: attach them to the latest one
    by_dev: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["type"] == "aer":
            by_dev[e["device"]].append(e)
    by_line = {d: [e["line"] for e in evs] for d, evs in by_dev.items()}  # in line order: found in input order
    for rx, fd in ((_AER_STATUS, "aer_status"), (_AER_BIT, "aer_bit")):
        for m in _at_lines(rx, fd, data):
            dev = _bdf(m.group("dev"))
            line = idx.line_of(m.start()) + 1
            claimed_offsets.append(m.start())
            evs = by_dev.get(dev)
            i = bisect_right(by_line[dev], line) - 1 if evs else -1
            if i < 0:
                continue
            owner = evs[i]
            if rx is _AER_STATUS:
                owner["vendor"] = m.group("vid").decode().lower()
            elif len(owner["bits"]) < 32:
                owner["bits"].append(m.group("name").decode("utf-8", "replace").strip())
    for m in _at_lines(_PCIEHP_DOWN, "link_down", data):
        add({"type": "link_down", "device": _bdf(m.group("port"))}, m.start(), m.group("pre"))
    bridges: dict[str, list[int]] = {}
    for m in _at_lines(_BRIDGE, "bridge", data):
        lo = int(m.group("lo"), 16)
        bridges[_bdf(m.group("port"))] = [lo, int(m.group("hi"), 16) if m.group("hi") else lo]
        claimed_offsets.append(m.start())
    for fd in ("aer_other", "dpc", "nodev", "link_down"):
        claimed_offsets.extend(m.start() for m in _at_lines(_AER_OTHER, fd, data))
    claimed_offsets.extend(m.start() for m in _FINDERS["nvrm"].finditer(data))
    if not events and not claimed_offsets:
        return None
    res.claimed_lines = idx.lines_of(claimed_offsets) if claimed_offsets else set()
    hosts = sorted({e["host"] for e in events if e.get("host")})
    res.summary.update(gpus=sorted(gpus), bridges=bridges, hosts=hosts,
                       xids=len([e for e in events if e["type"] == "xid"]),
                       aer=len([e for e in events if e["type"] == "aer"]))
    if res.summary.get("events_dropped"):
        res.notes.append(f"{NAME}: more than {MAX_EVENTS} events; the rest counted only")
    return res


# ---------------------------------------------------------------------------------------------------------------------
# Conclusions
# ---------------------------------------------------------------------------------------------------------------------

def _host_of(e: dict[str, Any], r: ReadResult) -> str:
    """The host a line came from: its syslog prefix, else the only host its input names, else the input itself."""
    if e.get("host"):
        return e["host"]
    hosts = r.summary.get("hosts") or []
    return hosts[0] if len(hosts) == 1 else os.path.basename(r.source)


def _chains(evs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split one GPU's Xids (in input order) into incidents: a gap over CHAIN_GAP_S on the same clock starts a new
    one; lines without a time stay with the incident before them."""
    chains: list[list[dict[str, Any]]] = []
    last_t: tuple[str, float] | None = None
    for e in evs:
        t = (e.get("clock"), e.get("t")) if e.get("t") is not None else None
        if not chains or (t and last_t and t[0] == last_t[0] and t[1] - last_t[1] > CHAIN_GAP_S):
            chains.append([])
        chains[-1].append(e)
        if t:
            last_t = t
    return chains


def _gpu_behind(dev: str, gpus: set[str], bridges: dict[str, list[int]]) -> tuple[str | None, str]:
    """The GPU an AER device names: itself (a GPU's own address), or the one behind it (a port whose bridge range,
    printed at boot, holds a GPU's bus). (gpu, how)."""
    d = _dev(dev)
    if d in gpus:
        return d, "the GPU itself"
    rng = bridges.get(dev)
    if rng:
        behind = sorted(g for g in gpus if g[:4] == d[:4] and rng[0] <= int(g[5:7], 16) <= rng[1])
        if behind:
            return behind[0], f"behind port {dev} (bridge to bus {rng[0]:02x}-{rng[1]:02x})"
    return None, ""


def conclude(results: list[ReadResult]) -> list[Finding]:
    findings: list[Finding] = []
    per_gpu: dict[tuple[str, str], list[tuple[dict[str, Any], ReadResult]]] = defaultdict(list)
    aer: dict[tuple[str, str], list[tuple[dict[str, Any], ReadResult]]] = defaultdict(list)
    gpus_by_host: dict[str, set[str]] = defaultdict(set)
    bridges_by_host: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for r in results:
        for e in r.events:
            h = _host_of(e, r)
            if e["type"] in ("xid", "fallen_off_bus"):
                per_gpu[(h, e["gpu"])].append((e, r))
            elif e["type"] in ("aer", "aer_received", "link_down"):
                aer[(h, e["device"])].append((e, r))
        hosts = r.summary.get("hosts") or [os.path.basename(r.source)]
        for h in hosts if len(hosts) == 1 else []:
            gpus_by_host[h] |= set(r.summary.get("gpus", []))
            bridges_by_host[h].update(r.summary.get("bridges", {}))
        if len(hosts) > 1:  # several hosts in one file: the GPUs are known per host from their own lines only
            for e in r.events:
                if e.get("gpu"):
                    gpus_by_host[_host_of(e, r)].add(e["gpu"])
            for h in hosts:
                bridges_by_host[h].update(r.summary.get("bridges", {}))
    aer_findings, link_failures = _aer_findings(aer, gpus_by_host, bridges_by_host)
    for (host, gpu), items in sorted(per_gpu.items()):
        findings.append(_xid_finding(host, gpu, items, link_failures.get((host, gpu))))
    findings.extend(aer_findings)
    return findings


def _xid_finding(host: str, gpu: str, items: list[tuple[dict[str, Any], ReadResult]],
                 link_failure: str | None) -> Finding:
    evs = [e for e, _ in items]
    xids = [e for e in evs if e["type"] == "xid"]
    fallen = [e for e in evs if e["type"] == "fallen_off_bus"]
    codes = Counter(e["xid"] for e in xids)
    chains = _chains(xids)
    roots = []
    for ch in chains:
        named = next((e["caused_by"] for e in ch if e.get("caused_by")), None)
        first = ch[0]["xid"]
        # the first Xid of the incident is its root; a "caused by previous Xid N" naming an Xid not in the log (it
        # came before the log starts) is the root instead
        roots.append(first if named is None or named in {e["xid"] for e in ch} else named)
    worst = max([*codes, *([79] if fallen else [])], key=lambda c: (severity(c) == "critical", c in codes))
    sev = "critical" if fallen or any(severity(c) == "critical" for c in codes) or any(
        severity(c) == "critical" for c in roots) else "warning"
    root = roots[0] if roots else 79
    meaning, cls, action = describe(root)
    pids = sorted({f"{e['pid']}" + (f" ({e['process']})" if e.get("process") else "") for e in xids if e.get("pid")})
    first = min(evs, key=lambda e: (e["source"], e["line"]))
    code_s = ", ".join(f"{c}x{n}" if n > 1 else str(c) for c, n in sorted(codes.items()))
    parts = [f"GPU {gpu} on {host}:"]
    if xids:
        parts.append(f"{len(xids)} Xid line{'s' if len(xids) > 1 else ''} (Xid {code_s}) in {len(chains)} "
                     f"incident{'s' if len(chains) > 1 else ''}; root cause Xid {root}: {meaning}")
    if fallen and 79 not in codes:
        parts.append(("" if not xids else "; ") + "the GPU fell off the bus (no Xid 79 printed)")
    if link_failure:
        parts.append(f"; preceded by {link_failure}")
    if cls == "app" and sev == "warning":
        parts.append("(application-level: the GPU is probably fine)")
    if not xids:
        action = describe(79)[2]
    elif worst != root and severity(worst) == "critical" and severity(root) != "critical":
        action += f"; but Xid {worst} followed ({describe(worst)[0]}): {describe(worst)[2]}"
    evidence = {
        "gpu_pci": gpu, "host": host, "xid_counts": {str(c): n for c, n in sorted(codes.items())},
        "incidents": [{"root_xid": rt, "xids": [e["xid"] for e in ch][:50], "first": f"{ch[0]['source']}:"
                       f"{ch[0]['line']}", "time": ch[0].get("time")} for rt, ch in zip(roots, chains)][:20],
        "pids": pids[:20], "fallen_off_bus_lines": [f"{e['source']}:{e['line']}" for e in fallen][:10],
        "first_line": f"{first['source']}:{first['line']}", "first_time": first.get("time"),
        "last_time": max(evs, key=lambda e: (e["source"], e["line"])).get("time"), "worst_xid": worst,
        "mig": sorted({e["mig"] for e in xids if e.get("mig")})[:8], "pcie_link_failure": link_failure,
    }
    return log_finding(NAME, "gpu_health", sev, " ".join(parts).replace(" ;", ";"),
                       inputs=[r.source for _, r in items], evidence=evidence, hosts=[host], gpus=[gpu],
                       recommendation=f"Xid {root}: {action}.")


def _aer_findings(aer, gpus_by_host, bridges_by_host) -> tuple[list[Finding], dict[tuple[str, str], str]]:
    """The AER findings, and per (host, GPU) the fatal link failure to name in that GPU's Xid finding."""
    out: list[Finding] = []
    link_failures: dict[tuple[str, str], str] = {}
    infos: list[str] = []
    info_inputs: set[str] = set()
    for (host, dev), items in sorted(aer.items()):
        bus = [e for e, _ in items if e["type"] == "aer"]
        recv = [e for e, _ in items if e["type"] == "aer_received"]
        down = [e for e, _ in items if e["type"] == "link_down"]
        counts = Counter(e["class"] for e in (bus or recv))
        bits = Counter(b for e in bus for b in e["bits"])
        surprise = sum(n for b, n in bits.items() if _SURPRISE.search(b))
        gpu, how = _gpu_behind(dev, gpus_by_host.get(host, set()), bridges_by_host.get(host, {}))
        nvidia = any(e.get("vendor") == "10de" for e in bus) or any(e.get("driver") == "nvidia" for e in bus)
        what = f"GPU {gpu} ({how})" if gpu else (f"NVIDIA device {dev}" if nvidia else f"PCIe device {dev}")
        first = min((e for e, _ in items), key=lambda e: (e["source"], e["line"]))
        ev = {"device": dev, "host": host, "gpu_pci": gpu, "corrected": counts.get("corrected", 0),
              "uncorrected_nonfatal": counts.get("nonfatal", 0), "fatal": counts.get("fatal", 0),
              "error_bits": dict(bits.most_common(12)), "surprise_down": surprise, "link_down": len(down),
              "layers": sorted({e["layer"] for e in bus})[:6], "first_line": f"{first['source']}:{first['line']}",
              "first_time": first.get("time")}
        inputs = [r.source for _, r in items]
        bits_s = ", ".join(f"{b} x{n}" for b, n in bits.most_common(4))
        if counts.get("fatal") or surprise or down:
            if gpu:
                link_failures[(host, gpu)] = (f"a fatal PCIe error{' (Surprise Down)' if surprise else ''} on "
                                              f"{'its own link' if _dev(dev) == gpu else 'its upstream port ' + dev}"
                                              f" ({first['source']}:{first['line']})")
            extra = []
            if surprise:
                extra.append(f"Surprise Down x{surprise}")
            if down:
                extra.append(f"hotplug Link Down x{len(down)}")
            out.append(log_finding(
                NAME, "gpu_health", "critical",
                f"PCIe fatal error on {what} on {host}: {counts.get('fatal', 0)} fatal AER report(s)"
                + (f" ({', '.join(extra)})" if extra else "") + (f"; bits {bits_s}" if bits_s else ""),
                inputs=inputs, evidence=ev, hosts=[host], gpus=[gpu] if gpu else [],
                recommendation="The PCIe link to this device failed: drain the node, reseat/replace the GPU, riser or "
                               "cable, check the slot's power; a GPU behind it that fell off the bus (Xid 79) is the "
                               "consequence, not the cause."))
        elif counts.get("nonfatal"):
            out.append(log_finding(
                NAME, "gpu_health", "warning",
                f"PCIe uncorrected (non-fatal) errors on {what} on {host}: {counts['nonfatal']} report(s)"
                + (f"; bits {bits_s}" if bits_s else ""), inputs=inputs, evidence=ev, hosts=[host],
                gpus=[gpu] if gpu else [],
                recommendation="Transactions were lost on this link: watch for Xids on the GPU behind it; reseat the "
                               "device/riser at the next maintenance; replace if they recur."))
        elif counts.get("corrected", 0) >= CORRECTED_BURST:
            out.append(log_finding(
                NAME, "gpu_health", "warning",
                f"PCIe corrected-error burst on {what} on {host}: {counts['corrected']} corrected AER reports"
                + (f" ({bits_s})" if bits_s else ""), inputs=inputs, evidence=ev, hosts=[host],
                gpus=[gpu] if gpu else [],
                recommendation="The link retries (signal integrity): it costs bandwidth and often precedes a link "
                               "drop; check the PCIe replay counter (nvidia-smi -q: Replays), reseat the riser/cable."))
        elif counts.get("corrected"):
            infos.append(f"{what} on {host}: {counts['corrected']}" + (f" ({bits_s})" if bits_s else ""))
            info_inputs.update(inputs)
    if infos:
        out.append(log_finding(NAME, "gpu_health", "info",
                               f"{len(infos)} PCIe device(s) with a few corrected AER errors (recovered by the link, "
                               f"under {CORRECTED_BURST} each): " + "; ".join(infos[:6]),
                               inputs=sorted(info_inputs), evidence={"devices": infos[:50]},
                               recommendation="Nothing to do unless they grow into a burst."))
    return out, link_failures


def summarize(results: list[ReadResult]) -> dict[str, Any]:
    return {"inputs": len(results), "xid_lines": sum(r.summary.get("xids", 0) for r in results),
            "aer_reports": sum(r.summary.get("aer", 0) for r in results),
            "gpus": sorted({g for r in results for g in r.summary.get("gpus", [])})[:256],
            "drivers": sorted({r.summary["driver"] for r in results if r.summary.get("driver")})}
