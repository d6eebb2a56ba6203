"""The kernel-log reader: NVRM Xid lines (with/without pid, every prefix), multi-line records, fallen off the bus
without an Xid, "caused by previous Xid" chains, PCIe AER tied to the GPU behind a port; numbers asserted."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import kernel
from fuzz_settings import fuzz_settings

FIX = Path(__file__).parent / "fixtures" / "logs" / "kernel"


def _read(name: str):
    p = FIX / name
    return kernel.read(InputFile(str(p), p.read_bytes()))


def _by_gpu(findings, gpu, word="Xid"):
    return [f for f in findings if gpu in f.gpus and word in f.summary]


def test_sniff():
    assert kernel.sniff((FIX / "dmesg_xid79_aer.log").read_bytes())
    assert not kernel.sniff(b"NCCL INFO Bootstrap : Using eth0\n")


def test_dmesg_xid_forms_and_prefixes():
    r = _read("dmesg_xid79_aer.log")
    xids = [e for e in r.events if e["type"] == "xid"]
    assert [e["xid"] for e in xids] == [13, 13, 43, 79, 45, 45]
    assert xids[0]["pid"] == "40211" and xids[0]["process"] == "python" and xids[0]["gpu"] == "0000:86:00"
    assert xids[0]["clock"] == "mono" and xids[0]["t"] == 8123.456001 and xids[0]["line"] == 12
    assert xids[4]["caused_by"] == 79
    assert r.summary["driver"] == "535.129.03"
    assert r.summary["gpus"] == ["0000:3b:00", "0000:86:00"]
    assert r.summary["bridges"] == {"0000:3a:00.0": [0x3b, 0x3b], "0000:85:00.0": [0x86, 0x87]}
    assert len(r.claimed_lines) == 17  # boot noise, the segfault line: not ours


def test_syslog_host_pidless_mig_ansi_quoted_and_truncated():
    r = _read("syslog_xid_chain.log")
    xids = [e for e in r.events if e["type"] == "xid"]
    assert len(xids) == 9
    assert {e["host"] for e in xids} == {"gpu-node-07", "gpu-node-08"}
    dbe = next(e for e in xids if e["xid"] == 48)
    assert dbe["pid"] is None and dbe["gpu"] == "0000:9a:00" and "double bit" in dbe["msg"]
    assert next(e for e in xids if e["xid"] == 94 and e["host"] == "gpu-node-08")["mig"] == "GPU-I:05"
    assert any(e["xid"] == 31 and e["pid"] == "9912" for e in xids)  # behind an ANSI colour remnant
    assert xids[-1]["xid"] == 79 and xids[-1]["pid"] is None  # the truncated last line still counts
    unknown = next(e for e in xids if e["gpu"] == "0000:2a:00")
    assert unknown["pid"] == "<unknown>" and unknown["caused_by"] == 119


def test_multiline_record_and_old_kernel_aer():
    r = _read("dmesg_T_oldkernel.log")
    assert len(r.claimed_lines) == 9  # the two indented continuation lines included
    x62 = next(e for e in r.events if e.get("xid") == 62)
    assert "PMU halt" in x62["msg"] and "pc 0x3fa1" in x62["msg"] and x62["time"] == "Tue Mar  5 09:10:00 2024"
    recv = next(e for e in r.events if e["type"] == "aer_received")
    assert recv["device"] == "0000:3b:00.0" and recv["class"] == "nonfatal"  # id=3b00 decoded
    aer = next(e for e in r.events if e["type"] == "aer")
    assert aer["bits"] == ["Completion Timeout"] and aer["vendor"] == "10de"


def test_conclusions_across_files():
    rep = analyze([str(FIX)])
    f = rep.findings
    # Xid 79 behind a Surprise Down on the upstream port: root cause 79, the AER named in the same finding
    x79 = _by_gpu(f, "0000:3b:00", "Xid 45x2, 79")[0]
    assert x79.severity == "critical" and x79.evidence["incidents"][0]["root_xid"] == 79
    assert "upstream port 0000:3a:00.0" in x79.summary and x79.evidence["pids"] == ["40230 (python)"]
    port = next(x for x in f if x.evidence.get("device") == "0000:3a:00.0")
    assert port.severity == "critical" and port.gpus == ["0000:3b:00"] and port.evidence["surprise_down"] == 1
    # app-level Xid 13 x2 + 43: a warning
    app = _by_gpu(f, "0000:86:00")[0]
    assert app.severity == "warning" and app.evidence["xid_counts"] == {"13": 2, "43": 1}
    # chains: 94 -> 45 (caused by previous Xid 94) -> 43, then a separate incident (Xid 63) hours later
    ch = _by_gpu(f, "0000:18:00")[0]
    assert [i["root_xid"] for i in ch.evidence["incidents"]] == [94, 63] and ch.hosts == ["gpu-node-07"]
    assert ch.evidence["incidents"][0]["xids"] == [94, 45, 43]
    # a 45 whose cause (Xid 119) happened before the log began: 119 named as root
    assert _by_gpu(f, "0000:2a:00")[0].evidence["incidents"][0]["root_xid"] == 119
    # DBE first on gpu-node-08
    dbe = _by_gpu(f, "0000:9a:00")[0]
    assert dbe.evidence["incidents"][0]["root_xid"] == 48 and dbe.evidence["xid_counts"]["79"] == 1
    # fallen off the bus without an Xid (the three-line NVRM message)
    off = [x for x in f if x.gpus == ["0000:c1:00"] and "fell off the bus" in x.summary][0]
    assert off.severity == "critical" and "no Xid 79" in off.summary and off.hosts == ["gpu-node-12"]
    # corrected AER: a burst of 12 on the GPU itself is a warning, a single one on a root port is info
    burst = next(x for x in f if x.evidence.get("device") == "0000:c1:00.0")
    assert burst.severity == "warning" and burst.evidence["corrected"] == 12
    assert burst.evidence["error_bits"] == {"BadTLP": 10, "RxErr": 1, "BadDLLP": 1}
    info = [x for x in f if x.severity == "info"]
    assert len(info) == 1 and "0000:00:03.1" in info[0].summary
    nonfatal = next(x for x in f if x.evidence.get("uncorrected_nonfatal"))
    assert nonfatal.severity == "warning" and nonfatal.gpus == ["0000:3b:00"]
    # Xid 31 (app) followed by 62/64 (hardware): critical, and the advice names the hardware Xid too
    old = [x for x in _by_gpu(f, "0000:3b:00", "Xid 31")][0]
    assert old.severity == "critical" and "Xid 62 followed" in old.recommendation
    assert rep.summaries["kernel"]["xid_lines"] == 18 and rep.summaries["kernel"]["aer_reports"] == 15


def test_xid_table_reuses_and_extends_the_live_check():
    from analyzers.checks.gpu_health import XID_MEANING

    assert set(XID_MEANING) <= set(kernel.XID_INFO)
    for c in (48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 143, 144, 150):
        assert kernel.severity(c) == "critical", c
    for c in (13, 31, 43, 45):
        assert kernel.severity(c) == "warning" and c in kernel.APP_LEVEL


_CORPUS = [p.read_bytes() for p in sorted(FIX.iterdir())]


@fuzz_settings(150)
@given(st.binary(max_size=3000))
def test_fuzz_random_bytes(data):
    if kernel.sniff(data):
        r = kernel.read(InputFile("x", data))
        if r is not None:
            kernel.conclude([r])


@fuzz_settings(150)
@given(st.integers(0, len(_CORPUS) - 1), st.integers(0, 5000), st.integers(0, 5000), st.binary(max_size=40))
def test_fuzz_cut_and_mutated_fixtures(i, a, b, junk):
    data = _CORPUS[i]
    a, b = sorted((a % (len(data) + 1), b % (len(data) + 1)))
    mutated = data[:a] + junk + data[b:]
    for d in (data[a:], mutated):
        r = kernel.read(InputFile("x", d))
        if r is not None:
            kernel.conclude([r, r])
            kernel.summarize([r])
