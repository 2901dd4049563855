"""One line for an existing training loop: compile an optimizer's step with the backend.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    collage_compile.compile_optimizer(opt)     # opt.step() now runs the collage graph

The step is compiled in place, so every caller of ``opt.step()`` gets it: your loop, a
trainer that holds the optimizer, ``torch.amp.GradScaler.step``, an LR scheduler (which
wraps ``opt.step`` to count calls, before or after this).  ``torch.compile(opt.step,
backend=collage_compile.backend)`` remains the explicit spelling of the same thing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
import weakref
from typing import Any

import torch

from collage_compile.config import CollageConfig

__all__ = ["GradScaler", "compile_optimizer"]

#: every optimizer compile_optimizer compiled, while it lives -> the count of
#: ``torch._dynamo.reset()`` calls when it was last counted in :data:`_since_reset`
_COMPILED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
#: [resets, optimizers that compiled since that reset, dead ones included: the graphs of
#: an optimizer that died stay in Dynamo's cache, and count, until a reset]
_since_reset = [0, 0]
#: the graphs one optimizer may add to a shared step's code: its step, and a second one
#: where a guard of the first changes once (the state a first step creates)
_GRAPHS_PER_OPTIMIZER = 2
_NO_ROOM = contextlib.nullcontext()


def compile_optimizer(optimizer: torch.optim.Optimizer, **options: Any) -> torch.optim.Optimizer:
    """Compile ``optimizer.step`` with the collage backend (``options``: those of
    :func:`collage_compile.make_backend`) and install it as the optimizer's ``step``.

    Returns the optimizer.  A wrapper that holds the optimizer as ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``) has that one compiled, its own step left eager
    (it calls the compiled one).  Calling it again with the same options does nothing; with
    other options it raises ``ValueError`` (a compiled step keeps the options it was
    compiled with: build a new optimizer for others).  ``step(closure)`` calls the
    closure eagerly (with grad enabled, as torch.optim does), then the compiled step, and
    returns the closure's loss; LBFGS, whose step calls its closure repeatedly, is refused.
    A ``fused=True`` optimizer is
    one opaque kernel that no backend can rewrite: a ``ValueError`` says so (build it with
    ``fused=False``; :class:`collage_compile.hf.CollageCallback` switches a trainer's
    default fused AdamW before its first step).

    Its ``state_dict()`` carries the lo of its parameters once :func:`collage_compile.attach`
    is called (without, a CollageWarning says so the first time); a checkpoint of an attached
    optimizer loaded into it restores them, attached or not.

    ``cudagraphs=True``: once a call compiles nothing, the whole step is captured as one
    CUDA graph and replayed, each call checked against what the compiled step would run
    (:mod:`collage_compile.replay`; on a CPU the recorded graphs are called directly).
    """
    from collage_compile import _compat, checkpoint, compiler, names, replay, watch

    inner = checkpoint.unwrap(optimizer)
    if inner is not optimizer:  # the wrapper's own step (gradient sync, skips) stays eager
        compile_optimizer(inner, **options)
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"collage: compile_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if getattr(optimizer.step, "_collage_compiled", False):
        _same_options(optimizer, options)
        return optimizer
    _refuse_untraceable(optimizer)
    names.remember(optimizer)  # its state named in reports
    watch.install()
    _count(optimizer, _compat.dynamo_resets())
    whole = options.get("cudagraphs") is True  # the whole step as one replay
    _compiled_in_copies(optimizer, options)
    options = _as_compiled(options)
    backend = compiler.make_backend(**options) if options else compiler.backend
    compiled = torch.compile(optimizer.step, backend=backend)
    if whole:
        compiled = replay.WholeStep(optimizer, compiled)
    if options.get("mode") != "off":
        watch.expect_compiled(optimizer)
        checkpoint.guard(optimizer)
    _install(optimizer, compiled, options, whole)
    return optimizer


def _refuse_untraceable(optimizer: torch.optim.Optimizer) -> None:
    """A ``ValueError`` for a step no backend can compile as the user runs it: a fused
    kernel, or LBFGS's closure called many times."""
    fused = [i for i, g in enumerate(optimizer.param_groups) if g.get("fused")]
    if fused:
        raise ValueError(
            f"collage: {type(optimizer).__name__}(fused=True) runs one opaque kernel that "
            f"torch.compile does not trace (param_groups {fused}); build it with fused=False "
            "(foreach=True or the default) to have its step upgraded"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "collage: LBFGS calls its closure many times inside step (a line search); "
            "compile_optimizer runs a closure once, before the compiled step, as every other "
            "torch.optim optimizer does"
        )


