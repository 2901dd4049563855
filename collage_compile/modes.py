"""Which accumulators a mode upgrades.

Parameters are upgraded in every mode, and so is a tensor passed in that is an exact alias
of a tensor already carrying a pair (``p.data``, ``p.detach()``: its writes keep the pair
consistent instead of discarding lo).  Any other low-precision tensor a graph writes is
offered to the pattern families first; what they make of its writes (its *steps*) then
decides, here, whether the mode carries it as a pair:

- an *average of weights* (``ema.lerp_(p, 1-d)``, ``ema.mul_(d).add_(p, alpha=1-d)``,
  ``torch._foreach_lerp_``, ``AveragedModel``, ASGD's ``ax += (p - ax) * mu``) and a
  *copy of weights* (Lookahead's ``slow.copy_(p)``): every mode;
- a *decay-style accumulator* ``x = b*x + (1-b)*y`` with ``b >= plus_min_decay`` (AdamW's
  second moment at b = 0.999, RMSprop's at 0.99; Adamax's ``exp_inf = max(b*x, |g|)``), and
  a *sum* (additions alone, b = 1: Adagrad's sum of squares, schedule-free's ``z``):
  ``"plus"`` and ``"all"``;
- any other accumulator (momentum buffers, Adam's first moment): ``"all"``.

A tensor written only by overwrites and maxima (AMSGrad's ``max_exp_avg_sq``), or by a
write that is not an accumulation (``clamp_``, a write through a view), is left alone in
every mode, with the reason in the report: its arithmetic is exact or not ours to change.

Why after matching, not before: whether ``v`` is AdamW's second moment or its first is
visible only in the constants of its writes (``v.mul_(0.999)`` vs ``m.lerp_(g, 0.1)``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.accumulators import (
    VIEW_METHODS,
    Accumulator,
    Element,
    GraphInfo,
    Step,
    element_of,
    real_value,
)
from collage_compile.config import CollageConfig
from collage_compile.passes._common import is_number, is_scalar_like, op_name

# steps that round nothing: a tensor written by these alone accumulates nothing
_EXACT_KINDS = frozenset({"set", "max", "min"})


def select(info: GraphInfo, ctx: Any, config: CollageConfig) -> None:
    """After matching: keep the claims of the tensors ``config.mode`` upgrades, and mark
    the others ineligible with the reason (their claims are dropped, their writes run as
    written and are not warned about: leaving them alone is the mode's promise, except
    where :func:`_name_a_promise` or :func:`_like_weights` says the user expects a pair)."""
    writes_of: dict[Accumulator, list[Any]] = {}
    for w in info.writes:
        writes_of.setdefault(w.acc, []).append(w)
    like_weights = []
    averaged_with_weights = _averaged_beside_weights(info, ctx.sites)
    for acc, writes in writes_of.items():
        if config.mode == "off":
            reason = "mode='off' upgrades nothing: plain low-precision arithmetic"
        elif acc.is_weight or acc in averaged_with_weights:
            continue  # a parameter, an alias of a pair's tensor, an EMA's buffer
        elif _copies_weights(info, writes, ctx.sites):
            continue  # a snapshot of weights (Lookahead's slow weights)
        else:
            reason = _reason_to_leave(info, acc, writes, ctx.sites, config)
        if not reason:
            continue
        if config.mode == "plus":
            _watch_a_scheduled_decay(info, acc, writes, ctx)
        acc.eligible, acc.reason = False, reason
        if config.mode != "off":
            _name_a_promise(info, acc, writes, ctx.sites, config)
            if not acc.warn and _like_weights(info, acc, writes, ctx.sites):
                like_weights.append(acc)
        for w in writes:
            ctx.sites.pop(w, None)
    if like_weights and not any(acc.is_weight for acc in writes_of):
        for acc in like_weights:
            acc.warn, acc.reason = True, _LIKE_WEIGHTS.format(mode=config.mode)


def _copies_weights(info: GraphInfo, writes: list[Any], sites: dict[Any, Any]) -> bool:
    """Whether a tensor is a copy of weights: every write an overwrite or a bound, one an
    overwrite from a weight (Lookahead's ``slow.copy_(p)``, a snapshot to restore).  Left
    as written it holds the weight's rounded head, and what the copy feeds back (Lookahead's
    ``p = a*p + (1-a)*slow``) pulls the pair toward that head every time: the weights stall
    short of updates below half an ulp, in every mode, unnamed.  Carried, it holds the
    pair's value, in every mode, as an average of weights is."""
    if not all(w in sites for w in writes):
        return False
    steps = [s for w in writes for s in sites[w].steps]
    return all(s.kind in _EXACT_KINDS for s in steps) and any(
        s.kind == "set"
        and bool(s.args)
        and isinstance(s.args[0], (fx.Node, Element))
        and any(full and a.is_weight for a, full in info.accumulators_of_node(s.args[0]))
        for s in steps
    )


