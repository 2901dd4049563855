"""The backend: Dynamo graph in, Inductor-compiled callable with MCF accumulators out.

    backend(gm, example_inputs)
      -> copy the graph (Dynamo's own is never mutated)
      -> normalize                passes.normalize (BatchNorm in mode="all", storage adds)
      -> find accumulators        accumulators.GraphInfo
      -> match their writes       passes (pattern families)
      -> keep what the mode asks  modes.select (parameters, EMAs, decays, everything)
                                  (mode="exact": exact.compile_exact, which computes on the
                                  fp32 values a bf16 tensor and its remainder hold instead)
      -> rewrite each into MCF    rewrite.plan_chains / emit
      -> attach lo state          rewrite.add_lo_inputs + a wrapper that passes lo tensors
      -> hand to Inductor         _compat.compile_with_inductor (roundings are fp32
                                  arithmetic, mcf.round_to, so Inductor cannot drop them;
                                  no bf16 tile transposes, _compat.no_low_precision_tiles)

A graph with nothing to upgrade goes to Inductor untouched: fp32/fp64 training is
bit-identical to ``backend="inductor"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.fx as fx

from collage_compile import (
    _compat,
    decays,
    names,
    outputs,
    remainder,
    replay,
    report,
    schedules,
    state,
    watch,
)
from collage_compile.accumulators import Accumulator, GraphInfo, fetch_attr, written_nodes
from collage_compile.config import CollageConfig
from collage_compile.metrics import GraphMetrics, Row, measuring_now

log = logging.getLogger("collage_compile")

__all__ = ["backend", "compile_graph", "make_backend", "uuid"]


def make_backend(**options: Any) -> Callable[..., Any]:
    """A backend for ``torch.compile(fn, backend=...)`` with the given options
    (see :class:`collage_compile.config.CollageConfig`)."""
    config = CollageConfig.from_options(options)
    watch.install()

    def collage_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(gm, example_inputs, config)

    collage_backend.config = config  # type: ignore[attr-defined]
    collage_backend.__name__ = "collage"
    return collage_backend


def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The backend with default options: ``torch.compile(fn, backend=collage_compile.backend)``."""
    return compile_graph(gm, example_inputs, _config_for(None))


def __getattr__(name: str) -> Any:
    # The "collage" entry point loads ``_registered_backend`` when torch.compile first asks
    # for it: that, not the import, is when the once-only set-up runs.
    if name == "_registered_backend":
        watch.install()
        return _collage_registered
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _collage_registered(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """``backend="collage"``: ``torch.compile`` forwards ``options={...}`` and ``mode=``
    here; ``mode="reduce-overhead"`` is ``options={"cudagraphs": True}``."""
    if mode not in (None, "default", "reduce-overhead"):
        raise ValueError(
            f"collage: torch.compile(mode={mode!r}) is not supported with backend='collage' "
            "(only 'default' and 'reduce-overhead'); pass options={...}"
        )
    if mode == "reduce-overhead":
        options = {"cudagraphs": True, **(options or {})}
    return compile_graph(gm, example_inputs, _config_for(options))


@functools.cache
def _config_cached(items: tuple[tuple[str, Any], ...]) -> CollageConfig:
    return CollageConfig.from_options(dict(items))


def _config_for(options: dict[str, Any] | None) -> CollageConfig:
    return _config_cached(tuple(sorted((options or {}).items())))


def uuid(config: CollageConfig) -> str:
    """A stable hash of every configuration field and of the source of every pass: what a
    cache of compiled steps must key on (as vLLM's pass manager keys its own)."""
    from collage_compile import passes

    text = repr(dataclasses.astuple(config)) + passes.uuid()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _may_alias_a_pair(acc: Accumulator) -> bool:
    return not acc.eligible and acc.real is None and acc.role == "tensor"


def compile_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: CollageConfig
) -> Callable[..., Any]:
    """Rewrite one Dynamo graph's accumulations into MCF and compile it with Inductor
    (with ``every`` other than 1, twice: with the metrics and without, see
    :class:`_EveryK`).  A scheduled lr that Dynamo took as a constant is first sent back
    to be traced as an input (:func:`_compat.retrace_with_dynamic_floats`)."""
    replay.compiling()  # counted; refused inside a capture of the whole step
    _compat.retrace_with_dynamic_floats(schedules.is_scheduled)
    shown = f"the graph of {_compat.current_frame() or 'a compiled function'}"
    if config.inductor_cudagraphs and _uncapturable(gm, example_inputs):
        watch.cudagraphs_on_cpu(shown)
    try:
        with watch.in_call(shown):
            compiled = _compile_graph(gm, example_inputs, config)
    except Exception as e:
        _compat.before_float_restart(e)
        raise
    if config.every != 1 and isinstance(compiled, _LoInputs) and compiled.metrics is not None:
        quiet = dataclasses.replace(config, metrics=False, every=1)
        with watch.in_call(shown):
            quiet_compiled = _compile_graph(gm, example_inputs, quiet, record=False)
        compiled = _EveryK(compiled, quiet_compiled, config.every)
    _compat.forget_float_specializations()
    return compiled


def _uncapturable(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """A graph with work for a CUDA graph that has no CUDA tensor.  The graph Dynamo
    captures after torch.optim's step (its graph break at ``_optimizer_step_code``) only
    ticks the optimizer watch on a CPU tensor: nothing to capture, nothing to name (on the
    GPU image it was named beside a captured step)."""
    if _compat.is_step_tick_graph(gm):
        return False
    return not any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)


class _EveryK:
    """Calls the graph that measures on the first call and every ``every``-th after it
    (``every="metered"``: on none of them) and inside :func:`collage_compile.measuring`,
    the same graph compiled without the measurement otherwise.  Both update the same
    tensors and pairs the same way (``tests/test_metrics.py`` asserts the weights are
    bit-identical to ``metrics=False``); which one runs is the wrapper's choice, so a step
    never recompiles for it."""

    replay_role = "every"  # for replay: which graph runs is chosen per call

    def __init__(
        self, measured: _LoInputs, plain: Callable[..., Any], every: int | Literal["metered"]
    ):
        self.measured, self.plain, self.every = measured, plain, every
        self.metrics = measured.metrics
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        if replay.recording is not None:
            replay.recording.append((self, args, []))
        n, self.calls = self.calls, self.calls + 1
        counted = isinstance(self.every, int) and n % self.every == 0
        measure = counted or measuring_now()
        return (self.measured if measure else self.plain)(*args)


