"""The checks of one analysis round in parallel, in a few processes forked after the load.

The checks read the round's frame and do not depend on one another (each builds the matrices it asks for; the
ones they share are few and cheap next to the checks themselves). On a big run a post-mortem ``diagnose`` spends
most of its time in them, one after the other, on one core. Forked after the load, each child sees the loaded
frames as they are (copy-on-write: the frames are not copied, not pickled) and runs the checks it is given one at
a time, the longest first, taking the next as it finishes one (so a check shares what the checks before it in that
process built, as in a serial round); it sends back what ``run_all`` keeps of each (its findings, its error, its
coverage), pickled through a pipe; the parent puts the results back in the registry's order, so the findings are
those of a serial round.

What it costs: each running child's own working memory on top of the shared frames (the sum of the processes'
proportional set sizes, not one process's RSS, is the memory the run takes), a fork per process, and what the
processes build twice (a matrix two checks in different processes both ask for). A child that
dies without an answer (killed, out of memory) has its check run again in the parent, after the others.

Only where ``os.fork`` exists (POSIX); ``run_all(jobs=1)``, the default, runs in-process as before.
"""

from __future__ import annotations

import math
import os
import pickle
import selectors
import struct
import sys
from typing import Any, Callable

from analyzers.cpus import available_cpus

# Longest first (the scheduling that finishes soonest when one check dominates): the checks' relative cost on big
# runs, measured with bench/scale_diagnose.py's time split and bench/checks_scale.py (since the non-collective
# checks' array paths, data_stall builds its own matrices and gpu_health's per-sample tests are cheap). Checks not
# listed go last, in registry order.
LONGEST_FIRST = ("comm", "stragglers", "pipeline", "data_stall", "memory_pressure", "mfu", "gpu_health", "hang",
                 "fp16", "kernel_time")

# Runs below this many step + collective rows are done in-process: a fork per check costs more than it saves there.
MIN_ROWS = 500_000


def idle_cpus() -> int:
    """The available CPUs less the ones other processes keep busy (the 1-minute load average, this process's own
    share of it aside), to the nearest CPU: forking checks onto CPUs that are busy only adds the forks' cost, but a
    CPU idle more than half the time still runs a check sooner than waiting for the others (truncating instead
    gave one process on a 2-core box as soon as the load passed 1.0, this process's own load included)."""
    cpus = available_cpus()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cpus
    return max(1, min(cpus, math.floor(cpus - max(0.0, load - 1.0) + 0.5)))


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
    """``{name: run_one(name)}``, run by ``jobs`` processes forked from this one, each taking the next check (longest
    first) as it finishes one: a check shares with the checks before it in its process the matrices they built, as
    in a serial round. ``run_one`` must return something picklable and not raise (``run_all`` catches a check's
    exception inside it)."""
    results: dict[str, Any] = {}
    lost: list[str] = []
    pending = schedule(list(names))
    workers: dict[int, _Worker] = {}  # result fd -> worker
    sel = selectors.DefaultSelector()
    try:
        for _ in range(min(max(1, jobs), len(pending))):
            w = _Worker(run_one)
            workers[w.fd] = w
            sel.register(w.fd, selectors.EVENT_READ)
            w.give(pending.pop(0))
        while workers:
            for key, _ in sel.select():
                w = workers[key.fd]
                done, alive = w.read()
                for name, result in done:
                    results[name] = result
                if alive and w.task is None:
                    if pending:
                        w.give(pending.pop(0))
                        continue
                    w.finish()  # nothing left: it exits
                if not alive or w.task is None:
                    sel.unregister(w.fd)
                    del workers[w.fd]
                    if w.reap() is not None and w.task is not None:  # died with a check in hand (killed, OOM)
                        lost.append(w.task)
    finally:
        for w in workers.values():  # interrupted (Ctrl-C): no child left behind
            w.kill()
        sel.close()
    for name in lost + pending:  # what no child answered: run here, after the others
        results[name] = run_one(name)
    return results


_PARENT_FDS: set[int] = set()  # the parent's ends of the workers' pipes


class _Worker:
    """A forked child that runs the checks it is given one at a time: names in on one pipe, (name, pickled result)
    frames out on another."""

    def __init__(self, run_one: Callable[[str], Any]):
        task_r, task_w = os.pipe()
        out_r, out_w = os.pipe()
        sys.stdout.flush()  # nothing buffered here is written twice, by the child too
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                # the other workers' pipe ends too: a copy held open here would keep them from seeing their end
                for fd in [task_w, out_r, *_PARENT_FDS]:
                    os.close(fd)
                _serve(run_one, task_r, out_w)
                code = 0
            except BaseException:  # noqa: BLE001 - the parent sees no answer and runs the check itself
                pass
            finally:
                os._exit(code)
        os.close(task_r)
        os.close(out_w)
        _PARENT_FDS.update((out_r, task_w))
        self.pid, self.fd, self.tasks = pid, out_r, task_w
        self.task: str | None = None  # the check it is running
        self.buf = b""

    def give(self, name: str) -> None:
        self.task = name
        try:
            os.write(self.tasks, name.encode() + b"\n")
        except OSError:  # it died: its end of file comes next, and the check is run again
            pass

    def finish(self) -> None:
        self._close_tasks()

    def _close_tasks(self) -> None:
        if self.tasks >= 0:
            os.close(self.tasks)
            _PARENT_FDS.discard(self.tasks)
            self.tasks = -1

    def read(self) -> tuple[list[tuple[str, Any]], bool]:
        """The results complete so far, and whether the child is still there."""
        got = os.read(self.fd, 1 << 20)
        self.buf += got
        done = []
        while len(self.buf) >= 8:
            n = struct.unpack("<Q", self.buf[:8])[0]
            if len(self.buf) < 8 + n:
                break
            done.append(pickle.loads(self.buf[8:8 + n]))
            self.buf = self.buf[8 + n:]
            self.task = None
        return done, bool(got)

    def reap(self) -> int | None:
        """Wait for the child; None when it ended as it should (nothing in hand), else its status."""
        os.close(self.fd)
        _PARENT_FDS.discard(self.fd)
        self._close_tasks()
        _, status = os.waitpid(self.pid, 0)
        ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and self.task is None
        return None if ok else status

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
            self.reap()
        except OSError:
            pass


def _serve(run_one: Callable[[str], Any], task_fd: int, out_fd: int) -> None:
    """The child's loop: a check's name per line in, a length-prefixed pickle of (name, result) out, until the
    parent closes the names' pipe."""
    with os.fdopen(task_fd, "rb") as tasks, os.fdopen(out_fd, "wb") as out:
        for line in tasks:
            name = line.decode().strip()
            data = pickle.dumps((name, run_one(name)), protocol=pickle.HIGHEST_PROTOCOL)
            out.write(struct.pack("<Q", len(data)) + data)
            out.flush()
