"""What an LR scheduler changes in an optimizer's param groups every step: the floats the
backend traces as inputs from the first compile, so a schedule compiles the step once
(docs/training-loops.md)."""

from __future__ import annotations

from typing import Any

# where in a param group a scheduler writes a float (is_scheduled says when it does)
_PATHS: tuple[tuple[Any, ...], ...] = (("lr",), ("momentum",), ("betas", 0))


def is_scheduled(group: dict[str, Any], path: tuple[Any, ...]) -> bool:
    """Whether ``group`` holds at ``path`` a float an LR scheduler changes every step: the
    ``lr`` of a group a scheduler has set ``initial_lr`` in, and the momentum (SGD's
    ``momentum``, Adam's ``betas[0]``) that OneCycleLR and CyclicLR cycle, once they have
    set the group's ``max_momentum``."""
    announced = "initial_lr" if path == ("lr",) else "max_momentum"
    return path in _PATHS and announced in group and isinstance(_item(group, path), float)


def scheduled_floats(group: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The paths in ``group`` of the floats a scheduler changes."""
    return [p for p in _PATHS if is_scheduled(group, p)]


def _item(group: dict[str, Any], path: tuple[Any, ...]) -> Any:
    value: Any = group
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value
