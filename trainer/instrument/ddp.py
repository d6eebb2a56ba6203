"""DDP: a comm hook that does what ``allreduce_hook`` does and times each gradient bucket."""

from __future__ import annotations

import time

from trainer.instrument.recorder import Recorder


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
