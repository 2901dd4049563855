"""``copy_`` of an expression of the old value, and overwrites (``copy_``, ``fill_``, ``zero_``).

Before (single-tensor Adam's second moment, as Dynamo captures it)::

    mul_1 = v.mul_(0.999)
    fma = torch.ops.prims.fma.default(g * g, 0.001, mul_1)
    copy_ = mul_1.copy_(fma)

The source is walked back to the tensor's current value through affine operations (``+``,
``-``, ``*``, ``/`` by something independent of it, ``fma``, ``addcdiv``, ``addcmul``,
``lerp`` and dtype conversions) and ``torch.maximum`` / ``minimum`` / ``clamp`` (steps the pair carries exactly,
:mod:`~collage_compile.passes.maximum`); each becomes a :class:`Step`, so the copy above is the
additive step ``+ (g*g) * 0.001``, chained with the ``mul_`` before it::

    after: (hi, lo) = grow(mul((hi, lo), 0.999), (g*g).float() * 0.001)

A source that does not read the tensor is an overwrite: the pair becomes src (lo holds what
an fp32 source has beyond hi, zero for a bf16 one), so a stale lo never leaks into a value
written from elsewhere.  A source that reads the tensor in
a way not listed here is reported as not upgradable.

Why: ``x.copy_(f(x))`` is how an optimizer (or Dynamo's decomposition of one) spells an
in-place update out of place; rounding ``f(x)`` to bf16 loses the same updates ``x.add_``
would.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.accumulators import Accumulator, Element, GraphInfo, Step, flat_nodes
from collage_compile.passes._common import bind, f32, is_number, scale
from collage_compile.passes.decay import divisor_step


class _Unsupported(Exception):
    pass


def copy_(src: Any, non_blocking: Any = False) -> None:
    """Signature of ``Tensor.copy_``."""


def fill_(value: Any) -> None:
    """Signature of ``Tensor.fill_``."""


def match(info: GraphInfo, ctx: Any) -> int:
    n = 0
    for write in ctx.unclaimed():
        if not write.full_alias:
            continue
        if write.op == "zero_" and not write.args and not write.kwargs:
            ctx.claim(write, [Step("set", (0.0,))], pattern="zero_")
            n += 1
        elif write.op == "fill_":
            args = bind(fill_, write.args, write.kwargs)
            if args is not None:
                ctx.claim(write, [Step("set", args)], pattern="fill_")
                n += 1
        elif write.op == "copy_":
            args = bind(copy_, write.args, write.kwargs)
            if args is None:
                continue
            walker = _Walker(info, write.acc, info.positions[write.node])
            try:
                steps = walker.steps(args[0])
            except _Unsupported:
                continue
            if steps is None:  # the source does not read the tensor
                ctx.claim(write, [Step("set", (args[0],))], pattern="copy_(overwrite)")
            else:
                ctx.claim(
                    write,
                    steps,
                    pattern=f"copy_({walker.describe()})",
                    consumed=walker.consumed(write.node),
                )
            n += 1
    return n


# ---- expression walking -----------------------------------------------------------------

_ADD = {operator.add, torch.add, "add", torch.Tensor.add}
_SUB = {operator.sub, torch.sub, "sub", torch.Tensor.sub}
_MUL = {operator.mul, torch.mul, "mul", torch.Tensor.mul}
_DIV = {operator.truediv, torch.div, "div", torch.Tensor.div}
_NEG = {operator.neg, torch.neg, "neg", torch.Tensor.neg}
_ADDCDIV = {torch.addcdiv, "addcdiv"}
_ADDCMUL = {torch.addcmul, "addcmul"}
_LERP = {torch.lerp, "lerp"}
_MAXIMUM = {torch.maximum, "maximum"}
_MINIMUM = {torch.minimum, "minimum"}
_CLAMP = {torch.clamp, torch.clip, "clamp", "clip"}
_TRANSPARENT_METHODS = {
    "float",
    "bfloat16",
    "half",
    "double",
    "to",
    "type_as",
    "detach",
    "clone",
    "contiguous",
}
_TRANSPARENT_FUNCTIONS = {torch.clone, torch.detach}


# Looked up when a graph is matched, not at import: ``torch.ops.prims`` has no ``fma``
# until ``torch._prims`` is imported, and a set computed earlier stayed empty, after which
# plus mode left AdamW's second moment (written through ``prims.fma``) uncompensated.
@functools.cache
def _prim(name: str) -> Any:
    import torch._prims  # registers the prims ops

    return getattr(torch.ops.prims, name).default


def _add_sig(input: Any, other: Any, alpha: Any = 1) -> None: ...
def _mul_sig(input: Any, other: Any) -> None: ...
def _div_sig(input: Any, other: Any, rounding_mode: Any = None) -> None: ...
def _neg_sig(input: Any) -> None: ...
def _fma_sig(a: Any, b: Any, c: Any) -> None: ...
def _addc_sig(input: Any, tensor1: Any, tensor2: Any, value: Any = 1) -> None: ...
def _lerp_sig(input: Any, end: Any, weight: Any) -> None: ...
def _max_sig(input: Any, other: Any) -> None: ...
def _clamp_sig(input: Any, min: Any = None, max: Any = None) -> None: ...


def _product(a: Any, b: Any) -> Any:
    return f32(a) * f32(b)


def _quotient(a: Any, b: Any, value: Any = 1) -> Any:
    return scale(f32(a) / f32(b), value)


def _scaled(x: Any, factor: Any) -> Any:
    return scale(f32(x), factor)


def _addcmul_update(a: Any, b: Any, value: Any = 1) -> Any:
    return scale(f32(a) * f32(b), value)


def reads_tensor(info: GraphInfo, acc: Accumulator, x: Any) -> bool:
    """Whether ``x`` (a node, an element of a foreach list, a constant) is computed from
    ``acc`` through any view of its storage (an element: from its whole list)."""
    return _Walker(info, acc, len(info.positions)).depends(x.node if isinstance(x, Element) else x)


class _Walker:
    """Walks a copy_ source back to the accumulator's current value.

    The emitted chain applies the steps to the tensor's value *at the copy_* and reads the
    other operands then, so the walk is refused unless that is what the source computed:
    the tensor is not written between the node reading it and the copy_, a node on the path
    is not written between its definition and its reader (``t = 2*p; t.add_(g)``), and an
    operand is not written between its reader and the copy_ (``s = p + g; g.zero_()``).
    """

    def __init__(self, info: GraphInfo, acc: Accumulator, at: int):
        self.info = info
        self.acc = acc
        self.at = at
        self.ops: list[str] = []
        self.path: list[fx.Node] = []  # the nodes the successful walk went through
        self._memo: dict[fx.Node, bool] = {}

    def describe(self) -> str:
        return "->".join(self.ops) or "identity"

    def consumed(self, write: fx.Node) -> frozenset[fx.Node]:
        """The walked nodes, if nothing but the walk and the write uses any of them (they
        are then removed with the write); else none."""
        allowed = {*self.path, write}
        if all(set(n.users) <= allowed for n in self.path):
            return frozenset(self.path)
        return frozenset()

    def depends(self, x: Any) -> bool:
        """Whether ``x`` reads the tensor (through any view of its storage)."""
        if not isinstance(x, fx.Node):
            if isinstance(x, (list, tuple)):
                return any(self.depends(v) for v in x)
            return False
        if x not in self._memo:
            self._memo[x] = any(a is self.acc for a, _ in self.info.accumulators_of_node(x)) or any(
                self.depends(i) for i in x.all_input_nodes
            )
        return self._memo[x]

    def steps(self, expr: Any) -> list[Step] | None:
        """Steps taking the current value to ``expr``; None if ``expr`` does not read it."""
        if not self.depends(expr):
            return None
        return self._walk(expr, self.at)

    def _operand(self, x: Any, reader: int) -> None:
        for n in flat_nodes(x):
            if self.info.written_between(n, reader, self.at):
                raise _Unsupported

    def _walk(self, node: Any, reader: int) -> list[Step]:
        """Steps for ``node`` as read at position ``reader``."""
        if not isinstance(node, fx.Node):
            raise _Unsupported
        accs = self.info.accumulators_of_node(node)
        if any(a is self.acc for a, _ in accs):
            if accs != [(self.acc, True)] or self.info.written_between(node, reader, self.at):
                raise _Unsupported  # a view of it, or a value older than the copy_'s
            return []
        here = self.info.positions[node]
        if accs or self.info.written_between(node, here, reader):
            raise _Unsupported  # another persistent tensor, or a temporary changed in place
        for label, path, steps, operands in self._rules(node):
            if not self.depends(path):
                continue
            mark, path_mark = len(self.ops), len(self.path)
            try:
                inner = self._walk(path, here)
                self._operand(operands, here)
            except _Unsupported:
                del self.ops[mark:]
                del self.path[path_mark:]
                continue
            if label:
                self.ops.append(label)
            self.path.append(node)
            return [*inner, *steps]
        raise _Unsupported

    def _rules(self, node: fx.Node) -> Iterator[tuple[str, Any, list[Step], tuple[Any, ...]]]:
        """(label, path operand, steps applied after it, other operands) for each way
        ``node`` can be read as an affine function of one of its operands."""
        args, kwargs = node.args, node.kwargs
        if self._transparent(node):
            yield "", args[0], [], tuple(args[1:]) + tuple(kwargs.values())
            return
        rule = _rule_of(node.target)
        if rule is not None:
            signature, reads = rule
            b = bind(signature, args, kwargs)
            if b is not None:
                yield from reads(node.target, b)

    def _transparent(self, node: fx.Node) -> bool:
        """A dtype conversion (or copy) that changes no value on the path: the result is
        fp32/fp64 or the tensor's own dtype, on the tensor's device."""
        key = node.target
        if not (
            (node.op == "call_method" and key in _TRANSPARENT_METHODS)
            or (
                node.op == "call_function"
                and (key == _prim("convert_element_type") or key in _TRANSPARENT_FUNCTIONS)
            )
        ):
            return False
        if key in ("to", "type_as") and any(isinstance(a, fx.Node) for a in node.args[1:]):
            return False  # .to(other): a dtype/device read off another tensor
        ex = _compat.example_value(node)
        return (
            isinstance(ex, torch.Tensor)
            and ex.dtype in (torch.float32, torch.float64, self.acc.dtype)
            and ex.device == self.acc.example.device
        )


def _neg_scaled(x: Any, factor: Any) -> Any:
    return -_scaled(x, factor)


def _factor_steps(alpha: Any, negate: bool) -> list[Step]:
    """Multiplication by ``alpha`` (or ``-alpha``); alpha may be a graph node (symbolic)."""
    if is_number(alpha):
        return [Step("mul", (-alpha if negate else alpha,))]
    return [Step("mul", (alpha,)), *([Step("mul", (-1.0,))] if negate else [])]


# one reading per op family: (label, path operand, steps after it, other operands) for each
# operand the op is affine in, given its bound arguments
Reading = Iterator[tuple[str, Any, list[Step], tuple[Any, ...]]]


def _add_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, y, alpha = b
    sub = key in _SUB
    yield "add", x, [Step("add", (y, alpha), _neg_scaled if sub else _scaled)], (y, alpha)
    yield "add", y, [*_factor_steps(alpha, sub), Step("add", (x, 1), _scaled)], (x, alpha)


def _mul_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, y = b
    yield "mul", x, [Step("mul", (y,))], (y,)
    yield "mul", y, [Step("mul", (x,))], (x,)


def _div_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, y, rounding_mode = b
    step = divisor_step(y) if rounding_mode is None else None
    if step is not None:
        yield "div", x, [step], (y,)


def _neg_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    yield "neg", b[0], [Step("mul", (-1.0,))], ()


def _fma_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    a, m, c = b
    yield "fma", c, [Step("add", (a, m), _product)], (a, m)
    yield "fma", a, [Step("mul", (m,)), Step("add", (c, 1), _scaled)], (m, c)
    yield "fma", m, [Step("mul", (a,)), Step("add", (c, 1), _scaled)], (a, c)


def _addc_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, t1, t2, value = b
    fn = _quotient if key in _ADDCDIV else _addcmul_update
    label = "addcdiv" if key in _ADDCDIV else "addcmul"
    yield label, x, [Step("add", (t1, t2, value), fn)], (t1, t2, value)


def _lerp_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, end, weight = b
    yield "lerp", x, [Step("lerp", (end, weight))], (end, weight)


def _max_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, y = b  # not affine, but a step the pair carries exactly (passes/maximum.py)
    kind, label = ("max", "maximum") if key in _MAXIMUM else ("min", "minimum")
    yield label, x, [Step(kind, (y,))], (y,)
    yield label, y, [Step(kind, (x,))], (x,)


def _clamp_readings(key: Any, b: tuple[Any, ...]) -> Reading:
    x, low, high = b  # a maximum, then a minimum (torch's order)
    bounds = [(kind, y) for kind, y in (("max", low), ("min", high)) if y is not None]
    if bounds:
        yield "clamp", x, [Step(kind, (y,)) for kind, y in bounds], tuple(y for _, y in bounds)


_READINGS = (
    (_ADD | _SUB, _add_sig, _add_readings),
    (_MUL, _mul_sig, _mul_readings),
    (_DIV, _div_sig, _div_readings),
    (_NEG, _neg_sig, _neg_readings),
    (_ADDCDIV | _ADDCMUL, _addc_sig, _addc_readings),
    (_LERP, _lerp_sig, _lerp_readings),
    (_MAXIMUM | _MINIMUM, _max_sig, _max_readings),
    (_CLAMP, _clamp_sig, _clamp_readings),
)


def _rule_of(key: Any) -> tuple[Callable[..., Any], Callable[..., Reading]] | None:
    """The signature to bind an op's arguments to and its readings (None: not affine)."""
    for keys, signature, readings in _READINGS:
        if key in keys:
            return signature, readings
    if key == _prim("fma"):
        return _fma_sig, _fma_readings
    return None


