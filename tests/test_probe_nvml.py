"""The NVML probe: the real pynvml against the simulated NVML library, and its fallbacks.

Every test that loads a library into pynvml does it in a child process (tests/nvml_driver.py),
because a library loaded into pynvml cannot be unloaded from the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ranksight.simgpu import (
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    SimGpuState,
    state_path,
    write_state,
)

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "nvml_driver.py"


@pytest.fixture(scope="session")
def simnvml_lib(tmp_path_factory) -> Path:
    """The simulated NVML library, freshly built from probes/simnvml/simnvml.c with gcc."""
    from probes.simnvml_loader import SimNvmlError, build_simnvml

    dest = tmp_path_factory.mktemp("simnvml") / "libnvidia-ml.so.1"
    try:
        return build_simnvml(dest, force=True)
    except SimNvmlError as e:
        pytest.fail(f"cannot build the simulated NVML library (gcc is expected on this machine): {e}")


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "RANKSIGHT_SIMNVML_DIR",
                                                             "RANKSIGHT_SIMNVML_LIB")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class Driver:
    """A probe in a child process: send a command, get its JSON answer."""

    def __init__(self, cfg: dict, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, str(DRIVER), json.dumps(cfg)], cwd=REPO, env=_env(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"probe process died: {self.proc.stderr.read()}")
        return json.loads(line)

    def __call__(self, cmd: str):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        if self.proc.poll() is None:
            try:
                self("quit")
            finally:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
        err = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        assert "Traceback" not in err, err


@pytest.fixture
def drivers():
    started: list[Driver] = []

    def start(cfg: dict, env: dict | None = None) -> Driver:
        d = Driver(cfg, env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


def _by_gpu(samples):
    return {s["gpu"]: s for s in samples}


# --------------------------------------------------------------------------------------------
# simulated NVML through the real pynvml
# --------------------------------------------------------------------------------------------


def test_real_pynvml_runs_against_simulated_library(tmp_path, simnvml_lib, drivers):
    write_state(tmp_path, 0, SimGpuState())
    d = drivers({"sim_dir": str(tmp_path), "lib_path": str(simnvml_lib), "hide_real_nvml": True})
    assert d.info["mode"] == "simulated-nvml"
    assert d.info["status"].startswith("ok")
    info = d("pynvml")
    # the site-packages pynvml (nvidia-ml-py), with our library as its nvmlLib, mapped into the process
    assert info["pynvml_file"].endswith("site-packages/pynvml.py")
    assert info["lib_name"] == str(simnvml_lib)
    assert info["mapped"] == [str(simnvml_lib)]
    assert "simulated" in info["driver"]
    [s] = d("sample")
    assert s["source"] == "simulated-nvml" and s["simulated"] is True
    assert "Simulated" in s["name"]


def test_injected_thermal_throttle_is_seen(tmp_path, simnvml_lib, drivers):
    write_state(tmp_path, 0, SimGpuState(util_gpu=97, temp_c=70))
    write_state(tmp_path, 1, SimGpuState(util_gpu=96, temp_c=71))
    d = drivers({"sim_dir": str(tmp_path), "lib_path": str(simnvml_lib), "mode": "simulated-nvml"})

    before = _by_gpu(d("sample"))
    assert sorted(before) == [0, 1]
    assert before[1]["throttle_reasons"] == 0 and before[1]["throttle_names"] == []
    assert before[1]["sm_clock_mhz"] == 1980.0 and before[1]["max_sm_clock_mhz"] == 1980.0
    assert before[0]["util_pct"] == 97.0 and before[1]["temp_c"] == 71.0

    # the trainer's "throttle" fault on the rank that plays GPU 1
    write_state(tmp_path, 1, SimGpuState(util_gpu=96, temp_c=92, sm_clock_mhz=1095,
                                         throttle_reasons=THROTTLE_HW_THERMAL | THROTTLE_SW_POWER_CAP))
    after = _by_gpu(d("sample"))
    hot = after[1]
    assert hot["throttle_reasons"] == THROTTLE_HW_THERMAL | THROTTLE_SW_POWER_CAP
    assert hot["throttle_names"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert hot["sm_clock_mhz"] == 1095.0 and hot["max_sm_clock_mhz"] == 1980.0
    assert hot["temp_c"] == 92.0
    assert after[0]["throttle_reasons"] == 0 and after[0]["sm_clock_mhz"] == 1980.0

    # the fault ends: the next sample shows it
    write_state(tmp_path, 1, SimGpuState(util_gpu=96, temp_c=71))
    healed = _by_gpu(d("sample"))[1]
    assert healed["throttle_reasons"] == 0 and healed["sm_clock_mhz"] == 1980.0


def test_injected_xid_once_per_line_and_counted(tmp_path, simnvml_lib, drivers):
    write_state(tmp_path, 0, SimGpuState())
    write_state(tmp_path, 1, SimGpuState())
    d = drivers({"sim_dir": str(tmp_path), "lib_path": str(simnvml_lib), "mode": "simulated-nvml"})
    assert d("poll") == []

    write_state(tmp_path, 1, SimGpuState(xids=[(79, 1_700_000_000_123)]))
    events = d("poll")
    assert len(events) == 1
    ev = events[0]
    assert (ev["gpu"], ev["code"], ev["t"]) == (1, 79, 1_700_000_000.123)
    assert ev["source"] == "simulated-nvml" and ev["simulated"] is True
    assert d("poll") == []  # not repeated
    assert _by_gpu(d("sample"))[1]["xid_total"] == 1
    assert d("poll") == []

    # the same code again, later: a new event
    write_state(tmp_path, 1, SimGpuState(xids=[(79, 1_700_000_000_123), (79, 1_700_000_005_000)]))
    s = _by_gpu(d("sample"))  # sample() drains the event set too, so xid_total is current...
    assert s[1]["xid_total"] == 2 and s[0]["xid_total"] == 0
    events = d("poll")  # ...and the event is still handed out by the next poll, once
    assert [(e["gpu"], e["code"], e["t"]) for e in events] == [(1, 79, 1_700_000_005.0)]
    assert d("poll") == []


def test_optional_fields_none_until_the_device_has_them(tmp_path, simnvml_lib, drivers):
    write_state(tmp_path, 0, SimGpuState(ecc_sbe=3, ecc_dbe=1, retired_pages=2))
    d = drivers({"sim_dir": str(tmp_path), "lib_path": str(simnvml_lib), "mode": "simulated-nvml"})
    [s] = d("sample")
    assert (s["ecc_sbe"], s["ecc_dbe"], s["retired_pages"]) == (3, 1, 2)
    for field in ("remapped_rows", "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes_s", "nvlink_rx_bytes_s"):
        assert s[field] is None, field
    gaps = d("describe")["gaps"]
    assert gaps["gpu0.remapped_rows"] == "Not Supported"

    write_state(tmp_path, 0, SimGpuState(remapped_corr=4, remapped_unc=1, pcie_tx_kbs=2000, pcie_rx_kbs=500,
                                         nvlink_tx_kib=1000, nvlink_rx_kib=1000))
    [s] = d("sample")
    assert s["remapped_rows"] == 5
    assert (s["pcie_tx_bytes_s"], s["pcie_rx_bytes_s"]) == (2000 * 1024.0, 500 * 1024.0)
    assert s["nvlink_tx_bytes_s"] is None  # a rate needs two readings of the counter
    write_state(tmp_path, 0, SimGpuState(nvlink_tx_kib=5000, nvlink_rx_kib=1000))
    [s] = d("sample")
    assert s["nvlink_tx_bytes_s"] > 0 and s["nvlink_rx_bytes_s"] == 0.0
    assert s["remapped_rows"] is None and "gpu0.remapped_rows" in d("describe")["gaps"]


def test_device_count_follows_state_files(tmp_path, simnvml_lib, drivers):
    d = drivers({"sim_dir": str(tmp_path), "lib_path": str(simnvml_lib), "mode": "simulated-nvml"})
    assert d("sample") == []
    write_state(tmp_path, 0, SimGpuState())
    write_state(tmp_path, 2, SimGpuState())  # not consecutive: gpu-2 does not count without gpu-1
    assert [s["gpu"] for s in d("sample")] == [0]
    write_state(tmp_path, 1, SimGpuState(xids=[(48, 1000)]))
    assert [s["gpu"] for s in d("sample")] == [0, 1, 2]
    assert [(e["gpu"], e["code"]) for e in d("poll")] == [(1, 48)]  # new devices get registered for XIDs


def test_library_path_route_is_labelled_simulated(tmp_path, simnvml_lib, drivers):
    """pynvml's own CDLL("libnvidia-ml.so.1") finds the simulated library via LD_LIBRARY_PATH."""
    write_state(tmp_path, 0, SimGpuState(util_gpu=12))
    d = drivers({"mode": "nvml"},
                env={"LD_LIBRARY_PATH": str(simnvml_lib.parent), "RANKSIGHT_SIMNVML_DIR": str(tmp_path)})
    assert d.info["mode"] == "simulated-nvml"
    assert d("pynvml")["lib_name"] == "libnvidia-ml.so.1"
    [s] = d("sample")
    assert s["simulated"] is True and s["source"] == "simulated-nvml" and s["util_pct"] == 12.0


