"""dcgm-exporter text dumps (reader ``dcgm``): startup log then metrics in one file, MIG instances counted under
their GPU, GPUs counted per metric (per host), no samples is not healthy, Xid/throttle/healthy; numbers asserted."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from logs.inputs import InputFile
from logs.readers import dcgm_dump
from fuzz_settings import fuzz_settings

FIX = Path(__file__).parent / "fixtures" / "logs" / "nvidia_smi" / "dcgm"
A, B = FIX / "gpu-node-21-metrics.txt", FIX / "gpu-node-22-metrics-old.txt"


def _read(p: Path):
    return dcgm_dump.read(InputFile(str(p), p.read_bytes()))


def test_read_sections_and_mig():
    r = _read(A)
    assert r.summary["exporter_version"] == "3.3.5-3.4.0" and r.summary["gpus"] == 4  # 2 MIG instances: not GPUs
    assert r.summary["hosts"] == ["gpu-node-21"] and r.summary["series"] == 29
    assert len(r.claimed_lines) == 49  # all but the "$ curl" line
    d = r.events[0]
    assert d["gpus"]["gpu-node-21|GPU-11aa11bb-0000-4000-8000-000000000001"]["mig"] == ["1:3g.40gb", "2:3g.40gb"]
    assert d["families"]["DCGM_FI_DEV_GPU_TEMP"]["gpus"] == 3
    assert d["startup_problems"][0]["line"] == 3 and d["startup_problems"][0]["level"] == "warn"
    old = _read(B)
    assert old.summary["hosts"] == ["gpu-node-22"] and old.summary["gpus"] == 2  # the older "Hostname" label


def test_conclusions():
    f = dcgm_dump.conclude([_read(A), _read(B)])
    by = {x.summary.split(":")[1].split()[1] if ":" in x.summary else x.summary: x for x in f}
    empty = next(x for x in f if "no samples" in x.summary)
    assert empty.severity == "warning" and empty.evidence["no_samples"] == ["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"]
    miss = next(x for x in f if "missing for some GPUs" in x.summary)
    assert list(miss.evidence["missing"]) == ["DCGM_FI_DEV_GPU_TEMP"]  # per host: node-22 has fewer
    assert "reported for 5 of 6 GPUs" in miss.summary and miss.hosts == ["gpu-node-21"]
    xid = next(x for x in f if "Xid" in x.summary)
    assert xid.severity == "critical" and list(xid.evidence["gpus"].values())[0]["xid"] == 79
    thr = next(x for x in f if "clock event reason" in x.summary)
    assert "sw_power_cap, power 42 s" in thr.summary and "1 of 6 GPUs" in thr.summary  # idle (gpu 1, mask 1) ignored
    assert any("logged 1 warning/error" in x.summary for x in f)
    assert not any(x.severity == "info" for x in f) and by


def test_healthy_is_info_and_no_samples_is_not():
    f = dcgm_dump.conclude([_read(B)])
    assert [x.severity for x in f] == ["info"] and "2 GPUs on 1 host(s) report all 6 metric families" in f[0].summary
    text = B.read_bytes() + b"# HELP DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL x\n" \
                            b"# TYPE DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL counter\n"
    f = dcgm_dump.conclude([dcgm_dump.read(InputFile("b", text))])
    assert [x.severity for x in f] == ["warning"] and "no samples" in f[0].summary


_CORPUS = [A.read_bytes(), B.read_bytes()]


@fuzz_settings(150)
@given(st.binary(max_size=3000))
def test_fuzz_random_bytes(data):
    r = dcgm_dump.read(InputFile("x", b"DCGM_FI_DEV_GPU_TEMP{" + data))
    if r is not None:
        dcgm_dump.conclude([r])


@fuzz_settings(100)
@given(st.integers(0, 1), st.integers(0, 5000), st.integers(0, 5000), st.binary(max_size=40))
def test_fuzz_cut_and_mutated(i, a, b, junk):
    data = _CORPUS[i]
    a, b = sorted((a % (len(data) + 1), b % (len(data) + 1)))
    for d in (data[a:], data[:a] + junk + data[b:]):
        r = dcgm_dump.read(InputFile("x", d))
        if r is not None:
            dcgm_dump.conclude([r, r])
            dcgm_dump.summarize([r])