def _name_a_promise(
    info: GraphInfo, acc: Accumulator, writes: list[Any], sites: dict[Any, Any], config: Any
) -> None:
    """Warn where the mode promised ``acc`` a pair it cannot have, saying why: under
    ``"all"``, a write that rounds (every accumulator is promised); under any mode,
    accumulations of a kind the mode carries next to a write it cannot carry (Adamax's
    ``exp_inf``: ``mul_(beta2)``, then ``maximum(out=)``: in bf16 the decay rounds back)."""
    carried = _carried_kind(info, acc, writes, sites, config)
    rounds = config.mode == "all" and not all(w in sites or _exact(w) for w in writes)
    acc.warn = rounds or carried is not None
    if carried:
        acc.reason += (
            f"; its other writes are {carried} that mode={config.mode!r} carries, run "
            f"here in plain {str(acc.dtype).replace('torch.', '')}, where a change below "
            "half an ulp rounds away (mode='exact' carries both)"
        )


# Dynamo's sources of optimizer state, module buffers and gradients (scaled in place by
# clip_grad_norm_): never taken for a weight
_STATE_SOURCE = re.compile(r"\.state\[|\._buffers\[|\.grad$")
# a decay this close to 1 is a weight decay's 1 - lr*wd, not a moment's beta
_WEIGHT_DECAY_MIN = 0.9999
_LIKE_WEIGHTS = (
    "written the way a weight is (additions, with no decay or a weight decay's), but neither "
    "a parameter (an nn.Parameter, a leaf tensor requiring grad, or a tensor in an "
    "optimizer's param_groups) nor optimizer state or a module buffer, in a graph that "
    "updates no parameter: mode={mode!r} leaves it in plain low precision, where updates "
    "below half an ulp are lost. If it is a weight (a detached tensor trained with "
    "torch.func), give it requires_grad=True (torch.func.grad works the same) or use "
    "mode='all'; if it is state of an optimizer of your own, mode='all' carries it too"
)


def _like_weights(
    info: GraphInfo, acc: Accumulator, writes: list[Any], sites: dict[Any, Any]
) -> bool:
    """Whether a tensor the mode leaves is updated as a weight is: an input from outside
    any optimizer's state, module's buffers and gradients, every write an accumulation that
    adds, with no decay or a weight decay's (hand-written steps over torch.func's detached
    weights)."""
    if acc.example.dim() == 0 or _STATE_SOURCE.search(acc.name):
        return False  # a 0-dim sum is a counter or a running loss, not a weight
    if not all(w in sites for w in writes):
        return False
    steps = [st for w in writes for st in sites[w].steps if st.kind not in _EXACT_KINDS]
    if not any(st.kind == "add" for st in steps):
        return False  # a weight's update adds to it: scaling alone is not one
    b = _decay_factor(info, steps)
    return b is None or b >= _WEIGHT_DECAY_MIN


def _watch_a_scheduled_decay(
    info: GraphInfo, acc: Accumulator, writes: list[Any], ctx: Any
) -> None:
    """Plus leaves ``acc`` for its decay now: where that decay is a graph input (a
    schedule), the compiled step watches it (:mod:`collage_compile.decays`)."""
    if not all(w in ctx.sites for w in writes):
        return
    steps = [st for w in writes for st in ctx.sites[w].steps]
    for x, is_lerp in _decay_operands(steps):
        if isinstance(x, fx.Node):
            ctx.scheduled_decays.append((acc, x, is_lerp))
            return


def _carried_kind(
    info: GraphInfo, acc: Accumulator, writes: list[Any], sites: dict[Any, Any], config: Any
) -> str | None:
    """The accumulations of ``acc`` that the mode would carry, described, when some other
    write of it is not an accumulation (None: no such mix)."""
    if all(w in sites for w in writes):
        return None
    steps = [
        st for w in writes if w in sites for st in sites[w].steps if st.kind not in _EXACT_KINDS
    ]
    if not steps:
        return None
    kind = kind_of(info, acc, steps, config)
    if not _carries(kind, config):
        return None
    b = _decay_factor(info, steps)
    return f"a decay by {b:g}" if b is not None else f"an accumulation ({kind})"


