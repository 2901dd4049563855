"""The 16-bit remainder of ``mode="exact"``: a bf16 tensor and an int16 that together hold
an fp32 value bit for bit.  Plain torch functions (eager tensors or fx proxies), the same
code in tests and in the compiled step.  A leaf: it imports nothing of ours.

bf16 is fp32 without its low 16 bits (same sign, same 8-bit exponent), so an fp32 value
``x`` with bit pattern ``F`` (an int32) splits into

    H = (F + 0x8000) & ~0xFFFF      the pattern of hi as fp32: F rounded to 16 bits
    r = F - H                       in [-0x8000, 0x7FFF]: exactly an int16

and joins back as ``F = bits(float(hi)) + r``.  Integer arithmetic on the pattern: every
fp32 value but NaN comes back bit for bit, subnormals, zeros of either sign, infinities and
the values that round to infinity (``F = 0x7F7FFFFF``: hi is inf, r = -1) included.  A NaN
is replaced by the canonical NaN first (its hi is bf16's 0x7FC0, what a cast gives, and it
joins back as fp32's canonical NaN: a NaN's payload is not kept).

hi is the nearest bf16 value to x, the value a cast gives, with one exception forced by
counting: under round to nearest even, 65537 fp32 patterns round to each *even* bf16 value
(both halfway points, ``U << 16 | 0x8000`` on either side, belong to it) and a 16-bit
remainder has 65536 states.  So ties round away from zero (adding 0x8000 carries exactly
when the dropped half is at least one half), and a value exactly halfway above an even
bf16 value gets the odd one above as hi: as near as the even one, one bf16 ulp from the
cast.  Every other value's hi is the cast's (``tests/test_remainder.py``; docs/numerics.md).

Overflow: ``F + 0x8000`` stays below 2^31 once NaN is replaced (the largest pattern left,
+inf, is 0x7F800000), and ``bits(float(hi)) + r`` for a remainder made here never leaves
int32 (a hi of -0.0, the one pattern whose int32 is -2^31, comes only with r >= 0).
Nothing here rounds: no compiler pass can drop or change a step of it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DTYPE", "join", "split"]

#: the dtype a remainder is stored in
DTYPE = torch.int16
_HALF = 0x8000
_HIGH_MASK = -65536  # 0xFFFF0000 as an int32


def split(x: Any, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """fp32 ``x`` as (hi, remainder): hi in ``dtype`` (bf16 only), the remainder int16."""
    if dtype != torch.bfloat16:
        raise TypeError(f"collage: an exact remainder needs bfloat16, got {dtype}")
    bits = torch.where(x == x, x, float("nan")).view(torch.int32)
    high = (bits + _HALF) >> 16  # hi's own pattern, in [-2^15, 2^15)
    return high.to(torch.int16).view(dtype), (bits - high * 65536).to(DTYPE)


def join(hi: Any, rem: Any) -> Any:
    """The fp32 value of (hi, remainder): exact."""
    return (hi.view(torch.int16).to(torch.int32) * 65536 + rem.to(torch.int32)).view(torch.float32)
