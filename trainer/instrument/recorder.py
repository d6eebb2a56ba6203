"""The per-rank recorder: step timings, collective arrival and completion, events; and the step record.

Cheap and never blocking: records are appended to this rank's spool file (``RunDir.spool(rank)``,
``ranksight.spool.SpoolWriter``), one write per batch of complete JSON lines, so a reader (the node agent)
never sees half a line and the trainer never waits for anyone.

Every collective the trainer can see goes through ``Recorder.enter()`` / ``Recorder.leave()`` (the hooks in
this package call them), which gives a CollectiveRecord with the wall time this rank *arrived* (``t_arrive``)
and the time it completed (``t_done``). A rank that arrives last waits ~0; ranks that arrived early wait for
it. That, not step time, tells the culprit from the victims. Gradient-sync collectives (DDP buckets; FSDP2
reduce-scatters and backward all-gathers) are flagged ``sync``; ``StepRecord.sync_arrival`` is the step's
first sync arrival and ``sync_wait_ms`` the time the rank then spent blocked in them.

A slow link or a hang happens *at* a collective: ``enter()`` calls the injected faults there through the
``FaultHook`` it was given (``trainer.faults.FaultState``; None without ``--inject``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ranksight.schema import CollectiveRecord, EventRecord, StepRecord
from ranksight.spool import NullSpool, SpoolWriter
from trainer.instrument.memory import MemoryProbe


class FaultHook(Protocol):
    """What the instrumentation asks of the injected faults where this rank communicates or computes.

    The faults act physically (they sleep); the instrumentation decides what the time is billed as."""

    def before_arrival(self, op: str, group: str, announce: Callable[[str, dict], None]) -> None:
        """``hang``: never returns (after ``announce("hang_entered", detail)``); otherwise returns at once."""

    def delay_send(self) -> float:
        """``slow_link``: sleep the delay of this rank's data leaving; returns the seconds slept (0.0: none)."""

    def slow_compute(self, compute_s: float) -> float:
        """``slow_rank``/``throttle``: stretch ``compute_s`` of compute; returns the slow-down to bill (seconds)."""


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
    link_delay: float = 0.0  # seconds of injected slow_link delay spent posting it (blocking this rank)
    cpu_arrive: float = 0.0  # this thread's CPU time at arrival (gloo may poll while a rank waits)
    async_bucket: bool = False  # a DDP bucket: overlapped with backward (see Recorder.comm_summary)


@dataclass(slots=True)
class StepTimes:
    """Accumulators for the current step (seconds)."""

    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    pipeline_wait: float = 0.0
    blocked_comm: float = 0.0  # blocking collectives timed directly (FSDP2, explicit ones)
    injected_slow: float = 0.0  # slow_rank/throttle: seconds the simulated device was made slower
    comm_cpu: float = 0.0  # CPU time the training thread spent inside blocking collectives (not device work)
    collectives: list[OpenCollective] = field(default_factory=list)


