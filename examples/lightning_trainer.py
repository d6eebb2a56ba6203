"""A LightningModule (an MLP classifier on synthetic data) trained by Lightning's ``Trainer`` with the DDP strategy,
observed by ranksight through its Lightning callback.

ranksight costs this script 2 added lines, marked ``# ranksight``: the import of ``RanksightCallback`` and the
``callbacks=[...]`` argument of the Trainer. The callback does ``ranksight.init``, ``rs.watch`` on the DDP-wrapped
model, one ranksight step per optimizer step with its phases and loss, and the end of the run.

    torchrun --standalone --nproc-per-node 2 examples/lightning_trainer.py --store runs --run-id pl1 --steps 40 \\
        --slow-rank 1 --slow-factor 1.5
    ranksight diagnose pl1 --store runs

``--slow-rank``/``--slow-factor``/``--slow-start``: one rank slow on purpose (``straggler.py``, the example's own
code, inside ``training_step``). Works with ``lightning`` or ``pytorch_lightning``, whichever is installed; gloo on a
CPU, NCCL with one GPU per rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from ranksight.integrations.lightning import RanksightCallback  # ranksight
from straggler import Straggler, add_arguments


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=None, help="the run store (default $RANKSIGHT_STORE or ./runs)")
    p.add_argument("--run-id", default=None, help="the run id (default $RANKSIGHT_RUN_ID or torchrun's run id)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_arguments(p)
    return p.parse_args()


def mlp(width: int, classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, 2 * width), nn.GELU(),
                         nn.Linear(2 * width, width), nn.GELU(), nn.Linear(width, classes))


class TeacherData(Dataset):
    """Random inputs labelled by a fixed random network: a task the model can learn, as long as asked for."""

    def __init__(self, width: int, size: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, width, generator=g)
        torch.manual_seed(1)
        with torch.no_grad():
            self.y = mlp(width)(self.x).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Classifier(pl.LightningModule):
    def __init__(self, width: int, lr: float, straggler: Straggler):
        super().__init__()
        self.net = mlp(width)
        self.lr = lr
        self.straggler = straggler

    def training_step(self, batch, batch_idx):
        x, y = batch
        with self.straggler.forward(self.global_step):
            loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    args = parse_args()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nnodes = int(os.environ.get("WORLD_SIZE", "1")) // local_world
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    data = TeacherData(args.width, size=args.batch_size * local_world * nnodes * 8)
    model = Classifier(args.width, args.lr, Straggler.from_args(rank, args, "cuda" if use_cuda else "cpu"))
    trainer = pl.Trainer(
        accelerator="gpu" if use_cuda else "cpu", devices=local_world, num_nodes=nnodes, strategy="ddp",
        max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
        callbacks=[RanksightCallback(run_id=args.run_id, store=args.store)],  # ranksight
    )
    # the DistributedSampler Lightning adds gives each rank its own shard; the data repeats over epochs
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if trainer.global_rank == 0:
        print(f"finished at step {trainer.global_step}, loss {float(trainer.callback_metrics['train_loss']):.4f}",
              flush=True)


if __name__ == "__main__":
    main()
