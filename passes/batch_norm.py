"""BatchNorm running statistics as accumulators (``mode="all"`` only): a graph normalization.

``F.batch_norm`` in training mode updates its running statistics inside one op, so no
in-place write of them appears in the graph.  Spelled out, they are two EMAs:

Before (a bf16 ``BatchNorm2d``, momentum 0.1)::

    y = torch.nn.functional.batch_norm(x, running_mean, running_var, w, b, True, 0.1, 1e-05)

After::

    y = torch.nn.functional.batch_norm(x, None, None, w, b, True, 0.1, 1e-05)
    xs = x.detach().float()
    running_mean.lerp_(xs.mean([0, 2, 3]), 0.1)               # then the lerp family
    running_var.lerp_(xs.var([0, 2, 3], correction=1), 0.1)   # (unbiased, as BatchNorm)

``y`` is unchanged: in training mode BatchNorm normalizes with the batch's own statistics,
whether or not it also updates running ones.  The statistics enter the EMA unrounded (fp32).

Why: ``rm + 0.1 * (mean - rm)`` rounds back to ``rm`` in bf16 whenever the batch mean is
within ~2 % of it, so bf16 running statistics freeze near their first values.

A ``momentum=None`` BatchNorm (cumulative average, factor ``1/num_batches_tracked``) or
statistics that are not bf16/fp16 are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from collage_compile import _compat
from collage_compile.mcf import LOW_PRECISION
from collage_compile.passes._common import bind, is_number


def _batch_norm(
    input: Any,
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: Any = False,
    momentum: Any = 0.1,
    eps: Any = 1e-5,
) -> None:
    """Signature of ``torch.nn.functional.batch_norm``."""


def run(gm: fx.GraphModule) -> int:
    """Spell out the running-statistics updates of every training-mode batch_norm whose
    statistics are low precision; returns how many it rewrote."""
    graph = gm.graph
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.batch_norm:
            continue
        args = bind(_batch_norm, node.args, node.kwargs)
        if args is None:
            continue
        x, rm, rv, w, b, training, momentum, eps = args
        if training is not True or not is_number(momentum) or not _low(rm) or not _low(rv):
            continue
        x_val = _compat.example_value(x)
        if not isinstance(x_val, torch.Tensor) or x_val.dim() < 2:
            continue
        dims = [0, *range(2, x_val.dim())]
        with graph.inserting_before(node):
            y = graph.call_function(F.batch_norm, (x, None, None, w, b, True, momentum, eps))
            y.meta = dict(node.meta)
            xs = graph.call_method("float", (graph.call_method("detach", (x,)),))
            mean = graph.call_method("mean", (xs, dims))
            var = graph.call_method("var", (xs, dims), {"correction": 1})
            graph.call_method("lerp_", (rm, mean, momentum))
            graph.call_method("lerp_", (rv, var, momentum))
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        n += 1
    if n:
        graph.lint()
        gm.recompile()
    return n


def _low(x: Any) -> bool:
    val = _compat.example_value(x) if isinstance(x, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in LOW_PRECISION
