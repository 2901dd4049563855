"""``mode="exact"``: the step computes on the fp32 values a bf16 tensor and its 16-bit
remainder hold (:mod:`collage_compile.remainder`), bit for bit what the same step computes
on fp32 tensors.

    compile_exact(...)
      -> which tensors   every low-precision tensor the graph writes, every weight a
                         write to one of them reads whole (an EMA's parameter), and every
                         tensor it reads that carries a remainder (state an optimizer
                         replaces each step); a graph that writes none of them but makes
                         state (ADOPT's first step) too
      -> remainder inputs, one int16 per tensor (rewrite.add_lo_inputs)
      -> promote         passes.promote: join at the start, the graph's own ops in fp32,
                         split at the end
      -> measure         with metrics, the parameters' updates (:func:`_measure`)
      -> finalize        changing hyperparameters as tensors (passes.scalars), and Adam's
                         denominator at lr = 0 (passes.step_size, exact form)
      -> Inductor        as for the fp32 step

Which ops write a tensor does not matter (a ``torch.maximum``, a write through a view): the
optimizer's own ops run on the fp32 value.  A tensor the graph reaches through two
different views of one storage (a flat buffer and its parts, passed in separately) cannot
be given one fp32 value per view: it is left in plain bf16, named in a CollageWarning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat, metrics, names, remainder, report, rewrite, state, watch
from collage_compile.accumulators import Accumulator, Element, GraphInfo, Site, same_view
from collage_compile.config import CollageConfig
from collage_compile.passes import promote, scalars, step_size

__all__ = ["Compiled", "compile_exact"]


@dataclasses.dataclass
class Compiled:
    """One graph compiled in exact mode, and what the backend's wrapper needs to call it."""

    fn: Callable[..., Any]
    upgraded: list[Accumulator]  # one per tensor, its remainder an input, in order
    left: list[Accumulator]  # written, not upgraded (their lo restarts after each call)
    measured: list[tuple[Accumulator, Any]]  # metrics rows
    readers: list[Accumulator]  # weights read whole, their remainders inputs after
    new_state: list[int]  # outputs whose remainders the graph returns after its outputs
    scalars: list[tuple[int, Any]]  # floats read from a tensor of its own: index, example
    host: tuple[frozenset[int], list[str]] | None  # cudagraphs="step": rewrite.host_reads


def compile_exact(
    gm: fx.GraphModule,
    info: GraphInfo,
    sites: dict[Any, Site],
    example_inputs: Sequence[Any],
    config: CollageConfig,
    record: bool,
) -> Compiled:
    """Rewrite and compile one graph in exact mode."""
    grads = _gradients(info)
    groups, left = _choose(info, set(grads))
    for acc in [a for g in groups for a in g]:
        state.check_exact_dtype(acc.example, acc.describe())
    upgraded = [g[0] for g in groups]
    chained = {a for g in groups for a in g}
    claimed = {w: s for w, s in sites.items() if w.acc in chained}
    readers = [
        r
        for r in rewrite.pair_readers(info, rewrite.plan_chains(info, claimed, []))
        if r.dtype == torch.bfloat16 and r not in chained
    ]
    readers += _paired_reads(info, chained, set(readers))
    _report(info, chained, set(grads), config, record)
    watch.compiled_frame(
        _compat.current_frame(),
        [
            (names.display(a.real, a.name), id(a.real) if a.real is not None else None)
            for a in upgraded
        ],
    )
    fake_mode = _compat.fake_mode_of(example_inputs, gm)
    with_rem = upgraded + readers
    rewrite.add_lo_inputs(gm, with_rem, fake_mode, remainder.DTYPE)
    tensors = [promote.Promoted([a.node for a in g], g[0].lo_node, True) for g in groups]
    tensors += [promote.Promoted([r.node], r.lo_node, False) for r in readers]
    written = {w.acc for w in info.writes}
    tensors += [promote.Promoted([g.node], None, g in written) for g in grads]
    promotion = promote.run(gm, tensors, fake_mode)
    measured = []
    if config.metrics:
        measured = _measure(gm, info, claimed, groups, promotion.current)
        if measured:
            rewrite.add_metrics_output(gm, measured)
    scalars.run(gm)
    step_size.run(gm, exact=True)
    inputs, statics, host = rewrite.capture_inputs(gm, fake_mode, example_inputs, config.cudagraphs)
    gm.graph.lint()
    gm.recompile()
    rem_examples = [_compat.example_value(a.lo_node) for a in with_rem]
    n_tensors = sum(isinstance(t, torch.Tensor) for t in inputs)
    patches = {
        **_compat.scalar_prologue_patch(),
        **_compat.no_input_asserts_patch(),
        **_compat.combo_args_patch(n_tensors, len(rem_examples)),
    }
    compiled = _compat.compile_with_inductor(
        gm, [*inputs, *rem_examples], patches, config.inductor_cudagraphs
    )
    return Compiled(compiled, upgraded, left, measured, readers, promotion.new_state, statics, host)


