"""``RanksightCallback``: ranksight in a Hugging Face ``transformers.Trainer``.

    from ranksight.integrations.hf import RanksightCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(RanksightCallback(run_id="exp1", store="/shared/ranksight", trainer=trainer))

What it does, in the Trainer's callback events (every process runs them):

- ``on_train_begin``: ``ranksight.init`` (the process group exists by then) and ``rs.watch`` on the model the Trainer
  trains: ``trainer.model_wrapped`` (the ``DistributedDataParallel`` wrapper) when the callback was given
  ``trainer=``. Without it the callback sees only the unwrapped model (the events pass no other): FSDP2 shards that
  model in place and is watched all the same, but DDP's gradient-sync timing is not attached, and ``diagnose`` says
  which checks could not run for want of it;
- one ranksight step per optimizer step, from ``on_step_begin`` to ``on_step_end``. When the Trainer logs at that
  step (``control.should_log``), the step stays open until ``on_log`` and takes the logged ``loss``, ``grad_norm``
  and ``learning_rate`` (the Trainer's loss there is the mean since its last log: the Trainer hands callbacks no
  per-step loss);
- phases: ``forward`` from the model's forward (a forward pre-hook), ``backward`` from the first gradient of its
  output, ``optimizer`` between ``on_pre_optimizer_step`` and ``on_optimizer_step``; the batches' token ids are
  counted in the same pre-hook. The batch is fetched before ``on_step_begin``, outside the step;
- ``on_train_end`` finishes the run (``exit`` with reason ``finished``). The Trainer has no exception event: an
  exception that ends the process is recorded by ``ranksight.init``'s exit handlers (with its reason).

``transformers`` is imported only when ``RanksightCallback`` is first used (the class subclasses
``transformers.TrainerCallback``).
"""

from __future__ import annotations

from ranksight.instrument.session import first_grad_tensor

__all__ = ["RanksightCallback"]


class TrainerHooks:
    """The callback's behaviour (``RanksightCallback`` adds ``transformers.TrainerCallback`` as a base)."""

    def __init__(self, run_id: str | None = None, store=None, *, trainer=None, watch: bool = True, **init_kwargs):
        """``run_id``/``store`` and ``init_kwargs``: as ``ranksight.init``. ``trainer``: the ``Trainer`` this callback
        is added to, so that the wrapped (DDP) model is watched. ``watch=False``: no timing hooks on the model."""
        self.run_id, self.store, self.init_kwargs = run_id, store, init_kwargs
        self.trainer, self.watch = trainer, watch
        self.rs = None  # the ranksight Session, from on_train_begin on
        self.step = None  # the open StepHandle
        self.await_log = False  # the open step waits for on_log's loss
        self.micro = 0
        self.tokens = 0
        self.hooked: set[int] = set()  # the modules whose phases are hooked (id)

    # -- start -----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.rs is None:
            import ranksight

            self.rs = ranksight.init(self.run_id, self.store, **self.init_kwargs)
            if self.watch:
                wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
                target = wrapped if wrapped is not None else model
                if target is not None:
                    self.rs.watch(target)
        if model is not None and id(model) not in self.hooked:
            self.hook_phases(model)
            self.hooked.add(id(model))

    def hook_phases(self, model) -> None:
        """forward from the model's forward pre-hook (which also counts the batch's tokens), backward from the first
        gradient of its output; only inside an open step and in training mode (evaluation runs the model too)."""
        from ranksight.integrations.batch import count_tokens

        def pre(module, args, kwargs):
            if self.step is None or not module.training:
                return
            self.rs.set_phase("forward")
            self.micro += 1
            self.tokens += count_tokens(kwargs) or count_tokens(args)

        def post(module, args, kwargs, out):
            if self.step is None or not module.training:
                return
            t = first_grad_tensor(out)
            if t is not None:
                t.register_hook(self._on_backward)

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)

    def _on_backward(self, grad):
        if self.step is not None:
            self.rs.set_phase("backward")

    # -- steps -------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if self.rs is None or self.rs.finished:
            return
        self.close()  # a step still open (its log never came)
        self.step = self.rs.begin_step(int(state.global_step))
        self.micro = self.tokens = 0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.step is not None:
            self.rs.set_phase("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.step is not None:
            self.rs.set_phase(None)

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is None:
            return
        if getattr(control, "should_log", False):
            self.await_log = True  # the Trainer logs right after this event: take its loss
        else:
            self.close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.step is None or not self.await_log:
            return
        values = {}
        for key, field in (("loss", "loss"), ("grad_norm", "grad_norm"), ("learning_rate", "lr")):
            v = (logs or {}).get(key)
            if isinstance(v, (int, float)):
                values[field] = float(v)
        self.close(**values)

    def close(self, **values) -> None:
        """End the open step with what its batches said (micro-batches, tokens) and ``values``."""
        if self.step is None:
            return
        values["microbatches"] = max(1, self.micro)
        if self.tokens:
            values["tokens"] = self.tokens
        self.step = None
        self.await_log = False
        self.rs.end_step(**values)

    # -- the end ---------------------------------------------------------------------------------
    def on_train_end(self, args, state, control, **kwargs):
        if self.rs is None:
            return
        self.close()
        self.rs.finish()


def _make_class() -> type:
    from transformers import TrainerCallback

    return type("RanksightCallback", (TrainerHooks, TrainerCallback), {
        "__doc__": TrainerHooks.__doc__.replace("The callback's behaviour", "ranksight in a Hugging Face Trainer")
                   + "\n\n" + (__doc__ or ""),
        "__module__": __name__,
    })


def __getattr__(name: str):
    # made on first use, on transformers' TrainerCallback
    if name == "RanksightCallback":
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
