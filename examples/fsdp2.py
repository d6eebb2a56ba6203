"""An FSDP2 (``fully_shard``) training loop: a tiny transformer language model on synthetic tokens, observed by
ranksight.

ranksight costs this loop 3 added lines and 1 changed one, marked ``# ranksight`` and ``# ranksight (changed)``:
``import ranksight``, ``rs = ranksight.init(...)``, ``with rs.step(step):`` (the loop body moves in by one indent),
and the root ``fully_shard`` line, which gains ``rs.watch(...)`` (it returns the model; ``--no-watch`` on that line
only exists to show what diagnose says when the gradient-sync timing is missing). ``rs.watch`` times FSDP2's
reduce-scatters and all-gathers (``FSDPModule.set_custom_reduce_scatter``/``set_custom_all_gather``).

    torchrun --standalone --nproc-per-node 4 examples/fsdp2.py --store runs --run-id fsdp1 --steps 40 \\
        --slow-rank 1 --slow-factor 1.5
    ranksight diagnose fsdp1 --store runs

``--slow-rank``/``--slow-factor``/``--slow-start``: one rank slow on purpose (``straggler.py``, the example's own
code). gloo on a CPU; NCCL with one GPU per rank.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ranksight  # ranksight
from straggler import Straggler, add_arguments


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=None, help="the run store (default $RANKSIGHT_STORE or ./runs)")
    p.add_argument("--run-id", default=None, help="the run id (default $RANKSIGHT_RUN_ID or torchrun's run id)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--no-watch", action="store_true", help="leave rs.watch out (demo of a missing signal)")
    add_arguments(p)
    return p.parse_args()


class TinyLM(nn.Module):
    """Token + position embedding, pre-norm transformer blocks with a causal mask, a linear head; returns the
    next-token loss."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                       batch_first=True, norm_first=True)
            for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            h = block(h, src_mask=self.causal[:t, :t], is_causal=True)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(gen: torch.Generator, batch: int, seq_len: int, vocab: int, device) -> torch.Tensor:
    """Sequences that follow a rule (each token is the previous one times 3 plus 1, mod vocab, from a random start),
    so the model has something to learn."""
    tokens = [torch.randint(0, vocab, (batch,), generator=gen, device=device)]
    for _ in range(seq_len):
        tokens.append((3 * tokens[-1] + 1) % vocab)
    return torch.stack(tokens, dim=1)


def main() -> None:
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                         and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    rs = ranksight.init(run_id=args.run_id, store=args.store)  # ranksight
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.d_model, args.n_layers, args.seq_len).to(device)
    shard = functools.partial(fully_shard, mesh=mesh)
    for block in model.blocks:
        shard(block)
    model = shard(model) if args.no_watch else rs.watch(shard(model))  # ranksight (changed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    straggler = Straggler.from_args(rank, args, device.type)
    data = torch.Generator(device=device).manual_seed(1000 + rank)

    for step in range(args.steps):
        with rs.step(step):  # ranksight
            seq = synthetic_batch(data, args.batch_size, args.seq_len, args.vocab, device)
            with straggler.forward(step):
                loss = model(seq[:, :-1], seq[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()  # the run's end is recorded at exit (the atexit handler of ranksight.init)


if __name__ == "__main__":
    main()
