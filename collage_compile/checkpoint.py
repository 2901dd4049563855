"""lo state in checkpoints, and conversions between full and low precision without loss.

The lo components are training state: a checkpoint without them resumes from a value that
differs from the one the run was tracking by up to half a bf16 ulp per weight, and a resumed
run then drifts from the uninterrupted one.  One line per object puts them where users
already save state:

    collage_compile.attach(optimizer)   # lo of its params and of its (plus-mode) state
    collage_compile.attach(ema_model)   # an nn.Module, e.g. an AveragedModel EMA

after which ``optimizer.state_dict()`` / ``module.state_dict()`` carry every lo (same dtype as
its tensor, so ``Optimizer.load_state_dict``'s cast to the param's dtype could not touch it
even if it saw it) and ``load_state_dict`` restores them.  Each lo travels with a checksum of
the hi it belongs to: a lo restored before its weights are loaded (``opt.load_state_dict``
then ``model.load_state_dict``) is checked against the weights on the next compiled step,
and dropped (zeroed, with a CollageWarning naming it) if they are not the ones it was saved
with.  Loading an optimizer's state changes no weight: under a live pair that no write has
touched since its last compiled step, the saved lo is only offered
(:func:`collage_compile.state.offer`), taken if the weights are loaded before that step.

Keys: each low-precision parameter's optimizer state entry gains ``"collage_lo"``,
``"collage_lo.<name>"`` for each low-precision state tensor ``<name>`` and ``"collage_hi"``
(a checksum of the param: two int64 as their bits in the param's dtype, 8 elements, so
that torch's cast leaves it as it is too; int64 ones, saved before, are read as well);
module state dicts gain ``"<param>._collage_lo"`` / ``"<param>._collage_hi"``.  A tensor
without a lo is saved with a zero one, so the keys depend only on dtypes and a fresh
object's state dict is a complete template for ``torch.distributed.checkpoint`` loads.

State loaded into an optimizer before it was attached (the Hugging Face Trainer loads its
checkpoint before any callback runs) is taken out of the live state and restored when
:func:`attach` is called (:func:`adopt`), or at the load for an optimizer that
:func:`collage_compile.compile_optimizer` compiled (:func:`guard`).

``mode="exact"``'s int16 remainders are saved as their bits in the tensor's own dtype
(``rem.view(torch.bfloat16)``: the same keys, dtypes and shapes as a pair's lo, so any
template loads them and nothing casts them), and bit 62 of the first checksum entry is
flipped to say so (a checksum of fewer than 2^46 elements leaves bits 62 and 63 equal, so
checkpoints saved before keep reading as pairs).  One kind per parameter entry: its
state's lo entries are saved in the parameter's kind.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from collage_compile import _compat, remainder, state
from collage_compile.mcf import LOW_PRECISION

__all__ = ["adopt", "attach", "convert", "set_value"]

LO = "collage_lo"
HI = "collage_hi"
_MODULE_LO = "._collage_lo"
_MODULE_HI = "._collage_hi"
_EXACT_FLAG = 1 << 62

# object -> hook handles (attach is idempotent)
_attached: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def attach(*objects: torch.optim.Optimizer | torch.nn.Module) -> None:
    """Save and restore lo components with these optimizers' and modules' state dicts.

    Call once per object, before saving or loading (calling again does nothing).  An
    optimizer carries the lo of its parameters and of its state tensors; a module the lo
    of its parameters (use it for EMAs, which no optimizer holds).  A
    ``ZeroRedundancyOptimizer`` is attached with its inner optimizer, whose state dicts its
    own are gathered from; accelerate's ``AcceleratedOptimizer`` (a wrapper that holds
    the optimizer as ``.optimizer``) through the optimizer it wraps.
    """
    for obj in objects:
        if obj in _attached:
            continue
        if unwrap(obj) is not obj:  # accelerate's wrapper: its state dicts are the inner one's
            attach(unwrap(obj))
        elif isinstance(obj, torch.optim.Optimizer):
            _attached[obj] = _attach_optimizer(obj)
            inner = _inner_optimizer(obj)
            if inner is not None:
                attach(inner)
        elif isinstance(obj, torch.nn.Module):
            _attached[obj] = _attach_module(obj)
        else:
            raise TypeError(
                f"collage: attach() takes optimizers and modules, got {type(obj).__name__}"
            )


def is_attached(obj: Any) -> bool:
    """Whether :func:`attach` was called for ``obj``."""
    return obj in _attached


def unwrap(optimizer: Any) -> Any:
    """The optimizer whose step does the arithmetic inside forwarding wrappers: accelerate's
    ``AcceleratedOptimizer`` (a ``torch.optim.Optimizer`` subclass that never runs its
    ``__init__``, so it has no hooks of its own) and the like, which hold it as
    ``.optimizer``.  ``optimizer`` itself when it wraps none."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _inner_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer a ``ZeroRedundancyOptimizer`` steps its shard with (``opt.optim``):
    its state dicts are the inner one's, and its load copies state into it."""
    inner = getattr(opt, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) and inner is not opt else None


