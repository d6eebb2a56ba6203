"""The simulated GPU each rank plays on a machine without one (everything here is SIMULATED).

A rank reports every step the state its real activity implies: utilization from the share of
the time it spent computing, memory from its real memory use, power and temperature from
utilization. Faults change it: ``throttle`` lowers the SM clock by the slowdown factor, sets HW
thermal + SW power-cap throttle reasons and raises the temperature; ``xid`` appends (code,
unix_ms) to the XID list of the node's devices. The device name and the manifest say "simulated".

The state file is rewritten at most every ``min_interval_s`` (1 s; readers, the simulated NVML
and its Python fallback, sample it once a second), and at once whenever a discrete part of the
state changes (clocks, throttle reasons, a new XID), so a fault shows on the very next sample.
Utilization covers every step since the previous write (compute time / step time summed), not
just the last step. ``flush()`` writes what is pending (the loop calls it after its last step).
"""

from __future__ import annotations

import time

from ranksight.layout import RunDir
from ranksight.simgpu import THROTTLE_HW_THERMAL, THROTTLE_SW_POWER_CAP, SimGpuState, write_state

MIN_INTERVAL_S = 1.0


class SimulatedGpu:
    def __init__(self, run: RunDir, node: int, local_rank: int, rank: int, min_interval_s: float = MIN_INTERVAL_S):
        self.node_dir = run.simgpu_node_dir(node)
        self.gpu = local_rank
        self.state = SimGpuState(
            name="RankSight Simulated GPU (CPU host, simulated)",
            uuid=f"GPU-5e5e{node:04x}-{local_rank:04x}-sim0-{rank:04x}-000000000000",
        )
        self.xids_done: set[int] = set()
        self.min_interval_s = min_interval_s
        self._last_write: float | None = None  # monotonic time of the last write
        self._step_ms = 0.0  # summed since the last write
        self._compute_ms = 0.0
        self._mem_bytes = 0
        self._pending = False
        self.writes = 0

    def _discrete(self) -> tuple:
        s = self.state
        return s.sm_clock_mhz, s.throttle_reasons, len(s.xids)

    def update(self, step_ms: float, compute_ms: float, mem_bytes: int, faults) -> None:
        self._step_ms += max(0.0, step_ms)
        self._compute_ms += max(0.0, compute_ms)
        self._mem_bytes = mem_bytes
        self._pending = True
        s = self.state
        before = self._discrete()
        s.sm_clock_mhz, s.throttle_reasons = s.max_sm_clock_mhz, 0
        throttles = faults.mine("throttle") if faults is not None else []
        if throttles:
            factor = max(f.factor or 1.0 for f in throttles)
            s.sm_clock_mhz = int(s.max_sm_clock_mhz / factor)
            s.throttle_reasons = THROTTLE_HW_THERMAL | THROTTLE_SW_POWER_CAP
        for i, f in enumerate(faults.specs if faults is not None else []):
            if f.kind == "xid" and f.node == faults.node and i not in self.xids_done and faults.step >= f.start:
                s.xids.append((int(f.code or 79), int(time.time() * 1000)))
                self.xids_done.add(i)
        now = time.monotonic()
        if (self._last_write is None or self._discrete() != before
                or now - self._last_write >= self.min_interval_s):
            self._write(now)

    def flush(self) -> None:
        if self._pending:
            self._write(time.monotonic())

    def _write(self, now: float) -> None:
        s = self.state
        util = 0 if self._step_ms <= 0 else max(0, min(100, round(100.0 * self._compute_ms / self._step_ms)))
        s.util_gpu = util
        s.util_mem = util // 2
        s.mem_used = min(self._mem_bytes, s.mem_total)
        s.power_mw = 70_000 + (s.power_limit_mw - 70_000) * util // 100
        s.temp_c = 35 + util * 35 // 100
        if s.throttle_reasons:  # throttle: hot and at its power cap
            s.temp_c = 91
            s.power_mw = s.power_limit_mw
        write_state(self.node_dir, self.gpu, s)
        self._step_ms = self._compute_ms = 0.0
        self._pending = False
        self._last_write = now
        self.writes += 1
