"""FSDP2: custom reduce-scatter / all-gather that time the (blocking) collectives."""

from __future__ import annotations

from ranksight.instrument.recorder import Recorder


def make_fsdp_comms(recorder: Recorder):
    """A (reduce-scatter, all-gather) pair for ``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``
    (public methods), or None where this torch has no default implementations to time (they live in a private
    module, ``torch.distributed.fsdp._fully_shard._fsdp_collectives``, that may move between releases)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return None

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
