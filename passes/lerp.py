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

from collage_compile import _compat
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
        elif write.op == "add_":
            step = _scaled_difference(info, write)
            if step is not None:
                ctx.claim(write, [step], pattern="lerp_ (as add_((end - x) * w))")
                n += 1
    return n


def add_(other: Any, alpha: Any = 1) -> None:
    """Signature of ``Tensor.add_``."""


def _scaled_difference(info: GraphInfo, write: Any) -> Step | None:
    """``x.add_((end - x) * w)`` (ASGD's ``ax.add_(p.sub(ax).mul_(mu))``, a hand-written
    EMA): a lerp toward ``end`` with weight ``w`` (a number or a 0-dim tensor), if neither
    ``x`` nor ``end`` is written between the subtraction and this write."""
    args = bind(add_, write.args, write.kwargs)
    if args is None or not is_number(args[1]) or args[1] != 1:
        return None
    product = args[0]
    index = None
    if isinstance(product, Element):
        product, index = product.node, product.index
    if not isinstance(product, fx.Node) or product.kwargs or len(product.args) != 2:
        return None
    name = _op_name(product)
    if name not in ("mul", "mul_"):
        return None
    a, b = (element_of(x, index) for x in product.args)
    for diff, weight in ((a, b), (b, a)):
        if not _scalar_like(weight):
            continue
        end = _end_of_difference(info, diff, write)
        if end is not None and not (
            isinstance(weight, fx.Node)
            and info.written_between(weight, info.positions[product], info.positions[write.node])
        ):
            return Step("lerp", (end, weight))
    return None


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.target in (operator.mul, torch.mul):
        return "mul"
    if node.target is torch._foreach_mul_:
        return "mul_"
    return ""


def _scalar_like(x: Any) -> bool:
    if is_number(x):
        return True
    if isinstance(x, Element):
        val = _compat.example_value(x.node)
        val = val[x.index] if isinstance(val, (list, tuple)) else None
    else:
        val = _compat.example_value(x) if isinstance(x, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _traced_foreach_lerp(info: GraphInfo, write: Any) -> Step | None:
    """``x.addcmul_(full_like(_, w), end - x)``: a lerp toward ``end`` with weight ``w``, if
    neither ``x`` nor ``end`` is written between the subtraction and this write."""
    args = bind(addcmul_, write.args, write.kwargs)
    if args is None or not is_number(args[2]):
        return None
    t1, t2, value = args
    for fill, diff in ((t1, t2), (t2, t1)):
        weight = _fill_value(fill)
        if weight is None and _scalar_like(fill):  # a 0-dim tensor weight (ASGD's mu)
            weight = fill
        if weight is None:
            continue
        end = _end_of_difference(info, diff, write)
        if end is None:
            continue
        if value != 1:
            if not is_number(weight):
                continue
            weight = weight * value
        return Step("lerp", (end, weight))
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
    if not all(isinstance(a, (fx.Node, list, tuple)) for a in producer.args):
        return None  # a number minus x is not a difference toward a tensor
    end = element_of(producer.args[0], index)
    start = element_of(producer.args[1], index)
    if (write.acc, True) not in info.accumulators_of_node(start):
        return None
    since, at = info.positions[producer], info.positions[write.node]
    if info.written_between(start, since, at) or info.written_between(end, since, at):
        return None
    return end
