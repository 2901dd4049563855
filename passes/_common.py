"""Shared helpers of the pattern families: argument binding and fp32 operands."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat


def f32(x: Any) -> Any:
    """An operand as fp32: tensors (and proxies) are upcast, Python numbers become floats,
    a symbolic scalar (a ``SymFloat`` under ``dynamic=True``) becomes a 0-dim fp32 tensor.

    Upcasting a bf16/fp16 operand is exact; what matters is that the arithmetic combining
    the operands runs in fp32, so the update reaching the Grow is not rounded to bf16 first.
    """
    if isinstance(x, fx.Proxy) and is_scalar(x):
        return scalar_f64(x).float()
    if isinstance(x, (torch.Tensor, fx.Proxy)):
        return x.float()
    return float(x)


def scalar_f64(x: Any) -> Any:
    """A symbolic Python scalar (``1 - lr*wd`` once Dynamo has made ``lr`` dynamic) as a
    0-dim float64 tensor, exact.

    Built as ``zeros + x`` because that is an op Dynamo's float tensorification
    (``torch.fx.passes._tensorify_python_scalars``) rewrites into tensor arithmetic on the
    graph's float input; a SymFloat consumed any other way (``torch.scalar_tensor``,
    ``new_full``) is specialized to the value it was traced with, which guards on it: one
    recompile per learning rate, then eager execution at the recompile limit.
    """
    if isinstance(x, fx.Proxy) and mirrors_arithmetic(x.node):
        return fx.Proxy(_mirror(x.tracer.graph, x.node, None, {}), x.tracer)
    if isinstance(x, fx.Proxy):  # a graph node, not a constant folded in while tracing
        zero = x.tracer.create_proxy("call_function", torch.zeros, ((),), {"dtype": torch.float64})
    else:
        zero = torch.zeros((), dtype=torch.float64)
    return zero + x


def _is_symbolic_int(node: Any) -> bool:
    """A graph value that is a SymInt with free symbols (a step count Dynamo made dynamic,
    or arithmetic on one): ``k + 1`` in a float's arithmetic is mirrored as a float64 tensor,
    exact below 2**53."""
    if not isinstance(node, fx.Node):
        return False
    ex = _compat.example_value(node)
    return isinstance(ex, torch.SymInt) and bool(_compat.free_symbols(ex))


def is_symbolic_float(node: Any) -> bool:
    """A graph value that is a SymFloat with free symbols (a float input Dynamo made
    dynamic, such as a scheduled lr, or arithmetic on one)."""
    if not isinstance(node, fx.Node):
        return False
    ex = _compat.example_value(node)
    return isinstance(ex, torch.SymFloat) and bool(_compat.free_symbols(ex))


def hyperparameter_f64(
    graph: fx.Graph, x: fx.Node, device: Any = None, made: dict[Any, fx.Node] | None = None
) -> fx.Node:
    """A node computing symbolic float ``x`` as a 0-dim float64 tensor on ``device``, placed
    right after ``x`` (valid for all of its users) and marked so the chain arithmetic knows
    it is exact (:func:`is_exact_f64`).  ``made`` caches the tensors of ``x``'s operands
    when ``x`` is arithmetic on float inputs (:func:`mirrors_arithmetic`)."""
    if mirrors_arithmetic(x):
        return _mirror(graph, x, device, {} if made is None else made)
    with graph.inserting_after(x):
        zero = graph.call_function(torch.zeros, ((),), {"dtype": torch.float64, "device": device})
    with graph.inserting_after(zero):
        node = graph.call_function(operator.add, (zero, x))
    ex = _compat.example_value(x)
    node.meta[_EXACT_F64] = True
    fake = _compat.fake_scalar_f64(ex, device)
    if fake is not None:
        zero.meta["example_value"] = fake
        node.meta["example_value"] = fake
    return node


def hyperparameter_device(node: fx.Node) -> torch.device | None:
    """The device of ``node`` if it is what :func:`hyperparameter_f64` made of an input's
    ``.item()`` (``zeros(device) + x.item()``), else None."""
    if not (
        node.meta.get(_EXACT_F64)
        and node.target is operator.add
        and len(node.args) == 2
        and all(isinstance(a, fx.Node) for a in node.args)
    ):
        return None
    zeros, item = node.args
    if zeros.target is not torch.zeros or not (item.op == "call_method" and item.target == "item"):
        return None
    return torch.device(zeros.kwargs.get("device") or "cpu")


# Python arithmetic on floats, as float64 tensor arithmetic: the same IEEE operations in the
# same order, except that a tensor divides a constant by it as reciprocal * constant (two
# roundings) and a GPU kernel may fuse a * b + c or divide by a constant's reciprocal; each
# at most one float64 ulp, as the tensorification's own arithmetic.  ``**`` is not one IEEE
# operation: Inductor expands a small integer power into products and a GPU's float64 pow
# is not libm's, a float64 ulp or two, gone in the cast to fp32.  ``max``/``min`` of a
# tensor and a number are built as clamps (:func:`_extremum`)
_FLOAT_ARITHMETIC: dict[Any, Callable[..., Any]] = {
    operator.neg: operator.neg,
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.truediv: operator.truediv,
    # schedule-free's weight, ((k + 1) ** r) * (max(lr, lr_max) ** 2), k a step count
    operator.pow: operator.pow,
    torch.sym_max: torch.maximum,
    torch.sym_min: torch.minimum,
}
_CLAMPS = {torch.maximum: torch.clamp_min, torch.minimum: torch.clamp_max}


def _extremum(target: Any, args: list[Any]) -> tuple[Any, tuple[Any, ...]]:
    """``maximum(a, b)`` of two tensors, ``clamp_min(t, n)`` of a tensor and a number: torch
    functions, so that the graph stays cacheable (AOTAutograd's cache bypasses a graph that
    calls a Python function of ours)."""
    if target not in _CLAMPS or all(isinstance(a, fx.Node) for a in args):
        return target, tuple(args)
    t, n = (args[0], args[1]) if isinstance(args[0], fx.Node) else (args[1], args[0])
    return _CLAMPS[target], (t, n)


def mirrors_arithmetic(x: fx.Node) -> bool:
    """Whether symbolic float ``x`` is Python arithmetic (``-lr``, ``1 - lr*wd``) on float
    inputs, rather than one float input itself, and :func:`hyperparameter_f64` builds its
    tensor from theirs, op for op.

    Why: torch's float tensorification (``torch/fx/passes/_tensorify_python_scalars.py``)
    turns ``zeros + (1 - lr*wd)`` into tensor arithmetic on the float input ``lr`` and then
    checks that every float input it met was tensorified.  On torch 2.11 that check reads
    the expression's own symbol, ``1 - lr*wd``, not ``lr``
    (``tensorified_symbols.add(a.meta["val"].node._expr)``; 2.13 adds its free symbols), so
    it specializes ``lr``: one compile per learning rate, then eager steps in plain low
    precision at the recompile limit (measured on 2.11).  The mirror makes every float the
    tensorification meets one input's own symbol, on every version, and evaluates the
    arithmetic in eager's order (the tensorification rebuilds it from the simplified
    expression, ``lr * bc**-1`` for ``lr / bc``)."""
    ex = _compat.example_value(x)
    return (
        isinstance(ex, torch.SymFloat)
        and not _compat.is_symbol(ex)
        and _is_float_arithmetic(x)
        and _reads_a_float_input(x)
    )


def _reads_a_float_input(x: Any) -> bool:
    """Whether arithmetic ``x`` reads a float input (a hyperparameter), not only sizes or
    step counts: ``x * (1.0 / s0)`` in a forward pass under dynamic shapes is left alone."""
    if not isinstance(x, fx.Node):
        return False
    ex = _compat.example_value(x)
    if _compat.is_symbol(ex):
        return isinstance(ex, torch.SymFloat)
    return any(_reads_a_float_input(a) for a in x.args)


def _is_float_arithmetic(x: Any) -> bool:
    if is_number(x):
        return True
    if not isinstance(x, fx.Node) or not (is_symbolic_float(x) or _is_symbolic_int(x)):
        return False
    if _compat.is_symbol(_compat.example_value(x)):
        return True  # a float input or a step count (a leaf)
    return (
        x.op == "call_function"
        and x.target in _FLOAT_ARITHMETIC
        and not x.kwargs
        and all(_is_float_arithmetic(a) for a in x.args)
    )


def _mirror(graph: fx.Graph, x: fx.Node, device: Any, made: dict[Any, fx.Node]) -> fx.Node:
    """``x``'s float arithmetic on 0-dim float64 tensors, each placed right after the float
    it stands for; a float input becomes ``zeros + x``, the one op the tensorification sees."""
    key = (x, device)
    if key in made:
        return made[key]
    ex = _compat.example_value(x)
    if _compat.is_symbol(ex):
        node = hyperparameter_f64(graph, x, device)
    else:
        args = [a if is_number(a) else _mirror(graph, a, device, made) for a in x.args]
        target, args = _extremum(_FLOAT_ARITHMETIC[x.target], args)
        with graph.inserting_after(x):
            node = graph.call_function(target, args)
        node.meta[_EXACT_F64] = True
        fake = _compat.fake_scalar_f64(ex, device)
        if fake is not None:
            node.meta["example_value"] = fake
    made[key] = node
    return node


_EXACT_F64 = "collage_exact_f64"


def is_exact_f64(x: Any) -> bool:
    """A float64 0-dim tensor holding a hyperparameter exactly: a node made by
    :func:`hyperparameter_f64` (as a proxy), or an eager float64 0-dim tensor."""
    if isinstance(x, fx.Proxy):
        return bool(x.node.meta.get(_EXACT_F64))
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64 and x.dim() == 0


def is_scalar(x: Any) -> bool:
    """A Python number, or a graph value that is a (symbolic) Python scalar, not a tensor."""
    if isinstance(x, fx.Proxy):
        x = x.node
    if isinstance(x, fx.Node):
        ex = _compat.example_value(x)
        return isinstance(ex, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(
            ex, bool
        )
    return is_number(x)


def bind(
    signature_of: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...] | None:
    """Bind a write's operands to ``signature_of``'s parameters, defaults applied.

    Returns the positional tuple, or ``None`` when the operands do not fit (an overload the
    family does not handle).
    """
    try:
        bound = _signature(signature_of).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return tuple(bound.arguments.values())


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    # once per function: inspect.signature parses it anew on every call, and every write
    # of every tensor is bound (a tenth of the rewrite at 1000 tensors)
    return inspect.signature(fn)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scale(x: Any, factor: Any) -> Any:
    """``x * factor``, skipping a multiplication by the constant 1."""
    if is_number(factor) and factor == 1:
        return x
    return x * f32(factor) if is_number(factor) else x * factor


def is_scalar_like(x: Any) -> bool:
    """A Python number, or a graph value (node or list element) that is a scalar or a 0-dim
    tensor: something that scales every element alike."""
    if is_number(x):
        return True
    from collage_compile.accumulators import Element

    if isinstance(x, Element):
        ex = _compat.example_value(x.node)
        if not isinstance(ex, (list, tuple)):
            return False  # an element of a 1-D tensor of per-element values
        ex = ex[x.index]
    elif isinstance(x, fx.Node):
        ex = _compat.example_value(x)
    else:
        return False
    return not isinstance(ex, torch.Tensor) or ex.dim() == 0


_OPERATOR_NAMES = {
    operator.mul: "mul",
    operator.imul: "mul",
    operator.sub: "sub",
    operator.isub: "sub",
    operator.truediv: "div",
    operator.itruediv: "div",
    operator.getitem: "getitem",
}


def op_name(node: fx.Node) -> str:
    """A node's operation as one name for every spelling: method, ``torch`` function,
    Python operator, aten overload or foreach op (``mul_``, ``torch.mul``, ``operator.mul``,
    ``torch._foreach_mul_`` are all ``"mul"``)."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[node.target]
    elif _compat.is_op_overload(node.target):
        name = _compat.op_packet_name(node.target)
    else:
        name = getattr(node.target, "__name__", str(node.target))
    if name.startswith("_foreach_"):
        name = name[len("_foreach_") :]
    return name.rstrip("_")
