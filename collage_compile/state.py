"""The lo components: one per upgraded tensor, keyed by tensor identity, dying with it.

A plain ``WeakKeyDictionary`` would call ``Tensor.__eq__``; ``WeakIdKeyDictionary`` builds a
weak reference on every lookup, too slow for a per-step lookup of every parameter.  This is
an ``id()``-keyed dict whose entries hold a weak reference to their tensor and are removed by
its finalizer, so a lookup is one dict access plus an identity check.

A lo is one of two kinds, told apart by its dtype: a *pair* correction (the tensor's own
dtype, ``mode="light"/"plus"/"all"``: the value is ``hi + lo``) or an exact *remainder*
(int16, ``mode="exact"``: the value is :func:`collage_compile.remainder.join` of the two).
A graph that meets the other kind converts it (:func:`lo_for`), with a CollageWarning.

Tensors passed *into* a compiled function may be fresh aliases made every call
(``AveragedModel`` passes ``p.detach()`` of each averaged parameter): keyed by identity their
lo would die with the alias after each step.  They are keyed by *view* instead (storage,
offset, sizes, strides, dtype), held while the storage lives (a storage weak reference,
swept lazily), and a lookup by identity falls back to the view, so ``value(ema_param)`` finds
the pair its ``detach()`` alias carried.
"""

from __future__ import annotations

import logging
import operator
import threading
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from collage_compile import _compat, mcf, remainder, replay
from collage_compile.diagnostics import CollageWarning, warn_once
from collage_compile.mcf import LOW_PRECISION

__all__ = [
    "check",
    "check_exact_dtype",
    "clear",
    "components",
    "empty_lo",
    "get_lo",
    "is_remainder",
    "lo_for",
    "los_overlapping",
    "residual",
    "set_lo",
    "stamp",
    "value",
]

log = logging.getLogger("collage_compile")

_lock = threading.Lock()
# id(tensor) -> (weakref to tensor, lo)
_entries: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
# storage data pointer -> ids of the registered tensors on it (to find aliases: p.data)
_by_storage: dict[int, set[int]] = {}
# view key -> (storage weak reference, lo), for tensors registered by view
_by_view: dict[tuple, tuple[object, torch.Tensor]] = {}
_views_live_after_sweep = 0
# bumped whenever a tensor gains or loses its pair (callers cache "which tensors carry one")
_epoch = 0


def epoch() -> int:
    """A number that changes whenever the set of tensors carrying a pair may have changed."""
    return _epoch


def _storage_ptr(t: torch.Tensor) -> int:
    # a DTensor's elements are its local shard's (the wrapper has no storage)
    return _compat.local_tensor(t).untyped_storage().data_ptr()


def storage_of(t: torch.Tensor) -> int:
    """The key of ``t``'s storage, as the registry keeps it (a DTensor: its shard's)."""
    return _storage_ptr(t)


def _view_key(t: torch.Tensor) -> tuple:
    local = _compat.local_tensor(t)
    return (
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        tuple(local.stride()),
        t.dtype,
        t.device,
    )


def _view_lo(t: torch.Tensor) -> torch.Tensor | None:
    if not _by_view:
        return None
    key = _view_key(t)
    entry = _by_view.get(key)
    if entry is None:
        return None
    if entry[0].expired():  # the storage died and its address was reused
        _by_view.pop(key, None)
        return None
    return entry[1]


def _sweep_views() -> None:
    global _views_live_after_sweep
    for key, (ref, _) in list(_by_view.items()):
        if ref.expired():
            del _by_view[key]
    _views_live_after_sweep = len(_by_view)


def _drop(key: int, ref: weakref.ref, ptr: int | None) -> None:
    global _epoch
    with _lock:
        entry = _entries.get(key)
        if entry is not None and entry[0] is ref:
            _epoch += 1
            del _entries[key]
            ids = _by_storage.get(ptr)
            if ids is not None:
                ids.discard(key)
                if not ids:
                    del _by_storage[ptr]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes [start, end) of its storage that a tensor's elements occupy."""
    t = _compat.local_tensor(t)
    return _span_of(t.storage_offset(), t.shape, t.stride(), t.element_size())


