"""The simulated GPU each rank plays on a machine without one (everything here is SIMULATED).

Once per step a rank writes the state its real activity implies: utilization from the
share of the step it spent computing, memory from its real memory use, power and
temperature from utilization. Faults change it: ``throttle`` lowers the SM clock by the
slowdown factor, sets HW thermal + SW power-cap throttle reasons and raises the
temperature; ``xid`` appends (code, unix_ms) to the XID list of the node's devices.
The device name and the manifest say "simulated".
"""

from __future__ import annotations

import time

from ranksight.layout import RunDir
from ranksight.simgpu import THROTTLE_HW_THERMAL, THROTTLE_SW_POWER_CAP, SimGpuState, write_state


class SimulatedGpu:
    def __init__(self, run: RunDir, node: int, local_rank: int, rank: int):
        self.node_dir = run.simgpu_node_dir(node)
        self.gpu = local_rank
        self.state = SimGpuState(
            name="RankSight Simulated GPU (CPU host, simulated)",
            uuid=f"GPU-5e5e{node:04x}-{local_rank:04x}-sim0-{rank:04x}-000000000000",
        )
        self.xids_done: set[int] = set()

    def update(self, step_ms: float, compute_ms: float, mem_bytes: int, faults) -> None:
        s = self.state
        util = 0 if step_ms <= 0 else max(0, min(100, round(100.0 * compute_ms / step_ms)))
        s.util_gpu = util
        s.util_mem = util // 2
        s.mem_used = min(mem_bytes, s.mem_total)
        s.power_mw = 70_000 + (s.power_limit_mw - 70_000) * util // 100
        s.temp_c = 35 + util * 35 // 100
        s.sm_clock_mhz, s.throttle_reasons = s.max_sm_clock_mhz, 0
        throttles = faults.mine("throttle") if faults is not None else []
        if throttles:
            factor = max(f.factor or 1.0 for f in throttles)
            s.sm_clock_mhz = int(s.max_sm_clock_mhz / factor)
            s.throttle_reasons = THROTTLE_HW_THERMAL | THROTTLE_SW_POWER_CAP
            s.temp_c = 91
            s.power_mw = s.power_limit_mw
        for i, f in enumerate(faults.specs if faults is not None else []):
            if f.kind == "xid" and f.node == faults.node and i not in self.xids_done and faults.step >= f.start:
                s.xids.append((int(f.code or 79), int(time.time() * 1000)))
                self.xids_done.add(i)
        write_state(self.node_dir, self.gpu, s)
