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
from collage_compile.passes._common import bind, is_number, is_scalar_like, op_name
from collage_compile.passes.additive import add_, addcmul_


def lerp_(end: Any, weight: Any) -> None:
    """Signature of the in-place op (the step itself is computed in the chain)."""


def match(info: GraphInfo, ctx: Any) -> int:
    n = 0
    for write in ctx.unclaimed():
        if write.op == "lerp_":
            args = bind(lerp_, write.args, write.kwargs)
            if args is None:
                continue
            ctx.claim(write, [Step("lerp", args)], pattern="lerp_")
            n += 1
        elif write.op in _TRACED_FORMS:
            form, recognize = _TRACED_FORMS[write.op]
            step = recognize(info, write)
            if step is not None:
                ctx.claim(write, [step], pattern=f"lerp_ (as {form})")
                n += 1
            elif write.op == "addcmul_" and (high := _traced_high_weight_lerp(info, write)):
                if high[0] not in ctx.sites:
                    ctx.claim(high[0], [], pattern="lerp_ (its copy_ of end)")
                    ctx.claim(write, [high[1]], pattern="lerp_ (as copy_, addcmul_)")
                    n += 2
    return n


def _traced_high_weight_lerp(info: GraphInfo, write: Any) -> tuple[Any, Step] | None:
    """torch 2.13 Dynamo's ``torch._foreach_lerp_`` with a float weight ``w >= 0.5``::

        diff = torch._foreach_sub(end, x)
        neg_omw = -(1.0 - torch.tensor(w, dtype=x.dtype))
        x_i.copy_(end_i)
        torch._foreach_addcmul_(x, [neg_omw, ...], diff)

    is ``x_i.lerp_(end_i, w)``: (the copy_ write, the lerp step for this addcmul_)."""
    args = bind(addcmul_, write.args, write.kwargs)
    if args is None or args[2] != 1:
        return None
    found = [
        (w, d)
        for f, d in ((args[0], args[1]), (args[1], args[0]))
        if (w := _one_minus_negated(f)) is not None
    ]
    if not found:
        return None
    weight, diff = found[0]
    difference = _difference(info, diff, write)
    if difference is None:
        return None
    end, producer = difference
    since, at = info.positions[producer], info.positions[write.node]
    between = [w for w in info.writes if w.acc is write.acc and since < info.positions[w.node] < at]
    if len(between) != 1 or between[0].op != "copy_" or not between[0].full_alias:
        return None
    copy = between[0]
    if copy.args != (end,) or copy.kwargs:
        return None
    if info.written_between(end, since, at):
        return None
    return copy, Step("lerp", (end, weight))


def _one_minus_negated(x: Any) -> float | None:
    """``w`` from ``-(1.0 - torch.tensor(w, ...))``, else None."""
    if not (isinstance(x, fx.Node) and x.target in (operator.neg, torch.neg) and x.args):
        return None
    sub = x.args[0]
    if not (
        isinstance(sub, fx.Node)
        and sub.target in (operator.sub, torch.sub)
        and len(sub.args) == 2
        and sub.args[0] == 1.0
        and isinstance(sub.args[1], fx.Node)
        and sub.args[1].target is torch.tensor
        and is_number(sub.args[1].args[0])
    ):
        return None
    return float(sub.args[1].args[0])


def _traced_tensor_weight_lerp(info: GraphInfo, write: Any) -> Step | None:
    """torch 2.13 Dynamo's ``torch._foreach_lerp_`` with a tensor weight ``t``::

        diff = torch._foreach_sub(end, x)
        w = torch.where(|t| >= 0.5, -(1 - t), t)
        b = torch.where(|t| >= 0.5, end_i, x_i)
        torch._foreach_addcmul_([b, ...], [w, ...], (diff[i], ...))
        x_i.copy_(b)

    is ``x_i.lerp_(end_i, t)``: this ``copy_`` claimed as that lerp (the temporaries are
    left to dead-code elimination)."""
    if write.args[1:] or write.kwargs or not isinstance(write.args[0], fx.Node):
        return None
    b = write.args[0]
    if not (b.op == "call_function" and b.target is torch.where and len(b.args) == 3):
        return None
    mask, end, start = b.args
    if (write.acc, True) not in info.accumulators_of_node(start):
        return None
    writers = [u for u in b.users if u is not write.node and u.op == "call_function"]
    if len(writers) != 1 or writers[0].target is not torch._foreach_addcmul_:
        return None
    fused = writers[0]
    if fused.kwargs or len(fused.args) != 3 or not isinstance(fused.args[0], (list, tuple)):
        return None
    bases, weights, diffs = fused.args
    if b not in bases or not isinstance(weights, (list, tuple)):
        return None
    i = list(bases).index(b)
    w_node, diff = weights[i], element_of(diffs, i)
    if not (
        isinstance(w_node, fx.Node)
        and w_node.target is torch.where
        and len(w_node.args) == 3
        and w_node.args[0] is mask
    ):
        return None
    weight = w_node.args[2]
    if _end_of_difference(info, diff, write) is not end:
        return None
    if info.written_between(weight, info.positions[w_node], info.positions[write.node]):
        return None
    return Step("lerp", (end, weight))


