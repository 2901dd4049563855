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
step), each new output with the inputs and earlier new outputs it could be (same dtype and
number of elements, found when the graph compiles), and copies an output that came back
on one of their storages: the values are right, only the storage is shared.  Graphs with
no new outputs (every step after the first) pay nothing; outputs that are views of inputs
or of each other (as in eager) are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.accumulators import storage_key as _storage

__all__ = ["Plan", "plan", "separated"]

log = logging.getLogger("collage_compile")

# (every input index some output could alias, then per new output: its index, the input
# indices and the earlier output indices it could alias, the later outputs that are views
# of it)
Entry = tuple[int, frozenset[int], frozenset[int], tuple[int, ...]]
Plan = tuple[list[int], list[Entry]]


def plan(gm: fx.GraphModule) -> Plan:
    """The new tensors among ``gm``'s outputs, each with the inputs and earlier new outputs
    Inductor could return in its place; empty where there are none.  Read off the graph's
    own fake values (the example inputs a backend gets may be the real tensors): an output
    on an input's storage, or on an earlier output's, is a view in eager too, left alone."""
    inputs = [_compat.example_value(n) for n in gm.graph.find_nodes(op="placeholder")]
    storages = {_storage(x) for x in inputs if isinstance(x, torch.Tensor)}
    found: list[Entry] = []
    fresh: list[tuple[int, Any]] = []
    views: dict[Any, list[int]] = {}  # a new output's storage -> the outputs on it
    values = [
        _compat.example_value(n) if isinstance(n, fx.Node) else None for n in _output_nodes(gm)
    ]
    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor) or _empty(value):
            continue
        key = _storage(value)
        if key in views:
            views[key].append(i)  # a view of an earlier new output (one in eager too)
            continue
        if key in storages:
            continue  # a view of an input (one in eager too)
        views[key] = []
        ins = frozenset(j for j, x in enumerate(inputs) if _like(x, value))
        outs = frozenset(k for k, v in fresh if _like(v, value))
        if ins or outs:
            found.append((i, ins, outs, ()))
        fresh.append((i, value))
    if not found:
        return ([], [])
    found = [(i, ins, outs, tuple(views[_storage(values[i])])) for i, ins, outs, _ in found]
    return (sorted(set().union(*(ins for _, ins, _, _ in found))), found)


def separated(out: Any, args: Sequence[Any], found: Plan) -> Any:
    """``out`` with every new output that shares a storage with an input or an earlier
    new output it could be (:func:`plan`) replaced by a copy of itself.  Linear in the
    planned outputs and their inputs: one pointer per tensor, looked up in dicts."""
    inputs, entries = found
    taken: dict[int, list[int]] = {}  # storage pointer -> the inputs (~j) and outputs on it
    for j in inputs:
        if (ptr := _ptr(args[j])) is not None:
            taken.setdefault(ptr, []).append(~j)
    copied = None
    for i, ins, outs, viewed in entries:
        t = out[i]
        if not isinstance(t, torch.Tensor):
            continue
        ptr = t.untyped_storage().data_ptr()
        if any(~o in ins if o < 0 else o in outs for o in taken.get(ptr, ())):
            if copied is None:
                copied = out = list(out)
                log.debug("collage: output %d of a step came back on another tensor's memory", i)
            storage = t.untyped_storage().clone()  # the outputs that are views of it follow
            for k in (i, *viewed):
                out[k] = _on(storage, out[k])
            ptr = storage.data_ptr()
        taken.setdefault(ptr, []).append(i)
    return out


def _on(storage: Any, t: torch.Tensor) -> torch.Tensor:
    """``t``'s view (offset, sizes, strides) of ``storage``."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.size(), t.stride()
    )


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


def _ptr(t: Any) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
