"""``ranksight.init``: instrument any training loop in three lines.

    rs = ranksight.init(run_id="exp1", store="/shared/ranksight")   # after torch.distributed is initialized
    rs.watch(model)                                                  # after DDP / fully_shard / TP wrapping
    for step in range(n):
        with rs.step(step) as s:                                     # one StepRecord per step
            ...                                                      # optional: with rs.phase("forward"): ...
            s.report(loss=loss)                                      # optional: loss, grad_norm, loss_scale, ...

What each step measures, on this rank:

- wall time of the step and of each phase the loop names (``data``, ``forward``, ``backward``, ``optimizer``);
- every collective the hooks see (``rs.watch``): when this rank arrived, when it completed; from the gradient-sync
  collectives the step's sync arrival and the time spent waiting for peers there;
- device time (``device_ms``): on CUDA, from events on the training stream (``device_time``): the stream's span over
  the step less the spans it spent waiting for communication, pipeline peers and input copies, read back a step or
  more later without a device sync; on a CPU, the training thread's CPU time less what it spent inside collectives;
- memory peak, tokens (counted from the model's input when the loop does not say) and model FLOPs.

A clean end is recorded: ``rs.finish()``, leaving ``with ranksight.init(...) as rs:``, interpreter exit (atexit) and
SIGTERM each write this rank's ``exit`` event with the reason, so a finished run is never mistaken for a hang.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from ranksight.instrument.device_time import DeviceClock, has_run, wall
from ranksight.instrument.memory import MemoryProbe
from ranksight.instrument.recorder import OpenCollective, Recorder, StepTimes, comm_summary
from ranksight.instrument.watch import attach
from ranksight.layout import DEFAULT_STORE as LAYOUT_DEFAULT_STORE
from ranksight.layout import RunDir
from ranksight.schema import RankPlacement, StepRecord

PHASES = ("data", "forward", "backward", "optimizer")
DEFAULT_STORE = str(LAYOUT_DEFAULT_STORE)  # where diagnose, the agent and the head look by default
# CUDA steps waiting for their events; past this the oldest is waited for (its end event only, not the stream)
MAX_PENDING_STEPS = 8


@dataclass(slots=True)
class StepValues:
    """What the loop reports about a step (``StepHandle.report``); tensors are read when the record is written."""

    loss: object = None
    grad_norm: object = None
    loss_scale: float | None = None
    overflow: bool = False
    skipped: bool = False
    lr: float = 0.0
    tokens: int | None = None
    flops: float | None = None
    microbatches: int | None = None
    profiling: bool = False


class StepHandle:
    """The open step (``with rs.step(n) as s``). After the step: ``step_ms``, ``compute_ms`` and ``mem_bytes`` as
    measured on the host (the device figures follow in the record, a step or more later on CUDA)."""

    def __init__(self, step: int):
        self.step = step
        self.values = StepValues()
        self.step_ms = self.compute_ms = 0.0
        self.mem_bytes = 0

    def report(self, **values) -> None:
        """``loss``, ``grad_norm``, ``loss_scale``, ``overflow``, ``skipped``, ``lr``, ``tokens``, ``flops``,
        ``microbatches``, ``profiling``: any subset, any time during the step (tensors are fine: they are read
        once the step's device work has run, so reporting them costs no sync)."""
        for k, v in values.items():
            if not hasattr(self.values, k):
                raise TypeError(f"report() got an unknown field {k!r}; fields: {', '.join(StepValues.__slots__)}")
            setattr(self.values, k, v)


@dataclass(slots=True)
class _Pending:
    """A finished step on CUDA whose device events have not all run yet."""

    record: StepRecord
    times: StepTimes
    values: StepValues


class Session:
    """One rank's instrumentation: made by ``ranksight.init``; the loop calls ``watch``, ``step``, ``phase``,
    ``event`` and ``finish``. Everything it writes goes to this rank's spool file under the run directory, where
    the node agent picks it up.

    Its ~18 methods are the public API's verbs (each with a context-manager form and a call form for framework
    callbacks) plus the step's write-out; the measuring itself is in ``Recorder``, the hooks and ``device_time``."""

    def __init__(self, run: RunDir, placement: RankPlacement, world: int, attempt: int, group_ranks: dict,
                 *, device: str, enabled: bool = True, tokens_per_step: int | None = None,
                 flops_per_step: float | None = None, microbatches: int = 1, tp: int = 1, manifest=None):
        self.run, self.placement, self.world = run, placement, world
        self.device = device
        self.recorder = Recorder(run.run_id, run.spool(placement.rank), placement.rank, group_ranks,
                                 enabled=enabled, attempt=attempt)
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.microbatches, self.tp = microbatches, tp
        self.manifest = manifest  # rank 0's ManifestWriter when this session wrote the manifest
        self.params = 0  # counted by watch(): model FLOPs per token ~ 6 x params
        self.mem: MemoryProbe | None = None
        self.pending: deque[_Pending] = deque()
        self.placements: list[RankPlacement] = [placement]  # every rank's, as gathered by init
        self.finished = False
        self.last_step: int | None = None
        self._step: StepHandle | None = None
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self._phase_ev0 = None
        self._t_start = self._p0 = self._cpu0 = 0.0
        self._auto_tokens = 0
        self._error: str | None = None  # an uncaught exception's reason, for the exit event at interpreter exit

    # -- the model -------------------------------------------------------------------
    def watch(self, model, *, mesh=None, stages=(), comm_hook=None, comm_state=None):
        """Attach the timing hooks ``model`` needs (see ``ranksight.instrument.watch.attach``) and label its
        phases; returns ``model``. Call once, after wrapping (DDP, ``fully_shard``, TP) and before the first step.
        ``comm_hook``/``comm_state``: your own DDP comm hook, timed instead of registered by you."""
        import torch

        parts = list(model) if isinstance(model, (list, tuple)) else [model]
        if self.recorder.enabled:
            from torch.nn.parallel import DistributedDataParallel

            for part in parts:
                if isinstance(part, DistributedDataParallel) and part.process_group is not None:
                    import torch.distributed as dist

                    self.recorder.group_ranks["dp"] = dist.get_process_group_ranks(part.process_group)
            what = attach(self.recorder, model, mesh=mesh, stages=stages, comm_hook=comm_hook, comm_state=comm_state)
            for part in parts:
                self._label_phases(part)
            self.recorder.event("watch", what)
        first = next((p for part in parts for p in part.parameters()), None)
        if first is not None:
            self.device = first.device.type if first.device.type in ("cuda", "cpu") else self.device
        self.params = sum(p.numel() for part in parts for p in part.parameters())
        if self.manifest is not None and self.manifest.m is not None:
            self.manifest.m.params = self.params
            self.manifest.m.flops_per_token = 6.0 * self.params / max(1, self.tp)
            self.manifest.m.device = self.device
            if self.device == "cuda":
                self.manifest.m.layout.pop("simulated_gpus", None)
            if self.device == "cuda" and (self.manifest.m.peak_flops <= 0 or self.manifest.m.peak_simulated):
                _set_gpu_peak(self.manifest.m, torch.cuda.get_device_name())
            self.manifest.write()
        return model

    def _label_phases(self, module) -> None:
        """Forward pre-hook: phase "forward" (and the step's tokens from the input); a gradient hook on the
        output: phase "backward". Only the label the collectives inside are filed under; timing is the loop's."""
        import torch

        def pre(mod, args):
            if self._phase is None:
                self.recorder.phase = "forward"
            if self.tokens_per_step is None and args and isinstance(args[0], torch.Tensor):
                x = args[0]
                # token ids (integers): every element is a token; features (floats): one sample per row
                self._auto_tokens += x.numel() if not x.is_floating_point() else (x.shape[0] if x.dim() else 1)

        def post(mod, args, out):
            t = first_grad_tensor(out)
            if t is not None and self._phase is None:
                t.register_hook(self._on_backward)

        # prepended: the label must be set before FSDP2's own pre-forward hook issues the step's first all-gather
        # (else it would run under the previous step's "backward" label, and count as the gradient sync)
        module.register_forward_pre_hook(pre, prepend=True)
        module.register_forward_hook(post, prepend=True)

    def _on_backward(self, grad):
        if self._phase is None:
            self.recorder.phase = "backward"

    # -- steps -----------------------------------------------------------------------
    def begin_step(self, step: int) -> StepHandle:
        """Start step ``step`` (for loops that cannot use ``with rs.step(n)``, e.g. framework callbacks)."""
        if self._step is not None:
            self.end_step()
        rec = self.recorder
        if rec.clock is None and self.device == "cuda" and rec.enabled:
            import torch

            rec.clock = DeviceClock(torch.cuda.current_device())
        if self.mem is None:
            self.mem = MemoryProbe(_Device(self.device))
        rec.begin_step(step)
        rec.phase = "forward"  # a step starts in forward until the loop or the model hooks say otherwise
        self._step = StepHandle(step)
        self._auto_tokens = 0
        self._t_start, self._p0, self._cpu0 = time.time(), time.perf_counter(), time.thread_time()
        return self._step

    def end_step(self, **values) -> StepHandle | None:
        """End the open step and write its record (on CUDA, once its device events have run)."""
        h = self._step
        if h is None:
            return None
        if values:
            h.report(**values)
        self.set_phase(None)
        self._step = None
        p1, t_end = time.perf_counter(), time.time()
        rec = self.recorder
        cpu_s = time.thread_time() - self._cpu0
        t = rec.take_step()
        h.step_ms = (p1 - self._p0) * 1000.0
        self.last_step = h.step
        if not rec.enabled:
            return h
        h.mem_bytes = self.mem.sample()
        exposed, sync_arrival, wait = comm_summary(t.collectives, t.blocked_comm)
        v = h.values
        tokens = v.tokens if v.tokens is not None else (self.tokens_per_step or self._auto_tokens)
        flops = v.flops if v.flops is not None else self.flops_per_step
        if flops is None:
            flops = 6.0 * self.params * tokens / max(1, self.tp)
        p = self.placement
        r = StepRecord(
            run_id=rec.run_id, rank=p.rank, node=p.node, host=p.host, attempt=rec.attempt, world_size=self.world,
            pp_stage=p.pp_stage, dp_rank=p.dp_rank, tp_rank=p.tp_rank, step=h.step, t_start=self._t_start,
            t_end=t_end, step_ms=h.step_ms, data_ms=t.data * 1000, forward_ms=t.forward * 1000,
            backward_ms=t.backward * 1000, optimizer_ms=t.optimizer * 1000, comm_ms=exposed * 1000,
            pipeline_wait_ms=t.pipeline_wait * 1000, sync_arrival=sync_arrival,
            sync_wait_ms=None if wait is None else wait * 1000, tokens=int(tokens), flops=float(flops),
            microbatches=v.microbatches or self.microbatches, lr=float(v.lr or 0.0), mem_bytes=h.mem_bytes,
            profiling=v.profiling, loss_scale=None if v.loss_scale is None else float(v.loss_scale),
            overflow=bool(v.overflow), skipped=bool(v.skipped),
            # CPU: the training thread's CPU time, less what it spent inside collectives (gloo can poll)
            device_ms=(cpu_s - t.comm_cpu) * 1000.0 if self.device == "cpu" else None)
        r.compute_ms = max(0.0, r.step_ms - r.data_ms - r.comm_ms - r.pipeline_wait_ms)
        h.compute_ms = r.compute_ms
        if t.marks is None:
            self.write_record(r, t, v)
        else:
            t.marks.end = rec.mark()
            self.pending.append(_Pending(r, t, v))
            self.resolve_device_steps()
        return h

    @contextlib.contextmanager
    def step(self, step: int, **values):
        """``with rs.step(n) as s:`` around one training step (``values``: as ``s.report``)."""
        h = self.begin_step(step)
        if values:
            h.report(**values)
        try:
            yield h
        except BaseException as e:
            self.fail(exit_reason(e))
            raise
        self.end_step()

    # -- phases ----------------------------------------------------------------------
    def set_phase(self, name: str | None) -> None:
        """Switch the step's phase: the running one ends (its wall time is added to the step), ``name`` starts
        (None: no phase)."""
        if name is not None and name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        rec = self.recorder
        now = time.perf_counter()
        if self._phase is not None:
            setattr(rec.t, self._phase, getattr(rec.t, self._phase) + now - self._phase_t0)
            if self._phase == "data" and self._phase_ev0 is not None and rec.t.marks is not None:
                rec.t.marks.data.append((self._phase_ev0, rec.mark()))
        self._phase = name
        if name is not None:
            rec.phase = name
            self._phase_t0 = now
            self._phase_ev0 = rec.mark() if name == "data" else None

    @contextlib.contextmanager
    def phase(self, name: str):
        """``with rs.phase("forward"):`` — time one phase of the step."""
        self.set_phase(name)
        try:
            yield
        finally:
            if self._phase == name:
                self.set_phase(None)

    # -- collectives and events the loop issues itself ---------------------------------
    def timed(self, op: str, group_name: str, fn, /, *args, nbytes: int = 0, sync: bool = False, **kwargs):
        """Run a blocking collective ``fn(*args, **kwargs)`` with arrival/completion timing, filed under the
        communicator ``group_name`` (e.g. "dp", "pp", "world")."""
        return self.recorder.timed(op, group_name, fn, *args, nbytes=nbytes, sync=sync, **kwargs)

    def event(self, name: str, detail: dict | None = None, step: int | None = None) -> None:
        self.recorder.event(name, detail, step)

    # -- CUDA: steps resolved once their device events have run --------------------------
    def resolve_device_steps(self, wait: bool = False) -> None:
        """Write the pending CUDA steps whose events have all run (all of them with ``wait``)."""
        while self.pending:
            head = self.pending[0]
            if wait or len(self.pending) > MAX_PENDING_STEPS:
                head.times.marks.end.synchronize()  # that event only; later work keeps running
            if not all(has_run(ev) for ev in _events(head.times)):
                if wait:
                    import torch

                    torch.cuda.synchronize()
                else:
                    return
            self.pending.popleft()
            _apply_device_times(head.record, head.times)
            self.write_record(head.record, head.times, head.values)

    def write_record(self, r: StepRecord, t: StepTimes, v: StepValues) -> None:
        loss = _as_float(v.loss)
        r.loss = loss if loss is not None and math.isfinite(loss) else None
        r.loss_nonfinite = loss is not None and not math.isfinite(loss)
        gn = _as_float(v.grad_norm)
        r.grad_norm = gn if gn is not None and math.isfinite(gn) else None
        spool = self.recorder.spool
        for c in t.collectives:
            spool.add(self.recorder.collective_record(c, r.step))
        spool.add(r)
        spool.flush()

    # -- the end -----------------------------------------------------------------------
    def finish(self, reason: str = "finished") -> None:
        """Record the end of this rank's run: the open step, the pending device steps, the ``exit`` event (and
        the manifest's end on rank 0 when the run finished). Idempotent."""
        if self.finished:
            return
        self.finished = True
        try:
            if self._step is not None:
                self.end_step()
            if self.pending:
                self.resolve_device_steps(wait=True)
        finally:
            self.recorder.event("exit", {"reason": reason, "step": self.last_step})
            if self.manifest is not None and reason == "finished":
                self.manifest.finish()

    def fail(self, reason: str) -> None:
        """The step (or run) failed: write the collectives this rank was in, then ``exit`` with ``reason``."""
        if self.finished:
            return
        self.finished = True
        self._step = None
        self.recorder.flush_unfinished(reason)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.finish()
        else:
            self.fail(exit_reason(exc))

    def install_exit_handlers(self) -> None:
        """Record the end at interpreter exit (with an uncaught exception's reason) and on SIGTERM (only where
        nobody else handles SIGTERM: a handler the loop or its framework installed is left alone)."""
        atexit.register(lambda: self.finish(self._error or "finished"))
        previous_hook = sys.excepthook

        def excepthook(tp, value, tb):
            self._error = exit_reason(value)
            previous_hook(tp, value, tb)

        sys.excepthook = excepthook
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            def on_term(signum, frame):
                self.finish("signal SIGTERM")
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

            signal.signal(signal.SIGTERM, on_term)


# -- helpers -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Device:
    type: str


def exit_reason(e: BaseException) -> str:
    """An exception as the ``exit`` event's reason: its type and (the start of) its message."""
    return f"{type(e).__name__}: {str(e)[:400]}"


def _as_float(x) -> float | None:
    if x is None:
        return None
    try:
        return float(x.detach() if hasattr(x, "detach") else x)
    except (TypeError, ValueError, RuntimeError):
        return None


def first_grad_tensor(out):
    """The output's first tensor that needs a gradient (a tensor, or in a tuple, list or dict such as a ModelOutput)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
    return None


def _events(t: StepTimes):
    yield from t.marks.events()
    for c in t.collectives:
        yield c.ev_arrive
        yield c.ev_block
        yield c.ev_done


def _apply_device_times(r: StepRecord, t: StepTimes) -> None:
    """Replace the host's view of the step's communication with the device's: collectives' arrival/completion,
    exposed comm, sync arrival and wait; and set ``device_ms`` (the stream's span less its waits)."""
    marks = t.marks
    a = marks.anchor
    blocked = 0.0
    for c in t.collectives:
        _device_collective(c, a)
        if not c.async_bucket and c.ev_block is not None and c.ev_done is not None:
            blocked += max(0.0, c.ev_block.elapsed_time(c.ev_done) / 1000.0)
    exposed, sync_arrival, wait = comm_summary(t.collectives, blocked)
    pw = marks.span_s(marks.pipeline_wait)
    span = marks.start.elapsed_time(marks.end) / 1000.0
    r.comm_ms = exposed * 1000.0
    r.sync_arrival = sync_arrival
    r.sync_wait_ms = None if wait is None else wait * 1000.0
    if marks.pipeline_wait:
        r.pipeline_wait_ms = pw * 1000.0
    r.device_ms = max(0.0, span - exposed - pw - marks.span_s(marks.data)) * 1000.0
    r.compute_ms = max(0.0, r.step_ms - r.data_ms - r.comm_ms - r.pipeline_wait_ms)


def _device_collective(c: OpenCollective, anchor) -> None:
    if c.ev_arrive is not None:
        c.t_arrive = wall(anchor, c.ev_arrive)
    if c.ev_done is not None:
        c.t_done = wall(anchor, c.ev_done)


def _set_gpu_peak(m, name: str) -> None:
    from ranksight.peaks import gpu_peak

    known = gpu_peak(name)
    if known is not None:
        m.peak_flops, m.peak_source, m.peak_simulated = known[0], known[1], False
    else:
        m.peak_flops, m.peak_simulated = 0.0, False
        m.peak_source = f"unknown GPU {name!r}: no peak in ranksight.peaks (pass peak_flops= to ranksight.init)"


def host_name() -> str:
    return os.environ.get("RANKSIGHT_HOST") or socket.gethostname()
