"""Pattern families that turn writes to accumulators into MCF steps, in the order they run.

1. ``lerp``      -- ``lerp_`` (EMA-style interpolation), also as Dynamo traces ``_foreach_lerp_``
2. ``additive``  -- ``add_``, ``sub_``, ``addcdiv_``, ``addcmul_`` (method, ``+=`` and foreach forms)
3. ``decay``     -- ``mul_``, ``div_``, ``neg_`` by a constant or tensor (weight decay)
4. ``maximum``   -- ``torch.maximum(x, y, out=x)``, ``_foreach_maximum_`` (Adamax's ``exp_inf``)
5. ``copy_expr`` -- ``copy_(f(old))`` through affine ops, and overwrites (``copy_``, ``fill_``, ``zero_``)

First, on Dynamo's graph itself (every path to Inductor compiles it):

0. ``foreach_sub`` -- ``_foreach_sub(a, b, alpha=c)`` as ``_foreach_add(a, b, alpha=-c)``:
   torch 2.11's Inductor drops a foreach subtraction's ``alpha`` (see its docstring)

Before the families, normalizations run on the graph where the configuration asks for them:

0. ``eager_alpha`` (``arithmetic="storage"``) -- ``a.add(b, alpha=c)`` on bf16/fp16 spelled
   out in fp32 with one cast, so it rounds once as eager does (see its docstring)
0. ``batch_norm`` (``mode="all"`` and ``"exact"``) -- a training-mode ``F.batch_norm``'s running statistics
   spelled out as two ``lerp_`` writes, which the lerp family then claims
0. ``working_copy`` (``"light"``, ``"plus"``, ``"all"``) -- an fp32 copy of a weight updated in
   place and copied back (Hugging Face's Adafactor), spelled out of place for ``copy_expr``
0. ``step_size`` (every mode but ``"exact"``) -- Adam's compiled low-precision denominator,
   which divides by the step size, refolded so that ``lr = 0`` updates by 0 instead of
   writing NaN

``mode="exact"`` then runs ``promote`` (every upgraded tensor computes as its fp32 value,
in place of the families' rewrite) and ``step_size`` in its exact form.

After the rewrite, on every graph that holds a low-precision accumulator:

6. ``scalars`` -- a hyperparameter a scheduler changes (lr, betas, momentum), which Dynamo
   passes as a float input, enters every op that is left as a 0-dim tensor, so that no op
   specializes it (one compile per learning rate, then eager execution)

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

from collage_compile.passes import (
    additive,
    batch_norm,
    copy_expr,
    decay,
    eager_alpha,
    foreach_sub,
    lerp,
    maximum,
    promote,
    scalars,
    step_size,
    working_copy,
)

FAMILIES: tuple[tuple[str, Callable[..., int]], ...] = (
    ("lerp", lerp.match),
    ("additive", additive.match),
    ("decay", decay.match),
    ("maximum", maximum.match),
    ("copy_expr", copy_expr.match),
)


# (name, applies to a configuration, normalization)
NORMALIZATIONS: tuple[tuple[str, Callable[[Any], bool], Callable[..., int]], ...] = (
    ("batch_norm", lambda config: config.mode in ("all", "exact"), batch_norm.run),
    ("eager_alpha", lambda config: config.arithmetic == "storage", eager_alpha.run),
    # exact mode keeps Adam's own rounding: its form of the fix runs after the promotion
    ("step_size", lambda config: config.mode != "exact", step_size.run),
    ("working_copy", lambda config: config.mode in ("light", "plus", "all"), working_copy.run),
)


def normalize(gm: Any, config: Any) -> dict[str, int]:
    """Graph normalizations the configuration needs before accumulators are found."""
    return {name: fn(gm) for name, applies, fn in NORMALIZATIONS if applies(config)}


def finalize(gm: Any) -> dict[str, int]:
    """Passes on the rewritten graph (see the module docstring)."""
    return {"scalars": scalars.run(gm)}


def run(info: Any, ctx: Any) -> dict[str, int]:
    """Run every family once, in order; returns sites claimed per family."""
    return {name: fn(info, ctx) for name, fn in FAMILIES}


def uuid() -> str:
    """Hash of every family's source, so a changed pass changes cache keys."""
    h = hashlib.sha256()
    passes = (*(fn for _, _, fn in NORMALIZATIONS), *(fn for _, fn in FAMILIES))
    for fn in (*passes, foreach_sub.run, scalars.run, promote.run):
        h.update(inspect.getsource(inspect.getmodule(fn)).encode())
    return h.hexdigest()[:16]
