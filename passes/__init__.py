"""Pattern families that turn writes to accumulators into MCF steps, in the order they run.

1. ``lerp``      -- ``lerp_`` (EMA-style interpolation), also as Dynamo traces ``_foreach_lerp_``
2. ``additive``  -- ``add_``, ``sub_``, ``addcdiv_``, ``addcmul_`` (method, ``+=`` and foreach forms)
3. ``decay``     -- ``mul_``, ``div_``, ``neg_`` by a constant or tensor (weight decay)
4. ``copy_expr`` -- ``copy_(f(old))`` through affine ops, and overwrites (``copy_``, ``fill_``, ``zero_``)

Before them, for ``arithmetic="storage"`` only, one normalization runs on the graph:

0. ``eager_alpha`` -- ``a.add(b, alpha=c)`` on bf16/fp16 spelled out in fp32 with one cast, so
   it rounds once as eager does (see its docstring for the Inductor behaviour it avoids)

Each family is ``match(info, ctx) -> int``: it claims the writes it understands (turning each
into :class:`collage_compile.accumulators.Step` s) and returns how many it claimed.  A write no
family claims is reported as not upgradable.  Invariants a family may rely on: the graph is
a private copy of Dynamo's, every write is split per tensor (foreach lists included), and the
accumulator is bf16/fp16 and eligible under the configured mode.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

from collage_compile.passes import additive, copy_expr, decay, eager_alpha, lerp

FAMILIES: tuple[tuple[str, Callable[..., int]], ...] = (
    ("lerp", lerp.match),
    ("additive", additive.match),
    ("decay", decay.match),
    ("copy_expr", copy_expr.match),
)


STORAGE_NORMALIZATIONS: tuple[tuple[str, Callable[..., int]], ...] = (
    ("eager_alpha", eager_alpha.run),
)


def normalize(gm: Any, arithmetic: str) -> dict[str, int]:
    """Graph normalizations that an arithmetic needs before accumulators are found."""
    if arithmetic != "storage":
        return {}
    return {name: fn(gm) for name, fn in STORAGE_NORMALIZATIONS}


def run(info: Any, ctx: Any) -> dict[str, int]:
    """Run every family once, in order; returns sites claimed per family."""
    return {name: fn(info, ctx) for name, fn in FAMILIES}


def uuid() -> str:
    """Hash of every family's source, so a changed pass changes cache keys."""
    h = hashlib.sha256()
    for _, fn in (*STORAGE_NORMALIZATIONS, *FAMILIES):
        h.update(inspect.getsource(inspect.getmodule(fn)).encode())
    return h.hexdigest()[:16]