def _compile_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: CollageConfig, record: bool = True
) -> Callable[..., Any]:
    watch.install()
    asked = config.mode != "off"  # compensation asked for (the watch hears which)
    if _compat.is_step_tick_graph(gm):
        # the optimizer watch's call after a step: nothing to compile, and the watch is
        # called directly rather than through its op (the dispatcher's Python wrapping
        # cost about as much as the watch itself)
        ticks = _compat.step_tick_ids(gm)
        return _StepTicks(_without_step_ticks(gm).forward, ticks, asked, empty=True)
    names.learn(gm, list(example_inputs))
    if asked:
        watch.read_by_graph(example_inputs)
    ticks = _compat.step_tick_ids(gm)
    compiled = _compile_rewritten(gm, example_inputs, config, record)
    if isinstance(compiled, _LoInputs):
        compiled.ticks, compiled.collage = ticks, asked
        compiled.replayed = config.inductor_cudagraphs
        compiled.sources = [names.source_name(n) for n in gm.graph.find_nodes(op="placeholder")]
        compiled.expect_grad_layouts(example_inputs)
        return compiled
    # for a capture of the whole step every graph it calls is seen (replay.record)
    wrap = ticks or config.cudagraphs == "step"
    return _StepTicks(compiled, ticks, asked) if wrap else compiled


def _without_step_ticks(gm: fx.GraphModule) -> fx.GraphModule:
    """Dynamo's graph without the optimizer watch's ticks (a copy: Dynamo's own is never
    mutated): the wrapper runs the watch after each call instead
    (:func:`_compat.take_step_ticks`).  What a graph that is compiled as Dynamo captured
    it gets; a rewrite takes the ticks out of its own copy."""
    if not _compat.has_step_ticks(gm):
        return gm
    copy = _compat.copy_graph_module(gm)
    _compat.take_step_ticks(copy)
    copy.recompile()
    return copy


class _Separated:
    """A compiled step with no pairs whose new outputs are separated after each call
    (:mod:`collage_compile.outputs`)."""

    replay_role = "graph"

    def __init__(self, compiled: Callable[..., Any], separate: outputs.Plan):
        self.compiled, self.separate = compiled, separate

    def __call__(self, *args: Any) -> Any:
        return outputs.separated(self.compiled(*args), args, self.separate)


class _StepTicks:
    """A compiled graph with nothing to upgrade that followed optimizer steps: the
    optimizer watch runs after each call (:func:`_without_step_ticks`)."""

    def __init__(
        self,
        compiled: Callable[..., Any],
        ticks: list[int],
        collage: bool,
        empty: bool = False,
    ):
        self.compiled, self.ticks = compiled, ticks
        # the watch hears a step whose code ran here as one collage was asked to compile
        # (True), or one compiled with mode="off", which asked for no compensation (False)
        self.collage = collage
        # for replay: the graph is the watch's ticks alone (it computes nothing), or not
        self.replay_role = "watch" if empty else "graph"

    def __call__(self, *args: Any) -> Any:
        if replay.recording is not None:
            replay.recording.append((self, args, []))
        out = self.compiled(*args)
        _run_ticks(self.ticks, self.collage, out)
        return out

    def after_replay(self) -> None:
        """What a call does besides its graph, for a replay of it (:mod:`replay`)."""
        _compat.run_step_ticks(self.ticks, by_collage=self.collage)


def _run_ticks(ticks: list[int], collage: bool, out: Any) -> None:
    """The optimizer watch after a call of a graph that held these optimizers' ticks; it
    sees the call's outputs (new state a step made: :func:`watch._made_state_alone`)."""
    watch.step_outputs[0] = out if isinstance(out, (list, tuple)) else ()
    try:
        _compat.run_step_ticks(ticks, by_collage=collage)
    finally:
        watch.step_outputs[0] = ()


def _compile_rewritten(
    original: fx.GraphModule, example_inputs: Sequence[Any], config: CollageConfig, record: bool
) -> Callable[..., Any]:
    from collage_compile import passes

    passes.foreach_sub.run(original)  # on Dynamo's graph: every path below compiles it
    gm = _compat.copy_graph_module(original)
    _compat.take_step_ticks(gm)
    normalized = passes.normalize(gm, config)
    # every low-precision tensor starts eligible: the families claim what they understand,
    # then the mode keeps what it upgrades (modes.select)
    info = GraphInfo(gm, list(example_inputs), config)
    if config.mode != "off":  # a collage graph wrote these, upgraded or named
        watch.written_by_graph([w.acc.real for w in info.writes])
    # an optimizer step: no bf16/fp16 tile transposes in its C++ kernels (GCC 12 at -O3
    # miscompiles them on AVX-512, silently); a forward pass goes to Inductor untouched
    tiles = _compat.no_low_precision_tiles() if info.writes else contextlib.nullcontext()
    with tiles:
        compiled = _compile_analyzed(original, gm, normalized, info, example_inputs, config, record)
    separate = outputs.plan(original) if info.writes else ([], [])
    if not separate[1]:
        return compiled
    if isinstance(compiled, _LoInputs):
        compiled.separate = separate
        return compiled
    return _Separated(compiled, separate)


def _compile_analyzed(
    original: fx.GraphModule,
    gm: fx.GraphModule,
    normalized: dict[str, int],
    info: GraphInfo,
    example_inputs: Sequence[Any],
    config: CollageConfig,
    record: bool,
) -> Callable[..., Any]:
    from collage_compile import modes, passes, rewrite

    ctx = rewrite.MatchContext(info)
    counts = passes.run(info, ctx)
    if config.mode == "exact":
        return _compile_exact(
            original, gm, info, ctx.sites, normalized, example_inputs, config, record
        )
    # mode="off" measures the parameter updates the families recognized, then drops them all
    measured_sites = {w: s for w, s in ctx.sites.items() if w.acc.role == "param"}
    modes.select(info, ctx, config)
    unsupported = [w for w in info.writes if w.acc.eligible and w not in ctx.sites]
    rep = report.GraphReport.build(info, ctx.sites, unsupported, config)
    if record:  # the same graph compiled a second time (every=) is not reported again
        rep.warn_unsupported()
        report.record(rep)
    if config.mode == "off":
        return _measure_only(original, gm, info, measured_sites, example_inputs, config)

    chains = rewrite.plan_chains(info, ctx.sites, unsupported)
    chained = {id(c.acc) for c in chains}
    upgraded = [acc for acc in info.accumulators if id(acc) in chained]
    watch.compiled_frame(
        _compat.current_frame(),
        [
            (names.display(a.real, a.name), id(a.real) if a.real is not None else None)
            for a in upgraded
        ],
    )
    unchained = _unchained(info, unsupported, upgraded)
    _warn_returned_averages(info)
    clones = rewrite.weight_clones(info)
    if not chains and not clones and not any(normalized.values()):
        log.debug(
            "collage: nothing to upgrade in graph (%d accumulators seen)", len(info.accumulators)
        )
        writes = _writes_parameters(gm)
        return _compile_unrewritten(original, gm, example_inputs, config, unchained, writes)
    log.debug(
        "collage: rewriting %d sites in %d chains on %d tensors (%s)",
        sum(len(c.sites) for c in chains),
        len(chains),
        len(upgraded),
        ", ".join(f"{k}={v}" for k, v in counts.items()),
    )
    out = _compile_chains(
        gm, info, chains, upgraded, unsupported, unchained, example_inputs, config, clones
    )
    out.decay_watches = _decay_watches(info, ctx.scheduled_decays)
    out.plus_min_decay = config.plus_min_decay
    return out


