"""Steps that run without a collage graph are found and named: never a silent fallback.

A tensor carrying a (hi, lo) pair is compensated only while graphs compiled by the
backend update it.  When something else does (``opt.step`` called uncompiled,
``torch.compiler.disable``, a graph break that leaves the step to eager, Dynamo's
recompile limit, another backend), the update is plain low precision and the user must
hear about it.  Three watchers, installed once when the backend is first asked for:

1. **Optimizer steps.**  A check that runs after every optimizer step, compiled or not,
   without a graph break or a guard (:func:`_compat.after_every_optimizer_step`: a custom
   op where torch.optim's step wrapper calls its profiler entry point, recorded into the
   compiled step; the collage backend takes it out of its graphs and runs the check from
   its wrapper after every call, so the graph runs no Python and can be captured as a
   CUDA graph).  Every call of a collage graph first adds
   the tensors it writes to each optimizer's window; the check compares the window with
   the optimizer's parameters that carry a pair and have a gradient.  One no collage graph
   wrote was stepped without one: a :class:`CollageWarning` names the optimizer, the
   parameters and the likely cause.  Their lo is *kept*: the eager step was a valid plain
   update of hi, and lo still holds what earlier steps left in it (zeroing it would lose
   that too), so the next compiled step resumes from hi + lo.  The check also warns about
   input no graph can upgrade (``fused=True``, complex32, sparse gradients, an untraceable
   Adafactor).  Cost per step: a few set operations, whatever the model size.
   An optimizer ``compile_optimizer`` compiled is also checked before its weights carry
   a pair: a step in which no collage graph wrote any of its low-precision weights that
   have a gradient is named (its step never compiled: Dynamo's recompile limit on
   torch.optim's code, which every optimizer shares, filled by others).  So is any other
   optimizer's step that wrote none of its low-precision weights where collage was
   asked for them: its step's own code ran in a collage graph (a graph break left the
   body to eager), or collage graphs read those weights (the model compiled with the
   backend, the step not).
2. **Dynamo's recompile limit.**  When Dynamo gives up on a function whose graphs the
   backend compiled (its ``recompile_limit`` warning), a CollageWarning names the tensors
   those graphs upgrade: calls that match none of the compiled graphs now run eagerly.
3. **Writes outside a step.**  After each optimizer step, a bounded number of the recorded
   pairs (round robin) have their version counter compared with the one recorded after
   their last compiled update: an EMA updated eagerly, or a ``load_state_dict`` without
   :func:`collage_compile.attach`, is named in a CollageWarning.  The next compiled step
   that reads such a tensor restarts its lo from zero (the lo belonged to the old values),
   and :func:`collage_compile.value` ignores it from the write on.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, ClassVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from collage_compile import _compat, diagnostics, names, state
from collage_compile.diagnostics import warn_once
from collage_compile.mcf import LOW_PRECISION

__all__ = ["compiled_frame", "install", "record_call"]

_installed = False
_install_lock = threading.Lock()

# ids of the tensors each collage graph call wrote, in call order; _calls[0] is call
# number _first[0].  An optimizer's window is the calls since its last step: one log for
# all, so a call costs the same however many optimizers there are (one per parameter,
# stepped in backward, make hundreds)
_calls: list[frozenset[int]] = []
_first = [0]
# optimizer -> the number of the first call of its window
_windows: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# a window longer than this belongs to an optimizer no longer stepped: not judged
_WINDOW_LIMIT = 4096
# optimizer -> (registry epoch, parameter count, ids of parameters carrying a pair, id -> param)
_expected: weakref.WeakKeyDictionary[Any, tuple[int, int, frozenset[int], dict[int, Any]]] = (
    weakref.WeakKeyDictionary()
)
# "'step' (file:line)" -> (names, ids) of the tensors the collage graphs of that frame upgrade
_frames: dict[str, tuple[list[str], set[int]]] = {}
# how many torch._dynamo.reset() calls had been made when _frames was last added to: a
# reset discards every compiled graph, and a later recompile limit is another backend's
_frames_reset = [0]
# ids of tensors already named in a recompile-limit warning (not named again per step)
_limit_named: set[int] = set()
# optimizer -> parameter count when its input was last checked
_checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# optimizers compile_optimizer compiled: every step must write their low-precision weights,
# whose ids are kept with the parameter count they were read at
_compiled_optimizers: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)
# optimizers compile_optimizer compiled -> {id(weight): its version counter} then: a step
# that writes no weight (ADOPT's first) is told from one that ran without a graph
_versions_at_compile: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
# optimizers whose last step was let off as one that made state alone -> (weight, the
# graph's outputs that may be its new state), checked at the next step: Dynamo stores
# new state only after the call, and a step post-hook's outputs share the graph
_made_pending: weakref.WeakKeyDictionary[Any, list[tuple[Any, list[Any]]]] = (
    weakref.WeakKeyDictionary()
)
# the outputs of the collage graph whose optimizer ticks run now (the new tensors a step
# made, which Dynamo stores as state after the call): set by the graph's wrapper
step_outputs: list[Any] = [()]
# low-precision tensors that collage graphs (not mode="off") read as parameters (_READ)
# or write (_WRITTEN) -> those flags, and a count of changes (an optimizer's cached
# answer is read again when it moves)
_by_graphs: WeakIdKeyDictionary = WeakIdKeyDictionary()
_by_graphs_epoch = [0]
# optimizers not compiled by compile_optimizer -> _plain_candidates' answer
_plain_optimizers: weakref.WeakKeyDictionary[Any, tuple[int, int, frozenset[int], bool, bool]] = (
    weakref.WeakKeyDictionary()
)
# optimizers named for input no graph can upgrade (fused=True, sparse gradients, ...)
_input_named: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# recompile-limit events seen: (function, limit, value, last reason)
_limits: list[tuple[str, str, str, str]] = []
# pairs checked per optimizer step for writes outside a step (round robin)
SWEEP_BUDGET = 16


def install() -> None:
    """Install the watchers (once; never at import)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _compat.after_every_optimizer_step(_after_step)
        _compat.on_recompile_limit(_recompile_limit_hit)
        _compat.on_cudagraph_skip(_cudagraph_skipped)
        _compat.trace_math_pow_symbolically()  # not a watcher: the same once-only set-up
        _installed = True


