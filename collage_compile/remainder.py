"""The 16-bit remainder of ``mode="exact"``: a bf16 tensor and an int16 that together hold
an fp32 value.  Plain torch functions (eager tensors or fx proxies), the same code in tests
and in the compiled step.  A leaf: it imports nothing of ours.

bf16 is fp32 without its low 16 bits (same sign, same 8-bit exponent), so an fp32 value
``x`` with bit pattern ``F`` (an int32) splits into

    H = F rounded to its high 16 bits, to nearest, ties to even    hi, exactly the cast
    r = F - (H << 16)                                               the remainder

and joins back as ``F = (H << 16) + r``.  Integer arithmetic on the pattern: subnormals,
zeros of either sign, infinities and the values that round to infinity (``F = 0x7F7FFFFF``:
hi is inf, r = -1) come back bit for bit.  A NaN is replaced by the canonical NaN first
(its hi is a bf16 NaN, and it joins back as a NaN: a NaN's payload is not kept).

hi is always the cast, the bf16 copy (16, 32) training gives the forward pass.  One value
in 65537 cannot come back: under round to nearest even, 65537 fp32 patterns round to each
*even* bf16 value (both half-way points belong to it) and a 16-bit remainder has 65536
states.  The half-way point *above* an even hi needs r = +0x8000, one past int16: it keeps
0x7FFF, so that value is held one fp32 ulp below itself (and still casts to the same hi).
Every other fp32 value is held exactly (``tests/test_remainder.py``; docs/numerics.md).

Overflow: ``F + 0x8000`` stays below 2^31 once NaN is replaced (the largest pattern left,
+inf, is 0x7F800000), and ``(H << 16) + r`` for a remainder made here never leaves int32
(a hi of -0.0, the one pattern at -2^31, comes only with r >= 0).  Nothing here rounds a
float: no compiler pass can drop or change a step of it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DTYPE", "join", "split"]

#: the dtype a remainder is stored in
DTYPE = torch.int16
_HIGH_MASK = -65536  # 0xFFFF0000 as an int32


def split(x: Any, dtype: torch.dtype = torch.bfloat16, *, shift: bool = True) -> tuple[Any, Any]:
    """fp32 ``x`` as (hi, remainder): hi in ``dtype`` (bf16 only), the remainder int16.

    ``shift=False`` for a DTensor: its ``>>`` by a Python int computes garbage (torch
    2.13, eager and compiled), so hi's pattern is converted from fp32 instead (exact: its
    low 16 bits are zero), a slower loop on a CPU."""
    if dtype != torch.bfloat16:
        raise TypeError(f"collage: an exact remainder needs bfloat16, got {dtype}")
    bits = torch.where(x == x, x, float("nan")).view(torch.int32)
    # to nearest, ties to even: add just under half, and one more when the kept part is
    # odd (a bool, not torch.where on two numbers: DTensor mis-shards that on 2.13)
    odd = ((bits & 0x10000) != 0).to(torch.int32)
    high = (bits + 0x7FFF + odd) & _HIGH_MASK
    rem = (bits - high).clamp(max=0x7FFF)  # +0x8000: half-way above an even hi
    if shift:
        hi = (high >> 16).to(torch.int16).view(dtype)
    else:
        hi = high.view(torch.float32).to(dtype)
    return hi, rem.to(DTYPE)


def join(hi: Any, rem: Any) -> Any:
    """The fp32 value of (hi, remainder): exact."""
    return (hi.view(torch.int16).to(torch.int32) * 65536 + rem.to(torch.int32)).view(torch.float32)
