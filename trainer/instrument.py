"""Per-rank instrumentation: step records, collective arrival times, events, simulated GPU state.

Cheap and never blocking: records are appended to this rank's spool file
(``RunDir.spool(rank)``) with one ``os.write`` per batch of complete JSON lines on an
O_APPEND descriptor, so a reader (the node agent) never sees half a line and the
trainer never waits for anyone.

How communication is measured (details per wrapper in docs/trainer.md):
- every collective the trainer can see goes through ``Recorder.enter()`` / ``Recorder.leave()``,
  which gives a CollectiveRecord with the wall time this rank *arrived* (``t_arrive``)
  and the time it completed (``t_done``). A rank that arrives last waits ~0; ranks that
  arrived early wait for it. That, not step time, tells the culprit from the victims.
- gradient-sync collectives (DDP buckets; FSDP2 reduce-scatters and backward all-gathers) are flagged ``sync``;
  ``StepRecord.sync_arrival`` is the step's first sync arrival and ``sync_wait_ms`` the
  time the rank then spent blocked in them.
- fault hooks live here too, because a slow link or a hang happens *at* a collective.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass, field

from ranksight.schema import CollectiveRecord, EventRecord, StepRecord
from ranksight.spool import NullSpool, SpoolWriter


@dataclass(slots=True)
class _OpenCollective:
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
    collectives: list[_OpenCollective] = field(default_factory=list)


class Recorder:
    """One per rank. The training loop, comm hooks and fault hooks all report here."""

    def __init__(self, run_id: str, spool_path: os.PathLike, rank: int, faults, group_ranks: dict[str, list[int]],
                 enabled: bool = True, attempt: int = 0):
        self.run_id, self.rank, self.faults = run_id, rank, faults
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
        self.tp_pending: dict[int, _OpenCollective] = {}  # functional all-reduces issued, not yet waited
        self.tp_is_sync = False  # set when dp == 1 and tp > 1 (see install_tp_timing)
        # DDP buckets complete on gloo's thread; the autograd thread reads the result after backward.
        self._hang_announced = False

    # -- steps ---------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self.t = StepTimes()

    # -- collectives ---------------------------------------------------------
    def enter(self, op: str, group: str, nbytes: int = 0, sync: bool = False,
              async_bucket: bool = False) -> _OpenCollective:
        """This rank arrives at a collective. Applies the hang and slow_link faults, which happen *here*.

        ``async_bucket``: a DDP bucket, overlapped with backward and never left through ``leave()``, so
        no CPU time is taken at its arrival (``time.thread_time`` is a system call)."""
        t_arrive = time.time()
        faulty = self.faults is not None and bool(self.faults.specs)  # no --inject: skip the fault checks
        if faulty and self.faults.has("hang"):
            self._hang_forever(op, group)
        seq = self.seq.get(group, 0)
        self.seq[group] = seq + 1
        c = _OpenCollective(op, group, self.group_ranks.get(group, []), nbytes, t_arrive, sync, seq,
                            cpu_arrive=0.0 if async_bucket else time.thread_time(), async_bucket=async_bucket)
        self.t.collectives.append(c)
        if faulty:
            delay = self.faults.link_delay_s()
            if delay > 0:
                # slow_link: the data leaves this rank late. Inside the collective's timing, so it
                # is comm time of this rank (and, through the collective, of its peers).
                t0 = time.perf_counter()
                time.sleep(delay)
                c.link_delay = time.perf_counter() - t0
        return c

    def tp_issued(self, key: int, c: _OpenCollective) -> None:
        """A functional all-reduce was issued; its output tensor's id is ``key`` until wait_tensor finds it."""
        old = self.tp_pending.get(key)
        if old is not None:
            # ids are unique among live objects only: the tensor registered under this id died unwaited and CPython
            # reused its id. That all-reduce was never waited for: drop it as finish_step does, or it would stay
            # in the step's records with no completion (and look like a hang).
            self.t.collectives = [x for x in self.t.collectives if x is not old]
        self.tp_pending[key] = c

    def leave(self, c: _OpenCollective, blocking: bool = True) -> None:
        c.t_done = time.time()
        if blocking:
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

    def _hang_forever(self, op: str, group: str) -> None:
        # The rank stops *before* the collective: it never arrives, so its peers block in it
        # until the process-group timeout fires. Flush first so the spool shows everything
        # up to the hang. Sleeping in a plain loop keeps the process killable (SIGTERM/SIGKILL).
        self.event("hang_entered", {"op": op, "group": group, "simulated_fault": True})
        while True:
            time.sleep(3600)

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

        One pass over the step's collectives (this runs every step); the sums are taken in the same
        order as ever, so the values are bit for bit what they were."""
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

    def _collective_record(self, c: _OpenCollective) -> CollectiveRecord:
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

    def __init__(self, recorder: Recorder, mem: "MemoryProbe", *, node: int, host: str, world_size: int,
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


# --------------------------------------------------------------------------
# DDP: a comm hook around the default allreduce hook
# --------------------------------------------------------------------------


def make_ddp_comm_hook(recorder: Recorder):
    """DDP calls the hook when a gradient bucket is ready on *this* rank (= arrival).
    The future's callback runs when the bucket's all-reduce has completed (= done)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(process_group, bucket):
        if not recorder.enabled:  # switched off at run time (bench/overhead.py): the plain all-reduce
            return allreduce_hook(process_group, bucket)
        buf = bucket.buffer()
        # overlapped with backward: exposed time is computed in comm_summary()
        c = recorder.enter("all_reduce", "dp", buf.numel() * buf.element_size(), sync=True, async_bucket=True)
        # allreduce_hook's own steps (default_hooks._allreduce_fut), with the completion time taken in its one
        # ``then`` callback: chaining a second callback after allreduce_hook's costs a future and a Python call
        # (with the GIL, on gloo's thread) per bucket.
        group = process_group if process_group is not None else dist.group.WORLD
        buf.div_(group.size())

        def done(f):
            value = f.value()[0]  # raises if the all-reduce failed (e.g. timed out): t_done stays None
            c.t_done = time.time()
            return value

        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(done)

    return hook


