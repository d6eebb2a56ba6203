"""The training loop: one process per rank, started by torchrun.

Ties together config -> model/parallelism -> data -> instrumentation -> faults ->
control channel -> checkpoints -> manifest. Per step every rank appends one StepRecord
(plus its CollectiveRecords) to its spool and reports to its simulated GPU (whose state
file is rewritten at most once a second, and at once on a fault; see trainer/simdevice.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import ranksight
from ranksight.instrument.manifest import ManifestWriter, attempt_entry, make_manifest, measure_cpu_peak
from ranksight.layout import RunDir, atomic_write
from trainer import checkpoint as ckpt
from trainer.config import TrainConfig
from trainer.control import REFORM_EXIT_CODE, REFORM_SLEEP_S, ControlChannel, evicted_marker
from trainer.data import DataLoader, make_dataset
from trainer.faults import FaultState, apply_config_faults, carry_onsets, parse_faults
from trainer.model import count_params, flops_per_token, loss_fn
from trainer.parallelize import (
    Layout,
    build_mesh,
    build_model_parts,
    build_pipeline,
    clip_grad_norm_,
    init_distributed,
    pick_backend,
    resolve_layout,
    uses_fsdp,
)
from trainer.netfault import LinkShaper
from trainer.overhead_toggle import OverheadToggle
from trainer.profiling import Profiler
from trainer.simdevice import SimulatedGpu

TP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _setup_nccl_logs(run: RunDir) -> None:
    # Only when the user has not chosen their own NCCL logging.
    if "NCCL_DEBUG" not in os.environ and "NCCL_DEBUG_FILE" not in os.environ:
        run.nccl_dir.mkdir(parents=True, exist_ok=True)
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ["NCCL_DEBUG_FILE"] = str(run.nccl_dir / "%h.%p.log")


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(cfg: TrainConfig) -> None:
    specs = parse_faults(cfg.inject)  # bad --inject fails here, before any process group
    apply_config_faults(cfg, specs)
    cfg.validate()
    run = RunDir(cfg.store, cfg.run_id)
    backend, device = pick_backend()
    if backend == "nccl":
        _setup_nccl_logs(run)
    init_distributed(backend, cfg.pg_timeout_s)
    rec = None
    try:
        rec = train_loop(cfg, specs, run, backend, device)
    except SystemExit as e:
        if rec is None and isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        _exit(2 if isinstance(e.code, str) else int(e.code or 0))
    except BaseException as e:  # noqa: BLE001 - a rank must never exit through gloo's destructors
        traceback.print_exc()
        rs = _SESSION[0]
        if rs is not None:
            rs.fail(f"{type(e).__name__}: {str(e)[:400]}")
        _exit(1)
    _exit(0)


# This rank's ranksight session as soon as it exists, for main()'s error path (write what the rank was stuck in).
_SESSION: list = [None]


def train_loop(cfg: TrainConfig, specs, run: RunDir, backend: str, device: torch.device):
    """This rank's whole run once its process group exists: build, train, write, tear down. Returns its session."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    dp, tp, pp = resolve_layout(cfg, world)
    mesh = build_mesh(device, dp, tp, pp)
    lay = Layout(dp=dp, tp=tp, pp=pp, world=world, pp_rank=mesh["pp"].get_local_rank(),
                 dp_rank=mesh["dp"].get_local_rank(), tp_rank=mesh["tp"].get_local_rank())
    tokens_per_step = cfg.batch_size * cfg.model.seq_len * cfg.grad_accum  # per dp replica
    fpt = flops_per_token(cfg.model)
    # The trainer is ranksight's first user: the same API any loop uses (docs/instrument.md); it writes its own,
    # richer manifest (config, faults, peak) below.
    # node: --node, else $RANKSIGHT_NODE or torchrun's $GROUP_RANK (resolved by ranksight.init, as for any loop)
    rs = ranksight.init(cfg.run_id, cfg.store, node=cfg.node, mesh=mesh, device=device.type,
                        tokens_per_step=tokens_per_step, flops_per_step=fpt * tokens_per_step / (tp * pp),
                        microbatches=cfg.parallel.microbatches if pp > 1 else cfg.grad_accum,
                        write_manifest=False, enabled=cfg.instrument, exit_handlers=False)
    rec = rs.recorder
    _SESSION[0] = rs
    placements, node = rs.placements, rs.placement.node

    faults = FaultState(specs, rank, node, local_rank, device.type)
    faults.shaper = LinkShaper.from_env() if specs else None
    # bench/overhead.py only (environment; None otherwise): instrumentation ON/OFF in blocks of steps
    toggle = OverheadToggle.from_env(rank, local_rank)
    if toggle is not None and (not cfg.instrument or specs):
        raise SystemExit("RANKSIGHT_OVERHEAD_BLOCK needs the instrumentation on and no --inject")
    ckpt.seed_rng(cfg.seed, rank, 0)

    parts, stage_ids, n_stages = build_model_parts(cfg, mesh, lay, device)
    params = [p for part in parts for p in part.parameters()]
    optims = [torch.optim.AdamW(part.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
              for part in parts]
    scaler = None
    if cfg.precision == "fp16":
        if uses_fsdp(cfg):
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device=device.type)
        else:
            scaler = torch.amp.GradScaler(device.type)
    autocast = (lambda: torch.autocast(device.type, dtype=TP_DTYPES[cfg.precision])) \
        if cfg.precision in TP_DTYPES else contextlib.nullcontext

    # Fault hooks on the model output: NaN loss, and inf gradients flowing back from here
    # (before any gradient sync, so every rank's GradScaler sees them, as in a real overflow).
    def output_fault_hook(module, inputs, out):
        if faults.has("nan_loss"):
            out = out + float("nan")
        if faults.has("fp16_overflow") and out.requires_grad:
            out.register_hook(lambda g: g * float("inf"))
        return out

    for part in parts:
        part.register_forward_hook(output_fault_hook)

    pp_losses: list[torch.Tensor] = []
    sched, stages = None, []
    if pp > 1:
        def pp_loss(out, tgt):
            loss = loss_fn(out, tgt)
            pp_losses.append(loss.detach())
            return scaler.scale(loss) if scaler is not None else loss

        sched, stages = build_pipeline(cfg, parts, stage_ids, n_stages, mesh, device, pp_loss)

    # slow_rank's extra work, measured against this thread's compute (CPU time less time inside collectives)
    def compute_cpu() -> float:
        return time.thread_time() - rec.t.comm_cpu

    for stage in stages:
        faults.wrap_stage_chunks(stage, compute_cpu)
    faults.install_transport_delay()  # slow_link without a network namespace (before the hooks: inside them)
    rs.watch(parts, mesh=mesh, stages=stages)  # --no-instrument: attaches nothing

    def pp_all_reduce(tensor: torch.Tensor, group) -> None:
        # the loop's own collectives over the pp group (found_inf + loss, the grad norm), timed as group "pp"
        rs.timed("all_reduce", "pp", dist.all_reduce, tensor, group=group,
                 nbytes=tensor.numel() * tensor.element_size())

    is_first = 0 in stage_ids
    is_last = (n_stages - 1) in stage_ids

    # -- resume ------------------------------------------------------------------
    start_step, data_position, resumed = 0, 0, None
    latest = ckpt.read_latest(run) if cfg.resume else None
    if latest is not None:
        t0 = time.time()
        train_state = ckpt.load(run, latest, parts, optims, scaler, rank, world, cfg.seed)
        start_step, data_position = int(train_state["step"]), int(train_state["data_position"])
        resumed = start_step
        rec.event("resume", {"checkpoint": latest, "step": start_step, "data_position": data_position,
                             "saved_world_size": train_state["saved_world_size"], "world_size": world,
                             "rng_restored": train_state["rng_restored"], "ms": (time.time() - t0) * 1000},
                  step=start_step)
    dataset = make_dataset(cfg.dataset, cfg.model.vocab, cfg.model.seq_len, cfg.seed)
    loader = DataLoader(dataset, cfg.batch_size, dp, lay.dp_rank, data_position)

    # -- manifest -------------------------------------------------------------------
    nodes = {p.node for p in placements}
    manifest = ManifestWriter(run)
    layout_d = {"dp": dp, "tp": tp, "pp": pp, "world": world, "pp_schedule": cfg.parallel.pp_schedule,
                "microbatches": cfg.parallel.microbatches if pp > 1 else 1,
                "virtual_stages": n_stages // pp, "dp_mode": "fsdp" if uses_fsdp(cfg) else "ddp",
                "precision": cfg.precision}
    peak = None
    if device.type == "cpu":
        # The MFU denominator: rank 0 measures matmul FLOP/s while every other rank waits in a
        # blocking barrier (all ranks just met in all_gather_object), so the measurement has
        # the cores to itself and is an upper bound for what a rank achieves.
        if rank == 0:
            peak = measure_cpu_peak()
        dist.barrier()
    if rank == 0:
        m = make_manifest(run.run_id, cfg.to_dict(), layout_d, placements, backend, device, fpt,
                          count_params(cfg.model), specs, peak=peak)
        if device.type == "cpu":
            m.layout["simulated_gpus"] = "each rank writes a SIMULATED GPU state (simgpu/), no real GPU"
        manifest.start(m, attempt_entry(world, resumed), carry=carry_onsets)
    rs.event("layout", {"layout": layout_d, "resumed_step": resumed}, step=start_step)

    control = ControlChannel(run, rank, nodes, cfg.min_nodes, device, rec)
    profiler = Profiler(run, rank, cfg.profile.every, cfg.profile.steps, cfg.profile.warmup, device, rec)
    simgpu = SimulatedGpu(run, node, local_rank, rank) if device.type == "cpu" and cfg.instrument else None
    pp_group = mesh["pp"].get_group() if pp > 1 else None

    if scaler is not None:
        # Pipeline stages without the loss never call scaler.scale(); initialize the scale
        # (from the init value or the checkpoint) so every stage unscales by the same factor.
        scaler.scale(torch.ones((), device=device))

    step = start_step
    while step < cfg.steps:
        step += 1
        if toggle is not None:
            toggle.begin_step(step, rec)
        rs.begin_step(step)
        faults.begin_step(step, rs.event, manifest if rank == 0 else None)
        profiling = profiler.before_step(step)
        lr = cfg.lr * min(1.0, step / max(1, cfg.warmup))
        for o in optims:
            for g in o.param_groups:
                g["lr"] = lr

        # -- forward / backward --------------------------------------------------
        local_losses: list[torch.Tensor] = []
        if pp == 1:
            model = parts[0]
            for k in range(cfg.grad_accum):
                rs.set_phase("data")
                x, y = loader.micro_batch(k)
                stall = faults.data_delay_s()
                if stall > 0:
                    time.sleep(stall)  # data_stall: the loader is late on this rank
                x, y = x.to(device), y.to(device)
                last = k == cfg.grad_accum - 1
                if uses_fsdp(cfg):
                    model.set_requires_gradient_sync(last)
                    sync_ctx = contextlib.nullcontext()
                else:
                    sync_ctx = contextlib.nullcontext() if last else model.no_sync()
                with sync_ctx:
                    rs.set_phase("forward")
                    c0 = compute_cpu()
                    with autocast():
                        logits = model(x)
                        loss = loss_fn(logits, y)
                    # slow_rank: extra work of forward + backward (~2x forward), before the gradient sync
                    faults.slow_compute(3.0 * (compute_cpu() - c0))
                    rs.set_phase("backward")
                    scaled = loss / cfg.grad_accum
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                    rs.set_phase(None)
                local_losses.append(loss.detach().float())
            loader.advance(cfg.grad_accum)
        else:
            rs.set_phase("data")
            x, y = loader.micro_batch(0)
            stall = faults.data_delay_s()
            if stall > 0:
                time.sleep(stall)
            x, y = x.to(device), y.to(device)
            rs.set_phase(None)  # the stages' chunks time forward and backward themselves
            pp_losses.clear()
            with autocast():
                if is_first and is_last:
                    sched.step(x, target=y)
                elif is_first:
                    sched.step(x)
                elif is_last:
                    sched.step(target=y)
                else:
                    sched.step()
            # The first step's shape inference also calls the loss fn once: keep the real micro-batches.
            mb_losses = pp_losses[-cfg.parallel.microbatches:]
            local_losses = [torch.stack(mb_losses).mean()] if mb_losses else []
            loader.advance(1)

        # -- optimizer -----------------------------------------------------------
        rs.set_phase("optimizer")
        found = 0.0
        if scaler is not None:
            for o in optims:
                scaler.unscale_(o)
            found = sum(float(v.sum()) for o in optims
                        for v in scaler._per_optimizer_states[id(o)]["found_inf_per_device"].values())
        step_loss = float(torch.stack(local_losses).mean()) if local_losses else float("nan")
        if pp > 1:
            # Stages own disjoint grads: agree on found_inf, and share the last stage's loss.
            stats = torch.tensor([found, step_loss if is_last else 0.0, 1.0 if is_last else 0.0],
                                 dtype=torch.float64, device=device)
            pp_all_reduce(stats, group=pp_group)
            found = float(stats[0])
            step_loss = float(stats[1]) / max(1.0, float(stats[2]))
            if scaler is not None:
                for o in optims:
                    for v in scaler._per_optimizer_states[id(o)]["found_inf_per_device"].values():
                        v.fill_(1.0 if found > 0 else 0.0)
        norm = clip_grad_norm_(params, cfg.clip, pp_group, all_reduce=pp_all_reduce)
        grad_norm = float(norm)
        overflow = found > 0 or not math.isfinite(grad_norm)
        if scaler is not None:
            for o in optims:
                scaler.step(o)  # skipped by the scaler when found_inf
            scaler.update()  # halves the scale after an overflow
            skipped = found > 0
        elif overflow:
            skipped = True  # fp32/bf16: never apply non-finite gradients
        else:
            for o in optims:
                o.step()
            skipped = False
        for o in optims:
            o.zero_grad(set_to_none=True)
        rs.set_phase(None)

        # -- control channel (collective: every rank, same step) ------------------
        action, a_steps, a_node = control.poll(step)

        # -- step record -----------------------------------------------------------
        h = rs.end_step(loss=step_loss, grad_norm=grad_norm, overflow=overflow, skipped=skipped, lr=lr,
                        loss_scale=float(scaler.get_scale()) if scaler is not None else None, profiling=profiling)
        step_ms = h.step_ms
        if overflow:
            rec.event("overflow", {"found_inf": found, "grad_norm_finite": math.isfinite(grad_norm),
                                   "loss_scale": float(scaler.get_scale()) if scaler is not None else None})
        if simgpu is not None and rec.enabled:
            simgpu.update(step_ms, h.compute_ms, h.mem_bytes, faults)
        profiler.after_step(step)
        if rank == 0 and not cfg.quiet:
            tps = tokens_per_step * dp / max(step_ms / 1000.0, 1e-9)
            print(f"step {step:5d} | loss {step_loss:8.4f} | {step_ms:8.1f} ms | {tps:10.0f} tok/s"
                  + (" | skipped (overflow)" if skipped else ""), flush=True)

        # -- act on the control request ----------------------------------------------
        if action is not None:
            rec.event("control", {"action": action, "steps": a_steps, "node": a_node})
        if action == "checkpoint":
            name = _save(cfg, run, rec, step, parts, optims, scaler, loader, rank, world, "control")
            control.ack(step, f"saved {name}")
        elif action == "profile":
            profiler.request(a_steps, "ondemand")
            control.ack(step, f"tracing steps {step + 1}-{step + a_steps}")
        elif action == "evict":
            name = _save(cfg, run, rec, step, parts, optims, scaler, loader, rank, world, "evict")
            control.ack(step, f"saved {name}; node {a_node} leaves")
            if rank == 0:
                manifest.update_attempt(ended_step=step, evicted_node=a_node)
            _evict(run, rec, step, node, a_node, profiler)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            _save(cfg, run, rec, step, parts, optims, scaler, loader, rank, world, "periodic")
        if cfg.stop_after is not None and step >= cfg.stop_after:
            # Test aid: die like a crash (no teardown, no final checkpoint).
            rec.event("exit", {"reason": f"--crash-after-step {cfg.stop_after}"})
            _exit(13)

    if toggle is not None:
        toggle.finish(rec)
    if simgpu is not None:
        simgpu.flush()
    if cfg.checkpoint_at_end:
        _save(cfg, run, rec, step, parts, optims, scaler, loader, rank, world, "end")
    profiler.close()
    faults.close()
    rs.finish()
    if rank == 0:
        manifest.update_attempt(ended_step=step)
        manifest.finish()
    # gloo can abort at interpreter exit (worker threads still own work objects): tear down
    # explicitly and leave with os._exit (see shared/research/torch-cpu-feasibility.md).
    dist.barrier()
    dist.destroy_process_group()
    return rs


