"""``_foreach_sub`` with a numeric ``alpha``, spelled as ``_foreach_add`` of ``-alpha``.

Before (schedule-free's iterate step)::

    torch._foreach_sub_(zs, grads, alpha=0.001)

After::

    torch._foreach_add_(zs, grads, alpha=-0.001)

Why: torch 2.11's Inductor lowers ``aten._foreach_sub.List`` without ``alpha``
(``register_foreach_pointwise(aten._foreach_sub.List, sub)`` in
``torch/_inductor/lowering.py``, no ``allow_alpha``; 2.13 passes it): the compiled step
subtracts the whole gradient, silently, under plain Inductor too (schedule-free's foreach
AdamW moved its weights 16x its float64 run's movement).  The sum is the same: ``b * -alpha``
is ``-(b * alpha)`` exactly, and ``a + -(x)`` rounds as ``a - x``, fused or not.  A symbolic
alpha (a scheduled float) is left to :mod:`collage_compile.passes.scalars`, which takes it
out of the op.  Runs on Dynamo's graph before anything else, on every torch (on 2.13 the
arithmetic is the same either way), so every path to Inductor gets it.
"""

from __future__ import annotations

import numbers

import torch
import torch.fx as fx

_SPELLED = {torch._foreach_sub: torch._foreach_add, torch._foreach_sub_: torch._foreach_add_}


def run(gm: fx.GraphModule) -> int:
    """Rewrite every ``_foreach_sub(_)`` with a numeric ``alpha`` other than 1; returns how
    many (the graph module is recompiled when any)."""
    n = 0
    for node in gm.graph.nodes:
        alpha = node.kwargs.get("alpha") if node.op == "call_function" else None
        if node.target not in _SPELLED or not _numeric(alpha) or alpha == 1:
            continue
        node.target = _SPELLED[node.target]
        node.kwargs = {**node.kwargs, "alpha": -alpha}
        n += 1
    if n:
        gm.recompile()
    return n


def _numeric(x: object) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, (bool, complex))