def _carries(kind: str, config: Any) -> bool:
    """Whether ``config.mode`` carries accumulators of ``kind`` (:func:`kind_of`) as pairs."""
    return (
        kind == "weights-average"
        or config.mode == "all"
        or (config.mode == "plus" and kind in ("decay", "sum"))
    )


def kind_of(info: GraphInfo, acc: Accumulator, steps: list[Step], config: CollageConfig) -> str:
    """``"weights-average"``, ``"decay"`` (b >= plus_min_decay), ``"sum"`` (additions
    alone: b = 1) or ``"accumulator"``."""
    if any(_averages_weights(info, acc, s) for s in steps):
        return "weights-average"
    b = _decay_factor(info, steps)
    if b is not None and config.plus_min_decay <= b < 1.0:
        return "decay"
    if b is None and _sums(acc, steps):
        return "sum"
    return "accumulator"


def _sums(acc: Accumulator, steps: list[Step]) -> bool:
    """Whether every step of ``acc`` that rounds adds to it something not computed from it
    (Adagrad's sum of squares, schedule-free's ``z``): the decay ``b = 1``, whose rounding,
    unlike a decay's, is never forgotten, so ``"plus"`` carries it as it carries decays
    near 1."""
    kinds = [s.kind for s in steps if s.kind not in _EXACT_KINDS]
    return (
        bool(kinds)
        and all(k == "add" for k in kinds)
        and not acc.is_gradient
        and not any(_addend_reads(s, acc) for s in steps)
    )


def _addend_reads(step: Step, acc: Accumulator) -> bool:
    """Whether an addition adds something computed from the tensor itself: a decay spelled
    as one (``m.add_(0.1*g - 0.1*m)``), whose factor the match did not see, is no sum."""
    nodes = [a.node if isinstance(a, Element) else a for a in step.args]
    return step.kind == "add" and any(isinstance(n, fx.Node) and _reads(n, acc.node) for n in nodes)


def _reason_to_leave(
    info: GraphInfo, acc: Accumulator, writes: list[Any], sites: dict[Any, Any], config: Any
) -> str:
    for w in writes:
        if w not in sites:
            what = f"{w.op} of a view" if not w.full_alias else w.op
            return f"written by {what}, which is not an accumulation: left as written"
    steps = [s for w in writes for s in sites[w].steps]
    if all(s.kind in _EXACT_KINDS for s in steps):
        return (
            "only overwritten or bounded (maximum, minimum, clamp) here (no accumulation): "
            "left as written"
        )
    kind = kind_of(info, acc, steps, config)
    if _carries(kind, config):
        return ""
    b = _decay_factor(info, steps)
    described = f"decay {b:g}" if b is not None else "no decay factor"
    if config.mode == "light":
        # "sum" and "decay" as plus reads them (plus_min_decay is the same config's)
        by = "mode='plus' or 'all'" if kind in ("decay", "sum") else "mode='all'"
        return (
            f"mode='light' upgrades parameters and averages of weights ({described}); "
            f"{by} upgrades it"
        )
    return (
        f"mode='plus' upgrades sums and decay-style state with decay >= "
        f"{config.plus_min_decay:g} ({described}); mode='all' upgrades it"
    )


_EXACT_OPS = {"maximum", "minimum", "max", "min", "clamp", "clamp_min", "clamp_max", "where"}


def _exact(write: Any) -> bool:
    """A write that loses nothing to rounding: an overwrite, or a max/min/clamp/where
    (AMSGrad's ``max_exp_avg_sq``, Adamax's ``exp_inf``), spelled in place, with ``out=``
    or as ``copy_`` of one."""
    op = write.op.split("(")[0].rstrip("_")
    if op in _EXACT_OPS or op in ("zero", "fill"):
        return True
    if write.op == "copy_" and write.args and isinstance(write.args[0], fx.Node):
        src = write.args[0]
        name = src.target if src.op == "call_method" else getattr(src.target, "__name__", "")
        return str(name).rstrip("_") in _EXACT_OPS or not _reads(src, write.target)
    return False


def _reads(node: fx.Node, target: Any, depth: int = 0) -> bool:
    """Whether ``node`` is computed from ``target`` (an overwrite from elsewhere is exact)."""
    if node is target:
        return True
    if depth > 8:
        return False
    return any(_reads(i, target, depth + 1) for i in node.all_input_nodes)


