"""Shared helpers for the trainer tests: launch torchrun on CPU, read spools, a 1-process reference."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from ranksight.layout import RunDir
from cli.local_cluster import kill_tree
from ranksight.schema import CollectiveRecord, CommunicatorRecord, EventRecord, StepRecord, decode_spool_line

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--batch-size", "4",
        "--lr", "1e-2", "--warmup", "1", "--quiet", "--pg-timeout", "90"]


def torchrun(nproc: int, args: list[str], store: Path, run_id: str, timeout: float = 240,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone -m trainer`` and always reap every process it started
    (torchrun's workers live in their own sessions, so killing torchrun alone is not enough)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.5", "-m", "trainer", *args,
           "--store", str(store), "--run-id", run_id]
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(ROOT)})
    e.update(env or {})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out after {timeout}s:\n{out.decode(errors='replace')[-6000:]}")
    finally:
        _kill_tree(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out.decode(errors="replace"), "")


def _kill_tree(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)  # torchrun and every worker (they run in their own sessions)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def check_ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, f"torchrun failed rc={res.returncode}:\n{res.stdout[-6000:]}"


def spool(store: Path, run_id: str) -> dict[int, list]:
    run = RunDir(store, run_id)
    out: dict[int, list] = {}
    for f in sorted(run.spool_dir.glob("rank-*.jsonl")):
        rank = int(f.stem.split("-")[1])
        out[rank] = [decode_spool_line(line) for line in f.read_bytes().splitlines() if line.strip()]
    return out


def steps(recs: list) -> dict[int, StepRecord]:
    return {r.step: r for r in recs if isinstance(r, StepRecord)}


def events(recs: list, name: str | None = None) -> list[EventRecord]:
    return [r for r in recs if isinstance(r, EventRecord) and (name is None or r.event == name)]


def collectives(recs: list) -> list[CollectiveRecord]:
    return [r for r in recs if isinstance(r, CollectiveRecord)]


def members(sp: dict[int, list]) -> dict[str, list[int]]:
    """Every process group's members from the communicator records of all ranks' spools (each written once, by the
    group's lowest rank: a second copy fails here)."""
    out: dict[str, list[int]] = {}
    for rank, recs in sp.items():
        for r in recs:
            if isinstance(r, CommunicatorRecord):
                assert r.comm_id not in out and r.rank == rank == min(r.ranks), r
                out[r.comm_id] = r.ranks
    return out


def manifest(store: Path, run_id: str) -> dict:
    return json.loads(RunDir(store, run_id).manifest.read_text())


def reference_losses(n_steps: int, batch: int, d_model=32, n_layers=2, n_heads=4, seq_len=16, vocab=256,
                     lr=1e-2, warmup=1, clip=1.0, seed=1234) -> tuple[list[float], list[float]]:
    """The same model, data and optimizer in one process on the global batch: (losses, grad norms)."""
    import torch

    from trainer.config import ModelConfig
    from trainer.data import DataLoader, SyntheticTokens
    from trainer.model import GPT, init_weights, loss_fn

    torch.manual_seed(0)
    cfg = ModelConfig(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
    model = GPT(cfg)
    init_weights(model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    loader = DataLoader(SyntheticTokens(vocab, seq_len, seed), batch, 1, 0)
    losses, norms = [], []
    for step in range(1, n_steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / max(1, warmup))
        x, y = loader.micro_batch(0)
        loader.advance(1)
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


def mean(xs) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs)