def _scaled_difference(info: GraphInfo, write: Any) -> Step | None:
    """``x.add_((end - x) * w)`` (ASGD's ``ax.add_(p.sub(ax).mul_(mu))``, a hand-written
    EMA) or ``x.add_(end - x, alpha=w)`` (Lookahead's slow weights): a lerp toward ``end``
    with weight ``w`` (a number or a 0-dim tensor), if neither ``x`` nor ``end`` is written
    between the subtraction and this write."""
    args = bind(add_, write.args, write.kwargs)
    if args is None:
        return None
    if not (is_number(args[1]) and args[1] == 1):
        return _difference_by_alpha(info, write, *args)
    product, index = _producer(args[0])
    if not isinstance(product, fx.Node) or product.kwargs or len(product.args) != 2:
        return None
    if op_name(product) != "mul":
        return None
    a, b = (element_of(x, index) for x in product.args)
    for diff, weight in ((a, b), (b, a)):
        if not is_scalar_like(weight):
            continue
        end = _end_of_difference(info, diff, write)
        if end is not None and not (
            isinstance(weight, fx.Node)
            and info.written_between(weight, info.positions[product], info.positions[write.node])
        ):
            return Step("lerp", (end, weight))
    return None


def _difference_by_alpha(info: GraphInfo, write: Any, diff: Any, alpha: Any) -> Step | None:
    """``x.add_(end - x, alpha=w)``: read from hi alone, ``end - x`` rounds to the storage
    dtype and loses both tensors' lo (Lookahead's slow weights then stall short of the
    fast ones); as a lerp the difference is taken against both pairs' whole values."""
    if not is_scalar_like(alpha):
        return None
    end = _end_of_difference(info, diff, write)
    if end is None:
        return None
    if isinstance(alpha, fx.Node) and info.written_between(
        alpha, info.positions[alpha], info.positions[write.node]
    ):
        return None
    return Step("lerp", (end, alpha))


def _traced_foreach_lerp(info: GraphInfo, write: Any) -> Step | None:
    """``x.addcmul_(full_like(_, w), end - x)``: a lerp toward ``end`` with weight ``w``, if
    neither ``x`` nor ``end`` is written between the subtraction and this write."""
    args = bind(addcmul_, write.args, write.kwargs)
    if args is None or not is_number(args[2]):
        return None
    t1, t2, value = args
    for fill, diff in ((t1, t2), (t2, t1)):
        weight = _fill_value(fill)
        if weight is None and is_scalar_like(fill):  # a 0-dim tensor weight (ASGD's mu)
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


def _difference(info: GraphInfo, diff: Any, write: Any) -> tuple[Any, fx.Node] | None:
    """(end, the subtraction node) when ``diff`` is ``end - x``, x the written tensor."""
    producer, index = _producer(diff)
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
    start = element_of(producer.args[1], index)
    if (write.acc, True) not in info.accumulators_of_node(start):
        return None
    return element_of(producer.args[0], index), producer


def _producer(x: Any) -> tuple[Any, int | None]:
    """(the node, the index) of a value that is one element of a foreach op's result, as an
    Element or as Dynamo's ``getitem`` of it; (x, None) for anything else."""
    if isinstance(x, Element):
        return x.node, x.index
    if (
        isinstance(x, fx.Node)
        and x.op == "call_function"
        and x.target is operator.getitem
        and isinstance(x.args[0], fx.Node)
        and isinstance(x.args[1], int)
        and isinstance(_compat.example_value(x.args[0]), (list, tuple))
    ):
        return x.args[0], x.args[1]
    return x, None  # an index into a tensor is not an element of a foreach result


def _end_of_difference(info: GraphInfo, diff: Any, write: Any) -> Any:
    """``end`` when ``diff`` is ``end - x`` (x: the written tensor) and neither is written
    between the subtraction and the write."""
    found = _difference(info, diff, write)
    if found is None:
        return None
    end, producer = found
    since, at = info.positions[producer], info.positions[write.node]
    if info.written_between(write.target, since, at) or info.written_between(end, since, at):
        return None
    return end


# write op -> (the form's name in reports, recognizer returning a lerp Step or None)
_TRACED_FORMS: dict[str, tuple[str, Any]] = {
    "addcmul_": ("addcmul_", _traced_foreach_lerp),
    "copy_": ("where, addcmul_, copy_", _traced_tensor_weight_lerp),
    "add_": ("add_((end - x) * w)", _scaled_difference),
}
