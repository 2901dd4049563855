"""The lo components: one per upgraded tensor, keyed by tensor identity, dying with it.

A plain ``WeakKeyDictionary`` would call ``Tensor.__eq__``; ``WeakIdKeyDictionary`` builds a
weak reference on every lookup, too slow for a per-step lookup of every parameter.  This is
an ``id()``-keyed dict whose entries hold a weak reference to their tensor and are removed by
its finalizer, so a lookup is one dict access plus an identity check.
"""

from __future__ import annotations

import threading
import weakref

import torch

from collage_compile.mcf import LOW_PRECISION

__all__ = ["clear", "components", "get_lo", "lo_for", "value"]

_lock = threading.Lock()
# id(tensor) -> (weakref to tensor, lo)
_entries: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _drop(key: int, ref: weakref.ref) -> None:
    with _lock:
        entry = _entries.get(key)
        if entry is not None and entry[0] is ref:
            del _entries[key]


def get_lo(t: torch.Tensor) -> torch.Tensor | None:
    """The lo component of ``t`` if it has one (no allocation)."""
    entry = _entries.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]


def lo_for(t: torch.Tensor) -> torch.Tensor:
    """The lo component of ``t``, allocated as zeros (same dtype, device and layout) on first use."""
    lo = get_lo(t)
    if lo is not None:
        return lo
    if t.dtype not in LOW_PRECISION:
        raise TypeError(f"collage: lo requested for a {t.dtype} tensor of shape {tuple(t.shape)}")
    with _lock:
        lo = get_lo(t)
        if lo is None:
            with torch.no_grad():
                lo = torch.zeros_like(t.detach(), memory_format=torch.preserve_format)
            key = id(t)
            ref = weakref.ref(t, lambda r, key=key: _drop(key, r))
            _entries[key] = (ref, lo)
    return lo


def components(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hi, lo)`` of a tensor: hi is ``t`` itself, lo is ``None`` if it was never upgraded."""
    return t, get_lo(t)


def value(t: torch.Tensor) -> torch.Tensor:
    """The fp32 value ``hi + lo`` that the optimizer tracks (``t.float()`` where there is no lo)."""
    lo = get_lo(t)
    with torch.no_grad():
        if lo is None:
            return t.detach().float()
        return t.detach().float() + lo.float()


def clear() -> None:
    """Forget every lo component (tests; a fresh start)."""
    with _lock:
        _entries.clear()


def count() -> int:
    """How many tensors currently carry a lo component."""
    return len(_entries)
