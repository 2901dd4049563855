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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.config import CollageConfig
from collage_compile.mcf import LOW_PRECISION

# In-place methods that do not write tensor data.
_NON_WRITING_METHODS = frozenset(
    {"requires_grad_", "retain_grad", "share_memory_", "record_stream", "set_", "resize_"}
)
_INPLACE_OPERATORS = {
    operator.iadd: "add_",
    operator.isub: "sub_",
    operator.imul: "mul_",
    operator.itruediv: "div_",
}


@dataclasses.dataclass(eq=False)
class Accumulator:
    """A persistent low-precision tensor written by the graph."""

    node: fx.Node  # the placeholder or get_attr node
    example: torch.Tensor  # Dynamo's example value (fake) for it
    real: torch.Tensor | None  # the real tensor when it is a get_attr (known at compile time)
    input_index: int | None  # position among the graph's placeholders, when it is one
    role: str  # "param" (nn.Parameter / leaf requiring grad) or "tensor"
    name: str
    eligible: bool = False
    reason: str = ""  # why it is not eligible
    lo_node: fx.Node | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.example.dtype

    def describe(self) -> str:
        return f"{self.name} {tuple(self.example.shape)} {str(self.dtype).replace('torch.', '')}"


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
        ``"lerp"``: value += ``args[1]`` * (``args[0]`` - value)
        ``"set"``: value = ``args[0]`` (an overwrite: lo restarts at zero)
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


def is_foreach_inplace(target: Any) -> bool:
    name = getattr(target, "__name__", "")
    return name.startswith("_foreach_") and name.endswith("_") and callable(target)


def _written_operands(node: fx.Node) -> list[tuple[Any, str]]:
    """(written operand, canonical op name) pairs of a node; the operand may be a list."""
    if node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.startswith("_") and name not in _NON_WRITING_METHODS:
            return [(node.args[0], name)]
        return []
    if node.op != "call_function":
        return []
    target = node.target
    out = node.kwargs.get("out")
    written: list[tuple[Any, str]] = []
    if out is not None:
        written.append((out, f"{getattr(target, '__name__', target)}(out=)"))
    if target in _INPLACE_OPERATORS:
        written.append((node.args[0], _INPLACE_OPERATORS[target]))
    elif is_foreach_inplace(target):
        written.append((node.args[0], target.__name__[len("_foreach_") :]))
    elif _compat.is_op_overload(target):
        for i, name in _compat.written_schema_args(target):
            val = node.args[i] if i < len(node.args) else node.kwargs.get(name)
            if val is not None:
                written.append((val, target.__name__))
    else:
        name = getattr(target, "__name__", "")
        if name.endswith("_") and not name.startswith("__") and node.args:
            written.append((node.args[0], name.lstrip("_") if name.startswith("_fused") else name))
    return written


class GraphInfo:
    """Accumulators of one graph and every write to them, in graph order."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], config: CollageConfig):
        self.gm = gm
        self.config = config
        self.accumulators: list[Accumulator] = []
        self.writes: list[Write] = []
        self._by_storage: dict[Any, Accumulator] = {}
        self._find_candidates(example_inputs)
        if self.accumulators:
            self._find_writes()

    # -- candidates -------------------------------------------------------------------
    def _find_candidates(self, example_inputs: list[Any]) -> None:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        index_of = {n: i for i, n in enumerate(placeholders)}
        candidates: list[Accumulator] = []
        for node in self.gm.graph.nodes:
            if node.op not in ("placeholder", "get_attr"):
                continue
            ex = _compat.example_value(node)
            if not isinstance(ex, torch.Tensor) or ex.dtype not in LOW_PRECISION:
                continue
            real = None
            if node.op == "get_attr":
                real = _fetch_attr(self.gm, node.target)
                probe = real
                idx = None
            else:
                idx = index_of[node]
                probe = example_inputs[idx] if idx < len(example_inputs) else None
            is_param = isinstance(probe, torch.nn.Parameter) or (
                isinstance(probe, torch.Tensor) and probe.is_leaf and probe.requires_grad
            )
            candidates.append(
                Accumulator(
                    node=node,
                    example=ex,
                    real=real,
                    input_index=idx,
                    role="param" if is_param else "tensor",
                    name=_readable_name(node),
                )
            )
        for acc in candidates:
            try:
                self._by_storage[_compat.storage_key(acc.example)] = acc
            except (RuntimeError, NotImplementedError):  # e.g. sparse: no storage
                continue
            self.accumulators.append(acc)

    def _accumulator_of(self, value: Any) -> tuple[Accumulator | None, bool]:
        """(accumulator, is full alias) for a fake tensor value."""
        if not isinstance(value, torch.Tensor) or value.is_sparse:
            return None, False
        try:
            acc = self._by_storage.get(_compat.storage_key(value))
        except (RuntimeError, NotImplementedError):
            return None, False
        if acc is None:
            return None, False
        ex = acc.example
        full = (
            value.shape == ex.shape
            and value.stride() == ex.stride()
            and value.storage_offset() == ex.storage_offset()
            and value.dtype == ex.dtype
        )
        return acc, full

    def accumulator_of_node(self, node: Any) -> tuple[Accumulator | None, bool]:
        if not isinstance(node, fx.Node):
            return None, False
        return self._accumulator_of(_compat.example_value(node))

    # -- writes -----------------------------------------------------------------------
    def _find_writes(self) -> None:
        for node in self.gm.graph.nodes:
            for operand, op in _written_operands(node):
                elements = _elements(operand)
                for index, element in elements:
                    acc, full = self.accumulator_of_node(element)
                    if acc is None:
                        continue
                    args, kwargs = _element_operands(node, op, index)
                    self.writes.append(
                        Write(node, acc, element, index, op, args, kwargs, full_alias=full)
                    )

    def written(self) -> list[Accumulator]:
        seen = {w.acc for w in self.writes}
        return [a for a in self.accumulators if a in seen]

    def readers(self, acc: Accumulator) -> Iterator[fx.Node]:
        """Nodes that use ``acc`` (or an alias of it) as an input."""
        for node in self.gm.graph.nodes:
            for inp in node.all_input_nodes:
                a, _ = self.accumulator_of_node(inp)
                if a is acc:
                    yield node
                    break


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _readable_name(node: fx.Node) -> str:
    source = getattr(node, "_dynamo_source", None)
    if source is not None:
        try:
            return source.name
        except Exception:
            pass
    return str(node.target)


def _elements(operand: Any) -> list[tuple[int | None, Any]]:
    if isinstance(operand, (list, tuple)):
        return list(enumerate(operand))
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
    node: fx.Node, op: str, index: int | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    per_elem = op in _PER_ELEMENT_SCALAR_TENSOR
    args = tuple(element_of(a, index, per_elem) for a in node.args[1:])
    kwargs = {k: element_of(v, index, per_elem) for k, v in node.kwargs.items() if k != "out"}
    return args, kwargs
