"""``RanksightCallback``: ranksight in a Lightning ``Trainer``, in one line.

    from ranksight.integrations.lightning import RanksightCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[RanksightCallback(run_id="exp1", store="/shared/ranksight")])

What it does, in Lightning's hooks (every rank runs them):

- ``setup`` (fit): ``ranksight.init`` (the process group exists by then);
- ``on_fit_start``: ``rs.watch`` on the model the strategy trains, i.e. the ``DistributedDataParallel`` wrapper under
  ``DDPStrategy``, the LightningModule (its FSDP2-sharded modules) under ``ModelParallelStrategy``;
- one ranksight step per optimizer step: opened at ``on_train_batch_start``, closed at ``on_train_batch_end`` once
  the optimizer has stepped (with gradient accumulation a step spans its micro-batches), with the loss from the
  training step's output, the learning rate, the micro-batches and the batch's tokens;
- phases: ``forward`` from the batch start, ``backward`` between ``on_before_backward`` and ``on_after_backward``,
  ``optimizer`` from ``on_before_optimizer_step``. Loading the batch happens before ``on_train_batch_start``, outside
  the step: Lightning has no hook around it;
- the end: ``on_train_end`` finishes the run (``exit`` with reason ``finished``); ``on_exception`` records the error.

DDP accepts one comm hook: a hook of your own goes to ``RanksightCallback(comm_hook=..., comm_state=...)`` (it is
timed and registered for you) rather than to ``DDPStrategy(ddp_comm_hook=...)``; where the strategy already
registered one, the gradient-sync timing is left out and the ``watch`` event says so.

The Lightning package is imported only when ``RanksightCallback`` is first used; the class then subclasses the
``Callback`` of the Lightning package(s) already imported (``lightning.pytorch`` and/or ``pytorch_lightning``), or,
when neither is yet, of those installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping

from ranksight.instrument.session import exit_reason

__all__ = ["RanksightCallback", "callback_bases"]

# the two distributions of Lightning: the unified ``lightning`` package and the standalone ``pytorch_lightning``
LIGHTNING_MODULES = ("lightning.pytorch", "pytorch_lightning")


def callback_bases() -> tuple[type, ...]:
    """The ``Callback`` classes to subclass: of the Lightning packages already imported, else of every one installed
    (a Trainer accepts only its own package's callbacks)."""
    names = [m for m in LIGHTNING_MODULES if m in sys.modules]
    if not names:
        names = [m for m in LIGHTNING_MODULES if _installed(m)]
    if not names:
        raise ImportError("ranksight.integrations.lightning needs Lightning: pip install pytorch-lightning "
                          "(or lightning)")
    return tuple(importlib.import_module(m).Callback for m in names)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


class LightningHooks:
    """The callback's behaviour (``RanksightCallback`` adds Lightning's ``Callback`` as a base)."""

    def __init__(self, run_id: str | None = None, store=None, *, watch: bool = True, comm_hook=None,
                 comm_state=None, **init_kwargs):
        """``run_id``/``store`` and ``init_kwargs``: as ``ranksight.init``. ``watch=False``: no timing hooks on the
        model (steps and phases only). ``comm_hook``/``comm_state``: your DDP comm hook, timed by ranksight."""
        self.run_id, self.store, self.init_kwargs = run_id, store, init_kwargs
        self.watch, self.comm_hook, self.comm_state = watch, comm_hook, comm_state
        self.rs = None  # the ranksight Session, from setup on
        self.step = None  # the open StepHandle
        self.opened_at = 0  # trainer.global_step when the open step began
        self.micro = 0
        self.tokens = 0

    # -- start ---------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.rs is not None:
            return
        import ranksight

        self.rs = ranksight.init(self.run_id, self.store, **self.init_kwargs)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.rs is None or not self.watch:
            return
        model = trainer.strategy.model or pl_module
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel) and getattr(model, "_comm_hooks", None):
            # the strategy registered a comm hook (DDPStrategy(ddp_comm_hook=...)) and DDP takes only one
            self.rs.event("watch_skipped", {"reason": "the DDP model already has a comm hook: pass it to "
                                                      "RanksightCallback(comm_hook=...) to have it timed"})
            self.rs.watch(pl_module)
            return
        self.rs.watch(model, comm_hook=self.comm_hook, comm_state=self.comm_state)

    # -- steps -----------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.rs is None or self.rs.finished:
            return
        if self.step is None:
            self.step = self.rs.begin_step(int(trainer.global_step))
            self.opened_at = trainer.global_step
            self.micro = self.tokens = 0
        self.micro += 1
        from ranksight.integrations.batch import count_tokens

        self.tokens += count_tokens(batch)
        self.rs.set_phase("forward")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.step is not None:
            self.rs.set_phase("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.step is not None:
            self.rs.set_phase(None)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.step is not None:
            self.rs.set_phase("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.step is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None and hasattr(loss, "detach"):
            self.step.report(loss=loss.detach())
        # an optimizer step closes the ranksight step; without accumulation every batch is one
        if trainer.global_step > self.opened_at or getattr(trainer, "accumulate_grad_batches", 1) <= 1:
            self.close(trainer)

    def close(self, trainer=None) -> None:
        """End the open step with what the batches said (micro-batches, tokens, the learning rate)."""
        if self.step is None:
            return
        values = {"microbatches": self.micro}
        if self.tokens:
            values["tokens"] = self.tokens
        optimizers = getattr(trainer, "optimizers", None) or []
        if optimizers and optimizers[0].param_groups:
            values["lr"] = float(optimizers[0].param_groups[0].get("lr", 0.0))
        self.step = None
        self.rs.end_step(**values)

    # -- the end ------------------------------------------------------------------------------
    def on_train_end(self, trainer, pl_module) -> None:
        if self.rs is None:
            return
        self.close(trainer)
        self.rs.finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.rs is None:
            return
        self.step = None
        self.rs.fail(exit_reason(exception))


def _make_class() -> type:
    bases = callback_bases()
    return type("RanksightCallback", (LightningHooks, *bases), {
        "__doc__": LightningHooks.__doc__.replace("The callback's behaviour", "ranksight in a Lightning Trainer")
                   + "\n\n" + (__doc__ or ""),
        "__module__": __name__,
    })


def __getattr__(name: str):
    # made on first use, on the base class(es) of the Lightning package(s) in use
    if name == "RanksightCallback":
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
