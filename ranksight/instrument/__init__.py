"""The in-process instrumentation: what a training loop imports (``ranksight.init``) to be observed.

- ``session``: ``Session`` (``watch``, ``step``, ``phase``, ``event``, ``finish``) and the step record it writes.
- ``recorder``: ``Recorder``, collective arrival/completion and the step's timings; ``comm_summary``.
- ``watch``: ``attach``, the timing hooks for DDP, FSDP2, tensor and pipeline parallelism.
- ``ddp``, ``fsdp``, ``tensor_parallel``, ``pipeline``: the hooks, one module per parallelism.
- ``device_time``: CUDA events on the training stream and their wall times (``DeviceClock``).
- ``memory``: the step's memory peak.  ``manifest``: the run manifest (run.json) rank 0 writes, and the peak.

It imports torch; the rest of ``ranksight`` (the shared formats the agent and the head use) does not.
"""

from __future__ import annotations

import os
import uuid

from ranksight.instrument.session import DEFAULT_STORE, Session, StepHandle, host_name

__all__ = ["init", "Session", "StepHandle"]


def init(run_id: str | None = None, store: str | os.PathLike | None = None, *, node: int | None = None,
         host: str | None = None, mesh=None, device: str | None = None, tokens_per_step: int | None = None,
         flops_per_step: float | None = None, peak_flops: float | None = None, microbatches: int = 1,
         config: dict | None = None, write_manifest: bool = True, enabled: bool = True,
         exit_handlers: bool = True) -> Session:
    """Instrument this rank. Call on every rank, after ``torch.distributed.init_process_group`` (it is a
    collective then: the ranks agree on the run id and exchange where they run).

    - ``run_id``: else ``$RANKSIGHT_RUN_ID``, else torchrun's ``$TORCHELASTIC_RUN_ID``, else one rank 0 makes up.
    - ``store``: the directory node agents watch; else ``$RANKSIGHT_STORE``, else ``./runs`` (where ``diagnose`` looks too).
    - rank, world size and local rank from torch.distributed and torchrun's environment; ``node`` (else
      ``$RANKSIGHT_NODE``, torchrun's ``$GROUP_RANK``, or the index of this host among the job's hosts) and
      ``host`` (else ``$RANKSIGHT_HOST`` or the host name).
    - ``mesh``: a device mesh with named dims ``dp``/``tp``/``pp`` when the job has more than data parallelism.
    - ``tokens_per_step``/``flops_per_step``: per rank; else counted from the model's input and ~6 x params.
    - ``peak_flops``: per device, for MFU; else the GPU's from ``ranksight.peaks``, or on a CPU a measured matmul
      peak (labelled as a CPU figure, not a GPU's).
    - ``write_manifest``: rank 0 writes the run's manifest (run.json) unless it exists for an earlier attempt.
    - ``enabled=False``: nothing is written and no hook is attached (the loop runs unchanged).
    """
    import torch
    import torch.distributed as dist

    from ranksight.layout import RunDir
    from ranksight.schema import RankPlacement

    dist_on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if dist_on else int(os.environ.get("RANK", "0"))
    world = dist.get_world_size() if dist_on else int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    host = host or host_name()
    if device is None:
        # the job's device: NCCL's, or one the loop has already put to use (gloo can carry CUDA tensors too);
        # rs.watch(model) corrects it from the model's parameters
        on_gpu = torch.cuda.is_available() and (torch.cuda.is_initialized() or (dist_on and dist.get_backend() == "nccl"))
        device = "cuda" if on_gpu else "cpu"
    run_id = run_id or os.environ.get("RANKSIGHT_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None
    if run_id is None or run_id == "none":
        made = [f"run-{uuid.uuid4().hex[:8]}"]
        if dist_on:
            dist.broadcast_object_list(made, src=0)
        run_id = made[0]
    store = store or os.environ.get("RANKSIGHT_STORE") or DEFAULT_STORE
    run = RunDir(store, run_id)

    if node is None and os.environ.get("RANKSIGHT_NODE", "") != "":
        node = int(os.environ["RANKSIGHT_NODE"])
    if node is None and os.environ.get("GROUP_RANK", "") != "":
        node = int(os.environ["GROUP_RANK"])
    coords = _mesh_coords(mesh, rank, world)
    me = RankPlacement(rank=rank, node=-1 if node is None else node, host=host, local_rank=local_rank,
                       pp_stage=coords["pp"][0], dp_rank=coords["dp"][0], tp_rank=coords["tp"][0],
                       gpu=local_rank if device == "cuda" else None)
    placements = [me]
    if dist_on and world > 1:
        placements = [None] * world
        dist.all_gather_object(placements, me)
    if any(p.node < 0 for p in placements):
        hosts = sorted({p.host for p in placements})
        for p in placements:
            p.node = hosts.index(p.host)
    me = placements[rank] if len(placements) > rank else me
    group_ranks = {"world": list(range(world)), "dp": coords["dp"][1], "tp": coords["tp"][1], "pp": coords["pp"][1]}
    writer = None
    if enabled and write_manifest and rank == 0:
        writer = _write_manifest(run, placements, world, coords, device, dist_on, config, peak_flops)
    if enabled and write_manifest and dist_on and world > 1 and device == "cpu" and peak_flops is None:
        dist.barrier()  # the other ranks wait while rank 0 measures the CPU peak, so it has the cores to itself
    session = Session(run, me, world, attempt, group_ranks, device=device, enabled=enabled,
                      tokens_per_step=tokens_per_step, flops_per_step=flops_per_step, microbatches=microbatches,
                      tp=coords["tp"][2], manifest=writer)
    session.placements = placements
    if enabled:
        session.event("start", {"attempt": attempt, "world_size": world, "node": me.node, "host": host,
                                "device": device})
        if exit_handlers:
            session.install_exit_handlers()
    return session


def _mesh_coords(mesh, rank: int, world: int) -> dict[str, tuple[int, list[int], int]]:
    """{dim: (this rank's index, the group's global ranks, size)} for dp/tp/pp; without a mesh, pure DP."""
    out = {"dp": (rank, list(range(world)), world), "tp": (0, [rank], 1), "pp": (0, [rank], 1)}
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if mesh is not None:
        import torch.distributed as dist

        for dim in ("dp", "tp", "pp"):
            if dim in names:
                sub = mesh[dim]
                out[dim] = (sub.get_local_rank(), dist.get_process_group_ranks(sub.get_group()), sub.size())
    return out


def _write_manifest(run, placements, world: int, coords, device: str, dist_on: bool, config, peak_flops):
    """Rank 0: the run's manifest, unless an earlier attempt's (kept, with this attempt appended)."""
    import torch
    import torch.distributed as dist

    from ranksight.instrument.manifest import ManifestWriter, attempt_entry, make_manifest, measure_cpu_peak
    from ranksight.peaks import gpu_peak

    if peak_flops is not None:
        peak = (float(peak_flops), "given to ranksight.init(peak_flops=...)", False)
    elif device == "cuda":
        name = torch.cuda.get_device_name()
        known = gpu_peak(name)
        peak = (known[0], known[1], False) if known else (0.0, f"unknown GPU {name!r}: pass peak_flops=", False)
    else:
        peak = measure_cpu_peak()
    layout = {"world": world, "dp": coords["dp"][2], "tp": coords["tp"][2], "pp": coords["pp"][2]}
    backend = dist.get_backend() if dist_on else "none"
    m = make_manifest(run.run_id, dict(config or {}), layout, placements, backend, torch.device(device), 0.0, 0,
                      peak=peak)
    if device == "cpu":
        m.layout["simulated_gpus"] = "no GPU: device time is the training thread's CPU time (a CPU stand-in)"
    writer = ManifestWriter(run)
    writer.start(m, attempt_entry(world, None))
    return writer
