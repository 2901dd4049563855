"""Interpolations: ``lerp_`` (``x += w * (end - x)``), ``torch._foreach_lerp_``, and the form
Dynamo traces ``torch._foreach_lerp_`` into on torch 2.13.

Before (a bf16 EMA of weights, d = 0.999)::

    lerp_ = ema.lerp_(p, 0.001)

    # torch 2.13 Dynamo, torch._foreach_lerp_(emas, params, 0.001) (a polyfill):
    _foreach_sub = torch._foreach_sub([p0, p1], [ema0, ema1])
    d = _foreach_sub[0];  full_like = torch.full_like(d, 0.001)
    torch._foreach_addcmul_([ema0, ema1], [full_like, full_like_1], (d, d_1))

After (both)::

    s, e = hi.float(), lo.float()
    u = 0.001 * ((p_value - s) - e)           # the step, from the pair's full value
    s, e = two_sum(s, u) ...                   # then as any addition

Why: ``w * (end - x)`` is typically far below half an ulp of ``x`` (an EMA with d >= 0.996
is stuck for good in bf16).  The difference ``end - x`` is taken against hi + lo, so the
interpolation tracks the value the pair stands for, not its rounded head; ``p_value`` is
hi + lo of ``p`` when ``p`` carries a pair too.  Recognizing the addcmul_ form as a lerp
(rather than adding ``w * (end - hi)``) keeps lo inside the decay, and lets the modes see
the decay factor ``1 - w``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from collage_compile.accumulators import Element, GraphInfo, Step, element_of
from collage_compile.passes._common import bind, is_number


def lerp_(end: Any, weight: Any) -> None:
    """Signature of the in-place op (the step itself is computed in the chain)."""


def addcmul_(tensor1: Any, tensor2: Any, value: Any = 1) -> None:
    """Signature of ``Tensor.addcmul_``."""


def match(info: GraphInfo, ctx: Any) -> int:
    n = 0
    for write in ctx.unclaimed():
        if write.op == "lerp_":
            args = bind(lerp_, write.args, write.kwargs)
            if args is None:
                continue
            ctx.claim(write, [Step("lerp", args)], pattern="lerp_")
            n += 1
        elif write.op == "addcmul_":
            step = _traced_foreach_lerp(info, write)
            if step is not None:
                ctx.claim(write, [step], pattern="lerp_ (as addcmul_)")
                n += 1
    return n


def _traced_foreach_lerp(info: GraphInfo, write: Any) -> Step | None:
    """``x.addcmul_(full_like(_, w), end - x)``: a lerp toward ``end`` with weight ``w``, if
    neither ``x`` nor ``end`` is written between the subtraction and this write."""
    args = bind(addcmul_, write.args, write.kwargs)
    if args is None or not is_number(args[2]):
        return None
    t1, t2, value = args
    for fill, diff in ((t1, t2), (t2, t1)):
        weight = _fill_value(fill)
        if weight is None:
            continue
        end = _end_of_difference(info, diff, write)
        if end is None:
            continue
        return Step("lerp", (end, weight if value == 1 else weight * value))
    return None


def _fill_value(x: Any) -> Any:
    if (
        isinstance(x, fx.Node)
        and x.op == "call_function"
        and x.target is torch.full_like
        and len(x.args) == 2
        and is_number(x.args[1])
        and not {k for k in x.kwargs if k != "dtype"}
    ):
        return float(x.args[1])
    return None


def _end_of_difference(info: GraphInfo, diff: Any, write: Any) -> Any:
    if isinstance(diff, Element):
        producer, index = diff.node, diff.index
    elif (
        isinstance(diff, fx.Node)
        and diff.op == "call_function"
        and diff.target is operator.getitem
        and isinstance(diff.args[0], fx.Node)
    ):
        producer, index = diff.args[0], diff.args[1]
    else:
        producer, index = diff, None
    if not isinstance(producer, fx.Node) or len(producer.args) != 2 or producer.kwargs:
        return None
    if index is None:
        ok = producer.target in (torch.sub, operator.sub) or (
            producer.op == "call_method" and producer.target == "sub"
        )
    else:
        ok = producer.op == "call_function" and producer.target is torch._foreach_sub
    if not ok:
        return None
    end = element_of(producer.args[0], index)
    start = element_of(producer.args[1], index)
    if (write.acc, True) not in info.accumulators_of_node(start):
        return None
    since, at = info.positions[producer], info.positions[write.node]
    if info.written_between(start, since, at) or info.written_between(end, since, at):
        return None
    return end