class _InCall:
    """Collage graph calls and compiles in progress, each with what it updates (the
    tensors, or the compiled frame): a step's check that runs inside a call (the
    optimizer step and the check in one graph) must not read the version counters of the
    tensors that call is writing, which it stamps only when it returns; a CUDA graph
    Inductor skips while one is in progress is named by it."""

    depth = 0
    shown: ClassVar[list[str]] = []  # innermost last
    _next = ""

    def __call__(self, shown: str) -> _InCall:
        _InCall._next = shown
        return self

    def __enter__(self) -> None:
        _InCall.depth += 1
        _InCall.shown.append(_InCall._next)

    def __exit__(self, *exc: Any) -> None:
        _InCall.depth -= 1
        _InCall.shown.pop()


in_call = _InCall()


def record_call(ids: frozenset[int]) -> None:
    """A collage graph is writing the tensors with these ids (called before every call)."""
    _calls.append(ids)
    if len(_calls) > 2 * _WINDOW_LIMIT:  # no window reaches back that far
        del _calls[:_WINDOW_LIMIT]
        _first[0] += _WINDOW_LIMIT


def _take_window(optimizer: Any) -> list[frozenset[int]] | None:
    """The calls since the optimizer's last step (None: not watched until now, or too
    long ago), and its next window begun."""
    start = _windows.get(optimizer)
    end = _first[0] + len(_calls)
    _windows[optimizer] = end
    if start is None or end - start > _WINDOW_LIMIT:
        return None
    return _calls[start - _first[0] :]


def compiled_frame(frame: str | None, upgraded: list[tuple[str, int | None]]) -> None:
    """The backend compiled a graph of ``frame`` that upgrades these tensors (name, id)."""
    if frame is not None and upgraded:
        _forget_frames_after_reset()
        shown, ids = _frames.setdefault(frame, ([], set()))
        shown.extend(n for n, _ in upgraded if n not in shown)
        ids.update(i for _, i in upgraded if i is not None)


def _forget_frames_after_reset() -> None:
    """Drop the frames recorded before a ``torch._dynamo.reset()``: their graphs are gone."""
    resets = _compat.dynamo_resets()
    if resets != _frames_reset[0]:
        _frames.clear()
        _limit_named.clear()
        _limits.clear()
        _frames_reset[0] = resets


