"""Every traceable stock torch.optim optimizer, each variant, foreach off and on, compiled,
under a schedule that changes its hyperparameters every step as a user's scheduler does.

For each case: the bf16 run compiled with the backend is compared with a float64 shadow
driven by the same optimizer class, fed the same gradients, the same hyperparameters and
the run's own optimizer state (its full value, hi + lo where the state carries a pair)
before every step, so the shadow receives exactly the updates the run intended and
accumulates them without rounding.  The same stream run in plain bf16 (eager: what a run
without collage does) must lose far more.  The step must compile at most twice (the first
call with the initial values as constants, the second with every changed float as a graph
input; once more where the first step creates state the guards see), so no value of the
learning rate, beta1 or momentum recompiles it.  The rewritten graphs, compactly printed,
are pinned as snapshots (``tests/snapshots``; refresh with ``EXPECTTEST_ACCEPT=1`` and
review the diff).

The streams are chosen so each update is well below half a bf16 ulp of the weights, where
plain bf16 drops most of them.  ``python -m pytest tests/test_all_optimizers.py -s`` prints
the table that README and the issue notes quote.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
import torch._dynamo.testing
import user_optimizers
from conftest import CompiledGraphs, GraphCapture, assert_snapshot, relative_error, step_compiles

import collage_compile
from collage_compile import _compat

# streams (steps, weight scale, grad mean, grad std): updates ~2^-11 of the weights
SGD_LIKE = (150, 0.5, 0.01, 0.005)
ADAPTIVE = (100, 1.0, 0.0, 0.01)
# NAdam's and RAdam's variants (their extra flag is the same)
DECOUPLED = {
    "default": {"lr": 3e-4},
    "decoupled-wd-maximize": {
        "lr": 3e-4,
        "weight_decay": 0.01,
        "decoupled_weight_decay": True,
        "maximize": True,
    },
}

# name -> (class, variants {label: kwargs}, stream)
OPTIMIZERS = {
    "SGD": (
        torch.optim.SGD,
        {
            "plain": {"lr": 1e-3},
            "momentum-nesterov-wd": {
                "lr": 1e-3,
                "momentum": 0.9,
                "nesterov": True,
                "weight_decay": 0.01,
            },
            "momentum-dampening-maximize": {
                "lr": 1e-3,
                "momentum": 0.9,
                "dampening": 0.1,
                "maximize": True,
            },
        },
        SGD_LIKE,
    ),
    "Adam": (
        torch.optim.Adam,
        {
            "default": {"lr": 3e-4},
            "amsgrad-wd-maximize": {
                "lr": 3e-4,
                "amsgrad": True,
                "weight_decay": 0.01,
                "maximize": True,
            },
        },
        ADAPTIVE,
    ),
    "AdamW": (
        torch.optim.AdamW,
        {
            "default": {"lr": 3e-4, "weight_decay": 0.01},
            "amsgrad-maximize": {"lr": 3e-4, "amsgrad": True, "maximize": True},
        },
        ADAPTIVE,
    ),
    "NAdam": (torch.optim.NAdam, DECOUPLED, ADAPTIVE),
    "RAdam": (torch.optim.RAdam, DECOUPLED, ADAPTIVE),
    "Adamax": (
        torch.optim.Adamax,
        {
            "default": {"lr": 3e-4},
            "wd-maximize": {"lr": 3e-4, "weight_decay": 0.01, "maximize": True},
        },
        ADAPTIVE,
    ),
    "Adagrad": (
        torch.optim.Adagrad,
        {
            "default": {"lr": 1e-3},
            "wd-lr_decay-maximize": {
                "lr": 1e-3,
                "weight_decay": 0.01,
                "lr_decay": 1e-3,
                "maximize": True,
            },
        },
        ADAPTIVE,
    ),
    "RMSprop": (
        torch.optim.RMSprop,
        {
            "default": {"lr": 1e-4},
            "centered-momentum-wd-maximize": {
                "lr": 3e-5,
                "centered": True,
                "momentum": 0.9,
                "weight_decay": 0.01,
                "maximize": True,
            },
        },
        ADAPTIVE,
    ),
    "Adadelta": (
        torch.optim.Adadelta,
        {
            "default": {"lr": 0.3},
            "wd-maximize": {"lr": 0.3, "weight_decay": 0.01, "maximize": True},
        },
        ADAPTIVE,
    ),
    "ASGD": (
        torch.optim.ASGD,
        {
            "default": {"lr": 1e-3},
            "wd-maximize": {"lr": 1e-3, "weight_decay": 0.01, "maximize": True},
        },
        SGD_LIKE,
    ),
    # written by a user in plain torch ops (tests/user_optimizers.py), upgraded unchanged
    "Lion": (
        user_optimizers.Lion,
        {"default": {"lr": 3e-4}, "wd": {"lr": 3e-4, "weight_decay": 0.1}},
        ADAPTIVE,
    ),
    "SignSGD": (user_optimizers.SignSGD, {"momentum": {"lr": 3e-4}}, ADAPTIVE),
    "Adafactor": (
        torch.optim.Adafactor,
        {  # eps1 fixed: its default is the param dtype's eps (bf16: 2^-7 vs float64: 2^-52)
            "default": {"lr": 1e-3, "eps": (1e-10, 1e-3)},
            "wd-maximize": {
                "lr": 1e-3,
                "eps": (1e-10, 1e-3),
                "weight_decay": 0.01,
                "maximize": True,
            },
        },
        ADAPTIVE,
    ),
    # matrices only; its Newton-Schulz iteration runs in bf16 by design (torch casts the
    # update), so the shadow's update differs from the run's by that rounding alone; the
    # tall matrix takes the transposed path (the update is a transposed matmul result)
    "Muon": (
        torch.optim.Muon,
        {
            "default": {"lr": 1e-3},
            "plain-momentum-rms-wd": {
                "lr": 1e-3,
                "nesterov": False,
                "adjust_lr_fn": "match_rms_adamw",
                "weight_decay": 0.01,
            },
        },
        ADAPTIVE,
    ),
}
MATRIX_AND_VECTOR = ((16, 32), (32,))
SHAPES = {"Muon": ((16, 32), (32, 16))}  # others: MATRIX_AND_VECTOR

# Adafactor's step calls Tensor.item(): traceable only with capture_scalar_outputs (both
# paths, torch 2.11 and 2.13); without it, a warning test (below)
# graphs compiled over a run (see the module docstring): SGD's first step creates momentum
# buffers that the second step's guards see; Adafactor is split by graph breaks
MAX_COMPILES = {"SGD": 3, "ASGD": 2, "Adafactor": 8}
SINGLE_PATH_ONLY = {"SignSGD", "Muon"}  # one code path

CASES = [
    pytest.param(
        name, variant, foreach, id=f"{name}-{variant}-{'foreach' if foreach else 'single'}"
    )
    for name, (_, variants, _) in OPTIMIZERS.items()
    for variant in variants
    for foreach in (False, True)
    if not (foreach and name in SINGLE_PATH_ONLY)
]


def _params(seed: int, scale: float, shapes=MATRIX_AND_VECTOR) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter((torch.randn(s, generator=g) * scale).to(torch.bfloat16)) for s in shapes
    ]


def _full(v):
    if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
        return collage_compile.value(v).double().clone()
    return v.clone() if torch.is_tensor(v) else v


def schedule(group: dict, initial: dict, k: int, steps: int) -> None:
    """What a warmup + cosine LambdaLR and OneCycleLR's momentum cycling do to a group:
    lr rises over the first tenth of the run, then decays; beta1 (or momentum, where it is
    used) and weight decay move down and back.  Python floats, set between steps."""
    warm = max(1, steps // 10)
    factor = (k + 1) / warm if k < warm else 0.5 * (1 + math.cos(math.pi * (k - warm) / steps))
    group["lr"] = initial["lr"] * factor
    cycle = 1.0 - 0.05 * math.sin(math.pi * (k + 1) / steps)
    if "betas" in initial:
        group["betas"] = (initial["betas"][0] * cycle, initial["betas"][1])
    if initial.get("momentum"):
        group["momentum"] = initial["momentum"] * cycle
    if initial.get("weight_decay"):  # a weight-decay schedule, as some recipes use
        group["weight_decay"] = initial["weight_decay"] * cycle


def run(cls, kwargs, stream, foreach, backend, seed=0, scheduled=True):
    """bf16 params trained by ``cls`` (compiled with ``backend``, or eager when None) and
    their float64 shadow, under :func:`schedule`.  Returns (relative error, params,
    optimizer, frames compiled)."""
    steps, scale, mean, std = stream
    params = _params(seed, scale, SHAPES.get(cls.__name__, MATRIX_AND_VECTOR))
    start = [p.detach().double().clone() for p in params]
    ref = [torch.nn.Parameter(s.clone()) for s in start]
    flag = "foreach" in inspect.signature(cls.__init__).parameters  # Muon has none
    opt = cls(params, **kwargs, **({"foreach": foreach} if flag else {}))
    ref_opt = cls(ref, **kwargs, **({"foreach": False} if flag else {}))
    initial = dict(opt.param_groups[0])
    counter = step = None
    if backend is None:
        step = opt.step
    else:
        counter = CompiledGraphs(backend)
        step = torch.compile(opt.step, backend=counter)
    g = torch.Generator().manual_seed(seed + 1)
    for k in range(steps):
        for p, r in zip(params, ref):
            grad = (mean + std * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
            p.grad, r.grad = grad, grad.double()
        for p, r in zip(params, ref):
            if opt.state.get(p):
                ref_opt.state[r] = {k: _full(v) for k, v in opt.state[p].items()}
        step()
        ref_opt.step()
        if scheduled:
            schedule(opt.param_groups[0], initial, k, steps)
            schedule(ref_opt.param_groups[0], initial, k, steps)
    value = torch.cat([collage_compile.value(p).double().flatten() for p in params])
    target = torch.cat([r.detach().flatten() for r in ref])
    origin = torch.cat([s.flatten() for s in start])
    frames = step_compiles(counter) if counter is not None else None
    return relative_error(value, target, origin), params, opt, frames


@pytest.mark.parametrize(("name", "variant", "foreach"), CASES)
def test_optimizer_is_upgraded_and_tracks_float64(name, variant, foreach, monkeypatch):
    cls, variants, stream = OPTIMIZERS[name]
    capture = GraphCapture(monkeypatch)
    # Adafactor: Tensor.item() captured, not a graph break (see above); its step takes
    # min(lr, 1/sqrt(step)) in Python, which guards on lr: under a schedule it recompiles
    # per value, plain Inductor alike (named in a warning: the test after this one)
    scalars = name == "Adafactor"
    with warnings.catch_warnings(), torch._dynamo.config.patch(capture_scalar_outputs=scalars):
        warnings.simplefilter("error", collage_compile.CollageWarning)
        err, params, _, frames = run(
            cls, variants[variant], stream, foreach, collage_compile.backend, scheduled=not scalars
        )
    plain_err, _, _, _ = run(cls, variants[variant], stream, foreach, None, scheduled=not scalars)
    print(
        f"{name:9s} {variant:30s} foreach={foreach!s:5s} compiles {frames}  "
        f"collage {err:.2e}  plain {plain_err:.2e}"
    )
    assert err <= 0.03
    assert plain_err >= max(0.3, 10 * err)
    # Adafactor's step has graph breaks around its Tensor.item() calls: several frames
    assert frames <= MAX_COMPILES.get(name, 2)
    for p in params:
        assert collage_compile.components(p)[1] is not None
    if _compat.torch_version().startswith("2.13"):
        assert_snapshot(
            f"{name}-{variant}-{'foreach' if foreach else 'single'}",
            "\n\n".join(capture.compact),
        )


def test_adafactor_that_torch_compile_skips_is_named_in_a_warning():
    """Without capture_scalar_outputs Dynamo skips Adafactor's step (Tensor.item()): it runs
    eagerly in plain bf16.  The backend cannot see it, so the optimizer hook says so."""
    params = _params(0, 1.0)
    opt = torch.optim.Adafactor(params, lr=1e-3, foreach=False)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    with pytest.warns(collage_compile.CollageWarning, match="Adafactor.step calls Tensor.item"):
        step()


def test_adafactor_under_a_schedule_names_the_recompile_limit():
    """Adafactor's ``min(lr, 1/sqrt(step))`` runs in Python while Dynamo traces: a new lr is
    a new guard, as in plain Inductor.  When the recompile limit ends compilation, the user
    is told which function and which tensors are then stepped in plain bf16."""
    params = _params(0, 1.0)
    # eps1 given: torch 2.11's foreach Adafactor cannot be traced with its default (None),
    # whatever the backend ("dtype is needed to compute eps1"); 1e-10 as in OPTIMIZERS
    opt = torch.optim.Adafactor(params, lr=1e-3, eps=(1e-10, 1e-3), foreach=True)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    with (
        torch._dynamo.config.patch(capture_scalar_outputs=True),
        warnings.catch_warnings(record=True) as rec,
    ):
        warnings.simplefilter("always")
        for _ in range(12):
            for p in params:
                p.grad = torch.full_like(p, 0.01)
            step()
            opt.param_groups[0]["lr"] *= 0.9
    msgs = [str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)]
    assert len(msgs) == 1, msgs
    assert "hit config.recompile_limit" in msgs[0] and "param_groups[0]['lr']" in msgs[0]
