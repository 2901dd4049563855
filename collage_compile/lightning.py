"""Lightning (``lightning`` / ``pytorch_lightning`` 2.x): one callback adopts collage.

    from collage_compile.lightning import CollageCallback

    trainer = L.Trainer(precision="bf16-true", callbacks=[CollageCallback(mode="plus")],
                        gradient_clip_val=1.0, accumulate_grad_batches=2)
    trainer.fit(module)   # configure_optimizers returns a stock optimizer and scheduler

When fitting begins (``on_fit_start``: after Lightning built the optimizers the module's
``configure_optimizers`` returns, before it restores their state from ``ckpt_path``), the
callback compiles each optimizer's step with the collage backend
(:func:`collage_compile.compile_optimizer`) and attaches its ``lo`` components to its state
dict (:func:`collage_compile.attach`).  So, with nothing else changed:

* every optimizer step Lightning makes is the compensated one: Lightning passes its
  training-step closure to ``optimizer.step``, and the compiled step runs that closure
  eagerly first (forward, backward, and the gradient clipping the ``Trainer``'s
  ``gradient_clip_val`` asks for), as torch.optim does; accumulation
  (``accumulate_grad_batches``) calls the closure alone between steps;
* the module's schedulers, stepped by Lightning, change the learning rate without a
  recompile (the backend keeps it a graph input);
* Lightning's checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) carry every
  ``lo`` inside the optimizer state they already hold, and ``fit(ckpt_path=...)`` restores
  them: the resumed run continues bit for bit.

``precision="bf16-true"`` (or ``"16-true"``) is what makes the weights bf16; under
``"bf16-mixed"`` the weights stay fp32 and there is nothing to upgrade.  A
``fused=True`` optimizer is refused by name (no backend can rewrite its kernel).

Importing this module imports ``lightning`` (or ``pytorch_lightning``);
``import collage_compile`` does not.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from collage_compile.checkpoint import attach
from collage_compile.optim import compile_optimizer

__all__ = ["CollageCallback"]


class CollageCallback(Callback):
    """Compile each of the Trainer's optimizers with the collage backend (``options``:
    those of :func:`collage_compile.make_backend`) and carry their ``lo`` in its
    checkpoints."""

    def __init__(self, **options: Any):
        self.options = options

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.optimizers:
            raise RuntimeError(
                "collage: the Trainer has no optimizer (configure_optimizers returned none, "
                "or manual optimization builds its own): nothing to compile"
            )
        for optimizer in trainer.optimizers:
            compile_optimizer(optimizer, **self.options)
            attach(optimizer)
