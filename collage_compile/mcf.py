"""Multi-component float (MCF) arithmetic, written once as plain torch functions.

Every function here takes eager tensors *or* ``torch.fx`` proxies: the same code is the
reference that tests compare against float64, and the body that the graph rewrite traces
into the optimizer graph.  A value is carried as a pair (hi, lo) of the storage dtype
(bf16/fp16): hi is the tensor the model uses, lo a same-dtype correction.

Two arithmetics (``CollageConfig.arithmetic``):

* ``"fp32"`` (default): the pair is loaded into an fp32 *double-word* (s, e): s the stored
  hi, e everything else (lo, then every update and decay term of the chain).  An update is
  added to e, never to s, so it is rounded relative to itself and lo, never relative to
  the weight: fp32's 24 bits cannot eat a tiny update, and the rounding it does get
  (2^-24 of the update) is the precision the optimizer computed the update in.  The result
  is rounded once into the pair, hi to nearest.  One to three operations per step where
  error-free transformations (TwoSum, Dekker's product) need seven to nine, with the same
  accuracy on the float64-checked streams (README "Speed").
* ``"storage"``: the paper's sequence (Collage, arXiv 2405.03637, Algorithm "Grow"), every
  operation rounded to the storage dtype, bit-identical to running it op by op in eager bf16.

Rounding that survives the compiler
-----------------------------------
Inductor computes fused bf16 chains in fp32 registers and drops ``to(bf16)``/``to(float32)``
round trips inside a kernel (FIELD_NOTES section 1), so ``x.to(bf16).float()`` is *not* a
rounding once compiled.  :func:`round_to` rounds to bf16 with integer arithmetic on the fp32
bit pattern (round to nearest even in five integer operations), and to fp16 with fp32
arithmetic alone (a Veltkamp split; :func:`round_to_float_ops` does so for bf16 too, the
faster of the two in a C++ kernel), which no compiler pass may remove without licence to
reassociate floating point (Inductor's C++ flags keep ``-fno-unsafe-math-optimizations``
and ``-ffp-contract=off``; Triton does not reassociate).  Every product inside it and
inside :func:`two_prod` is exact, so FMA contraction (Triton's default) cannot change a
result either.  The fp32 arithmetic rounds bf16 with :func:`split_round`, the same split
without branches: Inductor's C++ backend moves a bitcast through memory one element at a
time when it vectorizes 32 lanes wide, which made the bit version the slowest part of a step.

Compiling these functions yourself: pass ``options=collage_compile.inductor_options()`` to
``torch.compile``.  Error-free transformations reuse every intermediate several times, and
Inductor re-traces a reused pointwise value into each user until it is large, which makes
lowering exponential in the chain length (the backend applies the same option to graphs in
``"storage"`` arithmetic).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "LOW_PRECISION",
    "constant_factor",
    "dw_add",
    "dw_div",
    "dw_from_pair",
    "dw_mul",
    "dw_to_pair",
    "fast2sum",
    "grow",
    "load_pair",
    "mul",
    "renormalize",
    "round_to",
    "round_to_float_ops",
    "split",
    "split_constant",
    "split_round",
    "storage_add",
    "storage_div",
    "storage_mul",
    "two_prod",
    "two_sum",
    "value",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Significant bits p (implicit bit included) and the smallest normal exponent of each
# storage format.
_FORMATS: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (8, -126),
    torch.float16: (11, -14),
}
_FP16_OVERFLOW = 65520.0
_INF = float("inf")


def _format(dtype: torch.dtype) -> tuple[int, int]:
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise TypeError(f"MCF storage dtype must be bfloat16 or float16, got {dtype}") from None


def round_to(x: Any, dtype: torch.dtype) -> Any:
    """Round fp32 ``x`` to the nearest ``dtype`` value (ties to even); the result stays fp32.

    Equal, bit for bit, to ``x.to(dtype).float()`` in eager mode (subnormals, overflow to
    inf and NaN included), but made of arithmetic that Inductor keeps.
    """
    if dtype == torch.bfloat16:
        r = _round_bf16_bits(x)
        # a NaN whose payload sits only in the 16 dropped bits would carry into inf
        return torch.where(x != x, x, r)
    return round_to_float_ops(x, dtype)


def _round_bf16_bits(x: Any) -> Any:
    """fp32 ``x`` rounded to bf16, on its bit pattern; exact for every input except NaN.

    bf16 is fp32 without its low 16 bits.  Adding 0x7FFF plus the lowest kept bit carries
    into the kept bits exactly when the dropped half is above half-way, or exactly half-way
    with an odd kept part (ties to even), and masking the dropped half off truncates.  The
    encoding is monotone in magnitude and the sign bit is untouched, so one rule covers
    subnormals, the overflow to inf (the carry runs into the exponent) and inf itself.
    Five integer operations where the Veltkamp split needs about fifteen (with its huge,
    subnormal and non-finite branches), and no compiler pass rewrites integer arithmetic on
    a bitcast: Inductor lowers both bitcasts inside the fused kernel (Triton:
    ``tl.bitcast``; C++: through a buffer, lane by lane, which makes it slower there than
    :func:`round_to_float_ops`, ``python -m benchmarks.rounding``).  A NaN may
    come back as inf: callers that can see a NaN select it back (:func:`round_to`); callers
    that have already excluded NaN skip that (:func:`dw_to_pair`).
    """
    bits = x.view(torch.int32)
    # NaN is the only input whose sum overflows int32 (>= 0x7F800001 + 0x8000), and its
    # lanes are replaced by the caller; every other magnitude stays below 0x7F808000.
    bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & -65536
    return bits.view(torch.float32)


def round_to_float_ops(x: Any, dtype: torch.dtype) -> Any:
    """:func:`round_to` computed with fp32 arithmetic operations alone, no bitcast (a
    Veltkamp split with its huge, subnormal and non-finite branches): the same result,
    bit for bit, for every input, NaN included, and float16's :func:`round_to`.  No
    compiler pass may change it without licence to reassociate floating point.  For bf16
    in C++ kernels: about fifteen vector operations where the bit version's two bitcasts
    go through memory one lane at a time (``python -m benchmarks.rounding``)."""
    p, emin = _format(dtype)
    ax = x.abs()
    if dtype == torch.bfloat16:
        # Veltkamp needs y * 2^16 to stay finite: scale huge values down by a power of two
        # (exact) and back up afterwards (overflowing to inf exactly where RN would).
        big = ax >= 2.0**100
        y = torch.where(big, x * 2.0**-64, x)
    else:
        y = x
    # Veltkamp split with sigma = 2^(24-p) + 1: c - (c - y) is y rounded to p bits, to
    # nearest, ties to even.  y * 2^(24-p) is exact, so c is a single rounding either way.
    c = y * 2.0 ** (24 - p) + y
    r = c - (c - y)
    if dtype == torch.bfloat16:
        r = torch.where(big, r * 2.0**64, r)
    else:
        # from 65520 (halfway past the largest finite fp16, 65504) a cast gives +-inf
        r = torch.where(ax >= _FP16_OVERFLOW, x * _INF, r)
    # Below the smallest normal the format has a fixed quantum 2^(emin-p+1): adding and
    # subtracting 1.5 * 2^(emin-p+1+23) rounds to it (the sum's ulp is that quantum).
    # Done on |x| and signed afterwards so that tiny negatives round to -0.0, as a cast does.
    magic = 1.5 * 2.0 ** (emin - p + 1 + 23)
    r = torch.where(ax < 2.0**emin, torch.copysign((ax + magic) - magic, x), r)
    # inf and nan pass through (the split would turn inf into nan); |x| < inf is
    # isfinite in one comparison (false for nan)
    return torch.where(ax < _INF, r, x)


def split_round(x: Any, dtype: torch.dtype) -> Any:
    """fp32 ``x`` rounded to ``dtype``'s significand (to nearest, ties to even) by a
    Veltkamp split, four fp32 operations and no branch.

    Equal to :func:`round_to` wherever ``dtype`` has a normal number of that size (bf16:
    ``2^-126 <= |x| < 2^111``; ``tests/test_mcf.py`` checks it, ties included).  Below, it
    keeps more bits than a subnormal holds; from 2^111 (``x * 2^16`` overflows), and for
    inf and NaN, it returns NaN.  ``x * 2^16`` is exact, so FMA contraction cannot change
    ``c``, and nothing else is a product.
    """
    p, _ = _format(dtype)
    c = x * 2.0 ** (24 - p) + x
    return c - (c - x)


def two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    """Knuth's TwoSum: ``s + e == a + b`` exactly, ``s = fl(a + b)``; any magnitudes."""
    s = a + b
    bb = s - a
    ab = s - bb
    return s, (a - ab) + (b - bb)


