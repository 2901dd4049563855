"""``mode="exact"``: every upgraded tensor computes as its fp32 value, for the whole graph.

Before (AdamW single-tensor, bf16 ``p``, ``m``, ``v``; ``g`` the bf16 gradient)::

    p.mul_(1 - lr*wd)
    m.lerp_(g, 1 - b1)
    v.mul_(b2);  v.addcmul_(g, g, value=1 - b2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)

After (``*_rem`` the int16 remainders, new graph inputs; ``join``/``split`` from
:mod:`collage_compile.remainder`)::

    p32 = join(p, p_rem);  m32 = join(m, m_rem);  v32 = join(v, v_rem)
    p32.mul_(1 - lr*wd)
    m32.lerp_(g.float(), 1 - b1)
    v32.mul_(b2);  v32.addcmul_(g.float(), g.float(), value=1 - b2)
    denom = (v32.sqrt() / bc2_sqrt).add_(eps)
    p32.addcdiv_(m32, denom, value=-step_size)
    hi, rem = split(p32);  p.copy_(hi);  p_rem.copy_(rem)          # and m, v

Why: a bf16 tensor and its remainder *are* an fp32 value, so the optimizer's own ops on
that value compute what they compute on fp32 parameters and state: no pattern to match, no
rounding to keep alive (``join`` and ``split`` are integer arithmetic on bit patterns), and
a write no family understands (``torch.maximum``, a write through a view) is as exact as
any other.  Inductor lowers the ops as it lowers the fp32 step, bit for bit.

The gradients are upcast at the start (exact), as the fp32 step reads fp32 gradients, so
an op on gradients alone (Adafactor's row norms) computes in fp32 too.  A low-precision
tensor the graph makes with a factory and returns (state made on the first step, CAME's
``torch.zeros(shape, dtype=grad.dtype)``) is made in fp32, as the fp32 step makes it, and
returned with its remainder.  Each op reading a
promoted value reads every other low-precision operand upcast.  An op reading no promoted value
(a forward pass in the same graph) is left as it is.  A cast that was a no-op on the bf16
tensor (``x.to(torch.bfloat16)``) stays one; a cast to fp32 becomes a copy.  A
low-precision input the graph writes from promoted values (a gradient modified in place)
is computed in fp32 and written back rounded, as its dtype asks.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat, remainder, state
from collage_compile.accumulators import storage_key, written_nodes
from collage_compile.mcf import LOW_PRECISION

_CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16"}
_CAST_DTYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclasses.dataclass(eq=False)
class Promoted:
    """One tensor the graph computes on as fp32: its input nodes (aliases of one view),
    the node of its remainder input, and whether the graph writes it (else it only
    reads it: an EMA's parameter).  Without a remainder (a gradient, read as the fp32
    step reads its fp32 gradient) it is upcast, and written back rounded if written."""

    nodes: list[fx.Node]
    rem: fx.Node | None
    written: bool


@dataclasses.dataclass
class Promotion:
    """What :func:`run` did.  ``current(node)``: how to read a node of the original graph
    in the promoted one: an input promoted or written back -> its fp32 value (updated in
    place to the end of the graph), a cast removed -> its operand, anything else ->
    itself.  ``new_state``: the outputs (positions) that are new bf16 tensors computed in
    fp32, whose remainders the graph returns after its outputs, in that order."""

    current: Callable[[Any], Any]
    new_state: list[int]


def run(gm: fx.GraphModule, tensors: list[Promoted], fake_mode: Any) -> Promotion:
    """Promote ``tensors`` (see the module docstring)."""
    walk = _Walk(gm.graph, fake_mode)
    originals = list(walk.order)
    for t in tensors:
        walk.join(t)
    for node in originals:
        if node.op == "output":
            walk.output(node, tensors)
        elif node.op in ("call_function", "call_method"):
            walk.visit(node)
    return Promotion(walk.current, walk.new_state)


class _Walk:
    def __init__(self, graph: fx.Graph, fake_mode: Any):
        self.graph = graph
        self.fake_mode = fake_mode
        self.tracer = fx.proxy.GraphAppendingTracer(graph)
        self.env: dict[fx.Node, fx.Node] = {}  # input node -> its fp32 value now
        self.promoted: set[fx.Node] = set()  # nodes whose value is fp32 in place of bf16
        self.low: dict[fx.Node, torch.dtype] = {}  # original low dtype of promoted nodes
        self.written_back: dict[fx.Node, None] = {}  # low inputs written from fp32 values
        # the input each fp32 stand-in (or an in-place op's result on one) is the value of:
        # an output that returns it returns the input, written back
        self.alias_of: dict[fx.Node, fx.Node] = {}
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.replaced: dict[fx.Node, fx.Node] = {}  # casts removed -> their operand
        self.new_state: list[int] = []  # outputs whose remainder follows the outputs
        # an in-place op's result -> the tensor it wrote (``zeros.mul_(b)`` is ``zeros``),
        # and that tensor -> its names
        self.same: dict[fx.Node, fx.Node] = {}
        self.names: dict[fx.Node, list[fx.Node]] = {}
        self.made_as_state = _made_as_state(graph)

    def current(self, node: Any) -> Any:
        while node in self.replaced:
            node = self.replaced[node]
        return self.env.get(node, node)

    def proxy(self, n: fx.Node) -> fx.Proxy:
        return fx.Proxy(n, self.tracer)

    def join(self, t: Promoted) -> None:
        last = max([*t.nodes, *([t.rem] if t.rem is not None else [])], key=self.order.__getitem__)
        with self.graph.inserting_before(last.next):
            x = self.proxy(t.nodes[0])
            joined = (remainder.join(x, self.proxy(t.rem)) if t.rem is not None else x.float()).node
        self._mark(joined, _compat.example_value(t.nodes[0]))
        self.alias_of[joined] = t.nodes[0]
        for n in t.nodes:
            self.env[n] = joined

    def _mark(self, node: fx.Node, like: Any) -> None:
        """``node`` holds fp32 where the graph had ``like`` (a low-precision example value)."""
        self.promoted.add(node)
        self.low[node] = _dtype_of(like)
        with self.fake_mode:
            fake = _retyped(like)
        _compat.set_example_value(node, fake)
        node.meta["val"] = fake

    def visit(self, node: fx.Node) -> None:
        sub = lambda a: self.env.get(a, a)
        node.args, node.kwargs = fx.map_arg(node.args, sub), fx.map_arg(node.kwargs, sub)
        written = written_nodes(node)
        if written:
            root = self.same[node] = self.same.get(written[0], written[0])
            self.names.setdefault(root, [root]).append(node)
        if node in self.made_as_state:
            self._made_fp32(node)
            return
        if not any(i in self.promoted for i in node.all_input_nodes):
            return
        if node.op == "call_method" and node.target in _CASTS and self._cast(node):
            return
        if node.kwargs.get("dtype") in LOW_PRECISION:
            node.kwargs = {**node.kwargs, "dtype": torch.float32}
        self._upcast_operands(node)
        ex = _compat.example_value(node)
        if _is_low(ex) or (isinstance(ex, (list, tuple)) and any(_is_low(v) for v in ex)):
            self._mark(node, ex)
        if written and written[0] in self.alias_of:  # x.add_(u) returns x
            self.alias_of[node] = self.alias_of[written[0]]

    def _upcast_operands(self, node: fx.Node) -> None:
        """Every low-precision operand not yet promoted is read as fp32 (exact); one the
        node writes in place goes on as that fp32 copy, and an input is written back."""
        written = set(written_nodes(node))
        ups: dict[fx.Node, Any] = {}
        for i in node.all_input_nodes:
            ex = _compat.example_value(i)
            if i in self.promoted:
                continue
            if isinstance(ex, (list, tuple)) and any(_is_low(v) for v in ex):
                # a list-valued node (a foreach result): its elements, each upcast
                ups[i] = [self._upcast(self._item(node, i, k), v, node) for k, v in enumerate(ex)]
                continue
            if not _is_low(ex):
                continue
            ups[i] = self._upcast(i, ex, node)
            if i in written:
                # every name of the tensor (``zeros``, ``zeros.mul_(b)``) reads the copy on
                root = self.same.get(i, i)
                for n in self.names.get(root, [root]):
                    self.env[n] = ups[i]
                if i.op in ("placeholder", "get_attr"):
                    self.written_back[i] = None
                    self.alias_of[ups[i]] = i
        if ups:
            node.args = fx.map_arg(node.args, lambda a: ups.get(a, a))
            node.kwargs = fx.map_arg(node.kwargs, lambda a: ups.get(a, a))

    def _made_fp32(self, node: fx.Node) -> None:
        """A low-precision tensor the graph makes and returns (new state: CAME's
        ``torch.zeros(shape, dtype=grad.dtype)``) is made in fp32, as the fp32 step makes
        it, so that every op on it computes in fp32 and it is returned with a remainder."""
        node.kwargs = {**node.kwargs, "dtype": torch.float32}
        self._mark(node, _compat.example_value(node))

    def _upcast(self, x: fx.Node, like: Any, before: fx.Node) -> fx.Node:
        if not _is_low(like):
            return x
        with self.graph.inserting_before(before):
            up = self.graph.call_method("float", (x,))
        self._mark(up, like)
        return up

    def _item(self, before: fx.Node, x: fx.Node, k: int) -> fx.Node:
        with self.graph.inserting_before(before):
            item = self.graph.call_function(operator.getitem, (x, k))
        _compat.set_example_value(item, _compat.example_value(x)[k])
        return item

    def _cast(self, node: fx.Node) -> bool:
        """A cast of a promoted value: one that did nothing to the bf16 value does nothing
        to its fp32 one (the same alias), one to fp32 copies it; True if handled."""
        x = node.args[0]
        if x not in self.promoted:
            return False
        target = _cast_target(node, self.low)
        if target is None:
            return False
        if target == self.low[x]:
            new = x
        elif target == torch.float32:
            with self.graph.inserting_before(node):
                new = self.graph.call_function(torch.clone, (x,))
            new.meta = dict(node.meta)
        else:
            return False
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        self.replaced[node] = new
        return True

    def output(self, node: fx.Node, tensors: list[Promoted]) -> None:
        """Split every written tensor back into (hi, remainder), write back the inputs
        computed in fp32, and give the graph's outputs their own dtypes again.  The writes
        run with grad mode off where the graph turns it on again before it ends (Dynamo
        restores it after a ``no_grad`` step): with it on, a write to a weight that
        requires grad made AOTAutograd trace a training graph that dropped the write where
        the graph also returns a tensor (``state["step"] += 1``), and the weight took that
        tensor's value."""
        restores = _grad_mode_at_end(self.graph)
        with self.graph.inserting_before(node):
            if restores:  # the writes with grad off, then the mode the graph ends in
                self.graph.call_function(torch._C._set_grad_enabled, (False,))
            for t in tensors:
                if not t.written:
                    continue
                value = self.proxy(self.env[t.nodes[0]])
                if t.rem is None:
                    self.proxy(t.nodes[0]).copy_(value)  # rounded, as its dtype asks
                    continue
                hi, rem = remainder.split(value, self.low_of(t), shift=self.shifts(t.nodes[0]))
                self.proxy(t.nodes[0]).copy_(hi)
                self.proxy(t.rem).copy_(rem)
            for i in self.written_back:
                self.proxy(i).copy_(self.proxy(self.env[i]))
            if restores:
                self.graph.call_function(torch._C._set_grad_enabled, (True,))

        # a tensor the graph made in low precision (CAME's ``torch.zeros(..., dtype=
        # grad.dtype)``) and then wrote from fp32 values was written as its fp32 copy:
        # the output is that copy, not the tensor as made
        outputs = [self.env.get(a, a) if isinstance(a, fx.Node) else a for a in node.args[0]]
        rems = []
        for k, a in enumerate(outputs):
            if not isinstance(a, fx.Node) or a not in self.promoted:
                continue
            if a in self.alias_of:  # a promoted input's value: the input, written back
                outputs[k] = self.alias_of[a]
                continue
            # a new tensor (SGD's first momentum buffer, which the optimizer keeps as its
            # state): its hi, and its remainder returned after the outputs, for the
            # backend's wrapper to pair with it
            with self.graph.inserting_before(node):
                if self.low[a] == torch.bfloat16:
                    hi, rem = remainder.split(self.proxy(a), shift=self.shifts(a))
                    outputs[k] = hi.node
                    rems.append(rem.node)
                    self.new_state.append(k)
                else:
                    outputs[k] = self.graph.call_method("to", (a, self.low[a]))
        node.args = ((*outputs, *rems),)

    @staticmethod
    def shifts(node: fx.Node) -> bool:
        """Whether the split may use ``>>`` (not on a DTensor: :func:`remainder.split`)."""
        return not _compat.is_dtensor(_compat.example_value(node))

    def low_of(self, t: Promoted) -> torch.dtype:
        return _dtype_of(_compat.example_value(t.nodes[0]))