def _decay_factor(info: GraphInfo, steps: list[Step]) -> float | None:
    """The ``b`` of ``x = b*x + ...``: a constant factor of a ``mul`` step, or one minus
    the weight of a ``lerp`` step; None if there is no (known) one."""
    for x, is_lerp in _decay_operands(steps):
        b = decay_value(info, x, is_lerp)
        if b is not None:
            return b
    return None


def _decay_operands(steps: list[Step]) -> Iterator[tuple[Any, bool]]:
    """Each operand that sets a decay: a ``mul`` step's factor (False), a ``lerp`` step's
    weight (True: the decay is one minus it)."""
    for s in steps:
        if s.kind == "mul" and s.update is None:
            yield s.args[0], False
        elif s.kind == "lerp":
            yield s.args[1], True


def decay_value(info: GraphInfo, x: Any, is_lerp_weight: bool) -> float | None:
    """The decay operand ``x`` sets, as a number now (:func:`_number`)."""
    c = _number(info, x)
    return None if c is None else (1.0 - c if is_lerp_weight else c)


def _number(info: GraphInfo, x: Any) -> float | None:
    """A step's factor as a number: a constant, a symbolic scalar's hint, or the value a
    0-dim tensor attribute holds when the graph is compiled (Adam's tensor betas: a value
    that changes later does not reclassify the tensor)."""
    if is_number(x):
        return float(x)
    if not isinstance(x, fx.Node):
        return None
    if x.op in ("get_attr", "placeholder"):
        real = real_value(info, x)
        if isinstance(real, torch.Tensor) and real.dim() == 0 and real.is_floating_point():
            return float(real)
    return _compat.scalar_hint(_compat.example_value(x))


# ---- averages of weights -------------------------------------------------------------------

# value-preserving conversions, and views (an EMA of p.t() or p[:4] averages a weight)
_ALIAS_OPS = {
    "detach",
    "to",
    "float",
    "type_as",
    "clone",
    "contiguous",
    "view_as",
    "getitem",
    *VIEW_METHODS,
}


def _averaged_beside_weights(info: GraphInfo, sites: dict[Any, Any]) -> set[Accumulator]:
    """Tensors a foreach write updates alongside averages of weights, the same way: an EMA
    of a model averages its buffers in the same ``_foreach_lerp_`` as its parameters
    (AveragedModel(use_buffers=True), timm's ModelEmaV3), and a buffer (BatchNorm's running
    statistics), passed detached and carrying no pair, is known by that company alone."""
    nodes = {
        w.node
        for w in info.writes
        if w.index is not None
        and w in sites
        and any(_averages_weights(info, w.acc, st) for st in sites[w].steps)
    }
    return {w.acc for w in info.writes if w.node in nodes and w in sites}


def _averages_weights(info: GraphInfo, acc: Accumulator, step: Step) -> bool:
    """Whether a step moves ``acc`` toward a parameter: lerp toward it, add a multiple of
    it, add a multiple of ``(param - acc)``, or set it to the parameter."""
    if step.kind == "lerp":
        return _is_param(info, step.args[0], acc, 0)
    if step.kind in ("add", "set"):
        operands = [a for a in step.args if isinstance(a, (fx.Node, Element))]
        return len(operands) == 1 and _is_param(info, operands[0], acc, 0)
    return False


def _is_param(info: GraphInfo, x: Any, acc: Accumulator, depth: int) -> bool:
    """``x`` is a parameter, or a scalar multiple / ``param - acc`` of one."""
    if any(full and a.is_weight for a, full in info.accumulators_of_node(x)):
        return True
    if depth > 4:
        return False
    node, index = (x.node, x.index) if isinstance(x, Element) else (x, None)
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and index is None:
        # Dynamo's getitem of a foreach op's result (torch 2.11's _foreach_lerp_ polyfill)
        return _is_param(info, element_of(*node.args), acc, depth + 1)
    name = op_name(node)
    args = [element_of(a, index) for a in node.args]
    tensors = [a for a in args if isinstance(a, (fx.Node, Element)) and not is_scalar_like(a)]
    if name in _ALIAS_OPS and tensors:
        return _is_param(info, tensors[0], acc, depth + 1)
    if (name == "mul" and len(tensors) == 1) or (name == "div" and tensors[:1] == args[:1]):
        return len(tensors) == 1 and _is_param(info, tensors[0], acc, depth + 1)
    if name == "sub" and len(args) >= 2:
        return _is_param(info, args[0], acc, depth + 1) and any(
            a is acc for a, _ in info.accumulators_of_node(args[1])
        )
    return False