def _span_of(offset: int, shape: Any, stride: Any, itemsize: int) -> tuple[int, int]:
    if not all(shape):
        return (0, 0)
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride))
    return offset * itemsize, (offset + extent) * itemsize


def los_overlapping(t: torch.Tensor) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """(owner, lo) for ``t``'s own lo and for every other registered tensor whose elements
    overlap ``t``'s memory (``t`` may be ``p.data`` or ``p.detach()`` of a parameter that
    carries a pair)."""
    own = get_lo(t)
    out = [(t, own)] if own is not None else []
    ptr = _storage_ptr(t)
    start, end = _span(t)
    for key, (ref, lo) in list(_by_view.items()):
        if key[0] != ptr or lo is own or ref.expired():
            continue
        o_start, o_end = _span_of(*key[1:4], lo.element_size())
        if o_start < end and start < o_end:
            out.append((None, lo))  # a pair registered by view: no owner object
    ids = _by_storage.get(ptr)
    if not ids:
        return out
    for key in list(ids):
        entry = _entries.get(key)
        other = entry[0]() if entry is not None else None
        if other is None or other is t:
            continue
        o_start, o_end = _span(other)
        if o_start < end and start < o_end:
            out.append((other, entry[1]))
    return out


def any_registered(ids: set[int]) -> bool:
    """Whether any tensor of these ids (``id(t)``) is alive and carries a pair."""
    for i in ids:
        entry = _entries.get(i)
        if entry is not None and entry[0]() is not None:
            return True
    return False


def get_lo(t: torch.Tensor) -> torch.Tensor | None:
    """The lo component of ``t`` if it has one (no allocation)."""
    entry = _entries.get(id(t))
    if entry is None or entry[0]() is not t:
        return _view_lo(t)
    return entry[1]


def has_pair(t: torch.Tensor) -> bool:
    """Whether ``t`` (or the tensor it is an exact alias of) carries a lo component."""
    return get_lo(t) is not None or _exact_alias_lo(t) is not None


def _exact_alias_lo(t: torch.Tensor) -> torch.Tensor | None:
    """The lo of a tensor registered by identity that is exactly ``t``'s view (``t`` is
    its ``detach()`` or ``.data``)."""
    ids = _by_storage.get(_storage_ptr(t))
    if not ids:
        return None
    key = _view_key(t)
    for i in list(ids):
        entry = _entries.get(i)
        other = entry[0]() if entry is not None else None
        if other is not None and other is not t and _view_key(other) == key:
            return entry[1]
    return None


def empty_lo(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised lo for ``t`` (real or fake), of ``t``'s dtype unless given (an
    exact remainder: :data:`remainder.DTYPE`): the tensor's own strides where it is
    dense (a transposed weight's lo is transposed too, so the fused kernel walks both
    alike), contiguous otherwise (a strided view of a larger buffer: lo holds only the
    elements of the view).  A DTensor's lo is a DTensor on the same mesh and placements,
    each rank holding the lo of its own shard."""
    if replay.capturing:  # a lo made here would be zeroed again by every replay
        raise RuntimeError("collage: a pair created inside the capture of a whole step")
    dtype = dtype or t.dtype
    if _compat.is_dtensor(t):
        return _compat.dtensor_like(t, empty_lo(_compat.local_tensor(t), dtype))
    if _compat.is_non_overlapping_and_dense(t):
        return torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=t.device)
    return torch.empty(t.size(), dtype=dtype, device=t.device)


def is_remainder(lo: torch.Tensor) -> bool:
    """Whether ``lo`` is an exact remainder (``mode="exact"``) rather than a pair's lo."""
    return lo.dtype == remainder.DTYPE