def expect_compiled(optimizer: Any) -> None:
    """``compile_optimizer`` compiled this optimizer's step: from its first step on, a
    step in which no collage graph wrote any of its low-precision weights that have a
    gradient ran without one, pairs or not (:func:`_uncompiled_step`)."""
    _compiled_optimizers[optimizer] = (-1, frozenset())
    _versions_at_compile[optimizer] = {id(p): p._version for p in _low_params(optimizer)}
    _windows.setdefault(optimizer, _first[0] + len(_calls))


def reset() -> None:
    """Forget what was watched (tests; a fresh start).  The hook stays installed."""
    _windows.clear()
    _calls.clear()
    _compiled_optimizers.clear()
    _versions_at_compile.clear()
    _made_pending.clear()
    _expected.clear()
    _frames.clear()
    _limit_named.clear()
    _checked.clear()
    _limits.clear()
    _by_graphs.clear()
    _plain_optimizers.clear()
    _input_named.clear()


# ----------------------------------------------------------------------- optimizer hooks


def _after_step(optimizer: Any, by_collage: bool | None = None) -> None:
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _checked.get(optimizer) != count:
        _check_input(optimizer)
        _checked[optimizer] = count
    window = _take_window(optimizer)
    if window is not None:  # None: its first step since the watch began (nothing to compare)
        written = frozenset().union(*window)
        expected, by_id = _pair_params(optimizer)
        missing = expected - written
        if missing:
            stepped = [by_id[i] for i in missing if by_id[i].grad is not None]
            if stepped:
                _eager_step(optimizer, stepped, len(expected))
        if optimizer in _compiled_optimizers:
            _uncompiled_step(optimizer, written, count, by_collage)
        else:
            _plain_step(optimizer, written, count, by_collage)
    if not _InCall.depth:
        _sweep()


def read_by_graph(example_inputs: Any) -> None:
    """A collage graph (not ``mode="off"``) reads these: its low-precision parameters are
    meant to be compensated (:func:`_plain_step`)."""
    _note(example_inputs, _READ)


def written_by_graph(tensors: Any) -> None:
    """A collage graph (not ``mode="off"``) writes these, upgraded or named as it compiles
    (a write it cannot carry has its own warning, :func:`_plain_step` says nothing more)."""
    _note(tensors, _WRITTEN)


_READ, _WRITTEN = 1, 2


def _note(tensors: Any, flag: int) -> None:
    added = False
    for t in tensors:
        if (
            isinstance(t, torch.Tensor)
            and t.dtype in LOW_PRECISION
            and not _compat.is_fake(t)
            and (flag == _WRITTEN or isinstance(t, torch.nn.Parameter))
            and not _by_graphs.get(t, 0) & flag
        ):
            _by_graphs[t] = _by_graphs.get(t, 0) | flag
            added = True
    if added:
        _by_graphs_epoch[0] += 1


# param_groups keys of optimizers that compensate bf16 by themselves: optimi's Kahan
# summation, torchao's bf16 stochastic rounding
_SELF_COMPENSATING = ("kahan_sum", "bf16_stochastic_round")


def _plain_step(
    optimizer: Any, written: frozenset[int], count: int, by_collage: bool | None
) -> None:
    """A step of an optimizer ``compile_optimizer`` did not compile, in which no collage
    graph wrote any of its low-precision weights (none carrying a pair yet:
    :func:`_eager_step` names those), named once where the user asked collage for them:
    the step's own code ran in a collage graph (``torch.compile(opt.step,
    backend="collage")`` whose body Dynamo left to eager at a graph break), or the weights
    are read by collage graphs (a model compiled with ``backend="collage"``, a whole
    step whose ``opt.step`` ran under ``torch.compiler.disable``).  Not for a step
    compiled with ``mode="off"``, weights a collage graph wrote (its own warnings name
    what it could not carry), an optimizer named for its input or one that compensates
    by itself (:data:`_SELF_COMPENSATING`).  Per step, one dictionary lookup and one set
    operation in C; after the warning, the lookup alone."""
    if by_collage is False:
        return  # compiled with mode="off": no compensation asked for
    cached = _plain_optimizers.get(optimizer)
    if cached is None or cached[0] != count or cached[1] != _by_graphs_epoch[0]:
        cached = _plain_candidates(optimizer, count)
    ids, read, named = cached[2], cached[3], cached[4]
    if named or not ids or not (by_collage or read) or not written.isdisjoint(ids):
        return
    low = _low_params(optimizer, stepped=True)
    if not low or any(state.get_lo(p) is not None for p in low):
        return  # none stepped, or carrying pairs: _eager_step named them
    _plain_optimizers[optimizer] = (*cached[:4], True)  # named once: no more work per step
    _warn_plain_step(optimizer, low, by_collage is True)


