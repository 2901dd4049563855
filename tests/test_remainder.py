"""The exact remainder (``collage_compile.remainder``): a bf16 tensor and an int16 that are an
fp32 value bit for bit, eager and compiled, for every kind of fp32 input.

The inputs: every one of the 65536 high halves of an fp32 pattern (every sign, exponent and
bf16 significand, the infinities and NaNs included) joined with low halves that cover the
edges (0, 1, just below and above half-way, half-way, all ones) and random ones, plus a
million random patterns.
"""

from __future__ import annotations

import pytest
import torch

from collage_compile import remainder

_EDGES = [0x0000, 0x0001, 0x3FFF, 0x7FFE, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFE, 0xFFFF]


def _patterns(extra_lows: int = 6, randoms: int = 1 << 20) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    lows = torch.tensor(_EDGES + torch.randint(0, 1 << 16, (extra_lows,), generator=g).tolist())
    high = torch.arange(1 << 16, dtype=torch.int64)
    bits = ((high[:, None] << 16) | lows[None, :]).flatten()
    bits = torch.cat([bits, torch.randint(0, 1 << 32, (randoms,), generator=g)])
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


def _check(bits: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor, back: torch.Tensor) -> None:
    x = bits.view(torch.float32)
    nan = torch.isnan(x)
    assert hi.dtype == torch.bfloat16 and rem.dtype == torch.int16
    # hi is the cast (round to nearest, ties to even) of every value, a NaN's a NaN
    cast = x.to(torch.bfloat16)
    assert torch.equal(hi.view(torch.int16)[~nan], cast.view(torch.int16)[~nan])
    assert bool(torch.isnan(back[nan]).all()) and bool(torch.isnan(hi[nan]).all())
    # every value but NaN comes back bit for bit, but the half-way point above an even hi,
    # which comes back one fp32 ulp below itself (module docstring)
    high, low = bits >> 16, bits & 0xFFFF
    tie_above_even = (low == 0x8000) & (high & 1 == 0) & ~nan
    got = back.view(torch.int32)
    assert torch.equal(got[~nan & ~tie_above_even], bits[~nan & ~tie_above_even])
    assert torch.equal(got[tie_above_even], bits[tie_above_even] - 1)
    assert int(tie_above_even.sum()) > 30000  # the edges include every such tie


def test_split_and_join_hold_every_fp32_value_eagerly():
    bits = _patterns()
    hi, rem = remainder.split(bits.view(torch.float32))
    _check(bits, hi, rem, remainder.join(hi, rem))


def test_the_compiled_split_and_join_are_the_eager_ones_bit_for_bit():
    bits = _patterns(extra_lows=0, randoms=1 << 16)
    split = torch.compile(remainder.split, backend="inductor", fullgraph=True)
    join = torch.compile(remainder.join, backend="inductor", fullgraph=True)
    hi, rem = split(bits.view(torch.float32))
    _check(bits, hi, rem, join(hi, rem))
    eager_hi, eager_rem = remainder.split(bits.view(torch.float32))
    finite = ~torch.isnan(bits.view(torch.float32))
    assert torch.equal(hi.view(torch.int16)[finite], eager_hi.view(torch.int16)[finite])
    assert torch.equal(rem, eager_rem)


def test_sixteen_bits_cannot_hold_round_to_nearest_even():
    """Why hi is not always the cast: 65537 fp32 patterns cast to an even bf16 value (its
    two half-way points included), 65535 to an odd one, and a remainder has 65536 states."""
    for h in (0x3F80, 0x3F81, 0x0002, 0x0003, 0x7F7E):
        around = torch.arange((h << 16) - 0x10000, (h << 16) + 0x10000, dtype=torch.int64)
        cast = around.to(torch.int32).view(torch.float32).to(torch.bfloat16)
        count = int((cast.view(torch.int16) == h).sum())
        assert count == (65537 if h % 2 == 0 else 65535)


def test_a_nan_is_one_nan_and_the_largest_finite_values_round_to_inf_with_a_remainder():
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    big = torch.tensor([0x7F7FFFFF, 0x7F7F8000], dtype=torch.int32).view(torch.float32)
    hi, rem = remainder.split(torch.cat([x, big]))
    assert bool(torch.isnan(hi[:2]).all()) and rem[:2].tolist() == [0, 0]
    assert hi[2:4].tolist() == [float("inf"), -float("inf")] and rem[2:4].tolist() == [0, 0]
    # fp32's largest value casts to bf16 inf, and the remainder still holds it
    assert hi[4:].tolist() == [float("inf")] * 2 and rem[4:].tolist() == [-1, -0x8000]
    assert torch.equal(remainder.join(hi[4:], rem[4:]), big)


def test_fp16_has_no_exact_remainder():
    with pytest.raises(TypeError, match="bfloat16"):
        remainder.split(torch.ones(2), torch.float16)
