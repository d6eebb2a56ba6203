"""The per-rank recorder: collective arrival and completion, step timings, events; the spool.

Cheap and never blocking: records are appended to this rank's spool file (``RunDir.spool(rank)``,
``ranksight.spool.SpoolWriter``), one write per batch of complete JSON lines, so a reader (the node agent)
never sees half a line and the training loop never waits for anyone.

Every collective the hooks can see goes through ``Recorder.enter()`` / ``Recorder.leave()``, which gives a
CollectiveRecord with the time this rank *arrived* (``t_arrive``) and the time it completed (``t_done``). A rank
that arrives last waits ~0; ranks that arrived early wait for it. That, not step time, tells the culprit from the
victims. Gradient-sync collectives (DDP buckets; FSDP2 reduce-scatters and backward all-gathers) are flagged
``sync``; ``comm_summary`` gives the step's first sync arrival and the time the rank then spent waiting in them.

On CUDA each timing point is also a device event (``ranksight.instrument.device_time``): the session resolves the
step from the device's times once they have run, since a host clock only sees NCCL work being queued.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from ranksight.instrument.device_time import DeviceClock, StepMarks
from ranksight.schema import CollectiveRecord, CommunicatorRecord, EventRecord, communicator_id
from ranksight.spool import NullSpool, SpoolWriter


@dataclass(slots=True)
class OpenCollective:
    """A collective (or p2p op) this rank arrived at in the current step; written as a CollectiveRecord."""

    op: str
    group: str
    group_ranks: list[int]
    nbytes: int
    t_arrive: float
    sync: bool
    seq: int
    t_done: float | None = None
    cpu_arrive: float = 0.0  # this thread's CPU time at arrival (gloo may poll while a rank waits)
    async_bucket: bool = False  # a DDP bucket: overlapped with backward (see comm_summary)
    # CUDA only: the compute stream reached the collective (arrival), started waiting for its result, has it
    ev_arrive: object = None
    ev_block: object = None
    ev_done: object = None


@dataclass(slots=True)
class StepTimes:
    """Accumulators for the current step (seconds)."""

    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    pipeline_wait: float = 0.0
    blocked_comm: float = 0.0  # blocking collectives timed directly (FSDP2, explicit ones)
    comm_cpu: float = 0.0  # CPU time the training thread spent inside blocking collectives (not its own work)
    collectives: list[OpenCollective] = field(default_factory=list)
    marks: StepMarks | None = None  # CUDA: the step's device events


def comm_summary(collectives: list[OpenCollective], blocked_s: float) -> tuple[float, float | None, float | None]:
    """(exposed comm seconds, sync_arrival, sync_wait seconds) of a step's collectives, from their ``t_arrive`` /
    ``t_done`` (host or device times); ``blocked_s``: the time blocked in blocking collectives. One pass (every step)."""
    exposed = blocked_s
    sync_arrival = None
    blocking_wait = 0.0
    last_arrive = None  # the DDP bucket that was ready last
    max_done = None  # the latest bucket completion
    open_bucket = False  # a bucket without completion (counts as done when the last one arrived)
    for c in collectives:
        if not c.sync:
            continue
        if sync_arrival is None or c.t_arrive < sync_arrival:
            sync_arrival = c.t_arrive
        if c.async_bucket:
            if last_arrive is None or c.t_arrive > last_arrive:
                last_arrive = c.t_arrive
            if c.t_done is None:
                open_bucket = True
            elif max_done is None or c.t_done > max_done:
                max_done = c.t_done
        else:
            blocking_wait += max(0.0, (c.t_done or c.t_arrive) - c.t_arrive)
    if sync_arrival is None:
        return exposed, None, None
    wait = blocking_wait
    if last_arrive is not None:
        # DDP buckets run asynchronously under backward: the rank is only *blocked* from the
        # moment its last bucket was ready until the last bucket finished.
        last_done = last_arrive if max_done is None else (max(max_done, last_arrive) if open_bucket else max_done)
        peers_wait = max(0.0, last_done - last_arrive)
        wait += peers_wait
        exposed += peers_wait
    return exposed, sync_arrival, wait


class Recorder:
    """One per rank. The timing hooks and the session report here."""

    def __init__(self, run_id: str, spool_path: os.PathLike, rank: int, group_ranks: dict[str, list[int]], *,
                 enabled: bool = True, attempt: int = 0, clock: DeviceClock | None = None):
        self.run_id, self.rank = run_id, rank
        self.attempt = attempt  # torchrun restart count: this process's process groups are new ones
        # enabled=False: nothing is written and every hook passes straight to the plain collective. It may be
        # switched at a step boundary (trainer.overhead_toggle, for bench/overhead.py); events, which are rare,
        # are still written while it is off.
        self.enabled = enabled
        self.spool = SpoolWriter(spool_path) if enabled else NullSpool()
        self.group_ranks = group_ranks  # {"dp": [...], "tp": [...], "pp": [...], "world": [...]}
        self.clock = clock  # CUDA: device events for every timing point; None on CPU
        self.seq: dict[str, int] = {}
        self.step = 0
        self.phase = "forward"  # forward | backward | optimizer | data: set by the session and the model hooks
        self.t = StepTimes()
        self.tp_pending: dict[int, OpenCollective] = {}  # functional all-reduces issued, not yet waited
        self.tp_is_sync = False  # set when dp == 1 and tp > 1 (see tensor_parallel.install_tp_timing)
        self._comm_ids: dict[str, tuple[list[int], str]] = {}  # group name -> (its members list, its comm_id)

    # -- steps ---------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.t = StepTimes()
        if self.clock is not None:
            self.t.marks = StepMarks(self.clock.current_anchor(), self.clock.mark())

    def mark(self):
        """A device event now on the current stream (CUDA), else None."""
        return None if self.clock is None else self.clock.mark()

    # -- collectives ---------------------------------------------------------
    def enter(self, op: str, group: str, nbytes: int = 0, sync: bool = False,
              async_bucket: bool = False) -> OpenCollective:
        """This rank arrives at a collective.

        ``async_bucket``: a DDP bucket, overlapped with backward and never left through ``leave()``, so
        no CPU time is taken at its arrival (``time.thread_time`` is a system call)."""
        seq = self.seq.get(group, 0)
        self.seq[group] = seq + 1
        c = OpenCollective(op, group, self.group_ranks.get(group, []), nbytes, time.time(), sync, seq,
                           cpu_arrive=0.0 if async_bucket else time.thread_time(), async_bucket=async_bucket)
        if self.clock is not None:
            c.ev_arrive = c.ev_block = self.clock.mark()
        self.t.collectives.append(c)
        return c

    def enter_link(self, op: str, src: int, dst: int, nbytes: int, t_arrive: float, ev_arrive=None) -> OpenCollective:
        """A pipeline send or recv between global ranks ``src`` and ``dst``, on the directed link group
        ``pp:<src>><dst>``: its sequence number counts the transfers from src to dst, so the sender's k-th
        send and the receiver's k-th recv are one op instance."""
        group = f"pp:{src}>{dst}"
        seq = self.seq.get(group, 0)
        self.seq[group] = seq + 1
        c = OpenCollective(op, group, [src, dst], nbytes, t_arrive, False, seq, ev_arrive=ev_arrive,
                           ev_block=ev_arrive)
        self.t.collectives.append(c)
        return c

    def tp_issued(self, key: int, c: OpenCollective) -> None:
        """A functional all-reduce was issued; its output tensor's id is ``key`` until wait_tensor finds it."""
        old = self.tp_pending.get(key)
        if old is not None:
            # ids are unique among live objects only: the tensor registered under this id died unwaited and CPython
            # reused its id. That all-reduce was never waited for: drop it as finish_step does, or it would stay
            # in the step's records with no completion (and look like a hang).
            self.t.collectives = [x for x in self.t.collectives if x is not old]
        self.tp_pending[key] = c

    def leave(self, c: OpenCollective) -> None:
        """This rank leaves a blocking collective: the time since arrival was spent blocked in it."""
        c.t_done = time.time()
        if self.clock is not None:
            c.ev_done = self.clock.mark()
        self.t.blocked_comm += c.t_done - c.t_arrive
        self.t.comm_cpu += time.thread_time() - c.cpu_arrive

    def timed(self, op: str, group_name: str, fn, /, *args, nbytes: int = 0, sync: bool = False, **kwargs):
        """Run a blocking collective ``fn`` with arrival/completion timing."""
        if not self.enabled:
            return fn(*args, **kwargs)
        c = self.enter(op, group_name, nbytes, sync)
        out = fn(*args, **kwargs)
        self.leave(c)
        return out

    # -- pipeline p2p ----------------------------------------------------------
    def add_pipeline_wait(self, seconds: float, ev_start=None, ev_end=None) -> None:
        """Time blocked waiting for pipeline p2p (and, on CUDA, the device span the stream waited)."""
        self.t.pipeline_wait += seconds
        if ev_start is not None and self.t.marks is not None:
            self.t.marks.pipeline_wait.append((ev_start, ev_end))

    # -- events --------------------------------------------------------------
    def event(self, name: str, detail: dict | None = None, step: int | None = None) -> None:
        self.spool.write_now(EventRecord(run_id=self.run_id, rank=self.rank, step=self.step if step is None else step,
                                         t=time.time(), event=name, detail=detail or {}))

    # -- end of step -----------------------------------------------------------
    def take_step(self) -> StepTimes:
        """The step's accumulators, handed over for its record; the recorder starts empty for the next step.

        A functional all-reduce whose result was never waited for in this step has no completion to report: it
        is dropped rather than made to look like a hang."""
        t = self.t
        if self.tp_pending:
            unwaited = {id(c) for c in self.tp_pending.values()}
            self.tp_pending.clear()
            t.collectives = [c for c in t.collectives if id(c) not in unwaited]
        self.t = StepTimes()
        return t

    def comm_id(self, group: str, members: list[int], step: int) -> str:
        """The id of the process group ``group`` with ``members`` (``ranksight.schema.communicator_id``). The first
        time a group is seen, its lowest member writes its ``CommunicatorRecord`` (before any record that names it),
        so the members of a group are stored once per job, not in every collective record of every rank. The
        members list is compared by identity (the session's lists are shared, and replaced, never mutated, when a
        group changes) and, when small (a pipeline link), by value."""
        hit = self._comm_ids.get(group)
        if hit is not None and (hit[0] is members or (len(members) <= 64 and hit[0] == members)):
            return hit[1]
        cid = communicator_id(group, members, self.attempt)
        self._comm_ids[group] = (members, cid)
        if members and self.rank == min(members):
            self.spool.add(CommunicatorRecord(run_id=self.run_id, comm_id=cid, group=group, ranks=sorted(members),
                                              attempt=self.attempt, rank=self.rank, step=step))
        return cid

    def collective_record(self, c: OpenCollective, step: int) -> CollectiveRecord:
        return CollectiveRecord(
            run_id=self.run_id, rank=self.rank, step=step, seq=c.seq, op=c.op, group=c.group,
            comm_id=self.comm_id(c.group, c.group_ranks, step) if c.group_ranks else "",
            nbytes=c.nbytes, t_arrive=c.t_arrive, t_done=c.t_done,
            duration_ms=None if c.t_done is None else (c.t_done - c.t_arrive) * 1000.0, attempt=self.attempt)

    def flush_unfinished(self, reason: str) -> None:
        """On an error (e.g. a peer hung and the PG timed out): write the collectives this rank was stuck in, then
        the ``exit`` event with the reason."""
        for c in self.t.collectives:
            self.spool.add(self.collective_record(c, self.step))
        self.t.collectives = []
        self.spool.flush()
        self.event("exit", {"reason": reason})