def _plain_candidates(optimizer: Any, count: int) -> tuple[int, int, frozenset[int], bool, bool]:
    """(count, epoch, ids of the low-precision weights to check, whether collage graphs
    read any of them, nothing to name), cached in :data:`_plain_optimizers`."""
    low = _low_params(optimizer)
    exempt = (
        optimizer in _input_named
        or getattr(optimizer.step, "_collage_compiled", False)  # compile_optimizer, mode="off"
        or any(g.get(key) for g in optimizer.param_groups for key in _SELF_COMPENSATING)
        or any(_by_graphs.get(p, 0) & _WRITTEN for p in low)
    )
    read = any(_by_graphs.get(p, 0) & _READ for p in low)
    previous = _plain_optimizers.get(optimizer)
    named = exempt or (previous is not None and previous[4])
    cached = (count, _by_graphs_epoch[0], frozenset(map(id, low)), read, named)
    _plain_optimizers[optimizer] = cached
    return cached


def _warn_plain_step(optimizer: Any, low: list[Any], ticked: bool) -> None:
    if ticked:
        why = (
            "its step's code was compiled with the collage backend, but the update itself "
            "ran eagerly: Dynamo could not trace the step's body (a graph break inside its "
            "loop: Tensor.item(), print, data-dependent Python; TORCH_LOGS=graph_breaks "
            "shows it)"
        )
    else:
        why = (
            "graphs compiled with the collage backend read them (a model compiled with "
            'backend="collage"), but this step ran outside every collage graph: the '
            "optimizer's step was not compiled with the backend, or torch.compiler.disable "
            "or a graph break left it to eager"
        )
    warn_once(
        ("plain-step", str(id(optimizer))),
        f"collage: {type(optimizer).__name__}.step ran without a graph compiled by the "
        f"collage backend: {len(low)} {_dtype(low)} parameters with a gradient "
        f"({names.of_params(optimizer, low)}) {_updated_plainly(low)}, uncompensated. "
        f"Cause: {why}. The backend compensates the updates inside the graphs it compiles: "
        "collage_compile.compile_optimizer(opt), or a step function that calls opt.step() "
        'compiled with backend="collage" and traceable. An optimizer meant to run plain '
        '(or that compensates by itself) can be compiled with mode="off", or this '
        "warning filtered.",
        stacklevel=5,
    )


def _pair_params(optimizer: Any) -> tuple[frozenset[int], dict[int, Any]]:
    """Ids of the optimizer's parameters that carry a pair (cached until one gains or
    loses its pair, or the optimizer gains parameters)."""
    epoch = state.epoch()
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    cached = _expected.get(optimizer)
    if cached is not None and cached[0] == epoch and cached[1] == count:
        return cached[2], cached[3]
    by_id = {
        id(p): p
        for g in optimizer.param_groups
        for p in g["params"]
        if isinstance(p, torch.Tensor) and state.get_lo(p) is not None
    }
    _expected[optimizer] = (epoch, count, frozenset(by_id), by_id)
    return frozenset(by_id), by_id


