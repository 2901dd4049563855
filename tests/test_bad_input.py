"""Unusual and bad input: each gets a defined answer (upgraded correctly, left alone with a
reason, or an error), never silent precision loss or lost state."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import mcf_value, relative_error

import collage_compile
from collage_compile import state


def _sgd_stream(p: torch.nn.Parameter, steps: int, lr: float, mean: float, std: float):
    """(compiled collage SGD on p, float64 reference, eager plain copy, start)."""
    opt = torch.optim.SGD([p], lr=lr)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    ref = p.detach().double().clone()
    plain = p.detach().clone()
    start = ref.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grad = (mean + std * torch.randn(p.shape, generator=g)).to(p.dtype)
        p.grad = grad
        step()
        ref.add_(grad.double(), alpha=-lr)
        plain.add_(grad, alpha=-lr)
    return ref, plain, start


@pytest.mark.parametrize("scale", [0.5, 2e-3], ids=["normal", "subnormal_lo"])
def test_fp16_parameters_are_carried_as_fp16_pairs(scale):
    """fp16 pairs: same arithmetic, fp16's formats (11 bits, max 65504, subnormals below
    2^-14).  With weights ~2e-3 every lo is subnormal, rounded to its fixed quantum 2^-24
    (round_to's subnormal branch): updates of 2e-7 (3 quanta) are still kept, where plain
    fp16 (ulp 2^-19 there) loses them all.  Updates below half a quantum (3e-8 absolute)
    are beyond an fp16 pair at any weight scale."""
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter((scale * torch.randn(2048, generator=g)).to(torch.float16))
    ref, plain, start = _sgd_stream(p, 100, 2e-5 if scale < 0.1 else 1e-3 * scale, 0.01, 0.005)
    lo = state.get_lo(p)
    assert lo.dtype == torch.float16
    err = relative_error(mcf_value(p), ref, start)
    plain_err = relative_error(plain.double(), ref, start)
    print(f"fp16 weights ~{scale}: collage {err:.2e}  plain fp16 {plain_err:.2f}")
    assert plain_err > 0.5
    assert err < (0.01 if scale > 0.1 else 0.05)
    if scale < 0.1:
        assert (lo.abs() < 2.0**-14).all()  # every lo subnormal


def test_grad_scaler_skipped_steps_leave_hi_and_lo_untouched():
    """``torch.amp.GradScaler`` with a compiled collage ``opt.step``: steps with Inf
    gradients are skipped (hi and lo bit-identical), the others follow float64.  fp16
    parameters: GradScaler itself refuses fp16 gradients, with or without collage."""
    model = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    (p,) = model.parameters()
    opt = torch.optim.SGD([p], lr=1e-3)
    opt.step = torch.compile(opt.step, backend=collage_compile.backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref = p.detach().double().clone()
    start = ref.clone()
    plain = p.detach().clone()  # the same applied steps in eager bf16
    g = torch.Generator().manual_seed(0)
    skipped = 0
    for k in range(30):
        grad = (0.01 + 0.005 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
        if k % 7 == 3:
            grad[0, 0] = float("inf")
        opt.zero_grad()
        # d(sum(w * grad))/dw = grad, scaled by the scaler
        scaler.scale((p * grad).sum()).backward()
        before = (p.detach().clone(), None if k == 0 else state.get_lo(p).clone())
        scaler.step(opt)
        scaler.update()
        if k % 7 == 3:
            skipped += 1
            assert torch.equal(p.detach(), before[0])
            assert torch.equal(state.get_lo(p), before[1])
        else:
            ref.add_(grad.double(), alpha=-1e-3)
            plain.add_(grad, alpha=-1e-3)
    assert skipped == 4
    err = relative_error(mcf_value(p), ref, start)
    plain_err = relative_error(plain.double(), ref, start)
    print(f"GradScaler bf16: collage {err:.2e}  plain bf16 {plain_err:.2f}")
    assert err < 0.02 and plain_err > 0.5

    half = torch.nn.Linear(4, 4).half()
    opt16 = torch.optim.SGD(half.parameters(), lr=1e-3)
    opt16.step = torch.compile(opt16.step, backend=collage_compile.backend)
    scaler16 = torch.amp.GradScaler("cpu")
    scaler16.scale(half(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        scaler16.step(opt16)


def test_params_without_grad_and_frozen_params_are_left_alone():
    """In one optimizer: a parameter whose grad is None this step and a frozen one are not
    touched and get no lo; the others are upgraded."""
    live, nograd = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16)), None
    nograd = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16), requires_grad=False)
    opt = torch.optim.AdamW([live, nograd, frozen], lr=1e-5, weight_decay=0.01)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    ref = torch.nn.Parameter(live.detach().double().clone())
    start = ref.detach().clone()
    ref_opt = torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.01)
    plain = torch.nn.Parameter(live.detach().clone())  # the same AdamW in eager bf16
    plain_opt = torch.optim.AdamW([plain], lr=1e-5, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        live.grad = (0.01 + 0.005 * torch.randn(64, generator=g)).to(torch.bfloat16)
        ref.grad, plain.grad = live.grad.double(), live.grad.clone()
        step()
        ref_opt.step()
        plain_opt.step()
    assert torch.equal(nograd.detach(), torch.ones_like(nograd))
    assert torch.equal(frozen.detach(), torch.ones_like(frozen))
    assert collage_compile.components(nograd)[1] is None
    assert collage_compile.components(frozen)[1] is None
    # light mode keeps AdamW's moments in bf16: a few percent off float64's
    assert relative_error(mcf_value(live), ref.detach(), start) < 0.05
    assert relative_error(plain.detach().double(), ref.detach(), start) > 0.9


def test_complex_and_sparse_parameters_are_left_alone_with_a_warning():
    """complex32 (a pair is real-valued) and sparse gradients (Dynamo does not trace them)
    run as written, with one warning each naming the parameter; complex64 is not low
    precision and is left alone silently, as fp32 is."""
    c32 = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64).to(torch.complex32))
    c64 = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    opt = torch.optim.SGD([c32, c64], lr=1e-3)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    # as written: the same step in eager complex32 arithmetic (each real part moves by
    # about one fp16 ulp, 2^-10 near 1), and exactly in complex64
    c32_start = c32.detach().clone()
    eager = c32_start.clone().add_(torch.ones(4, dtype=torch.complex32), alpha=-1e-3)
    expected = c64.detach() - 1e-3
    c32.grad = torch.ones(4, dtype=torch.complex32)
    c64.grad = torch.ones(4, dtype=torch.complex64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step()
        step_again = [str(w.message) for w in caught]
    msgs = [m for m in step_again if "collage" in m]
    assert len(msgs) == 1 and "params[0] (4,) is complex32" in msgs[0]
    assert collage_compile.components(c32)[1] is None
    assert collage_compile.components(c64)[1] is None
    moved = c32.detach().cfloat() - c32_start.cfloat()
    print(f"complex32 step: moved by {moved.real.tolist()}")
    c32_bits, eager_bits = c32.detach().view(torch.float16), eager.view(torch.float16)
    assert torch.equal(c32_bits, eager_bits), "the complex32 weight is not the eager step's"
    assert (moved.real < 0).all() and (moved.imag == 0).all()
    assert torch.allclose(c64.detach(), expected)

    emb = torch.nn.Embedding(10, 4, sparse=True).to(torch.bfloat16)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.warns(collage_compile.CollageWarning, match=r"\(10, 4\) has a sparse gradient"):
        step()
    assert not torch.equal(emb.weight[1], before[1]) and torch.equal(emb.weight[0], before[0])


@pytest.mark.parametrize("arithmetic", ["fp32", "storage"])
def test_inf_and_nan_updates_behave_like_plain_arithmetic(arithmetic):
    """An Inf update gives the weight Inf (not NaN, which inf - inf in the error terms
    would give), a NaN update gives NaN, and the other elements are unaffected."""
    p = torch.nn.Parameter(torch.ones(6, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1.0)
    backend = collage_compile.make_backend(arithmetic=arithmetic)
    step = torch.compile(opt.step, backend=backend)
    inf, nan = float("inf"), float("nan")
    p.grad = torch.tensor([inf, -inf, nan, 1e-4, 0.0, 1e-4], dtype=torch.bfloat16)
    plain = p.detach() - p.grad
    step()
    assert torch.equal(p.detach()[:2], plain[:2])  # -inf, +inf
    assert p[2].isnan()
    lo = state.get_lo(p)
    assert torch.equal(lo[:2], torch.zeros(2, dtype=torch.bfloat16))
    assert abs(mcf_value(p)[3].item() - (1 - 1e-4)) < 1e-6
    assert plain[3].item() == 1.0  # what plain bf16 gives: the update is lost
    assert mcf_value(p)[4].item() == 1.0


@pytest.mark.parametrize("kind", ["empty", "zero_dim", "transposed", "channels_last"])
def test_unusual_shapes_and_layouts_are_upgraded(kind):
    """Empty and 0-dim parameters, a transposed (non-contiguous) one and a channels-last
    conv weight: upgraded, lo laid out like its tensor, numerics against float64."""
    g = torch.Generator().manual_seed(0)
    if kind == "empty":
        p = torch.nn.Parameter(torch.ones(0, 3, dtype=torch.bfloat16))
    elif kind == "zero_dim":
        p = torch.nn.Parameter(torch.tensor(0.75, dtype=torch.bfloat16))
    elif kind == "transposed":
        p = torch.nn.Parameter((0.5 * torch.randn(48, 32, generator=g)).to(torch.bfloat16).t())
    else:
        conv = torch.nn.Conv2d(8, 16, 3).to(torch.bfloat16, memory_format=torch.channels_last)
        p = conv.weight
        with torch.no_grad():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    ref, plain, start = _sgd_stream(p, 60, 1e-3, 0.01, 0.005)
    lo = state.get_lo(p)
    assert lo is not None and lo.shape == p.shape and lo.stride() == p.stride()
    if kind == "empty":
        assert p.numel() == 0
        return
    err = relative_error(mcf_value(p), ref, start)
    plain_err = relative_error(plain.double(), ref, start)
    print(f"{kind}: collage {err:.2e}  plain bf16 {plain_err:.2f}")
    assert err < 0.02 and plain_err > 0.5