def fast2sum(a: Any, b: Any) -> tuple[Any, Any]:
    """Dekker's Fast2Sum: exact when ``|a| >= |b|`` (or a's exponent is not smaller)."""
    s = a + b
    return s, b - (s - a)


def split(a: Any) -> tuple[Any, Any]:
    """Veltkamp split of fp32 ``a`` into two halves of at most 12 significant bits.

    A Python float is split on the host with fp32 arithmetic (Python's own floats are
    float64, whose split would keep all 24 bits in the head).
    """
    if isinstance(a, (int, float)):
        t = torch.tensor(float(a), dtype=torch.float32)
        hi, lo = split(t)
        return hi.item(), lo.item()
    c = a * 4096.0 + a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a: Any, b: Any) -> tuple[Any, Any]:
    """Dekker's TwoProd: ``p + e == a * b`` exactly for fp32 ``a`` and ``b`` (no fma needed).

    Each partial product of 12-bit halves is exact, so fma contraction cannot change ``e``.
    Where the split would overflow (``|a|`` or ``|b|`` above ~1e34) ``e`` is 0.  A Python
    float ``b`` must already be an fp32 value (see :func:`split_constant`).
    """
    p = a * b
    ah, al = split(a)
    bh, bl = split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, torch.where(e.abs() < _INF, e, 0.0)


