"""One graph node per MCF chain, so compile time does not grow with the chain's arithmetic.

An emitted chain is some twenty pointwise nodes per tensor (the pair's load, each step,
the rounding into (hi, lo)).  Every later stage pays per FX node: AOTAutograd's tracing,
fake-tensor propagation, Inductor's post-grad passes and its per-node lowering, and, as a
chain's intermediates read the tensors its ``copy_`` later overwrites, Inductor realizes
each of them before the mutation (``GraphLowering.mark_buffer_mutated``), only to find
them dead in the scheduler (README "Speed" has the compile times before and after).

:func:`outline` replaces a chain's nodes by one call of ``collage::chain(key, inputs)``
returning the new (hi, lo).  ``key`` names the chain's arithmetic, traced once to aten ops
(with Inductor's decompositions) and kept in :data:`_GRAPHS`; Inductor lowers the call by
running that aten graph through its own lowerings (:func:`_compat.register_inline_lowering`),
so the kernel computes exactly what the inline nodes computed and fuses as before; the
lowering computes each of the chain's values once per loop body (the split and the
remainder read them several times) and writes an output that only overwrites its tensor
straight into it, where Inductor would compute it into a buffer and copy that.  The key
is a hash of the arithmetic and the inputs' metadata, so a cached kernel (Inductor's FX
graph cache keys on the graph, key included) always matches its arithmetic.  Eagerly (any
other backend), the op runs the same aten graph.

A chain stays inline when outlining could change what it computes or cannot be proven
safe: a symbolic shape, a non-tensor input, a value used outside the chain, an in-place
op, an op Inductor would not lower itself (a fallback kernel), grad mode on with an
input requiring grad (the op has no autograd formula), or a DTensor input (FSDP2: DTensor
runs the inline ops shard by shard).  Metrics chains stay inline too.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat

__all__ = ["Outlined", "call_again", "chain_graph", "outline"]

# key -> the chain's arithmetic as aten ops, and its outputs' (shape, stride, dtype)
_GRAPHS: dict[str, fx.GraphModule] = {}
_OUT_META: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]] = {}
# a chain's arithmetic and its inputs' dtypes (no sizes) -> its shape-free aten trace
_SHAPE_FREE: dict[str, fx.GraphModule] = {}


@torch.library.custom_op("collage::chain", mutates_args=())
def chain(key: str, inputs: list[torch.Tensor], group: int = -1) -> list[torch.Tensor]:
    """The new (hi, lo) of one MCF chain (see the module docstring).  ``group``: the chains
    of one foreach op share a number >= 0 (their kernels are one horizontal kernel where
    the backend has them), a chain of its own has -1."""
    outs = list(_graph(key)(*inputs))
    # a custom op's outputs may not alias its inputs
    return [o.clone() if any(o is i for i in inputs) else o for o in outs]


@chain.register_fake
def _chain_fake(key: str, inputs: list[torch.Tensor], group: int = -1) -> list[torch.Tensor]:
    _graph(key)
    device = inputs[0].device
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype in _OUT_META[key]
    ]


def _graph(key: str) -> fx.GraphModule:
    gm = _GRAPHS.get(key)
    if gm is None:
        raise RuntimeError(
            f"collage: chain {key} is not known in this process (a graph compiled by "
            "collage_compile's backend in another process?)"
        )
    return gm


@functools.cache
def _register_lowering() -> None:
    # on first use: importing Inductor's lowerings takes a while
    _compat.register_inline_lowering(torch.ops.collage.chain.default, _graph)


def chain_graph(key: str) -> fx.GraphModule:
    """The aten graph behind ``collage::chain(key, ...)`` (what snapshots print)."""
    return _graph(key)


def outline(
    graph: fx.Graph,
    region: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    grad_enabled: bool,
    group: int = -1,
) -> Outlined | None:
    """Replace ``region`` (a chain's nodes, in graph order) by one ``collage::chain`` call
    producing ``outputs``; None, and the graph untouched, when the chain must stay inline.
    ``grad_enabled``: the grad mode where the chain runs (the op has no autograd formula,
    so a chain that autograd would record stays inline).  ``group``: a number shared by
    the chains that replace one foreach op (-1: none), so that Inductor can lower them as
    that op, into one horizontal kernel (:func:`_compat.register_inline_lowering`)."""
    # reads of a foreach result's elements stay where they are, as inputs
    region = [
        n
        for n in region
        if not (n.target is operator.getitem and not _is_member(n.args[0], region))
    ]
    members = set(region)
    if not all(o in members for o in outputs):
        return None
    inputs: list[fx.Node] = []
    for node in region:
        if node.op not in ("call_function", "call_method"):
            return None
        for a in node.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
        if node not in outputs and any(u not in members for u in node.users):
            return None
    examples = _outlinable(inputs, grad_enabled)
    if examples is None:
        return None
    structure = _signature(region, inputs, outputs, examples)
    key = _key(structure, examples)
    if not _known(key, structure, examples):
        aten = _trace(region, inputs, outputs, examples)
        if aten is None:
            return None
        if _shape_free(aten):
            _SHAPE_FREE[structure] = aten
        _register(key, aten, examples)
    # every input is defined before the region's last node (some, a foreach result's
    # elements, only just before the node that reads them)
    with graph.inserting_before(region[-1]):
        items = _call(graph, key, inputs, examples, group)
    for o, item in zip(outputs, items):
        o.replace_all_uses_with(item)
    for node in reversed(region):
        graph.erase_node(node)
    return Outlined(structure, inputs, items)


@dataclasses.dataclass(frozen=True)
class Outlined:
    """What :func:`outline` made: the chain's arithmetic (its structure, as keyed), its
    inputs in the call's order, and the nodes of the call's outputs."""

    structure: str
    inputs: list[fx.Node]
    outputs: list[fx.Node]


def call_again(
    graph: fx.Graph, structure: str, inputs: list[fx.Node], grad_enabled: bool, group: int = -1
) -> list[fx.Node] | None:
    """One ``collage::chain`` call, at the graph's insertion point, of arithmetic
    ``structure`` (an earlier :func:`outline`'s) on ``inputs``: the call :func:`outline`
    makes of a chain of that arithmetic on these inputs, made without the chain's nodes.
    Its output nodes; None when the call cannot be made so (the inputs must stay inline,
    or the arithmetic was traced for sizes other than theirs)."""
    examples = _outlinable(inputs, grad_enabled)
    if examples is None:
        return None
    key = _key(structure, examples)
    if not _known(key, structure, examples):
        return None
    return _call(graph, key, inputs, examples, group)


def _known(key: str, structure: str, examples: list[torch.Tensor]) -> bool:
    """Whether ``key`` has its aten graph, registering it from the shape-free trace of
    ``structure`` if there is one: chains of the same arithmetic on tensors of other shapes
    share one trace unless the trace names a size (a shape-free trace is pointwise ops on
    whole tensors)."""
    if key in _GRAPHS:
        return True
    aten = _SHAPE_FREE.get(structure)
    if aten is None:
        return False
    _register(key, aten, examples)
    return True


def _register(key: str, aten: fx.GraphModule, examples: list[torch.Tensor]) -> None:
    _GRAPHS[key] = aten
    _OUT_META[key] = _compat.output_meta(aten, examples)


def _outlinable(inputs: list[fx.Node], grad_enabled: bool) -> list[torch.Tensor] | None:
    """The inputs' example values, or None when a chain reading them must stay inline."""
    examples = [_compat.example_value(n) for n in inputs]
    if not examples or not all(_concrete_tensor(t) for t in examples):
        return None
    if len({t.device for t in examples}) != 1:
        return None
    if grad_enabled and any(t.requires_grad for t in examples):
        return None
    return examples


def _key(structure: str, examples: list[torch.Tensor]) -> str:
    layout = ";".join(f"{tuple(t.shape)}:{tuple(t.stride())}" for t in examples)
    return "chain_" + hashlib.sha256(f"{structure}\n{layout}".encode()).hexdigest()[:20]


def _call(
    graph: fx.Graph, key: str, inputs: list[fx.Node], examples: list[torch.Tensor], group: int
) -> list[fx.Node]:
    """The call node and a ``getitem`` per output, at the graph's insertion point."""
    _register_lowering()
    out_examples = [_compat.fake_like(examples[0], *meta) for meta in _OUT_META[key]]
    args = (key, list(inputs)) if group < 0 else (key, list(inputs), group)
    call = graph.call_function(torch.ops.collage.chain.default, args)
    _compat.set_example_value(call, list(out_examples))
    call.meta["val"] = list(out_examples)
    items = []
    for i, ex in enumerate(out_examples):
        item = graph.call_function(operator.getitem, (call, i))
        _compat.set_example_value(item, ex)
        item.meta["val"] = ex
        items.append(item)
    return items


def _trace(
    region: Sequence[fx.Node],
    inputs: list[fx.Node],
    outputs: Sequence[fx.Node],
    examples: list[torch.Tensor],
) -> fx.GraphModule | None:
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env[n] = sub.placeholder(f"in_{i}")
    for node in region:
        env[node] = sub.node_copy(node, lambda a: env[a])
    sub.output(tuple(env[o] for o in outputs))
    return _compat.trace_to_inductor_aten(fx.GraphModule({}, sub), examples)


def _shape_free(gm: fx.GraphModule) -> bool:
    """No argument of any op is a size (a non-empty list), so the graph computes the same
    pointwise function on inputs of any shape."""

    def sized(a: Any) -> bool:
        if isinstance(a, (list, tuple)):
            return len(a) > 0
        if isinstance(a, dict):
            return any(sized(v) for v in a.values())
        return isinstance(a, (torch.SymInt, torch.Size))

    return not any(
        sized(a) for n in gm.graph.nodes if n.op == "call_function" for a in (*n.args, n.kwargs)
    )


def _is_member(x: Any, region: Sequence[fx.Node]) -> bool:
    return isinstance(x, fx.Node) and x in region


def _concrete_tensor(t: Any) -> bool:
    # a DTensor's chain stays inline: DTensor runs each pointwise op on the local shards,
    # where the op would need a sharding rule of its own
    if _compat.is_dtensor(t):
        return False
    return isinstance(t, torch.Tensor) and all(isinstance(s, int) for s in (*t.shape, *t.stride()))


def _signature(
    region: Sequence[fx.Node],
    inputs: list[fx.Node],
    outputs: Sequence[fx.Node],
    examples: list[torch.Tensor],
) -> str:
    """The chain's arithmetic and its inputs' dtypes, independent of node names and sizes."""
    index = {n: f"in{i}" for i, n in enumerate(inputs)}
    index.update({n: f"v{i}" for i, n in enumerate(region)})

    def show(a: Any) -> str:
        if isinstance(a, fx.Node):
            return index[a]
        if isinstance(a, (list, tuple)):
            return f"{type(a).__name__}({','.join(show(v) for v in a)})"
        if isinstance(a, dict):
            return "{" + ",".join(f"{k}:{show(v)}" for k, v in sorted(a.items())) + "}"
        if isinstance(a, float):
            return a.hex()
        return repr(a)

    lines = [f"{index[n]}:{t.dim() == 0}:{t.dtype}:{t.device}" for n, t in zip(inputs, examples)]
    for node in region:
        target = node.target if isinstance(node.target, str) else _qualname(node.target)
        lines.append(f"{index[node]}={node.op}:{target}({show(node.args)};{show(node.kwargs)})")
    lines.append("out=" + show(list(outputs)))
    lines.append(torch.__version__)
    return "\n".join(lines)


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