def _eager_step(optimizer: Any, params: list[Any], carrying: int) -> None:
    """``params`` (carrying pairs) were stepped without a collage graph: keep their lo as
    the lo of the new hi, and say so once per optimizer.  Those no longer low precision
    (``module.float()``) need no pair: :func:`_widened` names them instead."""
    widened = [p for p in params if p.dtype not in LOW_PRECISION]
    if widened:
        _widened(optimizer, widened)
        params = [p for p in params if p.dtype in LOW_PRECISION]
        if not params:
            return
    for p in params:
        for t in [p, *_state_tensors(optimizer, p)]:
            lo = state.get_lo(t)
            if lo is not None:
                state.stamp(t, lo)  # the step was a valid update of hi: not an outside write
    if all(id(p) in _limit_named for p in params):
        return  # the recompile-limit warning named them already
    shown = names.of_params(optimizer, params)
    warn_once(
        ("eager-step", str(id(optimizer))),
        f"collage: {type(optimizer).__name__}.step ran without a graph compiled by the collage "
        f"backend: {len(params)} of its {carrying} parameters that carry a (hi, lo) pair "
        f"({shown}) {_updated_plainly(params)}. Cause: "
        f"{_limit_of_class(optimizer) or _cause(params)}. Their lo is kept "
        "and the next compiled step resumes from hi + lo. "
        f"To stay compensated, call the compiled step every time "
        f"(step = torch.compile(opt.step, backend=collage_compile.backend), or "
        f"collage_compile.compile_optimizer(opt)).",
        stacklevel=4,
    )


def _widened(optimizer: Any, params: list[Any]) -> None:
    """Parameters that carried a pair became float32 (``module.float()``): their step is
    fp32 arithmetic, which needs no pair, but the part of their value the lo held is gone
    (the widening kept hi alone).  Their lo is dropped, and that is said once."""
    shown = names.of_params(optimizer, params)
    for p in params:
        state.unpair(p)
    warn_once(
        ("widened", str(id(optimizer)), shown),
        f"collage: {len(params)} parameters of {type(optimizer).__name__} that carried a "
        f"(hi, lo) pair are now {_dtype(params)} ({shown}): module.float() or param.data = "
        "... widened hi alone, and what each lo held (up to half a bf16 ulp per element) was "
        f"lost. They need no pair and train in {_dtype(params)} from here on. To widen "
        "without that loss, collage_compile.convert(model, torch.float32) keeps hi + lo.",
        stacklevel=5,
    )


def _uncompiled_step(
    optimizer: Any, written: frozenset[int], count: int, by_collage: bool | None
) -> None:
    """A step of an optimizer ``compile_optimizer`` compiled in which no collage graph
    wrote any of its low-precision weights with a gradient: it ran without one, also
    where no weight carries a pair yet (the step never compiled: Dynamo's recompile
    limit for the step's code, which every optimizer of the class shares, filled by
    others), so :func:`_eager_step` would see nothing to compare.  Named once, unless
    the step wrote no weight at all (:func:`_made_state_alone`).  Per step, one set
    operation in C (the weights' ids are read again when their count changes): the
    replay's host work does not grow with the tensor count."""
    if _made_pending:
        _check_made_state(optimizer)
    seen, ids = _compiled_optimizers[optimizer]
    if seen != count:
        ids = frozenset(map(id, _low_params(optimizer)))
        _compiled_optimizers[optimizer] = (count, ids)
    if not ids or not written.isdisjoint(ids):
        return
    low = _low_params(optimizer, stepped=True)
    if not low or any(id(p) in written for p in low):
        return
    if all(state.get_lo(p) is not None for p in low):
        return  # carrying pairs: _eager_step named them
    if by_collage and _made_state_alone(optimizer, low):
        return
    _warn_uncompiled(optimizer, low, "this step")


def _warn_uncompiled(optimizer: Any, low: list[Any], which: str, stacklevel: int = 5) -> None:
    warn_once(
        ("uncompiled-step", str(id(optimizer))),
        f"collage: {type(optimizer).__name__}.step was compiled by compile_optimizer, but "
        f"{which} ran without a graph compiled by the collage backend: {len(low)} of its "
        f"{_dtype(low)} parameters with a gradient ({names.of_params(optimizer, low)}) "
        f"{_updated_plainly(low)}. Cause: {_limit_of_class(optimizer) or _cause(low)}.",
        stacklevel=stacklevel,
    )


def _check_made_state(optimizer: Any) -> None:
    """The step before was let off as one that made its state alone
    (:func:`_made_state_alone`): each weight's state must now hold one of the tensors
    that step's graph returned, else they were something else (a step post-hook's copy
    of the weights) and that step is named."""
    pending = _made_pending.pop(optimizer, None)
    if pending is None:
        return
    unmade = [
        p
        for p, outs in pending
        if not any(t is o for t in _state_tensors(optimizer, p) for o in outs)
    ]
    if unmade:
        _warn_uncompiled(optimizer, unmade, "the step before this one", stacklevel=6)


