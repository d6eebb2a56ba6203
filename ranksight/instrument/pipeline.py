"""Pipeline parallel: the schedules' p2p waits (the bubble), every send and recv, and the stages' chunk times."""

from __future__ import annotations

import time

from ranksight.instrument.recorder import OpenCollective, Recorder


def install_p2p_timing(recorder: Recorder) -> None:
    """Wrap ``torch.distributed.pipelining.schedules``' p2p helpers (looked up as module globals
    by every schedule). Time waiting for a p2p batch is pipeline wait.

    Every send and recv is also recorded, as the flight recorder does: one CollectiveRecord per op on
    a *directed link* communicator ``pp:<src>><dst>`` (``Recorder.enter_link``). Arrival: a sender when
    it posts its data; a receiver when it starts waiting for the data (a recv may be posted early and
    waited on later). Completion: when this rank's wait on that op returned. A p2p op that never completed
    (the peer hung or died) stays open and is written by ``flush_unfinished``: the hang analyzer then names
    the rank that never joined."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    if getattr(schedules, "_ranksight_wrapped", False):
        return
    orig_wait, orig_batch = schedules._wait_batch_p2p, schedules._batch_p2p
    # id(works list) -> (the list, its ops' records). Holding the list keeps its id from being reused.
    pending: dict[int, tuple[list, list[OpenCollective]]] = {}

    def _wait_batch_p2p(work):
        if not recorder.enabled:
            return orig_wait(work)
        t0, w0, cpu0 = time.perf_counter(), time.time(), time.thread_time()
        ev0 = recorder.mark()
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
        ev1 = recorder.mark()
        for c in recs:
            if c.t_done is None:
                c.t_done = now
            if ev1 is not None:
                c.ev_done = ev1
                if c.op == "recv":
                    c.ev_arrive = c.ev_block = ev0
        recorder.add_pipeline_wait(time.perf_counter() - t0, ev0, ev1)
        recorder.t.comm_cpu += time.thread_time() - cpu0

    def _batch_p2p(p2p_ops, desc=None):
        recs: list[OpenCollective] = []
        if recorder.enabled and p2p_ops:
            t_post, ev_post = time.time(), recorder.mark()
            for p in p2p_ops:
                send = p.op in (dist.isend, dist.send)
                src, dst = (recorder.rank, int(p.peer)) if send else (int(p.peer), recorder.rank)
                recs.append(recorder.enter_link("send" if send else "recv", src, dst,
                                                p.tensor.numel() * p.tensor.element_size(), t_post, ev_post))
        works = orig_batch(p2p_ops, desc=desc) if desc is not None else orig_batch(p2p_ops)
        if recs:
            pending[id(works)] = (works, recs)
        return works

    schedules._wait_batch_p2p = _wait_batch_p2p
    schedules._batch_p2p = _batch_p2p
    schedules._ranksight_wrapped = True


def time_stage_chunks(stage, recorder: Recorder) -> None:
    """Wrap a ``PipelineStage``'s ``forward_one_chunk`` / ``backward_one_chunk``: their wall time is this rank's
    forward / backward time, and they set the recorder's phase."""
    stage.forward_one_chunk = _timed_chunk(stage.forward_one_chunk, "forward", recorder)
    stage.backward_one_chunk = _timed_chunk(stage.backward_one_chunk, "backward", recorder)


def _timed_chunk(run_chunk, phase: str, recorder: Recorder):
    """``run_chunk`` with its wall time added to the step's ``phase`` time (StepTimes.forward or .backward)."""

    def chunk(*a, **kw):
        recorder.phase = phase
        t0 = time.perf_counter()
        out = run_chunk(*a, **kw)
        setattr(recorder.t, phase, getattr(recorder.t, phase) + time.perf_counter() - t0)
        return out

    return chunk
