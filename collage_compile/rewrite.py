"""Emit MCF code for the claimed writes: lo inputs, chains of steps, and the old nodes' removal.

Consecutive writes to one tensor with nothing reading it in between form a *chain* (AdamW:
``p.mul_(1-lr*wd)`` then ``p.addcdiv_(m, d)``).  A chain is emitted once, just before its last
write: the pair is loaded, every step applied in MCF arithmetic, the result rounded into
(hi, lo) once and written back with ``copy_``.  AOTAutograd then functionalizes the copies and
Inductor fuses the chain into the kernel that already computes the update.

A chain is closed early when something reads the tensor (the reader must see the rounded
hi; a ``copy_`` source expression used only by its ``copy_`` does not count: it is removed
with the write), or when an operand of one of its steps is written before the chain would be emitted
(emission reads operands late).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat, fuse, mcf, reuse, state
from collage_compile.accumulators import (
    _PER_ELEMENT_SCALAR_TENSOR,
    VIEW_METHODS,
    Accumulator,
    Element,
    GraphInfo,
    Site,
    Step,
    Write,
    fetch_attr,
    flat_nodes,
    read_nodes,
    written_nodes,
    written_slots,
)
from collage_compile.passes._common import (
    f32,
    hyperparameter_device,
    hyperparameter_f64,
    is_exact_f64,
    is_number,
    is_scalar,
    is_symbolic_float,
    scalar_f64,
)

# ---- the chain arithmetic, a plain torch function (eager or traced) ---------------------


def mcf_chain(
    hi: Any,
    lo: Any,
    steps: list[tuple[str, tuple[Any, ...], Any]],
    arithmetic: str,
    dtype: torch.dtype | None = None,
    *,
    stored: bool = False,
) -> tuple[Any, Any]:
    """Apply ``steps`` (``(kind, args, fn)`` with resolved operands) to the pair (hi, lo).

    Returns the new (hi, lo) in the storage dtype (``hi.dtype`` unless given; a proxy has
    none).  Used eagerly by tests and traced with fx proxies by the rewrite.  ``stored``:
    the result is only stored, not read again in fp32 (see :func:`mcf.dw_to_pair`).
    """
    dtype = dtype or hi.dtype
    if arithmetic == "fp32":
        s, e = mcf.dw_from_pair(hi, lo, dtype)
        for kind, args, fn in steps:
            s, e = _fp32_step(hi, s, e, kind, args, fn)
        return mcf.dw_to_pair(s, e, dtype, stored=stored)
    if arithmetic == "storage":
        a, r = mcf.load_pair(hi, lo, dtype)
        for kind, args, fn in steps:
            a, r = _storage_step(hi, a, r, kind, args, fn, dtype)
        return a.to(dtype), r.to(dtype)
    raise ValueError(f"unknown arithmetic {arithmetic!r}")


def _fp32_step(hi: Any, s: Any, e: Any, kind: str, args: Any, fn: Any) -> tuple[Any, Any]:
    """One step on the fp32 double-word (s, e); ``hi`` gives shapes and the storage dtype."""
    if kind == "add":
        return mcf.dw_add(s, e, fn(*args))
    if kind == "mul":
        return mcf.dw_mul(s, e, *_factor_and_change(hi, args, fn))
    if kind == "div":
        return mcf.dw_div(s, e, f32(args[0]))
    if kind == "lerp":
        end, weight = args
        return mcf.dw_add(s, e, ((f32(end) - s) - e) * f32(weight))
    if kind == "set":
        return _set_value(hi, args[0]), torch.zeros_like(hi, dtype=torch.float32)
    if kind in _BOUNDS:
        return _BOUNDS[kind](s, e, _max_operand(hi, args[0]))
    raise ValueError(f"unknown step kind {kind!r}")


def _storage_step(
    hi: Any, a: Any, r: Any, kind: str, args: Any, fn: Any, dtype: torch.dtype
) -> tuple[Any, Any]:
    """One step of the paper's arithmetic on (a, r), fp32 tensors holding ``dtype`` values."""
    if kind == "add":
        u = fn(*args)
        if not _is_tensor(u):  # a Python scalar added to every element
            u = torch.full_like(a, float(u)) if is_number(u) else f32(u)
        return mcf.storage_add(a, r, u, dtype)
    if kind == "mul":
        c_hi, c_lo = _factor_storage(hi, args, fn, dtype)
        return mcf.storage_mul(a, r, c_hi, c_lo, dtype)
    if kind == "div":
        return mcf.storage_div(a, r, f32(args[0]), dtype)
    if kind == "lerp":
        end, weight = args
        return mcf.storage_add(a, r, ((f32(end) - a) - r) * f32(weight), dtype)
    if kind == "set":
        return mcf.round_to(_set_value(hi, args[0]), dtype), torch.zeros_like(
            hi, dtype=torch.float32
        )
    if kind in _BOUNDS:  # y rounded to storage first, as every storage operand is
        return _BOUNDS[kind](a, r, mcf.round_to(_max_operand(hi, args[0]), dtype))
    raise ValueError(f"unknown step kind {kind!r}")