def _gradients(info: GraphInfo) -> list[Accumulator]:
    """The gradients the graph reads: upcast at its start, as the fp32 step reads fp32
    gradients.  torch.optim's (``GradSource``) even where the step writes them (maximize,
    clipping); a ``p.grad`` read by other code only where the graph does not write it: a
    gradient accumulated in place (``p.grad.add_(g)`` over micro-batches) is a sum, carried
    with its remainder as any other written tensor."""
    written = {w.acc for w in info.writes}
    return [
        a
        for a in info.accumulators
        if _compat.is_gradient_input(a.node)
        and (_compat.is_torch_optim_gradient(a.node) or a not in written)
    ]


def _paired_reads(
    info: GraphInfo, chained: set[Accumulator], readers: set[Accumulator]
) -> list[Accumulator]:
    """Optimizer state this graph reads that carries a remainder and whose memory it does
    not write: state an optimizer replaces rather than updates (AdaLite's
    ``state["v_avg_0"] = v.sum(1)``, a new tensor each step, returned with its remainder),
    or reads in one graph and writes in another.  Read as the bf16 tensor alone, the step
    computed on a value one bf16 rounding from the fp32 step's; they are read as hi +
    remainder (:func:`_read_with_remainder`)."""
    written = info.written_storages()
    return [
        a
        for a in info.accumulators
        if a.carries_pair
        and a.dtype == torch.bfloat16
        and a not in chained
        and a not in readers
        and not a.is_gradient
        and a.node.users
        and _read_with_remainder(info, a, written)
    ]


def _read_with_remainder(info: GraphInfo, a: Accumulator, written: set[Any]) -> bool:
    """Optimizer state only: weights are not (a forward pass reading them stays as it
    is), nor a tensor on memory the graph writes (its reads must see the write)."""
    return (
        a.role != "param"
        and _compat.is_optimizer_state_input(a.node)
        and info.storage_key(a.example) not in written
    )


def makes_state(gm: fx.GraphModule, info: GraphInfo) -> bool:
    """Whether a graph that writes no input makes optimizer state: it reads a gradient
    and returns a low-precision tensor it computed (ADOPT's first step fills its second
    moment from ``grad * grad`` and skips the weights).  Made in bf16 by plain Inductor,
    that state would start one bf16 rounding from the fp32 step's, with no remainder."""
    if not any(_compat.is_gradient_input(a.node) for a in info.accumulators):
        return False
    outputs = gm.graph.output_node().all_input_nodes
    if _is_training_forward(outputs):
        return False  # a forward that reads ``.grad``: left to Inductor as it is
    return any(
        n.op not in ("placeholder", "get_attr")
        and getattr(_compat.example_value(n), "dtype", None) in (torch.bfloat16, torch.float16)
        for n in outputs
    )


def _is_training_forward(outputs: list[fx.Node]) -> bool:
    """Whether any output requires grad (no optimizer step's does: it runs under no_grad)."""
    return any(getattr(_compat.example_value(n), "requires_grad", False) for n in outputs)


