"""Learning-rate schedules: compiled once (ReduceLROnPlateau twice), never per value, and
compensated throughout.

A scheduler changes ``param_groups[i]['lr']`` (and, for CyclicLR/OneCycleLR, AdamW's betas)
as a Python float every step.  Dynamo compiles the step first with the initial values as
constants, then, at the first change, once more with every changed float as a graph input
(its "automatic dynamic").  The backend sends a scheduled lr (its group has ``initial_lr``)
and a cycled beta1 (``max_momentum``) back to be traced as inputs before it compiles
anything (``_compat.retrace_with_dynamic_floats``), so only ReduceLROnPlateau's lr (no
``initial_lr``: nothing says it will change) costs a second compile.  It must then keep
them dynamic (``passes/scalars.py``: nothing it emits may specialize them), or every new
value recompiles until the recompile limit and the step runs eagerly in plain bf16.

Each test: AdamW (Collage-plus) on bf16 weights, a stream of gradients, 200 steps of one of
``torch.optim.lr_scheduler``'s schedulers, the step compiled with the backend, and the same
optimizer, gradients and schedule run in float64 and in eager plain bf16.  Asserted: the
step compiled as often as ``COMPILES`` says, no CollageWarning, collage's ``value()`` within 3 % of float64
(relative to the float64 run's movement) and plain bf16 far off on the same stream.
``tests/test_all_optimizers.py`` runs every other optimizer under a changing schedule.
``python -m pytest tests/test_schedules.py -s`` prints the table.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch._dynamo.testing
from conftest import CompiledGraphs, relative_error, step_compiles

import collage_compile
from collage_compile import _compat

STEPS = 200
WARMUP = 20


def _warmup_cosine(step: int) -> float:
    """Hugging Face's get_cosine_schedule_with_warmup: from exactly 0, linear, then cosine."""
    if step < WARMUP:
        return step / WARMUP
    return 0.5 * (1.0 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


S = torch.optim.lr_scheduler
SCHEDULERS = {
    "LambdaLR-warmup-cosine-from-0": lambda o: S.LambdaLR(o, _warmup_cosine),
    "StepLR": lambda o: S.StepLR(o, step_size=50, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[60, 120], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=40),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.1, total_iters=STEPS),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.99),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=STEPS, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=STEPS),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=50),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda _: 0.995),
    "CyclicLR-betas": lambda o: S.CyclicLR(o, base_lr=1e-5, max_lr=1e-4, step_size_up=25),
    "OneCycleLR-betas": lambda o: S.OneCycleLR(o, max_lr=1e-4, total_steps=STEPS),
    "SequentialLR": lambda o: S.SequentialLR(
        o,
        [S.LinearLR(o, start_factor=0.01, total_iters=WARMUP), S.CosineAnnealingLR(o, STEPS)],
        milestones=[WARMUP],
    ),
    "ChainedScheduler": lambda o: S.ChainedScheduler(
        [S.ConstantLR(o, factor=0.5, total_iters=30), S.ExponentialLR(o, gamma=0.995)]
    ),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=10),
}


