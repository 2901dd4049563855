"""``mode="exact"`` around the step: plain Inductor without a schedule, lr = 0, conversions from
fp32 and from the other kind of lo, fp16, an EMA, metrics and ``explain()``.
(Every optimizer against the fp32 step: test_exact.py; checkpoints: test_checkpoint.py.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import collage_compile
from collage_compile import state

EXACT = {"mode": "exact"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.to(torch.bfloat16).to(dtype)  # the same (bf16) starting values in any dtype


def _grads(model: torch.nn.Module, k: int) -> None:
    g = torch.Generator().manual_seed(100 + k)
    for p in model.parameters():
        p.grad = (1e-2 * torch.randn(p.shape, generator=g)).to(torch.bfloat16).to(p.dtype)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_without_a_schedule_exact_is_plain_inductors_fp32_step(foreach):
    """A constant learning rate: plain Inductor compiles the fp32 step once, and the exact
    step equals it bit for bit (what the schedule test compares with the scalars pass)."""
    exact, fp32 = _model(torch.bfloat16), _model(torch.float32)
    opt_e = torch.optim.AdamW(exact.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
    opt_f = torch.optim.AdamW(fp32.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
    collage_compile.compile_optimizer(opt_e, **EXACT)
    step_f = torch.compile(opt_f.step, backend="inductor")
    light = _model(torch.bfloat16)
    opt_l = collage_compile.compile_optimizer(
        torch.optim.AdamW(light.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach)
    )
    for k in range(20):
        for m in (exact, fp32, light):
            _grads(m, k)
        opt_e.step()
        step_f()
        opt_l.step()
    for p, q, r in zip(exact.parameters(), fp32.parameters(), light.parameters()):
        assert torch.equal(_bits(collage_compile.value(p)), _bits(q))
        assert not torch.equal(_bits(collage_compile.value(r)), _bits(q))


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_a_warmup_from_lr_zero_updates_nothing_where_plain_inductor_writes_nan(foreach):
    """Hugging Face's warmups start at lr = 0.  Compiled fp32 AdamW divides 0 by -0.0 there
    (pytorch#126514: an element whose second moment is 0 becomes NaN); exact mode takes
    the refolded quotient only where the step size is 0 (passes/step_size.py), so its first
    step changes nothing, and every later step is the fp32 step's bits (test_exact.py)."""
    exact, fp32 = _model(torch.bfloat16), _model(torch.float32)
    before = [p.detach().clone() for p in exact.parameters()]
    opt_e = torch.optim.AdamW(exact.parameters(), lr=0.0, weight_decay=0.1, foreach=foreach)
    opt_f = torch.optim.AdamW(fp32.parameters(), lr=0.0, weight_decay=0.1, foreach=foreach)
    collage_compile.compile_optimizer(opt_e, **EXACT)
    step_f = torch.compile(opt_f.step, backend="inductor")
    for m in (exact, fp32):
        _grads(m, 0)
        with torch.no_grad():
            m[0].weight.grad[0].zero_()  # a row no token hit: its second moment stays 0
    opt_e.step()
    step_f()
    for p, b in zip(exact.parameters(), before):
        assert torch.equal(_bits(p), _bits(b)) and not collage_compile.value(p).isnan().any()
    if not foreach:
        assert fp32[0].weight[0].isnan().all()  # what the fix is for


def test_fp32_weights_convert_losslessly_and_set_value_holds_any_fp32_value():
    fp32 = _model(torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in fp32.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-4)  # low bits bf16 cannot hold
    original = [p.detach().clone() for p in fp32.parameters()]
    model = collage_compile.convert(fp32, torch.bfloat16, exact=True)
    for p, o in zip(model.parameters(), original):
        assert p.dtype == torch.bfloat16 and state.is_remainder(collage_compile.components(p)[1])
        assert torch.equal(_bits(collage_compile.value(p)), _bits(o))
        assert not torch.equal(_bits(p.float()), _bits(o))  # hi alone is not the value
    back = collage_compile.convert(model, torch.float32)
    for p, o in zip(back.parameters(), original):
        assert torch.equal(_bits(p), _bits(o))

    t = torch.zeros(5, dtype=torch.bfloat16)
    v = torch.tensor([1.0 + 2**-20, -3e-39, float("inf"), 65504.123, -(2**-149)])
    collage_compile.set_value(t, v, exact=True)
    assert torch.equal(_bits(collage_compile.value(t)), _bits(v))
    with pytest.raises(TypeError, match="bfloat16 only"):
        collage_compile.convert(_model(torch.float32), torch.float16, exact=True)


def test_a_pair_meets_an_exact_step_and_continues_from_its_value_with_a_warning():
    """The same parameters stepped in light mode, then by an exact step (a light
    checkpoint resumed in exact mode): the pair becomes a remainder holding hi + lo, named
    in a CollageWarning, and the way back converts as well."""
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    light = torch.compile(opt.step, backend=collage_compile.make_backend(mode="light"))
    for k in range(5):
        _grads(model, k)
        light()
    p = model[0].weight
    lo = collage_compile.components(p)[1]
    assert lo.dtype == torch.bfloat16 and lo.abs().max() > 0
    held = p.float() + lo.float()
    torch._dynamo.reset()
    exact = torch.compile(opt.step, backend=collage_compile.make_backend(**EXACT))
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    said = _collage_warnings(exact)
    assert said and all("exact remainder" in m and "same value" in m for m in said), said
    rem = collage_compile.components(p)[1]
    assert state.is_remainder(rem)
    # the pair's value, exactly (it fits in fp32 here: lo within 2^-16 of hi)
    assert torch.equal(_bits(collage_compile.value(p)), _bits(held))
    torch._dynamo.reset()
    back = torch.compile(opt.step, backend=collage_compile.make_backend(mode="light"))
    # the conversion, named once per tensor, and nothing else (no write from outside)
    said = _collage_warnings(back)
    assert said and all("pair's lo" in m for m in said), said
    assert collage_compile.components(p)[1].dtype == torch.bfloat16


def _collage_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in seen if issubclass(w.category, collage_compile.CollageWarning)]


