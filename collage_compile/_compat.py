"""The one door to private torch APIs (Dynamo, AOTAutograd, Inductor internals).

Checked on torch 2.13.0 (CPU wheel, C++ codegen) and on torch 2.11.0, the GPU image's (its
CUDA build run on a CPU: C++ codegen and Triton's interpreter, ``tools/torch211.sh``); the
CUDA-only paths are written against 2.11's source and not yet run on a GPU.  Where a function
below says "written for 2.11", the suite has since run it there.  When torch changes, this
file changes; nothing else in the package
imports ``torch._dynamo``, ``torch._inductor``, ``torch._guards`` or ``torch._subclasses``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

CHECKED_TORCH_VERSIONS = ("2.11", "2.13")


def current_frame() -> str | None:
    """The function Dynamo is compiling now, as its recompile-limit warning names it
    (``'step' (/path/adam.py:214)``); None outside a Dynamo compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:
        return None
    return f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"


# id -> weakref of every optimizer (the tick op gets the id, a constant in a compiled graph)
_optimizers: dict[int, Any] = {}
# the function called after every step (set once by after_every_optimizer_step), with
# whether the collage backend's wrapper called it (the step's code ran in a collage graph)
_after_step: list[Callable[[Any, bool | None], None]] = []


def after_every_optimizer_step(fn: Callable[[Any, bool | None], None]) -> None:
    """Call ``fn(optimizer, by_collage)`` after every ``torch.optim`` step, compiled or not,
    at run time (``by_collage``: called by the wrapper of a graph the collage backend
    compiled, :func:`run_step_ticks`).

    torch.optim's step wrapper calls ``self._optimizer_step_code()`` (an empty method, the
    profiler's entry point) right after the step.  Ours first calls the custom op
    ``collage::optimizer_stepped(id(self), ticks)``, whose implementation calls ``fn``:
    eagerly it runs there and then; traced by Dynamo it becomes a node of the graph (it
    mutates ``ticks``, a counter, so no pass may drop it), executed on every call of the
    compiled step by every other backend.  The collage backend takes the node out of its
    graphs and calls ``fn`` from its wrapper after the graph (:func:`take_step_ticks`):
    a graph then holds no op that runs Python or writes a CPU tensor, which would keep
    Inductor from capturing a CUDA step as a CUDA graph.  No graph break, no guard beyond
    the optimizer's identity, which Dynamo guards anyway: ``fullgraph=True`` keeps
    working, for every backend.  (A global step post-hook would not do: one that runs
    eagerly needs ``torch.compiler.disable``, a graph break inside the hook loop, which
    makes Dynamo skip the wrapper frame and trace the step alone, and fails
    ``fullgraph=True``.)  Checked on 2.13 and written for 2.11
    (``Optimizer.profile_hook_step``, ``Optimizer._patch_step_function``,
    ``torch.library.custom_op``)."""
    import gc

    cls = torch.optim.Optimizer
    original = cls._optimizer_step_code
    if getattr(original, "_collage", False):
        return
    _after_step.append(fn)
    # Every optimizer is entered when it is built (``__init__`` and ``__setstate__`` call
    # ``_patch_step_function``) or, if it already exists, now.
    ticks = torch.zeros((), dtype=torch.int64)
    for obj in gc.get_objects():
        if issubclass(type(obj), cls):  # type(), not isinstance: no __class__ property runs
            _enter(obj)
    patch_step = cls._patch_step_function

    def _patch_step_function(self: Any) -> None:
        _enter(self)
        patch_step(self)

    @torch.library.custom_op("collage::optimizer_stepped", mutates_args=("ticks",))
    def optimizer_stepped(key: int, ticks: torch.Tensor) -> None:
        ticks.add_(1)
        run_step_ticks((key,))

    @optimizer_stepped.register_fake
    def _(key: int, ticks: torch.Tensor) -> None:
        return None

    def _optimizer_step_code(self: Any) -> None:
        if torch.compiler.is_compiling():
            optimizer_stepped(id(self), ticks)  # a node of the graph being traced
        else:
            fn(self, None)  # eagerly: no op dispatch
        original(self)

    _optimizer_step_code._collage = True  # type: ignore[attr-defined]
    _optimizer_step_code.__doc__ = original.__doc__
    cls._optimizer_step_code = _optimizer_step_code  # type: ignore[method-assign]
    cls._patch_step_function = _patch_step_function  # type: ignore[method-assign]


def _enter(optimizer: Any) -> None:
    """Register ``optimizer`` under its id for :func:`run_step_ticks` (until it dies)."""
    import weakref

    key = id(optimizer)
    _optimizers[key] = weakref.ref(optimizer, lambda _, key=key: _optimizers.pop(key, None))


def run_step_ticks(keys: Sequence[int], by_collage: bool | None = None) -> None:
    """Call the after-step function for the optimizers with these ids (those still alive);
    ``by_collage``: from the wrapper of a collage graph, compiled to compensate (True) or
    with ``mode="off"`` (False); None: the tick op ran, in a graph another backend
    compiled."""
    for key in keys:
        ref = _optimizers.get(key)
        optimizer = ref() if ref is not None else None
        if optimizer is not None:
            for fn in _after_step:
                fn(optimizer, by_collage)


def _step_tick_op() -> Any:
    op = getattr(getattr(torch.ops, "collage", None), "optimizer_stepped", None)
    return op.default if op is not None else None


def is_step_tick_graph(gm: fx.GraphModule) -> bool:
    """A graph that only calls ``collage::optimizer_stepped`` (what Dynamo captures after a
    torch.optim step's own graph break: see :func:`after_every_optimizer_step`)."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    op = _step_tick_op()
    return bool(calls) and op is not None and all(n.target is op for n in calls)


def has_step_ticks(gm: fx.GraphModule) -> bool:
    op = _step_tick_op()
    return op is not None and bool(gm.graph.find_nodes(op="call_function", target=op))


def step_tick_ids(gm: fx.GraphModule) -> list[int]:
    """The ids of the optimizers whose ``collage::optimizer_stepped`` nodes ``gm`` holds,
    in graph order (what :func:`take_step_ticks` takes out)."""
    op = _step_tick_op()
    if op is None:
        return []
    nodes = gm.graph.find_nodes(op="call_function", target=op)
    return [n.args[0] for n in nodes if not n.users and isinstance(n.args[0], int)]


def take_step_ticks(gm: fx.GraphModule) -> list[int]:
    """Remove the ``collage::optimizer_stepped`` nodes from ``gm`` (in place) and return
    their optimizers' ids, in graph order: the caller runs :func:`run_step_ticks` after
    each call of the compiled graph.  The counter they wrote stays an input, unused (an
    unused CPU input does not keep Inductor from capturing a CUDA graph)."""
    op = _step_tick_op()
    if op is None:
        return []
    keys = []
    for node in list(gm.graph.find_nodes(op="call_function", target=op)):
        if not node.users and isinstance(node.args[0], int):
            keys.append(node.args[0])
            gm.graph.erase_node(node)
    return keys


def dynamic_from_the_first_compile(fn: Callable[..., Any], sources: Sequence[str]) -> None:
    """Have Dynamo trace the float inputs ``sources`` (source names relative to the frame
    of ``fn`` and of every function it wraps, ``"L['self'].param_groups[0]['lr']"``) as
    symbols from their first compile.  Dynamo specializes a float on the value it first
    sees and recompiles, dynamic, when it changes (automatic dynamic): a schedule's second
    step compiled the whole step again (on a GPU, 64 s after the first 38 s).  What its
    second compile records in the code's frame state (``torch._dynamo.pgo``), written
    before the first: the scalar's entry is ``auto_dynamic``.  Checked on 2.11 and 2.13
    (``CodeId.make`` takes the closure on 2.13; the functions here have none).  On a torch
    whose frame state differs it does nothing: the step then compiles twice, as before
    (``tests/test_schedules.py -k once`` fails there)."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and not getattr(fn, "__closure__", None):
            _mark_auto_dynamic(code, None, sources)
        fn = getattr(fn, "__wrapped__", None)