def _made_state_alone(optimizer: Any, low: list[Any]) -> bool:
    """Whether a compiled step made its state and wrote none of its weights (ADOPT's
    first step only fills its second moment): the step's code ran in a collage graph,
    which made a new tensor of each stepped weight's shape and dtype (new state, stored by
    Dynamo after the call), and no weight's version counter moved since
    ``compile_optimizer``.  A step run eagerly writes its weights in place (their
    versions move) or through ``p.data`` (timm's AdamP: no version moves), and then makes
    its state itself.  State written in place is no such evidence: a weight update left
    to eager code through ``p.data`` beside it would never be named.  Nor is an output
    alone (a step post-hook traced into the same graph returns its copy of the weights):
    the next step checks that the state holds it (:func:`_check_made_state`)."""
    versions = _versions_at_compile.get(optimizer)
    if versions is None or any(versions.get(id(p)) != p._version for p in low):
        return False
    made = Counter(
        (tuple(t.shape), t.dtype)
        for t in step_outputs[0]
        if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION
    )
    for p in low:
        key = (tuple(p.shape), p.dtype)
        if made[key] <= 0:
            return False
        made[key] -= 1
    outs = [t for t in step_outputs[0] if isinstance(t, torch.Tensor)]
    _made_pending[optimizer] = [
        (p, [t for t in outs if t.shape == p.shape and t.dtype == p.dtype]) for p in low
    ]
    return True


def _low_params(optimizer: Any, stepped: bool = False) -> list[Any]:
    """The optimizer's bf16/fp16 parameters (``stepped``: those with a gradient)."""
    return [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if getattr(p, "dtype", None) in LOW_PRECISION and (not stepped or p.grad is not None)
    ]


def _dtype(params: list[Any]) -> str:
    return str(params[0].dtype).replace("torch.", "")


def _updated_plainly(params: list[Any]) -> str:
    """What a step without a collage graph did to ``params``, in both warnings' words."""
    return (
        f"were updated in plain {_dtype(params)} arithmetic, which drops updates below half an ulp"
    )


def _limit_of_class(optimizer: Any) -> str | None:
    """A recompile limit hit for code of torch.optim (its step wrapper, a class's step):
    every optimizer runs that code and each compiled one adds graphs of its own (Dynamo
    guards on the optimizer object), so others' compiles count toward the limit."""
    _forget_frames_after_reset()  # a limit hit before a reset is not this step's cause
    for name, limit, value, reason in reversed(_limits):
        if "/torch/optim/" in name.replace("\\", "/"):
            return (
                f"torch.compile hit config.{limit} ({value}) for {name} (last reason: "
                f"{reason}): every optimizer runs that code and each one compiled adds graphs "
                "of its own, and a call that matches none of them runs eagerly (optimizers "
                "compiled by compile_optimizer leave room for each other; others, such as "
                "torch.compile(opt.step), do not). Raise "
                f"torch._dynamo.config.{limit} above the number of optimizers you compile"
            )
    return None


def _state_tensors(optimizer: Any, p: Any) -> list[torch.Tensor]:
    return [
        v
        for v in (optimizer.state.get(p) or {}).values()
        if isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION
    ]


def _cause(params: list[Any]) -> str:
    ids = {id(p) for p in params}
    for function, limit, value, reason in reversed(_limits):
        if function not in _frames or not ids & _frames[function][1]:
            continue
        return (
            f"torch.compile hit config.{limit} ({value}) for {function} (last reason: "
            f"{reason}), so calls that match none of its compiled graphs run eagerly"
        )
    return (
        "the step ran outside every graph compiled by the collage backend: an uncompiled "
        "call of opt.step, torch.compiler.disable around it, a graph break that left it to "
        "eager, torch.compile falling back to eager, or another backend "
        '(TORCH_LOGS="graph_breaks,recompiles" shows which)'
    )


# --------------------------------------------------------------------- recompile limit


