"""A Hugging Face ``transformers.Trainer`` run (a tiny GPT-2 made from a config, no download, on synthetic token
sequences), observed by ranksight through its Trainer callback.

ranksight costs this script 2 added lines, marked ``# ranksight``: the import of ``RanksightCallback`` and
``trainer.add_callback(...)`` (given the trainer, so that the DDP-wrapped model is watched).

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --store runs --run-id hf1 --steps 40 \\
        --slow-rank 1 --slow-factor 1.5
    ranksight diagnose hf1 --store runs

Needs ``transformers`` and ``accelerate`` (not dependencies of ranksight; the test suite does not run this script).
``--slow-rank``/``--slow-factor``/``--slow-start``: one rank slow on purpose (``straggler.py``, the example's own
code, in the model's forward). gloo on a CPU (``--device cpu``, or where there is no GPU); NCCL with one GPU per rank.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ranksight.integrations.hf import RanksightCallback  # ranksight
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
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add_arguments(p)
    return p.parse_args()


class RuleTokens(Dataset):
    """Sequences that follow a rule (each token is the previous one times 3 plus 1, mod vocab, from a random start)."""

    def __init__(self, size: int, seq_len: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, vocab, (size,), generator=g)]
        for _ in range(seq_len - 1):
            tokens.append((3 * tokens[-1] + 1) % vocab)
        self.ids = torch.stack(tokens, dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def slow_forward(model: torch.nn.Module, straggler: Straggler, trainer: Trainer) -> None:
    """The straggler's extra work after the model's forward (before backward): the example's own code."""
    inner = model.forward

    @functools.wraps(inner)  # the Trainer reads forward's signature to pick the dataset's columns
    def forward(*args, **kwargs):
        with straggler.forward(trainer.state.global_step):
            return inner(*args, **kwargs)

    model.forward = forward


def main() -> None:
    args = parse_args()
    use_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.d_model,
                        n_layer=args.n_layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-example-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=3e-3, logging_steps=args.logging_steps,
        save_strategy="no", report_to=[], use_cpu=use_cpu, disable_tqdm=True, dataloader_num_workers=0,
        ddp_backend="gloo" if use_cpu else None)
    data = RuleTokens(args.batch_size * max(1, world) * 8, args.seq_len, args.vocab)
    trainer = Trainer(model=model, args=training, train_dataset=data)
    trainer.add_callback(RanksightCallback(run_id=args.run_id, store=args.store, trainer=trainer))  # ranksight
    slow_forward(model, Straggler.from_args(rank, args, "cpu" if use_cpu else "cuda"), trainer)
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"finished at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
