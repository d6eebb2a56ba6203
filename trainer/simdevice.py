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
just the last step. ``flush()`` writes what is pending (the loop calls it after its last step)
and waits until it is on disk.

The file is written by a daemon thread, not the training thread: replacing a file by rename can take
milliseconds (renaming over an existing file makes ext4 start writing the new one's data back), which
the training step would pay.
The training thread only renders the state's text; the thread writes the latest text it was given.
"""

from __future__ import annotations

import os
import threading
import time

from ranksight.layout import RunDir
from ranksight.simgpu import SimGpuState, state_path

MIN_INTERVAL_S = 1.0


class StateFileWriter:
    """Atomically replaces one state file from a daemon thread; ``submit`` never blocks on the file system.

    Only the newest text matters (each is a whole state), so a text not yet written when a newer one
    arrives is replaced by it. Same atomicity as ``ranksight.layout.atomic_write`` (a temporary file in
    the same directory, then a rename), without the fsync (``durable=False``, as ``write_state``)."""

    def __init__(self, path):
        self.path = str(path)
        d, name = os.path.split(self.path)
        os.makedirs(d, exist_ok=True)
        self.tmp = os.path.join(d, f".{name}.tmp.{os.getpid()}")
        self._cv = threading.Condition()
        self._next: bytes | None = None  # newest text not yet taken by the thread
        self._busy = False  # the thread is writing
        self._thread: threading.Thread | None = None

    def submit(self, data: bytes) -> None:
        with self._cv:
            self._next = data
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ranksight-simgpu", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait(self, timeout: float = 10.0) -> bool:
        """Until everything submitted is written (True), or ``timeout`` seconds."""
        with self._cv:
            return self._cv.wait_for(lambda: self._next is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._next is not None)
                data, self._next, self._busy = self._next, None, True
            try:
                fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.replace(self.tmp, self.path)
            except OSError:
                pass  # the state is advisory (readers keep the last one); the next write tries again
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


class SimulatedGpu:
    def __init__(self, run: RunDir, node: int, local_rank: int, rank: int, min_interval_s: float = MIN_INTERVAL_S):
        self.node_dir = run.simgpu_node_dir(node)
        self.gpu = local_rank
        self.state = SimGpuState(
            name="RankSight Simulated GPU (CPU host, simulated)",
            uuid=f"GPU-5e5e{node:04x}-{local_rank:04x}-sim0-{rank:04x}-000000000000",
        )
        self.file = StateFileWriter(state_path(self.node_dir, local_rank))
        self.min_interval_s = min_interval_s
        self._last_write: float | None = None  # monotonic time of the last write
        self._step_ms = 0.0  # summed since the last write
        self._compute_ms = 0.0
        self._mem_bytes = 0
        self._pending = False
        self.writes = 0  # states handed to the writer thread

    def update(self, step_ms: float, compute_ms: float, mem_bytes: int, faults) -> None:
        self._step_ms += max(0.0, step_ms)
        self._compute_ms += max(0.0, compute_ms)
        self._mem_bytes = mem_bytes
        self._pending = True
        changed = faults is not None and faults.simulated_device(self.state)
        now = time.monotonic()
        if self._last_write is None or changed or now - self._last_write >= self.min_interval_s:
            self._write(now)

    def flush(self) -> None:
        """Write what is pending and wait until the file has it."""
        if self._pending:
            self._write(time.monotonic())
        self.file.wait()

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
        self.file.submit(s.to_text().encode())
        self._step_ms = self._compute_ms = 0.0
        self._pending = False
        self._last_write = now
        self.writes += 1
