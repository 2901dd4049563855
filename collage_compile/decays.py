"""A scheduled decay that ``mode="plus"`` classified below its threshold, watched at run time.

Plus carries decay-style state ``x = b*x + ...`` with ``b >= plus_min_decay`` and reads
``b`` when the graph is compiled (:mod:`collage_compile.modes`).  A ``b`` that changes from
step to step (a beta2 warmup from 0.95 to 0.999, set in ``param_groups``) is a graph input,
compiled once: a tensor left plain at 0.95 stays plain at 0.999, where bf16 rounds the
decay away (``bf16(0.999) == 1``), and the graph is never compiled again to say so.  Each
such decay is evaluated on every call from the graph's own inputs (a few Python float
operations, no device read) and, once it reaches the threshold, named with the tensors
it left.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile.passes._common import is_number

# value_of(i): the float the graph's i-th input holds on this call
ValueOf = Callable[[int], float]
_ARITHMETIC: dict[Any, Callable[..., float]] = {
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.truediv: operator.truediv,
    operator.neg: operator.neg,
    torch.sym_float: float,
}


class DecayWatch:
    """One scheduled decay factor and the tensors plus left for its compile-time value."""

    def __init__(self, evaluate: Callable[[ValueOf], float], at_compile: float):
        self.evaluate, self.at_compile = evaluate, at_compile
        self.names: list[str] = []
        self.said = False

    def check(self, value_of: ValueOf, threshold: float) -> None:
        if self.said:
            return
        b = self.evaluate(value_of)
        if threshold <= b < 1.0:
            self.said = True
            _name(self, b, threshold)


def _name(watch: DecayWatch, b: float, threshold: float) -> None:
    from collage_compile.diagnostics import CollageWarning

    warnings.warn(
        f"collage: mode='plus' left {', '.join(watch.names)} in plain low precision when "
        f"its decay was {watch.at_compile:g}, below plus_min_decay={threshold:g}; the decay "
        f"is scheduled (a graph input, compiled once) and is {b:g} now: bf16 rounds away "
        "part of each step's decay (all of it above 0.998). Use mode='all', which carries "
        "such state whatever its decay, or a plus_min_decay at or below the schedule's "
        "first value.",
        CollageWarning,
        stacklevel=4,
    )


def watch_for(
    node: Any, is_lerp_weight: bool, placeholders: list[fx.Node], at_compile: float
) -> DecayWatch | None:
    """A watch of the decay ``node`` (a lerp's weight ``w``: the decay is ``1 - w``), or
    None when it is not a function of the graph's float inputs this module evaluates."""
    index = {n: i for i, n in enumerate(placeholders)}
    inputs: list[int] = []
    fn = _evaluator(node, index, inputs)
    if fn is None or not inputs:
        return None
    evaluate = (lambda v: 1.0 - fn(v)) if is_lerp_weight else fn
    return DecayWatch(evaluate, at_compile)


def _evaluator(
    x: Any, index: dict[fx.Node, int], inputs: list[int], depth: int = 0
) -> Callable[[ValueOf], float] | None:
    """``x`` (a number, or a node over the graph's float inputs) as a function of them."""
    if is_number(x):
        c = float(x)
        return lambda v: c
    if not isinstance(x, fx.Node) or depth > 8:
        return None
    if x.op == "placeholder" and x in index:
        i = index[x]
        inputs.append(i)
        return lambda v: v(i)
    if x.op == "call_method" and x.target == "item" and len(x.args) == 1:
        return _evaluator(x.args[0], index, inputs, depth + 1)
    op = _ARITHMETIC.get(x.target) if x.op == "call_function" else None
    if op is None or x.kwargs:
        return None
    parts = [_evaluator(a, index, inputs, depth + 1) for a in x.args]
    if any(p is None for p in parts):
        return None
    return lambda v: op(*(p(v) for p in parts))  # type: ignore[misc]


def check_all(watches: Sequence[DecayWatch], args: Sequence[Any], threshold: float) -> None:
    """Each watch on the floats of this call's ``args`` (CPU scalars or Python numbers)."""
    for w in watches:
        w.check(lambda i: _host_float(args[i]), threshold)


def _host_float(x: Any) -> float:
    """A float input's value, never read from a device (NaN there: no check, no sync)."""
    if isinstance(x, torch.Tensor):
        return float(x) if x.device.type == "cpu" and x.numel() == 1 else float("nan")
    return float(x) if isinstance(x, (int, float)) else float("nan")
