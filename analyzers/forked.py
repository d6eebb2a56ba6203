"""The checks of one analysis round in parallel: one forked process per check, a few at a time.

The checks read the round's frame and do not depend on one another (each builds the matrices it asks for; the
ones they share are few and cheap next to the checks themselves). On a big run a post-mortem ``diagnose`` spends
most of its time in them, one after the other, on one core. Forked after the load, each child sees the loaded
frames as they are (copy-on-write: the frames are not copied, not pickled), runs one check, and sends back what
``run_all`` keeps of it (its findings, its error, its coverage), pickled through a pipe; the parent puts the
results back in the registry's order, so the findings are those of a serial round.

What it costs: each running child's own working memory on top of the shared frames (the sum of the processes'
proportional set sizes, not one process's RSS, is the memory the run takes), and a fork per check. A child that
dies without an answer (killed, out of memory) has its check run again in the parent, after the others.

Only where ``os.fork`` exists (POSIX); ``run_all(jobs=1)``, the default, runs in-process as before.
"""

from __future__ import annotations

import os
import pickle
import selectors
import sys
from typing import Any, Callable

# Longest first (the scheduling that finishes soonest when one check dominates): the checks' relative cost on big
# runs, measured with bench/scale_diagnose.py's time split. Checks not listed go last, in registry order.
LONGEST_FIRST = ("comm", "gpu_health", "stragglers", "pipeline", "memory_pressure", "data_stall", "mfu", "hang",
                 "fp16", "kernel_time")

# Runs below this many step + collective rows are done in-process: a fork per check costs more than it saves there.
MIN_ROWS = 500_000


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, a container's cpuset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def idle_cpus() -> int:
    """The available CPUs less the ones other processes keep busy (the 1-minute load average, this process's own
    share of it aside): forking checks onto CPUs that are busy only adds the forks' cost."""
    cpus = available_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cpus
    return max(1, min(cpus, int(cpus - max(0.0, load - 1.0))))


def default_jobs(data: Any, n_checks: int) -> int:
    """``diagnose``'s default: one process per idle CPU (at most one per check) on a big run, else 1."""
    if not hasattr(os, "fork"):
        return 1
    rows = sum(len(getattr(data, n, ())) for n in ("steps", "collectives"))
    if rows < MIN_ROWS:
        return 1
    return max(1, min(idle_cpus(), n_checks))


def schedule(names: list[str]) -> list[str]:
    """``names`` in the order they are started: longest first."""
    rank = {n: i for i, n in enumerate(LONGEST_FIRST)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), names.index(n)))


def run_forked(names: list[str], run_one: Callable[[str], Any], jobs: int) -> dict[str, Any]:
    """``{name: run_one(name)}``, each in a process forked from this one, at most ``jobs`` at a time. ``run_one``
    must return something picklable and not raise (``run_all`` catches a check's exception inside it)."""
    results: dict[str, Any] = {}
    lost: list[str] = []
    pending = schedule(list(names))
    running: dict[int, tuple[str, int]] = {}  # read fd -> (name, pid)
    chunks: dict[int, list[bytes]] = {}
    sel = selectors.DefaultSelector()
    try:
        while pending or running:
            while pending and len(running) < max(1, jobs):
                name = pending.pop(0)
                fd, pid = _start(name, run_one)
                running[fd] = (name, pid)
                chunks[fd] = []
                sel.register(fd, selectors.EVENT_READ)
            for key, _ in sel.select():
                fd = key.fd
                got = os.read(fd, 1 << 20)
                if got:
                    chunks[fd].append(got)
                    continue
                sel.unregister(fd)
                os.close(fd)
                name, pid = running.pop(fd)
                _, status = os.waitpid(pid, 0)
                payload = b"".join(chunks.pop(fd))
                try:
                    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
                        raise EOFError
                    results[name] = pickle.loads(payload)
                except Exception:  # noqa: BLE001 - no answer (killed, out of memory): run it here, after the others
                    lost.append(name)
    finally:
        for fd, (_, pid) in running.items():  # interrupted (Ctrl-C): no child left behind
            try:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            except OSError:
                pass
            os.close(fd)
        sel.close()
    for name in lost:
        results[name] = run_one(name)
    return results


def _start(name: str, run_one: Callable[[str], Any]) -> tuple[int, int]:
    """Fork a child that runs ``run_one(name)`` and writes the pickled result to a pipe; (read end, pid)."""
    r, w = os.pipe()
    sys.stdout.flush()  # nothing buffered here is written twice, by the child too
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            os.close(r)
            data = pickle.dumps(run_one(name), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(w, "wb") as f:
                f.write(data)
            code = 0
        except BaseException:  # noqa: BLE001 - the parent sees no answer and runs the check itself
            pass
        finally:
            os._exit(code)
    os.close(w)
    return r, pid
