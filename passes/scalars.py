"""Hyperparameters that change between steps, kept as tensors: no recompile per learning rate.

Before (AdamW foreach; a scheduler changed ``lr``, so Dynamo passes it as a float input)::

    item = lr.item()                              # a SymFloat
    _foreach_div_(bias_correction1, item)         # Scalar overload
    _foreach_pow(beta1, steps)                    # beta1 cycled by OneCycleLR
    buf.add_(grad, alpha=-item)

After::

    t = zeros((), float64) + item                 # tensor arithmetic on the float input
    _foreach_div_(bias_correction1, t.to(float32))         # Tensor overload
    _foreach_pow([t.to(float32).expand_as(s) for s in steps], steps)
    buf.add_(grad * t.to(float32))
    prims.fma(u, t.to(float32), x)                # fma(u, -item, x): one rounding either way

Why: a float that changes between calls reaches the graph as a SymFloat, and torch's float
tensorification (``torch/fx/passes/_tensorify_python_scalars.py``, run by AOTAutograd)
turns it into tensor arithmetic only where an aten ``mul/add/sub/div/pow`` takes it as a
positional operand.  Any other consumer (a foreach op's Scalar overload, ``alpha=`` and
``value=``, a scalar base of ``pow``, ``full_like``'s fill value) makes it *specialize*:
Dynamo guards on the value, the next step recompiles, and from the recompile limit (8) on
the step runs eagerly, in plain low precision.  Plain Inductor does this for foreach
Adam, NAdam, RAdam, Adamax, ASGD, SGD and RMSprop under a schedule.  Each rewrite keeps
the op's arithmetic: the scalar enters as a 0-dim tensor of the op's computation dtype
(fp32 for bf16/fp16/fp32 operands, what the tensorification casts to), where the Scalar
overload converted the Python float to that same dtype.

``torch.tensor(x)`` (Dynamo's ``_foreach_lerp_`` polyfill makes its weight one when it is at
least 1/2) becomes ``(zeros + x).to(dtype)``: the same single rounding of the float.

Runs after the MCF rewrite, on what is left: the families consume the writes they upgrade
(their scalars become float64 tensors there, :func:`collage_compile.passes._common.scalar_f64`).
A consumer this pass does not know is left alone and named in a debug log: its float still
specializes.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.passes._common import (
    hyperparameter_f64,
    is_symbolic_float,
    mirrors_arithmetic,
    op_name,
)

log = logging.getLogger("collage_compile")

_ALPHA_OPS = {"add", "sub"}
_VALUE_OPS = {"addcmul", "addcdiv"}
_FILL_FACTORIES = {torch.full_like}
# scalar -> 0-dim tensor (Dynamo's _foreach_lerp_ polyfill makes its weight one)
_SCALAR_FACTORIES = {torch.tensor, torch.scalar_tensor, torch.as_tensor, torch._refs.tensor}


def run(gm: fx.GraphModule) -> int:
    """Rewrite every known consumer of a symbolic float that would specialize it; returns
    how many nodes were rewritten."""
    graph = gm.graph
    tensors = _ScalarTensors(graph)
    n = 0
    unknown: set[str] = set()
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        if _is_sym(node) or not _reads_symbolic_float(node):
            continue
        done = _rewrite(graph, node, tensors)
        if done is None:
            unknown.add(_describe(node))
        n += bool(done)
    if unknown:
        log.debug(
            "collage: a changing hyperparameter stays a Python float in %s: it specializes "
            "(one compile per value)",
            ", ".join(sorted(unknown)),
        )
    return n


def _is_sym(node: fx.Node) -> bool:
    return isinstance(_compat.example_value(node), (torch.SymFloat, torch.SymInt, torch.SymBool))


def _reads_symbolic_float(node: fx.Node) -> bool:
    return any(is_symbolic_float(a) for a in _flat(node.args, node.kwargs))


def _flat(args: Any, kwargs: Any) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def _describe(node: fx.Node) -> str:
    return f"{op_name(node)} ({node.name})"


class _ScalarTensors:
    """One 0-dim tensor per (symbolic float, device, dtype), made right after the float."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.tracer = fx.proxy.GraphAppendingTracer(graph)
        self._made: dict[tuple[fx.Node, Any, torch.dtype], fx.Node] = {}
        self._f64: dict[Any, fx.Node] = {}

    def get(self, x: fx.Node, device: Any, dtype: torch.dtype) -> fx.Proxy:
        key = (x, device, dtype)
        node = self._made.get(key)
        if node is None:
            t64 = self.f64(x, device)
            with self.graph.inserting_after(t64):
                node = self.graph.call_method("to", (t64, dtype))
            self._made[key] = node
        return fx.Proxy(node, self.tracer)

    def f64(self, x: fx.Node, device: Any) -> fx.Node:
        """``x`` as a float64 0-dim tensor (``zeros + x``; arithmetic on float inputs op for
        op, :func:`collage_compile.passes._common.mirrors_arithmetic`)."""
        if (x, device) not in self._f64:
            self._f64[x, device] = hyperparameter_f64(self.graph, x, device, self._f64)
        return self._f64[x, device]


