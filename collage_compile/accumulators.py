"""Find accumulators: persistent low-precision tensors that a graph updates from their old value.

A Dynamo graph reaches persistent tensors two ways: ``get_attr`` nodes (parameters and
optimizer state that Dynamo installs into the graph module) and placeholders (tensors passed
in, e.g. ``params`` of a hand-written ``step(params, grads)``).  Either is a *candidate* when
it is bf16/fp16 and something in the graph writes to it.  Aliasing is read off Dynamo's fake
example values: two nodes whose example values share a storage are the same tensor, so
``mul_ = p.mul_(c); mul_.copy_(...)`` is two writes to ``p``.

This module only looks; the pattern families in ``collage_compile.passes`` decide what each
write means (:class:`Step`), and ``rewrite.py`` emits the MCF code.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat, state
from collage_compile.config import CollageConfig
from collage_compile.mcf import LOW_PRECISION

# Methods that return a view of their tensor's shape or elements (their other arguments
# constants): an EMA of ``p.t()`` or ``p[:4]`` reads (part of) the weight ``p``.
VIEW_METHODS = frozenset(
    {
        "view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "flatten",
        "squeeze",
        "unsqueeze",
        "__getitem__",
    }
)

# In-place methods that do not write tensor data.
_NON_WRITING_METHODS = frozenset(
    {"requires_grad_", "retain_grad", "share_memory_", "record_stream"}
)
# Writes spelled as Python operators (``x += u``, ``x[i] = v``) and their dunder methods.
_INPLACE_OPERATORS = {
    operator.iadd: "add_",
    operator.isub: "sub_",
    operator.imul: "mul_",
    operator.itruediv: "div_",
    operator.setitem: "setitem",
}
_INPLACE_DUNDERS = {
    "__iadd__": "add_",
    "__isub__": "sub_",
    "__imul__": "mul_",
    "__itruediv__": "div_",
    "__setitem__": "setitem",
}


# Dynamo's source of a tensor in an optimizer's param_groups: a parameter whatever its
# requires_grad (gradients assigned by hand: torch.func, zeroth-order training)
_OPTIMIZER_PARAM = re.compile(r"\.param_groups\[\d+\]\['params'\]\[\d+\]$")


@dataclasses.dataclass(eq=False)
class Accumulator:
    """A persistent low-precision tensor written by the graph."""

    node: fx.Node  # the placeholder or get_attr node
    example: torch.Tensor  # Dynamo's example value (fake) for it
    real: torch.Tensor | None  # the real tensor when it is a get_attr (known at compile time)
    input_index: int | None  # position among the graph's placeholders, when it is one
    role: str  # "param" (nn.Parameter / leaf requiring grad) or "tensor"
    name: str
    carries_pair: bool = False  # it (or what it aliases) had a lo when the graph was compiled
    eligible: bool = True  # until the mode leaves it (modes.select)
    reason: str = ""  # why it is not eligible
    warn: bool = False  # not eligible although its mode asks for it: warned about once
    lo_node: fx.Node | None = None

    @property
    def is_weight(self) -> bool:
        """A parameter, or an alias of a tensor carrying a pair (``p.detach()`` passed in)."""
        return self.role == "param" or self.carries_pair

    @property
    def is_gradient(self) -> bool:
        """A gradient (Dynamo's ``.grad`` source, or a gradient input): scaled, accumulated
        and zeroed by torch, never a sum or a persistent tensor of ours."""
        return self.name.endswith(".grad") or _compat.is_gradient_input(self.node)

    @property
    def dtype(self) -> torch.dtype:
        return self.example.dtype

    def describe(self) -> str:
        from collage_compile import names

        shown = names.display(self.real, self.name)
        return f"{shown} {tuple(self.example.shape)} {str(self.dtype).replace('torch.', '')}"


@dataclasses.dataclass(eq=False)
class Write:
    """One node writing one accumulator (a foreach node writes one per list element)."""

    node: fx.Node
    acc: Accumulator
    target: fx.Node  # the node passed as the written tensor (the accumulator or an alias)
    index: int | None  # element index in the written list, for foreach ops
    op: str  # canonical in-place name: "add_", "copy_", "_foreach_addcdiv_" -> "addcdiv_", ...
    args: tuple[Any, ...]  # operands after the written tensor, per element for foreach
    kwargs: dict[str, Any]
    full_alias: bool  # False when only a view of the accumulator is written


@dataclasses.dataclass
class Step:
    """What one write does to the accumulator's value, in the terms MCF can carry.

    kind:
        ``"add"``: value += ``update(*args)`` (an fp32 tensor, unrounded)
        ``"mul"``: value *= ``args[0]`` (a Python float, split in float64, or a tensor)
        ``"div"``: value /= ``args[0]`` (a tensor, or a constant whose reciprocal fp32
        cannot hold); divided directly, never through an overflowing reciprocal
        ``"lerp"``: value += ``args[1]`` * (``args[0]`` - value)
        ``"set"``: value = ``args[0]`` (an overwrite: the old lo is discarded; a source
        finer than the storage dtype keeps in lo what hi cannot hold, in fp32 arithmetic)
        ``"max"``: value = max(value, ``args[0]``) (exact: the whole pair is compared)
        ``"min"``: value = min(value, ``args[0]``) (likewise; a clamp is a max and a min)
    """

    kind: str
    args: tuple[Any, ...] = ()
    update: Callable[..., Any] | None = None


@dataclasses.dataclass(eq=False)
class Site:
    """A write that a pattern family understood."""

    write: Write
    steps: list[Step]
    pattern: str
    # nodes that read the tensor only to compute this write (``copy_``'s source expression,
    # used by nothing else): they go with the write, so their reads do not end its chain
    consumed: frozenset[fx.Node] = frozenset()


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a node's written operand sits: ``args[key]`` or ``kwargs[key]``."""

    where: str  # "arg" | "kwarg"
    key: int | str
    op: str  # canonical in-place name: "add_", "copy_", "_foreach_addcdiv_" -> "addcdiv_", ...

    def get(self, node: fx.Node) -> Any:
        if self.where == "arg":
            return node.args[self.key] if self.key < len(node.args) else None  # type: ignore[operator]
        return node.kwargs.get(self.key)  # type: ignore[arg-type]


def _canonical(name: str) -> str:
    return name[len("_foreach_") :] if name.startswith("_foreach_") else name


def written_slots(node: fx.Node) -> list[Slot]:
    """Every operand a node writes in place (Python method, operator, ``out=``, foreach,
    aten overload, fused optimizer kernel)."""
    if node.op == "call_method":
        name = node.target
        if name in _INPLACE_DUNDERS:
            return [Slot("arg", 0, _INPLACE_DUNDERS[name])]
        if name.endswith("_") and not name.startswith("_") and name not in _NON_WRITING_METHODS:
            return [Slot("arg", 0, name)]
        return []
    if node.op != "call_function":
        return []
    target = node.target
    name = getattr(target, "__name__", str(target))
    slots: list[Slot] = []
    if node.kwargs.get("out") is not None:
        slots.append(Slot("kwarg", "out", f"{name}(out=)"))
    if target in _INPLACE_OPERATORS:
        slots.append(Slot("arg", 0, _INPLACE_OPERATORS[target]))
    elif _compat.is_op_overload(target):
        op = _canonical(_compat.op_packet_name(target))
        for i, arg_name in _compat.written_schema_args(target):
            if i < len(node.args):
                slots.append(Slot("arg", i, op))
            elif arg_name in node.kwargs and arg_name != "out":
                slots.append(Slot("kwarg", arg_name, op))
    elif name.startswith("_fused_"):
        # fused optimizer kernels write every tensor list they take (params, state, steps)
        slots.extend(
            Slot("arg", i, name) for i, a in enumerate(node.args) if isinstance(a, (list, tuple))
        )
    elif name in _INPLACE_DUNDERS:
        slots.append(Slot("arg", 0, _INPLACE_DUNDERS[name]))
    elif name.endswith("_") and not name.startswith("__") and node.args:
        slots.append(Slot("arg", 0, _canonical(name)))
    return slots


def flat_nodes(x: Any) -> Iterator[fx.Node]:
    if isinstance(x, fx.Node):
        yield x
    elif isinstance(x, Element):
        yield x.node
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from flat_nodes(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from flat_nodes(v)


def written_nodes(node: fx.Node) -> list[fx.Node]:
    return [n for slot in written_slots(node) for n in flat_nodes(slot.get(node))]


def read_nodes(node: fx.Node) -> list[fx.Node]:
    """Nodes a node reads: its inputs, minus the operands it only writes (``p`` in
    ``p.add_(u)``; but both in ``p.add_(p)``)."""
    written = {(s.where, s.key) for s in written_slots(node)}
    out: list[fx.Node] = []
    for i, a in enumerate(node.args):
        if ("arg", i) not in written:
            out.extend(flat_nodes(a))
    for k, v in node.kwargs.items():
        if ("kwarg", k) not in written:
            out.extend(flat_nodes(v))
    return out


class GraphInfo:
    """Accumulators of one graph, every write to them, and where each storage is written."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], config: CollageConfig):
        self.gm = gm
        self.config = config
        self.example_inputs = example_inputs
        self.accumulators: list[Accumulator] = []
        self.writes: list[Write] = []
        self.positions: dict[fx.Node, int] = {n: i for i, n in enumerate(gm.graph.nodes)}
        # several accumulators may share one storage (views of a flat buffer)
        self._by_storage: dict[Any, list[Accumulator]] = {}
        # positions of every in-place write, per storage, over the whole graph
        self._write_positions: dict[Any, list[int]] = {}
        # id(value) -> (value, its storage key): the analysis asks for the same few values'
        # keys tens of times per tensor (the value is kept so its id is not reused)
        self._keys: dict[int, tuple[Any, Any]] = {}
        self._find_candidates(example_inputs)
        self._find_writes()

    # -- candidates -------------------------------------------------------------------
    def _find_candidates(self, example_inputs: list[Any]) -> None:
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        index_of = {n: i for i, n in enumerate(self.placeholders)}
        for node in self.gm.graph.nodes:
            if node.op not in ("placeholder", "get_attr"):
                continue
            ex = _compat.example_value(node)
            if not isinstance(ex, torch.Tensor) or ex.dtype not in LOW_PRECISION:
                continue
            key = self.storage_key(ex)
            if key is None:  # e.g. sparse: no storage to alias
                continue
            real = None
            if node.op == "get_attr":
                real = fetch_attr(self.gm, node.target)
                probe = real
                idx = None
            else:
                idx = index_of[node]
                probe = example_inputs[idx] if idx < len(example_inputs) else None
            name = readable_name(node)
            is_param = (
                isinstance(probe, torch.nn.Parameter)
                or (isinstance(probe, torch.Tensor) and probe.is_leaf and probe.requires_grad)
                or _OPTIMIZER_PARAM.search(name) is not None
            )
            acc = Accumulator(
                node=node,
                example=ex,
                real=real,
                input_index=idx,
                role="param" if is_param else "tensor",
                name=name,
                carries_pair=isinstance(probe, torch.Tensor)
                and not _compat.is_fake(probe)
                and state.has_pair(probe),
            )
            self._by_storage.setdefault(key, []).append(acc)
            self.accumulators.append(acc)

    def accumulators_of(self, value: Any) -> list[tuple[Accumulator, bool]]:
        """[(accumulator, value is exactly it)] for a (fake) tensor value.

        A value that is exactly an accumulator (same storage, offset, sizes, strides, dtype)
        names that one; any other view of a storage holding accumulators may touch each of
        them, so it names them all, as partial.
        """
        key = self.storage_key(value)
        accs = self._by_storage.get(key, []) if key is not None else []
        for acc in accs:
            if same_view(value, acc.example):
                return [(acc, True)]
        return [(acc, False) for acc in accs]

    def aliases(self, acc: Accumulator) -> list[Accumulator]:
        """Every input of the graph on ``acc``'s storage, ``acc`` first."""
        others = self._by_storage.get(self.storage_key(acc.example), [])
        return [acc, *[a for a in others if a is not acc]]

    def accumulators_of_node(self, node: Any) -> list[tuple[Accumulator, bool]]:
        if isinstance(node, Element):
            ex = _compat.example_value(node.node)
            value = ex[node.index] if isinstance(ex, (list, tuple)) else None
        elif isinstance(node, fx.Node):
            value = _compat.example_value(node)
        else:
            return []
        if not isinstance(value, torch.Tensor):
            return []
        return self.accumulators_of(value)

    def storages_of(self, node: Any) -> set[Any]:
        """Storage keys of a node's tensor value(s) (a list-valued node has several)."""
        if isinstance(node, Element):
            node = node.node
        if not isinstance(node, fx.Node):
            return set()
        ex = _compat.example_value(node)
        vals = ex if isinstance(ex, (list, tuple)) else [ex]
        return {k for v in vals if (k := self.storage_key(v)) is not None}

    def storage_key(self, value: Any) -> Any:
        """:func:`storage_key`, remembered per value."""
        hit = self._keys.get(id(value))
        if hit is None:
            hit = self._keys[id(value)] = (value, storage_key(value))
        return hit[1]

    def written_storages(self) -> set[Any]:
        """Storage keys of every tensor the graph writes in place (temporaries included)."""
        return set(self._write_positions)

    def written_between(self, node: Any, start: int, end: int) -> bool:
        """Whether any storage of ``node`` is written in place strictly between two positions."""
        for key in self.storages_of(node):
            if any(start < p < end for p in self._write_positions.get(key, ())):
                return True
        return False

    # -- writes -----------------------------------------------------------------------
    def _find_writes(self) -> None:
        for node in self.gm.graph.nodes:
            slots = written_slots(node)
            for slot in slots:
                operand = slot.get(node)
                for n in flat_nodes(operand):
                    for key in self.storages_of(n):
                        self._write_positions.setdefault(key, []).append(self.positions[node])
                for index, element in _elements(operand):
                    for acc, full in self.accumulators_of_node(element):
                        args, kwargs = _element_operands(node, slot, index)
                        self.writes.append(
                            Write(node, acc, element, index, slot.op, args, kwargs, full_alias=full)
                        )


def real_value(info: GraphInfo, node: fx.Node) -> Any:
    """The real object behind a get_attr node or a placeholder (its example input), when
    the graph was compiled; None for anything else."""
    if node.op == "get_attr":
        return fetch_attr(info.gm, str(node.target))
    if node.op == "placeholder":
        idx = info.placeholders.index(node)
        return info.example_inputs[idx] if idx < len(info.example_inputs) else None
    return None


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """The object a get_attr node's ``target`` names in ``gm`` (None if absent)."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def readable_name(node: fx.Node) -> str:
    """Dynamo's source expression for an input node (shown as ``names.display`` later)."""
    from collage_compile import names

    return names.source_name(node)


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (fake or real) tensors on one storage are the same view of it."""
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
    )


def storage_key(value: Any) -> Any:
    """A hashable key of a (fake or real) tensor's storage; None for non-tensors / sparse."""
    if not isinstance(value, torch.Tensor) or value.is_sparse:
        return None
    try:
        return _compat.storage_key(value)
    except (RuntimeError, NotImplementedError):
        return None


def _elements(operand: Any) -> list[tuple[int | None, Any]]:
    if isinstance(operand, (list, tuple)):
        return list(enumerate(operand))
    if isinstance(operand, fx.Node) and isinstance(_compat.example_value(operand), (list, tuple)):
        return [(i, Element(operand, i)) for i in range(len(_compat.example_value(operand)))]
    return [(None, operand)]


@dataclasses.dataclass(frozen=True)
class Element:
    """``node[index]`` of a list-valued node or of a 1-D tensor of per-element scalars,
    materialized as a getitem node only when the rewrite needs it."""

    node: fx.Node
    index: int


# foreach ops whose trailing tensor argument holds one scalar per list element
_PER_ELEMENT_SCALAR_TENSOR = frozenset({"addcdiv_", "addcmul_"})


def element_of(arg: Any, index: int | None, per_element_tensor: bool = False) -> Any:
    """The ``index``-th element of a foreach argument: an entry of a list of nodes/scalars,
    an :class:`Element` of a list-valued node or per-element scalar tensor, or the argument
    itself when it is shared by every element (a scalar, a 0-dim tensor)."""
    if index is None:
        return arg
    if isinstance(arg, (list, tuple)):
        return arg[index]
    if isinstance(arg, fx.Node):
        ex = _compat.example_value(arg)
        if isinstance(ex, (list, tuple)):
            return Element(arg, index)
        if per_element_tensor and isinstance(ex, torch.Tensor) and ex.dim() == 1:
            return Element(arg, index)
    return arg


def _element_operands(
    node: fx.Node, slot: Slot, index: int | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The operands of a write other than the written tensor, for list element ``index``."""
    per_elem = slot.op in _PER_ELEMENT_SCALAR_TENSOR
    if slot.where == "arg":
        rest = [a for i, a in enumerate(node.args) if i != slot.key]
        kwargs = {k: v for k, v in node.kwargs.items()}
    else:
        rest = list(node.args)
        kwargs = {k: v for k, v in node.kwargs.items() if k != slot.key}
    args = tuple(element_of(a, index, per_elem) for a in rest)
    kwargs = {k: element_of(v, index, per_elem) for k, v in kwargs.items()}
    return args, kwargs