class Recorder:
    """One per rank. The training loop and the timing hooks report here."""

    def __init__(self, run_id: str, spool_path: os.PathLike, rank: int, group_ranks: dict[str, list[int]], *,
                 enabled: bool = True, attempt: int = 0, faults: FaultHook | None = None):
        self.run_id, self.rank = run_id, rank
        # the injected faults (None without --inject), called where this rank arrives at a collective (enter), posts
        # pipeline p2p and finishes a pipeline chunk (pipeline.py)
        self.faults = faults
        self.attempt = attempt  # torchrun restart count: this process's process groups are new ones
        # enabled=False (--no-instrument): the loop's own timers still run, nothing is written
        # and no hook calls enter(); timed() just runs the collective. ``enabled`` may also be
        # switched at a step boundary (OverheadToggle, for bench/overhead.py): while it is False
        # every comm/p2p hook passes straight to the plain collective and the loop writes no
        # step record and no simulated GPU state (events, which are rare, are still written).
        self.enabled = enabled
        self.spool = SpoolWriter(spool_path) if enabled else NullSpool()
        self.group_ranks = group_ranks  # {"dp": [...], "tp": [...], "pp": [...], "world": [...]}
        self.seq: dict[str, int] = {}
        self.step = 0
        self.phase = "forward"  # set by the loop / pipeline stage wrappers: forward | backward | optimizer
        self.t = StepTimes()
        self.tp_pending: dict[int, OpenCollective] = {}  # functional all-reduces issued, not yet waited
        self.tp_is_sync = False  # set when dp == 1 and tp > 1 (see tensor_parallel.install_tp_timing)

    # -- steps ---------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.t = StepTimes()

    # -- collectives ---------------------------------------------------------
    def enter(self, op: str, group: str, nbytes: int = 0, sync: bool = False,
              async_bucket: bool = False) -> OpenCollective:
        """This rank arrives at a collective. The hang and slow_link faults happen *here*.

        ``async_bucket``: a DDP bucket, overlapped with backward and never left through ``leave()``, so
        no CPU time is taken at its arrival (``time.thread_time`` is a system call)."""
        t_arrive = time.time()
        if self.faults is not None:
            self.faults.before_arrival(op, group, self.event)  # hang: the rank never arrives
        seq = self.seq.get(group, 0)
        self.seq[group] = seq + 1
        c = OpenCollective(op, group, self.group_ranks.get(group, []), nbytes, t_arrive, sync, seq,
                           cpu_arrive=0.0 if async_bucket else time.thread_time(), async_bucket=async_bucket)
        self.t.collectives.append(c)
        if self.faults is not None:
            # slow_link: the data leaves this rank late. Inside the collective's timing, so it
            # is comm time of this rank (and, through the collective, of its peers).
            c.link_delay = self.faults.delay_send()
        return c

    def enter_link(self, op: str, src: int, dst: int, nbytes: int, t_arrive: float) -> OpenCollective:
        """A pipeline send or recv between global ranks ``src`` and ``dst``, on the directed link group
        ``pp:<src>><dst>``: its sequence number counts the transfers from src to dst, so the sender's k-th
        send and the receiver's k-th recv are one op instance."""
        group = f"pp:{src}>{dst}"
        seq = self.seq.get(group, 0)
        self.seq[group] = seq + 1
        c = OpenCollective(op, group, [src, dst], nbytes, t_arrive, False, seq)
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
        self.t.blocked_comm += c.t_done - c.t_arrive
        self.t.comm_cpu += time.thread_time() - c.cpu_arrive

    def timed(self, op: str, group_name: str, fn, *args, nbytes: int = 0, sync: bool = False, **kwargs):
        """Run a blocking collective ``fn`` with arrival/completion timing."""
        if not self.enabled:
            return fn(*args, **kwargs)
        c = self.enter(op, group_name, nbytes, sync)
        out = fn(*args, **kwargs)
        self.leave(c)
        return out

    # -- pipeline p2p ----------------------------------------------------------
    def add_pipeline_wait(self, seconds: float) -> None:
        self.t.pipeline_wait += seconds

    # -- events --------------------------------------------------------------
    def event(self, name: str, detail: dict | None = None, step: int | None = None) -> None:
        self.spool.write_now(EventRecord(run_id=self.run_id, rank=self.rank, step=self.step if step is None else step,
                                         t=time.time(), event=name, detail=detail or {}))

    # -- end of step -----------------------------------------------------------
    def comm_summary(self) -> tuple[float, float | None, float | None]:
        """(exposed comm seconds, sync_arrival, sync_wait seconds) for the step so far.

        One pass over the step's collectives (this runs every step)."""
        exposed = self.t.blocked_comm
        sync_arrival = None
        # sync_wait is time spent waiting for *peers*: an injected slow_link delay is this rank's own
        # data leaving late (comm time, in ``exposed``), not a wait, so it is taken out of the wait.
        blocking_wait = 0
        last = None  # the DDP bucket that was ready last (the first of equals)
        max_done = None  # the latest bucket completion
        open_bucket = False  # a bucket without completion (counts as done when the last one arrived)
        bucket_delay = 0  # slow_link delay spent posting buckets
        for c in self.t.collectives:
            if not c.sync:
                continue
            if sync_arrival is None or c.t_arrive < sync_arrival:
                sync_arrival = c.t_arrive
            if c.async_bucket:
                if last is None or c.t_arrive > last.t_arrive:
                    last = c
                if c.t_done is None:
                    open_bucket = True
                elif max_done is None or c.t_done > max_done:
                    max_done = c.t_done
                bucket_delay += c.link_delay
            else:
                blocking_wait += max(0.0, (c.t_done or c.t_arrive) - c.t_arrive - c.link_delay)
        if sync_arrival is None:
            return exposed, None, None
        wait = blocking_wait
        if last is not None:
            # DDP buckets run asynchronously under backward: the rank is only *blocked* from the
            # moment its last bucket was ready until the last bucket finished.
            last_arrive = last.t_arrive
            last_done = last_arrive if max_done is None else (max(max_done, last_arrive) if open_bucket else max_done)
            peers_wait = max(0.0, last_done - last_arrive - last.link_delay)
            wait += peers_wait
            # Exposed: the wait, plus every slow_link delay posting a bucket: it ran inside the comm
            # hook on the autograd thread, so this rank was blocked in communication then, not computing.
            exposed += peers_wait + bucket_delay
        return exposed, sync_arrival, wait

    def _collective_record(self, c: OpenCollective) -> CollectiveRecord:
        return CollectiveRecord(
            run_id=self.run_id, rank=self.rank, step=self.step, seq=c.seq, op=c.op, group=c.group,
            group_ranks=c.group_ranks, nbytes=c.nbytes, t_arrive=c.t_arrive, t_done=c.t_done,
            duration_ms=None if c.t_done is None else (c.t_done - c.t_arrive) * 1000.0, attempt=self.attempt)

    def finish_step(self, rec: StepRecord) -> None:
        # A functional all-reduce whose result was never waited for in this step has no
        # completion to report; drop it rather than make it look like a hang.
        if self.tp_pending:
            unwaited = {id(c) for c in self.tp_pending.values()}
            self.tp_pending.clear()
            self.t.collectives = [c for c in self.t.collectives if id(c) not in unwaited]
        for c in self.t.collectives:
            self.spool.add(self._collective_record(c))
        self.spool.add(rec)
        self.spool.flush()
        self.t.collectives = []

    def flush_unfinished(self, reason: str) -> None:
        """On an error (e.g. a peer hung and the PG timed out): write the collectives this rank was stuck in."""
        for c in self.t.collectives:
            self.spool.add(self._collective_record(c))
        self.t.collectives = []
        self.spool.flush()
        self.event("exit", {"reason": reason})