def _params(dtype, seed=0):
    """The same bf16 start in every dtype."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16).to(dtype))
        for s in [(24, 16), (16,)]
    ]


def train(
    make_opt, make_sched, backend, dtype=torch.bfloat16, steps=STEPS, foreach=None, mode=None
):
    """``steps`` steps of ``make_opt`` under ``make_sched`` on ``dtype`` weights (the step
    compiled with ``backend`` when given; with ``mode``, by ``compile_optimizer`` before the
    scheduler is made, as the GPU demo does); returns (params, start, frames compiled)."""
    params = _params(dtype)
    start = [p.detach().double().clone() for p in params]
    opt = make_opt(params, foreach)
    if mode is not None:
        collage_compile.compile_optimizer(opt, mode=mode)
    sched = make_sched(opt)
    counter = None
    step = opt.step
    if backend is not None:
        counter = CompiledGraphs(backend)
        step = torch.compile(opt.step, backend=counter)
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        for p in params:
            p.grad = (0.01 + 0.005 * torch.randn(p.shape, generator=g)).to(dtype)
        step()
        if isinstance(sched, S.ReduceLROnPlateau):
            sched.step(1.0 if k > 30 else 1.0 - k / 100)  # improves, then plateaus
        else:
            sched.step()
    frames = step_compiles(counter) if counter is not None else None
    return params, start, frames


def _adamw(params, foreach):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=foreach)


# plus mode: AdamW's second moment carries a pair too (bf16(0.999) == 1, so in plain bf16
# it never decays and the updates' size drifts from float64's; light mode is compared with a
# float64 shadow fed its own state in test_all_optimizers)
PLUS = collage_compile.make_backend(mode="plus")


def _errors(make_opt, make_sched, foreach=None, backend=None):
    backend = backend or PLUS
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        params, start, frames = train(make_opt, make_sched, backend, foreach=foreach)
    ref, _, _ = train(make_opt, make_sched, None, dtype=torch.float64, foreach=False)
    plain, _, _ = train(make_opt, make_sched, None, foreach=foreach)

    def flat(ts, value=False):
        return torch.cat(
            [(collage_compile.value(t) if value else t.detach()).double().flatten() for t in ts]
        )

    target, origin = flat(ref), torch.cat([s.flatten() for s in start])
    err = relative_error(flat(params, value=True), target, origin)
    plain_err = relative_error(flat(plain), target, origin)
    return err, plain_err, frames, params


# compiles of the step: 1, except where a float changes that no initial_lr announces
COMPILES = {"ReduceLROnPlateau": 2}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedule_compiles_once_and_stays_compensated(name):
    err, plain_err, frames, params = _errors(_adamw, SCHEDULERS[name])
    print(f"{name:32s} compiles {frames}  collage {err:.2e}  plain bf16 {plain_err:.2f}")
    assert frames == COMPILES.get(name, 1)
    assert err <= 0.03
    assert plain_err >= max(0.5, 10 * err)
    assert all(collage_compile.components(p)[1] is not None for p in params)


@pytest.mark.parametrize("name", ["LambdaLR-warmup-cosine-from-0", "OneCycleLR-betas"])
def test_compile_optimizer_compiles_a_scheduled_step_once(monkeypatch, name):
    """Dynamo compiles a float first as a constant and again, as a graph input, when it
    changes: a warmup from lr = 0 cost two compiles of the whole step (38 s, then 64 s, for
    the GPU demo's light step).  ``compile_optimizer`` tells Dynamo before the first step
    that a scheduled lr (and a cycled beta1) is an input (``_compat.
    dynamic_from_the_first_compile``): one compile, compensated throughout, and no graph
    the backend had to send back to be traced again (it would be counted here too)."""
    from collage_compile import compiler

    graphs = []
    compile_graph = compiler.compile_graph

    def counted(gm, example_inputs, config):
        graphs.append(gm)
        return compile_graph(gm, example_inputs, config)

    monkeypatch.setattr(compiler, "compile_graph", counted)
    torch._dynamo.reset()
    schedule = SCHEDULERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        params, start, _ = train(_adamw, schedule, None, foreach=True, mode="plus")
    ref, _, _ = train(_adamw, schedule, None, dtype=torch.float64, foreach=False)
    plain, _, _ = train(_adamw, schedule, None, foreach=True)
    origin = torch.cat([s.flatten() for s in start])
    target = torch.cat([r.detach().double().flatten() for r in ref])
    value = torch.cat([collage_compile.value(p).double().flatten() for p in params])
    err = relative_error(value, target, origin)
    plain_err = relative_error(torch.cat([q.detach().flatten() for q in plain]), target, origin)
    print(
        f"compile_optimizer, {name}: graphs {len(graphs)}  collage {err:.2e}  plain {plain_err:.2f}"
    )
    assert sum(not _compat.is_step_tick_graph(gm) for gm in graphs) == 1
    assert err <= 0.03
    assert plain_err >= max(0.5, 10 * err)


@pytest.mark.parametrize("name", ["LambdaLR-warmup-cosine-from-0", "OneCycleLR-betas"])
def test_schedule_on_the_foreach_path(name):
    """The foreach path (CUDA's default) consumes lr in foreach ops whose Scalar overloads
    plain Inductor specializes; every optimizer's foreach path is in test_all_optimizers."""
    err, plain_err, frames, _ = _errors(_adamw, SCHEDULERS[name], foreach=True)
    print(f"{name:32s} foreach compiles {frames}  collage {err:.2e}  plain {plain_err:.2f}")
    assert frames == COMPILES.get(name, 1)
    assert err <= 0.03
    assert plain_err >= max(0.5, 10 * err)


def _sgd_wd(params, foreach):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=0.01, foreach=foreach)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("make_opt", [_sgd_wd, _adamw], ids=["sgd", "adamw"])
def test_the_float_tensorification_meets_only_float_inputs(make_opt, foreach, capture):
    """torch 2.11's float tensorification specializes a float input that a tensor op reads
    only through Python arithmetic (``grad * -lr``, ``1 - lr*wd``): one compile per learning
    rate, then plain bf16 at the recompile limit (2.13 fixed it).  So in the graph the
    backend hands Inductor, every symbolic float a tensor op reads is a float input itself
    (the arithmetic on it is mirrored in float64 tensors, ``passes/_common.py``), on every
    torch version."""
    train(make_opt, SCHEDULERS["LinearLR"], collage_compile.backend, steps=3, foreach=foreach)
    read = []
    for gm in capture.modules:
        for node in gm.graph.nodes:
            if isinstance(_compat.example_value(node), (torch.SymFloat, torch.SymInt)):
                continue  # Python arithmetic on scalars, not a tensor op
            for a in node.all_input_nodes:
                ex = _compat.example_value(a)
                if isinstance(ex, torch.SymFloat) and _compat.free_symbols(ex):
                    read.append((node.name, str(ex), _compat.is_symbol(ex)))
    assert read, "no graph read the scheduled lr as a float"
    assert all(bare for _, _, bare in read), read


def _sgd(params, foreach):
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=foreach)