def _recompile_limit_hit(function: str, limit: str, value: str, reason: str) -> None:
    _forget_frames_after_reset()
    _limits.append((function, limit, value, reason))
    del _limits[:-64]
    if function not in _frames:
        return
    upgraded, ids = _frames[function]
    if ids and not state.any_registered(ids):
        # the tensors its collage graphs upgraded are gone (a model trained, deleted and
        # torch._dynamo.reset(): the same code compiled again, maybe by another backend)
        del _frames[function]
        return
    _limit_named.update(ids)
    shown = _listed(upgraded)
    warn_once(  # per set of tensors and reset: a new run's after a reset is named too
        ("recompile-limit", function, str(sorted(ids)), str(_frames_reset[0])),
        f"collage: torch.compile hit config.{limit} ({value}) for {function} (last reason: "
        f"{reason}). A call of it that matches none of its compiled graphs now runs eagerly, "
        f"and the tensors its collage graphs upgrade ({shown}) are then updated in plain low "
        f"precision. A hyperparameter changed as a Python float between calls is kept dynamic "
        f"by the backend; look for what else changes (TORCH_LOGS=recompiles), or raise "
        f"torch._dynamo.config.{limit}.",
        stacklevel=2,
    )


# --------------------------------------------------------------------- CUDA graph skips


def _cudagraph_skipped(reason: str) -> None:
    """Inductor did not capture a graph as a CUDA graph; named when a collage graph is
    being compiled or called (``cudagraphs=True``): it stays compensated but pays the
    host work of every kernel launch, which is what the option was asked to remove."""
    if not _InCall.shown:
        return
    shown = _InCall.shown[-1]
    warn_once(
        ("cudagraph-skip", shown, reason.split("\n")[0][:200]),
        f"collage: Inductor did not capture {shown} as a CUDA graph ({reason.strip()}). "
        f"Its updates stay compensated; it runs kernel by kernel, each launched from the "
        f"host, as without cudagraphs=True. TORCH_LOGS=cudagraphs shows where.",
        stacklevel=2,
    )


def cudagraphs_on_cpu(shown: str) -> None:
    """``cudagraphs=True`` for a graph with no CUDA tensor: said once."""
    warn_once(
        ("cudagraph-cpu",),
        f"collage: cudagraphs=True (or mode='reduce-overhead') captures CUDA work as CUDA "
        f"graphs; {shown} has no CUDA tensor, so it runs as compiled, without capture.",
        stacklevel=3,
    )


# ------------------------------------------------------------------ writes outside a step


def _sweep() -> None:
    written = state.sweep(SWEEP_BUDGET)
    for owner, why in written:
        if owner is None:
            continue
        outside_writes([names.display(owner, f"tensor {tuple(owner.shape)}")], why)


# writes from outside seen this many times, per what the warning names, are said again:
# a write on every step (SAM's perturbation undone eagerly, a hook after the step)
_RECURRING = 3


def _listed(shown: list[str]) -> str:
    """The first four names, and how many more."""
    return ", ".join(shown[:4]) + (f", and {len(shown) - 4} more" if len(shown) > 4 else "")


def outside_writes(shown: list[str], why: str, key: str | None = None) -> None:
    """Tensors carrying a pair were written outside a compiled step (found by the sweep or
    by a compiled step's check, ``key`` naming the graph): say so once, and once more
    when it recurs (each write restarts lo: a write every step leaves no compensation)."""
    listed = _listed(shown)
    count = diagnostics.occurrence(("outside-write", key or shown[0]))
    if count == _RECURRING:
        warn_once(
            ("outside-write-recurs", key or shown[0]),
            f"collage: {listed} {'was' if len(shown) == 1 else 'were'} written outside every "
            f"collage-compiled step again, {count} times now: each such write restarts "
            f"the lo, so a write on every step (a perturbation undone eagerly, as SAM's; a "
            f"hook after the step) leaves the tensor uncompensated. Compile the code that "
            f"writes it with the backend (torch.compile(fn, backend='collage')).",
            stacklevel=3,
        )
    warn_once(
        ("outside-write", key or shown[0]),
        f"collage: {listed} carrying a (hi, lo) pair {'was' if len(shown) == 1 else 'were'} "
        f"written outside every collage-compiled step ({why}): an update that ran eagerly "
        f"(an EMA or optimizer step not compiled with the backend: plain low precision), or "
        f"a write such as load_state_dict, fill_ or copy_. Its lo belonged to the old "
        f"values and restarts from zero at the next compiled step, unless an optimizer step "
        f"is found to have made that write (a warning then says so, and lo is kept: the "
        f"step updated hi). To keep lo across a load use collage_compile.attach "
        f"or collage_compile.set_value; compile every update with the backend.",
        stacklevel=3,
    )


