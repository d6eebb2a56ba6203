"""probes.dcgm: dcgm-exporter /metrics -> GpuSample / XidEvent, XIDs counted by transitions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from werkzeug.wrappers import Response

from conftest import free_port
from probes.dcgm import DcgmProbe, parse_exposition

FIX = Path(__file__).parent / "fixtures" / "dcgm"
BASE = (FIX / "scrape1.prom").read_text()
MIB = 1024 * 1024


class Exporter:
    """A fake dcgm-exporter: serves whatever text the test sets, as the real one would."""

    def __init__(self, httpserver):
        self.text = BASE
        self.status = 200
        self.hits = 0
        httpserver.expect_request("/metrics").respond_with_handler(self._handle)
        self.url = httpserver.url_for("/metrics")

    def _handle(self, request):
        self.hits += 1
        return Response(self.text, status=self.status, content_type="text/plain; version=0.0.4")

    def set_xid(self, gpu: int, code: int, msg: str) -> None:
        """Rewrite one GPU's DCGM_FI_DEV_XID_ERRORS line (value and err_code/err_msg labels)."""
        pat = re.compile(r'^(DCGM_FI_DEV_XID_ERRORS\{gpu="%d",.*?),err_code="[^"]*",err_msg="[^"]*"\} \S+$' % gpu, re.M)
        self.text, n = pat.subn(lambda m: f'{m.group(1)},err_code="{code}",err_msg="{msg}"}} {code}', self.text)
        assert n == 1


@pytest.fixture
def exporter(httpserver):
    return Exporter(httpserver)