def _mark_auto_dynamic(code: Any, closure: Any, sources: Sequence[str]) -> list[str] | None:
    """Write ``auto_dynamic`` for ``sources`` into the frame state of ``code``; the sources
    that were not so already, or None where this torch's frame state is not the one
    checked."""
    try:
        from torch._dynamo import pgo

        entry = pgo.FrameStateSizeEntry.make_scalar(pgo.auto_dynamic)
        try:  # 2.13 keys a code by its closure too
            key = pgo.CodeId.make(code, closure)
        except TypeError:  # 2.11: by the code alone
            key = pgo.CodeId.make(code)
        entries = pgo.get_code_state()[key].automatic_dynamic
        new = [n for n in sources if n not in entries or entries[n].scalar is not pgo.auto_dynamic]
    except (ImportError, AttributeError, TypeError):
        return None
    for name in new:
        entries[name] = dataclasses.replace(entry)
    return new


def forget_float_specializations() -> None:
    """Called after the backend compiled a graph: clear the floats torch's tensorification
    marked for specialization (``TensorifyState``, ``torch/_dynamo/symbolic_convert.py``).

    Why: where a float input is read by no tensor op of a graph (SGD's first step reads
    ``momentum`` only in ``if momentum != 0``, its buffer not yet made), the tensorification
    marks its symbol name (``zf77``) specialized and has Dynamo trace the frame again with
    the float a constant.  The mark is a class attribute that only ``torch._dynamo.reset()``
    or a restart for another reason clears, so it outlived that graph: every later compile
    of the step took ``momentum`` as a constant too, and a schedule that moves it (SGD
    under OneCycleLR) recompiled every step until the recompile limit, then ran eagerly,
    in plain low precision.  With a warm cache the first graph skipped the tensorification
    and it did not happen.  The mark has done its work once the graph it was raised for is
    compiled (2.11 and 2.13 read it only while tracing, before the backend runs)."""
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
    except ImportError:
        return
    TensorifyState.clear()


def before_float_restart(error: BaseException) -> None:
    """Called with what the backend's compile raised: where it is torch's float
    tensorification asking Dynamo to trace the frame again with a float a constant
    (``TensorifyScalarRestartAnalysis``), clear the frame's ``SpeculationLog`` first, as
    :func:`retrace_with_dynamic_floats` does for its own restart.

    Why: the new trace may branch differently (a constant, not a symbol), and Dynamo
    replays the graph breaks the first trace logged: SGD with momentum in two param groups
    under OneCycleLR (momentum cycled, an input from the first compile) raised
    ``SpeculationLogDivergence`` in the user's first step (``compile_optimizer``,
    2.11 and 2.13)."""
    try:
        from torch._dynamo import exc
        from torch._dynamo.symbolic_convert import InstructionTranslator

        if isinstance(error, exc.TensorifyScalarRestartAnalysis):
            InstructionTranslator.current_tx().speculation_log.clear()
    except Exception:
        return


def retrace_with_dynamic_floats(wanted: Callable[[dict[str, Any], tuple[Any, ...]], bool]) -> None:
    """Called by the backend as a compile begins: if the frame Dynamo is tracing took an item
    of an optimizer's param group as a constant (at ``path`` in ``group``: ``("lr",)``,
    ``("betas", 0)``) and ``wanted(group, path)`` says it is a float that will change (a
    scheduled lr), mark it automatic-dynamic in the frame's state and raise
    ``TensorifyScalarRestartAnalysis``, the one exception Dynamo lets a backend raise to
    trace the frame again, which then takes the float as an input.  So a user's
    ``torch.compile(step_fn, backend="collage")`` compiles a schedule once, as
    ``compile_optimizer`` does (:func:`dynamic_from_the_first_compile`), instead of a
    first time for the starting value and again at the first change; the cost is one more
    trace of the frame, no lowering (the trace starts afresh: its speculation log, where
    Dynamo keeps the graph breaks it met, is cleared).  The constant is found among the
    guards Dynamo has installed so far (``CONSTANT_MATCH`` on an item source), its group by
    evaluating the guard's source in the frame, as Dynamo's own guards do.  A float whose
    frame state already says dynamic is left as traced (Dynamo specialized it anyway), so
    a frame is traced again at most once.  Does nothing under compiler collectives (the
    ranks agree on frame state there), with ``specialize_float`` or without
    ``automatic_dynamic_shapes``, or where any of it is not as checked on 2.11 and 2.13."""
    try:
        from torch._dynamo import config as dynamo_config
        from torch._dynamo import exc
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._guards import TracingContext

        tx = InstructionTranslator.current_tx()
        context = TracingContext.try_get()
        if context is None or getattr(tx, "distributed_state", None) is not None:
            return
        if dynamo_config.specialize_float or not dynamo_config.automatic_dynamic_shapes:
            return
        guards = list(context.guards_context.dynamo_guards)
        scope = {"G": tx.f_globals, "L": tx.f_locals}
        closure = getattr(tx, "closure", None)
        restart = exc.TensorifyScalarRestartAnalysis
        speculation = tx.speculation_log
    except Exception:
        return
    names = []
    for guard in guards:
        if guard.create_fn_name() not in ("CONSTANT_MATCH", "EQUALS_MATCH"):
            continue
        try:
            found = _param_group_item(guard.originating_source, scope)
            if found is not None and wanted(*found):
                names.append(guard.name)
        except Exception:
            continue
    new = _mark_auto_dynamic(tx.f_code, closure, list(dict.fromkeys(names))) if names else None
    if new:
        # the new trace may branch differently (a symbol, not a constant): it must not
        # replay the graph breaks the first one logged (its SpeculationLog), as a restart
        # for a Dynamo graph break would
        speculation.clear()
        reason = f"collage: {', '.join(new)} will change: traced again as inputs"
        raise restart(restart_reason=reason)


def _param_group_item(source: Any, scope: dict[str, Any]) -> tuple[dict, tuple] | None:
    """(group, path) when ``source`` names an item at most two deep in an optimizer's param
    group (a dict with ``params``): ``group[path[0]]`` or ``group[path[0]][path[1]]``."""
    path: list[Any] = []
    for _ in range(2):
        if not (hasattr(source, "base") and hasattr(source, "index")):
            return None
        path.insert(0, source.index)
        source = source.base
        holder = source.get_value(scope, {}, {})
        if isinstance(holder, dict) and "params" in holder:
            return holder, tuple(path)
    return None