def test_simulated_library_behaves_like_nvml(tmp_path, simnvml_lib):
    """Error codes real NVML gives: missing dir -> DriverNotLoaded, unimplemented -> FunctionNotFound."""
    script = f"""
import ctypes, json, os, pynvml
pynvml.nvmlLib = ctypes.CDLL({str(simnvml_lib)!r})
out = {{}}
os.environ["RANKSIGHT_SIMNVML_DIR"] = {str(tmp_path / "missing")!r}
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as e:
    out["missing_dir"] = [type(e).__name__, str(e)]
os.environ["RANKSIGHT_SIMNVML_DIR"] = {str(tmp_path)!r}
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
for name, call in [("bar1", lambda: pynvml.nvmlDeviceGetBAR1MemoryInfo(h)),
                   ("video", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_VIDEO)),
                   ("index", lambda: pynvml.nvmlDeviceGetHandleByIndex(5))]:
    try:
        call(); out[name] = "no error"
    except pynvml.NVMLError as e:
        out[name] = type(e).__name__
m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
out["mem_v2"] = [m.total, m.used, m.free]
out["pci"] = pynvml.nvmlDeviceGetPciInfo(h).busId
es = pynvml.nvmlEventSetCreate()
try:
    pynvml.nvmlEventSetWait_v2(es, 0)
except pynvml.NVMLError as e:
    out["wait_empty"] = type(e).__name__
pynvml.nvmlEventSetFree(es)
pynvml.nvmlShutdown()
try:
    pynvml.nvmlDeviceGetCount()
except pynvml.NVMLError as e:
    out["after_shutdown"] = type(e).__name__
print(json.dumps(out))
"""
    write_state(tmp_path, 0, SimGpuState(mem_used=10, mem_total=100))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["missing_dir"] == ["NVMLError_DriverNotLoaded", "Driver Not Loaded"]
    assert out["bar1"] == "NVMLError_FunctionNotFound"
    assert out["video"] == "NVMLError_NotSupported"
    assert out["index"] == "NVMLError_InvalidArgument"
    assert out["mem_v2"] == [100, 10, 90]
    assert out["pci"] == "00000000:18:00.0"
    assert out["wait_empty"] == "NVMLError_Timeout"
    assert out["after_shutdown"] == "NVMLError_Uninitialized"