def fits(lo: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``lo`` is a lo of ``t``: ``t``'s dtype (or a remainder's), shape, device
    and layout."""
    return _fits(lo, t)


def _fits(
    lo: torch.Tensor, t: torch.Tensor, any_device: bool = False, any_layout: bool = False
) -> bool:
    dense = _compat.is_non_overlapping_and_dense(t)
    return (
        lo.dtype in (t.dtype, remainder.DTYPE)
        and lo.shape == t.shape
        and (any_device or lo.device == t.device)
        and (any_layout or (lo.stride() == t.stride() if dense else lo.is_contiguous()))
    )


def lo_for(
    t: torch.Tensor, by_view: bool = False, exact: bool = False, name: str = ""
) -> torch.Tensor:
    """The lo component of ``t``, allocated as zeros on first use: a pair's lo, or with
    ``exact`` an int16 remainder (``mode="exact"``, bf16 tensors only).

    ``by_view``: ``t`` may be an alias made for this call (an argument of a compiled
    function): use the pair of the tensor it is an exact alias of, else register the new lo
    by view, alive while the storage is.

    A lo that no longer fits its tensor (``module.half()`` or ``param.data = ...`` changed
    the dtype or shape under it) describes a value that is gone: it is replaced by zeros,
    with a one-time warning naming the tensor's shape.  One on another device or in
    another layout (``module.to(device)``, ``module.to(memory_format=...)``: the same
    values, moved) is moved with them.  A lo of the
    other kind is converted (:func:`_convert`), with a one-time warning naming ``name``.
    """
    global _epoch
    lo = get_lo(t)
    if lo is not None and _fits(lo, t):
        return _of_kind(t, lo, exact, name)
    if lo is not None and not by_view and _fits(lo, t, any_device=True, any_layout=True):
        # ``module.to(device)``, ``module.to(memory_format=...)``: the values moved, so
        # their corrections move too, into the tensor's new layout
        with torch.no_grad():
            moved = empty_lo(t, lo.dtype).copy_(lo)
        return _of_kind(t, _replace(t, moved), exact, name)
    if t.dtype not in LOW_PRECISION:
        raise TypeError(f"collage: lo requested for a {t.dtype} tensor of shape {tuple(t.shape)}")
    if exact:
        check_exact_dtype(t, name)
    dtype = remainder.DTYPE if exact else None
    if by_view:
        lo = _exact_alias_lo(t)
        if lo is not None and _fits(lo, t):
            return _of_kind(t, lo, exact, name)
        with _lock, torch.no_grad():
            lo = empty_lo(t, dtype).zero_()
            if len(_by_view) >= 2 * _views_live_after_sweep + 64:
                _sweep_views()
            _by_view[_view_key(t)] = (_compat.storage_weakref(t), lo)
            _epoch += 1
        return lo
    with _lock:
        lo = get_lo(t)
        if lo is None or not _fits(lo, t):
            if lo is not None:
                _warn_refit(lo, t, name)
            with torch.no_grad():
                lo = empty_lo(t, dtype).zero_()
            _register(t, lo)
    return _of_kind(t, lo, exact, name)


def check_exact_dtype(t: torch.Tensor, name: str = "") -> None:
    """Raise a TypeError naming ``t`` unless it is bf16, the one dtype a remainder holds."""
    if t.dtype == torch.bfloat16:
        return
    what = name or f"a tensor of shape {tuple(t.shape)}"
    raise TypeError(
        f"collage: mode='exact' holds bf16 tensors only, and {what} is "
        f"{str(t.dtype).replace('torch.', '')}: fp16 has 5 exponent bits where fp32 has 8, so "
        "no 16-bit remainder makes an fp16 value exact (docs/numerics.md).  Train it in bf16, "
        "or use mode='plus'"
    )


def _of_kind(t: torch.Tensor, lo: torch.Tensor, exact: bool, name: str) -> torch.Tensor:
    return lo if is_remainder(lo) == exact else _convert(t, lo, exact, name)


def _convert(t: torch.Tensor, lo: torch.Tensor, exact: bool, name: str) -> torch.Tensor:
    """Replace ``lo`` by the other kind of lo for the same value, keeping hi and whatever
    was recorded about it (a checkpoint's pending checksum included).

    To a remainder: the fp32 value ``hi + lo`` less hi's pattern, in int32 arithmetic, as
    :func:`remainder.join` adds it back.  A pair rounds hi to nearest even, so where its
    value lies exactly halfway above an even hi the remainder would need +0x8000, one past
    int16: it keeps 0x7FFF (one fp32 ulp below the value); where a pair's value does not
    share hi's sign or binade (hi = 0 under a tiny lo) it keeps 0 (the value is hi).  From
    a remainder: lo is the fp32 value less hi, rounded to the tensor's dtype (what a pair
    holds)."""
    if exact:
        check_exact_dtype(t, name)
    new = as_remainder(t, lo) if exact else as_pair(t, lo)
    with _lock:
        _swap(lo, new)
    what = name or f"a tensor {tuple(t.shape)}"
    pair, rem = "a (hi, lo) pair's lo", "an exact remainder (mode='exact')"
    had, gets = (pair, rem) if exact else (rem, pair)
    warn_once(
        ("convert", what, gets),
        f"collage: {what} carried {had} and is now updated by a graph that keeps {gets} "
        "(a checkpoint of another mode, or a step compiled with another mode): it continues "
        "from the same value, held as the new kind (docs/checkpoints.md)",
        stacklevel=4,
    )
    return new


def as_remainder(t: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """A pair's ``lo`` of bf16 ``t`` as the remainder of the same value (:func:`_convert`
    says where it is not exact)."""
    with torch.no_grad():
        hi = t.detach()
        v = mcf.value(hi, lo)
        diff = v.view(torch.int32).long() - hi.float().view(torch.int32).long()
        ok = (diff >= -0x8000) & (diff <= 0x8000) & (v == v)
        rem = torch.where(ok, diff.clamp(max=0x7FFF), 0)
        return empty_lo(t, remainder.DTYPE).copy_(rem)


def as_pair(t: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """A remainder of ``t`` as a pair's lo: the exact value less hi, rounded to ``t``'s dtype."""
    with torch.no_grad():
        hi = t.detach()
        return empty_lo(t).copy_((remainder.join(hi, rem) - hi.float()).to(t.dtype))


def _swap(old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` wherever the registry holds ``old``; the caller holds ``_lock``."""
    global _epoch
    _epoch += 1
    for key, (ref, lo) in list(_entries.items()):
        if lo is old:
            _entries[key] = (ref, new)
    for key, (ref, lo) in list(_by_view.items()):
        if lo is old:
            _by_view[key] = (ref, new)
    recorded = _stamps.pop(id(old), None)
    version = _versions.pop(id(old), None)
    if recorded is not None and recorded.lo() is old:
        # the old lo may live on (a graph's cached list): nothing is checked through it now
        _stamps[id(new)] = _Stamp(_lo_ref(new), *recorded[1:])
        _versions[id(new)] = version


