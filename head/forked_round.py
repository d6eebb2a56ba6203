"""A live analysis round's analyzers in a child process forked from the head, so the round and ingest do not share
one interpreter lock.

In one process the analysis thread and the request handlers take turns on the GIL: at thousands of requests a
second the round takes seconds longer and the handlers fall behind while it runs, though the head's machine has
idle cores. Here the round's input (``RunData``, the snapshot of the live window) is made in the head as before,
then a child forked from the head runs the analyzers on it: it sees the snapshot as it is (copy-on-write: nothing
copied or pickled on the way in), sends back the findings pickled through a pipe, and exits. The head's thread
waits on the pipe without holding the GIL, and books the findings as for a round run in-thread (the findings book,
the store, the listeners stay in the head).

A child that dies, answers nothing readable or outlives ``timeout_s`` (then it is killed) raises ``RoundLost``: the
round is a gap (``LiveAnalysis`` counts and logs it; the episodes stay as the last round left them), never a crash
of the head. Only the analyzers run in the child; they touch no lock of the head (the window's snapshot is theirs).

``forked_analyzer(fn)`` where ``os.fork`` exists; ``ranksight head --analyze-in thread`` keeps rounds in the head's
analysis thread, as before.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import stat
import time
import traceback
from typing import Any, Callable

from head.store.store_lock import held_fds

log = logging.getLogger("ranksight.head")

# How long a child may take before it is killed and its round counted lost: far beyond any round (<= 5 s at 16,384
# ranks), short enough that a stuck child does not hold the analysis loop for long.
DEFAULT_TIMEOUT_S = 120.0


class RoundLost(RuntimeError):
    """The forked round gave no findings back (killed, died, timed out, an answer that does not read)."""


def can_fork() -> bool:
    return hasattr(os, "fork")


# ``--analyze-in auto`` forks a round only when its input holds this many step and collective rows (a 1,024-rank
# round does, a small job's does not). Below it a round takes milliseconds in the analysis thread: a fork would cost
# more than the GIL it frees, and a second busy process beside a small job's ranks (a head on a training node, the
# demo's and the detection benchmarks' shared cores) is noise in the very step times the analyzers judge.
FORK_MIN_ROWS = 100_000


def round_rows(data: Any) -> int:
    """The step and collective rows of a round's input (``RunData``); 0 for anything else."""
    return sum(len(t) for t in (getattr(data, "steps", None), getattr(data, "collectives", None)) if t is not None)


def forked_analyzer(fn: Callable[[Any], Any], timeout_s: float = DEFAULT_TIMEOUT_S,
                    on_child_cpu: Callable[[float], None] | None = None, min_rows: int = 0) -> Callable[[Any], Any]:
    """``fn`` run in a child forked for each call (see the module's docstring), or in the caller's thread when the
    round's input holds fewer than ``min_rows`` rows (``round_rows``); ``on_child_cpu(seconds)`` gets the child's
    user + system CPU after each forked call. An exception ``fn`` raises in the child is raised again here as a
    ``RuntimeError`` carrying its traceback; a child lost is ``RoundLost``."""

    def in_child(data):
        if min_rows and round_rows(data) < min_rows:
            return fn(data)
        return run_forked(fn, data, timeout_s, on_child_cpu)

    in_child.__wrapped__ = fn  # type: ignore[attr-defined]
    return in_child


def run_forked(fn: Callable[[Any], Any], data: Any, timeout_s: float,
               on_child_cpu: Callable[[float], None] | None = None) -> Any:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, answer, leave without running the head's exit handlers or flushing its buffers
        code = 0
        try:
            os.close(r)
            _close_sockets()
            for fd in held_fds():  # the store's lock: a child outliving its head must not keep the store locked
                os.close(fd)
            try:
                answer = ("ok", fn(data))
            except BaseException:  # noqa: BLE001 - the head gets the error, the child just ends
                answer = ("error", traceback.format_exc())
            _write_all(w, pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    raw = None
    try:
        raw = _read_all(r, time.monotonic() + timeout_s)
    finally:
        os.close(r)
        if raw is None:  # past the deadline, or the wait itself failed: the child must not outlive it, nor be left a zombie
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status, usage = os.wait4(pid, 0)
    timed_out = raw is None
    if on_child_cpu is not None:
        on_child_cpu(usage.ru_utime + usage.ru_stime)
    if timed_out:
        raise RoundLost(f"the analysis child ran past {timeout_s:.0f} s and was killed")
    if not raw:
        raise RoundLost(f"the analysis child ended without an answer ({_how_it_ended(status)})")
    try:
        kind, value = pickle.loads(raw)
    except Exception as e:  # noqa: BLE001 - a truncated answer (the child died mid-write)
        raise RoundLost(f"the analysis child's answer does not read ({e}; {_how_it_ended(status)})") from None
    if kind == "error":
        raise RuntimeError(f"the analyzers failed in the analysis child:\n{value}")
    return value


def _close_sockets() -> None:
    """In the child: drop its copies of the head's sockets (the listening one, clients' connections). Closing a copy
    sends nothing (the head's own descriptor keeps each open), but without it a child outliving a dead head would
    hold the head's port and its clients' connections until the child ends. Where ``/proc`` is missing the copies
    stay: harmless while the head lives."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        return
    for fd in fds:
        if fd <= 2:  # stdio stays, whatever it is
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the listing's own descriptor, already gone
            pass


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int, deadline: float) -> bytes | None:
    """Everything the child writes until it closes its end; None at the deadline. ``poll``, not ``select``: a head
    holding thousands of connections has descriptors past ``select``'s 1,024."""
    chunks = []
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if not poller.poll(max(1, int(left * 1000))):
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