def _tensor_meta(x: Any) -> tuple[Any, torch.dtype] | None:
    """(device, computation dtype) of a tensor operand, or of a list's first tensor."""
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    ex = _compat.example_value(x) if isinstance(x, fx.Node) else None
    if isinstance(ex, (list, tuple)):
        ex = ex[0] if ex else None
    if not isinstance(ex, torch.Tensor) or not ex.is_floating_point():
        return None
    dtype = torch.float64 if ex.dtype == torch.float64 else torch.float32
    return ex.device, dtype


def _rewrite(graph: fx.Graph, node: fx.Node, tensors: _ScalarTensors) -> bool | None:
    """Rewrite one consumer; True if rewritten, False if it needs nothing, None if unknown."""
    name = op_name(node)
    target = node.target
    if str(getattr(target, "__name__", "")).startswith("_foreach_"):
        return _rewrite_foreach(graph, node, name, tensors)
    args, kwargs = list(node.args), dict(node.kwargs)
    if name == "pow" and len(args) == 2 and not kwargs:
        return _rewrite_pow(graph, node, args, tensors)
    if name in ("add", "sub", "mul", "div", "truediv") and not any(
        is_symbolic_float(v) for v in kwargs.values()
    ):
        return _rewrite_arithmetic(graph, node, args, tensors)
    if name == "fma" and len(args) == 3 and not kwargs:
        return _rewrite_fma(node, args, tensors)
    if name == "lerp" and is_symbolic_float((bound := _lerp_operands(args, kwargs))[-1]):
        return _rewrite_lerp(graph, node, bound, tensors)
    if name in _ALPHA_OPS and is_symbolic_float(kwargs.get("alpha")) and len(args) == 2:
        return _rewrite_alpha(graph, node, args, kwargs, tensors)
    if name in _VALUE_OPS and len(args) in (3, 4):
        return _rewrite_value(graph, node, args, kwargs, tensors)
    if target in _SCALAR_FACTORIES and len(args) == 1 and is_symbolic_float(args[0]):
        return _rewrite_scalar_factory(graph, node, args, kwargs, tensors)
    if target in _SCALAR_FACTORIES and len(args) == 1 and _floats_list(args[0]):
        return _rewrite_list_factory(graph, node, args[0], kwargs, tensors)
    if target in _FILL_FACTORIES and len(args) == 2 and is_symbolic_float(args[1]):
        return _rewrite_fill(graph, node, args, kwargs, tensors)
    return None


def _rewrite_pow(
    graph: fx.Graph, node: fx.Node, args: list[Any], tensors: _ScalarTensors
) -> bool | None:
    """``beta ** step`` (a float base or exponent): ``torch.pow`` of its tensor."""
    base, exp = args
    other = exp if is_symbolic_float(base) else base
    meta = _tensor_meta(other)
    if meta is None:
        return None
    args = [tensors.get(a, *meta).node if is_symbolic_float(a) else a for a in args]
    return _replace(graph, node, torch.pow, tuple(args), {})


