"""Graphs that read, alias or rewrite a tensor in ways a naive rewrite gets wrong.

Each case is one a reviewer broke an earlier version with.  The answer is either the upgrade
(checked against float64, with plain bf16 much worse) or the defined fallback: the write runs
as the user wrote it, a CollageWarning names the tensor, and lo restarts from zero so the
pair never disagrees with hi.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import bf16_param, eager_grow, grad_stream, mcf_value, relative_error

import collage_compile
from collage_compile import report


def _param(n=256, scale=1.0):
    return bf16_param(n=n, scale=scale)


def _upgraded_patterns() -> set[str]:
    return {e.pattern for r in report.reports() for e in r.entries if e.applied}


# ---- ordering: what a chain reads must be what the user's code read --------------------------


def test_a_temporary_changed_in_place_before_the_copy_is_computed_as_written():
    @torch.compile(backend=collage_compile.backend)
    def step(p, g):
        t = p * 2.0
        t.add_(g)  # t = 2p + g: the walk must not read t as 2p
        p.copy_(t)

    update = torch.compile(lambda p, g: p.add_(g, alpha=-1e-3), backend=collage_compile.backend)
    p = _param()
    g = torch.full_like(p.detach(), 0.5)
    with torch.no_grad():
        for _ in range(3):
            update(p, g)  # gives p a non-zero lo
        assert collage_compile.components(p)[1].abs().sum() > 0
        eager = (p.detach() * 2.0).add_(g)
        with pytest.warns(collage_compile.CollageWarning, match="copy_"):
            step(p, g)
    hi, lo = collage_compile.components(p)
    assert torch.equal(hi.detach(), eager)
    assert torch.equal(lo, torch.zeros_like(lo))


def test_an_operand_zeroed_between_its_read_and_the_copy_keeps_its_old_value():
    @torch.compile(backend=collage_compile.backend)
    def step(p, g):
        new = torch.add(p, g, alpha=-1e-2)  # reads g = 0.5
        g.zero_()  # the gradient is cleared inside the step
        p.copy_(new)

    p = _param()
    p0 = p.detach().double().clone()
    g = torch.full_like(p.detach(), 0.5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", collage_compile.CollageWarning)
        step(p, g)
    moved = (mcf_value(p) - p0).mean().item()
    assert moved == pytest.approx(-5e-3, rel=0.1)  # not 0: the update was not re-read as g = 0
    assert torch.equal(g, torch.zeros_like(g))


def test_an_operand_cleared_by_setitem_after_its_write_does_not_reach_the_chain():
    @torch.compile(backend=collage_compile.backend)
    def step(p, g):
        p.add_(g, alpha=-1e-2)  # g = 0.5 here
        g[:] = 0.0
        p.mul_(0.5)

    p = _param()
    p0 = p.detach().double().clone()
    g = torch.full_like(p.detach(), 0.5)
    with torch.no_grad():
        step(p, g)
    expected = (p0 - 5e-3) * 0.5
    assert (mcf_value(p) - expected).abs().max().item() <= 1e-5
    assert (p.detach().double() - expected).abs().max().item() > 1e-4  # hi alone cannot say it


def test_an_out_argument_between_two_writes_reads_the_first_write():
    @torch.compile(backend=collage_compile.backend)
    def step(p, g, buf):
        p.add_(g)
        torch.mul(p, 2.0, out=buf)  # must see p + g
        p.add_(g)

    p = _param()
    p0 = p.detach().clone()
    g = torch.full_like(p0, 0.5)
    buf = torch.empty_like(p0)
    with torch.no_grad():
        step(p, g, buf)
    assert torch.equal(buf, (p0 + g) * 2)


# ---- writes the backend cannot carry: warned, run as written, lo restarted ------------------


def test_setitem_on_a_parameter_warns_and_never_resurrects_pruned_weights():
    @torch.compile(backend=collage_compile.backend)
    def step(p, g, mask):
        p.add_(g, alpha=-1e-3)
        p[mask] = 0.0

    p = _param()
    mask = torch.arange(256) % 2 == 0
    with torch.no_grad():
        with pytest.warns(collage_compile.CollageWarning, match=r"setitem.*\[256\], bfloat16"):
            step(p, grad_stream(256, 1)[0], mask)
        assert (mcf_value(p)[mask] == 0).all()
        step(p, torch.zeros(256, dtype=torch.bfloat16), torch.zeros_like(mask))
    assert (p.detach()[mask] == 0).all()  # a stale lo did not bring them back


def test_a_cast_to_integers_in_a_copy_is_not_treated_as_a_conversion():
    @torch.compile(backend=collage_compile.backend)
    def step(p):
        p.copy_(p.to(torch.int32) * 0.5)  # trunc(p) * 0.5

    p = torch.nn.Parameter((torch.linspace(-4, 4, 256) + 0.3).to(torch.bfloat16))
    expected = p.detach().to(torch.int32) * 0.5
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", collage_compile.CollageWarning)
        step(p)
    assert torch.equal(mcf_value(p), expected.double())


# ---- division --------------------------------------------------------------------------------


@pytest.mark.parametrize("arithmetic", ["fp32", "storage"])
def test_division_by_a_tiny_tensor_matches_eager_instead_of_overflowing(arithmetic):
    """A reciprocal of 1e-39 is inf in fp32; the chain divides instead."""

    @torch.compile(backend=collage_compile.make_backend(arithmetic=arithmetic))
    def step(p, t):
        p.div_(t)

    p = torch.nn.Parameter(torch.full((8,), 1e-3).bfloat16())
    t = torch.tensor([1e-39, 4e-39, 1e-38, 1.0, 3e38, 1e-30, 2.0, 0.5]).bfloat16()
    eager = p.detach() / t
    with torch.no_grad():
        step(p, t)
    assert torch.equal(p.detach(), eager)
    assert torch.isfinite(mcf_value(p)).all()


# ---- layouts and aliasing ----------------------------------------------------------------------


def _plain_sgd_error(params, grads_per_param, lr):
    """Relative error of eager plain bf16 SGD on the same stream (the baseline)."""
    plain = [p.detach().clone() for p in params]
    refs = [p.detach().double().clone() for p in params]
    starts = [r.clone() for r in refs]
    for grads in grads_per_param:
        for q, r, g in zip(plain, refs, grads):
            q.add_(g, alpha=-lr)
            r.add_(g.double(), alpha=-lr)
    return [relative_error(q.double(), r, s) for q, r, s in zip(plain, refs, starts)], refs, starts


def test_parameters_that_are_views_of_one_flat_buffer_are_each_upgraded():
    """FSDP(use_orig_params) / DeepSpeed style: a and b share one storage."""
    flat = (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16()
    a, b = torch.nn.Parameter(flat[:256]), torch.nn.Parameter(flat[256:])
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    stream = list(zip(grad_stream(256, 300, seed=1), grad_stream(256, 300, seed=2)))
    plain_errs, refs, starts = _plain_sgd_error([a, b], stream, 1e-3)
    opt = torch.optim.SGD([a, b], lr=1e-3, foreach=False)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        for ga, gb in stream:
            a.grad, b.grad = ga, gb
            step()
    for p, r, s, plain_err in zip((a, b), refs, starts, plain_errs):
        err = relative_error(mcf_value(p), r, s)
        assert err <= 0.02
        assert plain_err >= 25 * err


def test_a_strided_view_parameter_gets_a_contiguous_lo_and_is_upgraded():
    base = (torch.randn(512, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16()
    p = torch.nn.Parameter(base[::2])
    assert p.stride() == (2,)
    stream = [[g] for g in grad_stream(256, 300)]
    (plain_err,), (ref,), (start,) = _plain_sgd_error([p], stream, 1e-3)
    f = torch.compile(lambda p, g: p.add_(g, alpha=-1e-3), backend=collage_compile.backend)
    with torch.no_grad():
        for (g,) in stream:
            f(p, g)
    lo = collage_compile.components(p)[1]
    assert lo.stride() == (1,) and lo.shape == p.shape
    err = relative_error(mcf_value(p), ref, start)
    assert err <= 0.02
    assert plain_err >= 25 * err


def test_module_half_after_compiling_raises_instead_of_reading_bf16_bits_as_fp16():
    """torch.compile does not re-check an optimizer's parameters after module.half() (plain
    Inductor then computes on the wrong dtype); the backend refuses with a clear error, and
    after a recompile the stale bf16 lo is replaced by zeros, with a warning."""
    lin = torch.nn.Linear(16, 8, bias=False).bfloat16()
    opt = torch.optim.SGD(lin.parameters(), lr=1e-3, foreach=False)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    p = lin.weight
    for _ in range(3):
        p.grad = torch.randn_like(p)
        step()
    assert collage_compile.components(p)[1].dtype == torch.bfloat16
    lin.half()
    p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match=r"bfloat16 is now float16.*torch._dynamo.reset"):
        step()
    torch._dynamo.reset()
    before = p.detach().clone()
    # named as the step's source names it (a user's name_tensors would name it lin.weight)
    with pytest.warns(collage_compile.CollageWarning, match=r"params\[0\] \(.*restarts from"):
        step()
    hi, lo = collage_compile.components(p)
    assert lo.dtype == torch.float16 and torch.equal(lo, torch.zeros_like(lo))
    assert torch.equal(hi.detach(), before)  # a zero update leaves the weights alone


def test_channels_last_after_compiling_raises_and_the_pair_moves_with_the_weight():
    """``model.to(memory_format=torch.channels_last)`` mid-run puts a conv weight in another
    layout under the same Parameter.  torch.compile does not re-check an optimizer's
    parameters, and a step compiled for the old layout indexed the weight in it beside its
    contiguous state: an adversarial test found the weights scrambled, further from float64
    than plain bf16, with no warning.  The backend refuses with a clear error; after a
    recompile the lo moves into the new layout (the values did not change) and training
    goes on compensated."""
    conv = torch.nn.Conv2d(8, 16, 3, bias=False).bfloat16()
    p = conv.weight
    cl = torch.channels_last
    start = p.detach().double().clone()
    ref, plain = start.clone(), p.detach().clone()
    opt = torch.optim.SGD([p], lr=1e-3)
    collage_compile.compile_optimizer(opt)
    stream = [g.view_as(p).clone() for g in grad_stream(p.numel(), 90)]  # no views
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        for i, g in enumerate(stream):
            if i == 30:
                value = mcf_value(p)
                conv.to(memory_format=cl)
                assert torch.equal(mcf_value(p), value)  # the pair still holds it
                p.grad = g.contiguous(memory_format=cl)  # as backward() would lay it out
                with pytest.raises(RuntimeError, match=r"strides \(72, 1, 24, 8\).*_dynamo.reset"):
                    opt.step()
                assert torch.equal(mcf_value(p), value)  # refused before any write
                torch._dynamo.reset()
            p.grad = g.contiguous(memory_format=cl) if i >= 30 else g
            opt.step()
            ref.add_(g.double(), alpha=-1e-3)
            plain.add_(g, alpha=-1e-3)
    hi, lo = collage_compile.components(p)
    assert hi.is_contiguous(memory_format=cl) and lo.stride() == hi.stride()
    err = relative_error(mcf_value(p), ref, start)
    assert err <= 0.02, err
    assert relative_error(plain.double(), ref, start) >= 0.25


def test_an_fp32_weight_stepped_beside_the_pairs_is_watched_for_a_new_layout_too():
    """An fp32 conv weight in the same AdamW as bf16 pairs is stepped by the rewritten graph,
    whose input asserts the backend turns off: put in channels-last under the same
    Parameter, it was indexed in its old layout (0.04 from eager AdamW after three steps,
    silently).  The backend refuses, naming it; recompiled, the step is eager AdamW's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 3))
    model[1].bfloat16()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    collage_compile.compile_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        if i == 3:
            model[0].to(memory_format=torch.channels_last)
            twin[0].to(memory_format=torch.channels_last)
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            q.grad = p.grad.clone()
        if i == 3:
            with pytest.raises(
                RuntimeError,
                match=r"params\[0\], held by .* strides \(36, 1, 12, 4\)",
            ):
                opt.step()
            torch._dynamo.reset()
        opt.step()
        twin_opt.step()
    assert torch.allclose(model[0].weight, twin[0].weight, rtol=0, atol=1e-5)


