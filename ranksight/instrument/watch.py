"""``attach``: the timing hooks a parallelized model needs, through PyTorch's public hook points.

- DDP (``DistributedDataParallel``): a comm hook (``register_comm_hook``) around ``allreduce_hook`` or the user's own
  hook; each gradient bucket's arrival and completion.
- FSDP2 (``fully_shard``): ``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather`` with timed versions
  of FSDP2's default collectives.
- Tensor parallel (a device mesh with a ``tp`` dimension larger than 1): DTensor's functional all-reduces, issue to
  wait.
- Pipeline parallel (``PipelineStage`` objects): the schedules' p2p batches and each stage's chunks.
- Any model: a forward pre-hook and a gradient hook on its output that label the phase (forward, backward) for the
  collectives that run inside it, and count the step's tokens when the loop does not say.

How each hook measures is described in docs/trainer.md ("How the instrumentation measures").
"""

from __future__ import annotations

from ranksight.instrument.ddp import make_ddp_comm_hook
from ranksight.instrument.fsdp import make_fsdp_comms
from ranksight.instrument.pipeline import install_p2p_timing, time_stage_chunks
from ranksight.instrument.recorder import Recorder
from ranksight.instrument.tensor_parallel import install_tp_timing


def attach(recorder: Recorder, model, *, mesh=None, stages=(), comm_hook=None, comm_state=None) -> dict[str, list[str]]:
    """Attach every timing hook ``model`` needs (a module, or a list of model parts); returns
    ``{"attached": [...], "not_attached": [...]}`` in words, for the ``watch`` event.

    ``mesh``: a device mesh with named dims (``dp``, ``tp``, ``pp``) when the job has tensor parallelism;
    ``stages``: this rank's ``PipelineStage``s; ``comm_hook``/``comm_state``: the DDP comm hook and its state the
    loop would register itself (None: ``allreduce_hook`` on the DDP module's process group)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    attached: list[str] = []
    missing: list[str] = []
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    tp = _mesh_size(mesh, "tp")
    if tp > 1:
        install_tp_timing(recorder, dp=_mesh_size(mesh, "dp"))
        attached.append("tensor-parallel all-reduces")
    for part in parts:
        if isinstance(part, DistributedDataParallel):
            state = comm_state if comm_state is not None else part.process_group
            part.register_comm_hook(state, make_ddp_comm_hook(recorder, comm_hook))
            attached.append("DDP gradient buckets (comm hook)")
            continue
        fsdp_modules = [m for m in part.modules() if isinstance(m, FSDPModule)]
        if fsdp_modules:
            comms = make_fsdp_comms(recorder)
            if comms is None:
                missing.append("FSDP2 collectives: this torch has no default FSDP2 collectives to time")
            else:
                for module in fsdp_modules:
                    module.set_custom_reduce_scatter(comms[0])
                    module.set_custom_all_gather(comms[1])
                attached.append(f"FSDP2 reduce-scatter/all-gather ({len(fsdp_modules)} modules)")
        elif not stages:
            missing.append(f"{type(part).__name__}: neither DDP nor FSDP2, so no gradient-sync timing "
                           "(sync arrival and wait need one; time explicit collectives with rs.timed)")
    if stages:
        install_p2p_timing(recorder)
        for stage in stages:
            time_stage_chunks(stage, recorder)
        attached.append(f"pipeline p2p and {len(stages)} stage(s)")
    return {"attached": attached, "not_attached": missing}


def _mesh_size(mesh, dim: str) -> int:
    if mesh is None:
        return 1
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh[dim].size() if dim in names else 1
