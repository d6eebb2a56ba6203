"""CPU time of a process's parts, told apart by thread: which part of a server burns the core.

A part is a name given to the threads that do one job (the head: ``http`` for its request handlers, ``flush`` for
the store's flusher, ``analysis`` for the live analysis loop). A thread runs its body inside ``parts.running(name)``;
``parts.seconds()`` is each part's CPU so far: what its finished threads used (``time.thread_time`` at their end)
plus what its live threads have used to now (Linux's per-thread ``/proc/self/task/<tid>/stat``, in clock ticks; a
thread whose file is gone is simply not counted until it records its own end). Where ``/proc`` has no task files
(not Linux), live threads count from their end only.

The process total (``time.process_time``) less the parts is what no part claims (the main thread, threads not
wrapped), so the parts never add up to more than was measured.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _thread_cpu_s(native_id: int) -> float | None:
    """A live thread's user + system CPU seconds from /proc; None when its file is gone or unreadable."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15 of the line
    except (IndexError, ValueError):
        return None


class ThreadParts:
    """CPU seconds per named part of this process (see the module's docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done: dict[str, float] = {}
        self._live: dict[int, tuple[str, float]] = {}  # native thread id -> (part, its CPU when it began the part)

    @contextmanager
    def running(self, part: str):
        """Count the calling thread's CPU inside the block to ``part``."""
        tid = threading.get_native_id()
        start = time.thread_time()
        with self._lock:
            self._done.setdefault(part, 0.0)
            self._live[tid] = (part, start)
        try:
            yield
        finally:
            used = time.thread_time() - start
            with self._lock:
                self._done[part] += used
                self._live.pop(tid, None)

    def add(self, part: str, seconds: float) -> None:
        """Count CPU measured elsewhere to ``part`` (a child process's, from its rusage)."""
        with self._lock:
            self._done[part] = self._done.get(part, 0.0) + seconds

    def seconds(self) -> dict[str, float]:
        """Each part's CPU seconds so far (finished threads exactly, live ones to the clock tick)."""
        with self._lock:  # a thread leaving its part waits here: it is counted live or done, never both
            out = dict(self._done)
            for tid, (part, start) in self._live.items():
                now = _thread_cpu_s(tid)
                if now is not None:
                    out[part] += max(0.0, now - start)
        return out
