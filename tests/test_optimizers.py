"""Stock torch.optim optimizers, compiled with the backend, against float64 on the same stream.

The reference is a float64 copy of the parameters driven by the same optimizer class, fed the
same gradients *and* the optimizer state of the run it checks (copied in before every step):
it receives exactly the updates the bf16 run intended, and accumulates them without
rounding.  What the bf16 run loses is then the accumulation error alone.  Every stream is
one where plain bf16 (the same optimizer run eagerly in bf16: what a bf16 run without
collage does; compiling it would only cost test time) loses most of the movement, and the
tests require it to be at least 25x worse than collage, so a compensation that silently
became a no-op fails.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch._dynamo.testing
import user_optimizers
from conftest import mcf_value, relative_error

import collage_compile

# Updates of ~2^-11 of the weights: below half a bf16 ulp (plain bf16 drops them) and well
# above the ~2^-17 a bf16 pair resolves.  Smooth streams (momentum) at ~2^-15 accumulate a
# systematic lo rounding error of several percent; README states that limit.
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 1e-3}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    "sgd_nesterov_wd": (
        torch.optim.SGD,
        {"lr": 1e-3, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    "adam": (torch.optim.Adam, {"lr": 3e-4}),
    "adamw": (torch.optim.AdamW, {"lr": 3e-4, "weight_decay": 0.01}),
}


def _params(seed: int, scale: float, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 64), (64,)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * scale).to(dtype)) for s in shapes]


def _sync_state(src: torch.optim.Optimizer, src_params, dst: torch.optim.Optimizer, dst_params):
    for ps, pd in zip(src_params, dst_params):
        st = src.state.get(ps)
        if not st:
            continue
        dst.state[pd] = {
            k: (
                v.detach().to(torch.float64).clone()
                if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0
                else (v.clone() if torch.is_tensor(v) else v)
            )
            for k, v in st.items()
        }


def run_stream(
    name: str,
    foreach: bool,
    backend,
    steps: int,
    scale: float,
    grad_mean: float,
    grad_std: float,
    seed: int = 0,
    dynamic: bool | None = None,
    requires_grad: bool = True,
):
    """Train bf16 params with ``backend`` (or ``"compile_optimizer"``) and a float64 shadow
    fed the same updates; ``requires_grad=False``: plain tensors, gradients set by hand.

    Returns (relative error of the bf16 run's value vs its float64 shadow, params).
    """
    cls, kw = OPTIMIZERS[name]
    params = _params(seed, scale, torch.bfloat16)
    if not requires_grad:
        params = [p.detach() for p in params]
    start = [p.detach().double().clone() for p in params]
    ref = [torch.nn.Parameter(s.clone()) for s in start]
    opt = cls(params, foreach=foreach, **kw)
    ref_opt = cls(ref, foreach=False, **kw)
    if backend == "compile_optimizer":
        collage_compile.compile_optimizer(opt)
    step = opt.step
    if backend not in (None, "compile_optimizer"):
        step = torch.compile(opt.step, backend=backend, dynamic=dynamic)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p, r in zip(params, ref):
            grad = (grad_mean + grad_std * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
            p.grad = grad
            r.grad = grad.double()
        _sync_state(opt, params, ref_opt, ref)
        step()
        ref_opt.step()
    value = torch.cat([mcf_value(p).flatten() for p in params])
    target = torch.cat([r.detach().flatten() for r in ref])
    origin = torch.cat([s.flatten() for s in start])
    return relative_error(value, target, origin), params


STREAMS = {
    # (steps, weight scale, grad mean, grad std): updates far below half a bf16 ulp of the weights
    "sgd": (300, 0.5, 0.01, 0.005),
    "sgd_momentum": (200, 0.5, 0.01, 0.005),
    "sgd_nesterov_wd": (200, 0.5, 0.01, 0.005),
    "adam": (150, 1.0, 0.0, 0.01),
    "adamw": (150, 1.0, 0.0, 0.01),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_sgd_done_criterion_stream(foreach):
    """lr=1e-3, grads 0.01 +- 0.005, weights N(0, 0.5^2), 300 steps (the issue's numbers)."""
    err, _ = run_stream("sgd", foreach, collage_compile.backend, 300, 0.5, 0.01, 0.005)
    plain_err, _ = run_stream("sgd", foreach, None, 300, 0.5, 0.01, 0.005)
    assert err <= 0.02 and plain_err >= 0.5


@pytest.mark.parametrize("backend", [collage_compile.backend, "compile_optimizer"])
def test_tensors_in_param_groups_are_parameters_without_requires_grad(backend):
    """An optimizer over tensors that do not require grad, their gradients set by hand
    (torch.func's grads, zeroth-order training): light mode upgrades them as parameters.
    They were left in plain bf16, named by no warning under torch.compile(opt.step)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        err, params = run_stream("adamw", True, backend, 150, 1.0, 0.0, 0.01, requires_grad=False)
    plain_err, _ = run_stream("adamw", True, None, 150, 1.0, 0.0, 0.01, requires_grad=False)
    assert not any(p.requires_grad for p in params)
    assert all(collage_compile.components(p)[1] is not None for p in params)
    assert err <= 0.02 and plain_err >= max(0.5, 25 * err)


def test_an_accelerate_wrapped_optimizer_is_compiled_and_attached_through_the_one_it_wraps():
    """accelerate's AcceleratedOptimizer subclasses Optimizer without running its
    ``__init__`` (no hooks of its own): ``compile_optimizer`` and ``attach`` crashed on it
    (AttributeError).  Both now go to the optimizer it wraps; its own step, which calls
    that one, stays eager.  Compensated against float64, and its state dict saves each lo."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        _accelerate_wrapped_run(Accelerator(cpu=True))
    finally:  # accelerate's state is global: the Trainer tests make their own
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _accelerate_wrapped_run(accelerator):
    torch.manual_seed(0)
    params = _params(3, 1.0, torch.bfloat16)
    wrapped = accelerator.prepare(torch.optim.AdamW(params, lr=1e-5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        assert collage_compile.compile_optimizer(wrapped, mode="plus") is wrapped
        collage_compile.attach(wrapped)
        err, plain_err = _adamw_against_float64(params, wrapped.step)
        saved = wrapped.state_dict()
    assert err <= 0.05 and plain_err >= max(0.5, 25 * err), (err, plain_err)  # bf16 exp_avg
    assert any("collage" in str(k) for k in saved["state"][0]), saved["state"][0].keys()


def test_parameters_cast_to_bf16_after_compile_optimizer_are_compensated_unwarned():
    """``compile_optimizer`` before ``model.to(torch.bfloat16)``: the first step runs on
    bf16 parameters and is compensated.  It was told "holds no bf16 or fp16 parameter ...
    runs as plain Inductor" at compile_optimizer (a false alarm); the dtypes are now read at
    the first step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    weights = [(torch.randn(p.shape) * 1.0).to(torch.bfloat16) for p in model.parameters()]
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        collage_compile.compile_optimizer(opt)
        model.to(torch.bfloat16)
        err, plain_err = _adamw_against_float64(list(model.parameters()), opt.step)
    assert err <= 0.05 and plain_err >= max(0.5, 25 * err), (err, plain_err)


def _adamw_against_float64(params, step, steps=100):
    """``step`` (an AdamW at lr 1e-5 over the bf16 ``params``) beside float64's and plain
    bf16's AdamW fed the same gradients: (its distance from float64, plain bf16's)."""
    ref, plain, start = _adamw_stream(params, step, steps)
    flat = lambda ts: torch.cat([t.flatten() for t in ts])
    err = relative_error(flat([mcf_value(p) for p in params]), flat(ref), flat(start))
    return err, relative_error(flat(plain), flat(ref), flat(start))


def _adamw_stream(params, step, steps, weight_decay=0.0, foreach=None):
    """Run ``step`` over ``params`` ``steps`` times on gradients ~0.01, beside a float64
    AdamW (its own float64 state) and a plain bf16 one fed the same: (ref, plain, start)."""
    ref = [torch.nn.Parameter(p.detach().double().clone()) for p in params]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in params]
    start = [p.detach().double().clone() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-5, weight_decay=weight_decay, foreach=False)
    plain_opt = torch.optim.AdamW(plain, lr=1e-5, weight_decay=weight_decay, foreach=foreach)
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        for p, r, q in zip(params, ref, plain):
            grad = (0.01 + 0.005 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
            p.grad, r.grad, q.grad = grad, grad.double(), grad.clone()
        step()
        ref_opt.step()
        plain_opt.step()
    return ref, plain, start


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_adamw_follows_a_float64_adamw_fed_the_same_grads(foreach):
    """lr=1e-5, weight_decay=0.01, 150 steps, weights N(0,1): the issue's AdamW criterion.

    Here the float64 AdamW keeps its own float64 state (nothing is copied in), so this also
    measures what bf16 optimizer state costs in light mode.  The same stream through AdamW
    in plain bf16 (eagerly) must miss the float64 run's movement, so a compensation that
    became a no-op fails.
    """
    torch.manual_seed(0)
    params = _params(3, 1.0, torch.bfloat16)
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, foreach=foreach)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    ref, plain, start = _adamw_stream(params, step, 150, weight_decay=0.01, foreach=foreach)
    d_ref = torch.cat([(r.detach() - s).flatten() for r, s in zip(ref, start)])

    def follows(values):
        d = torch.cat([(v - s).flatten() for v, s in zip(values, start)])
        cos = torch.nn.functional.cosine_similarity(d, d_ref, dim=0).item()
        return cos, (d.norm() / d_ref.norm()).item(), ((d - d_ref).norm() / d_ref.norm()).item()

    cos, ratio, err = follows([mcf_value(p) for p in params])
    plain_cos, plain_ratio, plain_err = follows([q.detach().double() for q in plain])
    print(
        f"AdamW foreach={foreach}: collage cosine {cos:.5f}, norm ratio {ratio:.4f}, "
        f"error {err:.3f}; plain bf16 cosine {plain_cos:.4f}, norm ratio {plain_ratio:.4f}, "
        f"error {plain_err:.3f}"
    )
    # measured (both variants): collage cosine 0.9996, ratio 0.965, error 0.045 (most of it
    # the light-mode bf16 moments); plain bf16 cosine 0.06, ratio 0.07, error 0.998
    assert cos >= 0.99 and abs(ratio - 1) <= 0.05
    assert not (plain_cos >= 0.99 and abs(plain_ratio - 1) <= 0.05)
    assert err <= 0.1 < plain_err


def test_a_smooth_stream_near_the_pairs_limit_keeps_a_few_percent_error():
    """README's stated limit: SGD momentum at lr=1e-4 on weights N(0, 0.5^2) gives updates of
    ~2^-15 of the weights that barely change from step to step, so lo's own rounding (8 bits)
    errs the same way every step.  Still far better than plain bf16, but not within 2 %."""
    OPTIMIZERS["sgd_momentum_small"] = (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9})
    try:
        err, _ = run_stream(
            "sgd_momentum_small", False, collage_compile.backend, 200, 0.5, 0.01, 0.005
        )
        plain_err, _ = run_stream("sgd_momentum_small", False, None, 200, 0.5, 0.01, 0.005)
    finally:
        del OPTIMIZERS["sgd_momentum_small"]
    print(f"smooth stream near the limit: collage {err:.2e}  plain bf16 {plain_err:.2e}")
    assert 0.01 <= err <= 0.1
    assert plain_err >= 0.9


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_adamw_with_dynamic_shapes_splits_its_symbolic_decay_at_run_time(foreach):
    """dynamic=True makes AdamW's ``1 - lr*wd`` a SymFloat: split into an fp32 pair on the
    device at run time instead of on the host."""
    steps, scale, mean, std = STREAMS["adamw"]
    err, _ = run_stream(
        "adamw", foreach, collage_compile.backend, steps, scale, mean, std, dynamic=True
    )
    plain_err, _ = run_stream("adamw", foreach, None, steps, scale, mean, std)
    print(f"adamw dynamic=True foreach={foreach}: collage {err:.2e}  plain bf16 {plain_err:.2e}")
    assert err <= 0.02
    assert plain_err >= 25 * err


def _errors(params, ref, plain) -> tuple[float, float]:
    """Errors of the compiled run's pairs and of plain bf16 relative to float64's movement
    (every run starting from ``_params(0, 0.5)``)."""
    start = torch.cat([p.detach().double().flatten() for p in _params(0, 0.5, torch.bfloat16)])
    target = torch.cat([r.detach().flatten() for r in ref])
    err = relative_error(torch.cat([mcf_value(p).flatten() for p in params]), target, start)
    plain_err = relative_error(torch.cat([p.detach().flatten() for p in plain]), target, start)
    return err, plain_err


def _aggmo_run(
    foreach: bool, dtype: torch.dtype, compiled: bool
) -> tuple[list, torch.optim.Optimizer]:
    """AggMo over 60 steps of gradients written in place (``zero_grad(set_to_none=False)``
    then a backward: the same gradient tensors every step)."""
    params = _params(0, 0.5, torch.bfloat16)
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in params]
    opt = user_optimizers.AggMo(params, lr=1e-3, foreach=foreach)
    if compiled:
        collage_compile.compile_optimizer(opt, mode="light")
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.zeros_like(p)
    for _ in range(60):
        for p in params:
            p.grad.copy_((0.01 + 0.005 * torch.randn(p.shape, generator=g)).to(torch.bfloat16))
        opt.step()
    return params, opt


def test_state_created_in_the_first_step_gets_tensors_of_its_own():
    """AggMo (tests/user_optimizers.py) creates three momentum buffers as zeros in its first
    step and writes ``buf.mul_(b).add_(g)``: Inductor folded ``0 * b + g`` to ``g`` and
    returned the gradient itself as every buffer (plain Inductor alike, pytorch/pytorch
    #197893), so the three momenta were one tensor, updated three times a step, and the
    gradient's next in-place write overwrote it: light ended 1.00 of float64's movement off
    (plain bf16 0.95), with no warning (``MUT=outputs_left_shared``).  The backend now copies such an output off the
    memory it shares (:mod:`collage_compile.outputs`).  The optimizer also keeps a step
    count in its own state under a string key (MADGRAD's ``state["k"]``), which the report's
    names and a checkpoint's load once took for a parameter's (a ``TypeError``, an
    ``AttributeError``).  The foreach form
    (``_foreach_mul_``, ``_foreach_add_``) came back separate here: not tested."""
    params, opt = _aggmo_run(False, torch.bfloat16, compiled=True)
    ref, _ = _aggmo_run(False, torch.float64, compiled=False)
    plain, _ = _aggmo_run(False, torch.bfloat16, compiled=False)
    err, plain_err = _errors(params, ref, plain)
    print(f"\ncollage {err:.2e}, plain bf16 {plain_err:.2e}")
    assert err < 0.01 and plain_err > 25 * err
    memory = [p.grad.untyped_storage().data_ptr() for p in params]
    for p in params:
        memory += [b.untyped_storage().data_ptr() for b in opt.state[p]["momentum_buffer"].values()]
    assert len(set(memory)) == len(memory), "a buffer shares memory with a gradient or another"
    # its checkpoint, "k" included, loads into a fresh compiled copy that steps as it does
    collage_compile.attach(opt)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = user_optimizers.AggMo(twins, lr=1e-3)
    collage_compile.attach(collage_compile.compile_optimizer(twin, mode="light"))
    buffer.seek(0)
    twin.load_state_dict(torch.load(buffer))
    for p, q in zip(params, twins):
        q.grad = p.grad.clone()
    opt.step()
    twin.step()
    assert all(torch.equal(mcf_value(p), mcf_value(q)) for p, q in zip(params, twins))
    assert int(twin.state["k"]) == int(opt.state["k"]) == 61


def _adabelief_run(dtype: torch.dtype, compiled: bool) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params(0, 0.5, torch.bfloat16)]
    opt = user_optimizers.AdaBeliefFP32(params, lr=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 20))
    if compiled:
        collage_compile.compile_optimizer(opt, mode="light")
    g = torch.Generator().manual_seed(1)
    for _ in range(60):
        for p in params:
            p.grad = (0.01 + 0.005 * torch.randn(p.shape, generator=g)).bfloat16().to(dtype)
        opt.step()
        schedule.step()
    return params


def test_a_step_computed_on_an_fp32_copy_and_copied_back_is_compensated():
    """timm's AdaBelief (tests/user_optimizers.py), Hugging Face's Adafactor and timm's RAdam
    compute the step on ``p.float()`` in place and ``p.copy_`` it back: the copy back was
    named ("not an accumulation") and lo restarted every step, the weights where plain bf16
    ends (timm's AdaBelief 0.992 of float64's movement off, plain 0.992; timm's RAdam the
    same, and unnamed where another optimizer's tensors of the same names had been named in
    the process: ``python tools/third_party.py``'s timm counterpart).  Now the copy is
    spelled out of place (:mod:`collage_compile.passes.working_copy`) and read as an affine
    update of the pair, under a warmup schedule (a symbolic ``value=``, which Dynamo writes
    as ``fma`` then ``copy_`` into the copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        params = _adabelief_run(torch.bfloat16, compiled=True)
    ref = _adabelief_run(torch.float64, compiled=False)
    plain = _adabelief_run(torch.bfloat16, compiled=False)
    err, plain_err = _errors(params, ref, plain)
    print(f"\ncollage {err:.2e}, plain bf16 {plain_err:.2e}")
    assert err < 0.02 and plain_err > 25 * err


def test_exact_mode_of_an_optimizer_that_counts_its_steps_in_its_state():
    """``mode="exact"`` is the fp32 step.  A hand-written optimizer whose step count is a
    tensor in its state, advanced by ``state["step"] += 1`` (tests/user_optimizers.py's
    AdaBelief), returns that tensor from the step's graph; exact mode wrote the weights
    back after the grad mode Dynamo restores at the step's end (grad on), AOTAutograd then traced a
    training graph that dropped the write, and every weight took the step count's value
    (2.0, then 3.0: after 12 steps 13.6 away), with no warning (``MUT=writes_after_grad_restore``).
    The writes now run with grad mode off."""
    runs = {}
    for run, dtype in (
        ("exact", torch.bfloat16),
        ("fp32", torch.float32),
        ("plain", torch.bfloat16),
    ):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.5).bfloat16().to(dtype))]
        opt = user_optimizers.AdaBeliefFP32(ps, lr=1e-4)
        if run == "exact":
            collage_compile.compile_optimizer(opt, mode="exact")
        for _ in range(12):
            ps[0].grad = (0.01 + 0.005 * torch.randn(32, 16, generator=g)).bfloat16().to(dtype)
            opt.step()
        runs[run] = (collage_compile.value(ps[0]) if run == "exact" else ps[0].detach()).double()
    far = (runs["exact"] - runs["fp32"]).abs().max().item()
    plain = (runs["plain"] - runs["fp32"]).abs().max().item()
    ulp = torch.finfo(torch.float32).eps * runs["fp32"].abs().max().item()
    print(
        f"\nexact mode against the fp32 step: {far:.2e} at most ({far / ulp:.1f} ulps), plain bf16 {plain:.2e}"
    )
    assert far <= 4 * ulp and plain > 1000 * ulp  # plain bf16 loses on the same stream


def _first_step_with_views(p, g, state):
    with torch.no_grad():
        buf = torch.zeros_like(p)
        buf.mul_(0.9).add_(g)  # folded to g by Inductor
        state["buf"], state["flat"] = buf, buf.view(-1)
        p.add_(buf, alpha=-1e-3)


def test_a_new_state_tensor_copied_off_a_gradient_keeps_its_views():
    """A step that creates a buffer and a view of it (flat state and its parts): where the
    buffer comes back on the gradient's memory and is copied off it, the view follows it,
    as in eager (a review of :mod:`collage_compile.outputs` found the view left on the
    gradient)."""
    p = torch.nn.Parameter(torch.randn(4, 8).bfloat16())
    g = torch.randn(4, 8).bfloat16()
    state = {}
    torch.compile(_first_step_with_views, backend=collage_compile.backend)(p, g, state)
    memory = {k: v.untyped_storage().data_ptr() for k, v in state.items()}
    assert memory["buf"] == memory["flat"] != g.untyped_storage().data_ptr(), memory
    assert torch.equal(state["flat"], g.flatten())


def test_step_sizes_made_from_a_list_of_floats_compile_once():
    """LaProp as pytorch_optimizer writes it (tests/user_optimizers.py's
    StepSizeListLaProp) keeps a float per tensor in its state, changed every step, and
    makes its step sizes with ``torch.tensor([...])`` of them.  Dynamo specialized that
    list: the step compiled again every step, and from the recompile limit on trained
    eagerly in plain bf16, named (``MUT=float_lists_specialize``).  The floats now enter as
    tensors (``passes/scalars.py``): three compiles, then compensated."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (16,)]
    start = [(torch.randn(s, generator=g) * 0.5).bfloat16() for s in shapes]
    grads = [
        [(0.01 + 0.005 * torch.randn(s, generator=g)).bfloat16() for s in shapes] for _ in range(30)
    ]
    runs = {}
    for run, dtype in (
        ("collage", torch.bfloat16),
        ("plain", torch.bfloat16),
        ("f64", torch.float64),
    ):
        torch._dynamo.reset()
        params = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in start]
        opt = user_optimizers.StepSizeListLaProp(params, lr=1e-4)
        step = opt.step
        if run == "collage":
            counter = torch._dynamo.testing.CompileCounterWithBackend(collage_compile.backend)
            step = torch.compile(opt.step, backend=counter)
        with warnings.catch_warnings():
            warnings.simplefilter("error", collage_compile.CollageWarning)
            for gs in grads:
                for p, grad in zip(params, gs):
                    p.grad = grad.to(dtype, copy=True)
                step()
        value = collage_compile.value if run == "collage" else torch.Tensor.detach
        runs[run] = torch.cat([value(p).double().flatten() for p in params])
    start64 = torch.cat([w.double().flatten() for w in start])
    moved = (runs["f64"] - start64).norm()
    err = float((runs["collage"] - runs["f64"]).norm() / moved)
    plain = float((runs["plain"] - runs["f64"]).norm() / moved)
    print(
        f"\n{counter.frame_count} compiles; light {err:.1e} of float64's movement, plain bf16 {plain:.2f}"
    )
    assert counter.frame_count <= 3
    assert err < 0.02 and plain > 0.5


@pytest.mark.parametrize("name", ["IntStepAdam", "TensorStepAdam"])
def test_an_int_step_count_read_through_math_pow_compiles_once(name):
    """pytorch_optimizer keeps its step count as a Python int in the param group and
    reads it through ``math.pow(beta, step)`` (tests/user_optimizers.py's IntStepAdam).
    Dynamo specialized the int inside ``math.pow``, so the step compiled again every step
    under any backend, and past the recompile limit trained eagerly in plain bf16 (named):
    Adan, LAMB, AdaBelief, Yogi and ten more of its optimizers (``MUT=math_pow_specialized``).
    The backend's set-up has Dynamo trace ``math.pow`` on a symbol as ``x ** y``
    (``_compat.trace_math_pow_symbolically``): three compiles, then compensated.

    MADGRAD's count is a tensor (TensorStepAdam: ``math.pow(state["k"] + 1, 0.5)``):
    traced as ``float(k + 1)`` it compiled again every step, MADGRAD trained in plain
    bf16 past the limit (``MUT=math_pow_of_tensors``), with Dynamo's
    ``capture_scalar_outputs`` on (as Adafactor needs, docs/limits.md); the handler leaves
    a tensor to Dynamo (a graph break), and the frames it makes compile once each."""
    g = torch.Generator().manual_seed(0)
    start = (torch.randn(32, 16, generator=g) * 0.5).bfloat16()
    grads = [(0.01 + 0.005 * torch.randn(32, 16, generator=g)).bfloat16() for _ in range(30)]
    runs = {}
    for run, dtype in (
        ("collage", torch.bfloat16),
        ("plain", torch.bfloat16),
        ("f64", torch.float64),
    ):
        torch._dynamo.reset()
        p = torch.nn.Parameter(start.to(dtype, copy=True))
        opt = getattr(user_optimizers, name)([p], lr=1e-4)
        step = opt.step
        if run == "collage":
            counter = torch._dynamo.testing.CompileCounterWithBackend(collage_compile.backend)
            step = torch.compile(opt.step, backend=counter)
        with (
            warnings.catch_warnings(),
            torch._dynamo.config.patch(capture_scalar_outputs=True),
        ):
            warnings.simplefilter("error", collage_compile.CollageWarning)
            for grad in grads:
                p.grad = grad.to(dtype)
                step()
        runs[run] = (collage_compile.value(p) if run == "collage" else p.detach()).double()
    moved = (runs["f64"] - start.double()).norm()
    err = float((runs["collage"] - runs["f64"]).norm() / moved)
    plain = float((runs["plain"] - runs["f64"]).norm() / moved)
    print(
        f"\n{counter.frame_count} compiles; light {err:.1e} of float64's movement, plain bf16 {plain:.2f}"
    )
    # the first step (state made), the second, then dynamic; MADGRAD's graph break: 3 frames
    assert counter.frame_count <= (3 if name == "IntStepAdam" else 6)
    assert err < 0.02 and plain > 0.5
