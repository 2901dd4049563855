"""What an LR scheduler changes in an optimizer's param groups every step: the floats the
backend traces as inputs from the first compile, so a schedule compiles the step once
(docs/training-loops.md)."""

from __future__ import annotations

from typing import Any

# where in a param group a scheduler writes a float (is_scheduled says when it does)
_PATHS: tuple[tuple[Any, ...], ...] = (("lr",), ("momentum",), ("betas", 0))


def is_scheduled(group: dict[str, Any], path: tuple[Any, ...]) -> bool:
    """Whether the float at ``path`` in a param group is one an LR scheduler changes every
    step: the ``lr`` of a group a scheduler has set ``initial_lr`` in, and the momentum
    (SGD's ``momentum``, Adam's ``betas[0]``) that OneCycleLR and CyclicLR cycle, once they
    have set the group's ``max_momentum``."""
    if path == ("lr",):
        return "initial_lr" in group
    return "max_momentum" in group and path in (("momentum",), ("betas", 0))


def scheduled_floats(group: dict[str, Any]) -> list[tuple[Any, ...]]:
    """The paths in ``group`` of the floats a scheduler changes."""
    return [p for p in _PATHS if is_scheduled(group, p) and isinstance(_item(group, p), float)]


def _item(group: dict[str, Any], path: tuple[Any, ...]) -> Any:
    value: Any = group
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value
