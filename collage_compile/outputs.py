"""New state that Inductor returns as a tensor it already had: separated again.

An optimizer that creates its state in its first step (``buf = torch.zeros_like(p)``, then
``buf.mul_(beta).add_(grad)``) hands Dynamo a graph whose outputs are new tensors.
Inductor folds ``0 * beta + grad`` to ``grad`` and returns the gradient itself as the
buffer (``joint_graph.remove_no_ops`` does not check for new aliasing between inputs and
outputs, pytorch/pytorch#197893), and two buffers that fold to the same value come back as
one tensor.  Measured on torch 2.11 and 2.13 (CPU), plain Inductor alike: pytorch_optimizer's
AggMo ends with its three momenta in one buffer, updated three times a step; a momentum
whose buffer is the gradient is zeroed by ``zero_grad(set_to_none=False)`` and overwritten
by the next backward (or by the gradient copy of a whole-step replay).  Eager and
``aot_eager`` return separate tensors.

The backend compares, after a call of a graph that writes tensors in place (an optimizer
step), each new output with the inputs and earlier outputs it could be (same dtype and
number of elements, found when the graph compiles), and copies an output that came back
on one of their storages: the values are right, only the storage is shared.  Graphs whose
outputs are all views of inputs (every step after the first) pay nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat

__all__ = ["Plan", "plan", "separated"]

log = logging.getLogger("collage_compile")

# (output index, input indices it could alias, earlier output indices it could alias)
Plan = list[tuple[int, list[int], list[int]]]


def plan(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Plan:
    """The new tensors among ``gm``'s outputs, each with the inputs and earlier new outputs
    Inductor could return in its place; empty where there are none."""
    outputs = _output_nodes(gm)
    storages = {_storage(x) for x in example_inputs if isinstance(x, torch.Tensor)}
    found: Plan = []
    fresh: list[tuple[int, fx.Node, Any]] = []
    for i, node in enumerate(outputs):
        value = _compat.example_value(node) if isinstance(node, fx.Node) else None
        if not isinstance(value, torch.Tensor) or node.op == "placeholder":
            continue
        if _empty(value) or _storage(value) in storages:
            continue  # nothing to share, or a view of an input (it is one in eager too)
        ins = [j for j, x in enumerate(example_inputs) if _like(x, value)]
        outs = [k for k, other, v in fresh if other is not node and _like(v, value)]
        if ins or outs:
            found.append((i, ins, outs))
        fresh.append((i, node, value))
    return found


def separated(out: Any, args: Sequence[Any], found: Plan) -> Any:
    """``out`` with every new output that shares a storage with an input or an earlier
    output (:func:`plan`) replaced by a copy of itself."""
    copied = None
    for i, ins, outs in found:
        t = out[i]
        if not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if any(_ptr(args[j]) == ptr for j in ins) or any(_ptr(out[k]) == ptr for k in outs):
            if copied is None:
                copied = out = list(out)
                log.debug("collage: output %d of a step came back on another tensor's memory", i)
            out[i] = t.clone()
    return out


def _output_nodes(gm: fx.GraphModule) -> list[Any]:
    node = next(iter(gm.graph.find_nodes(op="output")), None)
    if node is None or not node.args:
        return []
    result = node.args[0]
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _like(x: Any, value: torch.Tensor) -> bool:
    """Same dtype and number of elements (a symbolic number counts as the same)."""
    if not isinstance(x, torch.Tensor) or x.dtype != value.dtype:
        return False
    a, b = x.numel(), value.numel()
    return a == b if isinstance(a, int) and isinstance(b, int) else True


def _empty(t: torch.Tensor) -> bool:
    n = t.numel()
    return isinstance(n, int) and n == 0


def _storage(t: torch.Tensor) -> Any:
    return _compat.storage_key(t)


def _ptr(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