# --------------------------------------------------------------------------
# FSDP2: custom reduce-scatter / all-gather that time the (blocking) collectives
# --------------------------------------------------------------------------


def make_fsdp_comms(recorder: Recorder):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class TimedReduceScatter(DefaultReduceScatter):
        """FSDP2's gradient sync: called from each FSDP module's post-backward once its grads are ready."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if not recorder.enabled:
                return super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
            c = recorder.enter("reduce_scatter", "dp", input_tensor.numel() * input_tensor.element_size(), sync=True)
            work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
            if work is not None:
                work.wait()
            recorder.leave(c)
            return None

    class TimedAllGather(DefaultAllGather):
        """Parameter all-gather before forward/backward of each FSDP module.

        In backward it is part of the gradient sync: the first backward all-gather is where a
        rank that finished forward early waits for the one that did not, so it is flagged sync."""

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if not recorder.enabled:
                return super().__call__(output_tensor, input_tensor, group, async_op=async_op)
            c = recorder.enter("all_gather", "dp", output_tensor.numel() * output_tensor.element_size(),
                               sync=recorder.phase == "backward")
            work = super().__call__(output_tensor, input_tensor, group, async_op=async_op)
            if work is not None:
                work.wait()
            recorder.leave(c)
            return None

    return TimedReduceScatter(), TimedAllGather()


# --------------------------------------------------------------------------
# Tensor parallel: DTensor's functional all-reduces (issue -> wait)
# --------------------------------------------------------------------------


def install_tp_timing(recorder: Recorder) -> None:
    """DTensor redistributions (TP forward outputs, backward input-grads, norms) call
    ``torch.distributed._functional_collectives.all_reduce`` (arrival: the collective is issued)
    and later block in its ``wait_tensor`` (done). Both are looked up as module globals, so
    wrapping them times every TP all-reduce in forward *and* backward. Only the time actually
    spent inside ``wait_tensor`` counts as blocked communication."""
    import torch.distributed._functional_collectives as funcol

    if getattr(funcol, "_ranksight_wrapped", False):
        return
    orig_all_reduce, orig_wait = funcol.all_reduce, funcol.wait_tensor

    def _group_name(group) -> str:
        if isinstance(group, tuple) and len(group) == 2 and hasattr(group[0], "mesh_dim_names"):
            names = group[0].mesh_dim_names
            if names:
                return names[group[1]]
        return "tp"

    def all_reduce(self, reduceOp, group, tag=""):
        if not recorder.enabled:
            return orig_all_reduce(self, reduceOp, group, tag)
        name = _group_name(group)
        # Without data parallelism the backward TP all-reduces are where the ranks synchronize
        # in backward: they stand in for the gradient sync (sync_arrival / sync_wait_ms).
        sync = recorder.tp_is_sync and recorder.phase == "backward" and name == "tp"
        c = recorder.enter("all_reduce", name, self.numel() * self.element_size(), sync=sync)
        out = orig_all_reduce(self, reduceOp, group, tag)
        elem = out.elem if isinstance(out, funcol.AsyncCollectiveTensor) else out
        recorder.tp_issued(id(elem), c)
        if not isinstance(out, funcol.AsyncCollectiveTensor):  # already waited (tracing path)
            recorder.tp_pending.pop(id(elem), None)
            recorder.leave(c)
        else:
            # A slow_link delay was spent above, issuing the op, not in wait_tensor: this rank was blocked in
            # communication (comm_ms), never computing.
            recorder.t.blocked_comm += c.link_delay
        return out

    def wait_tensor(tensor):
        if not recorder.enabled:
            return orig_wait(tensor)
        c = recorder.tp_pending.pop(id(tensor), None)
        t0, cpu0 = time.time(), time.thread_time()
        out = orig_wait(tensor)
        recorder.t.comm_cpu += time.thread_time() - cpu0
        if c is not None:
            c.t_done = time.time()
            recorder.t.blocked_comm += c.t_done - t0
        return out

    funcol.all_reduce = all_reduce
    funcol.wait_tensor = wait_tensor
    funcol._ranksight_wrapped = True


# --------------------------------------------------------------------------
# Pipeline parallel: time the schedule's p2p waits (the bubble)
# --------------------------------------------------------------------------


def install_pipeline_timing(recorder: Recorder) -> None:
    """Wrap ``torch.distributed.pipelining.schedules``' p2p helpers (looked up as module globals
    by every schedule). Time waiting for a p2p batch is pipeline wait; a slow_link delays
    this rank's sends/recvs being posted.

    Every send and recv is also recorded, as the flight recorder does: one CollectiveRecord per op on
    a *directed link* communicator ``pp:<src>><dst>`` (group_ranks [src, dst], global ranks) whose
    sequence number counts the transfers from src to dst, so the sender's k-th send and the
    receiver's k-th recv pair up as one op instance. Arrival: a sender when it posts its data (before
    any injected slow_link delay, as for collectives: the data leaving late is the link's time); a
    receiver when it starts waiting for the data (a recv may be posted early and waited on later).
    Completion: when this rank's wait on that op returned. A p2p op that never completed (the peer hung
    or died) stays open and is written by ``flush_unfinished``: the hang analyzer then names the rank
    that never joined."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    if getattr(schedules, "_ranksight_wrapped", False):
        return
    orig_wait, orig_batch = schedules._wait_batch_p2p, schedules._batch_p2p
    # id(works list) -> (the list, its ops' records). Holding the list keeps its id from being reused.
    pending: dict[int, tuple[list, list[_OpenCollective]]] = {}

    def _wait_batch_p2p(work):
        if not recorder.enabled:
            return orig_wait(work)
        t0, w0, cpu0 = time.perf_counter(), time.time(), time.thread_time()
        _, recs = pending.pop(id(work), (None, []))
        for c in recs:
            if c.op == "recv":
                c.t_arrive = max(c.t_arrive, w0)
        per_op = isinstance(work, list) and len(work) == len(recs)
        for i, w in enumerate(work):
            w.wait()
            if per_op:
                recs[i].t_done = time.time()
        now = time.time()
        for c in recs:
            if c.t_done is None:
                c.t_done = now
        recorder.add_pipeline_wait(time.perf_counter() - t0)
        recorder.t.comm_cpu += time.thread_time() - cpu0

    def _batch_p2p(p2p_ops, desc=None):
        recs: list[_OpenCollective] = []
        if recorder.enabled and p2p_ops:
            t_post = time.time()
            if recorder.faults is not None:
                if recorder.faults.has("hang"):
                    recorder._hang_forever("p2p", "pp")
                delay = recorder.faults.link_delay_s()
                if delay > 0:
                    t0 = time.perf_counter()
                    time.sleep(delay)
                    recorder.add_pipeline_wait(time.perf_counter() - t0)
            for p in p2p_ops:
                send = p.op in (dist.isend, dist.send)
                src, dst = (recorder.rank, int(p.peer)) if send else (int(p.peer), recorder.rank)
                group = f"pp:{src}>{dst}"
                seq = recorder.seq.get(group, 0)
                recorder.seq[group] = seq + 1
                c = _OpenCollective("send" if send else "recv", group, [src, dst],
                                    p.tensor.numel() * p.tensor.element_size(), t_post, False, seq)
                recs.append(c)
                recorder.t.collectives.append(c)
        works = orig_batch(p2p_ops, desc=desc) if desc is not None else orig_batch(p2p_ops)
        if recs:
            pending[id(works)] = (works, recs)
        return works

    schedules._wait_batch_p2p = _wait_batch_p2p
    schedules._batch_p2p = _batch_p2p
    schedules._ranksight_wrapped = True


