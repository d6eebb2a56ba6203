"""Pure-Python GPU simulator: the fallback when the simulated NVML library cannot be built.

It reads the very state files the C library (``probes/simnvml``) reads
(``<run>/simgpu/node-<N>/gpu-<I>.state``, format in ``ranksight.simgpu`` and
docs/probes-gpu-host.md) and yields the same :class:`~ranksight.schema.GpuSample`
fields with the same semantics, labelled ``source="python-sim"``, ``simulated=True``.
No pynvml and no shared library are involved, so this path proves nothing about NVML;
it exists so that a machine without gcc still shows the simulated GPUs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ranksight.schema import GpuSample, XidEvent
from ranksight.simgpu import SimGpuState, device_count, state_path, throttle_names

SOURCE = "python-sim"


class PythonSimGpuProbe:
    """Same interface as :class:`probes.nvml.NvmlProbe`: ``sample()``, ``poll_xids()``, ``status``, ``mode``."""

    mode = SOURCE
    source = SOURCE
    simulated = True

    def __init__(self, node: int, host: str, sim_dir: str | os.PathLike):
        self.node = int(node)
        self.host = str(host)
        self.sim_dir = Path(sim_dir)
        self.status = "starting"
        self.gaps: dict[str, str] = {}
        self._seen: dict[int, set[tuple[int, int]]] = {}
        self._xid_total: dict[int, int] = {}
        self._pending: list[XidEvent] = []
        self._nvlink_prev: dict[tuple[int, str], tuple[int, float]] = {}
        self._update_status(None)

    # -- public ---------------------------------------------------------------------------
    def sample(self) -> list[GpuSample]:
        t = time.time()
        states = self._read_all()
        out: list[GpuSample] = []
        for gpu, st in states:
            self._collect_xids(gpu, st)
            out.append(self._to_sample(gpu, st, t))
        return out

    def poll_xids(self) -> list[XidEvent]:
        for gpu, st in self._read_all():
            self._collect_xids(gpu, st)
        events, self._pending = self._pending, []
        return events

    def close(self) -> None:
        self.status = "closed"

    def describe(self) -> dict:
        return {"mode": self.mode, "status": self.status, "simulated": True, "sim_dir": str(self.sim_dir),
                "gaps": dict(self.gaps)}

    # -- internals ------------------------------------------------------------------------
    def _update_status(self, n: int | None) -> None:
        if not self.sim_dir.is_dir():
            self.status = f"no GPU data: simulated GPU state directory {self.sim_dir} does not exist (yet)"
        elif n is None:
            self.status = f"ok: python-sim reading {self.sim_dir}"
        elif n == 0:
            self.status = f"no GPU data: no gpu-0.state in {self.sim_dir} (yet)"
        else:
            self.status = f"ok: python-sim, {n} simulated GPU(s) from {self.sim_dir}"

    def _read_all(self) -> list[tuple[int, SimGpuState]]:
        if not self.sim_dir.is_dir():
            self._update_status(None)
            return []
        n = device_count(self.sim_dir)
        out = []
        for gpu in range(n):
            try:
                text = state_path(self.sim_dir, gpu).read_text(errors="replace")
            except OSError as e:  # vanished between the count and the read: skip this round
                self.gaps[f"gpu{gpu}"] = f"state file unreadable: {e}"
                continue
            self.gaps.pop(f"gpu{gpu}", None)
            out.append((gpu, SimGpuState.from_text(text)))
        self._update_status(n)
        return out

    def _collect_xids(self, gpu: int, st: SimGpuState) -> None:
        seen = self._seen.setdefault(gpu, set())
        for code, ms in st.xids:
            if (code, ms) in seen:
                continue
            seen.add((code, ms))
            self._xid_total[gpu] = self._xid_total.get(gpu, 0) + 1
            self._pending.append(XidEvent(node=self.node, host=self.host, gpu=gpu, t=ms / 1000.0 if ms else time.time(),
                                          code=code, source=SOURCE, simulated=True))

    def _nvlink_rate(self, gpu: int, direction: str, kib: int | None, t: float) -> float | None:
        if kib is None:
            return None
        prev = self._nvlink_prev.get((gpu, direction))
        self._nvlink_prev[(gpu, direction)] = (kib, t)
        if prev is None or t <= prev[1] or kib < prev[0]:
            return None
        return (kib - prev[0]) * 1024.0 / (t - prev[1])

    def _to_sample(self, gpu: int, st: SimGpuState, t: float) -> GpuSample:
        remapped = None
        if st.remapped_corr is not None or st.remapped_unc is not None:
            remapped = (st.remapped_corr or 0) + (st.remapped_unc or 0)
        return GpuSample(
            node=self.node, host=self.host, gpu=gpu, t=t, source=SOURCE, simulated=True,
            name=st.name, uuid=st.uuid,
            util_pct=float(min(st.util_gpu, 100)), mem_util_pct=float(min(st.util_mem, 100)),
            mem_used_bytes=min(st.mem_used, st.mem_total), mem_total_bytes=st.mem_total,
            power_w=st.power_mw / 1000.0, power_limit_w=st.power_limit_mw / 1000.0,
            temp_c=float(st.temp_c),
            sm_clock_mhz=float(st.sm_clock_mhz), mem_clock_mhz=float(st.mem_clock_mhz),
            max_sm_clock_mhz=float(st.max_sm_clock_mhz),
            throttle_reasons=st.throttle_reasons, throttle_names=throttle_names(st.throttle_reasons),
            ecc_sbe=st.ecc_sbe, ecc_dbe=st.ecc_dbe, retired_pages=st.retired_pages, remapped_rows=remapped,
            pcie_tx_bytes_s=None if st.pcie_tx_kbs is None else st.pcie_tx_kbs * 1024.0,
            pcie_rx_bytes_s=None if st.pcie_rx_kbs is None else st.pcie_rx_kbs * 1024.0,
            nvlink_tx_bytes_s=self._nvlink_rate(gpu, "tx", st.nvlink_tx_kib, t),
            nvlink_rx_bytes_s=self._nvlink_rate(gpu, "rx", st.nvlink_rx_kib, t),
            xid_total=self._xid_total.get(gpu, 0),
        )