def _decay_watches(info: GraphInfo, scheduled: list[Any]) -> list[decays.DecayWatch]:
    """One watch per scheduled decay that plus left tensors for (:mod:`decays`), naming
    them; a decay this cannot evaluate from the graph's float inputs is not watched."""
    from collage_compile import modes

    found: dict[tuple[Any, bool], decays.DecayWatch | None] = {}
    for acc, node, lerp in scheduled:
        if (node, lerp) not in found:
            b = modes.decay_value(info, node, lerp)
            found[node, lerp] = (
                None if b is None else decays.watch_for(node, lerp, info.placeholders, b)
            )
        if found[node, lerp] is not None:
            found[node, lerp].names.append(acc.describe())
    return [w for w in found.values() if w is not None]


def _unchained(
    info: GraphInfo, unsupported: list[Any], upgraded: list[Accumulator]
) -> list[Accumulator]:
    """Tensors this graph writes without a chain: an unsupported write to a tensor with no
    chain here, or a write to a tensor passed in that is not upgraded (it may be ``p.data``
    of a parameter carrying a pair).  Any pair on their memory no longer matches its hi:
    the wrapper zeroes its lo after the call."""
    return list(
        {
            w.acc: None
            for w in info.writes
            if (w in unsupported and w.acc not in upgraded) or _may_alias_a_pair(w.acc)
        }
    )


def _no_finer(source: fx.Node, acc: Accumulator) -> bool:
    """Whether ``source`` holds no more precision than ``acc``: an fp32 source (``value(p)``
    saved, an fp32 master) sets hi and keeps in lo what hi cannot hold, so its restore
    drops nothing."""
    ex = _compat.example_value(source)
    return not isinstance(ex, torch.Tensor) or ex.dtype.itemsize <= acc.dtype.itemsize


def _restoring_slots(
    info: GraphInfo, sites: dict[Any, Any], upgraded: list[Accumulator], readers: list[Any]
) -> list[int]:
    """Slots of the weights this graph begins by overwriting with another tensor that
    carries no pair (``p.copy_(snapshot)``: L-BFGS's line search restoring its weights, a
    rollback): hi is set and lo restarts, so what the pair carried until then is dropped
    there (:meth:`_LoInputs.watch_restores` names it when it recurs)."""
    pairs = {a.node for a in [*upgraded, *readers]}
    first: dict[int, Any] = {}
    for w in info.writes:
        first.setdefault(id(w.acc), w)
    slots = []
    for slot, acc in enumerate(upgraded):
        site = sites.get(first.get(id(acc)))
        steps = site.steps if site is not None else []
        source = steps[0].args[0] if steps and steps[0].args else None
        if (
            site is not None
            and site.pattern == "copy_(overwrite)"
            and acc.is_weight
            and isinstance(source, fx.Node)
            and source not in pairs
            and _no_finer(source, acc)
        ):
            slots.append(slot)
    return slots


def _warn_returned_averages(info: GraphInfo) -> None:
    """Name each average a graph computes and returns without writing it: the code that
    writes it back runs outside every compiled graph, in plain low precision
    (:func:`passes.copy_expr.returned_updates`)."""
    from collage_compile.passes import copy_expr

    for acc, how in copy_expr.returned_updates(info):
        dtype = str(acc.dtype).replace("torch.", "")
        report.warn_once(
            ("returned-average", acc.name, str(tuple(acc.example.shape))),
            f"collage: a graph compiled with the collage backend returns an average of "
            f"{acc.describe()} ({how}) and writes it nowhere: the code that writes it back "
            f"runs outside the compiled graph, in plain {dtype}, so the average is not "
            "compensated (AveragedModel(avg_fn=...), or its default SWA average on a CPU: "
            "update_parameters breaks its graph and only avg_fn is compiled).  Use "
            "AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay)) or "
            "multi_avg_fn=get_swa_multi_avg_fn(), or update the average in place inside "
            "one compiled function (avg.lerp_(p, 1 - decay)).",
        )


def _compile_unrewritten(
    original: fx.GraphModule,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CollageConfig,
    unchained: list[Accumulator],
    writes_params: bool = False,
) -> Callable[..., Any]:
    """A graph with no chain, compiled as plain Inductor would, but for the floats a
    schedule changes, which stay inputs here too (an fp32 optimizer under a schedule: one
    compile per lr filled the recompile limit its bf16 twin shares, a step's code); the
    wrapper still zeroes the lo of a pair on memory it writes (``unchained``).  A step
    over fp32 parameters is watched for a parameter changed under it: ``model.to(
    torch.bfloat16)`` after compiled fp32 steps reused the step, which read bf16 memory as
    fp32 and crashed the process (plain Inductor too); it raises, naming the tensor."""
    from collage_compile import passes

    if any(passes.finalize(gm).values()):
        gm.recompile()
        original = gm
    compiled = _compat.compile_with_inductor(
        _without_step_ticks(original), example_inputs, cudagraphs=config.inductor_cudagraphs
    )
    if not (unchained or writes_params):
        return compiled
    out = _LoInputs(compiled, [], unchained)
    if writes_params:
        out.watch_layouts(gm, every_dim=True)
    return out


