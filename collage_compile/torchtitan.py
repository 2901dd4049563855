"""torchtitan: an optimizer container whose optimizers run the collage step.

torchtitan builds its optimizers from the config's ``optimizer`` entry, a
``Configurable.Config`` whose ``build()`` constructs the container named by its class.
This module's container is torchtitan's own ``OptimizersContainer`` with one addition:
after building the optimizers it compiles each one's step with the collage backend
(:func:`collage_compile.compile_optimizer`) and attaches its ``lo`` to its state dict
(:func:`collage_compile.attach`).  In a torchtitan config, instead of
``optimizer=default_adamw(lr=3e-4)``::

    from collage_compile.torchtitan import collage_adamw

    optimizer=collage_adamw(lr=3e-4, mode="plus")

Everything torchtitan does around the optimizer stays its own: the LR scheduler container
steps the same optimizers (the learning rate stays a graph input, no recompile per
value), FSDP2 shards the parameters and every ``lo`` is a DTensor placed like its
parameter, and the checkpoint manager saves the container's flat, FQN-keyed state dict with
DCP, now holding every ``lo`` (``state.<fqn>.collage_lo...``).  One change is needed for
loading: torchtitan unflattens only the state names an optimizer holds live, which would
drop every ``lo`` without a word; :meth:`CollageOptimizersContainer.load_state_dict` lists
them too, so a resumed run continues bit for bit.

``implementation="fused"`` (torchtitan's default) is one opaque kernel no backend can
rewrite: the container builds its optimizers with ``"foreach"`` instead, the same
arithmetic in traceable form, and logs that it did.  The model itself must hold bf16 (or
fp16) parameters: with FSDP2's ``MixedPrecisionPolicy`` over fp32 parameters there is
nothing to upgrade.

Importing this module imports ``torchtitan``; ``import collage_compile`` does not.
Checked with torchtitan 0.3.0.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.components.optimizer.utils import init_optim_state, load_flat_optim_state_dict

from collage_compile.checkpoint import HI, LO, attach
from collage_compile.optim import compile_optimizer

__all__ = ["CollageOptimizersContainer", "collage_adamw"]

log = logging.getLogger("collage_compile")


class CollageOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer``; each optimizer's step compiled by the collage
    backend with ``config.collage`` (the options of :func:`collage_compile.make_backend`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        implementation: str = "foreach"
        collage: dict[str, Any] = field(default_factory=dict)
        """Options of :func:`collage_compile.make_backend`, e.g. ``{"mode": "plus"}``."""

    def __init__(self, config: Config, *, model_parts: list[Any]) -> None:
        if config.implementation in ("fused", "fused_opt_states_bf16"):
            log.info(
                "collage: optimizer implementation %r is one opaque kernel; building the "
                "optimizers with 'foreach' (the same arithmetic, traceable) instead",
                config.implementation,
            )
            config = dataclasses.replace(config, implementation="foreach")
        super().__init__(config, model_parts=model_parts)
        for optimizer in self.optimizers:
            compile_optimizer(optimizer, **config.collage)
            attach(optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchtitan's load, with every ``lo`` the flat state dict holds passed on."""
        for optim in self.optimizers:
            init_optim_state(optim)
            listed = _list_ours(optim, state_dict)
            try:
                load_flat_optim_state_dict(optim, state_dict)
            finally:  # a load that failed leaves no placeholder behind
                for p, name in listed:
                    (optim.state.get(p) or {}).pop(name, None)


def _list_ours(optim: Any, flat: dict[str, Any]) -> list[tuple[Any, str]]:
    """Put a placeholder under each of our saved names into the live state of its
    parameter, which is what torchtitan's unflatten reads to know what to take from
    ``flat``; the attach hooks take the entries out before torch loads the rest."""
    listed = []
    for group in optim.param_groups:
        for p, fqn in zip(group["params"], group.get("param_names", [])):
            prefix = f"state.{fqn}."
            for key in flat:
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix) :]
                if name in (LO, HI) or name.startswith(LO + "."):
                    if name not in optim.state[p]:
                        optim.state[p][name] = None
                        listed.append((p, name))
    return listed


def collage_adamw(lr: float = 8e-4, mode: str = "light", **kwargs: Any) -> Any:
    """torchtitan's ``default_adamw`` (one catch-all AdamW group, betas (0.9, 0.95), eps
    1e-8, weight decay 0.1) in a :class:`CollageOptimizersContainer` with ``mode``."""
    return CollageOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={
                    "lr": lr,
                    "betas": (0.9, 0.95),
                    "eps": 1e-8,
                    "weight_decay": 0.1,
                    **kwargs,
                },
            )
        ],
        collage={"mode": mode},
    )