def _register(t: torch.Tensor, lo: torch.Tensor) -> None:
    """Make ``lo`` the pair of ``t`` (by identity); the caller holds ``_lock``."""
    global _epoch
    _epoch += 1
    key, ptr = id(t), _storage_ptr(t)
    old = _entries.get(key)
    if old is not None:  # re-fitted: the tensor may sit on a new storage now
        for ids in _by_storage.values():
            ids.discard(key)
        if old[1] is not lo:
            # the replaced lo may live on (a compiled graph's cached list holds it until its
            # next call): what was recorded for it no longer describes this tensor
            _stamps.pop(id(old[1]), None)
            _versions.pop(id(old[1]), None)
    by_view = _by_view.pop(_view_key(t), None) if _by_view else None
    if by_view is not None and by_view[1] is not lo:
        # a pair it had as an argument (registered by view) is superseded by this one
        _stamps.pop(id(by_view[1]), None)
        _versions.pop(id(by_view[1]), None)
    ref = weakref.ref(t, lambda r, key=key, ptr=ptr: _drop(key, r, ptr))
    _entries[key] = (ref, lo)
    _by_storage.setdefault(ptr, set()).add(key)


def _replace(t: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Register ``lo`` for ``t`` keeping what was known about the old pair's hi (a lo that
    moved device with its tensor still belongs to the same values)."""
    old = get_lo(t)
    recorded = _stamps.get(id(old)) if old is not None else None
    with _lock:
        _register(t, lo)
    if recorded is not None and recorded.lo() is old:
        _, owner, pending, registered = recorded
        # the move gave the tensor a new version counter: re-read it
        _stamps[id(lo)] = _Stamp(_lo_ref(lo), owner, pending, registered)
        _versions[id(lo)] = t._version
    return lo


def set_lo(t: torch.Tensor, lo: torch.Tensor) -> None:
    """Make ``lo`` (copied into ``t``'s layout; an int16 ``lo`` is an exact remainder, any
    other dtype a pair's lo, cast to ``t``'s) the correction of ``t`` and record ``t`` as
    it is now, so that only a later write outside a compiled step invalidates it."""
    if t.dtype not in LOW_PRECISION:
        raise TypeError(f"collage: lo given for a {t.dtype} tensor of shape {tuple(t.shape)}")
    if lo.shape != t.shape:
        raise ValueError(f"collage: lo of shape {tuple(lo.shape)} for a tensor {tuple(t.shape)}")
    exact = is_remainder(lo)
    if exact:
        check_exact_dtype(t)
    with torch.no_grad():
        new = empty_lo(t, lo.dtype if exact else None).copy_(lo)
    with _lock:
        _register(t, new)
    stamp(t, new)


def _warn_refit(lo: torch.Tensor, t: torch.Tensor, name: str = "") -> None:
    shown = f"{name} ({tuple(t.shape)} " if name else f"tensor ({tuple(t.shape)} "
    warnings.warn(
        f"collage: {shown}{str(t.dtype).replace('torch.', '')}, strides {tuple(t.stride())}) "
        f"changed under its lo ({tuple(lo.shape)} {str(lo.dtype).replace('torch.', '')}, "
        f"strides {tuple(lo.stride())}): module.half(), param.data = ...; its lo restarts "
        "from zero (what it held, up to half an ulp of each element, is lost once)",
        CollageWarning,
        stacklevel=3,
    )


def unpair(t: torch.Tensor) -> None:
    """Forget ``t``'s lo: ``t`` is no longer low precision (``module.float()``), so its
    lo describes no value of it."""
    with _lock:
        entry = _entries.get(id(t))
        if entry is None or entry[0]() is not t:
            return
        # registered under the storage it had then (module.float() gave it another)
        ptr = next((ptr for ptr, ids in _by_storage.items() if id(t) in ids), None)
    _drop(id(t), entry[0], ptr)  # as if the tensor had died
    forget(entry[1])


def _current_lo(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s lo, or that of the tensor it is an exact alias of (``p.data``), if it still
    fits ``t`` (a lo left from before ``model.float()`` describes a value that is gone)."""
    lo = get_lo(t)
    if lo is None and t.dtype in LOW_PRECISION:
        lo = _exact_alias_lo(t)
    # a lo laid out otherwise (``module.to(memory_format=...)``) still holds the corrections
    # of the same elements; the next compiled step moves it into the tensor's layout
    if lo is None or not _fits(lo, t, any_layout=True) or written_since_stamp(lo) is not None:
        return None
    return lo


