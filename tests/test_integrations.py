"""The framework callbacks (ranksight.integrations): Lightning's, in a real Trainer in this process; Hugging Face's,
driven in the order transformers' Trainer calls its events (and in a real Trainer where transformers is installed:
it is not a dependency, so CI skips that one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ranksight.schema import EventRecord, StepRecord, decode_spool_line

ROOT = Path(__file__).resolve().parents[1]
# no CPU peak measurement and no process-wide exit handlers inside the test process
INIT = {"peak_flops": 1e12, "exit_handlers": False}


def records(store: Path, run_id: str, rank: int = 0) -> list:
    path = store / run_id / "spool" / f"rank-{rank}.jsonl"
    return [decode_spool_line(line) for line in path.read_bytes().splitlines() if line.strip()]


def steps_of(recs) -> list[StepRecord]:
    return [r for r in recs if isinstance(r, StepRecord)]


def exits_of(recs) -> list[EventRecord]:
    return [r for r in recs if isinstance(r, EventRecord) and r.event == "exit"]


def test_importing_the_integrations_imports_no_framework():
    code = ("import sys, ranksight.integrations.lightning, ranksight.integrations.hf, ranksight.integrations.batch\n"
            "heavy = [m for m in ('torch', 'lightning', 'pytorch_lightning', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr


def test_count_tokens():
    from ranksight.integrations.batch import count_tokens

    ids = torch.zeros(4, 16, dtype=torch.long)
    feats = torch.zeros(8, 32)
    assert count_tokens(ids) == 64  # token ids: every element
    assert count_tokens((feats, torch.zeros(8, dtype=torch.long))) == 8  # features: one per row
    assert count_tokens({"attention_mask": feats, "input_ids": ids}) == 64  # input_ids first, wherever it is
    assert count_tokens([{"x": feats}]) == 8
    assert count_tokens("no tensor") == 0


# -- Lightning ------------------------------------------------------------------------------------------


def _lightning():
    import pytorch_lightning as pl  # a dev dependency (pyproject): the suite runs the callback in a real Trainer

    return pl


def _classifier(pl, fail_at: int | None = None):
    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch, batch_idx):
            if fail_at is not None and self.global_step >= fail_at:
                raise RuntimeError("boom in training_step")
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier()


def _loader(batch: int = 8, n: int = 256):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _trainer(pl, callback, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **kw)


def test_lightning_callback_records_steps_phases_loss_and_the_end(tmp_path):
    pl = _lightning()
    from ranksight.integrations.lightning import RanksightCallback

    assert issubclass(RanksightCallback, pl.Callback)
    cb = RanksightCallback(run_id="pl", store=tmp_path, **INIT)
    _trainer(pl, cb, max_steps=6).fit(_classifier(pl), _loader())

    recs = records(tmp_path, "pl")
    st = steps_of(recs)
    assert [r.step for r in st] == list(range(6))
    for r in st:
        assert r.loss is not None and r.loss > 0
        assert r.forward_ms > 0 and r.backward_ms > 0 and r.optimizer_ms > 0
        assert r.microbatches == 1 and r.tokens == 8  # features: one sample per row
        assert r.lr == pytest.approx(0.1)
        assert r.device_ms is not None and r.device_ms > 0
    assert [e.detail["reason"] for e in exits_of(recs)] == ["finished"]
    assert (tmp_path / "pl" / "run.json").is_file()


def test_lightning_callback_one_step_per_optimizer_step(tmp_path):
    pl = _lightning()
    from ranksight.integrations.lightning import RanksightCallback

    cb = RanksightCallback(run_id="acc", store=tmp_path, **INIT)
    _trainer(pl, cb, max_steps=3, accumulate_grad_batches=2).fit(_classifier(pl), _loader())
    st = steps_of(records(tmp_path, "acc"))
    assert [r.step for r in st] == [0, 1, 2]
    assert all(r.microbatches == 2 and r.tokens == 16 for r in st)


def test_lightning_callback_records_the_exception(tmp_path):
    pl = _lightning()
    from ranksight.integrations.lightning import RanksightCallback

    cb = RanksightCallback(run_id="boom", store=tmp_path, **INIT)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(pl, cb, max_steps=10).fit(_classifier(pl, fail_at=3), _loader())
    recs = records(tmp_path, "boom")
    assert [r.step for r in steps_of(recs)] == [0, 1, 2]
    assert [e.detail["reason"] for e in exits_of(recs)] == ["RuntimeError: boom in training_step"]


# -- Hugging Face ---------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Called as a transformers model is: keyword arguments in, a dict with the loss first out."""

    def __init__(self, vocab: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, input_ids=None, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def test_hf_callback_in_the_trainers_event_order(tmp_path):
    """The order of transformers' Trainer (_inner_training_loop, _maybe_log_save_evaluate): on_train_begin (model =
    the unwrapped model); per optimizer step on_step_begin, forward/backward per micro-batch (on_substep_end between),
    on_pre_optimizer_step, optimizer.step, on_optimizer_step, global_step += 1, on_step_end (DefaultFlowCallback has
    set control.should_log), on_log when logging, then an evaluation; on_train_end."""
    from ranksight.integrations.hf import TrainerHooks

    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = TrainerHooks(run_id="hf", store=tmp_path, **INIT)
    args, state, control = SimpleNamespace(), SimpleNamespace(global_step=0), SimpleNamespace(should_log=False)
    ids = torch.randint(0, 32, (2, 8))
    cb.on_train_begin(args, state, control, model=model)
    for _ in range(4):
        cb.on_step_begin(args, state, control, model=model)
        for _ in range(2):  # gradient accumulation: two micro-batches (the Trainer's on_substep_end between)
            model(input_ids=ids, labels=ids)["loss"].backward()
        cb.on_pre_optimizer_step(args, state, control)
        opt.step()
        cb.on_optimizer_step(args, state, control)
        opt.zero_grad()
        state.global_step += 1
        control.should_log = state.global_step % 2 == 0
        cb.on_step_end(args, state, control)
        if control.should_log:
            cb.on_log(args, state, control, logs={"loss": 1.5, "grad_norm": 0.25, "learning_rate": 0.1, "epoch": 1.0})
            model.eval()
            with torch.no_grad():
                model(input_ids=ids, labels=ids)  # evaluation: outside any step, not counted
            model.train()
    cb.on_train_end(args, state, control)

    recs = records(tmp_path, "hf")
    st = steps_of(recs)
    assert [r.step for r in st] == [0, 1, 2, 3]
    assert [r.loss for r in st] == [None, 1.5, None, 1.5]  # the logged loss, on the steps the Trainer logged
    assert [r.grad_norm for r in st] == [None, 0.25, None, 0.25]
    for r in st:
        assert r.microbatches == 2 and r.tokens == 2 * ids.numel()
        assert r.forward_ms > 0 and r.backward_ms > 0 and r.optimizer_ms > 0
    assert [e.detail["reason"] for e in exits_of(recs)] == ["finished"]


def test_hf_callback_in_a_real_trainer(tmp_path):
    """Where transformers and accelerate are installed (not in CI): a tiny GPT-2 made from a config, 6 steps."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ranksight.integrations.hf import RanksightCallback

    assert issubclass(RanksightCallback, transformers.TrainerCallback)

    class Rule(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = (torch.arange(16) * 3 + i) % 64
            return {"input_ids": ids, "labels": ids}

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4,
                                          logging_steps=3, save_strategy="no", report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rule())
    trainer.add_callback(RanksightCallback(run_id="hfreal", store=tmp_path, trainer=trainer, **INIT))
    trainer.train()

    recs = records(tmp_path, "hfreal")
    st = steps_of(recs)
    assert [r.step for r in st] == list(range(6))
    assert [r.loss is not None for r in st] == [False, False, True, False, False, True]
    assert all(r.tokens == 4 * 16 and r.forward_ms > 0 and r.backward_ms > 0 for r in st)
    assert [e.detail["reason"] for e in exits_of(recs)] == ["finished"]