def test_garbage_state_file_reads_the_same_in_c_and_python(tmp_path, simnvml_lib, drivers):
    """Malformed lines keep defaults in both readers; no crash, identical samples."""
    node = tmp_path / "n"
    node.mkdir()
    state_path(node, 0).write_bytes(
        b"name=Simulated = odd name\nutil_gpu=abc\ntemp_c=-5\nsm_clock_mhz=1500\nthrottle_reasons=64\n"
        b"\xff\xfe garbage\nxid=notanumber:5\nxid=31:1700000001000\n=\nmem_used=18446744073709551615x\n"
        b"ecc_sbe=7\nunknown_key=3\npcie_tx_kbs=\n")
    c = drivers({"sim_dir": str(node), "lib_path": str(simnvml_lib), "mode": "simulated-nvml"})
    p = drivers({"sim_dir": str(node), "mode": "python-sim"})
    [cs], [ps] = c("sample"), p("sample")
    assert p.info["mode"] == "python-sim" and ps["source"] == "python-sim" and ps["simulated"] is True
    for key in ("source", "t"):
        cs.pop(key), ps.pop(key)
    assert cs == ps
    assert cs["name"] == "Simulated = odd name"
    assert (cs["util_pct"], cs["temp_c"], cs["sm_clock_mhz"], cs["ecc_sbe"]) == (0.0, 35.0, 1500.0, 7)
    assert cs["throttle_names"] == ["hw_thermal_slowdown"] and cs["pcie_tx_bytes_s"] is None
    assert [e["code"] for e in c("poll")] == [e["code"] for e in p("poll")] == [31]