def _writes_parameters(gm: fx.GraphModule) -> bool:
    """Whether the graph writes a parameter it holds (an optimizer step, of any dtype)."""
    params = {
        n
        for n in gm.graph.find_nodes(op="get_attr")
        if isinstance(fetch_attr(gm, str(n.target)), torch.nn.Parameter)
    }
    return bool(params) and any(w in params for node in gm.graph.nodes for w in written_nodes(node))


def _compile_chains(
    gm: fx.GraphModule,
    info: GraphInfo,
    chains: list[Any],
    upgraded: list[Accumulator],
    unsupported: list[Any],
    unchained: list[Accumulator],
    example_inputs: Sequence[Any],
    config: CollageConfig,
    clones: list[tuple[Any, Accumulator]] = (),  # type: ignore[assignment]
) -> _LoInputs:
    """The graph with its chains rewritten into MCF arithmetic and the lo of each upgraded
    tensor (those ``chains`` update) an input, compiled by Inductor, in the wrapper that
    passes the lo; a clone of a weight it returns gets a clone of the weight's lo
    (:func:`rewrite.weight_clones`)."""
    from collage_compile import passes, rewrite

    # tensors carrying a pair that a chain reads whole (an EMA's parameter) or that the
    # graph returns a clone of pass their lo in too, after the upgraded ones
    readers = rewrite.pair_readers(info, chains)
    readers += list(dict.fromkeys(a for _, a in clones if a not in upgraded and a not in readers))
    with_lo = upgraded + readers
    fake_mode = _compat.fake_mode_of(example_inputs, gm)
    rewrite.add_lo_inputs(gm, with_lo, fake_mode)
    measured = rewrite.emit(gm, info, chains, unsupported, config.arithmetic, config.metrics)
    new_state = rewrite.add_clone_los(gm, clones)
    if measured:
        rewrite.add_metrics_output(gm, measured)
    passes.finalize(gm)
    inputs, scalars, host = rewrite.capture_inputs(gm, fake_mode, example_inputs, config.cudagraphs)
    gm.graph.lint()
    gm.recompile()
    lo_examples = [_compat.example_value(acc.lo_node) for acc in with_lo]
    tensors = sum(isinstance(t, torch.Tensor) for t in inputs)
    patches = {**_inductor_patches(config), **_compat.combo_args_patch(tensors, len(with_lo))}
    compiled = _compat.compile_with_inductor(
        gm, [*inputs, *lo_examples], patches, config.inductor_cudagraphs
    )
    out = _LoInputs(
        compiled,
        upgraded,
        unchained,
        _graph_metrics(measured),
        readers,
        new_state=new_state,
        scalars=_static_scalars(scalars),
        guards=_scalar_guards(scalars),
    )
    out.watch_layouts(gm)
    out.watch_restores(
        _restoring_slots(info, {s.write: s for c in chains for s in c.sites}, upgraded, readers)
    )
    if host is not None:
        out.unused, out.cpu_attrs = host
    return out


def _static_scalars(scalars: list[tuple[int, Any]]) -> list[tuple[int, torch.Tensor]]:
    """A tensor of the graph's own for each float it reads from one (filled per call)."""
    return [(i, torch.zeros((), dtype=torch.float64, device=f.device)) for i, f in scalars]


def _scalar_guards(scalars: list[tuple[int, Any]]) -> tuple[dict[int, Any], list[Any]]:
    """After the compile: the symbol of each float read from a tensor, and the guards the
    compile holds on them (:func:`_compat.float_guards`), which a replay checks itself."""
    symbols = {i: _compat.item_symbol(f) for i, f in scalars}
    guards = {g: None for _, f in scalars for g in _compat.float_guards(f)}
    return symbols, list(guards)


def _compile_exact(
    original: fx.GraphModule,
    gm: fx.GraphModule,
    info: GraphInfo,
    sites: dict[Any, Any],
    normalized: dict[str, int],
    example_inputs: Sequence[Any],
    config: CollageConfig,
    record: bool,
) -> Callable[..., Any]:
    """``mode="exact"`` (:mod:`collage_compile.exact`); a graph that writes nothing (a
    forward pass) goes to Inductor untouched, unless it makes optimizer state (ADOPT's
    first step only fills its second moment: :func:`exact.makes_state`)."""
    from collage_compile import exact

    if not info.writes and not any(normalized.values()) and not exact.makes_state(gm, info):
        if record:
            report.record(report.GraphReport.build(info, {}, [], config))
        return _compat.compile_with_inductor(
            _without_step_ticks(original), example_inputs, cudagraphs=config.inductor_cudagraphs
        )
    c = exact.compile_exact(gm, info, sites, example_inputs, config, record)
    out = _LoInputs(
        c.fn,
        c.upgraded,
        c.left,
        _graph_metrics(c.measured),
        c.readers,
        exact=True,
        new_state=c.new_state,
        scalars=_static_scalars(c.scalars),
        guards=_scalar_guards(c.scalars),
    )
    out.watch_layouts(gm)
    out.watch_restores(_restoring_slots(info, sites, c.upgraded, c.readers))
    if c.host is not None:
        out.unused, out.cpu_attrs = c.host
    return out


def _measure_only(
    original: fx.GraphModule,
    gm: fx.GraphModule,
    info: GraphInfo,
    sites: dict[Any, Any],
    example_inputs: Sequence[Any],
    config: CollageConfig,
) -> Callable[..., Any]:
    """``mode="off"``: the graph as plain Inductor compiles it, plus (with metrics) the
    measurements around its parameter writes.  A write here leaves any pair on the tensor
    stale, so its lo restarts from zero after the call (a later collage graph resumes)."""
    from collage_compile import passes, rewrite

    written = {w.acc: None for w in info.writes}
    unchained = [a for a in written if a.carries_pair or a.real is None]
    measured = []
    if config.metrics and sites:
        others = [w for w in info.writes if w.acc.role == "param" and w not in sites]
        chains = rewrite.plan_chains(info, sites, others)
        measured = rewrite.emit_measurements(gm, info, chains)
    if measured:
        rewrite.add_metrics_output(gm, measured)
    if any(passes.finalize(gm).values()) or measured:
        gm.graph.lint()
        gm.recompile()
        original = gm
    else:
        original = _without_step_ticks(original)
    # Inductor's own settings: its choice of what to materialize decides which bf16
    # temporaries are rounded, and "off" promises plain Inductor's arithmetic
    compiled = _compat.compile_with_inductor(
        original, example_inputs, cudagraphs=config.inductor_cudagraphs
    )
    if not measured:
        return _LoInputs(compiled, [], unchained) if unchained else compiled
    return _LoInputs(compiled, [], unchained, _graph_metrics(measured))


