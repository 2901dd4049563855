"""Each accumulation spelling the pattern families claim, in a hand-written compiled update.

Every case runs 200 steps on bf16 weights N(0, 0.5^2) with updates of ~2^-10 of the weights
(below half a bf16 ulp: plain bf16 drops them), compares hi + lo with the same update stream
accumulated in float64, and requires plain bf16 (the same function run eagerly) to be at least
25x worse.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import mcf_value, relative_error

import collage_compile

LR = 1e-3
N = 512


def _add(p, g, t):
    p.add_(g, alpha=-LR)


def _sub(p, g, t):
    p.sub_(g, alpha=LR)


def _iadd(p, g, t):
    p += g * -LR


def _addcdiv(p, g, t):
    p.addcdiv_(g, torch.full_like(g, 2.0), value=-2 * LR)


def _addcmul(p, g, t):
    p.addcmul_(g, torch.full_like(g, 0.5), value=-2 * LR)


def _lerp(p, g, t):
    p.lerp_(t, 5e-4)


def _decay_then_add(p, g, t):
    p.mul_(1 - 1e-3)
    p.add_(g, alpha=-LR)


def _div_decay(p, g, t):
    p.div_(1 + 1e-3)


def _copy_expr(p, g, t):
    p.copy_(p * (1 - 1e-3) - g * LR)


def _copy_fma(p, g, t):
    p.copy_(torch.ops.prims.fma.default(g, -LR, p))


def _copy_via_fp32(p, g, t):
    # the "upcast, update, cast back" spelling of a hand-written optimizer
    p.copy_((p.float() - LR * g.float()).to(p.dtype))


def _copy_wd_reads_p(p, g, t):
    # both sides of the sum read p: the walk takes p as the path, p*1e-3 as an operand
    p.copy_(p - LR * (g + 1e-3 * p))


def _mul_then_copy(p, g, t):
    # ASGD(foreach=False): the copy_'s source reads p after the decay wrote it
    p.mul_(1 - 1e-3)
    p.copy_(torch.ops.prims.fma.default(g, -LR, p))


def _div_tensor(p, g, t):
    p.div_(torch.full(g.shape, 1 + 1e-3))  # an fp32 divisor: bf16 would round it to 1


def _aten_add(p, g, t):
    torch.ops.aten.add_.Tensor(p, g, alpha=-LR)


def _aten_foreach_add(p, g, t):
    torch.ops.aten._foreach_add_.List([p], [g], alpha=-LR)


def _data_add(p, g, t):
    p.data.add_(g, alpha=-LR)


def _foreach_add(p, g, t):
    torch._foreach_add_([p], [g], alpha=-LR)


def _add_one_scaled_difference(p, g, t):
    # one element of (t - p) * w, added to every weight: no lerp (a lerp is element-wise)
    p.add_(((t - p) * 5e-4)[0])


def _foreach_lerp(p, g, t):
    torch._foreach_lerp_([p], [t], 5e-4)


def _foreach_mul_add(p, g, t):
    torch._foreach_mul_([p], 1 - 1e-3)
    torch._foreach_addcmul_([p], [g], [torch.ones_like(g)], value=-LR)


# float64 references of the update each case spells
def _working_copy(p, g, t):
    # the step on an fp32 copy, copied back (Hugging Face's Adafactor, timm's AdaBelief)
    p_fp32 = p.float()
    p_fp32.mul_(1 - 1e-3)
    p_fp32.add_(g.float(), alpha=-LR)
    p.copy_(p_fp32)


def _working_copy_set(p, g, t):
    # Dynamo's spelling of addcdiv_ with a symbolic value: fma, then a copy_ into the copy
    p_fp32 = p.to(torch.float32)
    p_fp32.copy_(p_fp32 - LR * g.float())
    p.copy_(p_fp32)


def _sgd(p, g, t):
    return p - LR * g


def _decayed_sgd(p, g, t):
    return p * (1 - 1e-3) - LR * g


def _ema(p, g, t):
    return p + 5e-4 * (t - p)


def _divided(p, g, t):
    return p / (1 + 1e-3)


def _clamp(p, g, t):
    p.add_(g, alpha=-LR)
    p.clamp_(-0.5, 0.5)


def _clamp_keywords(p, g, t):
    p.sub_(g, alpha=LR)
    p.clamp_(max=t.abs())  # a tensor bound, one side


def _foreach_clamp(p, g, t):
    torch._foreach_add_([p], [g], alpha=-LR)
    torch._foreach_clamp_min_([p], -0.5)
    torch._foreach_clamp_max_([p], 0.5)


def _copy_clamp(p, g, t):
    p.copy_((p - LR * g).clamp(-0.5, 0.5))


def _clamped_sgd(p, g, t):
    return (p - LR * g).clamp(-0.5, 0.5)


CASES = {
    "add_": (_add, _sgd),
    "sub_": (_sub, _sgd),
    "+=": (_iadd, _sgd),
    "addcdiv_": (_addcdiv, _sgd),
    "addcmul_": (_addcmul, _sgd),
    "lerp_": (_lerp, _ema),
    "mul_+add_": (_decay_then_add, _decayed_sgd),
    "div_": (_div_decay, _divided),
    "copy_(p*c-u)": (_copy_expr, _decayed_sgd),
    "copy_(fma)": (_copy_fma, _sgd),
    "copy_(fp32 round trip)": (_copy_via_fp32, _sgd),
    "copy_(p - lr*(g + wd*p))": (_copy_wd_reads_p, lambda p, g, t: p - LR * (g + 1e-3 * p)),
    "mul_+copy_(fma)": (_mul_then_copy, _decayed_sgd),
    "div_(tensor)": (_div_tensor, _divided),
    "aten.add_.Tensor": (_aten_add, _sgd),
    "aten._foreach_add_.List": (_aten_foreach_add, _sgd),
    "p.data.add_": (_data_add, _sgd),
    "_foreach_add_": (_foreach_add, _sgd),
    "_foreach_lerp_": (_foreach_lerp, _ema),
    "add_(((t - p) * w)[0])": (
        _add_one_scaled_difference,
        lambda p, g, t: p + 5e-4 * (t[0] - p[0]),
    ),
    "_foreach_mul_+addcmul_": (_foreach_mul_add, _decayed_sgd),
    # a weight constraint after the update: a maximum and a minimum of the pair's value
    "add_+clamp_": (_clamp, _clamped_sgd),
    "sub_+clamp_(max=tensor)": (_clamp_keywords, lambda p, g, t: (p - LR * g).clamp(max=t.abs())),
    "_foreach_clamp_min_+max_": (_foreach_clamp, _clamped_sgd),
    "copy_(clamp(p - lr*g))": (_copy_clamp, _clamped_sgd),
    "working_copy(mul_+add_)": (_working_copy, _decayed_sgd),
    "working_copy(copy_)": (_working_copy_set, _sgd),
}


def _run(fn, backend, steps=200):
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(N, generator=gen) * 0.5).bfloat16())
    target = (torch.randn(N, generator=gen) * 0.5).bfloat16()
    start = p.detach().double().clone()
    step = torch.compile(fn, backend=backend) if backend is not None else fn
    grads = [(0.5 + 0.25 * torch.randn(N, generator=gen)).bfloat16() for _ in range(steps)]
    with torch.no_grad(), warnings.catch_warnings():
        # every spelling is upgraded: none may be reported as "not upgraded"
        warnings.simplefilter("error", collage_compile.CollageWarning)
        for g in grads:
            step(p, g, target)
    return p, start, grads, target


@pytest.mark.parametrize("name", list(CASES))
def test_every_accumulation_spelling_is_upgraded(name):
    fn, exact = CASES[name]
    p, start, grads, target = _run(fn, collage_compile.backend)
    ref = start.clone()
    for g in grads:
        ref = exact(ref, g.double(), target.double())
    plain, *_ = _run(fn, None)
    err = relative_error(mcf_value(p), ref, start)
    plain_err = relative_error(plain.detach().double(), ref, start)
    print(f"{name}: collage {err:.2e}, plain bf16 {plain_err:.2e}")
    assert err <= 0.02
    assert plain_err >= 25 * err