def _choose(
    info: GraphInfo, grads: set[Accumulator]
) -> tuple[list[list[Accumulator]], list[Accumulator]]:
    """The written low-precision tensors but gradients, each as the group of input nodes
    that are the same view of it (a parameter and its ``detach()`` passed in), and those
    left: a storage reached through different views."""
    written = list({w.acc: None for w in info.writes if w.acc not in grads})
    groups, left, seen = [], [], set()
    for acc in written:
        if acc in seen:
            continue
        same = info.aliases(acc)
        seen.update(same)
        if all(same_view(a.example, acc.example) for a in same):
            groups.append([acc, *[a for a in same if a is not acc]])
            continue
        for a in same:
            if any(w.acc is a for w in info.writes):
                a.eligible, a.warn = False, True
                a.reason = (
                    "shares its memory with another input of this graph through a different "
                    "view (a flat buffer and its parts): exact mode cannot give both one fp32 "
                    "value, so it is updated in plain low precision"
                )
                left.append(a)
    return groups, left


def _report(
    info: GraphInfo,
    chained: set[Accumulator],
    grads: set[Accumulator],
    config: CollageConfig,
    record: bool,
) -> None:
    """Every write of a promoted tensor is upgraded, whatever its op; a gradient written in
    place is computed in fp32 and stored in its dtype: not state, listed without a warning."""
    for g in grads:
        g.eligible, g.warn = False, False
        g.reason = "a gradient, not state: computed in fp32, stored in its own dtype"
    upgraded = {w: Site(w, [], w.op) for w in info.writes if w.acc in chained}
    left = [w for w in info.writes if w.acc not in chained]
    rep = report.GraphReport.build(info, upgraded, left, config)
    if record:
        rep.warn_unsupported()
        report.record(rep)


# ---- metrics ----------------------------------------------------------------------------


def _measure(
    gm: fx.GraphModule,
    info: GraphInfo,
    claimed: dict[Any, Site],
    groups: list[list[Accumulator]],
    current: Callable[[Any], Any],
) -> list[tuple[Accumulator, Any]]:
    """The step's metrics for each parameter whose every write a family understood (its
    intended update is computed from the writes' operands, as in the other modes).

    old: the joined value before the first write (a copy: the fp32 value is updated in
    place); hi before: the stored bf16 tensor.  new: the fp32 value after the last write;
    hi after: its split.  lo, old and new, is the value less hi (exact in fp32)."""
    graph = gm.graph
    tracer = fx.proxy.GraphAppendingTracer(graph)
    proxy = lambda n: fx.Proxy(n, tracer)
    measured = []
    for group in groups:
        acc = group[0]
        writes = [w for w in info.writes if w.acc in group]
        if acc.role != "param" or not all(w in claimed for w in writes):
            continue
        value = current(acc.node)
        first, last = current(writes[0].node), current(writes[-1].node)
        with graph.inserting_before(first):
            old = torch.clone(proxy(value))
            old_hi = proxy(acc.node).float()
            old_lo = old - old_hi
        steps = [s for w in writes for s in claimed[w].steps]
        with graph.inserting_before(last):
            operands = [
                (s.kind, tuple(_fp32_operand(proxy, current, a) for a in s.args), s.update)
                for s in steps
            ]
            delta = metrics.intended_delta(
                old_hi, old_lo, rewrite.trace_steps(proxy(value), operands)
            )
        out = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out):
            new = proxy(value)
            shift = not _compat.is_dtensor(acc.example)
            new_hi, _ = remainder.split(new, acc.dtype, shift=shift)
            new_hi = new_hi.float()
            sums = metrics.step_sums(old_hi, old_lo, new_hi, new - new_hi, delta)
        measured.append((acc, sums.node))
    return measured


def _fp32_operand(
    proxy: Callable[[fx.Node], fx.Proxy], current: Callable[[Any], Any], a: Any
) -> Any:
    """A step's operand as the promoted graph holds it, low precision read as fp32."""
    if isinstance(a, Element):
        node = current(a.node)
        item = proxy(node)[a.index]
        return item.float() if _low(node) else item
    if isinstance(a, fx.Node):
        node = current(a)
        return proxy(node).float() if _low(node) else proxy(node)
    if isinstance(a, (list, tuple)):
        return type(a)(_fp32_operand(proxy, current, v) for v in a)
    return a


def _low(node: fx.Node) -> bool:
    ex = _compat.example_value(node)
    ex = ex[0] if isinstance(ex, (list, tuple)) and ex else ex
    return isinstance(ex, torch.Tensor) and ex.dtype in (torch.bfloat16, torch.float16)
