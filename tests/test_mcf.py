"""MCF arithmetic against exact rationals (float64 and fractions), eager and compiled.

Every compiled check runs the *same* plain torch function through Inductor and requires the
result bit-identical to eager: the roundings MCF depends on survived compilation.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import collage_compile
from collage_compile import mcf

N = 16  # every hypothesis example is a tensor of N elements: one compiled graph per function
DTYPES = [torch.bfloat16, torch.float16]
# The default run (CI) checks a fixed, derandomized sample; a wider random search:
#   COLLAGE_HYPOTHESIS_EXAMPLES=3000 python -m pytest tests/test_mcf.py
_EXAMPLES = os.environ.get("COLLAGE_HYPOTHESIS_EXAMPLES")
SETTINGS = settings(
    max_examples=int(_EXAMPLES or 60),
    derandomize=_EXAMPLES is None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def _t(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def _frac(x: torch.Tensor) -> list[Fraction]:
    return [Fraction(v) for v in x.double().tolist()]


def _ulp(x: float, dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    ax = max(abs(x), info.smallest_normal)
    return 2.0 ** math.floor(math.log2(ax)) * info.eps


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        return False
    view = torch.int16 if a.element_size() == 2 else torch.int32
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(view) == b.view(view)) | both_nan).all())


_compiled: dict[str, object] = {}


def compiled(name: str, fn):
    """One compiled version of ``fn`` per test module (static shape N)."""
    if name not in _compiled:
        _compiled[name] = torch.compile(
            fn, dynamic=False, backend="inductor", options=collage_compile.inductor_options()
        )
    return _compiled[name]


@pytest.fixture(autouse=True)
def _fresh_state():  # override conftest: keep compiled functions across examples
    yield


# ---- rounding ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_to_equals_a_cast_for_every_kind_of_fp32_input(dtype):
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            65504.0,
            65519.9,
            65520.0,
            -65520.0,
            3.3895e38,
            3.4e38,
            1e-40,
            -1e-45,
            6e-8,
            2.98e-8,
            2.0**-24,
            2.0**-25,
        ],
        dtype=torch.float32,
    )
    # exact ties between neighbouring storage values, and their neighbours
    grid = torch.linspace(-100, 100, 4001).to(dtype)
    nxt = torch.nextafter(grid, torch.full_like(grid, math.inf)).float()
    mid = (grid.float() + nxt) / 2
    ties = torch.cat([mid, torch.nextafter(mid, mid * 2), torch.nextafter(mid, mid * 0)])
    x = torch.cat([x, special, ties])
    ref = x.to(dtype).float()
    for round_fn in (mcf.round_to, mcf.round_to_float_ops):
        assert _same_bits(round_fn(x, dtype), ref), round_fn.__name__
        fn = torch.compile(
            lambda v, f=round_fn: f(v, dtype),
            dynamic=False,
            options=collage_compile.inductor_options(),
        )
        assert _same_bits(fn(x), ref), f"compiled {round_fn.__name__} differs from a cast"


@SETTINGS
@given(st.lists(f32, min_size=N, max_size=N), st.sampled_from(DTYPES))
def test_round_to_property_matches_cast_eager_and_compiled(values, dtype):
    x = _t(values)
    ref = x.to(dtype).float()
    assert _same_bits(mcf.round_to(x, dtype), ref)
    fn = compiled(f"round_{dtype}", lambda v, d=dtype: mcf.round_to(v, d))
    assert _same_bits(fn(x), ref)


# ---- error-free transformations ------------------------------------------------------------


@SETTINGS
@given(st.lists(st.tuples(f32, f32), min_size=N, max_size=N))
def test_two_sum_is_exact(pairs):
    a = _t([p[0] for p in pairs])
    b = _t([p[1] for p in pairs])
    assume(torch.isfinite(a + b).all())
    s, e = mcf.two_sum(a, b)
    cs, ce = compiled("two_sum", mcf.two_sum)(a, b)
    assert _same_bits(s, cs) and _same_bits(e, ce)
    assert _same_bits(s, a + b)
    for si, ei, ai, bi in zip(_frac(s), _frac(e), _frac(a), _frac(b)):
        assert si + ei == ai + bi


@SETTINGS
@given(st.lists(st.tuples(f32, f32), min_size=N, max_size=N))
def test_fast2sum_is_exact_when_the_first_operand_dominates(pairs):
    a = _t([max(p, key=abs) for p in pairs])
    b = _t([min(p, key=abs) for p in pairs])
    assume(torch.isfinite(a + b).all())
    s, e = mcf.fast2sum(a, b)
    for si, ei, ai, bi in zip(_frac(s), _frac(e), _frac(a), _frac(b)):
        assert si + ei == ai + bi


small_normal = st.floats(min_value=2.0**-60, max_value=2.0**60, width=32) | st.floats(
    min_value=-(2.0**60), max_value=-(2.0**-60), width=32
)


@SETTINGS
@given(st.lists(st.tuples(small_normal, small_normal), min_size=N, max_size=N))
def test_two_prod_is_exact_without_fma(pairs):
    a = _t([p[0] for p in pairs])
    b = _t([p[1] for p in pairs])
    p, e = mcf.two_prod(a, b)
    cp, ce = compiled("two_prod", mcf.two_prod)(a, b)
    assert _same_bits(p, cp) and _same_bits(e, ce)
    for pi, ei, ai, bi in zip(_frac(p), _frac(e), _frac(a), _frac(b)):
        assert pi + ei == ai * bi


@SETTINGS
@given(st.floats(min_value=-6e4, max_value=6e4), st.sampled_from(DTYPES))
@example(0.003543474458297307, torch.float16)  # lo falls in fp16's subnormal range
def test_split_constant_is_computed_in_float64(c, dtype):
    assume(c == 0 or abs(c) > 1e-3)
    hi, lo = mcf.split_constant(c, dtype)
    assert hi == torch.tensor(c, dtype=torch.float64).to(dtype).item()
    assert lo == torch.tensor(c - hi, dtype=torch.float64).to(dtype).item()
    # two storage components hold ~2p bits (far better than the head alone), down to the
    # subnormal spacing where lo is below the smallest normal (fp16: 2^-24)
    info = torch.finfo(dtype)
    p = 8 if dtype == torch.bfloat16 else 11
    assert abs((hi + lo) - c) <= abs(c) * 2.0 ** (-2 * p + 1) + info.smallest_normal * info.eps / 2


def test_split_constant_refuses_a_constant_outside_the_storage_range():
    with pytest.raises(OverflowError):
        mcf.split_constant(1e5, torch.float16)


def test_split_constant_keeps_the_decay_that_bf16_rounds_away():
    hi, lo = mcf.split_constant(0.999, torch.bfloat16)
    assert hi == 1.0 and lo != 0.0
    assert abs(hi + lo - 0.999) < 1e-6


# ---- pairs -----------------------------------------------------------------------------------


def _pairs(draw_values, dtype):
    """A normalized storage pair (|lo| <= ulp(hi)/2) from drawn fp32 values."""
    hi = _t([v[0] for v in draw_values], dtype)
    frac = torch.tensor([v[1] for v in draw_values], dtype=torch.float64)
    ulps = torch.tensor([_ulp(h, dtype) for h in hi.double().tolist()], dtype=torch.float64)
    lo = (frac * ulps / 2).to(dtype)
    return hi, lo


weights = st.floats(min_value=-64, max_value=64, width=32)
fractions = st.floats(min_value=-1, max_value=1)
updates = st.floats(min_value=-1, max_value=1, width=32)


def _exact_error_bound(h2: torch.Tensor, l2: torch.Tensor, dtype, scale: list[float]):
    out = []
    for hv, lv, sv in zip(h2.double().tolist(), l2.double().tolist(), scale):
        # bf16 below 2^-126: hi is rounded to 8 bits, not to the subnormal grid (mcf.split_round)
        sub = 2.0**-133 if dtype == torch.bfloat16 else 0.0
        out.append(
            0.5 * _ulp(lv, dtype) + 2.0**-22 * max(abs(lv), _ulp(hv, dtype) * 2.0**-8, sv) + sub
        )
    return out


@SETTINGS
@given(
    st.lists(st.tuples(weights, fractions), min_size=N, max_size=N),
    st.lists(updates, min_size=N, max_size=N),
    st.integers(min_value=0, max_value=30),
    st.sampled_from(DTYPES),
)
def test_grow_fp32_keeps_every_bit_the_pair_can_hold(hl, us, shift, dtype):
    hi, lo = _pairs(hl, dtype)
    u = _t(us) * 2.0**-shift  # updates from comparable to ~1e-9 of the weight
    h2, l2 = mcf.grow(hi, lo, u, "fp32")
    ch2, cl2 = compiled(f"grow_fp32_{dtype}", lambda a, b, c: mcf.grow(a, b, c, "fp32"))(hi, lo, u)
    assert _same_bits(h2, ch2) and _same_bits(l2, cl2), "compiled Grow lost a rounding"
    exact = [a + b + c for a, b, c in zip(_frac(hi), _frac(lo), _frac(u))]
    got = [a + b for a, b in zip(_frac(h2), _frac(l2))]
    bounds = _exact_error_bound(h2, l2, dtype, [abs(float(v)) for v in lo.double().tolist()])
    for g, x, bound in zip(got, exact, bounds):
        assert abs(float(g - x)) <= bound
    # hi is the storage value nearest to the pair's value, lo the rest
    for hv, lv in zip(h2.double().tolist(), l2.double().tolist()):
        assert abs(lv) <= 0.5 * _ulp(hv, dtype) * (1 + 2.0**-7)


@SETTINGS
@given(
    st.lists(st.tuples(weights, fractions), min_size=N, max_size=N),
    st.lists(updates, min_size=N, max_size=N),
    st.integers(min_value=0, max_value=20),
)
def test_grow_storage_is_the_papers_sequence_op_by_op_in_eager_bf16(hl, us, shift):
    dtype = torch.bfloat16
    hi, lo = _pairs(hl, dtype)
    u = (_t(us) * 2.0**-shift).to(dtype)
    # the paper's Grow, each operation an eager bf16 op
    s = hi + u
    r = lo + (u - (s - hi))
    a = s + r
    r = r - (a - s)
    h2, l2 = mcf.grow(hi, lo, u.float(), "storage")
    assert _same_bits(h2, a) and _same_bits(l2, r)
    ch2, cl2 = compiled("grow_storage", lambda x, y, z: mcf.grow(x, y, z.float(), "storage"))(
        hi, lo, u
    )
    assert _same_bits(ch2, a) and _same_bits(cl2, r), "compiled storage Grow is not eager bf16"


decays = st.floats(min_value=0.5, max_value=1.0, exclude_max=True)


@SETTINGS
@given(
    st.lists(st.tuples(weights, fractions), min_size=N, max_size=N), decays, st.sampled_from(DTYPES)
)
def test_mul_fp32_is_an_expansion_product(hl, c, dtype):
    hi, lo = _pairs(hl, dtype)
    h2, l2 = mcf.mul(hi, lo, c, "fp32")
    exact = [(a + b) * Fraction(c) for a, b in zip(_frac(hi), _frac(lo))]
    got = [a + b for a, b in zip(_frac(h2), _frac(l2))]
    bounds = _exact_error_bound(h2, l2, dtype, [abs(v) for v in hi.double().tolist()])
    for g, x, bound in zip(got, exact, bounds):
        assert abs(float(g - x)) <= bound


def test_mul_decays_a_value_that_plain_bf16_leaves_unchanged():
    hi = torch.full((N,), 1.0, dtype=torch.bfloat16)
    lo = torch.zeros_like(hi)
    plain = hi.clone()
    for _ in range(100):
        hi, lo = mcf.mul(hi, lo, 0.9999, "fp32")
        plain.mul_(0.9999)
    assert torch.equal(plain, torch.ones_like(plain))  # bf16 never decays
    value = (hi.double() + lo.double())[0].item()
    assert abs(value - 0.9999**100) < 0.01 * (1 - 0.9999**100)  # 1 % of the decay


@SETTINGS
@given(st.lists(st.tuples(weights, fractions), min_size=N, max_size=N), decays)
def test_mul_storage_is_alias_free_multmc_in_eager_bf16(hl, c):
    dtype = torch.bfloat16
    hi, lo = _pairs(hl, dtype)
    c_hi, c_lo = mcf.split_constant(c, dtype)
    vm, vr = torch.tensor(c_hi, dtype=dtype), torch.tensor(c_lo, dtype=dtype)
    # the reference's MultMC with its aliasing removed, op by op in eager bf16
    p = hi * vm
    err = torch.addcmul(-p, hi, vm)
    r = (lo * vm).addcmul(hi, vr).add(err)
    a = p + r
    r = r - (a - p)
    h2, l2 = mcf.mul(hi, lo, c, "storage")
    assert _same_bits(h2, a) and _same_bits(l2, r)


@SETTINGS
@given(
    st.lists(st.tuples(weights, weights), min_size=N, max_size=N),
    st.sampled_from(["fp32", "storage"]),
)
def test_renormalize_restores_the_pair_invariant(vals, arithmetic):
    dtype = torch.bfloat16
    hi = _t([v[0] for v in vals], dtype)
    lo = (_t([v[1] for v in vals]) * 2.0**-6).to(dtype)  # deliberately not normalized
    h2, l2 = mcf.renormalize(hi, lo, arithmetic)
    for hv, lv, a, b in zip(h2.double().tolist(), l2.double().tolist(), _frac(hi), _frac(lo)):
        assert abs(lv) <= 0.5 * _ulp(hv, dtype) * (1 + 2.0**-7)
        assert abs(float(Fraction(hv) + Fraction(lv) - (a + b))) <= _ulp(
            lv, dtype
        ) + 2.0**-24 * abs(hv)


@pytest.mark.parametrize("arithmetic", ["fp32", "storage"])
def test_inf_and_nan_updates_behave_like_plain_arithmetic(arithmetic):
    hi = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.bfloat16)
    lo = torch.tensor([2.0**-10, 0.0, -(2.0**-9), 0.0], dtype=torch.bfloat16)
    u = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    h2, l2 = mcf.grow(hi, lo, u, arithmetic)
    plain = (hi.float() + u).bfloat16()
    assert _same_bits(h2[:3], plain[:3])
    assert torch.equal(l2[:3], torch.zeros(3, dtype=torch.bfloat16))
    assert torch.isfinite(h2[3]) and torch.isfinite(l2[3])


divisors = st.floats(min_value=0.5, max_value=2.0, width=32)


@SETTINGS
@given(
    st.lists(st.tuples(weights, fractions), min_size=N, max_size=N),
    st.lists(divisors, min_size=N, max_size=N),
    st.sampled_from(DTYPES),
    st.sampled_from(["fp32", "storage"]),
)
def test_division_by_a_tensor_is_carried_by_the_pair(hl, ds, dtype, arithmetic):
    """(hi, lo) / d for an fp32 tensor d, divided directly (no reciprocal), eager ==
    compiled.  fp32 arithmetic keeps every bit the pair holds; storage arithmetic rounds each
    of its few operations to the storage dtype, so its lo is good to a few of its own ulps."""
    from collage_compile.rewrite import mcf_chain

    hi, lo = _pairs(hl, dtype)
    d = _t(ds)

    def div(a, b, c):
        return mcf_chain(a, b, [("div", (c,), None)], arithmetic, dtype)

    h2, l2 = div(hi, lo, d)
    ch2, cl2 = compiled(f"div_{arithmetic}_{dtype}", div)(hi, lo, d)
    assert _same_bits(h2, ch2) and _same_bits(l2, cl2), "compiled division lost a rounding"
    exact = [(a + b) / c for a, b, c in zip(_frac(hi), _frac(lo), _frac(d))]
    got = [a + b for a, b in zip(_frac(h2), _frac(l2))]
    if arithmetic == "fp32":
        bounds = _exact_error_bound(h2, l2, dtype, [abs(float(x)) for x in exact])
    else:
        bounds = [
            4 * _ulp(lv, dtype) + _ulp(hv, dtype) * 2.0**-7
            for hv, lv in zip(h2.double().tolist(), l2.double().tolist())
        ]
    for g, x, bound in zip(got, exact, bounds):
        assert abs(float(g - x)) <= bound
    # far better than hi alone (down to the subnormal spacing, below which lo holds nothing)
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    for g, x, hv in zip(got, exact, h2.double().tolist()):
        assert abs(float(g - x)) <= 2.0**-5 * _ulp(hv, dtype) + tiny


@SETTINGS
@given(
    st.lists(st.tuples(weights, fractions), min_size=N, max_size=N),
    st.lists(st.sampled_from(["hi", "above", "below", "free"]), min_size=N, max_size=N),
    st.lists(weights, min_size=N, max_size=N),
    st.sampled_from(DTYPES),
    st.sampled_from(["fp32", "storage"]),
    st.sampled_from(["max", "min"]),
)
def test_a_bound_compares_the_whole_pair_and_is_exact(hl, where, free, dtype, arithmetic, kind):
    """max((hi, lo), y) and min((hi, lo), y) for a storage value y, eager == compiled:
    exactly max(hi + lo, y) (min), also where y equals hi (only lo's sign decides) or is
    its neighbour; y wins with lo 0."""
    from collage_compile.rewrite import mcf_chain

    hi, lo = _pairs(hl, dtype)
    step = {"hi": 0.0, "above": 1.0, "below": -1.0}
    ys = [
        h + step[w] * _ulp(h, dtype) if w in step else f
        for h, w, f in zip(hi.double().tolist(), where, free)
    ]
    y = _t(ys, dtype)

    def bound(a, b, c):
        return mcf_chain(a, b, [(kind, (c,), None)], arithmetic, dtype)

    h2, l2 = bound(hi, lo, y)
    ch2, cl2 = compiled(f"{kind}_{arithmetic}_{dtype}", bound)(hi, lo, y)
    assert _same_bits(h2, ch2) and _same_bits(l2, cl2), f"compiled {kind} lost a rounding"
    pick = max if kind == "max" else min
    for a, b, c, g_hi, g_lo in zip(_frac(hi), _frac(lo), _frac(y), _frac(h2), _frac(l2)):
        assert g_hi + g_lo == pick(a + b, c)
        if pick(a + b, c) == c != a + b:
            assert (g_hi, g_lo) == (c, 0)


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("arithmetic", ["fp32", "storage"])
def test_a_bound_propagates_nan_from_either_side(arithmetic, kind):
    from collage_compile.rewrite import mcf_chain

    nan, inf = float("nan"), float("inf") if kind == "max" else -float("inf")
    hi, lo = _t([nan, 1.0, 1.0], torch.bfloat16), _t([0.0, 0.0, 2.0**-10], torch.bfloat16)
    y = _t([1.0, nan, inf], torch.bfloat16)
    h2, l2 = mcf_chain(hi, lo, [(kind, (y,), None)], arithmetic, torch.bfloat16)
    assert torch.isnan(h2[:2]).all() and h2[2].item() == inf and l2[2].item() == 0


def test_split_round_equals_a_cast_on_normal_bf16_values_ties_included():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (1_000_000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    ties = (torch.randint(0, 2**15, (200_000,), generator=g) * 65536 + 0x8000).to(torch.int32)
    x = torch.cat([x, -x, ties.view(torch.float32), -ties.view(torch.float32)])
    x = x[(x.abs() >= 2.0**-126) & (x.abs() < 2.0**111)]
    assert x.numel() > 1_500_000
    assert torch.equal(mcf.split_round(x, torch.bfloat16), x.to(torch.bfloat16).float())
