"""``copy_`` of an expression of the old value, and overwrites (``copy_``, ``fill_``, ``zero_``).

Before (single-tensor Adam's second moment, as Dynamo captures it)::

    mul_1 = v.mul_(0.999)
    fma = torch.ops.prims.fma.default(g * g, 0.001, mul_1)
    copy_ = mul_1.copy_(fma)

The source is walked back to the tensor's current value through affine operations (``+``,
``-``, ``*``, ``/`` by something independent of it, ``fma``, ``addcdiv``, ``addcmul``,
``lerp`` and dtype conversions); each becomes a :class:`Step`, so the copy above is the
additive step ``+ (g*g) * 0.001``, chained with the ``mul_`` before it::

    after: (hi, lo) = grow(mul((hi, lo), 0.999), (g*g).float() * 0.001)

A source that does not read the tensor is an overwrite: the pair becomes (src, 0), so a
stale lo never leaks into a value written from elsewhere.  A source that reads the tensor in
a way not listed here is reported as not upgradable.

Why: ``x.copy_(f(x))`` is how an optimizer (or Dynamo's decomposition of one) spells an
in-place update out of place; rounding ``f(x)`` to bf16 loses the same updates ``x.add_``
would.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from collage_compile.passes._common import bind, f32, is_number, scale

from collage_compile.accumulators import Accumulator, GraphInfo, Step


class _Unsupported(Exception):
    pass


def copy_(src: Any, non_blocking: Any = False) -> None:
    """Signature of ``Tensor.copy_``."""


def fill_(value: Any) -> None:
    """Signature of ``Tensor.fill_``."""


def match(info: GraphInfo, ctx: Any) -> int:
    n = 0
    positions = {node: i for i, node in enumerate(info.gm.graph.nodes)}
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
            walker = _Walker(info, write.acc, positions, positions[write.node])
            try:
                steps = walker.steps(args[0])
            except _Unsupported:
                continue
            if steps is None:  # the source does not read the tensor
                ctx.claim(write, [Step("set", (args[0],))], pattern="copy_(overwrite)")
            else:
                ctx.claim(write, steps, pattern=f"copy_({walker.describe()})")
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


def _fma_targets() -> set[Any]:
    out: set[Any] = set()
    prims = getattr(torch.ops, "prims", None)
    if prims is not None and hasattr(prims, "fma"):
        out.add(prims.fma.default)
    return out


def _convert_targets() -> set[Any]:
    out: set[Any] = set()
    prims = getattr(torch.ops, "prims", None)
    if prims is not None and hasattr(prims, "convert_element_type"):
        out.add(prims.convert_element_type.default)
    return out


_FMA = _fma_targets()
_CONVERT = _convert_targets()


def _key(node: fx.Node) -> Any:
    return node.target


def _add_sig(input: Any, other: Any, alpha: Any = 1) -> None: ...
def _mul_sig(input: Any, other: Any) -> None: ...
def _div_sig(input: Any, other: Any, rounding_mode: Any = None) -> None: ...
def _neg_sig(input: Any) -> None: ...
def _fma_sig(a: Any, b: Any, c: Any) -> None: ...
def _addc_sig(input: Any, tensor1: Any, tensor2: Any, value: Any = 1) -> None: ...
def _lerp_sig(input: Any, end: Any, weight: Any) -> None: ...


def _product(a: Any, b: Any) -> Any:
    return f32(a) * f32(b)


def _quotient(a: Any, b: Any, value: Any = 1) -> Any:
    return scale(f32(a) / f32(b), value)


def _scaled(x: Any, factor: Any) -> Any:
    return scale(f32(x), factor)


def _addcmul_update(a: Any, b: Any, value: Any = 1) -> Any:
    return scale(f32(a) * f32(b), value)


class _Walker:
    """Walks a copy_ source back to the accumulator's current value."""

    def __init__(self, info: GraphInfo, acc: Accumulator, positions: dict[fx.Node, int], at: int):
        self.info = info
        self.acc = acc
        self.positions = positions
        self.at = at
        self.ops: list[str] = []
        self._memo: dict[fx.Node, bool] = {}

    def describe(self) -> str:
        return "->".join(self.ops) or "identity"

    def depends(self, x: Any) -> bool:
        if not isinstance(x, fx.Node):
            if isinstance(x, (list, tuple)):
                return any(self.depends(v) for v in x)
            return False
        if x in self._memo:
            return self._memo[x]
        acc, _ = self.info.accumulator_of_node(x)
        result = acc is self.acc or any(self.depends(i) for i in x.all_input_nodes)
        self._memo[x] = result
        return result

    def steps(self, expr: Any) -> list[Step] | None:
        """Steps taking the current value to ``expr``; None if ``expr`` does not read it."""
        if not self.depends(expr):
            return None
        return self._walk(expr)

    def _leaf(self, node: fx.Node) -> list[Step]:
        # The read must see the *current* value: no write to the tensor between it and copy_.
        start = self.positions[node]
        for w in self.info.writes:
            if w.acc is self.acc and start < self.positions[w.node] < self.at:
                raise _Unsupported
        return []

    def _walk(self, node: Any) -> list[Step]:
        if not isinstance(node, fx.Node):
            raise _Unsupported
        acc, full = self.info.accumulator_of_node(node)
        if acc is self.acc:
            if not full:
                raise _Unsupported
            return self._leaf(node)
        key = _key(node)
        args, kwargs = node.args, node.kwargs
        transparent = (node.op == "call_method" and key in _TRANSPARENT_METHODS) or (
            node.op == "call_function" and (key in _CONVERT or key in _TRANSPARENT_FUNCTIONS)
        )
        if transparent:
            if key == "to" and any(isinstance(a, fx.Node) for a in args[1:]):
                raise _Unsupported  # .to(other_tensor): could be a device move of a view
            return self._walk(args[0])
        if key in _ADD or key in _SUB:
            b = bind(_add_sig, args, kwargs)
            if b is None:
                raise _Unsupported
            x, y, alpha = b
            sign = 1.0 if key in _ADD else -1.0
            if self.depends(x) and not self.depends(y):
                self.ops.append("add")
                return [*self._walk(x), Step("add", (y, _signed(alpha, sign)), _scaled)]
            if self.depends(y) and not self.depends(x):
                self.ops.append("add")
                return [
                    *self._walk(y),
                    Step("mul", (_signed(alpha, sign),)),
                    Step("add", (x, 1), _scaled),
                ]
            raise _Unsupported
        if key in _MUL:
            b = bind(_mul_sig, args, kwargs)
            if b is None:
                raise _Unsupported
            x, y = b
            if self.depends(y) and not self.depends(x):
                x, y = y, x
            if self.depends(y):
                raise _Unsupported
            self.ops.append("mul")
            return [*self._walk(x), Step("mul", (y,))]
        if key in _DIV:
            b = bind(_div_sig, args, kwargs)
            if b is None or b[2] is not None or self.depends(b[1]):
                raise _Unsupported
            x, y, _ = b
            self.ops.append("div")
            if is_number(y):
                if y == 0:
                    raise _Unsupported
                return [*self._walk(x), Step("mul", (1.0 / float(y),))]
            return [*self._walk(x), Step("mul", (y,), _reciprocal)]
        if key in _NEG:
            b = bind(_neg_sig, args, kwargs)
            if b is None:
                raise _Unsupported
            self.ops.append("neg")
            return [*self._walk(b[0]), Step("mul", (-1.0,))]
        if key in _FMA:
            b = bind(_fma_sig, args, kwargs)
            if b is None:
                raise _Unsupported
            a, m, c = b
            self.ops.append("fma")
            if self.depends(c) and not self.depends(a) and not self.depends(m):
                return [*self._walk(c), Step("add", (a, m), _product)]
            if self.depends(a) and not self.depends(m) and not self.depends(c):
                return [*self._walk(a), Step("mul", (m,)), Step("add", (c, 1), _scaled)]
            raise _Unsupported
        if key in _ADDCDIV or key in _ADDCMUL:
            b = bind(_addc_sig, args, kwargs)
            if b is None:
                raise _Unsupported
            x, t1, t2, value = b
            if self.depends(t1) or self.depends(t2):
                raise _Unsupported
            self.ops.append("addcdiv" if key in _ADDCDIV else "addcmul")
            fn = _quotient if key in _ADDCDIV else _addcmul_update
            return [*self._walk(x), Step("add", (t1, t2, value), fn)]
        if key in _LERP:
            b = bind(_lerp_sig, args, kwargs)
            if b is None:
                raise _Unsupported
            x, end, weight = b
            if self.depends(end) or self.depends(weight):
                raise _Unsupported
            self.ops.append("lerp")
            return [*self._walk(x), Step("lerp", (end, weight))]
        raise _Unsupported


def _signed(alpha: Any, sign: float) -> Any:
    if sign == 1.0:
        return alpha
    return -alpha


def _reciprocal(other: Any) -> Any:
    return torch.reciprocal(f32(other))