# ---- an update computed and returned, not written -----------------------------------------


def returned_updates(info: GraphInfo) -> list[tuple[Accumulator, str]]:
    """Low-precision inputs whose new value a graph that writes nothing computes and
    returns, without autograd, as an average: ``b * avg + (1 - b) * p`` with
    ``0.9 <= b < 1``, or a lerp.
    Outside the graph, code the compiler never saw writes it back in plain low precision
    (``AveragedModel(avg_fn=...)``: ``update_parameters`` breaks its graph, and only
    ``avg_fn`` is compiled), so the average is not compensated: the caller names it.
    [(input, the walk that reads the output as its update)]."""
    if info.writes:
        return []
    out = next(iter(info.gm.graph.find_nodes(op="output")))
    end = len(info.positions)
    found: list[tuple[Accumulator, str]] = []
    for node in flat_nodes(out.args):
        ex = _compat.example_value(node)
        if not isinstance(ex, torch.Tensor) or ex.dtype not in (torch.bfloat16, torch.float16):
            continue
        if ex.requires_grad:  # a forward pass's output (an average is computed without)
            continue
        for acc in info.accumulators:
            if acc.dtype != ex.dtype or acc.example.shape != ex.shape:
                continue
            if _lerp_spelled_out(info, acc, node):
                found.append((acc, "add(x, (p - x) * w)"))
                break
            walker = _Walker(info, acc, end)
            try:
                steps = walker.steps(node)
            except _Unsupported:
                continue
            if steps and any(map(_averaging, steps)):
                found.append((acc, walker.describe()))
                break
    return found