class StepWriter:
    """Builds this rank's StepRecord at the end of a step and hands it to the Recorder.

    The fields that are the same every step (run, placement, tokens, FLOPs, micro-batches) are bound
    once; ``write`` takes what the step measured."""

    def __init__(self, recorder: Recorder, mem: MemoryProbe, *, node: int, host: str, world_size: int,
                 pp_stage: int, dp_rank: int, tp_rank: int, tokens: int, flops: float, microbatches: int):
        self.rec, self.mem = recorder, mem
        self.static = dict(run_id=recorder.run_id, rank=recorder.rank, node=node, host=host,
                           attempt=recorder.attempt, world_size=world_size, pp_stage=pp_stage, dp_rank=dp_rank,
                           tp_rank=tp_rank, tokens=tokens, flops=flops, microbatches=microbatches)

    def write(self, step: int, t_start: float, t_end: float, step_ms: float, device_ms: float | None,
              loss: float, grad_norm: float, loss_scale: float | None, overflow: bool, skipped: bool, lr: float,
              profiling: bool) -> tuple[float, int]:
        """Write the step's collectives and its StepRecord; returns (compute_ms, mem_bytes) for the simulated GPU."""
        rec = self.rec
        t = rec.t
        comm_s, sync_arrival, sync_wait = rec.comm_summary()
        data_ms, comm_ms, pw_ms = t.data * 1000, comm_s * 1000, t.pipeline_wait * 1000
        compute_ms = max(0.0, step_ms - data_ms - comm_ms - pw_ms)
        mem_bytes = self.mem.sample()
        loss_ok = math.isfinite(loss)
        rec.finish_step(StepRecord(
            **self.static, step=step, t_start=t_start, t_end=t_end,
            step_ms=step_ms, data_ms=data_ms, forward_ms=t.forward * 1000, backward_ms=t.backward * 1000,
            optimizer_ms=t.optimizer * 1000, comm_ms=comm_ms, pipeline_wait_ms=pw_ms, compute_ms=compute_ms,
            sync_arrival=sync_arrival, sync_wait_ms=None if sync_wait is None else sync_wait * 1000,
            loss=loss if loss_ok else None, loss_nonfinite=not loss_ok,
            grad_norm=grad_norm if math.isfinite(grad_norm) else None, loss_scale=loss_scale,
            overflow=overflow, skipped=skipped, lr=lr, mem_bytes=mem_bytes, profiling=profiling, device_ms=device_ms))
        return compute_ms, mem_bytes