# --------------------------------------------------------------------------------------------
# fallbacks
# --------------------------------------------------------------------------------------------


def test_missing_library_falls_back_to_python_sim(tmp_path, drivers):
    write_state(tmp_path, 0, SimGpuState(util_gpu=40))
    d = drivers({"sim_dir": str(tmp_path), "lib_path": str(tmp_path / "no-such-lib.so.1"), "hide_real_nvml": True})
    assert d.info["mode"] == "python-sim"
    assert any("not built" in why for why in d.info["selection"])
    assert any("NVML Shared Library Not Found" in why for why in d.info["selection"])
    [s] = d("sample")
    assert s["source"] == "python-sim" and s["simulated"] is True and s["util_pct"] == 40.0

    write_state(tmp_path, 0, SimGpuState(util_gpu=40, sm_clock_mhz=900, throttle_reasons=THROTTLE_HW_THERMAL,
                                         xids=[(79, 5000)]))
    [s] = d("sample")
    assert s["throttle_names"] == ["hw_thermal_slowdown"] and s["sm_clock_mhz"] == 900.0 and s["xid_total"] == 1
    assert [(e["code"], e["t"], e["source"]) for e in d("poll")] == [(79, 5.0, "python-sim")]
    assert d("poll") == []
    write_state(tmp_path, 0, SimGpuState(xids=[(79, 5000), (79, 9000)]))
    assert [e["t"] for e in d("poll")] == [9.0]
    assert d("sample")[0]["xid_total"] == 2


def test_nothing_at_all_gives_empty_with_status(tmp_path, drivers):
    d = drivers({"sim_dir": None, "hide_real_nvml": True})
    assert d.info["mode"] == "none"
    assert d.info["status"].startswith("no GPU data:")
    assert "NVML Shared Library Not Found" in d.info["status"]
    assert d("sample") == [] and d("poll") == []


def test_state_directory_appearing_later(tmp_path, simnvml_lib, drivers):
    """An agent may start before the trainer writes its GPU state: no crash, data once it exists."""
    later = tmp_path / "simgpu" / "node-0"
    d = drivers({"sim_dir": str(later), "lib_path": str(simnvml_lib), "hide_real_nvml": True, "retry_s": 0})
    assert d.info["mode"] == "simulated-nvml"
    assert d.info["status"].startswith("no GPU data:") and "Driver Not Loaded" in d.info["status"]
    assert d("sample") == []
    write_state(later, 0, SimGpuState(util_gpu=5))
    [s] = d("sample")
    assert s["util_pct"] == 5.0 and s["simulated"] is True
    assert d("describe")["status"].startswith("ok")

    py = drivers({"sim_dir": str(tmp_path / "nowhere"), "mode": "python-sim"})
    assert py("sample") == [] and py("describe")["status"].startswith("no GPU data:")


def test_one_simulated_directory_per_process(tmp_path, simnvml_lib):
    a, b = tmp_path / "a", tmp_path / "b"
    write_state(a, 0, SimGpuState(util_gpu=1))
    write_state(b, 0, SimGpuState(util_gpu=2))
    script = f"""
import json
from probes.nvml import NvmlProbe, build_gpu_probe
first = NvmlProbe(0, "h", {str(a)!r}, lib_path={str(simnvml_lib)!r})
second = NvmlProbe(1, "h", {str(b)!r}, lib_path={str(simnvml_lib)!r})
fallback = build_gpu_probe(1, "h", {str(b)!r}, lib_path={str(simnvml_lib)!r})
print(json.dumps({{"first": [s.util_pct for s in first.sample()], "second": second.sample(),
                  "second_status": second.status, "fallback": fallback.mode,
                  "fallback_util": [s.util_pct for s in fallback.sample()]}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["first"] == [1.0]
    assert out["second"] == [] and "already serves" in out["second_status"]
    # on a CPU machine the auto choice for the second node degrades to the Python simulator
    if out["fallback"] != "nvml":
        assert out["fallback"] == "python-sim" and out["fallback_util"] == [2.0]


def test_bad_mode_is_a_clear_error():
    from probes.nvml import build_gpu_probe

    with pytest.raises(ValueError, match="unknown GPU probe mode"):
        build_gpu_probe(0, "h", None, mode="cuda")
    with pytest.raises(ValueError, match="needs sim_dir"):
        build_gpu_probe(0, "h", None, mode="python-sim")
