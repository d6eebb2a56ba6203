"""Per-rank instrumentation: what each rank did, step by step, written to its spool for the node agent.

The model and its parallelism (trainer/model.py, trainer/parallelize.py) know nothing of it: the training
loop builds them, then calls ``install`` once to attach the timing hooks the layout needs.

- ``recorder``: ``Recorder`` (step timings, collective arrival/completion, events; the spool) and
  ``StepWriter`` (the StepRecord at the end of a step); ``FaultHook``, what the hooks ask of the injected faults.
- ``ddp``, ``fsdp``, ``tensor_parallel``, ``pipeline``: the timing hooks, one module per parallelism.
- ``memory``: ``MemoryProbe``, the step's memory peak.
- ``overhead_toggle``: ``OverheadToggle``, instrumentation on/off in blocks of steps (the overhead benchmarks).

How each hook measures is described in docs/trainer.md.
"""

from __future__ import annotations

from trainer.instrument.ddp import make_ddp_comm_hook
from trainer.instrument.fsdp import make_fsdp_comms
from trainer.instrument.pipeline import install_p2p_timing, time_stage_chunks
from trainer.instrument.recorder import Recorder
from trainer.instrument.tensor_parallel import install_tp_timing


def install(recorder: Recorder, model_parts, mesh, stages=()) -> None:
    """Attach every timing hook the parallelized model needs, reporting to ``recorder``.

    ``model_parts``: this rank's model parts as parallelized (DDP wrappers or FSDP2 modules); ``mesh``: the
    ``(pp, dp, tp)`` device mesh; ``stages``: this rank's ``PipelineStage``s (none without pipeline
    parallelism). Installs DDP's comm hook or FSDP2's timed collectives on each part, the functional
    collectives' timing when ``mesh["tp"]`` has more than one rank, and the pipeline schedules' p2p timing and
    each stage's chunk timing when there are stages. Call it before the first step, so that the hooks see
    every collective; not at all for ``--no-instrument``.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if mesh["tp"].size() > 1:
        install_tp_timing(recorder, dp=mesh["dp"].size())
    for part in model_parts:
        if isinstance(part, DistributedDataParallel):
            part.register_comm_hook(mesh["dp"].get_group(), make_ddp_comm_hook(recorder))
            continue
        reduce_scatter, all_gather = make_fsdp_comms(recorder)
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(reduce_scatter)
                module.set_custom_all_gather(all_gather)
    if stages:
        install_p2p_timing(recorder)
        for stage in stages:
            time_stage_chunks(stage, recorder)
