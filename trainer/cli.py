"""``ranksight train`` / ``python -m trainer``: flags -> TrainConfig -> trainer.train.main (one rank).

Run it under torchrun, e.g.
    torchrun --standalone --nproc-per-node 4 -m trainer --dp 2 --tp 2 --steps 20 --run-id demo
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from trainer.config import ModelConfig, ParallelConfig, ProfileConfig, TrainConfig

train_command = typer.Typer(add_completion=False, help="Run the trainer on this rank (started by torchrun).")


@train_command.command()
def train(
    # model
    vocab: int = typer.Option(256, help="Vocabulary size (>= 256 for textfile datasets)."),
    d_model: int = typer.Option(64, help="Model width."),
    n_layers: int = typer.Option(2, help="Transformer blocks."),
    n_heads: int = typer.Option(4, help="Attention heads."),
    seq_len: int = typer.Option(32, help="Sequence length."),
    # parallelism
    dp: int = typer.Option(0, help="Data-parallel degree; 0 = world / (tp*pp)."),
    tp: int = typer.Option(1, help="Tensor-parallel degree."),
    pp: int = typer.Option(1, help="Pipeline-parallel degree."),
    dp_mode: str = typer.Option("ddp", help="ddp | fsdp (FSDP2). With --tp > 1 FSDP2 is always used."),
    pp_schedule: str = typer.Option("1f1b", help="1f1b | gpipe | interleaved."),
    microbatches: int = typer.Option(4, help="Pipeline micro-batches per step."),
    virtual_stages: int = typer.Option(2, help="Stages per rank for --pp-schedule interleaved."),
    # training
    precision: str = typer.Option("fp32", help="fp32 | bf16 | fp16 (fp16 uses a GradScaler)."),
    batch_size: int = typer.Option(8, help="Samples per dp rank per micro-step."),
    grad_accum: int = typer.Option(1, help="Micro-steps per optimizer step (pp = 1)."),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing/--no-activation-checkpointing"),
    clip: float = typer.Option(1.0, help="Max grad norm (0 = do not clip)."),
    lr: float = typer.Option(3e-3, help="Peak learning rate (AdamW)."),
    weight_decay: float = typer.Option(0.0, help="AdamW weight decay."),
    warmup: int = typer.Option(2, help="Linear warm-up steps."),
    steps: int = typer.Option(10, help="Total optimizer steps (a resumed run continues to this)."),
    seed: int = typer.Option(1234, help="Seed of the weights and the data."),
    dataset: str = typer.Option("synthetic", help="synthetic | textfile:PATH (byte tokens)."),
    # checkpoints
    checkpoint_every: int = typer.Option(0, help="Save every N steps (0 = only on request)."),
    checkpoint_at_end: bool = typer.Option(False, "--checkpoint-at-end", help="Save after the last step."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Load checkpoints/latest if present."),
    crash_after_step: Optional[int] = typer.Option(None, help="Test aid: every rank exits abruptly (code 13) after this step."),
    # profiler
    profile_every: int = typer.Option(0, help="Trace --profile-steps steps every K steps (0 = off)."),
    profile_steps: int = typer.Option(2, help="Steps per profiler window."),
    profile_warmup: int = typer.Option(1, help="Untraced warm-up steps before each scheduled window."),
    # run
    run_id: str = typer.Option("run", help="Run id: the run directory is <store>/<run-id>/."),
    store: str = typer.Option("./runs", help="Directory holding run directories."),
    node: Optional[int] = typer.Option(None, help="Node index (default: $RANKSIGHT_NODE, else $GROUP_RANK)."),
    min_nodes: int = typer.Option(1, help="An evict request never leaves fewer nodes than this."),
    pg_timeout: float = typer.Option(60.0, help="Process-group timeout in seconds (how long a hang takes to surface)."),
    inject: List[str] = typer.Option([], help="Fault: KIND:key=value,... (repeatable). See docs/trainer.md."),
    quiet: bool = typer.Option(False, "--quiet", help="No per-step progress line."),
    instrument: bool = typer.Option(True, "--instrument/--no-instrument",
                                    help="Per-step spool records, collective timing hooks and simulated GPU state "
                                         "(default on). --no-instrument is the baseline for measuring their overhead."),
) -> None:
    """Run the trainer on this rank (started by torchrun)."""
    cfg = TrainConfig(
        model=ModelConfig(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len),
        parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, dp_mode=dp_mode, pp_schedule=pp_schedule,
                                microbatches=microbatches, virtual_stages=virtual_stages),
        profile=ProfileConfig(every=profile_every, steps=profile_steps, warmup=profile_warmup),
        precision=precision, batch_size=batch_size, grad_accum=grad_accum,
        activation_checkpointing=activation_checkpointing, clip=clip, lr=lr, weight_decay=weight_decay,
        warmup=warmup, steps=steps, seed=seed, dataset=dataset, checkpoint_every=checkpoint_every,
        checkpoint_at_end=checkpoint_at_end, resume=resume, run_id=run_id, store=store, node=node,
        min_nodes=min_nodes, pg_timeout_s=pg_timeout, inject=list(inject), quiet=quiet, stop_after=crash_after_step,
        instrument=instrument,
    )
    from trainer.faults import FaultSpecError, apply_config_faults, parse_faults

    try:
        apply_config_faults(cfg, parse_faults(cfg.inject))
        cfg.validate()
    except (ValueError, FaultSpecError) as e:
        typer.echo(f"ranksight train: {e}", err=True)
        raise typer.Exit(2)
    from trainer.train import main

    main(cfg)


def run() -> None:
    train_command(prog_name="python -m trainer", args=sys.argv[1:])
