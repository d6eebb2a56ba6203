"""nvidia-smi -q (both reason namings, old and new ECC layouts, several snapshots) and dmon (columns by header);
dcgm-exporter text dumps (MIG de-duplicated, GPUs counted per metric, no samples is not healthy, a startup log
before the metrics); numbers asserted."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from logs import analyze
from logs.inputs import InputFile
from logs.readers import nvidia_smi
from fuzz_settings import fuzz_settings

FIX = Path(__file__).parent / "fixtures" / "logs" / "nvidia_smi"


def _read(name: str):
    p = FIX / name
    return nvidia_smi.read(InputFile(str(p), p.read_bytes()))


def test_sniff():
    assert all(nvidia_smi.sniff(p.read_bytes()) for p in FIX.glob("node*"))
    assert not nvidia_smi.sniff(b"NCCL INFO ring 0\n# a comment\n")


def test_smi_q_535_two_snapshots():
    r = _read("node07-smi-q-535.txt")
    q = [e for e in r.events if e["type"] == "smi_q"]
    assert len(q) == 4 and r.summary["snapshots"] == 2 and r.summary["driver"] == "535.129.03"
    g0 = q[2]
    assert g0["gpu"] == "0000:18:00.0" and g0["time"] == "Tue Mar  5 10:22:23 2024" and g0["snapshot"] == 2
    assert g0["reasons"] == ["SW Power Cap"] and g0["reason_seconds"]["SW Power Capping"] == 184.0
    assert (g0["power"], g0["power_limit"], g0["sm_clock"], g0["sm_max"]) == (699.5, 700.0, 1410, 1980)
    assert (g0["temp"], g0["temp_slowdown"], g0["temp_shutdown"]) == (84, 87, 92)
    assert g0["ecc_volatile_correctable"] == 2 and g0["ecc_aggregate_correctable"] == 5
    g1 = q[3]
    assert g1["gen_cur"] == 1 and g1["gen_max"] == 5 and g1["pstate"] == "P8" and g1["reasons"] == ["Idle"]
    assert r.summary["host"] == "node07-smi-q-535"


def test_smi_q_470_old_names():
    r = _read("node03-smi-q-470.txt")
    g = r.events[0]
    assert g["reasons"] == [] and g["gen_cur"] == 1 and g["width_cur"] == 8 and g["width_max"] == 16
    assert g["ecc_volatile_correctable"] == 1 and g["ecc_aggregate_correctable"] == 3  # Totals, not doubled
    assert g["power"] == 310.0 and g["power_limit"] == 400.0  # "Power Readings" / "Power Draw" / "Power Limit"
    assert g["remap_pending"] and g["remap_uncorrectable"] == 1


def test_dmon_by_header_with_date_time_and_junk():
    r = _read("node05-dmon.txt")
    rows = [e for e in r.events if e["type"] == "dmon"]
    assert len(rows) == 7  # the truncated last row is not a row
    assert rows[0]["pviol"] == 35 and rows[0]["pclk"] == 1410 and rows[0]["date"] == "20240305"
    assert rows[0]["line"] == 4 and rows[5]["pwr"] is None  # "-" is no value
    assert len(r.claimed_lines) == 9
    plain = _read("node06-dmon-plain.txt")
    assert len(plain.events) == 4 and plain.events[0]["gtemp"] == 55 and "pviol" not in plain.events[0]


def test_conclusions():
    # the nvidia-smi files only (dcgm/ holds the dcgm-exporter dumps, with their own test)
    f = [x for x in analyze([str(FIX)]).findings if x.analyzer == "logs.nvidia_smi"]
    by = {x.summary.split(":")[0]: x for x in f}
    thr = next(x for x in f if "clock-lowering" in x.summary)
    assert thr.severity == "warning" and thr.gpus == ["0000:18:00.0"] and thr.hosts == ["node07-smi-q-535"]
    ev = thr.evidence["gpus"][0]
    assert ev["snapshots"] == 2 and ev["counter_seconds"] == {"SW Power Capping": 184.0} and ev["power_w"] == 699.5
    down = next(x for x in f if "downgraded PCIe" in x.summary)
    assert down.severity == "warning" and "Gen1 x8 of Gen4 x16 at 91%" in down.summary
    idle = next(x for x in f if "power saving" in x.summary)
    assert idle.severity == "info" and idle.gpus == ["0000:2a:00.0"] and "Gen1 of Gen5 at 0% (P8)" in idle.summary
    hot = next(x for x in f if "slowdown temperature" in x.summary)
    assert hot.severity == "warning" and hot.evidence["gpus"][0]["temp_c"] == 84
    mem = next(x for x in f if "memory errors" in x.summary)
    assert mem.severity == "warning" and mem.evidence["gpus"][0]["remap_pending"] is True
    dm = next(x for x in f if x.summary.startswith("nvidia-smi dmon: 1 of 4"))
    assert dm.evidence["gpus"][0]["power_violation_samples"] == 3 and dm.evidence["gpus"][0]["samples"] == 4
    assert not any(x.severity == "critical" for x in f) and by


def test_healthy_fleet_is_info():
    f = analyze([str(FIX / "node11-smi-q-healthy.txt"), str(FIX / "node06-dmon-plain.txt")]).findings
    assert [x.severity for x in f] == ["info", "info"]
    q = next(x for x in f if "healthy" in x.summary)
    assert q.summary.startswith("4 GPUs on 1 host(s)") and q.evidence["max_temp_c"] == 55
    d = next(x for x in f if "dmon" in x.summary)
    assert "2 GPUs, 4 samples" in d.summary


_CORPUS = [p.read_bytes() for p in sorted(FIX.iterdir()) if p.is_file()]


@fuzz_settings(150)
@given(st.binary(max_size=3000))
def test_fuzz_random_bytes(data):
    if nvidia_smi.sniff(data):
        r = nvidia_smi.read(InputFile("x", data))
        if r is not None:
            nvidia_smi.conclude([r])


@fuzz_settings(100)
@given(st.integers(0, 10_000), st.integers(0, 20_000), st.integers(0, 20_000), st.binary(max_size=40))
def test_fuzz_cut_and_mutated_fixtures(i, a, b, junk):
    data = _CORPUS[i % len(_CORPUS)]
    a, b = sorted((a % (len(data) + 1), b % (len(data) + 1)))
    for d in (data[a:], data[:a] + junk + data[b:]):
        r = nvidia_smi.read(InputFile("x", d))
        if r is not None:
            nvidia_smi.conclude([r, r])
            nvidia_smi.summarize([r])