def _rewrite_arithmetic(
    graph: fx.Graph, node: fx.Node, args: list[Any], tensors: _ScalarTensors
) -> bool | None:
    """Positional operands of aten arithmetic: torch's own tensorification handles a float
    input; arithmetic on one (``grad * -lr``) becomes its mirror, which 2.11's
    tensorification would specialize (mirrors_arithmetic), in the op's computation dtype,
    as the tensorification casts it."""
    if not any(isinstance(a, fx.Node) and mirrors_arithmetic(a) for a in args):
        return False
    meta = next((m for a in args if (m := _tensor_meta(a)) is not None), None)
    if meta is None:
        return None
    node.args = tuple(
        tensors.get(a, *meta).node if isinstance(a, fx.Node) and mirrors_arithmetic(a) else a
        for a in args
    )
    _keep_dtype(graph, node, meta[1])
    return True


def _rewrite_fma(node: fx.Node, args: list[Any], tensors: _ScalarTensors) -> bool | None:
    """Dynamo's addcmul_/addcdiv_ with value=: fma(t, value, self), fused (one rounding) in
    Inductor's kernel whether b is a float or a 0-dim tensor of the same value."""
    meta = next((m for a in args if (m := _tensor_meta(a)) is not None), None)
    if meta is None:
        return None
    node.args = tuple(tensors.get(a, *meta).node if is_symbolic_float(a) else a for a in args)
    return True