def components(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hi, lo)`` of a tensor: hi is ``t`` itself, lo is ``None`` if it was never upgraded,
    no longer fits it (changed dtype, shape, device or layout), or ``t`` was written outside
    a compiled step since (its version counter moved: the lo belonged to the old values)."""
    return t, _current_lo(t)


def value(t: torch.Tensor) -> torch.Tensor:
    """The fp32 value the optimizer tracks: ``hi + lo`` of a pair, the exact value of a
    remainder (``t.float()`` where there is no lo)."""
    with torch.no_grad():
        lo = _current_lo(t)
        if lo is not None and is_remainder(lo):
            return remainder.join(t.detach(), lo)
        return mcf.value(t.detach(), lo)


def residual(t: torch.Tensor) -> torch.Tensor | None:
    """What the value holds beyond hi, ``value(t) - hi`` in fp32 (exact); None without a lo."""
    lo = _current_lo(t)
    if lo is None:
        return None
    with torch.no_grad():
        return lo.float() if not is_remainder(lo) else value(t) - t.detach().float()


def clear() -> None:
    """Forget every lo component (tests; a fresh start)."""
    global _views_live_after_sweep, _epoch
    with _lock:
        _epoch += 1
        _entries.clear()
        _by_storage.clear()
        _by_view.clear()
        _stamps.clear()
        _versions.clear()
        _views_live_after_sweep = 0


def paired_storages() -> dict[int, list[Any]]:
    """Storage pointer -> what carries a pair on it: the live tensors registered by
    identity, and the shapes of those registered by view (a compiled graph's inputs)."""
    out: dict[int, list[Any]] = {}
    with _lock:
        _sweep_views()
        refs = [ref for ref, _ in _entries.values()]
        views = list(_by_view)
    for t in (r() for r in refs):
        if t is not None:
            out.setdefault(_storage_ptr(t), []).append(t)
    for key in views:
        out.setdefault(key[0], []).append(key[2])
    return out


def count() -> int:
    """How many tensors currently carry a lo component."""
    with _lock:
        _sweep_views()
    return len(_entries) + len(_by_view)


# --------------------------------------------------------------------------------------
# Writes from outside: a lo describes the hi it was computed with.  After every compiled
# call the backend records the version counter of each pair's hi (``_versions``, one dict
# update per call for all of a graph's tensors).  A version that has moved since
# (``load_state_dict``, ``torch.no_grad(): p.fill_``, ``p.detach().copy_``, an update that
# ran eagerly) means hi was written by something else: its old lo would be added back to a
# value it does not belong to, so it is zeroed.  ``detach()`` aliases share their tensor's
# version counter, so a tensor passed in as a fresh alias every call is checked through
# the alias.  A write through ``.data`` is not seen (``.data`` has a version counter of its
# own; README and docs/checkpoints.md say so).  Nothing here reads a tensor's values: no
# device work and no synchronization on the hot path.  A lo restored from a checkpoint
# carries a checksum of the hi it was saved with instead, checked once (the model's weights
# may be loaded after the optimizer's state).

_VERSION = operator.attrgetter("_version")


class _Stamp(NamedTuple):
    lo: weakref.ref  # the lo this describes (ids are reused after it dies)
    owner: weakref.ref | None  # a tensor sharing hi's version counter: registered, or stamped
    pending: tuple[int, int] | None  # checksum of the hi a restored lo was saved with
    registered: bool = True  # owner is registered with lo (not a witness stamped through)


# id(lo) -> _Stamp
_stamps: dict[int, _Stamp] = {}
# id(lo) -> hi's version counter after its last compiled write (None: not known, trust lo)
_versions: dict[int, int | None] = {}


def _forget_stamp(key: int, ref: weakref.ref) -> None:
    entry = _stamps.get(key)
    if entry is not None and entry.lo is ref:
        del _stamps[key]
        _versions.pop(key, None)


def _lo_ref(lo: torch.Tensor) -> weakref.ref:
    key = id(lo)
    return weakref.ref(lo, lambda r: _forget_stamp(key, r))


def _owner_of(lo: torch.Tensor) -> torch.Tensor | None:
    for ref, entry_lo in list(_entries.values()):
        if entry_lo is lo:
            return ref()
    return None


def stamp(t: torch.Tensor, lo: torch.Tensor, pending: tuple[int, int] | None = None) -> None:
    """Record ``t`` (the hi of ``lo``, or an alias sharing its version counter) as it is now."""
    key = id(lo)
    old = _stamps.get(key)
    if old is not None and old.lo() is lo:
        if not old.registered or old.pending != pending:
            # a witness is the tensor stamped through this time
            owner_ref = old.owner if old.registered else weakref.ref(t)
            _stamps[key] = _Stamp(old.lo, owner_ref, pending, old.registered)
    else:
        # the tensor registered with it, else the one it is stamped through (a list that a
        # compiled function is passed every call; a fresh alias such as p.detach() dies at
        # once, and the next alias of the same tensor, sharing its version counter, is
        # checked instead)
        owner = _owner_of(lo)
        registered = owner is not None
        _stamps[key] = _Stamp(
            _lo_ref(lo), weakref.ref(owner if registered else t), pending, registered
        )
    _versions[key] = t._version


def track(t: torch.Tensor, lo: torch.Tensor) -> None:
    """Stamp ``t`` for ``lo`` unless something already did (a stamp that exists keeps the
    version it recorded, so a write since then is still seen)."""
    entry = _stamps.get(id(lo))
    if entry is None or entry.lo() is not lo:
        stamp(t, lo)


def record_versions(lo_ids: list[int], tensors: list[torch.Tensor]) -> None:
    """After a compiled call: the versions of the hi of each lo (by id), in one update."""
    _versions.update(zip(lo_ids, map(_VERSION, tensors)))
    if _offers:  # the call kept these pairs: an optimizer checkpoint's lo no longer applies
        for key in lo_ids:
            _offers.pop(key, None)


# id(lo) -> (lo, a checkpoint's lo for the same tensor, checksum of the hi it was saved
# with): loaded with an optimizer's state while the live pair was intact (see :func:`offer`)
_offers: dict[int, tuple[weakref.ref, torch.Tensor, tuple[int, int]]] = {}


def intact(t: torch.Tensor, lo: torch.Tensor) -> bool:
    """Whether ``lo`` is ``t``'s correction as the last compiled step (or a restore) left
    it: recorded, no checkpoint check pending, ``t`` not written since."""
    entry = _stamps.get(id(lo))
    if entry is None or entry.lo() is not lo or entry.pending is not None:
        return False
    owner = entry.owner() if entry.owner is not None else None
    version = _versions.get(id(lo))
    return version is not None and (owner if owner is not None else t)._version == version


def offer(t: torch.Tensor, lo: torch.Tensor, saved: torch.Tensor, pending: tuple[int, int]) -> None:
    """A lo loaded with an optimizer's state (``saved``, with the checksum of the hi it was
    saved with) for ``t``, whose live pair (``lo``) is intact: loading an optimizer's state
    changes no parameter, so ``lo`` stays.  If the weights are loaded before the next
    compiled step (``opt.load_state_dict`` then ``model.load_state_dict``: a rollback of
    both), that step's :func:`check` takes ``saved`` where they are the ones it was saved
    with; the step drops the offer otherwise."""
    key = id(lo)

    def gone(ref: weakref.ref) -> None:  # the pair died with its offer untaken
        if key in _offers and _offers[key][0] is ref:
            del _offers[key]

    with torch.no_grad():
        copy = torch.empty_like(lo).copy_(saved)
    _offers[key] = (weakref.ref(lo, gone), copy, pending)


def unchanged(lo_ids: list[int], tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor's version is the one recorded for its lo (one comparison when
    nothing was written from outside; a lo without a record counts as changed)."""
    return list(map(_VERSION, tensors)) == list(map(_versions.get, lo_ids))


def forget(lo: torch.Tensor) -> None:
    """Drop what was recorded for ``lo`` (nothing to check before its next use)."""
    _stamps.pop(id(lo), None)
    _versions.pop(id(lo), None)


def written_since_stamp(lo: torch.Tensor) -> str | None:
    """Why the owner of ``lo`` no longer holds the hi it was stamped with, as far as its
    version counter tells (no tensor work: a host check); None if it does (or is unknown)."""
    key = id(lo)
    entry = _stamps.get(key)
    if entry is None or entry.pending is not None or entry.owner is None or entry.lo() is not lo:
        return None
    owner = entry.owner()
    version = _versions.get(key)
    if owner is not None and version is not None and owner._version != version:
        return f"version {version} -> {owner._version}"
    return None


_sweep_keys: list[int] = []


def sweep(budget: int) -> list[tuple[torch.Tensor, str]]:
    """Check up to ``budget`` recorded pairs (round robin over all of them) for a write
    outside a compiled step, by version counter only; returns [(owner, why)] of those
    written.  Nothing is zeroed here (the next compiled step does that, :func:`check`)."""
    global _sweep_keys
    out = []
    for _ in range(min(budget, len(_stamps))):
        if not _sweep_keys:
            _sweep_keys = list(_stamps)
        key = _sweep_keys.pop()
        entry = _stamps.get(key)
        lo = entry.lo() if entry is not None else None
        if lo is None:
            continue
        why = written_since_stamp(lo)
        if why is not None:
            out.append((entry.owner(), why))
    return out


def check(t: torch.Tensor, lo: torch.Tensor, name: str = "") -> str | None:
    """Zero ``lo`` if ``t`` (its hi, or an alias sharing its version counter) was written
    since :func:`stamp` by anything but a compiled step; returns why it was zeroed, None if
    it was kept."""
    key = id(lo)
    entry = _stamps.get(key)
    if entry is None or entry.lo() is not lo:
        return None
    if entry.pending is not None:
        if checksum(t) == entry.pending:
            stamp(t, lo)
            return None
        why = "its weights differ from those it was saved with"
    else:
        version = _versions.get(key)
        owner = entry.owner() if entry.owner is not None else None
        current = (owner if owner is not None else t)._version
        if version is None or current == version:
            return None
        if owner is None and current < version:
            # a fresh alias with a counter of its own (p.data passed in): nothing to compare
            stamp(t, lo)
            return None
        why = f"version {version} -> {current}"
        offered = _offers.pop(key, None)
        if offered is not None and offered[0]() is lo:
            if checksum(t) == offered[2]:  # the weights of the optimizer's checkpoint
                with torch.no_grad():
                    lo.copy_(offered[1])
                stamp(t, lo)
                return None
            why = "its weights differ from those it was saved with"
    with torch.no_grad():
        lo.zero_()
    stamp(t, lo)
    log.debug(
        "collage: %s %s was written outside a compiled step (%s); its lo restarts from zero",
        name or "tensor",
        tuple(t.shape),
        why,
    )
    return why


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums of ``t``'s bit patterns, plain and weighted by a hash of the position:
    equal for equal tensors; equal for different ones only by coincidence (a weight moved
    from one element to another changes the second).

    A DTensor's are sums over the whole tensor, the same on every rank and for any sharding
    (a checkpoint saved on 2 ranks is checked on 1): the weight hashes each element's bits,
    not its position, which no rank knows without the layout of the others; two collective
    sums, run where checkpoints are saved and restored, never per step."""
    with torch.no_grad():
        if _compat.is_dtensor(t):
            bits = t.detach().view(_BITS[t.dtype]).to(torch.int64)
            weights = (bits * 2654435761) % 65521
            plain, weighted = bits.sum(), (bits * (weights + 1)).sum()
            return int(plain.full_tensor()), int(weighted.full_tensor())
        bits = t.detach().reshape(-1).view(_BITS[t.dtype]).to(torch.int64)
        n = bits.numel()
        weights = (torch.arange(n, device=t.device, dtype=torch.int64) * 2654435761) % 65521
        return int(bits.sum()), int((bits * (weights + 1)).sum())
