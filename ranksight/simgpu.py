"""State of a simulated GPU, for machines without one.

On a CPU machine each training rank plays "its" GPU: it writes the device state
that its real activity and the injected faults imply (utilization while it
computes, lower clocks and throttle reasons under a ``throttle`` fault, an XID
under an ``xid`` fault). The simulated NVML library (``probes/simnvml``, a C
shared object loaded by the real pynvml) and the pure-Python fallback read it.

The format is deliberately trivial so C can parse it with ``sscanf``: one
``key=value`` per line, integers only, one file per device:
``<run>/simgpu/node-<N>/gpu-<I>.state``. XID events are repeated ``xid=<code>:<unix_ms>``
lines; the reader reports each (code, time) pair once.

Everything read from these files is labelled ``simulated`` downstream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from ranksight.layout import atomic_write

# NVML clocksThrottleReasons bits (nvml.h, nvmlClocksEventReason*).
THROTTLE_GPU_IDLE = 0x1
THROTTLE_APP_CLOCKS = 0x2
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SYNC_BOOST = 0x10
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
THROTTLE_DISPLAY_CLOCKS = 0x100
THROTTLE_BOARD_LIMIT = 0x200
THROTTLE_RELIABILITY = 0x400

THROTTLE_NAMES = {
    THROTTLE_GPU_IDLE: "gpu_idle",
    THROTTLE_APP_CLOCKS: "applications_clocks_setting",
    THROTTLE_SW_POWER_CAP: "sw_power_cap",
    THROTTLE_HW_SLOWDOWN: "hw_slowdown",
    THROTTLE_SYNC_BOOST: "sync_boost",
    THROTTLE_SW_THERMAL: "sw_thermal_slowdown",
    THROTTLE_HW_THERMAL: "hw_thermal_slowdown",
    THROTTLE_HW_POWER_BRAKE: "hw_power_brake_slowdown",
    THROTTLE_DISPLAY_CLOCKS: "display_clock_setting",
    THROTTLE_BOARD_LIMIT: "board_limit",
    THROTTLE_RELIABILITY: "reliability",
}

# Reasons that mean "the GPU is slower than it should be" (idle and app clocks are benign).
THROTTLE_HARMFUL = (
    THROTTLE_SW_POWER_CAP | THROTTLE_HW_SLOWDOWN | THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE
)


# Optional integer keys of a state file (see SimGpuState); readers treat a missing key as "not supported".
OPTIONAL_KEYS = (
    "pcie_tx_kbs", "pcie_rx_kbs", "nvlink_tx_kib", "nvlink_rx_kib",
    "remapped_corr", "remapped_unc", "remapped_pending", "remapped_failure",
)


def throttle_names(mask: int) -> list[str]:
    """Names of the set reason bits, in bit order; bits NVML has not named here appear as ``0x...``. NVML's mask is an
    unsigned 64-bit value: anything else (a negative number from a bad record) is read as its low 64 bits."""
    mask = int(mask) & 0xFFFF_FFFF_FFFF_FFFF  # a negative int has infinitely many set bits: the loop would not end
    names = [name for bit, name in THROTTLE_NAMES.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_NAMES)
    bit = 1
    while unknown:
        if unknown & bit:
            names.append(hex(bit))
            unknown &= ~bit
        bit <<= 1
    return names


@dataclass
class SimGpuState:
    """One simulated device. Defaults describe an idle, healthy, H100-like GPU."""

    name: str = "RankSight Simulated GPU (CPU host)"
    uuid: str = "GPU-00000000-sim0-0000-0000-000000000000"
    util_gpu: int = 0  # percent
    util_mem: int = 0  # percent
    mem_used: int = 0  # bytes
    mem_total: int = 80 * 1024**3
    power_mw: int = 70_000
    power_limit_mw: int = 700_000
    temp_c: int = 35
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    max_sm_clock_mhz: int = 1980
    max_mem_clock_mhz: int = 2619
    throttle_reasons: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    retired_pages: int = 0
    xids: list[tuple[int, int]] = field(default_factory=list)  # (code, unix_ms)
    # Optional keys (written only when set). Absent -> the simulated NVML answers
    # NVML_ERROR_NOT_SUPPORTED for that query, like a device without the feature.
    pcie_tx_kbs: int | None = None  # PCIe throughput, KB/s (nvmlDeviceGetPcieThroughput)
    pcie_rx_kbs: int | None = None
    nvlink_tx_kib: int | None = None  # cumulative NVLink data KiB over all links (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)
    nvlink_rx_kib: int | None = None
    remapped_corr: int | None = None  # rows remapped for correctable / uncorrectable errors (nvmlDeviceGetRemappedRows)
    remapped_unc: int | None = None
    remapped_pending: int | None = None  # 0/1
    remapped_failure: int | None = None  # 0/1

    def to_text(self) -> str:
        lines = [f"name={self.name}", f"uuid={self.uuid}"]
        for key in (
            "util_gpu", "util_mem", "mem_used", "mem_total", "power_mw", "power_limit_mw", "temp_c",
            "sm_clock_mhz", "mem_clock_mhz", "max_sm_clock_mhz", "max_mem_clock_mhz", "throttle_reasons",
            "ecc_sbe", "ecc_dbe", "retired_pages",
        ):
            lines.append(f"{key}={int(getattr(self, key))}")
        for key in OPTIONAL_KEYS:
            value = getattr(self, key)
            if value is not None:
                lines.append(f"{key}={int(value)}")
        lines.extend(f"xid={code}:{ms}" for code, ms in self.xids)
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "SimGpuState":
        state = cls()
        for raw in text.splitlines():
            key, sep, value = raw.partition("=")
            if not sep:
                continue
            key, value = key.strip(), value.strip()
            if key in ("name", "uuid"):
                setattr(state, key, value)
            elif key == "xid":
                code, _, ms = value.partition(":")
                try:
                    state.xids.append((int(code), int(ms or 0)))
                except ValueError:
                    continue
            elif key in _INT_KEYS:
                # Non-negative integers only, as the C reader (probes/simnvml) accepts them;
                # anything else keeps the default.
                if value.isascii() and value.isdigit():
                    setattr(state, key, int(value))
        return state


_INT_KEYS = frozenset(f.name for f in fields(SimGpuState)) - {"name", "uuid", "xids"}


def state_path(node_dir: Path, gpu: int) -> Path:
    return Path(node_dir) / f"gpu-{gpu}.state"


def write_state(node_dir: str | os.PathLike, gpu: int, state: SimGpuState) -> None:
    """Atomically replace one device's state file (readers never see half a file).

    Not fsynced: ranks rewrite it every step, and after a crash the next step rewrites it anyway.
    """
    atomic_write(state_path(Path(node_dir), gpu), state.to_text().encode(), durable=False)


def read_state(node_dir: str | os.PathLike, gpu: int) -> SimGpuState | None:
    try:
        return SimGpuState.from_text(state_path(Path(node_dir), gpu).read_text())
    except FileNotFoundError:
        return None


def device_count(node_dir: str | os.PathLike) -> int:
    """Devices are numbered 0..n-1 by their files."""
    n = 0
    while state_path(Path(node_dir), n).exists():
        n += 1
    return n