def _graph_metrics(measured: list[tuple[Accumulator, Any]]) -> GraphMetrics | None:
    if not measured:
        return None
    rows = [
        Row(
            acc.name,
            weakref.ref(acc.real) if acc.real is not None else None,
            acc.input_index if acc.real is None else None,
        )
        for acc, _ in measured
    ]
    return GraphMetrics(rows)


def _inductor_patches(config: CollageConfig) -> dict[str, Any]:
    """Inductor config for a rewritten graph.

    The MCF roundings never depend on it (they are fp32 arithmetic).  In C++ loops the
    step's fp32 scalars are computed once per kernel (:func:`_compat.scalar_prologue_patch`).
    ``"storage"`` arithmetic is a long sequence of error-free transformations whose reused
    intermediates make Inductor's inlining exponential (minutes for one SGD step), so there
    Inductor materializes them early (:func:`_compat.bounded_inlining_patch`; the scheduler
    still fuses them into one kernel, checked by the kernel-count test); and it promises
    eager bf16 semantics for the whole optimizer step, so every other low-precision op of
    the graph (momentum buffers, ``grad + wd * p``) must round like eager too: that is
    ``emulate_precision_casts``, scoped to this graph.  The compiled module does not
    re-assert every input's size and stride (:func:`_compat.no_input_asserts_patch`).
    """
    if config.arithmetic == "storage":
        patches = {**_compat.bounded_inlining_patch(), **_compat.eager_rounding_patch()}
    else:
        patches = dict(_compat.scalar_prologue_patch())
    return {**patches, **_compat.no_input_asserts_patch()}


def inductor_options() -> dict[str, Any]:
    """Options for compiling MCF functions (``collage_compile.mcf``) yourself with Inductor:
    ``torch.compile(fn, options=collage_compile.inductor_options())``.  Without them the
    error-free transformations' reused intermediates make Inductor's lowering exponential."""
    return dict(_compat.bounded_inlining_patch())


_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = operator.methodcaller("stride")
_DTYPE = operator.attrgetter("dtype")
_IS_NONE = functools.partial(operator.is_, None)


def _check_as_compiled(what: str, t: torch.Tensor, meta: tuple[Any, ...]) -> None:
    """Raise unless ``t`` has the dtype, shape and strides (``meta``) its graph was compiled
    for.  A parameter changed under the same Parameter object (``module.half()``,
    ``model.to(memory_format=...)``, ``param.data = ...``) passes Dynamo's guards, which
    check an optimizer's parameters by identity alone, and the backend turns off Inductor's
    input asserts (:func:`_compat.no_input_asserts_patch`): the step would read it as the
    tensor it was compiled for."""
    if (t.dtype, t.shape, t.stride()) == meta:
        return
    dtype, shape, stride = meta
    was = f"{str(dtype).replace('torch.', '')} {tuple(shape)} strides {stride}"
    now = f"{str(t.dtype).replace('torch.', '')} {tuple(t.shape)} strides {t.stride()}"
    raise RuntimeError(
        f"collage: {what} is now {now}, and the graph was compiled for {was}: it changed "
        "(module.half(), model.to(memory_format=...), param.data = ...) after the graph was "
        "compiled, and torch.compile does not re-check an optimizer's parameters (the "
        "step would read it as the tensor it was compiled for).  Call "
        "torch._dynamo.reset() or compile the step again after the change."
    )


def _graph_title(upgraded: list[Accumulator]) -> str:
    """A graph as messages name it: the first four tensors it updates."""
    shown = [names.display(a.real, a.name) for a in upgraded[:4]]
    if not shown:
        return "a graph compiled by the collage backend"
    more = f", and {len(upgraded) - 4} more" if len(upgraded) > 4 else ""
    return f"the graph that updates {', '.join(shown)}{more}"


# a weight overwritten from a snapshot after being updated, this many times per graph, is
# named: once is a load or a rollback, a restore on every step leaves nothing compensated
_RESTORES_NAMED = 3


