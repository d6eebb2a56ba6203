"""Everything about *how* the model is spread over ranks; the model code knows nothing of it.

Order (as torchtitan): build the full model from the seed, cut out this rank's
pipeline stage(s), apply tensor parallel on mesh["tp"], then the data-parallel
wrapper on mesh["dp"], then wrap stages in a pipeline schedule on mesh["pp"].

Rules learned on this machine (shared/research/torch-cpu-feasibility.md):
- with TP, FSDP2 is always used on the dp dim, even dp=1: DDP turns DTensor params
  back into local shards and clipping then sees a shard-local norm (silently wrong);
  with every param a DTensor, foreach optimizers, clipping and GradScaler work.
- with PP, FSDP2 uses reshard_after_forward=False (micro-batches re-use the params).
- clipping is done per device mesh, then summed over the pp group (stages own disjoint params).

Nothing here observes anything: the instrumentation (trainer/instrument) attaches its timing hooks to what
this module built, afterwards, in one call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import PP_SCHEDULES, TrainConfig
from trainer.model import GPT, init_weights


def pick_backend() -> tuple[str, torch.device]:
    """NCCL on GPUs, gloo on CPU, chosen automatically."""
    if torch.cuda.is_available():
        import os

        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def init_distributed(backend: str, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    # Sub-groups (the mesh's dp/tp/pp groups) take torch's *default* timeout (30 min for
    # gloo), not the world group's. Set the default so a hang surfaces on every group
    # after --pg-timeout.
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.init_process_group(backend, timeout=timeout)


@dataclass
class Layout:
    dp: int
    tp: int
    pp: int
    world: int
    pp_rank: int
    dp_rank: int
    tp_rank: int


def resolve_layout(cfg: TrainConfig, world: int) -> tuple[int, int, int]:
    p = cfg.parallel
    if world % (p.tp * p.pp):
        raise SystemExit(f"ranksight train: world size {world} is not divisible by tp*pp = {p.tp}*{p.pp}; "
                         "pp and tp cannot change across an elastic restart, only dp can")
    dp = world // (p.tp * p.pp)
    if p.dp and p.dp != dp:
        import os

        if "TORCHELASTIC_RESTART_COUNT" in os.environ and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0:
            pass  # elastic re-formation at a new world size: dp follows the world (that is what evict needs)
        else:
            raise SystemExit(f"ranksight train: --dp {p.dp} x --tp {p.tp} x --pp {p.pp} = {p.dp * p.tp * p.pp} "
                             f"but the world size is {world}")
    return dp, p.tp, p.pp


def build_mesh(device: torch.device, dp: int, tp: int, pp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[str]:
    """Contiguous, as-even-as-possible split of layer indices over stages."""
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    count = base + (1 if stage < extra else 0)
    return [str(i) for i in range(start, start + count)]


def apply_tp(module: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for blk in module.layers.values():
        parallelize_module(blk, tp_mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(),
        })


def apply_fsdp(module: nn.Module, dp_mesh, reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    for blk in module.layers.values():
        fully_shard(blk, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def apply_ddp(module: nn.Module, dp_mesh, pipeline: bool = False) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Under a pipeline stage every micro-batch's backward but the last runs in no_sync, and
    # the reducer records the gradient-ready order for its one-time bucket rebuild across
    # *all* of them: with few micro-batches (e.g. M = pp = 2) it saw each parameter twice and
    # the next forward died with "rebuilt parameter indices size is not same as original
    # model parameters size". find_unused_parameters turns the rebuild off (and traverses the
    # stage output's graph, which is small); buckets keep their construction order.
    return DDP(module, process_group=dp_mesh.get_group(), find_unused_parameters=pipeline)


def uses_fsdp(cfg: TrainConfig) -> bool:
    """FSDP2 on the dp dim: when asked, always with TP (see module doc), and with interleaved PP
    (DDP's reducer fails when one rank holds two stage modules: "rebuilt parameter indices size
    is not same as original model parameters size")."""
    p = cfg.parallel
    return p.dp_mode == "fsdp" or p.tp > 1 or (p.pp > 1 and p.pp_schedule == "interleaved")


def build_model_parts(cfg: TrainConfig, mesh, layout: Layout, device: torch.device):
    """Returns (model_parts, stage_ids): one part without PP, V parts per rank with interleaved PP."""
    full = GPT(cfg.model)
    init_weights(full, cfg.seed)
    for blk in full.layers.values():
        blk.checkpoint_activations = cfg.activation_checkpointing
    p = cfg.parallel
    v = p.virtual_stages if (p.pp > 1 and p.pp_schedule == "interleaved") else 1
    n_stages = p.pp * v
    stage_ids = [layout.pp_rank + k * p.pp for k in range(v)]  # looped assignment (interleaved 1F1B)
    parts = []
    for s in stage_ids:
        m = full if n_stages == 1 else copy.deepcopy(full)
        if n_stages > 1:
            keep = set(stage_layers(cfg.model.n_layers, n_stages, s))
            for name in list(m.layers.keys()):
                if name not in keep:
                    del m.layers[name]
            if s != 0:
                m.tok = m.pos = None
            if s != n_stages - 1:
                m.norm = m.head = None
        m.to(device)
        if p.tp > 1:
            apply_tp(m, mesh["tp"])
        if uses_fsdp(cfg):
            apply_fsdp(m, mesh["dp"], reshard_after_forward=p.pp == 1)
        else:
            m = apply_ddp(m, mesh["dp"], pipeline=n_stages > 1)
        parts.append(m)
    return parts, stage_ids, n_stages


def build_pipeline(cfg: TrainConfig, parts, stage_ids, n_stages, mesh, device, pp_loss_fn):
    """A PipelineStage per part and the schedule over them; returns (schedule, stages)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    group = mesh["pp"].get_group()
    stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(parts, stage_ids)]
    cls = get_schedule_class(PP_SCHEDULES[cfg.parallel.pp_schedule])
    m = cfg.parallel.microbatches
    if issubclass(cls, PipelineScheduleSingle):
        sched = cls(stages[0], n_microbatches=m, loss_fn=pp_loss_fn)
    else:
        sched = cls(stages, n_microbatches=m, loss_fn=pp_loss_fn)
    return sched, stages


def clip_grad_norm_(params, max_norm: float, pp_group=None, all_reduce=dist.all_reduce) -> torch.Tensor:
    """Total grad norm over all params of the model (every stage), clipping to max_norm if > 0.

    Norms are computed per device mesh (mixed Tensor/DTensor or DTensors on different
    meshes cannot be stacked), squared-summed, then summed over the pp group with
    ``all_reduce(tensor, group=pp_group)`` (the training loop passes one it times).
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    groups: dict = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p.grad)
    device = params[0].grad.device if params else torch.device("cpu")
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.float() ** 2
    if pp_group is not None:
        all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    if max_norm > 0 and torch.isfinite(total):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total
