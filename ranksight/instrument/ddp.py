"""DDP: a comm hook that times each gradient bucket, around ``allreduce_hook`` or the user's own hook."""

from __future__ import annotations

import time

from ranksight.instrument.recorder import Recorder


def make_ddp_comm_hook(recorder: Recorder, inner=None):
    """DDP calls the hook when a gradient bucket is ready on *this* rank (= arrival). The future's callback runs
    when the bucket's collective has completed (= done); on CUDA its device event is recorded there, on the stream
    the callback runs on, which waits for the collective.

    ``inner``: the comm hook the user would register (``fp16_compress_hook``, PowerSGD, ...); None does what
    ``allreduce_hook`` does."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    plain = inner if inner is not None else allreduce_hook

    def hook(state, bucket):
        if not recorder.enabled:  # switched off at run time (bench/overhead.py): the plain hook
            return plain(state, bucket)
        buf = bucket.buffer()
        # overlapped with backward: exposed time is computed by comm_summary()
        c = recorder.enter("all_reduce", "dp", buf.numel() * buf.element_size(), sync=True, async_bucket=True)
        clock = recorder.clock

        if inner is not None:
            def done_inner(f):
                value = f.value()  # raises if the collective failed (e.g. timed out): t_done stays None
                c.t_done = time.time()
                if clock is not None:
                    c.ev_done = clock.mark()
                return value

            return inner(state, bucket).then(done_inner)

        # allreduce_hook's own steps (default_hooks._allreduce_fut), with the completion time taken in its one
        # ``then`` callback: chaining a second callback after allreduce_hook's costs a future and a Python call
        # (with the GIL, on gloo's thread) per bucket.
        group = state if state is not None else dist.group.WORLD
        buf.div_(group.size())

        def done(f):
            value = f.value()[0]  # raises if the all-reduce failed (e.g. timed out): t_done stays None
            c.t_done = time.time()
            if clock is not None:
                c.ev_done = clock.mark()
            return value

        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(done)

    return hook