def _lerp_spelled_out(info: GraphInfo, acc: Accumulator, node: fx.Node) -> bool:
    """``x + (p - x) * w`` or ``x + (p - x) / d`` of the input ``acc`` (a running mean:
    ``get_swa_avg_fn``), with ``p`` and the weight not reading it."""
    if node.op != "call_function" or node.target not in _ADD or len(node.args) != 2:
        return False
    x, scaled = node.args
    if not (isinstance(x, fx.Node) and _is_input(info, acc, x) and isinstance(scaled, fx.Node)):
        return False
    if scaled.op != "call_function" or scaled.target not in _MUL | _DIV or len(scaled.args) != 2:
        return False
    diff, weight = scaled.args
    if not (isinstance(diff, fx.Node) and diff.target in _SUB and len(diff.args) == 2):
        return False
    p, x2 = diff.args
    walker = _Walker(info, acc, len(info.positions))
    return x2 is x and not walker.depends(p) and not walker.depends(weight)


def _is_input(info: GraphInfo, acc: Accumulator, node: fx.Node) -> bool:
    ex = _compat.example_value(node)
    return node is acc.node or (
        isinstance(ex, torch.Tensor)
        and any(a is acc and whole for a, whole in info.accumulators_of(ex))
    )


def _averaging(step: Step) -> bool:
    """A lerp, or a decay by a constant factor in [0.9, 1): how an average moves."""
    if step.kind == "lerp":
        return True
    return step.kind == "mul" and is_number(step.args[0]) and 0.9 <= float(step.args[0]) < 1.0
