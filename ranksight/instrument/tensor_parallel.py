"""Tensor parallel: DTensor's functional all-reduces, timed from issue to wait."""

from __future__ import annotations

import time

from ranksight.instrument.recorder import Recorder


def install_tp_timing(recorder: Recorder, dp: int) -> None:
    """DTensor redistributions (TP forward outputs, backward input-grads, norms) call
    ``torch.distributed._functional_collectives.all_reduce`` (arrival: the collective is issued)
    and later block in its ``wait_tensor`` (done). Both are looked up as module globals, so
    wrapping them times every TP all-reduce in forward *and* backward. Only the time actually
    spent inside ``wait_tensor`` counts as blocked communication.

    Without data parallelism (``dp == 1``) the backward TP all-reduces are where the ranks synchronize
    in backward: they stand in for the gradient sync (sync_arrival / sync_wait_ms)."""
    import torch.distributed._functional_collectives as funcol

    recorder.tp_is_sync = dp == 1
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
        sync = recorder.tp_is_sync and recorder.phase == "backward" and name == "tp"
        c = recorder.enter("all_reduce", name, self.numel() * self.element_size(), sync=sync)
        out = orig_all_reduce(self, reduceOp, group, tag)
        elem = out.elem if isinstance(out, funcol.AsyncCollectiveTensor) else out
        recorder.tp_issued(id(elem), c)
        if not isinstance(out, funcol.AsyncCollectiveTensor):  # already waited (tracing path)
            recorder.tp_pending.pop(id(elem), None)
            recorder.leave(c)
        return out

    def wait_tensor(tensor):
        if not recorder.enabled:
            return orig_wait(tensor)
        c = recorder.tp_pending.pop(id(tensor), None)
        t0, cpu0 = time.time(), time.thread_time()
        ev_block = recorder.mark()  # CUDA: where the compute stream starts waiting for the result
        out = orig_wait(tensor)
        recorder.t.comm_cpu += time.thread_time() - cpu0
        if c is not None:
            c.t_done = time.time()
            if ev_block is not None:
                c.ev_block, c.ev_done = ev_block, recorder.mark()
            recorder.t.blocked_comm += c.t_done - t0
        return out

    funcol.all_reduce = all_reduce
    funcol.wait_tensor = wait_tensor
    funcol._ranksight_wrapped = True