def test_fields_are_mapped(exporter):
    p = DcgmProbe(exporter.url, node=3, host="fallback")
    samples = p.sample()
    assert p.errors == 0 and p.last_error is None
    assert [s.gpu for s in samples] == [0, 1]
    g0, g1 = samples
    assert (g0.source, g0.simulated, g0.node, g0.host) == ("dcgm", False, 3, "node-07")
    assert g0.name == "NVIDIA H100 80GB HBM3" and g0.uuid.startswith("GPU-5d5e")
    assert g0.util_pct == 97 and g0.mem_util_pct == 41
    assert g0.mem_used_bytes == 79000 * MIB and g0.mem_total_bytes == (79000 + 1024 + 535) * MIB
    assert (g0.power_w, g0.temp_c, g0.sm_clock_mhz, g0.mem_clock_mhz) == (512.25, 61, 1980, 2619)
    assert (g0.ecc_sbe, g0.ecc_dbe, g0.retired_pages, g0.remapped_rows) == (3, 0, 3, 4)
    assert (g0.pcie_tx_bytes_s, g0.pcie_rx_bytes_s) == (123456789, 987654321)
    assert g0.throttle_reasons == 0 and g0.throttle_names == []
    # GPU 1: thermal throttling (0x20 sw thermal + 0x40 hw thermal), older PCIe field in KB/s.
    assert g1.throttle_reasons == 96
    assert g1.throttle_names == ["sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert g1.pcie_tx_bytes_s == 2000 * 1024 and g1.retired_pages is None
    assert (g1.ecc_dbe, g1.remapped_rows) == (1, 3)


def test_xid_gauge_counts_transitions_not_values(exporter):
    p = DcgmProbe(exporter.url)
    # First scrape = baseline: GPU 1 already shows XID 48 (from before we started): not new.
    assert p.sample() and p.poll_xids() == []
    # Same gauge again (it never resets): still nothing.
    p.sample()
    assert p.poll_xids() == []
    exporter.set_xid(0, 79, "GPU has fallen off the bus")
    s = p.sample()
    x = p.poll_xids()
    assert [(e.gpu, e.code, e.source, e.simulated) for e in x] == [(0, 79, "dcgm", False)]
    assert {g.gpu: g.xid_total for g in s} == {0: 1, 1: 0}
    for _ in range(3):  # the gauge keeps holding 79: no new XID
        p.sample()
    assert p.poll_xids() == []
    exporter.set_xid(0, 13, "Graphics Engine Exception")
    exporter.set_xid(1, 31, "GPU memory page fault")
    s = p.sample()
    assert sorted((e.gpu, e.code) for e in p.poll_xids()) == [(0, 13), (1, 31)]
    assert {g.gpu: g.xid_total for g in s} == {0: 2, 1: 1}
    # A label change with the same value (err_msg update) is a new event too.
    exporter.set_xid(1, 31, "GPU memory page fault (MMU)")
    p.sample()
    assert [(e.gpu, e.code) for e in p.poll_xids()] == [(1, 31)]


def test_existing_xid_reported_when_asked(exporter):
    p = DcgmProbe(exporter.url, report_existing_xids=True)
    p.sample()
    assert [(e.gpu, e.code) for e in p.poll_xids()] == [(1, 48)]
    p.sample()
    assert p.poll_xids() == []


def _with_counts(text: str, counts: dict[int, int]) -> str:
    lines = ["# HELP DCGM_EXP_XID_ERRORS_COUNT Count of XID Errors within user-specified time window (see xid-count-window-size flag).",
             "# TYPE DCGM_EXP_XID_ERRORS_COUNT gauge"]
    for code, n in counts.items():
        lines.append(f'DCGM_EXP_XID_ERRORS_COUNT{{gpu="0",UUID="GPU-5d5e1a2b-0000-1111-2222-333344445555",'
                     f'pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",'
                     f'Hostname="node-07",window_size_in_ms="300000",xid="{code}"}} {n}')
    return text + "\n".join(lines) + "\n"


def test_xid_count_metric_sees_repeats_of_the_same_code(exporter):
    p = DcgmProbe(exporter.url)
    exporter.text = _with_counts(BASE, {31: 1})
    p.sample()
    assert p.poll_xids() == []  # baseline
    # Two more XID 31 arrive: the last-value gauge could not tell (31 -> 31), the count can.
    exporter.set_xid(0, 31, "GPU memory page fault")
    exporter.text = _with_counts(BASE.replace(
        'err_code="0",err_msg="No Error"} 0', 'err_code="31",err_msg="GPU memory page fault"} 31'), {31: 3})
    p.sample()
    assert [(e.gpu, e.code) for e in p.poll_xids()] == [(0, 31), (0, 31)]
    p.sample()
    assert p.poll_xids() == []
    # The window slides: the count falls to 0 (no event), then a new one arrives.
    exporter.text = _with_counts(BASE, {31: 0})
    p.sample()
    assert p.poll_xids() == []
    exporter.text = _with_counts(BASE, {31: 1, 43: 1})
    s = p.sample()
    assert sorted(e.code for e in p.poll_xids()) == [31, 43]
    assert next(g for g in s if g.gpu == 0).xid_total == 4


def test_unreachable_endpoint_is_a_gap_not_an_exception():
    p = DcgmProbe(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=1.0)
    assert p.sample() == []
    r = p.scrape()
    assert r.samples == [] and r.error
    assert p.errors == 2 and p.last_error and "scrape" in p.gaps
    assert p.poll_xids() == []


@pytest.mark.parametrize("body,status", [
    ("<html><body>502 Bad Gateway</body></html>\x00\xff{{{", 200),
    ("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\" 97\n", 200),
    ("", 200),
    (BASE, 500),
])
def test_garbage_or_http_errors_are_gaps_and_keep_xid_state(exporter, body, status):
    p = DcgmProbe(exporter.url)
    p.sample()  # baseline with GPU 1 at XID 48
    exporter.text, exporter.status = body, status
    assert p.sample() == []
    assert p.errors == 1 and p.last_error
    if status == 500:
        assert "500" in p.last_error
    # Back to normal: the baseline survived the gap, so the old XID 48 is not reported again...
    exporter.text, exporter.status = BASE, 200
    assert len(p.sample()) == 2 and p.poll_xids() == []
    assert p.last_error is None and "scrape" not in p.gaps
    # ...and a real change after the gap is.
    exporter.set_xid(1, 94, "Contained ECC error")
    p.sample()
    assert [(e.gpu, e.code) for e in p.poll_xids()] == [(1, 94)]


def test_nvlink_counter_rate_uses_the_scrape_clock(exporter):
    now = [100.0]
    p = DcgmProbe(exporter.url, clock=lambda: now[0])
    r1 = p.scrape()
    assert r1.extra[0]["nvlink_bandwidth_total"] == 1_000_000 and "nvlink_bandwidth_total_per_s" not in r1.extra[0]
    now[0] = 110.0
    exporter.text = exporter.text.replace("} 1000000\n", "} 1500000\n")
    r2 = p.scrape()
    assert r2.extra[0]["nvlink_bandwidth_total_per_s"] == pytest.approx(50_000.0)
    assert r2.extra[0]["driver_version"] == "550.90.07"
    assert all(s.t == 110.0 for s in r2.samples)


def test_parse_exposition_skips_mig_and_non_dcgm_series():
    text = BASE + (
        '# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-5d5e1a2b-0000-1111-2222-333344445555",GPU_I_ID="1",GPU_I_PROFILE="1g.10gb"} 5\n'
        '# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n'
    )
    gpus = parse_exposition(text)
    assert len(gpus) == 2
    g0 = gpus["GPU-5d5e1a2b-0000-1111-2222-333344445555"]
    assert g0["values"]["DCGM_FI_DEV_GPU_UTIL"] == 97
    with pytest.raises(ValueError):
        parse_exposition("this is { not prometheus")