def test_an_fp32_model_cast_to_bf16_after_compiled_steps_raises_instead_of_crashing():
    """Steps compiled over fp32 parameters (nothing to compensate) are reused after
    ``model.to(torch.bfloat16)``: Dynamo does not re-check an optimizer's parameters, and
    the fp32 kernels read bf16 memory as fp32 (garbage, or a segfault; plain Inductor
    too).  The step now raises, naming the tensor; after ``torch._dynamo.reset()`` it
    compiles for bf16 and is compensated."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", collage_compile.CollageWarning)  # fp32: nothing to do
        collage_compile.compile_optimizer(opt)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01)
            opt.step()
    model.to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    with pytest.raises(RuntimeError, match=r"params\[0\].* is now bfloat16"):
        opt.step()
    torch._dynamo.reset()
    opt.step()
    assert all(collage_compile.components(p)[1] is not None for p in model.parameters())
    assert all(p.float().abs().max() < 1 for p in model.parameters())


def test_module_float_mid_run_names_the_lo_it_lost_and_trains_on_in_fp32():
    """``model.float()`` mid-run widens hi alone: what the lo held is lost, once.  Named
    as that (a new-user test found it reported as a step run without the backend, with
    causes that did not include it), and the fp32 weights then step without a pair or a
    warning, tracking float64 from the widened values as fp32 SGD does."""
    lin = torch.nn.Linear(16, 8).bfloat16()
    opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
    collage_compile.compile_optimizer(opt)
    collage_compile.name_tensors(lin, opt)
    stream = grad_stream(8 * 16 + 8, 8, mean=0.01)
    for g in stream[:4]:
        lin.weight.grad, lin.bias.grad = g[:128].view(8, 16).bfloat16(), g[128:].bfloat16()
        opt.step()
    assert all(collage_compile.components(p)[1] is not None for p in lin.parameters())
    lin.float()
    start = [p.detach().double().clone() for p in lin.parameters()]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for g in stream[4:]:
            lin.weight.grad, lin.bias.grad = g[:128].view(8, 16).float(), g[128:].float()
            opt.step()
    msgs = [str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)]
    assert len(msgs) == 1, msgs
    assert "now float32 (weight, bias)" in msgs[0] and "convert(model, torch.float32)" in msgs[0]
    assert all(collage_compile.components(p)[1] is None for p in lin.parameters())
    for p, s0, (i, j) in zip(lin.parameters(), start, ((0, 128), (128, 136))):
        ref = s0 - 1e-3 * sum(g[i:j].double() for g in stream[4:]).view(s0.shape)
        assert (p.detach().double() - ref).abs().max() < 1e-7


def test_asgd_single_tensor_copy_after_its_decay_is_upgraded():
    """ASGD(foreach=False) writes p.mul_(...) and then p.copy_(fma(g, -eta, p))."""
    p = _param(n=512, scale=0.5)
    ref = torch.nn.Parameter(p.detach().double().clone())
    start = ref.detach().clone()
    opt = torch.optim.ASGD([p], lr=1e-3, foreach=False)
    ref_opt = torch.optim.ASGD([ref], lr=1e-3, foreach=False)
    plain = torch.nn.Parameter(p.detach().clone())
    plain_opt = torch.optim.ASGD([plain], lr=1e-3, foreach=False)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for g in grad_stream(512, 300):
        p.grad, ref.grad, plain.grad = g, g.double(), g.clone()
        step()
        ref_opt.step()
        plain_opt.step()
    if torch.__version__.startswith("2.13"):  # 2.11's Dynamo traces it as p.add_(...)
        assert "copy_(fma)" in _upgraded_patterns()
    err = relative_error(mcf_value(p), ref.detach(), start)
    plain_err = relative_error(plain.detach().double(), ref.detach(), start)
    assert err <= 0.02
    assert plain_err >= 25 * err


# ---- scalars ---------------------------------------------------------------------------------


def test_a_0dim_product_with_a_scheduled_float_keeps_eagers_dtype():
    """``s * (1 - lr * 0.1)``, ``s`` a 0-dim bf16 tensor and ``lr`` a float that changes
    every call: eager gives bf16.  The backend rebuilds ``1 - lr * 0.1`` as a float64 tensor
    cast to fp32 (what torch 2.11's tensorification would specialize), and a 0-dim fp32
    operand promotes a 0-dim product: it must come back bf16, rounded as eager rounds it."""
    p = _param(n=8, scale=0.5)
    g = torch.full((8,), 0.25, dtype=torch.bfloat16)
    s = torch.tensor(0.7, dtype=torch.bfloat16)

    @torch.compile(backend=collage_compile.backend)
    def f(p, g, s, lr):
        with torch.no_grad():
            p.add_(g, alpha=-lr)
        return s * (1 - lr * 0.1)

    for lr in (1e-3, 2e-3, 3e-3, 0.4):  # the second call on compiles with lr dynamic
        out, ref = f(p, g, s, lr), s * (1 - lr * 0.1)
        assert out.dtype == ref.dtype and torch.equal(out, ref), (lr, out, ref)


def test_symbolic_scalars_under_dynamic_shapes_are_carried_exactly():
    """``n = g.shape[0]`` is a SymInt with dynamic=True: decay, alpha, scalar add and lerp
    weight all become symbolic and must still reach the pair unrounded."""

    @torch.compile(backend=collage_compile.backend, dynamic=True)
    def step(p, g):
        n = g.shape[0]
        p.mul_(1 - 1e-3 / n)
        p.add_(g.sum(0), alpha=-1e-3 / n)
        p.add_(1e-4 / n)
        p.lerp_(g[0], 1e-3 / n)

    p = _param(n=128, scale=0.5)
    ref = p.detach().double().clone()
    start = ref.clone()
    plain = p.detach().clone()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i in range(120):
            n = (4, 6, 8)[i % 3]
            g = (0.01 + 0.005 * torch.randn(n, 128, generator=gen)).bfloat16()
            step(p, g)
            for x in (ref, plain):
                gx = g.to(x.dtype)
                x.mul_(1 - 1e-3 / n).add_(gx.sum(0), alpha=-1e-3 / n).add_(1e-4 / n)
                x.lerp_(gx[0], 1e-3 / n)
    err = relative_error(mcf_value(p), ref, start)
    plain_err = relative_error(plain.double(), ref, start)
    assert err <= 0.02
    assert plain_err >= 25 * err


def test_storage_arithmetic_adds_a_python_scalar_like_eager_bf16_grow():
    @torch.compile(backend=collage_compile.make_backend(arithmetic="storage"))
    def step(p):
        p.add_(1e-4)

    p = _param(n=128, scale=0.5)
    hi, lo = p.detach().clone(), torch.zeros_like(p.detach())
    u = torch.full_like(hi, 1e-4)  # the update rounded to bf16 first, as the paper does
    with torch.no_grad():
        for _ in range(50):
            step(p)
            hi, lo = eager_grow(hi, lo, u)
    got_hi, got_lo = collage_compile.components(p)
    assert torch.equal(got_hi.detach(), hi) and torch.equal(got_lo, lo)
    assert (hi.double() + lo.double() - p.detach().double()).abs().sum() > 0  # lo is used


# ---- aliases passed in -------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["data", "detach"])
def test_p_data_passed_in_shares_the_parameters_pair(alias):
    """p.data / p.detach() is a plain tensor to Dynamo, but an exact alias of a parameter
    that carries a pair: its writes are upgraded on that pair (an update accumulates into
    it, an overwrite resets lo) instead of leaving a lo that no longer belongs to its hi."""
    update = torch.compile(lambda p, g: p.add_(g, alpha=-1e-3), backend=collage_compile.backend)
    reset = torch.compile(lambda t: t.fill_(1.0), backend=collage_compile.backend)
    p = _param(n=64)
    view = (lambda: p.data) if alias == "data" else (lambda: p.detach())
    start = p.detach().double().clone()
    ref, plain = start.clone(), p.detach().clone()
    with torch.no_grad():
        update(p, torch.zeros(64, dtype=torch.bfloat16))  # p carries a pair from here on
        with warnings.catch_warnings():
            warnings.simplefilter("error", collage_compile.CollageWarning)
            for g in grad_stream(64, 20):
                update(view(), g)
                ref -= 1e-3 * g.double()
                plain.add_(g, alpha=-1e-3)  # the same stream in plain bf16
            err = relative_error(collage_compile.value(p), ref, start)
            assert err < 0.05
            assert relative_error(plain, ref, start) >= max(0.5, 10 * err)
            assert collage_compile.components(p)[1].abs().sum() > 0
            reset(view())
    assert torch.equal(collage_compile.value(p), torch.ones(64))
    assert not collage_compile.components(p)[1].any()


def test_writing_part_of_a_parameter_passed_in_restarts_its_lo_and_says_so():
    """A partial alias (a slice of p.data) is not the pair's tensor: its write is not
    upgraded, and the parameter's lo, no longer matching its hi, restarts with a warning."""
    update = torch.compile(lambda p, g: p.add_(g, alpha=-1e-3), backend=collage_compile.backend)
    reset = torch.compile(lambda t: t.fill_(1.0), backend=collage_compile.backend)
    p = _param(n=64)
    with torch.no_grad():
        for g in grad_stream(64, 5):
            update(p, g)
        assert collage_compile.components(p)[1].abs().sum() > 0
        with pytest.warns(collage_compile.CollageWarning, match=r"shares memory with a parameter"):
            reset(p.data[:32])
    assert torch.equal(collage_compile.value(p)[:32], torch.ones(32))
    assert not collage_compile.components(p)[1].any()


def test_a_copy_source_used_elsewhere_keeps_the_chain_split():
    """``p.mul_(c); t = p + u; p.copy_(t)`` is one chain when ``t`` serves only the copy_
    (ASGD's single-tensor step); when ``t`` is also returned, it must be computed from the
    decayed ``p`` at its own position, so the chain is closed before it."""

    def step(p, g):
        p.mul_(0.5)
        t = p + g * 0.25
        p.copy_(t)
        return t * 2

    compiled = torch.compile(step, backend=collage_compile.backend)
    p = _param(n=64)
    start = p.detach().float().clone()
    ref = p.detach().clone()
    g = torch.ones(64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = compiled(p, g)
        expected = step(ref, g)
    assert torch.equal(out, expected)  # t read the decayed p, as in eager
    assert torch.equal(p.detach(), ref)  # hi: rounded to nearest, as eager
    assert torch.equal(collage_compile.value(p), start * 0.5 + 0.25)  # hi + lo: exact
    assert not torch.equal(ref.float(), start * 0.5 + 0.25)  # which plain bf16 is not


@pytest.mark.parametrize("spelling", ["div_", "copy_"])
def test_a_max_norm_constraint_compiles_and_is_named(spelling):
    """A step post-hook's max-norm constraint (``p.div_(p.norm(dim=1, keepdim=True) + 1)``,
    Keras-style), compiled into the step by ``compile_optimizer``: its factor has a shape
    and is computed from the weight itself, a renormalization, not a decay.  Rewritten as
    one, Inductor's C++ loop fusion failed (``KeyError``) where plain Inductor compiles it
    (found by a new-user test).  Now the write runs as written, named once, lo restarting
    after it, and the step matches plain eager bf16 (within 2^-5: Inductor keeps the norm
    and the division's operands in fp32, eager rounds each to bf16)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    grads = [(0.01 * torch.randn(32, 16, generator=g)).to(torch.bfloat16) for _ in range(3)]

    def run(compiled):
        p = torch.nn.Parameter(w.clone())
        opt = torch.optim.SGD([p], lr=1e-3)

        def max_norm(optimizer, args, kwargs):
            with torch.no_grad():
                scale = p.norm(dim=1, keepdim=True) + 1.0
                p.div_(scale) if spelling == "div_" else p.copy_(p * (1.0 / scale))

        opt.register_step_post_hook(max_norm)
        if compiled:
            collage_compile.compile_optimizer(opt)
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
        return p.detach()

    plain = run(False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", collage_compile.CollageWarning)
        out = run(True)
    said = [str(r.message) for r in rec if r.category is collage_compile.CollageWarning]
    assert len(said) == 1 and f"not upgraded: {spelling}" in said[0], said
    torch.testing.assert_close(out, plain, rtol=2**-5, atol=0)


@pytest.mark.parametrize("mode", ["light", "exact"])
def test_a_clamp_constraint_in_a_step_post_hook_is_carried(mode):
    """A weight constraint ``p.clamp_(-c, c)`` in a step post-hook (WGAN's clipping,
    Keras-style constraints), compiled into the step by ``compile_optimizer``: a maximum and
    a minimum of the pair's whole value, so lo survives it.  Before, lo restarted after every
    clamp (named) and SGD's updates below half an ulp were lost as in plain bf16.  SGD on a
    fixed gradient stream, against the same stream in float64."""
    gen = torch.Generator().manual_seed(0)
    grads = [(0.5 + 0.25 * torch.randn(512, generator=gen)).bfloat16() for _ in range(60)]

    def run(compiled):
        p = bf16_param(seed=3)
        opt = torch.optim.SGD([p], lr=1e-3)

        def clip(optimizer, args, kwargs):
            with torch.no_grad():
                p.clamp_(-0.5, 0.5)

        opt.register_step_post_hook(clip)
        if compiled:
            collage_compile.compile_optimizer(opt, mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("error", collage_compile.CollageWarning)
            for g in grads:
                p.grad = g.clone()
                opt.step()
        return p

    start = bf16_param(seed=3).detach().double()
    ref = start.clone()
    for g in grads:
        ref = (ref - 1e-3 * g.double()).clamp(-0.5, 0.5)
    err = relative_error(mcf_value(run(True)), ref, start)
    plain_err = relative_error(run(False).detach().double(), ref, start)
    print(f"{mode}: collage {err:.2e}, plain bf16 {plain_err:.2e}")
    assert err <= 1e-3 and plain_err >= 25 * err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_foreach_subtraction_keeps_its_alpha(dtype):
    """torch 2.11's Inductor lowers ``_foreach_sub`` without its ``alpha``: schedule-free's
    ``torch._foreach_sub_(z, grads, alpha=lr)`` subtracted whole gradients, silently, and
    its foreach AdamW moved 16x as far as its float64 run, under plain Inductor too.  The
    backend spells it as ``_foreach_add`` of ``-alpha`` on Dynamo's graph
    (``passes/foreach_sub.py``; ``MUT=foreach_sub_kept``): fp32 tensors (a graph without
    pairs), bf16 optimizer state and bf16 weights (pairs) each move by ``alpha`` times
    their gradient, and no subtraction with an ``alpha`` reaches Inductor (2.13 lowers it
    right, so there the graph is what fails)."""
    g = torch.Generator().manual_seed(0)
    shapes = ((8, 4), (4,))
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    zs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    gs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    want = [p.detach().double() - 0.01 * d.double() for p, d in zip(ps, gs)]
    want += [z.double() - 0.001 * d.double() for z, d in zip(zs, gs)]
    kept = []

    def spy(gm, example_inputs):
        compiled = collage_compile.backend(gm, example_inputs)
        subs = (torch._foreach_sub, torch._foreach_sub_)
        kept.extend(n for n in gm.graph.nodes if n.target in subs and "alpha" in n.kwargs)
        return compiled

    @torch.no_grad()
    def step():
        torch._foreach_sub_(zs, gs, alpha=0.001)
        torch._foreach_sub_(ps, gs, alpha=0.01)

    torch.compile(step, backend=spy)()
    assert not kept
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    for t, w in zip([*ps, *zs], want):
        err = float((t.detach().double() - w).abs().max())
        assert err <= rtol * float(w.abs().max()), (err, dtype)


def test_a_forward_pass_scaled_by_its_size_is_left_to_inductor(monkeypatch):
    """Size arithmetic in a forward pass under dynamic shapes (``x * (1.0 / x.size(0))``)
    is not a hyperparameter: the float arithmetic the backend rebuilds as float64 tensors
    (so that 2.11 does not specialize a learning rate) must read a float input, or the
    forward graph gets float64 device work it never asked for
    (``MUT=size_arithmetic_mirrored``)."""
    from collage_compile.passes import scalars

    counts = []
    run = scalars.run
    monkeypatch.setattr(scalars, "run", lambda gm: counts.append(run(gm)) or counts[-1])
    f = torch.compile(
        lambda x: x * (1.0 / x.size(0)), backend=collage_compile.backend, dynamic=True
    )
    for n in (8, 16):
        x = torch.randn(n)
        assert torch.allclose(f(x), x / n)
    assert counts and not any(counts), counts