def on_recompile_limit(callback: Callable[[str, str, str, str], None]) -> None:
    """Call ``callback(function, limit, value, last_reason)`` whenever Dynamo gives up
    recompiling a function (its ``recompile_limit`` / ``accumulated_recompile_limit``
    warning, whose format is the same on 2.11 and 2.13).  Read off the warning's log
    record: Dynamo offers no other notice, and the record is emitted whether or not any
    handler shows it (the logger's level is WARNING unless a user silenced it)."""
    import logging

    class _Watch(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            msg = record.msg if isinstance(record.msg, str) else ""
            if msg.startswith("torch._dynamo hit config.%s") and len(record.args or ()) >= 4:
                limit, value, function, reason = record.args[:4]  # type: ignore[index]
                # the guard that failed, without its source comment and user stack
                reason = str(reason).split("\n")[0].split("  #")[0].strip()
                try:
                    callback(str(function), str(limit), str(value), reason)
                except Warning:  # warnings made errors by the user: theirs to see
                    raise
                except Exception:  # anything else must never break compilation
                    pass
            return True

    logging.getLogger("torch._dynamo.convert_frame").addFilter(_Watch())


class RecompileRoom:
    """While open, Dynamo's ``recompile_limit`` is ``extra`` higher (and
    ``accumulated_recompile_limit`` at least that high); restored on exit.

    Dynamo counts the graphs of a code object against one limit, and counts them per
    object only where the guard is on an ``nn.Module`` (``guards.py``'s ``ID_MATCH``
    keeps ``id_matched_objs`` for modules alone, on 2.11 and 2.13).  Every optimizer
    runs torch.optim's step wrapper and its class's ``step``, guarded by its identity,
    so the limit is shared by all of them.  Set by attribute, not ``config.patch``: the
    step of an optimizer in backward runs once per parameter (9 us here, against 44)."""

    __slots__ = ("extra", "old")

    def __init__(self, extra: int) -> None:
        self.extra = extra

    def __enter__(self) -> None:
        cfg = torch._dynamo.config
        self.old = (cfg.recompile_limit, cfg.accumulated_recompile_limit)
        cfg.recompile_limit = self.old[0] + self.extra
        cfg.accumulated_recompile_limit = max(self.old[1], self.old[0] + self.extra)

    def __exit__(self, *exc: Any) -> None:
        cfg = torch._dynamo.config
        cfg.recompile_limit, cfg.accumulated_recompile_limit = self.old


def compiling_in_backward_crashes() -> bool:
    """Whether a torch.compile inside a backward pass (a first optimizer step in a gradient
    hook) can crash the process: on torch 2.11 (CPU, any backend, ``"eager"`` included) a
    garbage collection during or after such a compile segfaulted; a step compiled outside
    backward ran inside it safely.  Not on 2.13."""
    return torch_version() < "2.13"


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread (a gradient
    hook is being called).  Checked on 2.11 and 2.13."""
    return torch._C._current_graph_task_id() != -1


def recompile_limit() -> int:
    return torch._dynamo.config.recompile_limit


_reset_marker: list[Callable[[Any], None]] = []
_resets_seen = [0]


def dynamo_resets() -> int:
    """How many ``torch._dynamo.reset()`` calls there have been since the first call of
    this function, counted when asked: a reset clears Dynamo's compile-start callbacks
    (``callback_handler.clear()``), where a no-op one of ours sits.  Same on 2.11 and 2.13."""
    from torch._dynamo.callback import callback_handler

    if _reset_marker and any(c is _reset_marker[0] for c in callback_handler.start_callbacks):
        return _resets_seen[0]
    if _reset_marker:
        _resets_seen[0] += 1
    _reset_marker[:] = [lambda _args: None]
    callback_handler.register_start_callback(_reset_marker[0])
    return _resets_seen[0]


def on_cudagraph_skip(callback: Callable[[str], None]) -> None:
    """Call ``callback(reason)`` whenever Inductor decides not to capture a CUDA graph, at
    compile time (a fresh compile or one loaded from its cache) or when cudagraph trees
    run it (``log_cudagraph_skip_and_bump_counter``, whose warning record is made
    whether or not ``TORCH_LOGS=cudagraphs`` shows it, as its ``cudagraph_skips`` counter
    is bumped).  A graph whose every node is on the CPU only bumps the counter: the
    backend names that case itself.  Checked on 2.13; the same function on 2.11."""
    import logging

    from torch._inductor import cudagraph_utils

    class _Watch(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno >= logging.WARNING:
                try:
                    callback(record.getMessage())
                except Warning:  # warnings made errors by the user: theirs to see
                    raise
                except Exception:  # anything else must never break compilation
                    pass
            return True

    cudagraph_utils.cudagraphs_log.addFilter(_Watch())


def torch_version() -> str:
    return torch.__version__.split("+")[0]


def fake_mode_of(example_inputs: Sequence[Any], gm: fx.GraphModule) -> Any:
    """The FakeTensorMode Dynamo traced ``gm`` under (to make example values for new inputs)."""
    from torch._guards import TracingContext, detect_fake_mode

    ctx = TracingContext.try_get()
    if ctx is not None and ctx.fake_mode is not None:
        return ctx.fake_mode
    mode = detect_fake_mode(example_inputs)
    if mode is not None:
        return mode
    for node in gm.graph.nodes:
        val = node.meta.get("example_value", node.meta.get("val"))
        if is_fake(val):
            return val.fake_mode
    return None


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def example_value(node: fx.Node) -> Any:
    """Dynamo's example value of a node (a fake tensor, a list of them, or a constant)."""
    meta = node.meta
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


def scalar_hint(x: Any) -> float | None:
    """A Python number as float; a SymInt/SymFloat as the value it was traced with (its
    ``node.hint``, private); anything else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        hint = getattr(x.node, "hint", None)
        return float(hint) if hint is not None else None
    return None


def fake_scalar_f64(x: Any, device: Any = None) -> Any:
    """A fake 0-dim float64 tensor in the fake mode that made symbolic float ``x`` (the
    example value of a node computing ``x`` as a tensor), or None."""
    shape_env = getattr(getattr(x, "node", None), "shape_env", None)
    if shape_env is None:
        return None
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    mode = ctx.fake_mode if ctx is not None else None
    if mode is None:
        return None
    with mode:
        return torch.empty((), dtype=torch.float64, device=device)


def is_symbol(x: Any) -> bool:
    """Whether a SymInt/SymFloat is one input's own symbol (``lr``), not an expression of
    symbols (``1 - lr*wd``) or a constant (its ``node.expr``, 2.11 and 2.13)."""
    import sympy

    return isinstance(getattr(getattr(x, "node", None), "expr", None), sympy.Symbol)


def free_symbols(x: Any) -> set[Any]:
    """The free symbols of a SymInt/SymFloat's expression (empty for a constant)."""
    node = getattr(x, "node", None)
    expr = getattr(node, "expr", None)
    return set(getattr(expr, "free_symbols", ()))


@functools.cache
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_gradient_input(node: fx.Node) -> bool:
    """Whether a graph input is a tensor's ``.grad``: Dynamo's ``GradSource`` where a
    torch.optim optimizer's ``_init_group`` mapped it, an ``AttrSource`` of member
    ``grad`` where any other code read ``p.grad`` (third-party and hand-written
    optimizers; 2.11, 2.13)."""
    from torch._dynamo.source import AttrSource, GradSource

    source = getattr(node, "_dynamo_source", None)
    return isinstance(source, GradSource) or (
        isinstance(source, AttrSource) and source.member == "grad"
    )


def _pow(x: Any, y: Any) -> float:
    return float(x) ** y


def _holds_a_tensor(args: Sequence[Any]) -> bool:
    """Whether a ``math.pow`` argument Dynamo traces is a tensor (MADGRAD's
    ``math.pow(state["k"] + 1, 0.5)``), left to Dynamo's own handling, a graph break:
    traced as ``float(x) ** y`` it compiled again every step (a guard on the gradients,
    which a step replaces)."""
    from torch._dynamo.variables.tensor import TensorVariable, UnspecializedPythonVariable

    return any(
        isinstance(a, TensorVariable) and not isinstance(a, UnspecializedPythonVariable)
        for a in args
    )


def is_torch_optim_gradient(node: fx.Node) -> bool:
    """Whether a graph input is a gradient a torch.optim optimizer's ``_init_group``
    mapped (Dynamo's ``GradSource``; 2.11, 2.13)."""
    from torch._dynamo.source import GradSource

    return isinstance(getattr(node, "_dynamo_source", None), GradSource)


def trace_math_pow_symbolically() -> None:
    """Dynamo traces ``math.pow(x, y)`` on a symbolic number as ``float(x) ** y`` (2.11,
    2.13).  Without it a Python int read through ``math.pow`` (pytorch_optimizer's
    ``debias``, ``1 - math.pow(beta, group["step"])``) is specialized in the guards, so the
    step compiles again every step, under any backend, and trains eagerly past the
    recompile limit; ``x ** y`` is traced on the symbol, so it compiles twice.  Constant
    arguments fold as before (the handler declines them), so are keywords."""
    from torch._dynamo.utils import check_unspec_or_constant_args
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    def handle_pow(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 2 or check_unspec_or_constant_args(args, kwargs):
            return None  # Dynamo's own handling
        if _holds_a_tensor(args):
            return None
        return tx.inline_user_function_return(VariableTracker.build(tx, _pow), list(args), {})

    TorchInGraphFunctionVariable._get_handlers().setdefault(math.pow, handle_pow)


def is_optimizer_state_input(node: fx.Node) -> bool:
    """Whether a graph input was reached through an optimizer's ``state`` dict, keyed by a
    tensor: ``DictGetItemSource(AttrSource(.., 'state'), ConstDictKeySource(..))``
    somewhere in Dynamo's source chain (2.11, 2.13).  A module's own ``self.state``
    tensor (an RNN's hidden state), or a dict of them keyed by name, is not."""
    from torch._dynamo.source import AttrSource, DictGetItemSource

    source, child = getattr(node, "_dynamo_source", None), None
    while source is not None:
        if isinstance(source, AttrSource) and source.member == "state":
            if (
                isinstance(child, DictGetItemSource)
                and child.base is source
                and not isinstance(child.index, (str, int))
            ):
                return True
        source, child = getattr(source, "base", None), source
    return False


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (FSDP2's sharded parameters and their state)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (``_local_tensor``: no autograd node, no view, the
    tensor whose storage the shard lives in); any other tensor is its own."""
    cls = _dtensor_type()
    if cls is not None and isinstance(t, cls):
        return t._local_tensor
    return t


#: :func:`local_tensor` of a DTensor as one C call (``map`` over a plan's shards per step)
shard_of = operator.attrgetter("_local_tensor")


def dtensor_like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``t``'s mesh, placements, global shape and strides whose shard is
    ``local`` (real or fake: made with the constructor, so ``local`` keeps the fake mode it
    was made in, where ``DTensor.from_local`` would trace through autograd)."""
    cls = _dtensor_type()
    return cls(local, t._spec, requires_grad=False)


def storage_weakref(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage with ``.expired()`` (the one torch.multiprocessing
    and FakeTensor use; the storage, not the tensor object, says whether memory lives on)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(local_tensor(t).untyped_storage())


def global_state() -> Callable[[], bool]:
    """A check that the global state Dynamo guards on every compiled frame (grad mode,
    autocast, the matmul precision flags, deterministic algorithms, default dtype, threads:
    ``GlobalStateGuard``) and the torch function mode stack are as they are now.  A
    whole-step replay runs no Dynamo, so it checks them itself.  ``torch._C._dynamo.guards.
    GlobalStateGuard`` and ``torch._C._len_torch_function_stack``, checked on 2.11 and
    2.13."""
    guard = torch._C._dynamo.guards.GlobalStateGuard()
    modes = torch._C._len_torch_function_stack()
    stack = torch._C._len_torch_function_stack

    def same() -> bool:
        return guard.check() and stack() == modes

    return same


def increment_versions(tensors: list[torch.Tensor]) -> None:
    """Bump each tensor's version counter, as AOTAutograd's wrapper does after a compiled
    call for the inputs it wrote (a CUDA graph's replay runs no host code).  One C call
    over the list (``torch._C._increment_version``, 2.11 and 2.13)."""
    torch._C._increment_version(tensors)


def set_example_value(node: fx.Node, value: Any) -> None:
    node.meta["example_value"] = value


def share_item_symbol(old: Any, new: Any) -> bool:
    """Give fake tensor ``new`` the symbol ``old.item()`` returns (``FakeTensor.item_memo``,
    which Dynamo sets on a float it passes in as a 0-dim tensor); False when ``old`` has
    none.  Checked on 2.11 and 2.13."""
    memo = getattr(old, "item_memo", None)
    if memo is None:
        return False
    new.item_memo = memo
    return True


def float_guards(fake: Any) -> list[Any]:
    """The guards the compile holds on the float ``fake.item()`` returns (a scheduled
    hyperparameter that a graph reads from a tensor input, :func:`share_item_symbol`), as
    sympy expressions: Dynamo's (SGD's ``if momentum != 0``), those the tensorification
    adds where it specialized a read it could not turn into tensor ops (``guard_scalar``,
    ``torch/fx/passes/_tensorify_python_scalars.py``), and a replacement of the symbol by a
    value as ``Eq``.  Dynamo checks them before each call; a replay runs no Dynamo, so it
    checks them itself (:func:`guard_function`).  ``ShapeEnv.guards`` and
    ``.replacements``, checked on 2.11 and 2.13."""
    import sympy

    memo = getattr(fake, "item_memo", None)
    env = getattr(getattr(memo, "node", None), "shape_env", None)
    symbols = free_symbols(memo)
    if env is None or not symbols:
        return []
    found = [g.expr for g in env.guards if symbols & g.expr.free_symbols]
    found += [sympy.Eq(s, env.replacements[s]) for s in symbols if s in env.replacements]
    return found


def item_symbol(fake: Any) -> Any:
    """The symbol of the float ``fake.item()`` returns (None if it is not one symbol)."""
    memo = getattr(fake, "item_memo", None)
    return memo.node.expr if is_symbol(memo) else None


def guard_function(expr: Any) -> tuple[Callable[..., bool], list[Any]]:
    """A guard of :func:`float_guards` as a Python function of its symbols' values, and
    those symbols in argument order: printed by torch's ``PythonPrinter``, as Dynamo prints
    its guards (floats exact, ``torch/utils/_sympy/printers.py``; 2.11 and 2.13)."""
    import math

    from torch.utils._sympy.printers import PythonPrinter

    symbols = sorted(expr.free_symbols, key=str)
    names = [f"_{i}" for i in range(len(symbols))]
    code = PythonPrinter().doprint(expr.xreplace(dict(zip(symbols, map(_sympy_symbol, names)))))
    fn = eval(f"lambda {', '.join(names)}: bool({code})", {"math": math})
    return fn, symbols


def _sympy_symbol(name: str) -> Any:
    import sympy

    return sympy.Symbol(name, real=True)


def mark_new_input(node: fx.Node) -> None:
    """A placeholder we add has no Dynamo source (AOTAutograd reads ``_dynamo_source``)."""
    node._dynamo_source = None  # type: ignore[attr-defined]


def mark_static_input(node: fx.Node) -> None:
    """The tensor passed for this placeholder keeps its address from call to call (a lo,
    held by the registry for its tensor's life): AOTAutograd lists it among the static
    inputs (``static_input_indices``, read from the placeholder's ``tensor_dict`` as
    Dynamo leaves it for ``torch._dynamo.mark_static_address(t, guard=False)``), so
    Inductor's cudagraph trees let the graph write it and do not copy it per replay.
    Checked on 2.13 (``_aot_autograd/frontend_utils.py``) and 2.11."""
    node.meta.setdefault("tensor_dict", {})["_dynamo_static_input_type"] = "unguarded"


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copied graph; Dynamo reads the original's placeholders after
    the backend returns, so the graph it hands us is never mutated.

    The copy is a ``_LazyGraphModule`` (as Dynamo's own graphs are, 2.11 and 2.13): its
    ``recompile()`` only marks the Python code stale, which is generated when something
    reads or runs it.  A rewritten graph goes straight to AOTAutograd, whose cache key
    renames the placeholders and recompiles twice (``normalize_placeholder_names``); an
    eager GraphModule generated the code of a graph of thousands of nodes each time, four
    times per compile, a tenth of a warm compile at 300 tensors."""
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    for old, new in val_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    new_gm = _LazyGraphModule(gm, graph, class_name=type(gm).__name__)
    new_gm.meta = dict(gm.meta)
    # Dynamo frees an optimizer's tensors with it: a finalizer on the optimizer pops them
    # from its graph's _parameters and _buffers (OptimizerVariable.create_finalizer, read
    # on 2.13).  The compiled step holds the copy; with dicts of its own, the copy kept the
    # weights of a deleted model until a second pass of the cyclic collector.
    new_gm._parameters = gm._parameters
    new_gm._buffers = gm._buffers
    for attr in ("_param_name_to_source", "shape_env", "compile_subgraph_reason"):
        if hasattr(gm, attr):
            setattr(new_gm, attr, getattr(gm, attr))
    return new_gm


def compile_with_inductor(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config_patches: dict[str, Any] | None = None,
    cudagraphs: bool = False,
) -> Callable[..., Any]:
    """Exactly what ``backend="inductor"`` does, optionally with scoped config patches,
    and with ``cudagraphs`` what its ``mode="reduce-overhead"`` does (``triton.cudagraphs``,
    cudagraph trees on by default on 2.11 and 2.13).

    A graph with DTensor inputs skips AOTAutograd's cache: its key hashes a DTensor by
    mesh, placements and global shape (torch 2.11 to 2.13), the same on every rank, so a
    rank with an uneven shard loaded another rank's kernel, compiled for the other local
    shape, from a cache directory the ranks share (plain Inductor alike, pytorch#188390,
    whose fix adds the device, the same on every CPU rank).  Inductor's own FX graph cache
    keys on the local shapes and stays on."""
    from torch._inductor.compile_fx import compile_fx

    no_cache = any(is_dtensor(t) for t in example_inputs)
    scope = torch._functorch.config.patch(enable_autograd_cache=False)
    origins = element_origins() if config_patches else contextlib.nullcontext()
    patches = {**(config_patches or {}), **({"triton.cudagraphs": True} if cudagraphs else {})}
    rounding = patches.get("emulate_precision_casts") and torch.__version__ < "2.13"
    with (
        scope if no_cache else contextlib.nullcontext(),
        origins,
        _cpp_keeps_low_precision_roundings() if rounding else contextlib.nullcontext(),
    ):
        return compile_fx(gm, list(example_inputs), config_patches=patches or None)


@contextlib.contextmanager
def _cpp_keeps_low_precision_roundings() -> Any:
    """torch before 2.13: the C++ backend drops the rounding ``emulate_precision_casts``
    asks for.  When a kernel stores a bf16 value, its CSE records the fp32 value it came
    from as that bf16 value widened (``CppKernel.cache_dtype_convert``), so a later op in the
    kernel reads it unrounded (2.11: ``g + wd*p`` multiplied by -lr before its rounding to
    bf16).  2.13 skips that record under ``emulate_precision_casts`` (pytorch#185337); this
    does the same while the backend compiles a graph that asks for it.  Checked on 2.11."""
    from torch._inductor.codegen.cpp import CppKernel

    original = CppKernel.cache_dtype_convert
    CppKernel.cache_dtype_convert = lambda self, *args: None
    try:
        yield
    finally:
        CppKernel.cache_dtype_convert = original


@contextlib.contextmanager
def element_origins() -> Any:
    """While Inductor lowers a rewritten graph: no IR node inherits origins through a
    list argument, except ``getitem(list, i)``, which takes those of element ``i``.

    Inductor records on every IR node the FX nodes it came from (its origins), and a node
    inherits the origins of every unrealized IR node among its arguments, the elements of
    a list included (``GraphLowering.run_node``, ``utils.gather_origins``).  An optimizer
    step's foreach ops over its 0-d step scalars stay unrealized, so every element of a
    foreach op after them inherited the origins of all N elements of its inputs, every
    ``getitem`` of one element inherited all N again, every IR node made from it copied
    the set, and the scheduler walks them once more per kernel
    (``Scheduler.enter_context``): time and memory that grow as N^2, faster for the
    rewritten step (about 1.5 times plain's IR nodes per tensor, each MCF chain's reading
    the whole set) than for plain Inductor's (docs/speed.md#compile-time has the table).
    Origins name kernels and annotate the generated code; nothing computed depends on
    them.  ``aten.cat(tensors, dim)``'s origins no longer name its inputs.  Checked on
    2.13, where ``torch/_inductor/graph.py`` imports ``gather_origins`` by name; where it
    does not, this changes nothing."""
    from torch._inductor import graph as inductor_graph

    gather = getattr(inductor_graph, "gather_origins", None)
    if gather is None:
        yield
        return

    def gather_elements(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if (
            len(args) == 2
            and not kwargs
            and isinstance(args[0], (list, tuple))
            and type(args[1]) is int
            and -len(args[0]) <= args[1] < len(args[0])
        ):
            return gather((args[0][args[1]],), {})
        single = [a for a in args if not isinstance(a, (list, tuple))]
        return gather(single, {k: v for k, v in kwargs.items() if not isinstance(v, (list, tuple))})

    inductor_graph.gather_origins = gather_elements
    try:
        yield
    finally:
        inductor_graph.gather_origins = gather


# the most a Triton combo kernel's buffers grow to here, from Inductor's 250 (see
# combo_args_patch; ``benchmarks.triton_compile --max-args``)
combo_args_max = 350


def combo_args_patch(tensor_inputs: int, lo_inputs: int) -> dict[str, Any]:
    """Inductor config: room for each lo in a Triton combo kernel.

    Inductor splits a foreach step's Triton combo kernels at 250 buffers read or written
    (``combo_kernel_max_num_args``, 2.11 and 2.13); each lo (or exact mode's remainder) is
    one more read and write, so at that limit light's AdamW over 144 tensors launched 14
    kernels where plain Inductor launches 10.  The limit grows by the share of buffers the
    pairs add (AdamW light: 5 tensors a parameter and a lo read and written, 350), up to
    :data:`combo_args_max` or the limit set, whichever is higher: Triton's compile time of
    a kernel grows faster than its pointers (sm_90, on a CPU: 166 pointers 3.4 s, 232
    pointers 5.9 s, 288 pointers 11.8 s; docs/speed.md).  350 buffers are at most 2.8 KB of
    pointers, within CUDA's 4 KB of kernel parameters.  The C++ path has no combo kernels."""
    if tensor_inputs <= 0 or lo_inputs <= 0:
        return {}
    import torch._inductor.config as inductor_config

    base = inductor_config.combo_kernel_max_num_args
    grown = base * (tensor_inputs + 2 * lo_inputs) // tensor_inputs
    return {"combo_kernel_max_num_args": min(grown, max(base, combo_args_max))}


def no_input_asserts_patch() -> dict[str, Any]:
    """Inductor config: no ``assert_size_stride`` of every input on every call.

    A rewritten graph has one more input per upgraded tensor (its lo), and at 300 tensors
    these asserts were a quarter of the step's host time (``benchmarks.host``).  They
    repeat checks made elsewhere: Dynamo's guards check the size and stride of the tensors
    it passes in, but not an optimizer's gradients, whose strides the backend's wrapper
    compares itself (``_LoInputs.expect_grad_layouts``), nor its parameters, which Dynamo
    guards by identity alone: the wrapper builds each lo with its tensor's layout
    (``state.empty_lo``) and re-checks the dtype, shape and strides of the parameters the
    graph holds (pairs, and ``_LoInputs.watch_layouts``: the others of two or more
    dimensions) whenever one's storage changes (``module.half()``,
    ``model.to(memory_format=...)``, ``p.data = ...``).  ``size_asserts`` on 2.11 and 2.13.
    """
    return {"size_asserts": False}


def no_low_precision_tiles() -> Any:
    """A context in which Inductor's C++ kernels never read or write a bf16/fp16 tensor
    through transposed 2-D tiles.

    Where a kernel's tensors are laid out in different orders (a column-major gradient
    beside a row-major weight, a channels-last weight beside contiguous state, a
    transposed matmul result), Inductor vectorizes along one dimension and reads the
    others through 32x32 tiles it transposes in a stack buffer (``transpose_mxn``).  For
    bf16 and fp16 on AVX-512 that transpose is miscompiled by GCC 12.2 at Inductor's
    ``-O3``: measured when a kernel transposes the same full tile twice (Inductor emits
    one transpose per use), and in a standalone call compiled with Inductor's flags; the
    kernel reads garbage, NaN included, silently.  Plain Inductor alike on 2.11 and 2.13
    (``tools/probe_tiles.py``); float32 tiles are right.  Here, where
    ``TilingSelect.select_tiling`` picks two tiling dimensions for a kernel with a
    low-precision tensor, the inner one alone is kept: the kernel stays vectorized and
    loads the transposed tensor element by element (right, measured).

    ``select_tiling`` returns (factors, indices) on 2.11 and (factors, indices, stats) on
    2.13.  A no-op post-grad pre-pass whose uuid names this rule keys Inductor's FX and
    AOTAutograd caches, so a kernel tiled without it is never reused (a user's own
    pre-pass is kept, and then keys alone)."""
    from unittest import mock

    from torch._inductor.codegen import cpp
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    original = cpp.TilingSelect.select_tiling

    def select_tiling(self: Any, fn_list: Any, var_sizes_list: Any) -> Any:
        out = original(self, fn_list, var_sizes_list)
        factors, indices = out[0], out[1]
        if len(indices) == 2:
            dtypes = cpp._get_dtype_from_loopbodies(cpp._get_loop_body(fn_list))
            if dtypes & {torch.bfloat16, torch.float16}:
                return (factors[-1:], indices[-1:], *out[2:])
        return out

    class NoLowPrecisionTiles(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            pass

        def uuid(self) -> Any:
            return ("collage: no low-precision tiles", get_hash_for_files((__file__,)))

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(cpp.TilingSelect, "select_tiling", select_tiling))
    if torch._inductor.config.post_grad_custom_pre_pass is None:
        key = {"post_grad_custom_pre_pass": NoLowPrecisionTiles()}
        stack.enter_context(torch._inductor.config.patch(key))
    return stack


def bounded_inlining_patch() -> dict[str, Any]:
    """Inductor config that bounds what Inductor inlines into a graph's loops.

    ``realize_opcount_threshold``: how large a reused pointwise expression may grow before
    it is materialized (30 by default, 50 on CPU in 2.13).  Error-free transformations
    (the ``"storage"`` arithmetic, or :mod:`collage_compile.mcf` compiled by hand) reuse
    every intermediate several times and Inductor re-traces a reused value into each user:
    measured cold on 2.13 CPU, compiling ``mcf.grow(..., "storage")`` on 16 elements,
    threshold 16 took 24 s, 8 took 6 s, the default did not finish in minutes.  The
    ``"fp32"`` arithmetic reuses little and does not need it (see
    :func:`scalar_prologue_patch`).
    """
    return {"realize_opcount_threshold": 8, **scalar_prologue_patch()}


def scalar_prologue_patch() -> dict[str, Any]:
    """Inductor config for a rewritten optimizer graph: :func:`realize_scalars_pass`, so
    the step's fp32 scalars are computed once per C++ kernel instead of once per vector.

    Inductor's own ``realize_opcount_threshold`` is left alone: materializing the chain's
    shared values (threshold 8) also leaves loop bodies without a low-precision load,
    and one such body makes the C++ backend tile the whole loop 16 lanes wide instead of
    32 (``TilingSelect.select_tiling``); on 2.13 CPU the plus AdamW step then ran 16 lanes
    wide and markedly slower (README "Speed" has the measured light steps).
    """
    return {"post_grad_custom_post_pass": realize_scalars_pass()}


# loops shorter than this keep their scalars inline (measured by benchmarks/host.py: at 300
# tensors of 8 elements, the two 0-d buffers per tensor cost more host time than the libm
# calls they save)
_REALIZE_MIN_NUMEL = 1024


@functools.cache
def realize_scalars_pass() -> Any:
    """An Inductor post-grad pass that reads every computed fp32/fp64 0-d tensor through
    ``aten.as_strided`` where a non-scalar computation uses it.

    An optimizer step derives per-tensor scalars from its step counter (AdamW's
    ``1 - beta2**step``, its square root, the step size).  Inductor inlines such a value
    into every loop that broadcasts it, so the C++ loop over a parameter calls
    ``powf``/``sqrtf`` once per 16-lane vector: a libm call clobbers every vector register
    (all are caller-saved on x86-64), so the values the MCF chain keeps live are spilled
    and reloaded around it, and each vector's long dependency chain restarts after it.
    Inductor's ``as_strided`` lowering realizes its input: the scalar is computed once in
    the kernel's scalar prologue and loaded in the loop (same kernel, same fp32 value, no
    numerical change).  A 0-d bool (exact mode's ``step_size == 0``) is computed once the
    same way.  Low-precision 0-d values are left alone (their store would round), and so
    are loops under 1024 elements (:data:`_REALIZE_MIN_NUMEL`) and loops Triton generates:
    a GPU has no libm call to hoist, and in a foreach combo kernel each realized scalar was
    one more pointer argument per sub-kernel (light's AdamW at 144 tensors, at 250
    buffers: a widest kernel of 200 pointers to plain Inductor's 166, and 15 launches
    where inline scalars make 14; docs/speed.md).
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class RealizeScalars(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.op == "call_function" and _long_cpp_loop(node):
                    _read_scalars_through_views(graph, node)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

    return RealizeScalars()


def _computed_scalar(node: fx.Node) -> bool:
    """A computed fp32/fp64/bool 0-d value (low-precision ones are left: a store rounds)."""
    val = node.meta.get("val")
    return (
        node.op == "call_function"
        and isinstance(val, torch.Tensor)
        and val.dim() == 0
        and val.dtype in (torch.float32, torch.float64, torch.bool)
    )


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s value is a view of another tensor: made by a view op, or an
    element of one's list (``unbind``, ``split``)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val._is_view():
        return True
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    aten = torch.ops.aten
    # ops Inductor lowers to views although their schemas are not
    lowered_as_views = (aten._unsafe_view.default, aten.lift_fresh.default, aten.lift.default)
    return is_op_overload(node.target) and (node.target.is_view or node.target in lowered_as_views)


def _long_cpp_loop(node: fx.Node) -> bool:
    """Whether ``node`` computes a loop the C++ backend generates, long enough that its
    scalars computed once beat the 0-d buffer each costs per call on the host (a tiny
    parameter's loop is one or two vectors).  A Triton kernel (CUDA, or a CPU under
    ``cpu_backend="triton"``) has no libm call to hoist, and each realized scalar would be
    one more pointer argument for every sub-kernel of its combo kernel."""
    val = node.meta.get("val")
    for v in val if isinstance(val, (list, tuple)) else [val]:
        if not (isinstance(v, torch.Tensor) and v.dim() > 0):
            continue
        if v.device.type != "cpu" or torch._inductor.config.cpu_backend != "cpp":
            continue
        n = v.numel()
        if not isinstance(n, int) or n >= _REALIZE_MIN_NUMEL:
            return True
    return False


def _read_scalars_through_views(graph: fx.Graph, node: fx.Node) -> None:
    """Make ``node`` read each computed scalar argument through one ``aten.as_strided``
    view, which Inductor's lowering realizes (computed once in the kernel's prologue).

    A scalar that is itself a view (``trust_ratios.unbind()[1]``, ``norms[1]``) is read
    through a copy of it first: Inductor's ``as_strided`` lowering replaces the layout of
    a view it has not realized with the one asked for, storage offset included, so
    ``as_strided(norms[1], [], [])`` read ``norms[0]`` (2.11 and 2.13; eager keeps the
    view's offset).  pytorch_optimizer's foreach LAMB applied the first parameter's trust
    ratio to every parameter, silently."""
    aten = torch.ops.aten
    views: dict[fx.Node, fx.Node] = {}

    def through_view(a: Any) -> Any:
        if not (isinstance(a, fx.Node) and _computed_scalar(a)):
            return a
        if a not in views:
            val = a.meta["val"]
            with graph.inserting_before(node):
                x = graph.call_function(aten.clone.default, (a,)) if _is_view(a) else a
                v = graph.call_function(aten.as_strided.default, (x, [], []))
            with val.fake_mode:
                if x is not a:
                    x.meta["val"] = aten.clone.default(val)
                v.meta["val"] = aten.as_strided.default(x.meta["val"], [], [])
            views[a] = v
        return views[a]

    node.args = fx.node.map_arg(node.args, through_view)
    node.kwargs = fx.node.map_arg(node.kwargs, through_view)


def eager_rounding_patch() -> dict[str, Any]:
    """Inductor config that rounds every bf16/fp16 op's result as eager does."""
    return {"emulate_precision_casts": True}


def storage_key(t: torch.Tensor) -> Any:
    """A hashable identity of ``t``'s storage, valid for fake and real tensors."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(local_tensor(t).untyped_storage())


def is_op_overload(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def op_packet_name(op: Any) -> str:
    """``aten.add_.Tensor`` -> ``"add_"``."""
    return op.overloadpacket.__name__


def is_non_overlapping_and_dense(t: Any) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (any dim order); False
    when a symbolic shape cannot decide it.  2.13 names it ``..._or_false``; older releases
    spelled it without the suffix."""
    import torch._prims_common as pc

    fn = (
        getattr(pc, "is_non_overlapping_and_dense_or_false", None)
        or pc.is_non_overlapping_and_dense
    )
    return bool(fn(t))


def written_schema_args(op: Any) -> list[tuple[int, str]]:
    """(position, name) of the arguments an aten/prims op writes in place (``Tensor(a!)``)."""
    return [
        (i, arg.name)
        for i, arg in enumerate(op._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]


def fused_optimizer_ops() -> dict[Any, str]:
    """torch.optim ``fused=True`` kernels, opaque to a graph rewrite, mapped to a readable name."""
    names = {
        "_fused_adam_": "Adam(fused=True)",
        "_fused_adamw_": "AdamW(fused=True)",
        "_fused_sgd_": "SGD(fused=True)",
        "_fused_adagrad_": "Adagrad(fused=True)",
    }
    return {getattr(torch, n): label for n, label in names.items() if hasattr(torch, n)}


def run_and_keep_kernel_code(
    fn: Callable[..., Any], *args: Any, fresh: bool = False
) -> tuple[Any, list[str]]:
    """Run ``fn`` and return (result, the source files Inductor generated while it ran).

    Unlike :func:`run_and_get_kernel_code` this does not reset Dynamo first, so functions
    compiled before stay compiled (benchmarks compare several compiled steps in one run;
    a reset would recompile each of them, without any patch active at its first compile).
    A graph Inductor loads from its FX graph cache has no code generated: with ``fresh``
    the cache is off meanwhile.
    """
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with (
        inductor_config.patch(fx_graph_cache=not fresh and inductor_config.fx_graph_cache),
        mock.patch.object(GraphLowering, "save_output_code", codes.append),
    ):
        result = fn(*args)
    return result, codes


def run_and_count_loop_bodies(fn: Callable[..., Any], *args: Any) -> tuple[Any, int, int]:
    """Run ``fn`` with Inductor's FX graph cache off and return (result, scheduler nodes,
    FX nodes of their loop bodies), summed over the graphs Inductor compiled meanwhile:
    the two sizes every stage of Inductor's code generation walks (tests pin the compile
    cost of the rewrite with them)."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.scheduler import Scheduler

    counts = [0, 0]
    init = Scheduler.__init__

    def counting_init(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        for fused in self.nodes:
            for node in fused.get_nodes():
                body = getattr(node, "_body", None)
                if body is None:
                    continue
                counts[0] += 1
                blocks = [body.root_block, *body.subblocks.values()]
                counts[1] += sum(len(block.graph.nodes) for block in blocks)

    with (
        inductor_config.patch(fx_graph_cache=False),
        mock.patch.object(Scheduler, "__init__", counting_init),
    ):
        result = fn(*args)
    return result, counts[0], counts[1]


@contextlib.contextmanager
def cudagraph_inputs() -> Any:
    """While open, for every graph Inductor compiles: ``(written, static)``, the indices
    of the inputs its kernels write and of those it may take to keep their address from
    call to call.  Under cudagraph trees Inductor captures a graph only if every written
    input is static (``cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor``,
    evaluated where the graph is on a CUDA device): on CPU this shows what it would decide.
    Read off ``CompiledFxGraph`` as constructed (2.13; the same fields on 2.11), so
    Inductor's caches are off meanwhile (a graph loaded from them is not constructed)."""
    from torch._inductor import output_code

    seen: list[tuple[set[int], set[int]]] = []
    init = output_code.CompiledFxGraph.__init__

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        static = (self.fx_kwargs or {}).get("static_input_idxs") or ()
        seen.append((set(self.mutated_input_idxs), set(static)))

    output_code.CompiledFxGraph.__init__ = recording  # type: ignore[method-assign]
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            yield seen
    finally:
        output_code.CompiledFxGraph.__init__ = init  # type: ignore[method-assign]


def run_and_get_kernel_code(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
    """Run a compiled function and return (result, generated source files) (tests use it)."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn, *args)


def captures_scalar_outputs() -> bool:
    """``torch._dynamo.config.capture_scalar_outputs`` (``Tensor.item()`` traced, not a
    graph break)."""
    import torch._dynamo

    return bool(torch._dynamo.config.capture_scalar_outputs)


def reset_dynamo() -> None:
    import torch._dynamo

    torch._dynamo.reset()


def trace_to_inductor_aten(gm: fx.GraphModule, examples: Sequence[torch.Tensor]) -> Any:
    """``gm`` traced to aten ops with Inductor's decompositions, on fake inputs shaped like
    ``examples``; None unless every op is functional and Inductor lowers it itself (no
    fallback kernel), which is what lets :func:`register_inline_lowering` fuse it."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import fallbacks, lowerings
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    with mode:
        fakes = [_empty_like_strided(t) for t in examples]
        try:
            aten = make_fx(gm, decomposition_table=select_decomp_table())(*fakes)
        except Exception:
            return None
    for node in aten.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function" or not is_op_overload(node.target):
            return None
        if node.target not in lowerings or node.target in fallbacks:
            return None
        if written_schema_args(node.target) or node.target._schema.is_mutable:
            return None
    return aten


def register_inline_lowering(op: Any, graph_of: Callable[[str], fx.GraphModule]) -> None:
    """Lower ``op(key, inputs)`` by running the aten graph ``graph_of(key)`` through
    Inductor's own lowerings, so the result fuses with its neighbours.

    Each output becomes one pointwise node whose loop body computes every value of the
    graph once (:func:`_lower_shared`).  Lowered node by node, as ``GraphLowering.run_node``
    would, a value read by several nodes is re-traced into each reader: a Veltkamp split
    reads its input three times and the pair's remainder reads the split twice, so the
    loop body of a second moment's lo held its chain about ten times over (302 nodes, of
    which the kernel keeps 85), and every stage of C++ code generation walks that body
    several times.  A graph with a value that is not one tensor is lowered node by node.

    An output that only overwrites a graph input (the pair's lo, a weight nothing else in
    the graph reads) is computed straight into that input, as Inductor's in-place foreach
    ops are (:func:`_write_in_place`); otherwise Inductor computes it into a buffer of its
    own, because it reads the input it overwrites, and copies that buffer in the graph's
    epilogue: two scheduler nodes, each paid for at every stage of the compile, where the
    kernel has one store either way.
    """
    from torch._inductor.lowering import register_lowering
    from torch._inductor.virtualized import V

    @register_lowering(op, type_promotion_kind=None)
    def _lower(key: str, inputs: list[Any], group: int = -1) -> list[Any]:
        gm = graph_of(key)
        if all(
            isinstance(n.meta.get("val"), torch.Tensor)
            for n in gm.graph.nodes
            if n.op == "call_function"
        ):
            node = V.graph.current_node
            buffers: list[Any] = []
            results = _lower_shared(gm, inputs, node if node.target is op else None, buffers)
            if group >= 0:
                _join_foreach_group(group, buffers)
            return results
        return _lower_per_node(gm, inputs)


# GraphLowering -> (group, device, buffers per chain, buffer index) -> its operation list
_FOREACH_LISTS: weakref.WeakKeyDictionary[Any, dict[tuple[int, str, int, int], list[str]]] = (
    weakref.WeakKeyDictionary()
)


def _join_foreach_group(group: int, buffers: list[Any]) -> None:
    """Add one chain's buffers to its foreach group's operation lists, where the backend
    fuses foreach ops horizontally (Triton: ``BackendFeature.FOREACH``).

    ``_foreach_*`` lowerings realize each output and register the outputs as one list
    (``foreach_group_loop`` in torch/_inductor/lowering.py), which the scheduler makes one
    ``ForeachKernelSchedulerNode``: one combo kernel for tensors of any sizes.  The chains
    that replace one foreach op are lowered one by one, so without this each tensor's
    chain would be a kernel of its own.  Buffer ``i`` of every chain in a group (a shared
    value it materializes, its hi, its lo) joins list ``i`` of the chains on its device
    with as many buffers: the same value for every tensor, none of them reading another
    (each chain writes only its own tensors), and the lists fuse with each other as a
    foreach op's consecutive lists do.  The C++
    backend has no FOREACH feature (it fuses loops of different sizes itself): nothing
    changes there, not even which values are realized."""
    from torch._inductor.codegen.common import BackendFeature
    from torch._inductor.virtualized import V

    if not buffers:
        return
    device = buffers[0].get_device()
    if not V.graph.has_feature(device, BackendFeature.FOREACH):
        return
    lists = _FOREACH_LISTS.setdefault(V.graph, {})
    for i, buf in enumerate(buffers):
        buf.realize()
        name = buf.get_operation_name()
        key = (group, str(device), len(buffers), i)
        if key in lists:
            lists[key].append(name)
        else:
            lists[key] = V.graph.lists[V.graph.register_operation_list([name])]


# A value that several outputs of a chain need (the correction word ``e`` that both the
# pair's hi and its lo are computed from) is materialized when its expression has more
# operations than this; a materialized fp32 value read only inside the kernel that
# computes it is a kernel-local buffer, which Inductor removes (no memory traffic).
SHARED_VALUE_OPCOUNT = 8


def _lower_shared(
    gm: fx.GraphModule, inputs: list[Any], call: fx.Node | None, buffers: list[Any]
) -> list[Any]:
    """Lower ``gm`` (called by the graph node ``call``) so that no loop body computes one
    of its values twice, and write the outputs that only overwrite graph inputs in place
    (:func:`_write_in_place`).  Appends to ``buffers`` the values it materializes and then
    the outputs' own computations, in graph order (each a value to realize).

    Every value reaches its readers' lowerings as a stand-in (:class:`_Memo`) computed
    once per evaluation of a loop body.  The arithmetic is the lowerings' own, so the
    kernel is what the node-by-node lowering generates after Inductor's common
    subexpression elimination.

    Each output is still its own pointwise node, and each loop body would compute all
    the values the outputs share: a shared fp32 value with more than
    :data:`SHARED_VALUE_OPCOUNT` operations is materialized instead (low-precision values
    never are: a store would round them), where a reader of the outputs still finds a
    low-precision load (Inductor's C++ backend vectorizes a loop whose every body is
    fp32 only half as wide)."""
    from torch._inductor.lowering import lowerings

    memo = _Memo()
    env: dict[fx.Node, Any] = {}
    outputs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    shared = _shared_frontier(gm, outputs)
    it = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = memo.stand_in(node, lowerings[node.target](*args, **kwargs))
            if (
                node in shared
                and env[node].get_dtype() in (torch.float32, torch.float64)
                and env[node].data.data.inner_fn_opcount().num_ops > SHARED_VALUE_OPCOUNT
            ):
                env[node].realize()
                buffers.append(env[node])
    results = [env[node] for node in outputs]
    for node, out in zip(outputs, results):
        if node.op == "call_function" and not any(out is b for b in buffers):
            buffers.append(out)
    written = _write_in_place(results, _epilogue_targets(call) if call is not None else {})
    for i, out in enumerate(results):
        if i in written:
            results[i] = written[i]
        elif outputs[i].op == "call_function" and out.has_exceeded_max_reads():
            out.realize_hint()
    return results


class _Memo:
    """Stand-ins for lowered values that share one table per evaluation of a loop body:
    a value several readers load at one index is computed once (its real loader runs only
    on a miss); the first stand-in loaded opens the table and closes it when it returns."""

    def __init__(self) -> None:
        self.table: dict[Any, Any] | None = None
        self.loaders: dict[fx.Node, Callable[..., Any]] = {}

    def load(self, node: fx.Node, index: Sequence[Any]) -> Any:
        from torch._inductor.virtualized import V

        if self.table is None:  # the outermost load of this graph: its evaluation
            self.table = {}
            try:
                return self.loaders[node](index)
            finally:
                self.table = None
        key = (id(V.get_ops_handler()), node, tuple(index))
        if key not in self.table:
            self.table[key] = self.loaders[node](index)
        return self.table[key]

    def stand_in(self, node: fx.Node, value: Any) -> Any:
        """A pointwise node that loads ``value`` (the lowering of ``node``) through the table."""
        from torch._inductor import ir

        self.loaders[node] = value.make_loader()
        return ir.Pointwise.create(
            device=value.get_device(),
            dtype=value.get_dtype(),
            inner_fn=functools.partial(self.load, node),
            ranges=list(value.get_size()),
        )


def _epilogue_targets(call: fx.Node) -> dict[int, Any]:
    """Output index -> the graph input that the graph's epilogue ``copy_`` overwrites with
    that output of ``call`` (and nothing else reads), where no node after ``call`` reads
    the input but that ``copy_``: ``call`` may then write it in place."""
    import operator

    from torch._inductor.virtualized import V

    lowered = V.graph.env  # the nodes before this one
    targets: dict[int, Any] = {}
    for item in call.users:
        if item.target is not operator.getitem or len(item.users) != 1:
            continue
        (copy,) = item.users
        if copy.target is not torch.ops.aten.copy_.default or copy.args != (copy.args[0], item):
            continue
        dst = copy.args[0]
        if copy.users or copy.kwargs or dst.op != "placeholder":
            continue
        if any(u not in lowered for u in dst.users if u is not copy and u is not call):
            continue
        targets[item.args[1]] = V.graph.env[dst]
    return targets


def _write_in_place(results: list[Any], targets: dict[int, Any]) -> dict[int, Any]:
    """Compute each output in ``targets`` directly into its graph input (one loop body
    that stores to the input, as Inductor's in-place foreach ops do) instead of into a
    buffer that the epilogue ``copy_`` copies; returns the outputs so written, each now
    standing for its input (the epilogue's ``copy_(input, input)`` is then nothing).

    An input is overwritten only once every other output that reads its old value is
    computed: a returned output that reads one is materialized first, and where two
    outputs read each other's input one is left to the epilogue."""
    from torch._inductor import ir
    from torch._inductor.lowering import mutate_to

    def computable_into(out: Any, dst: Any) -> bool:
        # a value of its own, not yet materialized, exactly the input's dtype and shape
        return (
            isinstance(out, ir.TensorBox)
            and isinstance(out.data, ir.StorageBox)
            and not ir.IRNode.is_realized_node(out.data.data)
            and sum(o is out for o in results) == 1
            and dst.get_dtype() == out.get_dtype()
            and dst.get_device() == out.get_device()
            and list(dst.get_size()) == list(out.get_size())
        )

    pending = {i: dst for i, dst in targets.items() if computable_into(results[i], dst)}
    names = {dst.get_name() for dst in pending.values()}
    reads = {i: set(out.get_read_names()) for i, out in enumerate(results)}
    for i, out in enumerate(results):
        if i not in pending and reads[i] & names:
            out.realize()
    written: dict[int, Any] = {}
    while pending:
        ready = [
            i
            for i, dst in pending.items()
            if not any(dst.get_name() in reads[j] for j in pending if j != i)
        ]
        if not ready:  # each reads another's input: the epilogue copies this one
            i = min(pending)
            results[i].realize()
            del pending[i]
            continue
        i = ready[0]
        dst = pending.pop(i)
        mutate_to(dst, results[i], unsafe_alias=True)
        written[i] = dst
    return written


def _shared_frontier(gm: fx.GraphModule, outputs: list[fx.Node]) -> set[fx.Node]:
    """The values that more than one output is computed from and that some value used
    by fewer outputs reads (the last values the outputs have in common)."""
    reach: dict[fx.Node, set[int]] = {}
    for node in reversed(gm.graph.nodes):
        r = {i for i, o in enumerate(outputs) if o is node}
        for user in node.users:
            r |= reach.get(user, set())
        reach[node] = r
    return {
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and len(reach[n]) > 1
        and any(len(reach[u]) < len(reach[n]) for u in n.users if u.op != "output")
    }


def _lower_per_node(gm: fx.GraphModule, inputs: list[Any]) -> list[Any]:
    """Run ``gm``'s nodes through Inductor's lowerings one by one (a value read by several
    nodes may be materialized, ``mark_reuse``; so may one that reads too many buffers,
    checked where a value is shared or returned)."""
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings

    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "output":
            return [env[n] for n in node.args[0]]
        else:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            out = lowerings[node.target](*args, **kwargs)
            # a value read once is inlined into its reader, whose own check covers it
            # (checking every node re-traces the growing expression each time)
            shared = len(node.users) > 1 or any(u.op == "output" for u in node.users)
            if isinstance(out, ir.TensorBox) and shared:
                if len(node.users) > 1:
                    out.mark_reuse(len(node.users))
                if out.has_exceeded_max_reads():
                    out.realize_hint()
            env[node] = out
    raise AssertionError("an aten graph without an output")


def fake_like(
    t: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A new empty tensor of ``shape``, ``stride`` and ``dtype`` on ``t``'s device, fake
    in ``t``'s fake mode if ``t`` is fake.  A FakeTensor is built straight over a meta
    tensor, as the fake mode builds its outputs (``FakeTensor.__new__``, 2.11 and 2.13):
    ``torch.empty_strided`` under the mode costs five times as much, and a rewrite makes
    two per tensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not is_fake(t):
        return torch.empty_strided(shape, stride, dtype=dtype, device=t.device)
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(t.fake_mode, meta, t.device)


def output_meta(
    gm: fx.GraphModule, examples: Sequence[torch.Tensor]
) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """(shape, stride, dtype) of each output of ``gm`` run on fake tensors like ``examples``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fakes = [_empty_like_strided(t) for t in examples]
        outs = gm(*fakes)
    return [(tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs]


def _empty_like_strided(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


@functools.cache
def fp16_grad_scaler() -> type:
    """``torch.amp.GradScaler`` that also unscales fp16 gradients.

    torch's refuses them ("Attempting to unscale FP16 gradients"): with autocast the
    parameters are fp32, and fp16 gradients mean a mistake.  With fp16 *parameters* (pure
    fp16 training, collage's pairs instead of fp32 masters) fp16 gradients are the point.
    Unscaling runs the same kernel (``_amp_foreach_non_finite_check_and_unscale_``: the
    product in fp32, stored in fp16), so a gradient below fp16's smallest subnormal (6e-8)
    after unscaling flushes to zero, as it would have without loss scaling.  The override is
    of ``GradScaler._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``, private
    and the same on 2.11 and 2.13.
    """

    class GradScaler(torch.amp.GradScaler):
        __doc__ = fp16_grad_scaler.__doc__

        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # type: ignore[override]
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    GradScaler.__module__ = "collage_compile"
    GradScaler.__qualname__ = "GradScaler"
    return GradScaler