def split_constant(c: float, dtype: torch.dtype) -> tuple[float, float]:
    """Split Python float ``c`` into ``(c_hi, c_lo)`` of ``dtype`` with ``c ~= c_hi + c_lo``.

    Computed in float64 on the host, whatever the default dtype: ``bf16(0.999) == 1.0``,
    so a decay constant needs its second component to decay anything at all.
    """
    c = float(c)
    if math.isfinite(c) and abs(c) >= _overflow_threshold(dtype):
        raise OverflowError(f"collage: constant {c!r} is out of {dtype}'s range")
    hi = torch.tensor(c, dtype=torch.float64).to(dtype).item()
    lo = torch.tensor(c - hi, dtype=torch.float64).to(dtype).item()
    return hi, lo


def constant_factor(c: float) -> tuple[float, float]:
    """``(c, c - 1)`` as fp32 values for :func:`dw_mul`, ``c - 1`` taken in float64 first
    (``1 - 1e-5`` in fp32 is 0.99998999..., whose distance to 1 is off by 0.1 %)."""
    c = float(c)
    as32 = torch.tensor([c, c - 1.0], dtype=torch.float64).float().tolist()
    return as32[0], as32[1]


def _overflow_threshold(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf in ``dtype`` (max + half an ulp)."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


# --------------------------------------------------------------------------------------
# "fp32" arithmetic: an fp32 double-word (s, e) carries the pair through a chain of steps.


def dw_from_pair(hi: Any, lo: Any, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """Load a storage pair into an fp32 double-word (exact), lo where it can belong to hi
    (:func:`load_pair`)."""
    return load_pair(hi, lo, dtype or hi.dtype)


def load_pair(hi: Any, lo: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """``(hi, lo)`` in fp32, each lo that cannot belong to its hi read as 0.

    Every pair this module writes has ``|lo| <= ulp(hi)/2 <= |hi| * 2^-p`` (p the storage
    significand's bits; for fp16 below its smallest normal, lo is under a subnormal step;
    bf16's subnormals, below 1e-38, are left out, and lose a lo of at most 2^-134).  A hi
    written where no check sees it (``p.data.zero_()``, ``p.data.copy_(new)``: ``.data``
    has a version counter of its own) keeps the old lo, which for smaller new values can
    be larger than the new value's rounding (after a zeroing, all of it): such a lo is
    dropped here, elementwise, so what a stale lo can add is bounded by the new hi's own
    rounding.  Five operations a load (bf16), in the kernel that already reads both.
    """
    p, emin = _format(dtype)
    h, low = hi.float(), lo.float()
    bound = h.abs() * 2.0**-p
    if dtype == torch.float16:  # its subnormals (below 6e-5: a second moment's range)
        bound = bound + 2.0 ** (emin - p + 1)
    return h, torch.where(low.abs() <= bound, low, 0.0)


def dw_add(s: Any, e: Any, u: Any) -> tuple[Any, Any]:
    """(s, e) + u: u joins the correction word, rounded relative to ``|e + u|`` only.

    s keeps the value it was loaded with (a storage value), so an update far below s's
    fp32 ulp is kept in full, and one comparable to the weight loses 2^-24 of itself, no
    more than computing it in fp32 already cost.
    """
    return s, e + u


def dw_mul(s: Any, e: Any, c: Any, c_minus_one: Any) -> tuple[Any, Any]:
    """(s, e) * c, given ``c`` and ``c - 1`` in fp32 (``c - 1`` computed before rounding c).

    ``s * c == s + s * (c - 1)``: the change ``s * (c - 1)`` joins the correction word, so a
    decay such as ``1 - lr * wd`` is applied in full however close to 1 it is (fp32's own
    ``s * c`` would round it away) and rounded relative to the change itself.
    """
    return s, e * c + s * c_minus_one


def dw_div(s: Any, e: Any, d: Any) -> tuple[Any, Any]:
    """(s, e) / d for an fp32 divisor: q = fl(s/d), the remainder s - q*d exactly (TwoProd),
    and its quotient as the error word.  No reciprocal, so a tiny d cannot overflow early."""
    q = s / d
    p, t = two_prod(q, d)
    return q, (((s - p) - t) + e) / d


def dw_to_pair(s: Any, e: Any, dtype: torch.dtype, *, stored: bool = False) -> tuple[Any, Any]:
    """Round a double-word into a storage pair: hi to nearest, lo the rounded remainder.

    Inf/NaN behave as plain arithmetic would: hi takes the naive fp32 result and lo is 0.

    ``stored``: the pair is only stored, never read back in fp32 by the same compiled code
    (the chain is the last use of its tensor there).  Then hi and lo are handed to the
    stores unrounded and the stores' own conversions round them (Inductor keeps a
    conversion into a low-precision buffer; it elides one only where the value is read back
    in fp32).  lo still needs hi's rounded value, computed here the way the store rounds.
    Otherwise both are rounded here, so a reader in the same kernel (an EMA of the weight,
    the step's metrics) sees exactly the stored values.

    bf16 is rounded with :func:`split_round` (fp32 arithmetic only: in a C++ kernel 32
    lanes wide, Inductor moves every value through a bitcast one element at a time, which
    made :func:`round_to` the slowest part of the step).  Below bf16's smallest normal,
    2^-126, it keeps more bits than a subnormal holds, so there hi + lo is exact to 2^-133
    rather than to the last bit; from 2^111 up the pair is rounded as plain bf16 (lo 0).
    """
    t = s + e
    if dtype == torch.bfloat16:
        r = split_round(t, dtype)  # NaN where t is inf, NaN or beyond 2^111
        lo_round = split_round
    else:
        r = round_to_float_ops(t, dtype)  # exact, subnormals and overflow to inf included
        lo_round = round_to_float_ops
    ok = r.abs() < _INF
    # s - r is exact where s is within a factor of two of r (Sterbenz): s is the loaded
    # hi, and e moves it by less than that unless an update dwarfs the weight, where the
    # remainder is rounded relative to the result (fp32 precision of hi + lo).  Where r is
    # finite so are s and e (an inf or NaN operand makes s + e one), and the remainder.
    rest = (s - r) + e
    if stored:
        return t.to(dtype), torch.where(ok, rest, 0.0).to(dtype)
    hi = torch.where(ok, r, t)
    lo = torch.where(ok, lo_round(rest, dtype), 0.0)
    return hi.to(dtype), lo.to(dtype)


def pair_max(s: Any, e: Any, y: Any) -> tuple[Any, Any]:
    """max(s + e, y) for a double-word (s, e) and an fp32 ``y``, as a double-word: the pair
    where its whole value is at least ``y``, else ``(y, 0)``.  The sign of ``(s - y) + e``
    is the comparison's: ``s - y`` is exact for storage values within 2^16 of each other
    (two short significands), and rounding keeps a sum's sign.  NaN propagates as
    ``torch.maximum``'s does (from either side); serves both arithmetics (in "storage"
    the pair is normalized and ``y`` a storage value, so the result is one too)."""
    take = ((s - y) + e < 0) | torch.isnan(y)
    return torch.where(take, y, s), torch.where(take, 0.0, e)


def pair_min(s: Any, e: Any, y: Any) -> tuple[Any, Any]:
    """min(s + e, y), the mirror of :func:`pair_max` (a clamp's upper bound)."""
    take = ((s - y) + e > 0) | torch.isnan(y)
    return torch.where(take, y, s), torch.where(take, 0.0, e)


# --------------------------------------------------------------------------------------
# "storage" arithmetic: the paper's operations, each rounded to the storage dtype.  The
# pair is carried as fp32 tensors that hold storage-dtype values.


def storage_add(a: Any, r: Any, u: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """Paper's Grow, op by op in ``dtype``: s=a+u; r+=u-(s-a); a'=s+r; r'=r-(a'-s)."""
    u = round_to(u, dtype)
    s = round_to(a + u, dtype)
    r = round_to(r + round_to(u - round_to(s - a, dtype), dtype), dtype)
    a2 = round_to(s + r, dtype)
    r2 = round_to(r - round_to(a2 - s, dtype), dtype)
    # Where s overflowed or u was inf/nan the paper's sequence yields nan (inf - inf);
    # plain arithmetic yields s, so give s and an empty correction.
    finite = s.abs() < _INF
    return torch.where(finite, a2, s), torch.where(finite, r2, 0.0)


def storage_mul(a: Any, r: Any, c_hi: Any, c_lo: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """Expansion product (a, r) * (c_hi, c_lo), op by op in ``dtype`` (paper's MultMC).

    Alias-free: the reference implementation multiplies ``a`` in place and then reuses it
    as if unmodified, which settles a decayed EMA at 0.33x-0.53x of its true value.
    """
    p = round_to(a * c_hi, dtype)
    # a * c_hi is exact in fp32 (two 8/11-bit significands), so this is TwoProd's error
    err = round_to(a * c_hi - p, dtype)
    r = round_to(r * c_hi, dtype)
    r = round_to(r + a * c_lo, dtype)
    r = round_to(r + err, dtype)
    a2 = round_to(p + r, dtype)
    r2 = round_to(r - round_to(a2 - p, dtype), dtype)
    finite = p.abs() < _INF
    return torch.where(finite, a2, p), torch.where(finite, r2, 0.0)


def storage_div(a: Any, r: Any, d: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """(a, r) / d in ``dtype``: q = rnd(a/d), the remainder ``a - q*d`` in fp32 (exact when
    d is a storage value: two short significands), its quotient added to r.  The paper has no
    division; dividing directly keeps a tiny divisor from overflowing a reciprocal."""
    q = round_to(a / d, dtype)
    r = round_to(r / d, dtype)
    r = round_to(r + round_to((a - q * d) / d, dtype), dtype)
    a2 = round_to(q + r, dtype)
    r2 = round_to(r - round_to(a2 - q, dtype), dtype)
    finite = q.abs() < _INF
    return torch.where(finite, a2, q), torch.where(finite, r2, 0.0)


# --------------------------------------------------------------------------------------
# Pair-level entry points.


def grow(hi: Any, lo: Any, update: Any, arithmetic: str = "fp32") -> tuple[Any, Any]:
    """Add ``update`` (any float dtype, ideally unrounded fp32) to the pair ``(hi, lo)``.

    Returns the new pair in ``hi.dtype``.
    """
    dtype = hi.dtype
    if arithmetic == "fp32":
        s, e = dw_add(*dw_from_pair(hi, lo), update.float())
        return dw_to_pair(s, e, dtype)
    if arithmetic == "storage":
        a, r = storage_add(*load_pair(hi, lo, dtype), update.float(), dtype)
        return a.to(dtype), r.to(dtype)
    raise ValueError(f"unknown arithmetic {arithmetic!r}")


def mul(hi: Any, lo: Any, c: float, arithmetic: str = "fp32") -> tuple[Any, Any]:
    """Multiply the pair ``(hi, lo)`` by the Python constant ``c`` (a decay)."""
    dtype = hi.dtype
    if arithmetic == "fp32":
        s, e = dw_mul(*dw_from_pair(hi, lo), *constant_factor(c))
        return dw_to_pair(s, e, dtype)
    if arithmetic == "storage":
        c_hi, c_lo = split_constant(c, dtype)
        a, r = storage_mul(*load_pair(hi, lo, dtype), c_hi, c_lo, dtype)
        return a.to(dtype), r.to(dtype)
    raise ValueError(f"unknown arithmetic {arithmetic!r}")


def renormalize(hi: Any, lo: Any, arithmetic: str = "fp32") -> tuple[Any, Any]:
    """Bring a pair back to |lo| <= ulp(hi)/2, hi the nearest value to hi + lo.

    Works for any pair (lo need not be smaller than hi): TwoSum, not Fast2Sum.
    """
    dtype = hi.dtype
    if arithmetic == "fp32":
        # TwoSum first: lo may be as large as hi, where s - hi would not be exact
        return dw_to_pair(*two_sum(hi.float(), lo.float()), dtype)
    if arithmetic == "storage":
        a, b = hi.float(), lo.float()
        # TwoSum with every operation rounded to dtype: still error-free in dtype
        s = round_to(a + b, dtype)
        bb = round_to(s - a, dtype)
        ab = round_to(s - bb, dtype)
        e = round_to(round_to(a - ab, dtype) + round_to(b - bb, dtype), dtype)
        finite = s.abs() < _INF
        return torch.where(finite, s, a + b).to(dtype), torch.where(finite, e, 0.0).to(dtype)
    raise ValueError(f"unknown arithmetic {arithmetic!r}")


def value(hi: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    """The fp32 value the pair stands for, ``hi + lo`` (``hi`` alone where there is no lo)."""
    if lo is None:
        return hi.float()
    h, low = load_pair(hi, lo, hi.dtype)
    return h + low
