"""The warning users see, given once per cause.  A leaf: it imports nothing of ours."""

from __future__ import annotations

import threading
import warnings

__all__ = ["CollageWarning", "reset_warnings", "warn_once"]


class CollageWarning(UserWarning):
    """Compensation was lost, or could not be given: a low-precision accumulation the
    backend found but could not upgrade, or a step that ran without a collage graph."""


_warned: set[tuple[str, ...]] = set()
_seen: dict[tuple[str, ...], int] = {}
_lock = threading.Lock()


def warn_once(key: tuple[str, ...], message: str, stacklevel: int = 2) -> bool:
    """A CollageWarning, given once per ``key`` for the life of the process (or until
    :func:`reset_warnings`); True if it was given now."""
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(message, CollageWarning, stacklevel=stacklevel + 1)
    return True


def occurrence(key: tuple[str, ...]) -> int:
    """How many times ``key`` has been seen, this one included (until
    :func:`reset_warnings`): a cause said once and again when it recurs."""
    with _lock:
        _seen[key] = _seen.get(key, 0) + 1
        return _seen[key]


def reset_warnings() -> None:
    with _lock:
        _warned.clear()
        _seen.clear()
