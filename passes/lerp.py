"""Interpolations: ``lerp_`` (``x += w * (end - x)``) and ``torch._foreach_lerp_``.

Before (a bf16 EMA of weights, d = 0.999)::

    lerp_ = ema.lerp_(p, 0.001)

After::

    s, e = hi.float(), lo.float()
    u = 0.001 * ((p.float() - s) - e)         # the step, from the pair's full value
    s, e = two_sum(s, u) ...                   # then as any addition

Why: ``w * (end - x)`` is typically far below half an ulp of ``x`` (an EMA with d >= 0.996
is stuck for good in bf16).  The difference ``end - x`` is taken against hi + lo, so the
interpolation tracks the value the pair stands for, not its rounded head.
"""

from __future__ import annotations

from typing import Any

from collage_compile.accumulators import GraphInfo, Step
from collage_compile.passes._common import bind


def lerp_(end: Any, weight: Any) -> None:
    """Signature of the in-place op (the step itself is computed in the chain)."""


def match(info: GraphInfo, ctx: Any) -> int:
    n = 0
    for write in ctx.unclaimed():
        if write.op != "lerp_":
            continue
        args = bind(lerp_, write.args, write.kwargs)
        if args is None:
            continue
        ctx.claim(write, [Step("lerp", args)], pattern="lerp_")
        n += 1
    return n