# --------------------------------------------------------------------------
# Overhead benchmark switch (bench/overhead.py): instrumentation on/off within one job
# --------------------------------------------------------------------------


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
    def from_env(cls, rank: int, local_rank: int) -> "OverheadToggle | None":
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

    def begin_step(self, step: int, recorder: "Recorder") -> None:
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

    def finish(self, recorder: "Recorder") -> None:
        """After the loop: the last step's timing, everything back on, the rows written."""
        self._close_row()
        recorder.enabled = True
        if self._paused:
            self._signal(signal.SIGCONT)
            self._paused = False
        if self.out_dir:
            import json

            os.makedirs(self.out_dir, exist_ok=True)
            with open(os.path.join(self.out_dir, f"toggle-rank-{self.rank}.json"), "w") as f:
                json.dump({"rank": self.rank, "block": self.block, "warmup": self.warmup,
                           "columns": ["step", "on", "wall_ms", "thread_cpu_ms", "proc_cpu_ms", "t"], "rows": self.rows}, f)


# --------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------


class MemoryProbe:
    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.statm_fd = None
        if not self.cuda:
            try:
                # RSS = statm's second field x page size (what psutil's memory_info().rss reads), from a
                # descriptor kept open: one pread per step instead of psutil's open/read/close and parsing.
                self.statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
                self.page = os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, AttributeError):
                import psutil

                self.proc = psutil.Process()

    def sample(self) -> int:
        """Peak this step: CUDA max allocated (then reset), or the process RSS on CPU."""
        if self.cuda:
            import torch

            v = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return int(v)
        if self.statm_fd is not None:
            return int(os.pread(self.statm_fd, 128, 0).split()[1]) * self.page
        return int(self.proc.memory_info().rss)