def _save(cfg, run, rec, step, parts, optims, scaler, loader, rank, world, reason) -> str:
    t0 = time.time()
    name = ckpt.save(run, step, parts, optims, scaler, loader.position, rank, world)
    rec.event("checkpoint", {"name": name, "reason": reason, "ms": (time.time() - t0) * 1000,
                             "data_position": loader.position})
    return name


def _evict(run: RunDir, rec, step: int, my_node: int, evict_node: int, profiler) -> None:
    profiler.close()
    leaving = my_node == evict_node
    if leaving:
        rec.event("evicted", {"node": evict_node, "step": step})
        atomic_write(evicted_marker(run, evict_node), f"step={step}\nt={time.time()}\n".encode())
    else:
        rec.event("reform", {"evicted_node": evict_node, "step": step, "exit_code": REFORM_EXIT_CODE})
    # Every rank has written its event (and node N its marker) before any agent is taken down.
    dist.barrier()
    if leaving:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Our parent is this node's torchrun agent: take it down so the node leaves the
            # rendezvous instead of restarting us.
            os.kill(os.getppid(), signal.SIGTERM)
        _exit(0)
    time.sleep(REFORM_SLEEP_S)  # let the evicted node's torchrun go away before we re-rendezvous
    _exit(REFORM_EXIT_CODE)
