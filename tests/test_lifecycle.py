"""How long a lo lives and who shares it: tensor lifetimes, recompiles, shapes, dtypes,
devices, and several optimizers or compiled functions over the same parameters."""

from __future__ import annotations

import gc
import resource
import warnings
import weakref

import pytest
import torch
from conftest import bf16_param, grad_stream, mcf_value, relative_error

import collage_compile
from collage_compile import state


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_a_thousand_lifetimes_keep_memory_flat():
    """The issue's criterion: 1000 create / train / delete cycles of a parameter passed
    into a compiled step (its lo kept by view), plus 1000 of a tensor given a pair with
    ``set_value`` (kept by identity): the registry and the process memory stay flat.  Each
    lifetime's lo is 512 KiB, so 1000 leaked would be 500 MiB: a quarter of that fails."""
    n = 256 * 1024

    @torch.compile(backend=collage_compile.backend)
    def sgd(p, g):
        with torch.no_grad():
            p.add_(g, alpha=-1e-3)

    g = torch.full((n,), 1e-3, dtype=torch.bfloat16)

    def lifetime(i: int) -> None:
        p = torch.nn.Parameter(torch.full((n,), 1.0 + i % 7, dtype=torch.bfloat16))
        sgd(p, g)
        assert collage_compile.components(p)[1] is not None
        t = torch.zeros(n, dtype=torch.bfloat16)
        collage_compile.set_value(t, torch.full((n,), 0.1, dtype=torch.float64))

    for i in range(50):  # warm-up: compile, allocator pools, index caches
        lifetime(i)
    gc.collect()
    base_count, base_rss = state.count(), _rss_mb()
    for i in range(1000):
        lifetime(i)
    gc.collect()
    grown = _rss_mb() - base_rss
    print(f"1000 lifetimes: registry {base_count} -> {state.count()}, RSS +{grown:.1f} MiB")
    assert state.count() <= base_count + 2
    assert len(state._stamps) <= base_count + 2
    # a leak of one lo a lifetime keeps 500 MiB; without one, RSS grew 65 MiB on the GPU
    # image's 16-core machine (its allocator's arenas), under 64 here
    assert grown < 128

    # the pairs really were made and used: the compiled step moved the value, plain would not
    p = torch.nn.Parameter(torch.full((n,), 1.0, dtype=torch.bfloat16))
    for _ in range(10):
        sgd(p, g)
    assert abs(mcf_value(p).mean().item() - (1 - 1e-5)) < 1e-7
    assert p.detach().double().mean().item() == 1.0


