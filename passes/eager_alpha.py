"""``arithmetic="storage"`` only: make ``a + alpha * b`` on bf16/fp16 round like eager.

Before (SGD with weight decay, bf16)::

    grad = g.add(p, alpha=0.01)                       # or torch._foreach_add(gs, ps, alpha=0.01)

After::

    grad = (g.float() + p.float() * 0.010009765625).to(torch.bfloat16)

Why: eager computes ``a + alpha * b`` in fp32 and rounds once; on CPU it first casts alpha to
the tensor's dtype (0.01 -> bf16 0.010009765625; measured: the fp32 alpha differs from eager
in 24 % of elements, the bf16 alpha in none), on CUDA alpha stays fp32.  Inductor lowers the alpha
as a separate ``mul`` node of the input dtype, and under ``emulate_precision_casts`` (which
storage arithmetic uses so the optimizer's own bf16 ops round like eager) that intermediate
product is rounded to bf16 as well, so ``grad`` differs from eager in the last bit and the
storage Grow is no longer bit-identical to an eager run.  Spelling the op out in fp32 with one
explicit cast gives eager's single rounding.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.accumulators import storage_key
from collage_compile.mcf import LOW_PRECISION

_ADD_SUB = {"add": 1.0, "sub": -1.0}
_FUNCTIONS = {torch.add: 1.0, torch.sub: -1.0}
_FOREACH = {torch._foreach_add: 1.0, torch._foreach_sub: -1.0}
_FOREACH_INPLACE = {torch._foreach_add_: 1.0, torch._foreach_sub_: -1.0}


def _alpha(node: fx.Node) -> Any:
    return node.kwargs.get("alpha", 1)


def _lowp(node: Any) -> torch.dtype | None:
    ex = _compat.example_value(node) if isinstance(node, fx.Node) else None
    if isinstance(ex, torch.Tensor) and ex.dtype in LOW_PRECISION:
        return ex.dtype
    return None


def _eager_alpha(alpha: float, dtype: torch.dtype, device: torch.device) -> float:
    if device.type == "cpu":
        return torch.tensor(float(alpha), dtype=torch.float64).to(dtype).item()
    return torch.tensor(float(alpha), dtype=torch.float32).item()


def _spelled_out(
    a: Any, b: Any, alpha: float, sign: float, dtype: torch.dtype, device: torch.device
) -> Any:
    af, bf = _operand(a, dtype), _operand(b, dtype)
    return (af + bf * (sign * _eager_alpha(alpha, dtype, device))).to(dtype)


def _operand(x: Any, dtype: torch.dtype) -> Any:
    """An operand as eager sees it: a tensor of another dtype (a 0-dim fp32 tensor added to
    bf16) is first cast to the result dtype, then computed on in fp32."""
    if not isinstance(x, fx.Proxy):
        return float(x)
    ex = _compat.example_value(x.node)
    if isinstance(ex, torch.Tensor) and ex.dtype != dtype:
        x = x.to(dtype)
    return x.float()


def _device(node: Any) -> torch.device:
    ex = _compat.example_value(node) if isinstance(node, fx.Node) else None
    return ex.device if isinstance(ex, torch.Tensor) else torch.device("cpu")


def run(gm: fx.GraphModule) -> int:
    """Rewrite every low-precision add/sub with a non-unit alpha; returns how many."""
    graph = gm.graph
    tracer = fx.proxy.GraphAppendingTracer(graph)

    def proxy(x: Any) -> Any:
        return fx.Proxy(x, tracer) if isinstance(x, fx.Node) else x

    persistent = _persistent_storages(graph)
    n = 0
    for node in list(graph.nodes):
        if node.op == "call_method" and node.target in _ADD_SUB:
            n += _rewrite_binary(graph, node, _ADD_SUB[node.target], proxy)
        elif node.op != "call_function":
            continue
        elif node.target in _FUNCTIONS:
            n += _rewrite_binary(graph, node, _FUNCTIONS[node.target], proxy)
        elif node.target in _FOREACH:
            n += _rewrite_foreach(graph, node, proxy)
        elif node.target in _FOREACH_INPLACE:
            n += _rewrite_foreach_inplace(graph, node, proxy, persistent)
    return n


def _rewrite_binary(graph: fx.Graph, node: fx.Node, sign: float, proxy: Any) -> int:
    """``a.add(b, alpha=c)`` / ``torch.sub(a, b, alpha=c)`` on a low-precision tensor."""
    alpha = _alpha(node)
    dtype = _lowp(node)
    if dtype is None or alpha == 1 or len(node.args) != 2 or set(node.kwargs) - {"alpha"}:
        return 0
    if not isinstance(alpha, (int, float)):
        return 0
    with graph.inserting_before(node):
        new = _spelled_out(
            proxy(node.args[0]), proxy(node.args[1]), alpha, sign, dtype, _device(node)
        ).node
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return 1


def _rewrite_foreach(graph: fx.Graph, node: fx.Node, proxy: Any) -> int:
    """``torch._foreach_add(xs, ys, alpha=c)``, every item read through ``getitem``."""
    alpha = _alpha(node)
    if alpha == 1 or not isinstance(alpha, (int, float)) or len(node.args) != 2:
        return 0
    xs, ys = node.args
    if not isinstance(xs, (list, tuple)) or not isinstance(ys, (list, tuple)):
        return 0
    if any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return 0
    dtypes = [_lowp(x) for x in xs]
    if any(d is None for d in dtypes):
        return 0
    sign = _FOREACH[node.target]
    with graph.inserting_before(node):
        items = [
            _spelled_out(proxy(x), proxy(y), alpha, sign, d, _device(x)).node
            for x, y, d in zip(xs, ys, dtypes)
        ]
    for user in list(node.users):
        item = items[user.args[1]]
        item.meta = dict(user.meta)
        user.replace_all_uses_with(item)
        graph.erase_node(user)
    graph.erase_node(node)
    return len(items)


def _rewrite_foreach_inplace(
    graph: fx.Graph, node: fx.Node, proxy: Any, persistent: set[Any]
) -> int:
    """``torch._foreach_add_(xs, ys, alpha=c)`` in place on temporaries only (nesterov's
    grads += momentum * buf); a write to a persistent tensor is an accumulation and
    belongs to the pattern families."""
    alpha = _alpha(node)
    if alpha == 1 or not isinstance(alpha, (int, float)) or len(node.args) != 2 or node.users:
        return 0
    xs, ys = node.args
    if not isinstance(xs, (list, tuple)) or not isinstance(ys, (list, tuple)):
        return 0
    dtypes = [_lowp(x) for x in xs]
    if any(d is None for d in dtypes) or any(_storage(x) in persistent for x in xs):
        return 0
    sign = _FOREACH_INPLACE[node.target]
    with graph.inserting_before(node):
        for x, y, d in zip(xs, ys, dtypes):
            px = proxy(x)
            px.copy_(_spelled_out(px, proxy(y), alpha, sign, d, _device(x)))
    graph.erase_node(node)
    return len(xs)


def _storage(node: Any) -> Any:
    return storage_key(_compat.example_value(node)) if isinstance(node, fx.Node) else None


def _persistent_storages(graph: fx.Graph) -> set[Any]:
    out = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            key = _storage(node)
            if key is not None:
                out.add(key)
    return out