def _lerp_operands(args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """``lerp(input, end, weight)`` operands however they were passed (schedule-free's
    ``p.lerp_(end=z, weight=ckp1)``); ``[None]`` for any other spelling."""
    names = ("input", "end", "weight")
    if len(args) > 3 or set(kwargs) - set(names[len(args) :]):
        return [None]
    bound = [*args, *(kwargs.get(k) for k in names[len(args) :])]
    return bound if all(x is not None for x in bound) else [None]


def _rewrite_lerp(
    graph: fx.Graph, node: fx.Node, args: list[Any], tensors: _ScalarTensors
) -> bool | None:
    """Inductor's lerp decomposition branches on the weight in Python (|w| < 1/2): that
    comparison guards on it.  Spelled out in fp32 with one rounding, as eager's first
    branch computes it (its other branch, b - (b - a) * (1 - w), can differ in the last
    fp32 bit, rarely visible after rounding to bf16)."""
    start_meta = _tensor_meta(args[0])
    ex = _compat.example_value(args[0])
    if start_meta is None:
        return None
    w = tensors.get(args[2], *start_meta)
    with graph.inserting_before(node):
        start, end = _proxy(graph, args[0]), _proxy(graph, args[1])
        f = start_meta[1]
        new = (start.to(f) + (end.to(f) - start.to(f)) * w).to(ex.dtype)
        if str(node.target).endswith("lerp_"):
            new = start.copy_(new)
    new.node.meta = dict(node.meta)
    node.replace_all_uses_with(new.node)
    graph.erase_node(node)
    return True


def _rewrite_alpha(
    graph: fx.Graph,
    node: fx.Node,
    args: list[Any],
    kwargs: dict[str, Any],
    tensors: _ScalarTensors,
) -> bool | None:
    """``add(a, b, alpha=lr)``: ``a + b * lr`` with lr a tensor."""
    meta = _tensor_meta(args[1])
    if meta is None:
        return None
    alpha = tensors.get(kwargs.pop("alpha"), *meta)
    with graph.inserting_before(node):
        scaled = (_proxy(graph, args[1]) * alpha).node
    node.args = (args[0], scaled)
    node.kwargs = kwargs
    return True


def _rewrite_value(
    graph: fx.Graph,
    node: fx.Node,
    args: list[Any],
    kwargs: dict[str, Any],
    tensors: _ScalarTensors,
) -> bool | None:
    """``addcmul(a, b, c, value=v)`` (or addcdiv): ``b * v`` with v a tensor, then the op."""
    value = args.pop(3) if len(args) == 4 else kwargs.pop("value", None)
    if not is_symbolic_float(value):
        return None
    meta = _tensor_meta(args[1])
    if meta is None:
        return None
    with graph.inserting_before(node):
        scaled = (_proxy(graph, args[1]) * tensors.get(value, *meta)).node
    node.args = (args[0], scaled, args[2])
    node.kwargs = kwargs
    return True


def _rewrite_scalar_factory(
    graph: fx.Graph,
    node: fx.Node,
    args: list[Any],
    kwargs: dict[str, Any],
    tensors: _ScalarTensors,
) -> bool | None:
    """``torch.tensor(lr)``: the float's float64 tensor, rounded once to the dtype."""
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    device = kwargs.get("device")
    if set(kwargs) - {"dtype", "device", "requires_grad"} or kwargs.get("requires_grad"):
        return None
    t64 = tensors.f64(args[0], device)
    with graph.inserting_before(node):
        new = graph.call_method("to", (t64, dtype))  # one rounding, as from the float
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def _floats_list(x: Any) -> bool:
    """A list of Python numbers and symbolic floats, at least one of them symbolic."""
    return (
        isinstance(x, (list, tuple))
        and any(is_symbolic_float(v) for v in x)
        and all(is_symbolic_float(v) or type(v) in (int, float) for v in x)
    )


def _rewrite_list_factory(
    graph: fx.Graph,
    node: fx.Node,
    values: list[Any],
    kwargs: dict[str, Any],
    tensors: _ScalarTensors,
) -> bool | None:
    """``torch.tensor([s1, s2, ...])`` (LaProp's per-tensor step sizes): the stack of each
    float's float64 tensor (a constant's too), rounded once each to the dtype."""
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    device = kwargs.get("device")
    if set(kwargs) - {"dtype", "device", "requires_grad"} or kwargs.get("requires_grad"):
        return None
    with graph.inserting_before(node):
        items = [
            tensors.f64(v, device)
            if is_symbolic_float(v)
            else graph.call_function(
                torch.full, ((), float(v)), {"dtype": torch.float64, "device": device}
            )
            for v in values
        ]
        stacked = graph.call_function(torch.stack, (items,))
        new = graph.call_method("to", (stacked, dtype))  # one rounding each, as from floats
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def _rewrite_fill(
    graph: fx.Graph,
    node: fx.Node,
    args: list[Any],
    kwargs: dict[str, Any],
    tensors: _ScalarTensors,
) -> bool | None:
    """``full_like(t, lr)``: zeros like ``t`` plus the float's tensor."""
    meta = _tensor_meta(node)
    if meta is None:
        return None
    with graph.inserting_before(node):
        base = graph.call_function(torch.zeros_like, (args[0],), kwargs)
        new = graph.call_function(operator.add, (base, tensors.get(args[1], *meta).node))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def _rewrite_foreach(
    graph: fx.Graph, node: fx.Node, name: str, tensors: _ScalarTensors
) -> bool | None:
    """A foreach op with a symbolic float operand: that float as a tensor, in the op form
    that reads it on the device (one function per form)."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if name == "pow" and len(args) == 2 and is_symbolic_float(args[0]):
        return _foreach_pow(graph, node, args, tensors)
    meta = _tensor_meta(args[0]) if args else None
    if meta is None:
        return None
    if name in ("mul", "div", "add", "sub") and len(args) == 2 and not kwargs:
        if not is_symbolic_float(args[1]):
            return None
        return _foreach_binary(graph, node, name, args, tensors.get(args[1], *meta))
    if name in _ALPHA_OPS and len(args) == 2 and is_symbolic_float(kwargs.get("alpha")):
        alpha = tensors.get(kwargs.pop("alpha"), *meta)
        with graph.inserting_before(node):
            scaled = graph.call_function(torch._foreach_mul, (args[1], alpha.node))
        node.args, node.kwargs = (args[0], scaled), kwargs
        return True
    if name in _VALUE_OPS and len(args) in (3, 4):
        value = args.pop(3) if len(args) == 4 else kwargs.pop("value", None)
        if not is_symbolic_float(value):
            return None
        with graph.inserting_before(node):
            t = tensors.get(value, *meta).node
            scaled = graph.call_function(torch._foreach_mul, (args[1], t))
        node.args, node.kwargs = (args[0], scaled, args[2]), kwargs
        return True
    if name == "lerp" and is_symbolic_float((bound := _lerp_operands(args, kwargs))[-1]):
        return _foreach_lerp(graph, node, bound, tensors.get(bound[2], *meta))
    return None


def _foreach_pow(
    graph: fx.Graph, node: fx.Node, args: list[Any], tensors: _ScalarTensors
) -> bool | None:
    """``_foreach_pow(x, exps)``, a float to tensor powers: the float's tensor expanded
    to each exponent's shape."""
    exps = args[1]
    meta = _tensor_meta(exps)
    if meta is None or not isinstance(exps, (list, tuple)):
        return None
    base = tensors.get(args[0], *meta)
    with graph.inserting_before(node):
        bases = [base.expand_as(_proxy(graph, e)).node for e in exps]
    node.args = (bases, exps)
    return True


def _foreach_binary(
    graph: fx.Graph, node: fx.Node, name: str, args: list[Any], t: fx.Proxy
) -> bool | None:
    """``_foreach_mul(xs, lr)`` and its kin, ``t`` the float's tensor."""
    if name in ("mul", "div"):  # the Tensor overload
        node.args = (args[0], t.node)
        return True
    # add/sub: the List overload, the scalar expanded to each element (functionalizing
    # _foreach_add_.Tensor under a symbolic scalar reads the scalar on the host)
    if not isinstance(args[0], (list, tuple)):
        return None
    with graph.inserting_before(node):
        items = [graph.call_method("expand_as", (t.node, x)) for x in args[0]]
    node.args = (args[0], items)
    return True


def _foreach_lerp(graph: fx.Graph, node: fx.Node, args: list[Any], w: fx.Proxy) -> bool:
    """``_foreach_lerp(a, b, w)``, ``w`` the float's tensor: a + w * (b - a), what the lerp
    decomposition computes for |w| < 1/2 (the other branch, b - (b - a) * (1 - w), differs
    in the last fp32 bit at most)."""
    inplace = str(node.target.__name__).endswith("_")
    with graph.inserting_before(node):
        diff = graph.call_function(torch._foreach_sub, (args[1], args[0]))
        step = graph.call_function(torch._foreach_mul, (diff, w.node))
        add = torch._foreach_add_ if inplace else torch._foreach_add
        new = graph.call_function(add, (args[0], step))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def _keep_dtype(graph: fx.Graph, node: fx.Node, computation: torch.dtype) -> None:
    """A 0-dim result keeps the dtype the float operand gave it: ``s * (1 - lr*wd)`` with
    ``s`` a 0-dim bf16 tensor is bf16, rounded once, where its fp32 0-dim operand would
    promote it to fp32 (as the tensorification converts its result back)."""
    ex = _compat.example_value(node)
    if not isinstance(ex, torch.Tensor) or ex.dim() != 0 or ex.dtype == computation:
        return
    with graph.inserting_after(node):
        cast = graph.call_method("to", (node, ex.dtype))
    cast.meta = dict(node.meta)
    node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)


def _proxy(graph: fx.Graph, x: fx.Node) -> fx.Proxy:
    return fx.Proxy(x, fx.proxy.GraphAppendingTracer(graph))


def _replace(
    graph: fx.Graph, node: fx.Node, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True
