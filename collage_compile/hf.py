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
the same AdamW arithmetic in traceable form, and logs that it did.

Importing this module imports ``transformers``; ``import collage_compile`` does not.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from collage_compile.optim import compile_optimizer

__all__ = ["CollageCallback"]

log = logging.getLogger("collage_compile")


class CollageCallback(TrainerCallback):
    """Compile the Trainer's optimizer step with the collage backend (``options``: those
    of :func:`collage_compile.make_backend`) when training begins."""

    def __init__(self, **options: Any):
        self.options = options

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        if optimizer is None:
            raise RuntimeError("collage: the Trainer passed no optimizer to on_train_begin")
        inner = _unwrap(optimizer)
        _unfuse(inner)
        compile_optimizer(inner, **self.options)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and the like)."""
    # AcceleratedOptimizer subclasses torch.optim.Optimizer itself: unwrap while there is
    # an inner optimizer, so the compiled step is the one that does the arithmetic
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
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
