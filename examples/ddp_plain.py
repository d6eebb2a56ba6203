"""A plain PyTorch DDP training loop (an MLP classifier on synthetic data), observed by ranksight.

ranksight costs this loop 3 added lines and 1 changed one, marked ``# ranksight`` and ``# ranksight (changed)``:
``import ranksight``, ``rs = ranksight.init(...)``, ``with rs.step(step):`` (the loop body moves in by one indent),
and the DDP line, which gains ``rs.watch(...)`` (it returns the model; the ``--no-watch`` switch on that line only
exists to show what diagnose says when the gradient-sync timing is missing).

    torchrun --standalone --nproc-per-node 4 examples/ddp_plain.py --store runs --run-id ddp1 --steps 40 \\
        --slow-rank 2 --slow-factor 1.5
    ranksight diagnose ddp1 --store runs

``--slow-rank``/``--slow-factor``/``--slow-start`` make one rank slow on purpose (``straggler.py``: the example's own
code, real extra work on that rank; ranksight is not told).

On a CPU the ranks use gloo; with one GPU per rank (``--device cuda``, the default where torchrun's local ranks fit
the GPUs) NCCL.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ranksight  # ranksight
from straggler import Straggler, add_arguments


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=None, help="the run store (default $RANKSIGHT_STORE or ./runs)")
    p.add_argument("--run-id", default=None, help="the run id (default $RANKSIGHT_RUN_ID or torchrun's run id)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=512, help="input width; the hidden layers are twice as wide")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--no-watch", action="store_true", help="leave rs.watch out (demo of a missing signal)")
    add_arguments(p)
    return p.parse_args()


def pick_device(choice: str) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()
                            and local_world <= torch.cuda.device_count()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def mlp(width: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, 2 * width), nn.GELU(),
                         nn.Linear(2 * width, width), nn.GELU(), nn.Linear(width, classes))


def main() -> None:
    args = parse_args()
    device = pick_device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    net = mlp(args.width).to(device)
    teacher = mlp(args.width).to(device)  # labels the synthetic inputs: a task the model can learn
    rs = ranksight.init(run_id=args.run_id, store=args.store)  # ranksight
    model = DDP(net) if args.no_watch else rs.watch(DDP(net))  # ranksight (changed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    straggler = Straggler.from_args(rank, args, device.type)
    data = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own shard of the data

    for step in range(args.steps):
        with rs.step(step):  # ranksight
            x = torch.randn(args.batch_size, args.width, generator=data, device=device)
            with torch.no_grad():
                y = teacher(x).argmax(dim=1)
            with straggler.forward(step):
                loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()  # the run's end is recorded at exit (the atexit handler of ranksight.init)


if __name__ == "__main__":
    main()