def trace_steps(hi: Any, steps: list[tuple[str, tuple[Any, ...], Any]]) -> list[tuple[str, Any]]:
    """Each step's operands in fp32, whatever the arithmetic: the update as the optimizer
    computed it, before any rounding into storage (what ``metrics.intended_delta`` reads).
    Shares its nodes with :func:`mcf_chain`'s (the compiler's CSE merges the repeats)."""
    out: list[tuple[str, Any]] = []
    for kind, args, fn in steps:
        if kind == "add":
            u = fn(*args)
            out.append(("add", (f32(u) if _is_tensor(u) else u,)))
        elif kind == "mul":
            out.append(("mul", _factor_fp32(hi, args, fn)))
        elif kind == "div":
            out.append(("div", (f32(args[0]),)))
        elif kind == "lerp":
            out.append(("lerp", (f32(args[0]), f32(args[1]))))
        elif kind == "set":
            out.append(("set", (_set_value(hi, args[0]),)))
        elif kind in _BOUNDS:
            out.append((kind, (_max_operand(hi, args[0]),)))
        else:
            raise ValueError(f"unknown step kind {kind!r}")
    return out


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, fx.Proxy) and not is_scalar(x))


def _set_value(hi: Any, src: Any) -> Any:
    if _is_tensor(src) or (is_scalar(src) and isinstance(src, fx.Proxy)):
        return f32(src).expand_as(hi)
    return torch.full_like(hi, float(src), dtype=torch.float32)


# steps that bound the value (a maximum, a minimum: a clamp is one of each), exact on a pair
_BOUNDS = {"max": mcf.pair_max, "min": mcf.pair_min}


def _max_operand(hi: Any, y: Any) -> Any:
    """The ``y`` of a maximum or minimum in fp32, a tensor of ``hi``'s shape (a number
    fills one)."""
    return torch.full_like(hi, float(y), dtype=torch.float32) if is_number(y) else f32(y)


def _split_symbolic(hi: Any, c: Any) -> tuple[Any, Any]:
    """A symbolic Python scalar (``1 - lr*wd`` once lr is scheduled) as an fp32 pair, split
    at run time in float64: a Veltkamp split (sigma = 2^29 + 1) leaves a 24-bit head, so
    both casts to fp32 are exact and no compiler pass can drop them."""
    return _split_f64(scalar_f64(c))


def _split_f64(c64: Any) -> tuple[Any, Any]:
    """A float64 0-dim tensor as an fp32 pair (see :func:`_split_symbolic`)."""
    t = c64 * float(2**29 + 1)
    head = t - (t - c64)
    return head.float(), (c64 - head).float()


def _factor_fp32(hi: Any, args: tuple[Any, ...], fn: Any) -> tuple[Any, Any]:
    c = fn(*args) if fn is not None else args[0]
    if is_exact_f64(c):
        return _split_f64(c)
    if _is_tensor(c):
        return c.float(), 0.0
    if isinstance(c, fx.Proxy):
        return _split_symbolic(hi, c)
    return mcf.split_constant(float(c), torch.float32)


def _factor_and_change(hi: Any, args: tuple[Any, ...], fn: Any) -> tuple[Any, Any]:
    """A decay's factor c and its change c - 1, in fp32 (:func:`mcf.dw_mul`)."""
    c = fn(*args) if fn is not None else args[0]
    if _is_tensor(c):
        # exact for c in [1/2, 2] (Sterbenz), every decay; elsewhere rounded relative to it;
        # a float64 hyperparameter (a scheduled 1 - lr*wd) takes c - 1 in float64 first
        return c.float(), (c - 1.0).float()
    if isinstance(c, fx.Proxy):
        c64 = scalar_f64(c)
        return c64.float(), (c64 - 1.0).float()
    return mcf.constant_factor(float(c))


