"""Hugging Face ``transformers.Trainer``: one callback adopts collage.

    from collage_compile.hf import CollageCallback

    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)   # bf16 weights only
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[CollageCallback()])
    trainer.train()

When training begins, the callback compiles the optimizer the Trainer built (or was given)
with the collage backend (:func:`collage_compile.compile_optimizer`), so every
``optimizer.step()`` the Trainer makes, after its gradient clipping and with its LR
schedule, runs the compensated step.  ``TrainingArguments``' default optimizer on recent
torch is ``adamw_torch_fused``, one opaque kernel no backend can rewrite: before the first
step (no state yet, nothing to convert) the callback switches its groups to ``fused=False``,
the same AdamW arithmetic in traceable form, and logs that it did.  It also attaches the
optimizer (:func:`collage_compile.attach`): the Trainer's checkpoints carry every ``lo``,
and ``trainer.train(resume_from_checkpoint=...)`` restores them (the Trainer loads its
optimizer before any callback runs; attaching then takes the loaded ``lo`` out of the
optimizer's state and restores them, checked against the weights the Trainer loaded).

With ``CollageCallback(metrics=True)`` the steps the Trainer logs are measured inside the
compiled step (``every="metered"`` unless given: the others run unmeasured) and their EDQ
goes into the Trainer's logs as ``collage/edq``, ``collage/edq_hi``, ``collage/imprecision``
and ``collage/lo_rel`` (:func:`collage_compile.last_metrics`): into ``state.log_history``
and to every ``report_to`` integration, whose callbacks the Trainer calls before a user's
(the callback moves itself to the front of the Trainer's callback list when training
begins, so its ``on_log`` fills the log dict before theirs read it).

Importing this module imports ``transformers``; ``import collage_compile`` does not.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from collage_compile.checkpoint import adopt, attach
from collage_compile.metrics import last_metrics, measuring
from collage_compile.optim import compile_optimizer

__all__ = ["CollageCallback"]

log = logging.getLogger("collage_compile")


class CollageCallback(TrainerCallback):
    """Compile the Trainer's optimizer step with the collage backend (``options``: those
    of :func:`collage_compile.make_backend`) when training begins."""

    def __init__(self, **options: Any):
        self.metrics = bool(options.get("metrics"))
        if self.metrics:
            options = {"every": "metered", **options}
        self.options = options
        self._open = contextlib.ExitStack()
        self._measured_step: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        if optimizer is None:
            raise RuntimeError("collage: the Trainer passed no optimizer to on_train_begin")
        inner = _unwrap(optimizer)
        _unfuse(inner)
        restored = adopt(inner)  # the lo the Trainer's resume load left in the state
        compile_optimizer(inner, **self.options)
        attach(inner)  # its checkpoints carry every lo from here on
        if state.global_step > 0 and not restored:
            _resumed_without_lo(inner, state.global_step)
        if self.metrics:
            _go_first(self)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.metrics and _logs_next(args, state):
            self._open.enter_context(measuring())
            self._measured_step = state.global_step + 1

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._open.close()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not self.metrics or logs is None or "loss" not in logs:
            return
        if self._measured_step != state.global_step:
            return  # a log the step before could not foresee: no stale numbers
        m = {f"collage/{k}": v for k, v in last_metrics().items()}
        logs.update(m)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last.update(m)  # the Trainer appended this log before calling the callbacks


def _resumed_without_lo(optimizer: torch.optim.Optimizer, step: int) -> None:
    """A resumed run whose optimizer state held no lo to restore (or none at all:
    ``save_only_model``): named once, where it has low-precision weights."""
    from collage_compile.diagnostics import warn_once
    from collage_compile.mcf import LOW_PRECISION

    low = any(p.dtype in LOW_PRECISION for g in optimizer.param_groups for p in g["params"])
    if not low:
        return
    warn_once(
        ("hf-resumed-without-lo", str(id(optimizer))),
        f"collage: the Trainer resumed at step {step} without the lo of its weights: the "
        "checkpoint's optimizer state holds none (saved without CollageCallback, or by a "
        "version whose callback did not attach, or with save_only_model=True, which keeps "
        "no optimizer state), or it was loaded where the callback cannot see it (accelerate's "
        "FSDP load). Every lo restarts from zero (up to half a bf16 ulp per weight, once; at "
        "small learning rates that is many steps' worth of updates). Checkpoints this run "
        "saves carry them.",
        stacklevel=3,
    )


def _logs_next(args: Any, state: Any) -> bool:
    """Whether the Trainer will log after the optimizer step about to run (its
    ``DefaultFlowCallback`` decides after the step; by steps this is the same rule; by
    epoch or a custom flow, every step is measured)."""
    step = state.global_step + 1
    if step == 1 and args.logging_first_step:
        return True
    if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps":
        return True
    every = state.logging_steps
    return bool(every) and step % every == 0


def _go_first(callback: CollageCallback) -> None:
    """Move ``callback`` to the front of the ``CallbackHandler`` calling it now (found on
    the call stack: the Trainer does not hand callbacks to a callback), so its ``on_log``
    adds the metrics before the integrations' read the log dict."""
    frame = inspect.currentframe()
    try:
        for _ in range(8):
            frame = frame.f_back if frame is not None else None
            owner = frame.f_locals.get("self") if frame is not None else None
            if isinstance(owner, CallbackHandler) and any(c is callback for c in owner.callbacks):
                owner.callbacks.remove(callback)
                owner.callbacks.insert(0, callback)
                return
    finally:
        del frame
    log.warning(
        "collage: CollageCallback found no Trainer callback list above it; the EDQ it adds "
        "to the logs reaches state.log_history but not report_to integrations called before it"
    )


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and the like)."""
    from collage_compile.checkpoint import unwrap

    optimizer = unwrap(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("collage: the Trainer's optimizer wraps no torch.optim.Optimizer")
    return optimizer


def _unfuse(optimizer: torch.optim.Optimizer) -> None:
    fused = [g for g in optimizer.param_groups if g.get("fused")]
    if not fused:
        return
    if any(optimizer.state.values()):
        raise ValueError(
            f"collage: {type(optimizer).__name__}(fused=True) has already stepped; its fused "
            "kernel cannot be upgraded. Use TrainingArguments(optim='adamw_torch')."
        )
    for group in fused:
        group["fused"] = False
    if "fused" in optimizer.defaults:
        optimizer.defaults["fused"] = False
    log.info(
        "collage: %s(fused=True) switched to fused=False before its first step (the same "
        "arithmetic, traceable); set TrainingArguments(optim='adamw_torch') to choose it",
        type(optimizer).__name__,
    )
