"""Backend configuration: one frozen dataclass, every field part of the cache key."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

MODES = ("light",)
ARITHMETICS = ("fp32", "storage")


@dataclasses.dataclass(frozen=True)
class CollageConfig:
    """What the backend upgrades and how.

    mode:
        ``"light"``: accumulations into parameters (``nn.Parameter`` or leaf tensors that
        require grad), as in the paper's Collage-light.
    arithmetic:
        ``"fp32"``: error-free fp32 double-word arithmetic on the unrounded update, rounded
        once into the (hi, lo) pair, hi to nearest (default; more accurate, same bytes).
        ``"storage"``: the paper's Grow with every operation rounded to the storage dtype,
        bit-identical to running it op by op in eager bf16/fp16.
    """

    mode: str = "light"
    arithmetic: str = "fp32"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"collage: mode must be one of {MODES}, got {self.mode!r}")
        if self.arithmetic not in ARITHMETICS:
            raise ValueError(
                f"collage: arithmetic must be one of {ARITHMETICS}, got {self.arithmetic!r}"
            )

    @classmethod
    def from_options(cls, options: dict[str, Any] | None = None, **kwargs: Any) -> CollageConfig:
        """Build from ``torch.compile(..., options={...})`` and/or keyword arguments."""
        merged = dict(options or {})
        merged.update(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - names)
        if unknown:
            raise TypeError(f"collage: unknown option(s) {unknown}; known: {sorted(names)}")
        return cls(**merged)

    def uuid(self) -> str:
        """A stable hash of every field (and the pass list), for cache keys."""
        from collage_compile import passes

        text = repr(dataclasses.astuple(self)) + passes.uuid()
        return hashlib.sha256(text.encode()).hexdigest()[:16]
