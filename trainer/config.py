"""Training configuration as plain dataclasses (torchtitan style).

The CLI (trainer/cli.py) fills these; everything else reads them. ``asdict(cfg)``
is what goes into the run manifest, so every knob that changes behaviour lives here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PP_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
DP_MODES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class ModelConfig:
    vocab: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32


@dataclass
class ParallelConfig:
    dp: int = 0  # 0: whatever is left of the world size after tp x pp (elastic: dp shrinks on evict)
    tp: int = 1
    pp: int = 1
    dp_mode: str = "ddp"  # ddp | fsdp; with tp > 1 FSDP2 is always used (DDP+TP clips with a wrong norm)
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved
    microbatches: int = 4  # pipeline micro-batches per step (pp > 1 only)
    virtual_stages: int = 2  # stages per rank for the interleaved schedule


@dataclass
class ProfileConfig:
    every: int = 0  # trace N steps every K steps; 0 = off (the default)
    steps: int = 2
    warmup: int = 1  # profiler warm-up steps before each active window (not traced)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    precision: str = "fp32"  # fp32 | bf16 | fp16
    batch_size: int = 8  # samples per dp rank per micro-step (global batch = batch_size * dp * grad_accum)
    grad_accum: int = 1
    activation_checkpointing: bool = False
    clip: float = 1.0  # max grad norm; 0 = no clipping (the norm is still measured)
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 2  # linear lr warm-up steps
    steps: int = 10
    seed: int = 1234
    dataset: str = "synthetic"  # synthetic | textfile:PATH
    checkpoint_every: int = 0  # 0 = only when asked (control request, evict) or at the end with --checkpoint-at-end
    checkpoint_at_end: bool = False
    resume: bool = True  # load checkpoints/latest when present
    run_id: str = "run"
    store: str = "./runs"
    node: int | None = None  # None: RANKSIGHT_NODE env, else GROUP_RANK
    min_nodes: int = 1  # an evict never leaves fewer nodes than this
    pg_timeout_s: float = 60.0
    inject: list[str] = field(default_factory=list)
    quiet: bool = False
    stop_after: int | None = None  # exit (without finishing) after this step: used to test resume
    instrument: bool = True  # False: no spool records, no collective timing hooks, no simulated GPU state

    def validate(self) -> None:
        m, p = self.model, self.parallel
        if m.d_model % m.n_heads:
            raise ValueError(f"--d-model {m.d_model} must be divisible by --n-heads {m.n_heads}")
        if min(m.vocab, m.d_model, m.n_layers, m.n_heads, m.seq_len) < 1:
            raise ValueError("model sizes must be positive")
        if p.dp_mode not in DP_MODES:
            raise ValueError(f"--dp-mode must be one of {DP_MODES}, got {p.dp_mode!r}")
        if p.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"--pp-schedule must be one of {tuple(PP_SCHEDULES)}, got {p.pp_schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if p.tp < 1 or p.pp < 1 or p.dp < 0:
            raise ValueError("--tp and --pp must be >= 1, --dp >= 0 (0 = derive from the world size)")
        if p.tp > 1 and (m.n_heads % p.tp or (4 * m.d_model) % p.tp):
            raise ValueError(f"--n-heads {m.n_heads} and the MLP width must be divisible by --tp {p.tp}")
        if p.pp > 1:
            v = p.virtual_stages if p.pp_schedule == "interleaved" else 1
            if m.n_layers < p.pp * v:
                raise ValueError(f"--n-layers {m.n_layers} is fewer than the {p.pp * v} pipeline stages")
            if self.batch_size % p.microbatches:
                raise ValueError(f"--batch-size {self.batch_size} must be divisible by --microbatches {p.microbatches}")
            if self.grad_accum != 1:
                raise ValueError("with --pp > 1 accumulate with --microbatches, not --grad-accum")
            if p.pp_schedule == "interleaved" and p.microbatches % p.pp:
                raise ValueError(f"interleaved 1F1B needs --microbatches divisible by --pp ({p.pp})")
        if self.batch_size < 1 or self.grad_accum < 1 or self.steps < 0:
            raise ValueError("--batch-size and --grad-accum must be >= 1, --steps >= 0")
        if not (self.dataset == "synthetic" or self.dataset.startswith("textfile:")):
            raise ValueError(f"--dataset must be 'synthetic' or 'textfile:PATH', got {self.dataset!r}")
        if not self.instrument and self.inject:
            raise ValueError("--inject needs the instrumentation (faults act in its hooks and are recorded in the "
                             "spool): drop --no-instrument")
        if self.profile.every and self.profile.steps + self.profile.warmup > self.profile.every:
            raise ValueError("--profile-steps + --profile-warmup must not exceed --profile-every")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