_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full}
_FACTORIES_LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
_FACTORY_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full"}


def _made_as_state(graph: fx.Graph) -> set[fx.Node]:
    """Low-precision tensors the graph makes with a factory (``torch.zeros``,
    ``zeros_like``, ``new_zeros``, ...) and returns, or writes in place, itself or through
    any view of its memory: the state an optimizer's first step creates, and temporaries
    written in place (``t = torch.zeros(..); v = t.view(..); t.add_(x)``).  Made in fp32
    from the start, every view of them is a view of the fp32 value; upcast only where a
    write from fp32 values came, a view taken before read the bf16 tensor as made (a
    review found a decay lost, and a weight left NaN by ``torch.mul(.., out=)`` through a
    view of ``torch.empty``).  A temporary only read stays as made."""
    made: dict[Any, fx.Node] = {}  # storage -> the factory that made it
    for node in graph.nodes:
        factory = (node.op == "call_function" and node.target in _FACTORIES | _FACTORIES_LIKE) or (
            node.op == "call_method" and node.target in _FACTORY_METHODS
        )
        ex = _compat.example_value(node)
        if factory and _is_low(ex) and (key := storage_key(ex)) is not None:
            made[key] = node
    if not made:
        return set()
    used: set[fx.Node] = set()
    output = next(n for n in graph.nodes if n.op == "output")
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            touched = written_nodes(node)
        elif node is output:
            touched = node.all_input_nodes
        else:
            continue
        for w in touched:
            factory = made.get(storage_key(_compat.example_value(w)))
            if factory is not None:
                used.add(factory)
    return used


