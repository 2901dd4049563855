"""A chain of the same arithmetic as an earlier one, emitted without building its nodes.

A foreach optimizer's step over N tensors rewrites into N chains that differ only in the
tensors they read.  Building each chain's twenty-odd nodes with fx proxies and outlining
them into one ``collage::chain`` call (:func:`fuse.outline`) was two thirds of the rewrite's
time, and the rewrite is what a second optimizer's compile, or a warm one, adds to plain
Inductor's (docs/speed.md).  A chain whose *plan* equals an earlier chain's is that chain's
arithmetic on other inputs: :func:`fuse.call_again` makes its call directly, with its
inputs where the earlier chain had them.

The plan is everything the chain's construction reads: the arithmetic, the storage dtype,
whether the stores round, the grad mode, each step's kind and update function (by
identity), and each operand: a constant by type and value, a graph value by its example's
type, dtype, rank, device, ``requires_grad``, symbolic-ness and exactness mark
(:func:`passes._common.is_exact_f64`), or as a repeat of an earlier operand.  A chain with
an operand the emission itself built (an EMA's ``hi + lo`` read, a list's element) has no
plan.  The second chain of a plan is still built in full and compared with the first (the
same arithmetic, the same inputs in the same places): only a plan that passed is reused,
and one that failed is never reused.  ``tests/test_fuse.py`` compiles steps both ways and
compares the graphs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat, fuse
from collage_compile.passes._common import _EXACT_F64, is_symbolic_float

__all__ = ["Reuse"]

ENABLED = True  # tests turn it off to compare the graphs built without it


class _NoPlan(Exception):
    pass


@dataclasses.dataclass
class _Template:
    structure: str
    slots: list[int]  # each call input's index among the plan's slots
    checked: bool = False


Plan = tuple[tuple[Any, ...], list[fx.Node]]  # (key, slot nodes: hi, lo, then operands)


class Reuse:
    """The plans of one emission and what each made.  ``known(node)``: whether ``node``
    existed before the emission (or is a hoisted scalar), the only operands a plan holds."""

    def __init__(self, known: Callable[[fx.Node], bool]):
        self._known = known
        self._templates: dict[tuple[Any, ...], _Template | None] = {}

    def plan(
        self, hi: fx.Node, lo: fx.Node, steps: Sequence[tuple[str, Any, Any]], head: tuple[Any, ...]
    ) -> Plan | None:
        """The plan of a chain on (``hi``, ``lo``) of ``steps`` (kind, operands as proxies,
        update); ``head``: the arithmetic, dtype, rounding and grad mode.  None: no plan."""
        if not ENABLED:
            return None
        slots = [hi, lo]
        try:
            parts = [head, _node(hi), _node(lo)]
            for kind, operands, update in steps:
                parts.append((kind, update, self._operand(operands, slots)))
        except (_NoPlan, TypeError):  # TypeError: an unhashable update function
            return None
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key, slots

    def call(
        self, graph: fx.Graph, plan: Plan, grad_enabled: bool, group: int
    ) -> list[fx.Node] | None:
        """The outputs of the call an earlier chain of ``plan`` made, on this chain's
        inputs, at the insertion point; None when this chain is to be built in full."""
        key, slots = plan
        t = self._templates.get(key)
        if t is None or not t.checked:
            return None
        inputs = [slots[i] for i in t.slots]
        return fuse.call_again(graph, t.structure, inputs, grad_enabled, group)

    def learn(self, plan: Plan, outlined: fuse.Outlined | None) -> None:
        """Record what the full build of a chain of ``plan`` made."""
        key, slots = plan
        made = _template(outlined, slots)
        if key not in self._templates:
            self._templates[key] = made
            return
        t = self._templates[key]
        if t is None or t.checked:
            return
        same = made is not None and (made.structure, made.slots) == (t.structure, t.slots)
        if same:
            t.checked = True
        else:
            self._templates[key] = None

    def _operand(self, x: Any, slots: list[fx.Node]) -> Any:
        if isinstance(x, fx.Proxy):
            n = x.node
            if n in slots:
                return ("again", slots.index(n))
            if not self._known(n):
                raise _NoPlan
            slots.append(n)
            return _node(n)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(self._operand(v, slots) for v in x))
        if isinstance(x, float):
            return ("float", x.hex())
        if x is None or isinstance(x, (bool, int, str, torch.dtype, torch.device)):
            return (type(x).__name__, repr(x))
        raise _NoPlan


def _node(n: fx.Node) -> tuple[Any, ...]:
    ex = _compat.example_value(n)
    exact = bool(n.meta.get(_EXACT_F64))
    if isinstance(ex, torch.Tensor):
        return ("tensor", ex.dtype, ex.dim(), str(ex.device), ex.requires_grad, exact)
    if isinstance(ex, (torch.SymInt, torch.SymFloat)):
        return ("symbolic", type(ex).__name__, is_symbolic_float(n), exact)
    if isinstance(ex, (bool, int, float)):
        return ("number", type(ex).__name__, repr(ex), exact)
    raise _NoPlan


def _template(outlined: fuse.Outlined | None, slots: list[fx.Node]) -> _Template | None:
    if not outlined:
        return None
    index = {}
    for i, n in enumerate(slots):
        index.setdefault(n, i)
    if not all(n in index for n in outlined.inputs):
        return None
    return _Template(outlined.structure, [index[n] for n in outlined.inputs])