def _factor_storage(hi: Any, args: tuple[Any, ...], fn: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    c = fn(*args) if fn is not None else args[0]
    if _is_tensor(c) or isinstance(c, fx.Proxy):
        if is_exact_f64(c):
            c32, c32_lo = _split_f64(c)
        else:
            c32, c32_lo = (c.float(), 0.0) if _is_tensor(c) else _split_symbolic(hi, c)
        c_hi = mcf.round_to(c32, dtype)
        return c_hi, mcf.round_to((c32 - c_hi) + c32_lo, dtype)
    try:
        return mcf.split_constant(float(c), dtype)
    except OverflowError:
        # beyond the storage range: multiply by the fp32 constant, as eager bf16 does
        return mcf.split_constant(float(c), torch.float32)[0], 0.0


# ---- claiming -----------------------------------------------------------------------------


class MatchContext:
    """Hands the pattern families the writes still unclaimed and records what they claim."""

    def __init__(self, info: GraphInfo):
        self.info = info
        self.sites: dict[Write, Site] = {}
        # (tensor, decay node, a lerp's weight?) plus left for a decay a schedule changes
        self.scheduled_decays: list[tuple[Accumulator, fx.Node, bool]] = []

    def unclaimed(self) -> Iterator[Write]:
        for w in self.info.writes:
            if (
                w.acc.eligible
                and w not in self.sites
                and w.full_alias
                and isinstance(w.target, fx.Node)  # not an element of a list-valued node
            ):
                yield w

    def claim(
        self,
        write: Write,
        steps: list[Step],
        pattern: str,
        consumed: frozenset[fx.Node] = frozenset(),
    ) -> None:
        if write in self.sites:
            raise AssertionError(f"write {write.node} claimed twice")
        if any(self._scaled_by_itself(write.acc, s) for s in steps):
            return  # left as written: reported as not upgraded, lo restarts after it
        self.sites[write] = Site(write, steps, pattern, consumed)

    def _scaled_by_itself(self, acc: Accumulator, step: Step) -> bool:
        """A ``mul``/``div`` whose factor has a shape and is computed from the tensor it
        scales (a max-norm constraint, ``p.div_(p.norm(dim=1, keepdim=True) + c)``): a
        renormalization, not a decay.  Rewritten, such a factor made Inductor's C++ loop
        fusion fail (``KeyError: 'buf1'``, torch 2.13) where the graph as written compiles,
        so it is left as written (named; lo restarts).  A 0-dim factor (``p / p.norm()``)
        is carried."""
        if step.kind not in ("mul", "div") or not step.args:
            return False
        factor = step.args[0]
        if not isinstance(factor, fx.Node):
            return False
        ex = _compat.example_value(factor)
        if not isinstance(ex, torch.Tensor) or ex.dim() == 0:
            return False
        seen, todo = set(), [factor]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if any(a is acc for a, _ in self.info.accumulators_of_node(node)):
                return True
            todo.extend(node.all_input_nodes)
        return False


# ---- emission -----------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Chain:
    acc: Accumulator
    sites: list[Site]
    operand_storages: set[Any]


class _Emitter:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.tracer = fx.proxy.GraphAppendingTracer(graph)
        self.scalars: dict[tuple[fx.Node, Any], fx.Node] = {}
        self.device: Any = None

    def proxy(self, x: Any) -> Any:
        if isinstance(x, fx.Node):
            return fx.Proxy(x, self.tracer)
        if isinstance(x, Element):
            return fx.Proxy(x.node, self.tracer)[x.index]
        if isinstance(x, (list, tuple)):
            return type(x)(self.proxy(v) for v in x)
        return x

    def hoist_scalars(self, chain: Chain) -> None:
        """Make each symbolic float a chain's steps read (a scheduled lr in ``1 - lr*wd``)
        a float64 tensor right after it is computed, outside the chain, so the chain's inputs
        are all tensors (:func:`fuse.outline`) and the value stays exact."""
        device = chain.acc.example.device
        for site in chain.sites:
            for step in site.steps:
                for n in flat_nodes(step.args):
                    if (n, device) not in self.scalars and is_symbolic_float(n):
                        self.scalars[n, device] = hyperparameter_f64(self.graph, n, device)
        self.device = device

    def operands(self, args: tuple[Any, ...], info: GraphInfo, own: Accumulator) -> Any:
        """A step's operands as proxies; an operand that is another tensor carrying a pair
        (an EMA's parameter) reads its full value hi + lo, in fp32; a symbolic float is its
        float64 tensor (:meth:`hoist_scalars`)."""
        out = []
        for a in args:
            if isinstance(a, fx.Node) and (a, self.device) in self.scalars:
                out.append(self.proxy(self.scalars[a, self.device]))
                continue
            lo = self._lo_of(info, a, own)
            if lo is None:
                out.append(self.proxy(a))
            else:  # the pair's whole value, as a chain loads its own
                h, low = mcf.load_pair(self.proxy(a), lo, _dtype_of(a))
                out.append(h + low)
        return tuple(out)

    def _lo_of(self, info: GraphInfo, x: Any, own: Accumulator) -> Any:
        """The lo (a proxy) matching operand ``x``: the pair's lo when ``x`` is a tensor
        carrying one, the same view of it when ``x`` is a view of one (``p.t()``,
        ``p.view(-1)``, ``p[:4]``); None otherwise."""
        pair = _pair_of(info, x, own)
        if pair is not None:
            return self.proxy(pair.lo_node)
        base, rest = _view_of(x)
        if base is None:
            return None
        lo = self._lo_of(info, base, own)
        if lo is None:
            return None
        if x.op == "call_method":
            return getattr(lo, x.target)(*rest)
        return x.target(lo, *rest)


_VIEW_FUNCTIONS = frozenset(
    {operator.getitem, torch.reshape, torch.t, torch.transpose, torch.permute, torch.flatten}
)


def _dtype_of(x: Any) -> torch.dtype:
    """The dtype of an operand's value (a node, or an element of a list-valued one)."""
    if isinstance(x, Element):
        return _compat.example_value(x.node)[x.index].dtype
    return _compat.example_value(x).dtype


def _view_of(x: Any) -> tuple[Any, tuple[Any, ...]]:
    """(base, other arguments) when ``x`` is a shape/index view of ``base`` whose other
    arguments are constants; (None, ()) otherwise."""
    if not isinstance(x, fx.Node) or x.kwargs or not x.args or not isinstance(x.args[0], fx.Node):
        return None, ()
    viewing = (x.op == "call_method" and x.target in VIEW_METHODS) or (
        x.op == "call_function" and x.target in _VIEW_FUNCTIONS
    )
    rest = tuple(x.args[1:])
    if not viewing or any(isinstance(n, fx.Node) for n in flat_nodes(rest)):
        return None, ()
    return x.args[0], rest


def _describe_chain(chain: Chain) -> str:
    def show(x: Any) -> str:
        if isinstance(x, fx.Node):
            return x.name
        if isinstance(x, Element):
            return f"{x.node.name}[{x.index}]"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(show(v) for v in x) + "]"
        return repr(x)

    steps = []
    for site in chain.sites:
        for step in site.steps:
            fn = f"{step.update.__name__}:" if step.update is not None else ""
            steps.append(f"{step.kind}({fn}{', '.join(show(a) for a in step.args)})")
    return f"{chain.acc.node.name} (+{chain.acc.lo_node.name}): " + ", ".join(steps)


def _pair_of(info: GraphInfo, x: Any, own: Accumulator) -> Accumulator | None:
    if not isinstance(x, (fx.Node, Element)):
        return None
    for acc, full in info.accumulators_of_node(x):
        if full and acc is not own and acc.lo_node is not None:
            return acc
    return None


def pair_readers(info: GraphInfo, chains: list[Chain]) -> list[Accumulator]:
    """Weights (parameters, or aliases of tensors carrying a pair) that a chain reads as a
    whole operand (an EMA's ``p``) and that are not upgraded in this graph: they get a lo
    input too, so the chain reads hi + lo."""
    chained = {c.acc for c in chains}
    readers: dict[Accumulator, None] = {}
    for chain in chains:
        for site in chain.sites:
            for step in site.steps:
                for a in step.args:
                    while isinstance(a, fx.Node) and not any(
                        full for _, full in info.accumulators_of_node(a)
                    ):
                        a = _view_of(a)[0]  # a view of a weight reads its pair's view
                    if not isinstance(a, (fx.Node, Element)):
                        continue
                    for acc, full in info.accumulators_of_node(a):
                        if full and acc.is_weight and acc not in chained:
                            readers[acc] = None
    return list(readers)


def plan_chains(info: GraphInfo, sites: dict[Write, Site], unsupported: list[Write]) -> list[Chain]:
    """Group sites into chains (see module docstring)."""
    sites_at: dict[fx.Node, list[Site]] = {}
    for site in sites.values():
        sites_at.setdefault(site.write.node, []).append(site)
    unsupported_at: dict[fx.Node, list[Write]] = {}
    for w in unsupported:
        unsupported_at.setdefault(w.node, []).append(w)
    open_chains: dict[Accumulator, Chain] = {}
    chains: list[Chain] = []
    consumed: dict[Accumulator, set[fx.Node]] = {}
    for site in sites.values():
        consumed.setdefault(site.write.acc, set()).update(site.consumed)

    def close(acc: Accumulator) -> None:
        chain = open_chains.pop(acc, None)
        if chain is not None:
            chains.append(chain)

    for node in info.gm.graph.nodes:
        here = sites_at.get(node, [])
        written = written_nodes(node)
        # 1. what this node reads: a chain is closed before a reader of its tensor (or of any
        #    view of its storage); the operands a node only writes are not reads
        for n in read_nodes(node):
            for acc, _ in info.accumulators_of_node(n):
                if node not in consumed.get(acc, ()):
                    close(acc)
        # 2. what this node writes (any tensor, temporaries included): a chain that would
        #    read it later as an operand is closed first; an unsupported write ends the
        #    chain of its own tensor
        if written:
            written_storages = set().union(*(info.storages_of(n) for n in written))
            for acc, chain in list(open_chains.items()):
                if chain.operand_storages & written_storages:
                    close(acc)
        for w in unsupported_at.get(node, []):
            close(w.acc)
        # 3. sites extend (or open) their tensor's chain
        for site in here:
            acc = site.write.acc
            chain = open_chains.get(acc)
            if chain is None:
                chain = open_chains[acc] = Chain(acc, [], set())
            chain.sites.append(site)
            for n in flat_nodes([s.args for s in site.steps]):
                chain.operand_storages |= info.storages_of(n)
    for acc in list(open_chains):
        close(acc)
    return chains


def last_pair_uses(info: GraphInfo, chains: list[Chain]) -> dict[Accumulator, int]:
    """For each accumulator, the position of the last node that uses its hi and lo as a
    pair: a write to its storage (a later chain loads hi + lo; an unsupported in-place op
    reads the old hi and its lo is then reset), or a chain reading it as a whole operand
    (an EMA reading the weight's hi + lo, emitted just before the chain's last write).

    A plain read (AdamW's ``sqrt(v)``) is not a use of the pair: inside one kernel it sees
    the unrounded value, as it would in plain Inductor."""
    last: dict[Accumulator, int] = {}
    for n in info.gm.graph.nodes:
        pos = info.positions.get(n)
        if pos is None:  # added by the rewrite (lo inputs)
            continue
        for w in written_nodes(n):
            for acc, _ in info.accumulators_of_node(w):
                last[acc] = pos
    for chain in chains:
        pos = info.positions[chain.sites[-1].write.node]
        for site in chain.sites:
            for step in site.steps:
                for arg in flat_nodes(step.args):
                    pair = _pair_operand(info, arg, chain.acc)
                    if pair is not None:
                        last[pair] = max(last.get(pair, -1), pos)
    return last


def _pair_operand(info: GraphInfo, x: Any, own: Accumulator) -> Accumulator | None:
    """The accumulator whose pair an operand reads (itself, or through a view), as
    :meth:`_Emitter._lo_of` resolves it."""
    while x is not None:
        pair = _pair_of(info, x, own)
        if pair is not None:
            return pair
        x = _view_of(x)[0]
    return None


def add_lo_inputs(
    gm: fx.GraphModule, accs: list[Accumulator], fake_mode: Any, dtype: torch.dtype | None = None
) -> None:
    """A placeholder per accumulator for its lo component (of ``dtype``: an exact
    remainder's; the accumulator's own by default), after the existing inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for acc in accs:
        if anchor is None:
            with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                node = gm.graph.placeholder(f"collage_lo_{len(placeholders)}")
        else:
            with gm.graph.inserting_after(anchor):
                node = gm.graph.placeholder(f"collage_lo_{acc.node.name}")
        _compat.mark_new_input(node)
        _compat.mark_static_input(node)
        # Dynamo's example values live in its tracing fake mode; AOTAutograd fakeifies the
        # backend's inputs in the tracing context's own mode (a different one on 2.13), so the
        # new input's example is made there, with the accumulator's (possibly symbolic) sizes.
        # Same layout rule as the real lo (state.empty_lo).
        with fake_mode:
            fake = state.empty_lo(acc.example, dtype)
        _compat.set_example_value(node, fake)
        node.meta["val"] = fake
        acc.lo_node = node
        anchor = node
        placeholders.append(node)


def scalars_as_static_inputs(gm: fx.GraphModule, fake_mode: Any) -> list[tuple[int, Any]]:
    """For a step captured as a CUDA graph: every float Dynamo passes in as a 0-dim CPU
    float64 tensor (a scheduled lr) that the graph reads only as MCF hyperparameters
    (:func:`hyperparameter_f64`'s ``zeros(device) + x.item()``) becomes an input on that
    device, marked static: the wrapper fills one tensor per graph with the value and
    passes it instead.  Returns, for each, the input's index and its new example value.

    Why: Inductor moves a CPU scalar input to the device outside the captured partition
    (``move_constructors_to_gpu``), into a new tensor each call, and cudagraph trees copy
    every non-static input into the graph's own with one ``_foreach_copy_``, whose fused
    kernel needs one dtype across the list; a float64 scalar among bf16 gradients sent it
    to its per-tensor loop, a copy per gradient (on the H100, 41 of the 142 ms that 100
    profiled steps of 75 tensors took).  The value is the same float64 either way.

    The new example keeps the symbol Dynamo gave the float (its ``.item()``), which
    AOTAutograd then turns into tensor arithmetic on the input, as it does for the CPU one
    (``tensorify_python_scalars``).  Without that symbol a cold compile failed on 2.11 and
    2.13 ("Expected scalars to be on CPU, got meta"; a warm cache hid it), and a version
    that took the ``.item()`` out of the graph got the lr specialized, a compile per lr."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[tuple[int, Any]] = []
    for index, node in enumerate(placeholders):
        devices = _hyperparameter_devices(node)
        if devices is None or len(devices) != 1:
            continue
        old = _compat.example_value(node)
        with fake_mode:
            fake = torch.empty((), dtype=torch.float64, device=next(iter(devices)))
        if not _compat.share_item_symbol(old, fake):
            continue
        _compat.mark_static_input(node)
        _compat.set_example_value(node, fake)
        node.meta["val"] = fake
        out.append((index, fake))
    return out


def capture_inputs(
    gm: fx.GraphModule, fake_mode: Any, example_inputs: Sequence[Any], cudagraphs: Any
) -> tuple[list[Any], list[tuple[int, Any]], tuple[frozenset[int], list[str]] | None]:
    """What a captured step needs of a rewritten graph before Inductor compiles it: with
    ``cudagraphs``, each scheduled float read from a tensor of its own
    (:func:`scalars_as_static_inputs`); the example inputs with those tensors' examples;
    for the whole-step replay (``"step"``), :func:`host_reads`, else None."""
    statics = scalars_as_static_inputs(gm, fake_mode) if cudagraphs else []
    inputs = list(example_inputs)
    for i, fake in statics:
        inputs[i] = fake
    return inputs, statics, host_reads(gm) if cudagraphs == "step" else None


def host_reads(gm: fx.GraphModule) -> tuple[frozenset[int], list[str]]:
    """The inputs ``gm`` does not read, and the CPU tensors it holds as attributes (a
    step count kept on the CPU): a capture of the whole step holds its CPU work at one
    step's values, so :mod:`replay` refuses a CUDA step that reads one."""
    unused = frozenset(
        i for i, n in enumerate(gm.graph.find_nodes(op="placeholder")) if not n.users
    )
    cpu = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = fetch_attr(gm, node.target)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and node.users:
            cpu.append(node.target)
    return unused, cpu


def _hyperparameter_devices(node: fx.Node) -> set[Any] | None:
    """The devices of the tensors the graph makes of placeholder ``node``'s value, if it
    reads that value only as tensors (:func:`_tensor_reads`), else None."""
    ex = _compat.example_value(node)
    if not (
        isinstance(ex, torch.Tensor)
        and ex.dim() == 0
        and ex.dtype == torch.float64
        and ex.device.type == "cpu"
        and node.users
    ):
        return None
    devices: set[Any] = set()
    for item in node.users:
        if not (item.op == "call_method" and item.target == "item"):
            return None
        if not _tensor_reads(item, devices):
            return None
    return devices or None


_SCALAR_ARITHMETIC = frozenset(
    {operator.neg, operator.add, operator.sub, operator.mul, operator.truediv}
)
# a tensor's arithmetic methods, the float their operand (Adamax's single-tensor step:
# ``neg_bias_correction.div_(lr)``)
_TENSOR_METHODS = frozenset({"add", "sub", "mul", "div", "add_", "sub_", "mul_", "div_"})


def _tensor_reads(x: fx.Node, devices: set[Any]) -> bool:
    """Whether every reader of symbolic float ``x`` reads it as a tensor, adding their
    devices to ``devices``: :func:`hyperparameter_f64`'s ``zeros(device) + x`` (the MCF
    chains' and ``passes.scalars``' tensors), or a positional operand of arithmetic with a
    tensor (``lr / bias_correction1`` of a single-tensor step, ``t.div_(lr)``), which the
    tensorification turns into tensor ops on the input; Python arithmetic on it is
    followed, and left dead (read by nothing) it is erased before Inductor.  A float the
    tensorification cannot turn into tensors is specialized and guarded (or the frame
    restarts with it a constant): :func:`_compat.float_guards` checks that after the
    compile."""
    for use in x.users:
        device = hyperparameter_device(use)
        if device is not None:
            devices.add(device)
            continue
        if use.op == "call_method" and use.target in _TENSOR_METHODS and not use.kwargs:
            self_ex = _compat.example_value(use.args[0])
            if use.args[1:] != (x,) or not isinstance(self_ex, torch.Tensor):
                return False
            devices.add(self_ex.device)
            continue
        if use.op != "call_function" or use.target not in _SCALAR_ARITHMETIC or use.kwargs:
            return False
        ex = _compat.example_value(use)
        if isinstance(ex, torch.Tensor):
            devices.add(ex.device)
        elif not (isinstance(ex, torch.SymFloat) and _tensor_reads(use, devices)):
            return False
    return True


def emit(
    gm: fx.GraphModule,
    info: GraphInfo,
    chains: list[Chain],
    unsupported: list[Write],
    arithmetic: str,
    metrics: bool = False,
    outline: bool = True,
) -> list[tuple[Accumulator, Any]]:
    """Write each chain's MCF code into the graph and remove the writes it replaces.

    With ``outline``, each chain becomes one ``collage::chain`` node (:mod:`collage_compile.fuse`)
    where that is safe; the arithmetic is the same either way.

    With ``metrics``, a parameter's chain also computes ``metrics.step_sums`` from the
    values it has at hand; returns [(accumulator, sums node)]."""
    writer = _ChainWriter(gm, info, chains, arithmetic, metrics, outline)
    for chain in chains:
        writer.write(chain)
    # an unsupported write leaves the pair consistent: lo restarts from zero after it
    for w in unsupported:
        if w.acc.lo_node is None:
            continue
        with gm.graph.inserting_after(w.node):
            writer.em.proxy(w.acc.lo_node).zero_()
    _remove_claimed(gm, info, [s for c in chains for s in c.sites])
    return writer.measured


class _ChainWriter:
    """:func:`emit`'s work on one chain at a time, with what it shares across chains: the
    hoisted scalars, the outlined calls later chains reuse, where each pair is last used."""

    def __init__(
        self,
        gm: fx.GraphModule,
        info: GraphInfo,
        chains: list[Chain],
        arithmetic: str,
        metrics: bool,
        outline: bool,
    ):
        self.graph, self.info, self.arithmetic = gm.graph, info, arithmetic
        self.metrics, self.outline = metrics, outline
        self.em = _Emitter(gm.graph)
        self.measured: list[tuple[Accumulator, Any]] = []
        self.used_until = last_pair_uses(info, chains)
        self.grad_enabled = _grad_mode_at(gm.graph)
        # the chains that one foreach op's write ends: one group of horizontally fused
        # kernels, as Inductor lowers the foreach op itself (Triton; C++ fuses them anyway)
        self.ends = collections.Counter(c.sites[-1].write.node for c in chains)
        hoisted = self.em.scalars.values()
        self.plans = reuse.Reuse(lambda n: n in info.positions or n in hoisted)

    def write(self, chain: Chain) -> None:
        """The chain's code before its last write, its pair copied back; outlined into one
        call (or a call an earlier chain's plan made) unless it measures metrics."""
        last, acc, em = chain.sites[-1].write.node, chain.acc, self.em
        em.hoist_scalars(chain)
        first_new = last.prev
        group = self.info.positions[last] if self.ends[last] > 1 else -1
        grad = self.grad_enabled[last]
        measure = self.metrics and acc.role == "param"
        outline = self.outline and not measure
        plan = made = None
        with self.graph.inserting_before(last):
            hi, lo = em.proxy(acc.node), em.proxy(acc.lo_node)
            steps = [
                (step.kind, em.operands(step.args, self.info, acc), step.update)
                for site in chain.sites
                for step in site.steps
            ]
            # the stores may round hi and lo themselves unless the pair is used again later
            stored = not measure and self.used_until.get(acc, -1) <= self.info.positions[last]
            if outline:
                head = (self.arithmetic, acc.dtype, stored, grad)
                plan = self.plans.plan(acc.node, acc.lo_node, steps, head)
                made = plan and self.plans.call(self.graph, plan, grad, group)
            if made:  # the call an earlier chain of this plan made, on this chain's tensors
                new_hi, new_lo = em.proxy(made[0]), em.proxy(made[1])
            else:
                new_hi, new_lo = mcf_chain(hi, lo, steps, self.arithmetic, acc.dtype, stored=stored)
                if measure:
                    sums = _step_sums(hi, lo, new_hi, new_lo, steps, acc.dtype)
                    self.measured.append((acc, sums))
            hi.copy_(new_hi)
            lo.copy_(new_lo)
        if outline and not made:
            region = []
            node = first_new.next
            while node.target != "copy_":
                region.append(node)
                node = node.next
            outlined = fuse.outline(self.graph, region, [new_hi.node, new_lo.node], grad, group)
            if plan is not None:
                self.plans.learn(plan, outlined)
        _tag(first_new, last, chain)


def _step_sums(
    hi: Any, lo: Any, new_hi: Any, new_lo: Any, steps: list[Any], dtype: torch.dtype
) -> fx.Node:
    """The node of ``metrics.step_sums`` for a parameter's chain: old and new pair, and the
    update the steps intended."""
    from collage_compile import metrics as _metrics

    old_hi, old_lo = mcf.load_pair(hi, lo, dtype)
    delta = _metrics.intended_delta(old_hi, old_lo, trace_steps(hi, steps))
    return _metrics.step_sums(old_hi, old_lo, new_hi, new_lo, delta).node


def _tag(first_new: fx.Node, last: fx.Node, chain: Chain) -> None:
    """Tag a chain's nodes (what a compact printout of the graph folds into one line)."""
    summary = _describe_chain(chain)
    node = first_new.next
    while node is not last:
        node.meta["collage_chain"] = summary
        node = node.next


def _grad_mode_at(graph: fx.Graph) -> dict[fx.Node, bool]:
    """Whether grad mode is on at each node (Dynamo keeps ``torch._C._set_grad_enabled``
    calls in the graph; the backend is called in the mode the graph starts in)."""
    mode, out = torch.is_grad_enabled(), {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            mode = bool(node.args[0])
        out[node] = mode
    return out


def emit_measurements(
    gm: fx.GraphModule, info: GraphInfo, chains: list[Chain]
) -> list[tuple[Accumulator, Any]]:
    """``mode="off"`` with metrics: leave every write as it is and measure around it.

    The old value is copied before a chain's first write, the intended update computed
    from the same operands the MCF chain would read (just before the last write, where
    they are current), and the new value read after the last write."""
    from collage_compile import metrics as _metrics

    graph = gm.graph
    em = _Emitter(graph)
    measured: list[tuple[Accumulator, Any]] = []
    last_pair_uses(info, chains)
    for chain in chains:
        acc = chain.acc
        if acc.role != "param":
            continue
        first, last = chain.sites[0].write.node, chain.sites[-1].write.node
        with graph.inserting_before(first):
            old = em.proxy(acc.node).float()
        with graph.inserting_before(last):
            hi = em.proxy(acc.node)
            steps = [
                (step.kind, em.operands(step.args, info, acc), step.update)
                for site in chain.sites
                for step in site.steps
            ]
            delta = _metrics.intended_delta(old, 0.0, trace_steps(hi, steps))
        with graph.inserting_before(last.next):
            # Inductor may hand this read the fp32 value it is about to store instead of the
            # stored one (it keeps fused bf16 chains in fp32 registers, FIELD_NOTES 1):
            # rounding it again (to nearest even, as the store does) is a no-op on a stored
            # value and the store's own rounding on the other; in fp32 arithmetic, which
            # C++ kernels vectorize (a bitcast there is a loop over the lanes)
            new = mcf.round_to_float_ops(em.proxy(acc.node).float(), acc.dtype)
            sums = _metrics.step_sums(old, 0.0, new, None, delta)
        measured.append((acc, sums.node))
    return measured


def weight_clones(info: GraphInfo) -> list[tuple[fx.Node, Accumulator]]:
    """Outputs that are clones of a weight's whole value: a snapshot the caller keeps and
    later restores (SAM's ``old_p = p.data.clone()``, L-BFGS's saved weights).  Each gets a
    copy of the weight's lo (:func:`add_clone_los`), so that a restore from it
    (``p.copy_(snapshot)``, a copy of a pair's whole value) restores the pair, where the head
    alone restarted lo at every restore.  A clone the graph then writes is new state, not a
    snapshot: its lo would not match what the writes leave in it."""
    out = next(n for n in reversed(info.gm.graph.nodes) if n.op == "output")
    found: dict[fx.Node, Accumulator] = {}
    end = len(info.positions)
    for node in out.args[0]:  # Dynamo's outputs: a flat tuple
        if not isinstance(node, fx.Node) or node in found or not _is_clone(node):
            continue
        if info.written_between(node, info.positions[node], end):
            continue  # state made from a weight and updated here (schedule-free's z)
        ex = _compat.example_value(node)
        if not isinstance(ex, torch.Tensor) or ex.requires_grad:
            continue  # a forward pass's output, for autograd: not a snapshot
        for acc, full in info.accumulators_of_node(node.args[0]):
            if full and acc.is_weight and ex.dtype == acc.dtype:
                found[node] = acc
    return list(found.items())


def _is_clone(node: fx.Node) -> bool:
    return bool(node.args) and (
        (node.op == "call_method" and node.target == "clone")
        or (node.op == "call_function" and node.target in (torch.clone, torch.Tensor.clone))
    )


def add_clone_los(gm: fx.GraphModule, clones: list[tuple[fx.Node, Accumulator]]) -> list[int]:
    """Return a clone of each weight's lo, taken where its hi was cloned, after the graph's
    outputs; the positions of the clones they belong to (the wrapper registers them)."""
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = tuple(out.args[0])
    los = []
    for node, acc in clones:
        with graph.inserting_after(node):
            los.append(graph.call_method("clone", (acc.lo_node,), dict(node.kwargs)))
    out.args = ((*values, *los),)
    return [values.index(node) for node, _ in clones]


def add_metrics_output(gm: fx.GraphModule, measured: list[tuple[Accumulator, Any]]) -> None:
    """Stack the sums of every measured tensor into one [n, 7] tensor, returned after the
    graph's own outputs (the backend's wrapper takes it off before Dynamo sees them)."""
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    with graph.inserting_before(out):
        stacked = graph.call_function(torch.stack, ([node for _, node in measured],))
    values = out.args[0]
    out.args = ((*values, stacked),)


def _remove_claimed(gm: fx.GraphModule, info: GraphInfo, sites: list[Site]) -> None:
    graph = gm.graph
    by_node: dict[fx.Node, list[Site]] = {}
    for site in sites:
        by_node.setdefault(site.write.node, []).append(site)
    orphans: set[fx.Node] = set()
    for node, node_sites in by_node.items():
        orphans.update(node.all_input_nodes)
        if node_sites[0].write.index is None:
            # a single-tensor write returns (an alias of) the tensor: later uses read it
            node.replace_all_uses_with(node_sites[0].write.acc.node)
            graph.erase_node(node)
            continue
        claimed = {s.write.index for s in node_sites}
        n_elems = len(node.args[0])
        rest = [i for i in range(n_elems) if i not in claimed]
        new = None
        if rest:
            with graph.inserting_before(node):
                per_elem = node_sites[0].write.op in _PER_ELEMENT_SCALAR_TENSOR
                new = graph.call_function(
                    node.target,
                    tuple(_subset(a, rest, graph, per_elem) for a in node.args),
                    {k: _subset(v, rest, graph, per_elem) for k, v in node.kwargs.items()},
                )
            new.meta = dict(node.meta)
        _redirect_elements(graph, node, rest, new)
        if new is not None:
            node.replace_all_uses_with(new)
        graph.erase_node(node)
    _prune(graph, orphans)


def _redirect_elements(
    graph: fx.Graph, node: fx.Node, rest: list[int], new: fx.Node | None
) -> None:
    """An in-place foreach write returns the tensors it wrote; a later ``getitem(node, i)``
    (torch 2.11's ``_foreach_lerp_`` polyfill returns ``_foreach_add_``'s result) reads
    element ``i``'s tensor itself when the rewrite took element ``i`` (the chain writes it),
    else element ``i`` of the call left for the other elements."""
    written = node.args[0]
    for user in list(node.users):
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            continue  # left to fail loudly when the node is erased
        i = user.args[1]
        if i in rest and new is not None:
            user.args = (new, rest.index(i))
        elif i not in rest and isinstance(written, (list, tuple)):
            user.replace_all_uses_with(written[i])
            graph.erase_node(user)


def _subset(arg: Any, keep: list[int], graph: fx.Graph, per_element_tensor: bool) -> Any:
    """A foreach argument restricted to the elements ``keep``."""
    if isinstance(arg, (list, tuple)):
        return type(arg)(arg[i] for i in keep)
    if isinstance(arg, fx.Node):
        ex = _compat.example_value(arg)
        if isinstance(ex, (list, tuple)):
            return [graph.call_function(operator.getitem, (arg, i)) for i in keep]
        if per_element_tensor and isinstance(ex, torch.Tensor) and ex.dim() == 1:
            items = [graph.call_function(operator.getitem, (arg, i)) for i in keep]
            return graph.call_function(torch.stack, (items,))
    return arg


def _prune(graph: fx.Graph, candidates: set[fx.Node]) -> None:
    """Remove the nodes that only fed a replaced write (e.g. a rewritten copy_'s source
    expression), if they are pure and now unused."""
    alive = set(graph.nodes)
    work = [n for n in candidates if n in alive]
    while work:
        node = work.pop()
        if node not in alive or node.users or node.op not in ("call_function", "call_method"):
            continue
        if written_slots(node) or (node.op == "call_function" and node.is_impure()):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        alive.discard(node)
        work.extend(inputs)
