"""Running maxima: ``x = max(x, y)`` where ``x`` decays in the same chain (Adamax's ``exp_inf``).

Covers ``torch.maximum(x, y, out=x)`` (either operand the tensor itself, or a view of all
of it such as ``x.mul_(b)``'s result) and ``torch._foreach_maximum_(xs, ys)`` (split per
element by the analysis).

Before (bf16 ``exp_inf``, Adamax's single-tensor step at beta2 = 0.999)::

    mul_ = exp_inf.mul_(0.999)
    maximum = torch.maximum(mul_, grad.abs().add_(eps), out=exp_inf)

After (``arithmetic="fp32"``, one chain with the decay)::

    s, e = exp_inf.float(), lo.float()
    s, e = s, e * 0.999 + s * (0.999 - 1)              # the decay, kept whole in e
    m = (grad.abs() + eps).float()
    take = ((s - m) + e < 0) | isnan(m)                # the pair's full value against m
    s, e = where(take, m, s), where(take, 0, e)
    ... rounded into (hi, lo) with the rest of the chain

Why: ``bf16(x * 0.999) == x`` for every bf16 ``x`` (the decay is 1e-3, bf16 resolves 2^-8),
so in plain bf16 Adamax's ``exp_inf`` never decays: it holds the largest gradient it ever
saw.  The decay's pair keeps the decrement in lo; the maximum then compares the pair's whole
value with ``y``: where ``y`` wins the value is ``y`` exactly (lo 0), else the decayed pair
stays.  Comparison is exact, so the step adds no rounding of its own.

A tensor whose only writes are maxima (AMSGrad's ``max_exp_avg_sq``) accumulates nothing
that rounds: the modes leave it as written (:mod:`collage_compile.modes`).
"""

from __future__ import annotations

from typing import Any

from collage_compile.accumulators import Accumulator, GraphInfo, Step
from collage_compile.passes.copy_expr import reads_tensor


def match(info: GraphInfo, ctx: Any) -> int:
    """Claim every maximum of a tensor with an operand that does not read it; returns how
    many sites it claimed."""
    n = 0
    for write in ctx.unclaimed():
        other = _other_operand(info, write)
        if other is not None:
            ctx.claim(write, [Step("max", (other,))], pattern=write.op)
            n += 1
    return n


def _other_operand(info: GraphInfo, write: Any) -> Any:
    """The ``y`` of ``x = max(x, y)``, or None when the write is not one."""
    if write.kwargs:
        return None
    if write.op == "maximum_" and len(write.args) == 1:
        other = write.args[0]
    elif write.op == "maximum(out=)" and len(write.args) == 2:
        a, b = write.args
        if _is_whole(info, write.acc, a):
            other = b
        elif _is_whole(info, write.acc, b):
            other = a
        else:
            return None  # x = max(a, b) of two other tensors: an overwrite, left as written
    else:
        return None
    return None if reads_tensor(info, write.acc, other) else other


def _is_whole(info: GraphInfo, acc: Accumulator, x: Any) -> bool:
    return any(a is acc and whole for a, whole in info.accumulators_of_node(x))
