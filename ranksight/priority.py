"""How far below training a ranksight process runs (``--priority idle|low|normal``).

A monitoring agent must not compete with the ranks for a core: ``ranksight agent`` runs at ``low`` by default
(``ranksight head`` at ``normal``: it has a node of its own). See docs/data-path.md, "Priority".
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ranksight.agent")

PRIORITIES = ("idle", "low", "normal")
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282, "riscv64": 30, "i686": 289}
_IOPRIO_WHO_PROCESS, _IOPRIO_CLASS_BE, _IOPRIO_CLASS_IDLE, _IOPRIO_CLASS_SHIFT = 1, 2, 3, 13


# The agent's default: nice 19. On a node whose cores are all busy, nice 19 still gets the kernel's weight 15 of 1024
# of a core, more than the agent needs (bench/RESULTS.md, the agent's CPU per step), so it keeps up while giving way
# to every rank. SCHED_IDLE's weight is 3 of 1024: below the agent's need, it falls behind without bound, so live
# detection would be late exactly when a node is loaded; and it bought no measurable step time (bench/overhead.py).
AGENT_DEFAULT_PRIORITY = "low"


def _own_threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # not Linux: 0 = the calling thread


def _ioprio_set(tid: int, value: int) -> None:
    import ctypes
    import platform

    nr = _IOPRIO_SET.get(platform.machine())
    if nr is None:
        raise OSError("ioprio_set: no syscall number known for " + platform.machine())
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, _IOPRIO_WHO_PROCESS, tid, value) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def set_priority(priority: str, who: str = "ranksight") -> list[str]:
    """Lower this process's scheduling priority so it never competes with training for a core.

    - ``idle``: every thread at SCHED_IDLE (it runs only when a core would otherwise idle; a waking rank
      preempts it at once) and the I/O class idle (honoured by the BFQ/CFQ disk schedulers only).
    - ``low``: nice 19 (still SCHED_OTHER: a small share of a busy core) and best-effort I/O level 7.
    - ``normal``: unchanged.

    Linux scheduling policy and nice value are per thread and inherited by threads created later, so call
    this before starting any thread; the threads that already exist are changed too (by thread id). Never
    fails: what the OS refuses is logged and returned as a note (the process goes on at its priority).
    """
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    notes: list[str] = []
    if priority == "normal":
        return notes
    tids = _own_threads()
    if priority == "idle":
        if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_IDLE"):
            notes.append("SCHED_IDLE not available on this OS: running at nice 19 instead")
            priority = "low"
        else:
            try:
                for tid in tids:
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError as e:
                notes.append(f"SCHED_IDLE refused ({e}): running at nice 19 instead")
                priority = "low"
    if priority == "low":
        try:
            for tid in tids:
                # setpriority(PRIO_PROCESS, tid) acts on that one thread on Linux
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (OSError, AttributeError) as e:
            notes.append(f"nice 19 refused ({e}): running at normal priority")
    io = (_IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT) if priority == "idle" else ((_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7)
    try:
        for tid in tids:
            _ioprio_set(tid, io)
    except (OSError, AttributeError) as e:
        notes.append(f"I/O priority not lowered ({e})")
    for n in notes:
        log.warning("%s: %s", who, n)
    return notes


def current_priority(tid: int = 0) -> str:
    """What ``set_priority`` left this thread (or ``tid``) at: idle, low or normal (anything else: normal)."""
    try:
        if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE:
            return "idle"
        return "low" if os.getpriority(os.PRIO_PROCESS, tid) >= 19 else "normal"
    except (OSError, AttributeError):
        return "normal"