def restored(shown: list[str], dtype: str) -> None:
    """Weights a collage graph overwrote from a tensor without a pair (a snapshot of hi)
    after they were updated, :data:`compiler._RESTORES_NAMED` times: said once per set of
    weights (a graph compiled again counts afresh and would say it again)."""
    listed = _listed(shown)
    warn_once(
        ("restored", *shown),
        f"collage: {listed} {'was' if len(shown) == 1 else 'were'} overwritten with another "
        f"tensor's values after being updated, again and again (a copy_ of a snapshot: "
        f"L-BFGS's strong_wolfe line search restoring its weights, a rollback, a swap). A "
        f"snapshot holds hi alone: each overwrite sets hi and restarts lo from zero, so the "
        f"compensation built until then is dropped, and a weight restored on every step is "
        f"no better than plain {dtype}. Save and restore the pair instead "
        f"(saved = collage_compile.value(p); collage_compile.set_value(p, saved)), or keep "
        f"these weights in fp32.",
        stacklevel=3,
    )


# ----------------------------------------------------------------- input that cannot be upgraded


def _check_input(optimizer: Any) -> None:
    """Warnings for what no graph can upgrade (fused kernels, complex32, sparse gradients,
    an untraceable Adafactor), and the checkpoint hooks of every optimizer that steps
    (:func:`checkpoint.guard`); runs after its first step and when its parameters change."""
    from collage_compile import checkpoint

    if _low_params(optimizer):
        checkpoint.guard(optimizer, compiled=False)
        names.remember(optimizer)
    for g, group in enumerate(optimizer.param_groups):
        low = False
        for i, p in enumerate(group["params"]):
            dtype = getattr(p, "dtype", None)
            if dtype == torch.complex32:
                _input_named[optimizer] = True
                _warn_param("complex", type(optimizer).__name__, g, i, tuple(p.shape))
            elif dtype in LOW_PRECISION:
                low = True
                grad = p.grad
                if grad is not None and grad.layout != torch.strided:
                    _input_named[optimizer] = True
                    _warn_param("sparse", type(optimizer).__name__, g, i, tuple(p.shape))
        if not low:
            continue
        if group.get("fused"):
            _input_named[optimizer] = True
            _warn_fused(type(optimizer).__name__)
            return
        if isinstance(optimizer, torch.optim.Adafactor) and not _compat.captures_scalar_outputs():
            _input_named[optimizer] = True
            _warn_untraced(type(optimizer).__name__)
            return


_PARAM_REASONS = {
    "complex": "is complex32: a (hi, lo) pair is real-valued, so its updates run as written, "
    "in plain fp16 complex arithmetic (updates below half an ulp are lost)",
    "sparse": "has a sparse gradient: Dynamo does not trace sparse tensors, so this step runs "
    "eagerly and the parameter is updated in plain low precision (updates below half an ulp "
    "are lost); use a dense gradient (e.g. nn.Embedding(sparse=False)) to have it upgraded",
}


def _warn_param(kind: str, opt: str, group: int, index: int, shape: tuple[int, ...]) -> None:
    warn_once(
        (kind, opt, str(group), str(index)),
        f"collage: {opt} param_groups[{group}].params[{index}] {shape} {_PARAM_REASONS[kind]}",
        stacklevel=5,
    )


def _warn_fused(name: str) -> None:
    warn_once(
        ("fused", name),
        f"collage: {name}(fused=True) runs one opaque kernel that torch.compile does not trace, "
        f"so its bf16/fp16 parameters are updated in plain low precision (updates below half "
        f"an ulp are lost); construct it with foreach=True (or foreach=False) to have collage "
        f"upgrade it",
        stacklevel=5,
    )


def _warn_untraced(name: str) -> None:
    warn_once(
        ("untraced", name),
        f"collage: {name}.step calls Tensor.item(), so torch.compile skips it (it runs eagerly "
        f"and its bf16/fp16 parameters are updated in plain low precision) unless "
        f"torch._dynamo.config.capture_scalar_outputs = True",
        stacklevel=5,
    )