def _is_exact(t: torch.Tensor) -> bool:
    lo = state.components(t)[1]
    return lo is not None and state.is_remainder(lo)


def _lo_or_zeros(t: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """``t``'s lo as saved, in ``t``'s dtype: a pair's lo, or (``exact``) the remainder's
    bits; converted to that kind if it holds the other, zeros where it has none.

    Every low-precision tensor gets an entry, a zero lo where it has none yet: the set of
    keys then depends only on dtypes, so a state dict built as a loading template (DCP's
    get_state_dict in a fresh process, before any lo exists) asks for every lo a
    checkpoint holds."""
    lo = state.components(t)[1]
    if lo is None:
        return torch.zeros_like(t.detach())
    if state.is_remainder(lo) != exact:
        lo = state.as_remainder(t, lo) if exact else state.as_pair(t, lo)
    return (lo.view(t.dtype) if exact else lo).detach().clone()


def _checksum_tensor(t: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """``t``'s checksum as saved: two int64 as their bits in ``t``'s (16-bit) dtype, which
    ``Optimizer.load_state_dict``'s cast to the param's dtype leaves bit for bit."""
    plain, weighted = state.checksum(t)
    sums = torch.tensor([plain ^ _EXACT_FLAG if exact else plain, weighted], dtype=torch.int64)
    return sums.view(t.dtype)


def _readable(saved: Any) -> bool:
    """Whether a saved ``HI`` still holds its two int64: as saved (int64 before this
    format), or their bits in a 16-bit dtype; not an int64 one torch cast to bf16."""
    if not isinstance(saved, torch.Tensor):
        return False
    if saved.dtype == torch.int64:
        return saved.numel() == 2
    return saved.dtype in LOW_PRECISION and saved.numel() == 8


def _read_checksum(saved: torch.Tensor | None) -> tuple[tuple[int, int] | None, bool]:
    """(the checksum, whether the entry's lo are exact remainders) of a saved ``HI``."""
    if saved is None:
        return None, False
    if not _readable(saved):
        raise ValueError(f"collage: not a checksum: {saved.dtype} {tuple(saved.shape)}")
    sums = saved if saved.dtype == torch.int64 else saved.detach().cpu().contiguous().view(-1)
    plain, weighted = (int(x) for x in sums.view(torch.int64).tolist())
    exact = (plain >> 62) & 1 != (plain >> 63) & 1
    return (plain ^ _EXACT_FLAG if exact else plain, weighted), exact


def _restore(
    t: torch.Tensor, lo: torch.Tensor, checksum: tuple[int, int] | None, exact: bool
) -> None:
    """Make ``lo`` (a remainder's bits with ``exact``) the lo of ``t``, kept by the next
    compiled step only if ``t`` then holds the hi ``lo`` was saved with (``checksum``)."""
    if t.dtype not in LOW_PRECISION:
        return  # the run that saved it used low precision; this one does not: nothing to add
    lo = lo.view(remainder.DTYPE) if exact else lo
    live = state.components(t)[1]
    if live is None and _all_zero(lo):
        return  # a zero lo is no lo: allocate none (light mode's optimizer state)
    if (
        checksum is not None
        and live is not None
        and not _compat.is_dtensor(t)
        and state.is_remainder(live) == exact
        and state.intact(t, live)
    ):
        # an optimizer's state loaded under a live pair (a rollback or reset of the
        # optimizer alone) changes no weight; its lo applies if the weights follow.  Not
        # for a DTensor: DCP loads its shards without moving its version counter, so only
        # the checksum tells whether the weights were loaded (the saved lo is taken)
        state.offer(t, live, lo, checksum)
        return
    state.set_lo(t, lo.to(device=t.device) if exact else lo.to(device=t.device, dtype=t.dtype))
    if checksum is None:
        return
    # checked on the next compiled step, whatever is loaded into ``t`` before it (the
    # weights may be loaded after the optimizer state, or twice)
    state.stamp(t, state.get_lo(t), pending=checksum)


# ----------------------------------------------------------------------------- optimizer


def _all_zero(lo: torch.Tensor) -> bool:
    # a DTensor's over all its shards, so that every rank decides alike
    if _compat.is_dtensor(lo):
        return not bool(lo.ne(0).sum().full_tensor())
    return not lo.any()


def _params_by_index(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    # the numbering Optimizer.state_dict() packs with: params in group order
    out: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out[len(out)] = p
    return out


def _attach_optimizer(optimizer: torch.optim.Optimizer) -> list[Any]:
    hooks = _OptimizerHooks()
    handles = [
        optimizer.register_state_dict_post_hook(hooks.save),
        optimizer.register_load_state_dict_pre_hook(hooks.before_load),
        optimizer.register_load_state_dict_post_hook(hooks.after_load),
    ]
    adopt(optimizer)  # what a load before this call left in the live state
    return handles


class _OptimizerHooks:
    """An optimizer's state-dict hooks: each lo saved beside its tensor's state, taken out
    of a loaded state before torch's load casts it, restored after it."""

    def __init__(self) -> None:
        self.pending: dict[Any, dict[str, Any]] = {}  # state key -> our entries, while loading
        self.keys: dict[Any, torch.Tensor] = {}  # state key -> live parameter, while loading

    def save(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        packed = dict(sd["state"])  # its entries are the live state dicts: copy, never mutate
        for i, p in _params_by_index(opt).items():
            if p.dtype not in LOW_PRECISION:
                continue
            low = {
                name: v
                for name, v in (opt.state.get(p) or {}).items()
                if isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION and not _ours(name)
            }
            # one kind per entry: exact if any of its tensors holds a remainder
            exact = any(_is_exact(t) for t in (p, *low.values()))
            extra = {LO: _lo_or_zeros(p, exact), HI: _checksum_tensor(p, exact)}
            for name, v in low.items():
                extra[f"{LO}.{name}"] = _lo_or_zeros(v, exact)
            packed[i] = {**packed.get(i, {}), **extra}
        _warn_unsaved_pairs()
        return {**sd, "state": packed}

    def before_load(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        self.pending.clear()
        # state keys are whatever the saved groups list (indices from state_dict(), names
        # from DCP's set_state_dict): map them to parameters as Optimizer.load_state_dict does
        saved = [k for g in sd["param_groups"] for k in g["params"]]
        live = [p for g in opt.param_groups for p in g["params"]]
        self.keys.clear()
        self.keys.update(zip(saved, live))
        packed = {}
        without = []
        for i, entry in sd["state"].items():
            if not isinstance(entry, dict):  # None (ZeRO: another rank's parameter), or
                packed[i] = entry  # an optimizer's own entry (MADGRAD's state["k"])
                continue
            ours = {k: v for k, v in entry.items() if _ours(k)}
            if ours:
                self.pending[i] = ours
                entry = {k: v for k, v in entry.items() if k not in ours}
            elif entry and getattr(self.keys.get(i), "dtype", None) in LOW_PRECISION:
                without.append(self.keys[i])
            if entry:
                packed[i] = entry
        if without:
            _warn_saved_without_lo(opt, without)
        return {**sd, "state": packed}

    def after_load(self, opt: torch.optim.Optimizer) -> None:
        for i, ours in self.pending.items():
            _restore_entry(opt, self.keys[i], ours)
        _drop_inner_copies(opt, [self.keys[i] for i in self.pending])
        self.pending.clear()
        self.keys.clear()


def _warn_unsaved_pairs() -> None:
    """Tensors carrying a pair on a storage that no attached optimizer (parameters, state)
    or module (parameters) saves, nor an unattached optimizer that its own warning names
    (:func:`_warn_unattached`): an EMA module whose attach was forgotten.  A checkpoint
    taken now holds their hi alone.  Named once."""
    covered: set[int] = set()
    for obj in [*_attached.keys(), *_guarded.keys()]:
        if isinstance(obj, torch.optim.Optimizer):
            for p in (p for g in obj.param_groups for p in g["params"]):
                covered.add(state.storage_of(p))
                values = (obj.state.get(p) or {}).values()
                covered.update(state.storage_of(v) for v in values if torch.is_tensor(v))
        elif isinstance(obj, torch.nn.Module) and obj in _attached:
            covered.update(state.storage_of(p) for p in obj.parameters())
    missing = [x for ptr, xs in state.paired_storages().items() if ptr not in covered for x in xs]
    if not missing:
        return
    from collage_compile import names
    from collage_compile.diagnostics import warn_once

    shown = [
        names.display(x, f"a tensor {tuple(x.shape)}")
        if torch.is_tensor(x)
        else f"a tensor {tuple(x)}"
        for x in missing
    ]
    more = f", and {len(shown) - 4} more" if len(shown) > 4 else ""
    warn_once(
        ("unsaved-pairs", *shown),
        f"collage: {len(missing)} tensors carrying a (hi, lo) pair ({', '.join(shown[:4])}"
        f"{more}) belong to no attached optimizer or module: a checkpoint taken now holds "
        "their hi alone, and a run resumed from it restarts each lo from zero (up to half a "
        "bf16 ulp per element, once; an EMA's lo holds what its small updates added). "
        "Attach the module that holds them before saving (collage_compile.attach(ema)).",
        stacklevel=4,
    )


def _drop_inner_copies(opt: torch.optim.Optimizer, restored: list[torch.Tensor]) -> None:
    """``ZeroRedundancyOptimizer.load_state_dict`` copies each entry of the checkpoint, ours
    included, into its inner optimizer's state (``opt.optim``) before the load hooks run:
    the copies of what was just restored are taken out, so that the inner optimizer's first
    step does not find them and name them as lost (:func:`_drop_unrestored`)."""
    inner = _inner_optimizer(opt)
    if inner is None:
        return
    for p in restored:
        entry = inner.state.get(p)
        for key in [k for k in entry or () if _ours(k)]:
            del entry[key]


def _name_lost(
    key: tuple[str, ...],
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    message: Callable[[str], str],
    stacklevel: int,
) -> None:
    """One CollageWarning per ``key`` and parameters: ``message`` of their names."""
    from collage_compile import names
    from collage_compile.diagnostics import warn_once

    shown = names.of_params(opt, params)
    warn_once((*key, shown), message(shown), stacklevel=stacklevel + 1)


def _warn_saved_without_lo(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """An attached optimizer loads state that holds no lo for these low-precision
    parameters: saved without ``attach``, or a DCP template built before it asked for none."""
    _name_lost(
        ("saved-without-lo", str(id(opt))),
        opt,
        params,
        lambda shown: (
            f"collage: {type(opt).__name__} loads optimizer state that holds no lo "
            f"for {len(params)} low-precision parameters ({shown}): saved by an optimizer that "
            "was not attached, or (torch.distributed.checkpoint) loaded into a template built "
            "before collage_compile.attach. If a collage run saved it, their lo were lost and "
            "restart from zero (up to half a bf16 ulp per weight, once; at small learning rates "
            "that is many steps' worth of updates)."
        ),
        stacklevel=4,
    )


def _ours(key: Any) -> bool:
    return key == HI or key == LO or (isinstance(key, str) and key.startswith(LO + "."))


def _restore_entry(opt: torch.optim.Optimizer, p: torch.Tensor, ours: dict[str, Any]) -> None:
    """Restore one parameter entry's saved lo: the parameter's, checked against its
    weights on the next compiled step, and its state tensors' (loaded with them)."""
    checksum, exact = _read_checksum(ours.get(HI))
    if LO in ours:
        _restore(p, ours[LO], checksum, exact)
    for key, lo in ours.items():
        if key.startswith(LO + "."):
            v = (opt.state.get(p) or {}).get(key[len(LO) + 1 :])
            if isinstance(v, torch.Tensor):
                # state tensors were just loaded with their hi: nothing to wait for
                _restore(v, lo, None, exact)


def adopt(optimizer: torch.optim.Optimizer) -> int:
    """Take the lo entries that a load without the attach hooks left in ``optimizer``'s
    live state (a checkpoint loaded before :func:`attach`, or into an optimizer that
    :func:`collage_compile.compile_optimizer` compiled and nobody attached) out of it,
    and restore them as an attached load would have; returns how many parameter entries
    it restored.

    An entry whose checksum torch cast to the param's dtype (int64, as saved before the
    checksum was kept in that dtype) cannot be checked: its lo (the weight's and its
    state's) are dropped, with a CollageWarning naming the parameters."""
    lost = []
    restored = 0
    for p, ours in _take_ours(optimizer).items():
        if not isinstance(p, torch.Tensor) or p.dtype not in LOW_PRECISION:
            continue  # saved by a low-precision run, loaded into a wider one: nothing to add
        if HI in ours and not _readable(ours[HI]):
            lost.append(p)
            continue
        _restore_entry(optimizer, p, ours)
        _drop_inner_copies(optimizer, [p])
        restored += 1
    if lost:
        _name_lost(
            ("unreadable-checksum",),
            optimizer,
            lost,
            lambda shown: (
                f"collage: {type(optimizer).__name__} was loaded without "
                "collage_compile.attach from a checkpoint in the older format (int64 weight "
                f"checksums, which torch's load cast to the weights' dtype): the lo of {shown} "
                "and of their optimizer state cannot be checked against their weights and "
                "restart from zero (up to half a bf16 ulp per element, once). Call "
                "collage_compile.attach(optimizer) before loading such a checkpoint."
            ),
            stacklevel=3,
        )
    return restored


def _take_ours(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[str, Any]]:
    """The lo entries a load without the attach hooks left in the live state, taken out."""
    found: dict[torch.Tensor, dict[str, Any]] = {}
    for p, entry in optimizer.state.items():
        if not isinstance(entry, dict):
            continue  # None (ZeRO: another rank's parameter), an optimizer's own entry
        keys = [k for k in entry if _ours(k)]
        if keys:
            found[p] = {k: entry.pop(k) for k in keys}
    return found


# optimizer -> [whether compile_optimizer compiled it] for those guard() hooked
_guarded: weakref.WeakKeyDictionary[Any, list[bool]] = weakref.WeakKeyDictionary()


def guard(optimizer: torch.optim.Optimizer, compiled: bool = True) -> None:
    """Hook an optimizer whose step collage compiles (once each): a checkpoint loaded into
    it without :func:`attach` still restores its lo (:func:`adopt`), and a ``state_dict()``
    taken without :func:`attach` (it carries no lo) is named once.  ``compiled``: by
    :func:`collage_compile.compile_optimizer`, named even before any lo exists (a
    distributed checkpoint's loading template), and what a load before it left is
    restored now; else (an optimizer with low-precision parameters, seen at its first step
    once collage is in use) named once its parameters carry a lo, and what a load left in
    it before that first step, which ran without it, is dropped by name."""
    if optimizer in _guarded:
        _guarded[optimizer][0] |= compiled
        return
    _guarded[optimizer] = [compiled]
    if compiled:
        adopt(optimizer)  # a load before compile_optimizer: no compiled step has run yet
    else:
        _drop_unrestored(optimizer)
    optimizer.register_state_dict_post_hook(_warn_unattached)
    optimizer.register_load_state_dict_post_hook(adopt)


def _warn_unattached(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    flags = _guarded.get(opt)
    if opt in _attached or flags is None or len(flags) > 1:
        return  # attached, or said already
    if _inner_optimizer(opt) in _attached:
        # a ZeroRedundancyOptimizer's state_dict() is its inner optimizer's (gathered by
        # consolidate_state_dict, after these hooks run): the inner one saves each lo
        return
    low = [p for p in _params_by_index(opt).values() if p.dtype in LOW_PRECISION]
    if not flags[0]:
        low = [p for p in low if state.get_lo(p) is not None]
    if not low:
        return
    flags.append(True)
    from collage_compile import names
    from collage_compile.diagnostics import CollageWarning

    warnings.warn(
        f"collage: {type(opt).__name__}.state_dict() carries no lo of its {len(low)} "
        f"low-precision parameters ({names.of_params(opt, low)}): the optimizer's step is "
        "compiled by collage, but the optimizer is not attached. A run resumed from this "
        "state (or a distributed checkpoint loaded into it as a template) restarts every lo "
        "from zero (up to half a bf16 ulp per weight, once). Call "
        "collage_compile.attach(optimizer) once, before saving or loading.",
        CollageWarning,
        stacklevel=3,
    )


def _drop_unrestored(optimizer: torch.optim.Optimizer) -> None:
    """lo entries a load left in ``optimizer``'s state that its first step, just run,
    did not use: too late to restore (its weights moved), so taken out and named."""
    left = list(_take_ours(optimizer))
    if left:
        _name_lost(
            ("unrestored",),
            optimizer,
            left,
            lambda shown: (
                f"collage: {type(optimizer).__name__} was loaded from a checkpoint "
                f"with lo entries, for {shown}, without collage_compile.attach: its first step "
                "ran without them, so they are dropped, and each lo restarted from zero (up to "
                "half a bf16 ulp per weight, once). Call collage_compile.attach(optimizer) (or "
                "compile the step with collage_compile.compile_optimizer) before loading."
            ),
            stacklevel=6,
        )


# -------------------------------------------------------------------------------- module


def _attach_module(module: torch.nn.Module) -> list[Any]:
    pending: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    root_prefix: list[str] = [""]

    def save(mod: torch.nn.Module, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
        for name, p in mod.named_parameters():
            if p.dtype in LOW_PRECISION:
                exact = _is_exact(p)
                sd[prefix + name + _MODULE_LO] = _lo_or_zeros(p, exact)
                sd[prefix + name + _MODULE_HI] = _checksum_tensor(p, exact)
                # DCP's get/set_model_state_dict resolve every key by attribute lookup
                # ("0.weight._collage_lo" -> model[0].weight._collage_lo): name the entries
                # on the parameter (a label, no tensor: nothing is held twice)
                p.__dict__.setdefault(_MODULE_LO[1:], "collage_compile lo, in state_dict()")
                p.__dict__.setdefault(_MODULE_HI[1:], "collage_compile hi checksum")
        _warn_unsaved_pairs()

    def before_load(mod: torch.nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
        pending.clear()
        root_prefix[0] = prefix
        for key in [k for k in sd if k.startswith(prefix) and k.endswith(_MODULE_LO)]:
            name = key[len(prefix) : -len(_MODULE_LO)]
            pending[name] = (sd.pop(key), sd.pop(prefix + name + _MODULE_HI, None))

    def after_load(mod: torch.nn.Module, _incompatible: Any) -> None:
        params = dict(mod.named_parameters())
        for name, (lo, saved_hi) in pending.items():
            if name in params:
                # load_state_dict copied the weights first: they are checked right here
                _restore(params[name], lo, *_read_checksum(saved_hi))
        pending.clear()

    return [
        module.register_state_dict_post_hook(save),
        module.register_load_state_dict_pre_hook(before_load),
        module.register_load_state_dict_post_hook(after_load),
    ]


# --------------------------------------------------------------------------- conversion


def set_value(t: torch.Tensor, value: torch.Tensor, exact: bool = False) -> None:
    """Set low-precision ``t`` to ``value`` (any float dtype) as a pair: ``t`` (hi) becomes
    ``value`` rounded to nearest, its lo the rounded residual ``value - hi``.

    ``hi + lo`` equals ``value`` within half an ulp of lo: only what the pair cannot hold is
    lost (a plain ``t.copy_(value)`` loses everything below half an ulp of hi).

    ``exact`` (``mode="exact"``, bf16 ``t``): ``value`` rounded to fp32, held exactly as
    ``t`` and an int16 remainder (:mod:`collage_compile.remainder`; lossless from fp32).
    """
    if t.dtype not in LOW_PRECISION:
        raise TypeError(f"collage: set_value needs a bf16/fp16 tensor, got {t.dtype}")
    if exact:
        state.check_exact_dtype(t)
    with torch.no_grad():
        src = value.detach().to(t.device)
        if exact:
            hi, lo = remainder.split(src.float(), t.dtype)
        else:
            if src.dtype not in (torch.float32, torch.float64):
                src = src.float()
            hi = src.to(t.dtype)
            # src - hi is exact in src's precision (hi is src rounded to fewer bits)
            lo = (src - hi.to(src.dtype)).to(t.dtype)
        t.copy_(hi)
    state.set_lo(t, lo)


def convert(module: torch.nn.Module, dtype: torch.dtype, exact: bool = False) -> torch.nn.Module:
    """``module.to(dtype)`` that loses nothing the pair can hold.

    To bf16/fp16: every floating parameter becomes its value rounded to nearest with the
    residual as its lo (an fp32 checkpoint converted this way keeps 16 significant bits;
    with ``exact``, for ``mode="exact"``, to bf16: all 24, as an int16 remainder).
    To fp32/fp64: every parameter becomes ``hi + lo`` (the value the optimizer tracked).
    Parameter objects are kept (``p.data`` is replaced), so build the optimizer and compile
    the step after converting.  Floating buffers are converted as ``module.to`` would.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"collage: convert() needs a floating dtype, got {dtype}")
    if exact and dtype != torch.bfloat16:
        raise TypeError(f"collage: convert(exact=True) converts to bfloat16 only, got {dtype}")
    for name, p in module.named_parameters():
        if _compat.is_dtensor(p) and p.is_floating_point() and p.dtype != dtype:
            # FSDP2 owns its sharded parameters' storage: replacing p.data would cut it loose
            raise TypeError(
                f"collage: convert() cannot change the dtype of {name}, a DTensor (FSDP2 "
                "parameter): build the model in the target dtype before fully_shard and "
                "load the values with collage_compile.set_value(p, value) "
                "(docs/distributed.md)"
            )
    with torch.no_grad():
        for p in module.parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if dtype in LOW_PRECISION:
                if p.dtype in LOW_PRECISION:  # fp16 <-> bf16: through the tracked value
                    src = state.value(p)
                else:
                    src = p.detach()
                p.data = torch.empty_like(p, dtype=dtype)
                set_value(p, src, exact=exact)
            else:
                p.data = state.value(p).to(dtype) if p.dtype in LOW_PRECISION else p.to(dtype)
        for mod in module.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    mod._buffers[name] = b.to(dtype)
    return module
