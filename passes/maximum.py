"""Bounds: running maxima (Adamax's ``exp_inf``), minima and clamps (a weight constraint).

Covers ``torch.maximum(x, y, out=x)`` (either operand the tensor itself, or a view of all
of it such as ``x.mul_(b)``'s result), ``torch._foreach_maximum_(xs, ys)`` (split per
element by the analysis), their ``minimum`` mirrors, ``clamp_min_`` / ``clamp_max_`` and
``clamp_`` / ``clip_`` (a maximum then a minimum), in place, with ``out=`` or foreach.

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
stays.  Comparison is exact, so the step adds no rounding of its own.  A clamp of a weight
after its update (``p.clamp_(-c, c)`` in a step post-hook, WGAN's clipping) is the same
two comparisons: without them lo restarted from zero after every clamp, so every weight
inside the bounds lost its small updates as plain bf16 does.

A tensor whose only writes are maxima (AMSGrad's ``max_exp_avg_sq``) accumulates nothing
that rounds: the modes leave it as written (:mod:`collage_compile.modes`).
"""

from __future__ import annotations

from typing import Any

from collage_compile.accumulators import Accumulator, GraphInfo, Step
from collage_compile.passes._common import bind
from collage_compile.passes.copy_expr import reads_tensor


def match(info: GraphInfo, ctx: Any) -> int:
    """Claim every bound of a tensor by operands that do not read it; returns how many
    sites it claimed."""
    n = 0
    for write in ctx.unclaimed():
        steps = _bounds(info, write)
        if steps:
            ctx.claim(write, steps, pattern=write.op)
            n += 1
    return n


def _clamp_sig(min: Any = None, max: Any = None) -> None: ...


# op -> the step kind its one operand gives
_ONE_SIDED = {"maximum_": "max", "clamp_min_": "max", "minimum_": "min", "clamp_max_": "min"}
_TWO_SIDED = {"maximum(out=)": "max", "minimum(out=)": "min"}
_CLAMPS = {"clamp_", "clip_"}
_CLAMPS_OUT = {"clamp(out=)", "clip(out=)"}


def _bounds(info: GraphInfo, write: Any) -> list[Step] | None:
    """The steps of ``x = max(x, y)``, ``min(x, y)`` or ``clamp(x, lo, hi)``, or None when
    the write is not one (or a bound reads the tensor)."""
    op, args = write.op, write.args
    if op in _ONE_SIDED and len(args) == 1 and not write.kwargs:
        steps = [Step(_ONE_SIDED[op], (args[0],))]
    elif op in _TWO_SIDED and len(args) == 2 and not write.kwargs:
        other = _other_operand(info, write.acc, *args)
        steps = None if other is None else [Step(_TWO_SIDED[op], (other,))]
    elif op in _CLAMPS:
        steps = _clamp_steps(args, write.kwargs)
    elif op in _CLAMPS_OUT and args and _is_whole(info, write.acc, args[0]):
        steps = _clamp_steps(args[1:], {k: v for k, v in write.kwargs.items() if k != "out"})
    else:
        return None
    if not steps or any(reads_tensor(info, write.acc, s.args[0]) for s in steps):
        return None
    return steps


def _clamp_steps(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Step] | None:
    """``clamp(x, min, max)`` as a maximum then a minimum (torch's order: where min > max
    every element is max); a bound left out or None is no step."""
    bound = bind(_clamp_sig, args, kwargs)
    if bound is None:
        return None
    low, high = bound
    steps = [Step(kind, (y,)) for kind, y in (("max", low), ("min", high)) if y is not None]
    return steps or None


def _other_operand(info: GraphInfo, acc: Accumulator, a: Any, b: Any) -> Any:
    """The ``y`` of ``x = max(x, y)`` spelled ``torch.maximum(a, b, out=x)``, or None
    (``max(a, b)`` of two other tensors is an overwrite, left as written)."""
    if _is_whole(info, acc, a):
        return b
    if _is_whole(info, acc, b):
        return a
    return None


def _is_whole(info: GraphInfo, acc: Accumulator, x: Any) -> bool:
    return any(a is acc and whole for a, whole in info.accumulators_of_node(x))
