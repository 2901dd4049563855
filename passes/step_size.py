"""Adam's compiled denominator, folded so that ``lr = 0`` updates by 0 instead of NaN.

Before (``_single_tensor_adam`` as torch.optim traces it under torch.compile; AdamW alike,
``max_exp_avg_sq`` with amsgrad)::

    step_size_neg = -(lr / bias_correction1)                 # 0-dim; -0.0 when lr == 0
    denom = (exp_avg_sq.sqrt() / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
    param.addcdiv_(exp_avg, denom)

After::

    denom = ((exp_avg_sq.sqrt() / bias_correction2_sqrt) + eps) / step_size_neg

Why: with ``lr == 0`` (the first step of Hugging Face's warmup schedules, the end of a
cosine decay to 0) every element whose second moment is 0 (an embedding row no token hit)
computes ``0 / -0.0 = NaN`` in the first term, and the parameter becomes NaN for good
(PyTorch issue 126514; eager computes ``-step_size * exp_avg / denom = 0``).  Factoring the
step size out leaves ``(sqrt(v)/b + eps) > 0`` divided by it: ``-inf`` for ``lr == 0``, and
``exp_avg / -inf = -0``, the update eager makes.  For ``lr != 0`` it is the same quotient,
rounded in a different order (fp32 registers inside the fused kernel).  Only low-precision
denominators are touched: an fp32 graph stays exactly what Inductor compiles.

Exact form (``mode="exact"``, run on the promoted fp32 graph): the refolded quotient is
taken only where the step size is 0, the original everywhere else, so every step with
``lr != 0`` rounds as the fp32 step does, bit for bit::

    denom = where(step_size_neg == 0, ((x / b) + eps) / step_size_neg,
                  (x / (b * step_size_neg)) + (eps / step_size_neg))
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.mcf import LOW_PRECISION
from collage_compile.passes._common import is_number, op_name


def run(gm: fx.GraphModule, exact: bool = False) -> int:
    """Refold every matching denominator (``exact``: the fp32 ones, where the step size
    is 0 only); returns how many."""
    graph = gm.graph
    n = 0
    for node in list(graph.nodes):
        match = _match(node, torch.float32 if exact else None)
        if match is None:
            continue
        x, b, s, eps, first, second = match
        with graph.inserting_before(node):
            scaled = graph.call_function(operator.truediv, (x, b))
            shifted = graph.call_function(operator.add, (scaled, eps))
            new = graph.call_function(operator.truediv, (shifted, s))
        new.meta = dict(node.meta)
        if exact:
            with graph.inserting_before(node.next):
                at_zero = graph.call_function(operator.eq, (s, 0))
                chosen = graph.call_function(torch.where, (at_zero, new, node))
            chosen.meta = dict(node.meta)
            node.replace_all_uses_with(chosen, delete_user_cb=lambda u, c=chosen: u is not c)
            n += 1
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for dead in (first, second, first.args[1]):
            if isinstance(dead, fx.Node) and not dead.users:
                graph.erase_node(dead)
        n += 1
    return n


def _match(node: fx.Node, dtype: torch.dtype | None = None) -> tuple[Any, ...] | None:
    """``(x / (b * s)) + (eps / s)`` -> (x, b, s, eps, the two quotients), for ``x`` of
    ``dtype`` (None: low precision)."""
    if node.op not in ("call_function", "call_method") or op_name(node) != "add":
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    first, second = node.args
    if not (_is_div(first) and _is_div(second)) or len(first.users) != 1:
        return None
    x, prod = first.args
    eps, s = second.args
    if not is_number(eps) or not isinstance(prod, fx.Node) or not _is_mul(prod):
        return None
    if s not in prod.args or not _is_scalar_tensor(s) or not _has_dtype(x, dtype):
        return None
    b = prod.args[1] if prod.args[0] is s else prod.args[0]
    if not _is_scalar_tensor(b) and not is_number(b):
        return None
    return x, b, s, eps, first, second


def _is_div(node: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and op_name(node) in ("truediv", "div")
        and len(node.args) == 2
        and not node.kwargs
    )


def _is_mul(node: fx.Node) -> bool:
    return (
        node.op in ("call_function", "call_method")
        and op_name(node) == "mul"
        and (len(node.args) == 2 and not node.kwargs)
    )


def _has_dtype(x: Any, dtype: torch.dtype | None) -> bool:
    ex = _compat.example_value(x) if isinstance(x, fx.Node) else None
    if not isinstance(ex, torch.Tensor):
        return False
    return ex.dtype in LOW_PRECISION if dtype is None else ex.dtype == dtype


def _is_scalar_tensor(x: Any) -> bool:
    ex = _compat.example_value(x) if isinstance(x, fx.Node) else None
    return isinstance(ex, torch.Tensor) and ex.dim() == 0
