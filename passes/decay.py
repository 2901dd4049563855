"""Decays: ``mul_`` / ``div_`` / ``neg_`` by a constant or a tensor (weight decay ``p *= 1-lr*wd``).

Before (AdamW, lr = 1e-3, weight_decay = 0.01)::

    mul_ = p.mul_(0.99999)

After (``arithmetic="fp32"``)::

    c_hi, c_lo = 0.99999 split in float64 on the host       # fp32 pair
    p_, t = two_prod(hi.float(), c_hi)                      # exact, fma-free (Dekker)
    e = t + (hi.float() * c_lo + lo.float() * c_hi)
    ... rounded into (hi, lo) with the rest of the chain

Why: ``bf16(x * 0.99999) == x`` for every bf16 ``x`` (the decay is 1e-5, bf16 resolves
2^-8), so plain bf16 weight decay never decays.  The expansion product keeps the decrement
in lo until it is large enough to move hi.
"""

from __future__ import annotations

from typing import Any

from collage_compile.accumulators import GraphInfo, Step
from collage_compile.passes._common import bind, is_number


def mul_(other: Any) -> None:
    """Signature of ``Tensor.mul_``."""


def div_(other: Any, rounding_mode: Any = None) -> None:
    """Signature of ``Tensor.div_``."""


def divisor_step(other: Any) -> Step | None:
    """A division as a step: by a constant, the float64 reciprocal where fp32 holds it (a
    multiplication, split again in the chain); otherwise a true division by ``other``."""
    if is_number(other):
        if other == 0:
            return None
        inv = 1.0 / float(other)
        return Step("mul", (inv,)) if abs(inv) < 3.0e38 else Step("div", (float(other),))
    return Step("div", (other,))


def match(info: GraphInfo, ctx: Any) -> int:
    n = 0
    for write in ctx.unclaimed():
        step = _step(write)
        if step is not None:
            ctx.claim(write, [step], pattern=write.op)
            n += 1
    return n


def _step(write: Any) -> Step | None:
    if write.op == "neg_":
        return Step("mul", (-1.0,)) if not write.args and not write.kwargs else None
    if write.op == "mul_":
        args = bind(mul_, write.args, write.kwargs)
        return None if args is None else Step("mul", args)
    if write.op == "div_":
        args = bind(div_, write.args, write.kwargs)
        if args is None or args[1] is not None:  # floor/trunc division: not a decay
            return None
        return divisor_step(args[0])
    return None