def test_a_deleted_models_weights_are_freed_by_one_collection():
    """A sweep deletes a model and its ``compile_optimizer``-ed optimizer and wants the
    weights' memory back.  The installed step is a bound method of the optimizer (a
    cycle), so Dynamo's finalizer, which drops the optimizer's tensors from its graph, runs
    inside the collection; the compiled step's working copy of that graph must not keep
    them for a second one."""

    def train_and_drop(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(16, 16).to(torch.bfloat16)
        opt = collage_compile.compile_optimizer(torch.optim.AdamW(model.parameters()))
        for _ in range(2):
            model(torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert collage_compile.components(model.weight)[1] is not None
        return weakref.ref(model.weight), weakref.ref(opt)

    refs = [train_and_drop(seed) for seed in range(2)]
    gc.collect()
    assert [w() is None for w, _ in refs] == [True, True]
    assert [o() is None for _, o in refs] == [True, True]


def test_two_optimizers_and_two_compiled_functions_share_one_pair():
    """Two optimizers over different parameters, and a second compiled function (weight
    decay written by hand) writing one of the same parameters: each parameter has one lo,
    used by every graph that writes it, and the value follows float64 through both."""
    a, b = bf16_param(seed=0), bf16_param(seed=1)
    ref_a, ref_b = a.detach().double().clone(), b.detach().double().clone()
    start_a, start_b = ref_a.clone(), ref_b.clone()
    opt_a = torch.optim.SGD([a], lr=1e-3)
    opt_b = torch.optim.AdamW([b], lr=1e-4, weight_decay=0.0)
    step_a = torch.compile(opt_a.step, backend=collage_compile.backend)
    step_b = torch.compile(opt_b.step, backend=collage_compile.backend)

    @torch.compile(backend=collage_compile.backend)
    def decay(ps):
        with torch.no_grad():
            for p in ps:
                p.mul_(1 - 1e-4)

    ref_opt_b = torch.optim.AdamW([torch.nn.Parameter(ref_b.clone())], lr=1e-4, weight_decay=0.0)
    # the same streams in eager bf16
    plain_a = a.detach().clone()
    plain_b = torch.nn.Parameter(b.detach().clone())
    plain_opt_b = torch.optim.AdamW([plain_b], lr=1e-4, weight_decay=0.0)
    grads = grad_stream(a.numel(), 60)
    for k, g in enumerate(grads):
        plain_a.add_(g, alpha=-1e-3).mul_(1 - 1e-4)
        plain_b.grad = g
        plain_opt_b.step()
        with torch.no_grad():
            plain_b.mul_(1 - 1e-4)
        a.grad = b.grad = g
        step_a()
        step_b()
        ref_a.add_(g.double(), alpha=-1e-3)
        rb = ref_opt_b.param_groups[0]["params"][0]
        rb.grad = g.double()
        ref_opt_b.step()
        if k == 0:
            lo_a, lo_b = state.get_lo(a), state.get_lo(b)
        decay([a, b])
        ref_a.mul_(1 - 1e-4)
        with torch.no_grad():
            rb.mul_(1 - 1e-4)
    rb = ref_opt_b.param_groups[0]["params"][0].detach()
    err_a = relative_error(mcf_value(a), ref_a, start_a)
    err_b = relative_error(mcf_value(b), rb, start_b)
    plain_a = relative_error(plain_a.double(), ref_a, start_a)
    plain_b = relative_error(plain_b.detach().double(), rb, start_b)
    print(
        f"shared pairs: SGD {err_a:.2e} (plain bf16 {plain_a:.2f}), "
        f"AdamW {err_b:.2e} (plain bf16 {plain_b:.2f})"
    )
    # measured: SGD 1.4e-2 (plain 1.00), AdamW 6.2e-3 (plain 0.98)
    assert err_a <= 0.02 < plain_a
    assert err_b <= 0.02 < plain_b
    assert state.get_lo(a) is lo_a and state.get_lo(b) is lo_b


def test_dynamic_shapes_and_new_learning_rates_keep_each_pair():
    """``dynamic=True`` with parameters of two sizes and a learning rate that changes: one
    graph serves both sizes, each parameter keeps its own lo through the lr change."""

    @torch.compile(backend=collage_compile.backend, dynamic=True)
    def step(p, g, lr):
        with torch.no_grad():
            p.add_(g, alpha=-lr)

    ps = [bf16_param(n=n, seed=n) for n in (300, 700)]
    refs = [p.detach().double().clone() for p in ps]
    starts = [r.clone() for r in refs]
    plains = [p.detach().clone() for p in ps]  # the same stream in eager bf16
    gs = {n: grad_stream(n, 120, seed=n) for n in (300, 700)}
    for k in range(120):
        lr = 1e-3 if k < 60 else 2e-3
        for p, r, q in zip(ps, refs, plains):
            g = gs[p.numel()][k]
            step(p, g, lr)
            r.add_(g.double(), alpha=-lr)
            q.add_(g, alpha=-lr)
        if k == 59:
            los = [state.get_lo(p) for p in ps]
    assert [state.get_lo(p) for p in ps] == los
    for p, r, s, q in zip(ps, refs, starts, plains):
        assert relative_error(mcf_value(p), r, s) < 0.02
        assert relative_error(q.double(), r, s) > 0.3


def test_convert_between_dtypes_keeps_the_tracked_value():
    """bf16 pair -> fp32 (hi + lo) -> fp16 pair -> bf16 pair: each conversion keeps what the
    target can hold; plain ``.to()`` round trips lose the low bits."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    w = model.weight.detach().double().clone()
    collage_compile.convert(model, torch.bfloat16)
    collage_compile.convert(model, torch.float32)
    assert model.weight.dtype == torch.float32
    assert (model.weight.double() - w).abs().max() < 2.0**-16 * w.abs().max()
    w32 = model.weight.detach().double().clone()
    collage_compile.convert(model, torch.float16)
    # an fp16 pair holds 22 bits (less where lo is subnormal, below 2^-14)
    fp16_err = (mcf_value(model.weight) - w32).abs()
    assert (fp16_err <= torch.maximum(2.0**-22 * w32.abs(), torch.tensor(2.0**-25))).all()
    collage_compile.convert(model, torch.bfloat16)
    pair_err = (mcf_value(model.weight) - w).abs().max().item()
    plain_err = (w.to(torch.float16).to(torch.bfloat16).double() - w).abs().max().item()
    assert pair_err < plain_err / 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moving_a_model_to_another_device_moves_its_lo():
    model = torch.nn.Linear(64, 64).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    step()
    before = [mcf_value(p).clone() for p in model.parameters()]
    model.cuda()
    torch._dynamo.reset()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    step()
    for p, v in zip(model.parameters(), before):
        assert state.get_lo(p).device == p.device
        assert torch.equal(mcf_value(p).cpu(), v)


def _unfreezing_run(dtype, mode):
    """AdamW over a (32, 16) matrix and a (16,) vector; a second such pair joins as a
    param group of its own at step 10 (progressive unfreezing); the values of all four at
    step 40, and their start."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 16), (16,)] * 2
    start = [(torch.randn(s, generator=g) * 0.5).bfloat16() for s in shapes]
    grads = [
        [(0.01 + 0.005 * torch.randn(s, generator=g)).bfloat16() for s in shapes] for _ in range(40)
    ]
    params = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in start]
    opt = torch.optim.AdamW(params[:2], lr=1e-4, weight_decay=0.1)
    if mode is not None:
        collage_compile.compile_optimizer(opt, mode=mode)
    for k, gs in enumerate(grads):
        if k == 10:
            opt.add_param_group({"params": params[2:], "lr": 5e-5, "weight_decay": 0.01})
        for p, grad in zip(params, gs):
            p.grad = grad.to(dtype, copy=True)
        opt.step()
    value = collage_compile.value if mode is not None else torch.Tensor.detach
    return [value(p).double() for p in params], [w.double() for w in start]


@pytest.mark.parametrize("mode", ["light", "exact"])
def test_a_param_group_added_mid_training_is_compensated_from_its_first_step(mode):
    """``opt.add_param_group`` after compiled steps (unfreezing a backbone): the step
    compiles again over the new tensors, whose pairs start with their first step; every
    tensor ends as close to its float64 run as when all train from the start (light:
    within 2 % of the movement, exact: the fp32 run's distance), plain bf16 over 50 %."""
    ref, start = _unfreezing_run(torch.float64, None)
    fp32, _ = _unfreezing_run(torch.float32, None)
    plain, _ = _unfreezing_run(torch.bfloat16, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        got, _ = _unfreezing_run(torch.bfloat16, mode)
    for i, (r, s) in enumerate(zip(ref, start)):
        moved = float((r - s).norm())
        err, e32, e16 = (float((x[i] - r).norm()) / moved for x in (got, fp32, plain))
        print(f"tensor {i}: {mode} {err:.1e}, fp32 {e32:.1e}, plain bf16 {e16:.2f}")
        assert e16 > 0.5
        assert err < (0.02 if mode == "light" else e32 + 1e-5), (i, err, e32)