def _install(
    optimizer: torch.optim.Optimizer, compiled: Any, options: dict[str, Any], whole: bool
) -> None:
    """``compiled`` installed as the optimizer's ``step``: a closure is called eagerly
    before it, and the optimizer keeps room under Dynamo's recompile limit while it runs."""
    first = [True]

    def step(self: torch.optim.Optimizer, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        if first:  # a scheduler made since compile_optimizer is known by now
            _refuse_compiling_in_backward(self)
            first.clear()
            _scheduled_dynamic(self)
            # the dtypes the step runs on (a model cast to bf16 after compile_optimizer)
            _warn_if_nothing_to_upgrade(self, options)
        if closure is None:
            with _room(self):
                return compiled(*args, **kwargs)
        # torch.optim's step calls the closure first, with grad enabled, and returns its
        # loss: done here, outside the compiled step, into which Dynamo would otherwise
        # trace the closure's forward and backward (Lightning passes one on every step)
        with torch.enable_grad():
            loss = closure()
        with _room(self):
            compiled(*args, **kwargs)
        return loss

    step._collage_compiled = True  # type: ignore[attr-defined]
    step._collage_options = CollageConfig.from_options(options)  # type: ignore[attr-defined]
    # the replay of the whole step (cudagraphs=True): its ``replays`` and ``refused``
    step.whole_step = compiled if whole else None  # type: ignore[attr-defined]
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        # an LR scheduler's call-counting wrapper is what got compiled: it still counts
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    step.__doc__ = f"{type(optimizer).__name__}.step, compiled with the collage backend."
    # a bound method, as the attribute was: an LR scheduler created later wraps its __func__
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def _compiled_in_copies(optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> None:
    """A copy of the optimizer (``copy.deepcopy``, or pickled: ``torch.save`` of the
    object) is compiled as it was, with the lo of its tensors and its :func:`attach`.

    torch's ``Optimizer.__getstate__`` keeps ``defaults``, ``state`` and ``param_groups``
    only, so a copy would step with the class's plain ``step`` over weights whose copies
    carry no pair: plain low precision, with nothing left to notice it.  Copy and pickle
    call ``__reduce_ex__``: ``Optimizer``'s (installed once, here) reduces an optimizer
    whose own ``step`` this module compiled through :func:`_rebuild`, and any other as
    ``object`` does (a wrapper that copied the optimizer's ``__dict__`` but has a ``step``
    of its own, Lightning's ``LightningOptimizer``, is copied as before)."""
    optimizer.__dict__["_collage_copy_options"] = dict(options)
    cls = torch.optim.Optimizer
    if "__reduce_ex__" not in cls.__dict__:
        cls.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign,assignment]


def _reduce_ex(self: torch.optim.Optimizer, protocol: int) -> Any:
    step = self.__dict__.get("step")
    options = self.__dict__.get("_collage_copy_options")
    # its own step, compiled here (an LR scheduler made since wraps it, keeping the marks)
    if options is None or not getattr(step, "_collage_compiled", False):
        return object.__reduce_ex__(self, protocol)
    return _reduce_compiled(self, options)


def _reduce_compiled(optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> Any:
    """``(rebuild, args, state)`` for copy and pickle: torch's state, then what
    :func:`_set_compiled_state` needs (the lo travel with their tensors, which copy and
    pickle keep identical to those of ``param_groups`` and ``state``)."""
    from collage_compile import checkpoint, state

    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    for entry in optimizer.state.values():
        if isinstance(entry, dict):
            tensors += [v for v in entry.values() if isinstance(v, torch.Tensor)]
    pairs = [(t, lo) for t in tensors if (lo := state.components(t)[1]) is not None]
    extra = {"options": options, "pairs": pairs, "attached": checkpoint.is_attached(optimizer)}
    return _rebuild, (type(optimizer),), (optimizer.__getstate__(), extra)


def _rebuild(cls: type) -> torch.optim.Optimizer:
    """An empty optimizer of ``cls`` whose state, when copy or pickle sets it, compiles it."""
    new = cls.__new__(cls)
    new.__setstate__ = functools.partial(_set_compiled_state, new)  # type: ignore[method-assign]
    return new


def _set_compiled_state(
    new: torch.optim.Optimizer, both: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    from collage_compile import checkpoint, state

    torch_state, extra = both
    del new.__dict__["__setstate__"]
    new.__setstate__(torch_state)
    for t, lo in extra["pairs"]:
        state.set_lo(t, lo)
    compile_optimizer(new, **extra["options"])
    if extra["attached"]:
        checkpoint.attach(new)


def _room(optimizer: torch.optim.Optimizer) -> Any:
    """Room under Dynamo's recompile limit for every optimizer compiled here, while one of
    them steps.

    All optimizers run the same code (torch.optim's step wrapper, their class's
    ``step``), and Dynamo guards each compiled optimizer by its identity there, counting
    every optimizer's graphs against the one limit of that code (8 by default).  Past it,
    the next optimizer's step ran eagerly: named, but uncompensated.  An optimizer per
    parameter, stepped in a gradient hook (optimizer in backward, torchtune's
    ``optimizer_in_bwd``), compiles one per parameter.  So, while a step compiled here
    runs, the limit is raised by the graphs the other optimizers compiled here may hold
    (:data:`_GRAPHS_PER_OPTIMIZER` each), only where they would not fit under it: the
    limit still stops a step that recompiles on its own.  An optimizer is counted from
    its compile, or after a ``torch._dynamo.reset()`` (which discards every graph) from
    its next step, when it compiles again; one that died is counted until a reset, since
    its graphs stay in Dynamo's cache.  Plain Inductor's optimizers
    get no room; one that fills the limit first is still named
    (``tests/test_fallbacks.py -k never_compiles``)."""
    from collage_compile import _compat

    n = max(len(_COMPILED), _since_reset[1])
    if _GRAPHS_PER_OPTIMIZER * n <= _compat.recompile_limit():
        return _NO_ROOM
    _count(optimizer, _compat.dynamo_resets())  # a step after a reset compiles again
    n = _since_reset[1]
    if _GRAPHS_PER_OPTIMIZER * n <= _compat.recompile_limit():
        return _NO_ROOM
    return _compat.RecompileRoom(_GRAPHS_PER_OPTIMIZER * (n - 1))


def _count(optimizer: torch.optim.Optimizer, resets: int) -> None:
    """Count the optimizer once in :data:`_since_reset` (again after a reset)."""
    if _since_reset[0] != resets:
        _since_reset[:] = [resets, 0]
    if _COMPILED.get(optimizer) != resets:
        _COMPILED[optimizer] = resets
        _since_reset[1] += 1


def _refuse_compiling_in_backward(optimizer: torch.optim.Optimizer) -> None:
    """A first step (which compiles) inside backward, on a torch whose compile there can
    crash the process (:func:`_compat.compiling_in_backward_crashes`): a clear error
    instead of a segfault."""
    from collage_compile import _compat

    if _compat.compiling_in_backward_crashes() and _compat.in_backward():
        raise RuntimeError(
            f"collage: {type(optimizer).__name__}.step is compiled by its first call, and this "
            f"one runs inside backward (a gradient hook: optimizer in backward). On torch "
            f"{_compat.torch_version()} a torch.compile inside backward can crash the process "
            "(a segfault in garbage collection, with any backend); torch 2.13 does not. Step "
            "the optimizer after backward, or use torch 2.13"
        )


def _as_compiled(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as the backend takes them: ``cudagraphs=True`` (the whole step as one
    replay, :mod:`collage_compile.replay`) is the backend's ``"step"``."""
    if options.get("cudagraphs") is True:
        return {**options, "cudagraphs": "step"}
    return options


def _same_options(optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> None:
    """A second ``compile_optimizer`` of the same optimizer: a no-op if it asks for what
    the step was compiled with, else an error (it would be ignored: a user who switched
    from ``mode="off"`` to ``"plus"`` would train uncompensated, unwarned)."""
    compiled = optimizer.step._collage_options
    wanted = CollageConfig.from_options(_as_compiled(options))
    if wanted == compiled:
        return
    differ = ", ".join(
        f"{f.name}={getattr(compiled, f.name)!r} (asked: {getattr(wanted, f.name)!r})"
        for f in dataclasses.fields(compiled)
        if getattr(compiled, f.name) != getattr(wanted, f.name)
    )
    raise ValueError(
        f"collage: {type(optimizer).__name__}.step is compiled already, with other options: "
        f"{differ}. A compiled step keeps its options; build a new optimizer (and "
        "compile_optimizer it once) to change them"
    )


def _scheduled_dynamic(optimizer: torch.optim.Optimizer) -> None:
    """Compile what a scheduler changes (:mod:`collage_compile.schedules`) as symbols from
    the first step, so a schedule costs one compile, not two (Dynamo specializes a float on
    its first value, then recompiles: at warmup from lr = 0 the first graph served one
    step).  Told before the first trace, as here, Dynamo traces the step once; the backend
    would otherwise send the frame back to be traced again
    (:func:`_compat.retrace_with_dynamic_floats`): one more trace of the step."""
    from collage_compile import _compat, schedules

    sources = [
        f"L['self'].param_groups[{i}]" + "".join(f"[{key!r}]" for key in path)
        for i, group in enumerate(optimizer.param_groups)
        for path in schedules.scheduled_floats(group)
    ]
    if sources:
        _compat.dynamic_from_the_first_compile(type(optimizer).step, sources)


def _warn_if_nothing_to_upgrade(optimizer: torch.optim.Optimizer, options: dict[str, Any]) -> None:
    """fp32 parameters need no pair: compiling them changes nothing, which a user who
    asked for collage (``precision="bf16-mixed"`` in Lightning, FSDP2's mixed precision
    over fp32 parameters) must hear about once."""
    from collage_compile.diagnostics import warn_once
    from collage_compile.mcf import LOW_PRECISION

    if options.get("mode") == "off":
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or any(getattr(p, "dtype", None) in LOW_PRECISION for p in params):
        return
    name = type(optimizer).__name__
    dtype = str(params[0].dtype).replace("torch.", "")
    warn_once(
        ("nothing-to-upgrade", name, dtype),
        f"collage: {name} holds no bf16 or fp16 parameter at its first step (they are "
        f"{dtype}): there is nothing to compensate, and its step runs as plain Inductor "
        f"would run it (parameters cast to bf16 later are compensated from then on). For "
        f"bf16 weights without an fp32 copy, make the parameters bf16 (model.to(torch."
        f"bfloat16); Lightning precision='bf16-true'; torchtitan training.dtype='bfloat16').",
        stacklevel=4,
    )


def _grad_scaler() -> type:
    from collage_compile import _compat

    return _compat.fp16_grad_scaler()


#: ``torch.amp.GradScaler`` for fp16 *parameters*: it unscales fp16 gradients, which
#: torch's refuses (see :func:`collage_compile._compat.fp16_grad_scaler`).  Use it with
#: :func:`compile_optimizer`, so that ``scaler.step(opt)`` calls the compiled step.
GradScaler = _grad_scaler()