class _LoInputs:
    """Calls the compiled graph with the lo component of every upgraded tensor appended (then
    that of every weight a chain only reads), and afterwards zeroes the lo of every pair on
    memory the graph wrote without an MCF chain.

    The host work per call does not grow with the number of tensors beyond a few C-level
    passes over them: get_attr tensors are fixed for the graph (Dynamo guards their
    identity), so their lo list is built once and rebuilt only when the registry changes
    (:func:`state.epoch`) or a tensor's storage does (``p.data = ...``, ``module.half()``);
    one comparison of version counters finds any write from outside (:mod:`state`), and one
    dict update records them after the call.  Nothing reads a tensor's values and nothing
    synchronizes with the device.  Tensors that arrive as inputs (a hand-written step's
    arguments, an EMA's ``detach()`` aliases) are looked up per call.  A weight the graph
    only reads (an EMA's parameter) gets its pair's lo when it has one, else zeros: reading
    it creates no pair (its writer does that).
    """

    replay_role = "pairs"  # for replay: a graph whose inputs it classifies

    def __init__(
        self,
        compiled: Callable[..., Any],
        upgraded: list[Accumulator],
        unchained: list[Accumulator] = (),  # type: ignore[assignment]
        metrics: GraphMetrics | None = None,
        readers: list[Accumulator] = (),  # type: ignore[assignment]
        exact: bool = False,
        new_state: list[int] = (),  # type: ignore[assignment]
        scalars: list[tuple[int, torch.Tensor]] = (),  # type: ignore[assignment]
        guards: tuple[dict[int, Any], list[Any]] = ({}, []),
    ):
        self.compiled = compiled
        # floats the graph reads from a tensor of its own, which keeps its address
        # (rewrite.scalars_as_static_inputs): filled from Dynamo's input before each call
        self._scalars = list(scalars)
        # their symbols (by input index) and what the compile guards on their values, which
        # Dynamo checks before each call and a replay checks itself
        self.scalar_symbols, self.guards = guards
        self.metrics = metrics
        # optimizers whose steps this graph ran: the watch checks them after each call
        self.ticks: list[int] = []
        self.collage = True  # False: compiled with mode="off" (the watch's by_collage)
        # captured as a CUDA graph: an output is overwritten by the next replay
        self.replayed = False
        # Dynamo's source of each input (``L['self'].param_groups[0]['lr']``)
        self.sources: list[str] = []
        # cudagraphs="step": inputs the graph does not read, CPU tensors it holds
        self.unused: frozenset[int] = frozenset()
        self.cpu_attrs: list[str] = []
        self._shown = _graph_title(upgraded)
        self.exact = exact  # lo inputs are exact remainders (mode="exact")
        # outputs that are new tensors whose remainders follow the outputs (exact mode)
        self.new_state = list(new_state)
        # new outputs Inductor may return on an input's or another output's memory
        self.separate: outputs.Plan | None = None
        # decays a schedule changes, for which plus left tensors (set by the compiler)
        self.decay_watches: list[decays.DecayWatch] = []
        self.plus_min_decay = 1.0
        self._index(upgraded, unchained, readers)
        self._init_layouts()

    def _index(
        self, upgraded: list[Accumulator], unchained: list[Accumulator], readers: list[Accumulator]
    ) -> None:
        """Where each tensor's lo goes among the graph's inputs (a slot per upgraded tensor,
        then per reader): the attrs (held by the graph, by weak reference), the inputs
        (looked up per call), and what every call writes."""
        attrs = [(slot, a) for slot, a in enumerate(upgraded) if a.real is not None]
        self._attr_slots = [slot for slot, _ in attrs]
        self._attr_accs = [a for _, a in attrs]
        self._attr_refs = [weakref.ref(a.real) for _, a in attrs]
        self._attr_meta = [(a.real.dtype, a.real.shape, a.real.stride()) for _, a in attrs]
        self._by_input = [
            (slot, a.input_index, a.name) for slot, a in enumerate(upgraded) if a.real is None
        ]
        first = len(upgraded)
        self._readers = [
            (first + i, weakref.ref(a.real) if a.real is not None else None, a.input_index)
            for i, a in enumerate(readers)
        ]
        self._zeros: dict[int, torch.Tensor] = {}
        self._call_los: list[torch.Tensor | None] = [None] * (len(upgraded) + len(readers))
        self._lo_ids: list[int] = []  # id of each attr's lo, in _attr_* order
        self._epoch: int | None = None  # state.epoch() when the lo list was built
        self._ptrs: list[int] = []  # the attrs' data pointers then
        self._unchained_refs = [(weakref.ref(a.real), a) for a in unchained if a.real is not None]
        self._unchained_inputs = [(a.input_index, a) for a in unchained if a.real is None]
        # what every call writes (watch: an optimizer step no collage graph wrote is named)
        self._written_ids = frozenset(
            id(a.real) for a in [*upgraded, *unchained] if a.real is not None
        )
        self._written_inputs = [a.input_index for a in [*upgraded, *unchained] if a.real is None]

    def _init_layouts(self) -> None:
        """Nothing watched yet: :meth:`expect_grad_layouts` and :meth:`watch_layouts` fill
        these once the graph is compiled."""
        # an optimizer's gradients among the inputs, and the strides the graph was compiled
        # for (expect_grad_layouts)
        self.grad_layouts: dict[int, tuple[int, ...]] = {}
        self.grad_dtypes: dict[int, torch.dtype] = {}
        self._grad_inputs: list[int] = []
        self._grad_strides: list[tuple[int, ...]] = []
        self._grad_dtypes: list[torch.dtype] = []
        # other parameters the graph holds (watch_layouts): references, what it was compiled
        # for, their data pointers then
        self._fixed: list[tuple[weakref.ref, tuple[Any, ...], str]] = []
        self._fixed_ptrs: list[int] = []
        # weights a call overwrites from a tensor without a pair (watch_restores): (slot,
        # index among the attrs or None, input index or None, name), each one's version
        # after this graph's last call, and how often something else wrote it in between
        self._restores: list[tuple[int, int | None, int | None, str]] = []
        self._restore_versions: list[int | None] = []
        self._restore_counts: list[int] = []

    def watch_layouts(self, gm: fx.GraphModule, every_dim: bool = False) -> None:
        """Watch the other parameters ``gm`` holds (a weight a chain only reads, an fp32
        weight stepped beside the pairs) as the attrs are watched (:meth:`_refresh`).
        Dynamo guards an optimizer's parameters by identity alone, and the backend turns
        off Inductor's input asserts (:func:`_compat.no_input_asserts_patch`), so a weight
        swapped under the same Parameter (``model.to(memory_format=...)``,
        ``module.half()``, ``p.data = ...``) would be read as the graph was compiled for.
        A parameter of one dimension has no other layout and is left out (``every_dim``:
        not, for its dtype: a step over fp32 parameters alone): per call, one comparison of
        data pointers, over none of the weights of a bf16 language model."""
        seen = {id(t) for t in (r() for r in self._attr_refs) if t is not None}
        for node in gm.graph.find_nodes(op="get_attr"):
            t = fetch_attr(gm, str(node.target))
            if (
                isinstance(t, torch.nn.Parameter)
                and (t.dim() >= 2 or every_dim)
                and not _compat.is_dtensor(t)  # its shard's strides Dynamo guards
                and id(t) not in seen
            ):
                seen.add(id(t))
                meta = (t.dtype, t.shape, t.stride())
                self._fixed.append(
                    (weakref.ref(t), meta, names.display(t, names.source_name(node)))
                )
        self._fixed_ptrs = [_DATA_PTR(r()) for r, _, _ in self._fixed]

    def _check_fixed(self) -> None:
        """Raise if a parameter :meth:`watch_layouts` watches is not what the graph was
        compiled for; a new storage of the same layout is taken as it is."""
        tensors = [r() for r, _, _ in self._fixed]
        if any(map(_IS_NONE, tensors)):
            return  # freed: Dynamo's guards fail before this graph runs again
        ptrs = list(map(_DATA_PTR, tensors))
        if ptrs == self._fixed_ptrs:
            return
        for t, (_, meta, name) in zip(tensors, self._fixed):
            _check_as_compiled(f"{name}, held by {self._shown},", t, meta)
        self._fixed_ptrs = ptrs

    def expect_grad_layouts(self, example_inputs: Sequence[Any]) -> None:
        """Record the strides and dtypes of the gradients among the inputs (``sources``).
        Dynamo does not guard an optimizer's gradients (nor its parameters), and the
        backend turns off Inductor's input asserts (:func:`_compat.no_input_asserts_patch`):
        a gradient laid out otherwise on a later call would be read in this layout, and one
        of another dtype (``p.grad_dtype`` set mid-run) its bytes read as this dtype,
        silently wrong.  Each call compares them (a pass in C each)."""
        for i, source in enumerate(self.sources):
            t = example_inputs[i] if i < len(example_inputs) else None
            if source.endswith(".grad") and isinstance(t, torch.Tensor):
                # a DTensor's shard strides Dynamo does guard: another layout recompiles
                # (measured on 2.13; tests/test_tiles.py -k fsdp2)
                if not _compat.is_dtensor(t):
                    self.grad_layouts[i] = t.stride()
                    self.grad_dtypes[i] = t.dtype
        self._grad_inputs = list(self.grad_layouts)
        self._grad_strides = list(self.grad_layouts.values())
        self._grad_dtypes = list(self.grad_dtypes.values())

    def _relaid(self, args: Sequence[Any], strides: list[tuple[int, ...]]) -> list[Any]:
        """``args`` with each gradient whose strides or dtype differ from the compiled ones
        copied into that layout and dtype (by value), said once per gradient."""
        args = list(args)
        wanted = zip(self._grad_inputs, self._grad_strides, self._grad_dtypes, strides)
        for i, want, dtype, got in wanted:
            g = args[i]
            if want == got and g.dtype == dtype:
                continue
            args[i] = g.new_empty_strided(g.shape, want, dtype=dtype).copy_(g)
            kind = "grad-dtype" if g.dtype != dtype else "grad-layout"
            if g.dtype != dtype:
                what = (
                    f"arrived as {g.dtype}, and {self._shown} was compiled for {dtype}; "
                    "torch.compile does not re-check an optimizer's gradients (its bytes "
                    f"would be read as {dtype}), so it is rounded to {dtype} on every such "
                    "call.  Keep a gradient's dtype from step to step (p.grad_dtype), or "
                    "compile the step after changing it."
                )
            else:
                what = (
                    f"arrived with strides {got}, and {self._shown} was compiled for {want}; "
                    "torch.compile does not re-check an optimizer's gradients, so it is "
                    "copied into that layout on every such call (plain Inductor would "
                    "raise).  Keep a gradient's layout from step to step to avoid the copy."
                )
            report.warn_once((kind, id(self), i), f"collage: {self.sources[i]} {what}")
        return args

    def watch_restores(self, slots: list[int]) -> None:
        """Count the calls that overwrite a weight in ``slots`` (:func:`_restoring_slots`)
        after something else wrote it: a restore between updates drops the lo the updates
        built, so a recurring one leaves the weight uncompensated and is named."""
        attrs = {slot: pos for pos, slot in enumerate(self._attr_slots)}
        inputs = {slot: (idx, name) for slot, idx, name in self._by_input}
        for slot in slots:
            if slot in attrs:
                self._restores.append((slot, attrs[slot], None, self._attr_accs[attrs[slot]].name))
            else:
                self._restores.append((slot, None, *inputs[slot]))
        self._restore_versions = [None] * len(self._restores)
        self._restore_counts = [0] * len(self._restores)

    def _restored(self, args: Sequence[Any], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Before the call: the weights it overwrites, each counted at the first call and
        whenever written since this graph last did (named once at
        :data:`_RESTORES_NAMED`: the third restore)."""
        weights = [
            tensors[pos] if pos is not None else args[idx] for _, pos, idx, _ in self._restores
        ]
        named = []
        for i, t in enumerate(weights):
            seen = self._restore_versions[i]
            if seen is None or t._version != seen:
                self._restore_counts[i] += 1
                if self._restore_counts[i] == _RESTORES_NAMED:
                    named.append(names.display(t, self._restores[i][3]))
        if named:
            watch.restored(named, str(weights[0].dtype).replace("torch.", ""))
        return weights

    def _attr_tensors(self) -> list[torch.Tensor]:
        tensors = [r() for r in self._attr_refs]
        # by identity, in C: ``None in tensors`` would call Tensor.__eq__ on every element
        if any(map(_IS_NONE, tensors)):
            acc = next(a for t, a in zip(tensors, self._attr_accs) if t is None)
            raise RuntimeError(f"collage: {acc.name} of a compiled graph was freed")
        return tensors  # type: ignore[return-value]

    def _refresh(self, tensors: list[torch.Tensor]) -> None:
        """Rebuild the attrs' lo list: the registry changed, or a tensor's storage did."""
        for t, acc, meta in zip(tensors, self._attr_accs, self._attr_meta):
            _check_as_compiled(acc.describe(), t, meta)
        los = []
        for t, slot, acc in zip(tensors, self._attr_slots, self._attr_accs):
            lo = self._call_los[slot]
            if lo is None or state.get_lo(t) is not lo:
                name = names.display(t, acc.name)
                lo = self._call_los[slot] = state.lo_for(t, exact=self.exact, name=name)
            state.track(t, lo)
            los.append(lo)
        self._lo_ids = [id(lo) for lo in los]
        self._ptrs = list(map(_DATA_PTR, tensors))
        self._epoch = state.epoch()

    def __call__(self, *args: Any) -> Any:
        if self.decay_watches:
            decays.check_all(self.decay_watches, args, self.plus_min_decay)
        tensors = self._attr_tensors()
        call_los = self._los_for_call(args, tensors)
        restored = self._restored(args, tensors) if self._restores else None
        wrote = self._written_ids
        if self._written_inputs:
            wrote = wrote | {id(args[i]) for i in self._written_inputs}
        # before the call: the optimizer watch reads it after the call (self.ticks) or after
        # the step that follows
        watch.record_call(wrote)
        if replay.recording is not None:
            replay.recording.append((self, args, list(call_los)))
        args = self._as_compiled_for(args)
        with watch.in_call(self._shown):
            # Dynamo calls a backend's result with positional arguments (never boxed)
            out = self.compiled(*args, *call_los)
        if restored is not None:
            self._restore_versions = [t._version for t in restored]
        return self._after_call(out, args, call_los, tensors)

    def _los_for_call(self, args: Sequence[Any], tensors: list[torch.Tensor]) -> list[Any]:
        """Each slot's lo for this call, after the checks: the attrs' lo list rebuilt if the
        registry or a storage changed, the other parameters' layouts, and a write from
        outside since the last call (named once; :func:`state.check` restarts that lo)."""
        if self._epoch != state.epoch() or list(map(_DATA_PTR, tensors)) != self._ptrs:
            self._refresh(tensors)
        if self._fixed:
            self._check_fixed()
        call_los = self._call_los
        outside: list[tuple[str, str]] = []
        if not state.unchanged(self._lo_ids, tensors):
            for t, slot, acc in zip(tensors, self._attr_slots, self._attr_accs):
                why = state.check(t, call_los[slot], acc.name)
                if why is not None:
                    outside.append((names.display(t, acc.name), why))
        if self._by_input or self._readers:
            call_los = list(call_los)
            for slot, idx, name in self._by_input:
                lo = state.lo_for(args[idx], by_view=True, exact=self.exact, name=name)
                call_los[slot] = lo
                why = state.check(args[idx], lo, name)
                if why is not None:
                    outside.append((names.display(None, name), why))
            for slot, ref, idx in self._readers:
                t = ref() if ref is not None else args[idx]
                call_los[slot] = self._reader_lo(slot, t)
        if outside:
            watch.outside_writes([n for n, _ in outside], outside[0][1], key=str(id(self)))
        return call_los

    def _as_compiled_for(self, args: Sequence[Any]) -> Sequence[Any]:
        """``args`` as the graph was compiled for: gradients in its layouts and dtypes
        (:meth:`_relaid`), floats in the graph's own tensors (:meth:`_with_scalars`)."""
        if self._grad_inputs:
            grads = list(map(args.__getitem__, self._grad_inputs))
            strides = list(map(_STRIDE, grads))
            if strides != self._grad_strides or list(map(_DTYPE, grads)) != self._grad_dtypes:
                args = self._relaid(args, strides)
        if self._scalars:
            args = self._with_scalars(args)
        return args

    def _after_call(
        self, out: Any, args: Sequence[Any], call_los: list[Any], tensors: list[torch.Tensor]
    ) -> Any:
        """The call's outputs less the metrics' sums and new state's remainders (recorded
        and registered), with the versions, stamps, restarts and optimizer ticks it leaves."""
        if self.metrics is not None:
            # the last output is the metrics' sums (rewrite.add_metrics_output), kept
            # until read: a copy where the next replay of a CUDA graph overwrites it
            sums = out[-1].clone() if self.replayed else out[-1]
            self.metrics.record(sums, args)
            out = out[:-1]
        if self.separate:  # before new state's lo are registered with its tensors
            out = outputs.separated(out, args, self.separate)
        if self.new_state:
            out = self._pair_new_state(out)
        # hi and lo moved together: remember hi's version as it is now (next call's check)
        state.record_versions(self._lo_ids, tensors)
        for slot, idx, _ in self._by_input:
            state.stamp(args[idx], call_los[slot])
        if self._unchained_refs or self._unchained_inputs:
            self._reset_unchained(args)
        if self.ticks:
            _run_ticks(self.ticks, self.collage, out)
        return out

    def _with_scalars(self, args: tuple[Any, ...]) -> list[Any]:
        """``args`` with each float the graph reads from its own tensor in that tensor, filled
        with the value Dynamo passed (a CPU tensor: the fill takes it as a kernel argument,
        no copy from host memory, no synchronization)."""
        args = list(args)  # type: ignore[assignment]
        fill = not replay.capturing  # a capture must not hold this step's value
        for idx, t in self._scalars:
            if fill:
                t.fill_(args[idx])
            args[idx] = t  # type: ignore[index]
        return args  # type: ignore[return-value]

    def replay_blocker(self, tensors: list[torch.Tensor] | None = None) -> str | None:
        """Why a replay of this call would not be the call it replaces (the registry's
        pairs changed, a tensor moved to new storage, or one was written from outside
        since the last call; each is handled by a call), else None.  ``tensors``: the
        graph's own, where the caller holds them and knows them in place."""
        if tensors is None:
            tensors = self._attr_tensors()
        if self._epoch != state.epoch():
            return "the tensors carrying a pair changed"
        if list(map(_DATA_PTR, tensors)) != self._ptrs:
            return "a tensor moved to new storage"
        if not state.unchanged(self._lo_ids, tensors):
            return "a tensor was written outside the step"
        return None

    def after_replay(self) -> None:
        """What a call does besides its graph, for a replay of it (:mod:`replay`): the
        watch's record of what it wrote, the versions it leaves (a CUDA replay bumped
        them as the compiled step does), the optimizer watch."""
        watch.record_call(self._written_ids)
        state.record_versions(self._lo_ids, self._attr_tensors())
        if self.ticks:
            _compat.run_step_ticks(self.ticks, by_collage=self.collage)

    def _pair_new_state(self, out: Any) -> Any:
        """Register the remainders the graph returns after its outputs with the new
        tensors they belong to (state the optimizer creates in the step)."""
        n = len(self.new_state)
        rems, out = out[-n:], out[:-n]
        if self.replayed:  # the lo of a tensor outlives the next replay
            rems = [r.clone() for r in rems]
        for k, rem in zip(self.new_state, rems):
            state.set_lo(out[k], rem)
        return out

    def _reader_lo(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        """The lo of a weight the graph only reads: its own (converted to this graph's kind
        if it has the other), else zeros (reading creates no pair)."""
        lo = state.components(t)[1]
        if lo is not None and state.is_remainder(lo) != self.exact:
            lo = state.lo_for(t, exact=self.exact, name=names.display(t, ""))
        if lo is not None:
            return lo
        dtype = remainder.DTYPE if self.exact else t.dtype
        lo = self._zeros.get(slot)
        if lo is None or lo.dtype != dtype or not state.fits(lo, t):
            lo = self._zeros[slot] = state.empty_lo(t, dtype).zero_()
        return lo

    def _reset_unchained(self, args: tuple[Any, ...]) -> None:
        """Zero the lo of every pair on memory this graph wrote without a chain."""
        written = [(r(), a) for r, a in self._unchained_refs]
        written += [(args[i], a) for i, a in self._unchained_inputs]
        for t, acc in written:
            for owner, lo in state.los_overlapping(t) if t is not None else ():
                lo.zero_()
                state.stamp(owner, lo) if owner is not None else state.forget(lo)
                if owner is not t:
                    report.warn_once(
                        ("alias", acc.name, acc.describe()),
                        f"collage: {acc.describe()} is written here and shares memory with a "
                        "parameter that carries a (hi, lo) pair (p.data or p.detach() passed "
                        f"in?); the write is not upgraded ({acc.reason or 'unsupported'}), "
                        "and the parameter's lo restarts from zero.  Pass the parameter itself.",
                    )
