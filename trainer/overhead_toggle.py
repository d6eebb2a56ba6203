"""The overhead benchmark's switch (bench/overhead.py, bench/recorder_cost.py): instrumentation on/off within one job."""

from __future__ import annotations

import json
import os
import signal
import time

from ranksight.instrument.recorder import Recorder


class OverheadToggle:
    """Alternates the instrumentation ON and OFF in blocks of steps, for measuring what it costs.

    Enabled only by the environment (read once at start-up; unset, the loop does not touch it):

    - ``RANKSIGHT_OVERHEAD_BLOCK=K``: after ``RANKSIGHT_OVERHEAD_WARMUP`` steps (default 0, all ON),
      steps come in blocks of K; blocks pair up (2j, 2j+1), ON then OFF for even j and OFF then ON
      for odd j (ABBA, so a linear drift cancels). Every rank computes the same schedule from the
      step number, so no collective is needed and all ranks switch at the same step boundary.
    - ``RANKSIGHT_OVERHEAD_OUT=DIR``: each rank keeps, per step, its iteration wall time (loop top to
      loop top: step record, spool write and simulated GPU state included), its main-thread CPU time,
      its process CPU time and the step's start (unix time) in memory, and writes them to
      ``DIR/toggle-rank-<R>.json`` at the end (nothing is written during the run).
    - ``RANKSIGHT_OVERHEAD_PAUSE_PIDS=PID,...``: local rank 0 sends SIGSTOP to these processes (the
      node agent, the head) when an OFF block starts and SIGCONT when an ON block starts (and at the
      end), so OFF blocks run without the agent as well.

    OFF means ``Recorder.enabled = False``: no spool records, hooks pass straight to the collective,
    no simulated GPU state write. Not for fault injection (faults act in the hooks).
    """

    def __init__(self, block: int, warmup: int, out_dir: str | None, pause_pids: list[int], rank: int,
                 local_rank: int):
        if block < 1:
            raise ValueError("RANKSIGHT_OVERHEAD_BLOCK must be >= 1")
        self.block, self.warmup, self.out_dir, self.rank = block, max(0, warmup), out_dir, rank
        self.pause_pids = pause_pids if local_rank == 0 else []
        # step, on, wall_ms, thread_cpu_ms, proc_cpu_ms, t (unix time the step started)
        self.rows: list[tuple[int, int, float, float, float, float]] = []
        self._last: tuple[int, bool, float, float, float, float] | None = None
        self._paused = False

    @classmethod
    def from_env(cls, rank: int, local_rank: int) -> OverheadToggle | None:
        block = os.environ.get("RANKSIGHT_OVERHEAD_BLOCK", "")
        if not block:
            return None
        pids = [int(p) for p in os.environ.get("RANKSIGHT_OVERHEAD_PAUSE_PIDS", "").split(",") if p.strip()]
        return cls(int(block), int(os.environ.get("RANKSIGHT_OVERHEAD_WARMUP", "0") or 0),
                   os.environ.get("RANKSIGHT_OVERHEAD_OUT") or None, pids, rank, local_rank)

    def is_on(self, step: int) -> bool:
        if step <= self.warmup:
            return True
        b = (step - self.warmup - 1) // self.block
        return (b % 2 == 0) == ((b // 2) % 2 == 0)

    def _signal(self, sig) -> None:
        for pid in self.pause_pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _close_row(self) -> None:
        p, tc, pc = time.perf_counter(), time.thread_time(), time.process_time()
        if self._last is not None:
            step, on, p0, tc0, pc0, t0 = self._last
            self.rows.append((step, int(on), (p - p0) * 1000.0, (tc - tc0) * 1000.0, (pc - pc0) * 1000.0, t0))
        self._last = None

    def begin_step(self, step: int, recorder: Recorder) -> None:
        """At the top of the loop: close the previous step's timing, switch, start this step's."""
        self._close_row()
        on = self.is_on(step)
        if on != recorder.enabled:
            recorder.enabled = on
        if on and self._paused:
            self._signal(signal.SIGCONT)
            self._paused = False
        elif not on and not self._paused:
            self._signal(signal.SIGSTOP)
            self._paused = True
        self._last = (step, on, time.perf_counter(), time.thread_time(), time.process_time(), time.time())

    def finish(self, recorder: Recorder) -> None:
        """After the loop: the last step's timing, everything back on, the rows written."""
        self._close_row()
        recorder.enabled = True
        if self._paused:
            self._signal(signal.SIGCONT)
            self._paused = False
        if self.out_dir:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"toggle-rank-{self.rank}.json"), "w") as f:
                json.dump({"rank": self.rank, "block": self.block, "warmup": self.warmup,
                           "columns": ["step", "on", "wall_ms", "thread_cpu_ms", "proc_cpu_ms", "t"], "rows": self.rows}, f)
