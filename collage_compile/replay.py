"""The whole optimizer step as one replay: ``compile_optimizer(opt, cudagraphs=True)``.

A compiled step on a GPU is bound by host work.  Inductor's cudagraph trees replay its
kernels, but keep the rest per call: Dynamo's guards and the arguments it gathers,
AOTAutograd's wrappers, the trees' own checks and input copies, the backend's wrapper
(on an H100, AdamW on 75 tensors: 0.96 ms a step for plain Inductor captured, 0.32 ms for
torch's fused AdamW; docs/speed.md).  Here, once a call of the compiled step compiles
nothing, that call is recorded: which collage graphs it called, with what.  On CUDA the
next step is captured whole, as one CUDA graph; every step after it is

    checks       the step would call the same graphs on the same tensors: the same
                 param_groups, parameters, optimizer state and hyperparameters, the same
                 gradients present in the same dtypes, the global state Dynamo guards
                 (autocast, matmul precision, modes), no hooks, each parameter and state
                 value on the storage captured (a graph holds addresses), and per graph
                 the registry's pairs and no write from outside since its last call (each
                 a pass over a list, in C);
                 once the parameters and gradients passed, the gradients are copied into
                 the captured graph's own buffers (never into a tensor the user holds),
                 one ``_foreach_copy_``, so that the device copies while the host checks
                 the rest (a copy a later check makes useless is harmless: only a replay
                 reads those buffers)
    refresh      each float the graphs read from a tensor of their own (a scheduled lr,
                 :func:`rewrite.scalars_as_static_inputs`) filled from ``param_groups``
    replay       one CUDA graph launch, then the version counters the captured step
                 bumped bumped again (on a CPU: each recorded graph called directly)
    bookkeeping  what the graphs' wrappers do besides the graph (versions, the watch)

A failed check runs the step as compiled (Dynamo recompiles if it must, the wrapper handles
a write from outside, as on every compiled call) and records it again: the checks decide
whether a replay is the step Dynamo would run, never the numerics.  A step that cannot be
replayed (metrics, an optimizer outside torch.optim, step hooks, a graph input the replay
cannot refresh, a capture that fails) is named once in a CollageWarning and runs
compiled, without capture, compensated as before.

Why torch.optim's optimizers only: a replay runs no Python of the step.  Their steps under
Dynamo keep every per-step value in a tensor (Dynamo sets ``capturable`` on CUDA), and the
checks above cover what their Python reads; another optimizer may keep a Python counter
that a replay would leave frozen.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import operator
import re
import traceback
from collections.abc import Callable
from typing import Any

import torch

from collage_compile import _compat

log = logging.getLogger("collage_compile")

__all__ = ["WholeStep"]

#: while a step is recorded, the calls of collage graphs it makes, in order:
#: (wrapper, Dynamo's arguments, the lo tensors the wrapper appended)
recording: list[tuple[Any, tuple[Any, ...], list[Any]]] | None = None
#: a capture of a whole step is in progress: wrappers do not fill their floats (the
#: capture would hold this step's value), and nothing may compile or create a pair
capturing = False
_compiles = 0
#: steps in a row that ran compiled after one was recorded, before the user is told
MISSED = 20

_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_VERSION = operator.attrgetter("_version")


_IS_NONE = functools.partial(operator.is_, None)
# Dynamo's name of a value under an optimizer's param_groups: group, keys, ``.grad``
_SOURCE = re.compile(r"\.param_groups\[(\d+)\]((?:\[(?:'[^']*'|\d+)\])+)(\.grad)?$")
_KEY = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def _spec(t: Any) -> Any:
    """A DTensor's sharding (read only where the recorded step's gradients were DTensors)."""
    return getattr(t, "_spec", None)


def compiling() -> None:
    """Called by the backend before every compile: counted (a recorded call that
    compiled is not yet the steady step), refused inside a capture (a compile runs
    device work that a capture must not hold)."""
    global _compiles
    _compiles += 1
    if capturing:
        raise RuntimeError("collage: a compile inside the capture of a whole optimizer step")


class _Refused(Exception):
    """A step that cannot be replayed, and why."""


class WholeStep:
    """``optimizer.step`` compiled by the backend (``compiled``), replayed whole once a
    call compiles nothing new (see the module's docstring).  ``replays`` counts the
    steps that ran as a replay."""

    def __init__(self, optimizer: torch.optim.Optimizer, compiled: Callable[..., Any]):
        self.optimizer, self.compiled = optimizer, compiled
        self.plan: _Plan | None = None
        self.pending: _Plan | None = None  # CUDA: recorded, to be captured next call
        self.refused: str | None = None
        self.replays = 0
        self.given_way: list[str] = []  # why a recorded step ran compiled (the first 100)
        # a failed capture's traceback, as text (the exception would keep the capture's
        # frames, its graph and memory pool alive)
        self.capture_error: str | None = None
        self.missed = 0  # steps in a row that differed from the one recorded before them
        module = type(optimizer).__module__  # torch.optim.adamw; Muon's is torch.optim
        if module != "torch.optim" and not module.startswith("torch.optim."):
            self._refuse(f"{type(optimizer).__name__} is not one of torch.optim's optimizers")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.plan
        if plan is not None:
            why = "the step was called with arguments" if args or kwargs else None
            # the caller capturing a graph of its own: the step runs compiled, into it
            if why is None and not plan.inside_a_capture():
                why = plan.stale(copy_grads=True)
                if why is None:
                    plan.run()
                    self.replays += 1
                    self.missed = 0
                    return None
            log.debug("collage: step run as compiled, not replayed: %s", why)
            if why is not None and len(self.given_way) < 100:
                self.given_way.append(why)
            self.plan = None
            self._missed(why)
        if args or kwargs or self.refused is not None:
            return self.compiled(*args, **kwargs)
        if _hooks(self.optimizer):
            self._refuse("it has step hooks (register_step_pre_hook / post_hook)")
            return self.compiled()
        pending, self.pending = self.pending, None
        if pending is not None:
            why = pending.stale()
            if why is None and not pending.inside_a_capture():
                return self._capture(pending)
            self._missed(why)
        return self._record()

    def _missed(self, why: str | None) -> None:
        """A recorded step that ran compiled: named once where that keeps happening (a
        step whose gradients, parameters or settings change every call is never replayed,
        and a user who asked for the replay would not know)."""
        if why is None:  # not a difference (a capture of the caller's own in progress)
            return
        self.missed += 1
        if self.missed < MISSED:
            return
        from collage_compile.diagnostics import warn_once

        name = type(self.optimizer).__name__
        warn_once(
            ("replay-missed", name),
            f"collage: {name}.step asked for a replay as one CUDA graph (compile_optimizer("
            f"cudagraphs=True)), but the last {MISSED} steps ran compiled, without capture: "
            f"each differed from the one recorded before it ({why}).  They stay "
            "compensated; only the host work of a replay is lost (docs/speed.md).",
            stacklevel=4,
        )

    def _record(self) -> Any:
        """A call of the compiled step, recorded; the plan of its replay if it compiled
        nothing (on CUDA captured at the next call)."""
        global recording
        before, calls = _compiles, []
        recording = calls
        try:
            out = self.compiled()
        finally:
            recording = None
        if _compiles != before:
            return out
        try:
            if out is not None:
                raise _Refused("its step returns a value")
            plan = _Plan(self.optimizer, calls)
        except _Refused as e:
            self._refuse(str(e))
            return out
        except (LookupError, TypeError, AttributeError) as e:  # a source read differently
            self._refuse(f"its recorded step could not be read ({type(e).__name__}: {e})")
            return out
        if plan.device.type == "cuda":
            self.pending = plan
        else:
            self.plan = plan
        return out

    def _capture(self, pending: _Plan) -> Any:
        """Capture this call of the step as one CUDA graph, then replay it: a capture
        runs no kernel, so the replay is this step."""
        pending.refresh()  # the floats the graphs read, set before the capture
        with _own_grads(self.optimizer):
            return self._capture_with(pending)

    def _capture_with(self, pending: _Plan) -> Any:
        global recording, capturing
        graph = torch.cuda.CUDAGraph()
        # what the compiled step's wrappers bump on the host, which a replay must too
        watched = [*pending.params, *pending.state_values]
        versions = list(map(_VERSION, watched))
        before, calls, failed = _compiles, [], None
        recording, capturing = calls, True
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.compiled()
        except Exception as e:
            failed = e
        finally:
            recording, capturing = None, False
        if failed is not None:  # nothing ran on the device: the step runs as compiled
            log.debug("collage: capture of the whole step failed", exc_info=failed)
            if _compiles == before:  # else Dynamo had to compile: recorded again later
                self.capture_error = "".join(traceback.format_exception(failed))
                self._refuse(f"its capture failed ({type(failed).__name__}: {str(failed)[:200]})")
            return self.compiled()
        try:
            plan = _Plan(self.optimizer, calls, graph)
            plan.bumped = [t for t, v in zip(watched, versions) if t._version != v]
            if plan.wrappers != pending.wrappers:
                raise _Refused("the captured step called other graphs than the one before it")
        except (_Refused, LookupError, TypeError, AttributeError) as e:
            graph.replay()  # this step, as captured
            self._refuse(str(e))
            return None
        graph.replay()
        self.plan = plan
        self.missed = 0
        return None

    def _refuse(self, why: str) -> None:
        from collage_compile.diagnostics import warn_once

        self.refused = why
        name = type(self.optimizer).__name__
        warn_once(
            ("replay", name, why),
            f"collage: {name}.step is not replayed as one CUDA graph (compile_optimizer("
            f"cudagraphs=True)): {why}.  It runs compiled, without capture: compensated "
            "as before, with a compiled step's host work on every call (docs/speed.md).",
            stacklevel=4,
        )


@contextlib.contextmanager
def _own_grads(optimizer: torch.optim.Optimizer) -> Any:
    """Each parameter's gradient replaced by a copy for the capture, then put back: the
    captured graph reads buffers of its own, into which each replay copies that step's
    gradients, and never a tensor the user holds (a gradient kept for logging, a buffer
    of the user's own: the first GPU run found a held gradient overwritten by later
    steps' values)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


@functools.cache
def _global_hooks() -> tuple[dict[Any, Any], dict[Any, Any]]:
    from torch.optim import optimizer as module

    return module._global_optimizer_pre_hooks, module._global_optimizer_post_hooks


def _hooks(optimizer: torch.optim.Optimizer) -> bool:
    pre, post = _global_hooks()
    return bool(
        optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or pre or post
    )


def _parse(source: str | None) -> tuple[int, tuple[Any, ...], bool] | None:
    """``...param_groups[g]['params'][i].grad`` -> (g, ('params', i), True); None for a
    source elsewhere."""
    m = _SOURCE.search(source or "")
    if m is None:
        return None
    keys = tuple(int(i) if i else k for k, i in _KEY.findall(m.group(2)))
    return int(m.group(1)), keys, m.group(3) is not None


def _lookup(groups: list[dict[str, Any]], group: int, keys: tuple[Any, ...]) -> Any:
    value: Any = groups[group]
    for key in keys:
        value = value[key]
    return value


def _same_value(x: Any, y: Any) -> bool:
    """Equal hyperparameters; tensors (an lr held in a tensor) by identity."""
    return x is y or (not (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)) and x == y)


class _Settings:
    """A param group's entries other than its parameters and the floats a replay fills,
    checked by identity (what a scheduler or a user sets is a new object), by value where
    identity fails; a tuple with a filled element (a scheduled ``betas[0]``) element by
    element."""

    def __init__(self, group: dict[str, Any], filled: set[tuple[Any, ...]]):
        partly = {path[0] for path in filled if len(path) == 2}
        whole = {path[0] for path in filled if len(path) == 1}
        self.size = len(group)
        self.keys = [k for k in group if k != "params" and k not in whole and k not in partly]
        self.values = [group[k] for k in self.keys]
        self.partial = [
            (k, tuple(group[k]), {path[1] for path in filled if path[0] == k}) for k in partly
        ]
        # a list changed in place is the same object: its elements, as Dynamo guards them
        self.lists = [(k, list(group[k])) for k in self.keys if type(group[k]) is list]

    def changed(self, group: dict[str, Any]) -> bool:
        if len(group) != self.size:
            return True
        try:
            now = list(map(group.__getitem__, self.keys))
        except KeyError:
            return True
        if not all(map(operator.is_, now, self.values)) and not all(
            map(_same_value, now, self.values)
        ):
            return True
        for key, recorded, skip in self.partial:
            value = group[key]
            if len(value) != len(recorded) or not all(
                j in skip or _same_value(x, y) for j, (x, y) in enumerate(zip(value, recorded))
            ):
                return True
        for key, recorded in self.lists:  # param_names, say: by identity first, in C
            value = group[key]
            if len(value) != len(recorded) or not (
                all(map(operator.is_, value, recorded)) or all(map(_same_value, value, recorded))
            ):
                return True
        return False


class _Plan:
    """What one recorded step called, and what a replay of it must check and refresh.
    Raises :class:`_Refused` for a step a replay cannot reproduce."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        calls: list[tuple[Any, tuple[Any, ...], list[Any]]],
        graph: Any = None,
    ):
        self.optimizer, self.graph = optimizer, graph
        # autocast, grad mode, matmul precision, torch function modes: Dynamo's guards
        self.same_global_state = _compat.global_state()
        # CUDA: the parameters and state the captured step bumped the versions of
        self.bumped: list[torch.Tensor] = []
        groups = optimizer.param_groups
        self.params = list(itertools.chain.from_iterable(g["params"] for g in groups))
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise _Refused(f"its parameters are on {len(devices)} devices")
        self.device = next(iter(devices))
        self.none = list(map(_IS_NONE, map(_GRAD, self.params)))
        self.scalars: list[tuple[torch.Tensor, int, tuple[Any, ...]]] = []
        # wrappers watching a scheduled decay (compiler: decays), with where in param_groups
        # each float input they read is
        self.decay_checks: list[tuple[Any, dict[int, tuple[int, tuple[Any, ...]]]]] = []
        # guards on those floats: (function, where each argument is, the guard)
        self.guards: list[tuple[Callable[..., bool], list[tuple[Any, ...]], str]] = []
        self.grad_params: list[torch.Tensor] = []
        self.static_grads: list[torch.Tensor] = []
        self.grad_slots: list[tuple[int, int]] = []  # (call, input) of each gradient
        self.grad_layouts: list[tuple[int, ...] | None] = []  # the strides compiled for
        self.compiled_dtypes: list[torch.dtype | None] = []  # and the dtype
        self.calls: list[tuple[Callable[..., Any], list[Any]]] = []
        self.wrappers: list[Any] = []
        roles = self._take_calls(calls)
        filled = {(g, keys) for _, g, keys in self.scalars}
        self.settings = [
            _Settings(group, {keys for g, keys in filled if g == i})
            for i, group in enumerate(groups)
        ]
        # where each gradient input sits among the parameters (stale() reads them all)
        position = {id(p): i for i, p in enumerate(self.params)}
        self.grad_index = [position[id(q)] for q in self.grad_params]
        # as recorded (a dtype other than the compiled one: the wrapper rounded it, said so)
        self.grad_dtypes = list(map(_DTYPE, self.static_grads))
        self._private_grads()
        self._grad_shards()
        self._state_columns()
        self._pair_checks([w for w, r in zip(self.wrappers, roles) if r == "pairs"])
        self._addresses()

    def _take_calls(self, calls: list[tuple[Any, tuple[Any, ...], list[Any]]]) -> list[Any]:
        """Record each graph call of the step with its inputs as a replay passes them;
        returns each wrapper's role (compiler: ``_LoInputs`` "pairs", ``_StepTicks``
        "watch" or "graph", ``_EveryK`` "every")."""
        roles = [getattr(w, "replay_role", None) for w, _, _ in calls]
        if "pairs" not in roles:
            raise _Refused("its step called no graph that updates a pair")
        floats = [id(w) for w, _, _ in calls if getattr(w, "_scalars", None)]
        if len(floats) != len(set(floats)):  # one tensor per float, filled once a replay
            raise _Refused("a graph of its step that reads scheduled floats is called twice")
        for (wrapper, args, los), role in zip(calls, roles):
            self.wrappers.append(wrapper)
            if role == "pairs":
                self.calls.append((wrapper.compiled, self._inputs(wrapper, args, los)))
            elif role == "every":
                raise _Refused("it measures metrics every few steps (metrics=True)")
            elif role != "watch":  # the optimizer watch's graph: only its bookkeeping
                raise _Refused("its step calls a graph that updates no pair")
        return roles

    def _private_grads(self) -> None:
        """Where the graphs are called directly (a CPU): their gradient inputs replaced by
        copies of their own, into which each replay copies that step's gradients, as a
        CUDA capture reads copies of its own (:func:`_own_grads`).  Never a tensor the
        user holds; and laid out as the graphs were compiled (``copy_`` takes any new
        gradient's strides; the graphs, called here without their wrapper, would not)."""
        if self.device.type == "cuda":  # the capture reads copies of its own already
            return
        own = [
            g.clone() if want is None else g.new_empty_strided(g.shape, want, dtype=dtype).copy_(g)
            for g, want, dtype in zip(self.static_grads, self.grad_layouts, self.compiled_dtypes)
        ]
        for (call, slot), g in zip(self.grad_slots, own):
            self.calls[call][1][slot] = g
        self.static_grads = own

    def _grad_shards(self) -> None:
        """FSDP2: a DTensor's gradient is copied shard to shard (DTensor has no foreach
        copy), and a new one must be sharded as the captured one was."""
        dtensors = list(map(_compat.is_dtensor, self.static_grads))
        if any(dtensors) and not all(dtensors):
            raise _Refused("its gradients are DTensors and plain tensors at once")
        self.grad_specs = list(map(_spec, self.static_grads)) if any(dtensors) else []
        self.static_locals = list(map(_compat.local_tensor, self.static_grads))

    def _inputs(self, wrapper: Any, args: tuple[Any, ...], los: list[Any]) -> list[Any]:
        """A graph's inputs as a replay passes them, each one classified: a float the
        replay fills, a gradient it copies, a tensor held by ``param_groups``."""
        self._refuse_per_call_work(wrapper)
        statics = dict(wrapper._scalars)
        paths: dict[Any, tuple[int, tuple[Any, ...]]] = {}  # a filled float's symbol: where
        inputs = list(args)
        for i, arg in enumerate(args):
            if i not in wrapper.unused:
                self._classify(wrapper, i, arg, statics, inputs, paths)
        if self.device.type == "cuda":
            for i, t in enumerate([*inputs, *los]):
                if i not in wrapper.unused and isinstance(t, torch.Tensor):
                    if t.device.type != "cuda":
                        raise _Refused(f"a graph of its step reads a {t.device.type} tensor")
        self._guard_checks(wrapper, paths)
        if getattr(wrapper, "decay_watches", None):
            where = {
                i: (g, keys) for t, g, keys in self.scalars for i in statics if statics[i] is t
            }
            self.decay_checks.append((wrapper, where))
        return inputs + los

    def _refuse_per_call_work(self, wrapper: Any) -> None:
        """Refuse a graph whose wrapper does work of its own each call: metrics it returns,
        state it creates, tensors passed in, writes whose pairs restart after each call,
        or (on CUDA) a computation on CPU tensors that a capture would freeze."""
        if wrapper.metrics is not None:
            raise _Refused("it measures metrics (metrics=True), returned per call")
        if (
            wrapper.new_state
            or wrapper._by_input
            or wrapper._unchained_refs
            or wrapper._unchained_inputs
            or wrapper._restores
        ):
            raise _Refused("a graph of its step does per-call work outside its kernels")
        if self.device.type == "cuda" and wrapper.cpu_attrs:
            raise _Refused(
                f"a graph of its step computes on CPU tensors ({wrapper.cpu_attrs[0]}: a step "
                "count of a state loaded before compiling?), which a capture holds at one "
                "step's values"
            )

    def _classify(
        self,
        wrapper: Any,
        i: int,
        arg: Any,
        statics: dict[int, torch.Tensor],
        inputs: list[Any],
        paths: dict[Any, tuple[int, tuple[Any, ...]]],
    ) -> None:
        """Input ``i``: a float of ``param_groups`` (``inputs[i]`` becomes the tensor the
        replay fills), a parameter's gradient (copied each replay), or a tensor
        ``param_groups`` holds; anything else is refused."""
        groups = self.optimizer.param_groups
        source = wrapper.sources[i] if i < len(wrapper.sources) else None
        where = _parse(source)
        what = source or f"input {i}"
        if i in statics:
            value = _lookup(groups, *where[:2]) if where and not where[2] else None
            if not isinstance(value, (int, float)) or float(value) != arg.item():
                raise _Refused(f"it reads {what}, which is not a float of param_groups")
            inputs[i] = statics[i]
            self.scalars.append((statics[i], where[0], where[1]))
            paths[wrapper.scalar_symbols.get(i)] = where[:2]
        elif isinstance(arg, torch.Tensor) and where is not None and where[2]:
            param = _lookup(groups, *where[:2])
            if param.grad is not arg:
                raise _Refused(f"{what} is not that parameter's gradient")
            self.grad_params.append(param)
            self.static_grads.append(arg)
            self.grad_slots.append((len(self.calls), i))
            self.grad_layouts.append(wrapper.grad_layouts.get(i))
            self.compiled_dtypes.append(wrapper.grad_dtypes.get(i))
        elif not (isinstance(arg, torch.Tensor) and where and _lookup(groups, *where[:2]) is arg):
            raise _Refused(
                f"its graph reads {what} as a number that a replay would hold at one step's value"
            )

    def _guard_checks(self, wrapper: Any, paths: dict[Any, tuple[int, tuple[Any, ...]]]) -> None:
        """What the graph's compile guards on the floats a replay fills (SGD's ``if
        momentum != 0``, the lerp weight ``1 - beta1 < 0.5`` under a schedule that moves
        beta1): checked before each replay, as Dynamo checks them before each call."""
        for expr in wrapper.guards:
            fn, symbols = _compat.guard_function(expr)
            if not all(s in paths for s in symbols):
                raise _Refused(f"its compile guards on {expr}, which a replay cannot check")
            self.guards.append((fn, [paths[s] for s in symbols], str(expr)))

    def _pair_checks(self, wrappers: list[Any]) -> None:
        """Per graph that updates pairs, the tensors its check reads: the ones it holds
        (weak references) where they are all parameters or state values, which the plan
        holds and :meth:`stale` has found in place by then; else None (the graph reads its
        own)."""
        held = set(map(id, itertools.chain(self.params, self.state_values)))
        self.pair_checks = []
        for wrapper in wrappers:
            tensors = wrapper._attr_tensors()
            known = all(id(t) in held for t in tensors)
            self.pair_checks.append((wrapper, tensors if known else None))

    def _addresses(self) -> None:
        """Where the elements of each parameter and state value lie that no pair check
        reads already.  A CUDA graph reads and writes them by address: after ``t.data =
        other`` (a state moved off the device and back by hand, ``set_``) the same tensor
        sits on a new storage, and a replay would update the freed one.  A DTensor's
        address is its shard's (its own ``data_ptr`` is 0; the pair checks read that 0)."""
        checked = {id(t) for _, ts in self.pair_checks if ts is not None for t in ts}
        tensors = list(itertools.chain(self.params, self.state_values))
        sharded = list(map(_compat.is_dtensor, tensors))
        self.placed = [t for t, d in zip(tensors, sharded) if not d and id(t) not in checked]
        self.placed_shards = [t for t, d in zip(tensors, sharded) if d]
        self.places = self._where()

    def _where(self) -> list[int]:
        return [
            *map(_DATA_PTR, self.placed),
            *map(_DATA_PTR, map(_compat.shard_of, self.placed_shards)),
        ]

    def _state_columns(self) -> None:
        """The optimizer's state as it is: its dict and every value of each parameter's."""
        state = self.state_obj = self.optimizer.state
        dicts = list(state.values())
        if any(type(d) is not dict for d in dicts):
            raise _Refused("its optimizer state is not a dict per parameter")
        self.state_values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
        if not all(isinstance(v, torch.Tensor) for v in self.state_values):
            raise _Refused(
                "its optimizer state holds a Python value, which a replay would not update"
            )

    def stale(self, copy_grads: bool = False) -> str | None:
        """Why a replay would not be the step Dynamo would run now, else None.  With
        ``copy_grads``, new gradient tensors are copied into the captured ones as soon as
        the parameters and gradients passed, before the other checks: the device copies
        while the host checks.  A copy that a later check makes useless is harmless: only
        a replay reads the captured gradients, and a step run compiled records new ones."""
        opt = self.optimizer
        if _hooks(opt):
            return "step hooks"
        if not self.same_global_state():
            return "the global state changed (autocast, grad mode, matmul precision or modes)"
        groups = opt.param_groups
        params = list(itertools.chain.from_iterable(g["params"] for g in groups))
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return "param_groups changed"
        grads = list(map(_GRAD, params))
        if list(map(_IS_NONE, grads)) != self.none:
            return "a parameter's gradient appeared or went"
        if self.grad_specs and self._sharded_differently(grads):
            return "a gradient is sharded differently"
        if list(map(_DTYPE, map(grads.__getitem__, self.grad_index))) != self.grad_dtypes:
            return "a gradient's dtype changed"
        if copy_grads:
            self._copy_grads(grads)
        if len(groups) != len(self.settings) or any(map(_Settings.changed, self.settings, groups)):
            return "a hyperparameter changed"
        for fn, where, text in self.guards:
            if not fn(*(_lookup(groups, g, keys) for g, keys in where)):
                return f"a scheduled hyperparameter fails a guard of its graph ({text})"
        why = self._state_changed()
        if why is not None:
            return why
        if self._where() != self.places:
            return "a parameter or a state value moved to new storage (t.data = ...?)"
        for wrapper, tensors in self.pair_checks:
            why = wrapper.replay_blocker(tensors)
            if why is not None:
                return why
        return None

    def _sharded_differently(self, grads: list[Any]) -> bool:
        """Whether a gradient's sharding differs from the captured one's (FSDP2 keeps one
        spec object per parameter: identity first, then equality)."""
        specs = list(map(_spec, map(grads.__getitem__, self.grad_index)))
        if all(map(operator.is_, specs, self.grad_specs)):
            return False
        if not all(map(operator.eq, specs, self.grad_specs)):
            return True
        self.grad_specs = specs  # equal: next time by identity (the capture's are copies')
        return False

    def _state_changed(self) -> str | None:
        """``load_state_dict`` replaces ``optimizer.state``; a value replaced by hand shows
        in the values, all of them read in one pass over the dicts the state holds now
        (never by a tensor key: ``Tensor.__hash__`` is a Python call).  A parameter's dict
        replaced by one with the same tensors is the same step."""
        state = self.optimizer.state
        if state is not self.state_obj:
            return "the optimizer's state changed (load_state_dict?)"
        try:
            values = list(itertools.chain.from_iterable(map(dict.values, state.values())))
        except TypeError:  # a parameter's state is no longer a dict
            return "the optimizer's state changed"
        if len(values) != len(self.state_values) or not all(
            map(operator.is_, values, self.state_values)
        ):
            return "a value of the optimizer's state was replaced"
        return None

    def inside_a_capture(self) -> bool:
        """The caller is capturing a CUDA graph of its own: the step runs as compiled,
        into that graph."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _copy_grads(self, grads: list[Any]) -> None:
        """The parameters' gradients (``grads``, in parameter order) copied into the
        replay's own (:func:`_own_grads`, :meth:`_private_grads`): a gradient the user
        still holds is never written."""
        if not self.static_grads:
            return
        now = list(map(grads.__getitem__, self.grad_index))
        if self.grad_specs:  # DTensors: their shards (a Python call each)
            now = list(map(_compat.local_tensor, now))
        torch._foreach_copy_(self.static_locals, now)

    def _check_decays(self, wrapper: Any, paths: dict[int, tuple[int, tuple[Any, ...]]]) -> None:
        """A wrapper's scheduled decays (:mod:`collage_compile.decays`), read from
        param_groups as the replay fills them: the wrapper's own check is not called."""
        groups = self.optimizer.param_groups

        def value_of(i: int) -> float:
            return float(_lookup(groups, *paths[i])) if i in paths else float("nan")

        for watch in wrapper.decay_watches:
            watch.check(value_of, wrapper.plus_min_decay)

    def refresh(self) -> None:
        """The floats the graphs read, filled from param_groups."""
        groups = self.optimizer.param_groups
        for t, g, keys in self.scalars:
            t.fill_(_lookup(groups, g, keys))

    def run(self) -> None:
        """The replay, after :meth:`stale` passed and copied the gradients."""
        self.refresh()
        for wrapper, paths in self.decay_checks:
            self._check_decays(wrapper, paths)
        if self.graph is not None:
            self.graph.replay()
            # as the compiled step's wrappers bump them (autograd's check of a tensor saved
            # for backward and written since: "modified by an inplace operation")
            _compat.increment_versions(self.bumped)
        else:
            for fn, inputs in self.calls:
                fn(*inputs)
        for wrapper in self.wrappers:
            wrapper.after_replay()
        if hasattr(self.optimizer, "_opt_called"):  # an LR scheduler's check of the order
            self.optimizer._opt_called = True