def test_fp16_parameters_are_refused_naming_the_tensor():
    model = _model(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step, backend=collage_compile.make_backend(**EXACT))
    _grads(model, 0)
    with pytest.raises(Exception, match=r"(?s)mode='exact' holds bf16 tensors only.*float16"):
        step()
    with pytest.raises(ValueError, match="arithmetic"):
        collage_compile.make_backend(mode="exact", arithmetic="storage")


def test_an_ema_of_exact_weights_is_the_fp32_ema_of_the_fp32_weights():
    """``ema.lerp_(p, 1 - d)`` reads the parameter's fp32 value (its remainder is an input
    of the EMA's graph) and keeps the EMA's own: the fp32 run's EMA, bit for bit, where a
    bf16 EMA with d = 0.999 would not move."""
    runs = {}
    for dtype, backend in (
        (torch.bfloat16, collage_compile.make_backend(**EXACT)),
        (torch.float32, "inductor"),
    ):
        torch._dynamo.reset()
        model = _model(dtype)
        ema = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        step = torch.compile(opt.step, backend=backend)

        def update(ema, params):
            for e, p in zip(ema, params):
                e.lerp_(p, 0.001)

        update = torch.compile(update, backend=backend)
        for k in range(30):
            _grads(model, k)
            step()
            update(ema, list(model.parameters()))
        runs[dtype] = [collage_compile.value(e) if dtype == torch.bfloat16 else e for e in ema]
    for a, b in zip(runs[torch.bfloat16], runs[torch.float32]):
        assert torch.equal(_bits(a), _bits(b))
    # the same EMA in plain bf16, of the fp32 run's weights cast, hardly moves at d = 0.999
    start = [p.detach().float() for p in _model(torch.bfloat16).parameters()]
    moved = sum(float((b - s).norm() ** 2) for b, s in zip(runs[torch.float32], start)) ** 0.5
    plain = [s.to(torch.bfloat16) for s in start]
    torch._dynamo.reset()
    model = _model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for k in range(30):
        _grads(model, k)
        opt.step()
        for e, p in zip(plain, model.parameters()):
            e.lerp_(p.detach().to(torch.bfloat16), 0.001)
    plain_err = sum(float((e.float() - b).norm() ** 2) for e, b in zip(plain, runs[torch.float32]))
    print(f"plain bf16 EMA {plain_err**0.5 / moved:.2f} of its movement")
    assert plain_err**0.5 > 0.5 * moved


def test_metrics_and_explain_describe_an_exact_step():
    """EDQ of the value is fp32's: all of each update but fp32's own rounding of ``p + u``
    (2^-24 of the weight, here ~1e-5 of updates 1e-5 against weights 0.5: 8e-5 measured),
    hi alone shows part of the tiny updates, and ``explain()`` names every tensor
    upgraded in exact mode, the second moment included."""
    model = _model(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, foreach=True)
    collage_compile.compile_optimizer(opt, mode="exact", metrics=True)
    _grads(model, 0)
    explained = collage_compile.explain(opt.step)  # the graphs the first step compiles
    for k in range(1, 3):
        _grads(model, k)
        opt.step()
    m = collage_compile.last_metrics()
    print(m)
    assert abs(m["edq"] - 1.0) < 1e-3
    assert m["edq_hi"] < 0.5 and m["imprecision"] > 0.5
    assert 0 < m["lo_rel"] < 2**-8
    text = str(explained)
    assert "mode='exact'" in text and "yes (exact)" in text and "exp_avg_sq" in text
    rows = [e for g in explained.graphs for e in g.entries if e.dtype == "bfloat16"]
    assert len({e.tensor for e in rows}) == 3 * 4 and all(e.applied for e in rows)


def test_a_hand_written_step_pairs_the_tensors_it_is_passed():
    """Tensors passed in (not attributes): their remainders are registered by view."""
    ps = [torch.randn(64).to(torch.bfloat16) for _ in range(2)]
    ref = [p.float() for p in ps]
    plain = [p.clone() for p in ps]
    plain_end = [p.clone() for p in ps]

    def sgd(params, grads, lr):
        for p, g in zip(params, grads):
            p.add_(g, alpha=-lr)

    step = torch.compile(sgd, backend=collage_compile.make_backend(**EXACT))
    step32 = torch.compile(sgd, backend="inductor")
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        grads = [(1e-3 * torch.randn(64, generator=g)).to(torch.bfloat16) for _ in ps]
        step(ps, grads, 1e-2)
        step32(ref, [x.float() for x in grads], 1e-2)
        sgd(plain_end, grads, 1e-2)
    start = [p.float() for p in plain]
    for p, r in zip(ps, ref):
        assert torch.equal(_bits(collage_compile.value(p)), _bits(r))
        assert not torch.equal(_bits(p.float()), _bits(r))
    # plain bf16 on the same stream keeps little of its updates (about 1e-5 against 1)
    moved = sum(float((r - s).norm() ** 2) for r, s in zip(ref, start)) ** 0.5
    err = sum(float((q.float() - r).norm() ** 2) for q, r in zip(plain_end, ref)) ** 0.5
    print(f"plain bf16 hand-written SGD {err / moved:.2f} of its movement")
    assert err > 0.5 * moved