def test_a_cycled_momentum_stays_an_input_from_a_cold_start():
    """OneCycleLR cycles SGD's momentum every step.  SGD's first step reads it only in
    ``if momentum != 0`` (no buffer yet), so torch's float tensorification has that graph
    traced again with momentum a constant, and its mark (``TensorifyState``) outlived the
    graph: on a cold cache every later compile took momentum as a constant too, one
    compile per value until the recompile limit, then eager steps in plain bf16 (named);
    a warm cache skipped the tensorification and hid it.  The backend clears the mark
    once a graph is compiled (``_compat.forget_float_specializations``).  Inductor's
    caches are off here, as on a user's first run: two compiles (the first step's and
    the steady one), no CollageWarning, and collage tracks float64."""
    torch._dynamo.reset()
    schedule = lambda o: S.OneCycleLR(o, max_lr=1e-3, total_steps=STEPS)
    # torch's own config patches: monkeypatch.setattr on these modules broke every later
    # compile in the same worker
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        err, plain_err, frames, _ = _errors(_sgd, schedule, foreach=True)
    print(
        f"SGD, OneCycleLR (momentum cycled), cold: compiles {frames}  collage {err:.2e}  "
        f"plain {plain_err:.2f}"
    )
    assert frames == 2
    assert err <= 0.03
    assert plain_err >= max(0.5, 10 * err)


def test_an_fp32_optimizer_under_a_schedule_leaves_its_bf16_twin_compensated():
    """Two AdamW in one process (an fp32 one first, as a baseline run in the same script
    or an fp32 head beside a bf16 body) run the same step code, and Dynamo's recompile
    limit is per code.  The fp32 graph upgrades nothing; it took the scheduled lr as a
    constant, one compile per step until the limit, after which the bf16 optimizer never
    compiled and stepped in plain bf16, unnamed.  Every graph the backend compiles now
    keeps a changing float an input (``passes.scalars``): each optimizer compiles once,
    and the bf16 one tracks float64 with no CollageWarning but the fp32 one's notice."""
    torch._dynamo.reset()
    schedule = SCHEDULERS["LambdaLR-warmup-cosine-from-0"]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        train(_adamw, schedule, None, dtype=torch.float32, steps=30, foreach=True, mode="light")
        params, start, _ = train(_adamw, schedule, None, steps=30, foreach=True, mode="plus")
    named = [str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)]
    assert len(named) == 1 and "no bf16 or fp16 parameter" in named[0], named
    ref, _, _ = train(_adamw, schedule, None, dtype=torch.float64, steps=30, foreach=False)
    plain, _, _ = train(_adamw, schedule, None, steps=30, foreach=True)
    origin = torch.cat([s.flatten() for s in start])
    target = torch.cat([r.detach().double().flatten() for r in ref])
    value = torch.cat([collage_compile.value(p).double().flatten() for p in params])
    err = relative_error(value, target, origin)
    plain_err = relative_error(torch.cat([q.detach().flatten() for q in plain]), target, origin)
    print(f"bf16 after an fp32 optimizer: collage {err:.2e}  plain {plain_err:.2f}")
    assert err <= 0.03
    assert plain_err >= 10 * err