def _is_low(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION


def _dtype_of(x: Any) -> torch.dtype:
    if isinstance(x, (list, tuple)):
        return next(v.dtype for v in x if _is_low(v))
    return x.dtype


def _retyped(x: Any) -> Any:
    """``x`` (a fake tensor, or a list of them) as fp32 where it is low precision."""
    if isinstance(x, (list, tuple)):
        return type(x)(_retyped(v) for v in x)
    if not _is_low(x):
        return x
    return state.empty_lo(x, torch.float32)


def _cast_target(node: fx.Node, low: dict[fx.Node, torch.dtype]) -> torch.dtype | None:
    """The dtype a cast converts to, as it was traced (None: not a dtype cast)."""
    name = node.target
    if name in _CAST_DTYPES:
        return _CAST_DTYPES[name]
    args = node.args[1:]
    if name == "type_as" and args:
        other = args[0]
        return low.get(other) or getattr(_compat.example_value(other), "dtype", None)
    dtype = node.kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    return dtype


def _grad_mode_at_end(graph: fx.Graph) -> bool:
    """Whether the graph turns grad mode on again before it ends (Dynamo restores it after
    a ``no_grad`` step): its last ``torch._C._set_grad_enabled`` call enables it."""
    calls = graph.find_nodes(op="call_function", target=torch._C._set_grad_enabled)
    return bool(calls) and calls[-1].args[:1] == (True,)
