"""Additive accumulations: ``add_``, ``sub_``, ``addcdiv_``, ``addcmul_``.

Covers the method forms, ``x += u`` / ``x -= u`` and the ``torch._foreach_*_`` list forms
(which the analysis already splits per list element).

Before (bf16 ``p``, lr = 1e-4; the update is below half an ulp of most weights)::

    add_ = p.add_(grad, alpha=-0.0001)

After (``arithmetic="fp32"``; ``lo`` is a new graph input)::

    s, e = two_sum(p.float(), grad.float() * -0.0001)   # exact: no bit of the update lost
    e = e + lo.float()
    p.copy_(round_to(s + e));  lo.copy_(round_to((s - hi) + e))

Why: ``p + u`` rounded to bf16 returns ``p`` whenever ``|u| < ulp(p)/2``; SGD at lr=1e-4 on a
bf16 Linear leaves 41 % of the weights unmoved in one step.  The pair keeps the part of the
update that hi cannot hold in lo, and the next update is added to hi + lo.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from collage_compile.accumulators import GraphInfo, Step
from collage_compile.passes._common import bind, f32, is_number, op_name, scale


def add_(other: Any, alpha: Any = 1) -> Any:
    return scale(f32(other), alpha)


def sub_(other: Any, alpha: Any = 1) -> Any:
    return scale(f32(other), -alpha)


def addcdiv_(tensor1: Any, tensor2: Any, value: Any = 1) -> Any:
    return scale(f32(tensor1) / f32(tensor2), value)


def addcmul_(tensor1: Any, tensor2: Any, value: Any = 1) -> Any:
    return scale(f32(tensor1) * f32(tensor2), value)


UPDATES = {"add_": add_, "sub_": sub_, "addcdiv_": addcdiv_, "addcmul_": addcmul_}


def match(info: GraphInfo, ctx: Any) -> int:
    """Claim every additive write; returns how many sites it claimed."""
    n = 0
    for write in ctx.unclaimed():
        update = UPDATES.get(write.op)
        if update is None:
            continue
        args = bind(update, write.args, write.kwargs)
        if args is None:
            continue
        if write.op in ("add_", "sub_"):
            args = _scaled_tensor(info, write, *args)
        ctx.claim(write, [Step("add", args, update)], pattern=write.op)
        n += 1
    return n


def _scaled_tensor(info: GraphInfo, write: Any, other: Any, alpha: Any) -> tuple[Any, Any]:
    """``x.add_(y * c)`` as ``x.add_(y, alpha=c)`` where ``y`` is another persistent tensor,
    not a gradient (a weight, Lookahead's slow weights), and ``c`` a number: the product is
    then taken on ``y``'s whole value, where a pair's head alone, multiplied in bf16, lost
    its lo.  torch 2.11's Dynamo traces ``x.add_(y, alpha=c)`` itself into that form."""
    if not (isinstance(other, fx.Node) and is_number(alpha) and op_name(other) == "mul"):
        return other, alpha
    if other.kwargs or len(other.args) != 2:
        return other, alpha
    since, at = info.positions[other], info.positions[write.node]
    if info.written_between(other, since, at):
        return other, alpha  # the product changed in place before it is added
    for y, c in (other.args, other.args[::-1]):
        if (
            isinstance(y, fx.Node)
            and is_number(c)
            and any(
                full and acc is not write.acc and not acc.is_gradient
                for acc, full in info.accumulators_of_node(y)
            )
            and not info.written_between(y, since, at)
        ):
            return y, c * alpha
    return other, alpha