def test_an_ema_decay_schedule_stays_dynamic():
    """An EMA of the weights whose decay warms up (``min(0.999, 1 - 0.5 / (1 + k))``, a
    Python float passed each step) tracks a float64 EMA of the same weights, compiled at most
    three times: the initial value, the first change, and once more when the lerp weight
    ``1 - decay`` drops below 1/2 (Dynamo's ``_foreach_lerp_`` takes one of two formulas by
    it, so that is a range guard, not a value guard)."""
    g = torch.Generator().manual_seed(0)
    weights = [
        torch.nn.Parameter((4 * torch.randn(24, 16, generator=g)).to(torch.bfloat16))
        for _ in range(2)
    ]
    ema = [w.detach().clone() for w in weights]
    ema64 = [w.double() for w in ema]
    plain = [w.clone() for w in ema]
    start = torch.cat([e.double().flatten() for e in ema])

    @torch.no_grad()
    def update(decay: float) -> None:
        torch._foreach_lerp_(ema, weights, 1.0 - decay)

    counter = torch._dynamo.testing.CompileCounterWithBackend(collage_compile.backend)
    compiled = torch.compile(update, backend=counter)
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        for k in range(STEPS):
            with torch.no_grad():
                for w in weights:  # the weights drift, as training moves them
                    w.add_(0.002 + 0.0005 * torch.randn(w.shape, generator=g))
                decay = min(0.999, 1.0 - 0.5 / (1 + k))
                compiled(decay)
                torch._foreach_lerp_(ema64, [w.double() for w in weights], 1.0 - decay)
                torch._foreach_lerp_(plain, [w.detach() for w in weights], 1.0 - decay)
    value = torch.cat([collage_compile.value(e).double().flatten() for e in ema])
    target = torch.cat([e.flatten() for e in ema64])
    err = relative_error(value, target, start)
    plain_err = relative_error(torch.cat([e.double().flatten() for e in plain]), target, start)
    print(
        f"EMA decay warmup: compiles {counter.frame_count}  collage {err:.2e}  plain {plain_err:.2f}"
    )
    assert counter.frame_count <= 3
    assert err <= 0.03
    assert plain_err >= max(0.3, 10 * err)


def _beta2_warmup(mode, cudagraphs=False, **options):
    """AdamW under a beta2 warmup, 0.95 to 0.999 by 0.001 a step, and a beta1 that a
    schedule also moves (0.85 to 0.95, as OneCycleLR's cycled momentum): the CollageWarnings
    and whether exp_avg_sq ends with a lo."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 16, generator=g).to(torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.85, 0.95), foreach=True)
    collage_compile.compile_optimizer(opt, mode=mode, cudagraphs=cudagraphs, **options)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", collage_compile.CollageWarning)
        for t in range(60):
            opt.param_groups[0]["betas"] = (
                0.85 + 0.1 * (t % 10) / 10,
                min(0.999, 0.95 + 0.001 * t),
            )
            p.grad = (1e-3 * torch.randn(16, 16, generator=g)).to(torch.bfloat16)
            opt.step()
    said = [str(w.message) for w in rec if w.category is collage_compile.CollageWarning]
    return said, collage_compile.components(opt.state[p]["exp_avg_sq"])[1] is not None


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["compiled", "replayed"])
def test_a_beta2_warmup_past_plus_min_decay_is_named_once(cudagraphs):
    """Plus reads a decay when it compiles; a scheduled beta2 is a graph input compiled
    once, at 0.951, so the second moment stays plain bf16 after the warmup reaches 0.999,
    where bf16 rounds its decay away.  The step watches the decay it left the tensor for
    and names it once it reaches plus_min_decay (from param_groups where the step is
    replayed); beta1's schedule, which never gets there, says nothing."""
    said, carried = _beta2_warmup("plus", cudagraphs)
    assert len(said) == 1, said
    assert "state[0].exp_avg_sq" in said[0] and "is 0.99 now" in said[0], said
    assert "when its decay was 0.951" in said[0] and "mode='all'" in said[0], said
    assert not carried


@pytest.mark.parametrize("mode, options", [("all", {}), ("plus", {"plus_min_decay": 0.95})])
def test_the_remedies_for_a_beta2_warmup_carry_the_second_moment_unwarned(mode, options):
    said, carried = _beta2_warmup(mode, **options)
    assert said == [] and carried
