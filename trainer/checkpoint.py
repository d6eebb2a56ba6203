"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: ``<run>/checkpoints/step-<S>/`` (a DCP directory) and ``<run>/checkpoints/latest``
(a small text file naming the newest *complete* one).

Atomicity: every rank writes its shards into step-S; DCP writes ``.metadata`` last
(coordinator, after all ranks finished). Then a barrier, then rank 0 atomically replaces
``latest``. A crash at any point before that leaves ``latest`` naming the previous
checkpoint, which is untouched.

What is saved: model and optimizer state (FQN-keyed, so DCP reshards them into any
(pp, dp, tp) layout on load), the GradScaler state, the step, the data position
(global samples consumed) and, per rank, the RNG states (Python, NumPy, torch CPU
and CUDA) under ``rng.rank<R>`` together with the world size they were saved at.

RNG on resume: with the same world size every rank gets its own RNG state back, so
the resumed run is bit-identical to an uninterrupted one. With a different world
size the per-rank states do not map onto the new ranks; each rank is then re-seeded
from (seed, rank, step). This model has no dropout and the data is addressed by
global sample index, so the loss curve does not depend on those RNG states anyway.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ranksight.layout import RunDir, atomic_write


def _rng_blob() -> bytes:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return pickle.dumps(state)


def _restore_rng(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rng(seed: int, rank: int, step: int) -> None:
    s = (seed * 1_000_003 + rank * 7919 + step) % (2**31)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _model_sd(parts) -> dict:
    sd = {}
    for p in parts:
        sd.update(get_model_state_dict(p))
    return sd


def _optim_sd(parts, optims) -> dict:
    # Flattened ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): keys of different pipeline
    # parts are disjoint, so the parts of an interleaved stage merge with a plain update and
    # DCP can reshard them into any other layout (as torchtitan does).
    sd = {}
    for p, o in zip(parts, optims):
        sd.update(get_optimizer_state_dict(p, o, options=_options()))
    return sd


def latest_path(run: RunDir):
    return run.checkpoints_dir / "latest"


def read_latest(run: RunDir) -> str | None:
    try:
        name = latest_path(run).read_text().strip()
    except FileNotFoundError:
        return None
    return name if name and (run.checkpoints_dir / name / ".metadata").exists() else None


def save(run: RunDir, step: int, parts, optims, scaler, data_position: int, rank: int, world: int) -> str:
    name = f"step-{step}"
    if read_latest(run) == name:
        return name  # this exact state is already the latest complete checkpoint
    state = {
        "model": _model_sd(parts),
        "optim": _optim_sd(parts, optims),
        "train": {"step": step, "data_position": data_position, "world_size": world,
                  "scaler": pickle.dumps(scaler.state_dict() if scaler is not None else None)},
        f"rng.rank{rank}": _rng_blob(),
    }
    dcp.save(state, checkpoint_id=str(run.checkpoints_dir / name))
    dist.barrier()
    if rank == 0:
        atomic_write(latest_path(run), (name + "\n").encode())
    dist.barrier()
    return name


def load(run: RunDir, name: str, parts, optims, scaler, rank: int, world: int, seed: int) -> dict:
    """Load ``name`` into the (possibly differently laid out) parts/optimizers. Returns the train dict."""
    ckpt = str(run.checkpoints_dir / name)
    meta = dcp.FileSystemReader(ckpt).read_metadata()
    saved_world = None
    train = {"step": 0, "data_position": 0, "world_size": 0, "scaler": b""}
    probe = {"train": dict(train)}
    dcp.load(probe, checkpoint_id=ckpt)
    train = probe["train"]
    saved_world = int(train["world_size"])
    state = {"model": _model_sd(parts), "optim": _optim_sd(parts, optims)}
    rng_key = f"rng.rank{rank}"
    same_world = saved_world == world and rng_key in meta.state_dict_metadata
    if same_world:
        state[rng_key] = b""
    dcp.load(state, checkpoint_id=ckpt)
    for p in parts:
        set_model_state_dict(p, state["model"], options=_non_strict())
    for p, o in zip(parts, optims):
        set_optimizer_state_dict(p, o, state["optim"], options=_options())
    scaler_state = pickle.loads(train["scaler"]) if train.get("scaler") else None
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    if same_world:
        _restore_rng(state[rng_key])
    else:
        seed_rng(seed, rank, int(train["step"]))
    train["rng_restored"] = bool(same_world)
    train["saved_world_size"] = saved_world
    return train


def _non_strict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Each pipeline part holds a subset of the model's FQNs: load what this part owns.
    return StateDictOptions(strict=False)


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False, flatten_optimizer_state_dict=True)
