"""Backend configuration: one frozen dataclass (:func:`collage_compile.compiler.uuid` hashes
every field with the passes' source).  A leaf: it imports nothing of ours."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

MODES = ("light", "plus", "all", "exact", "off")
ARITHMETICS = ("fp32", "storage")


@dataclasses.dataclass(frozen=True)
class CollageConfig:
    """What the backend upgrades and how.

    mode:
        ``"light"``: accumulations into parameters (``nn.Parameter`` or leaf tensors that
        require grad), as in the paper's Collage-light, and averages of weights (EMA).
        ``"plus"``: also decay-style accumulators ``x = b*x + (1-b)*y`` with
        ``b >= plus_min_decay`` (AdamW's second moment, RMSprop's square average), as in
        the paper's Collage-plus.  ``"all"``: every low-precision accumulator (momentum
        buffers, first moments, Adagrad sums, BatchNorm running statistics).  ``"exact"``:
        what ``"all"`` upgrades and every other low-precision tensor an optimizer step
        writes, each held as the bf16 tensor plus a 16-bit remainder that together are an
        fp32 value: the step computes what it computes on fp32 tensors, bit for bit
        (bf16 only; ``arithmetic`` does not apply).  ``"off"``:
        nothing; the graph runs as plain Inductor would run it (with ``metrics=True``, the
        same metrics are measured for plain low-precision arithmetic).
        Persistent cost: 2 bytes per upgraded element (a bf16/fp16 lo, or an int16
        remainder); see README.
    plus_min_decay:
        The smallest decay ``b`` that ``mode="plus"`` upgrades.  bf16 resolves relative
        changes of 2^-9: an EMA with ``1 - b`` below that never moves, and near it rounds
        most of each update away.
    arithmetic:
        ``"fp32"``: error-free fp32 double-word arithmetic on the unrounded update, rounded
        once into the (hi, lo) pair, hi to nearest (default; more accurate, same bytes).
        ``"storage"``: the paper's Grow with every operation rounded to the storage dtype,
        bit-identical to running it op by op in eager bf16/fp16.
    metrics:
        Measure, in the same kernels as the update, how much of each parameter update is
        applied (EDQ on hi + lo and on hi, the share of elements whose hi did not move, the
        size of lo): :func:`collage_compile.last_metrics`.  Off by default; off changes
        nothing in the generated code.
    every:
        With ``metrics``, measure one step in ``every`` (the first, then every ``every``-th
        call of each compiled graph, and every call inside
        :func:`collage_compile.measuring`, which :func:`collage_compile.metered` opens
        around the steps it reports), each measured step exactly as with ``every=1``; the
        other steps run a graph compiled without the measurement, chosen per call by the
        backend's wrapper (no recompile, no guard).  Set it to the logging interval or
        larger: a measured step costs about 2x to 4x an unmeasured one on CPU
        (docs/metrics.md).  ``"metered"``: only the calls inside ``measuring()``, that
        is the steps a ``metered`` loop reports.  Compiling takes twice as long (both
        graphs are compiled up front).
    cudagraphs:
        Have Inductor capture each compiled graph as a CUDA graph (its cudagraph trees,
        what ``torch.compile(mode="reduce-overhead")`` turns on, which sets this option for
        ``backend="collage"``).  Every ``lo`` the graph writes is a static input (its
        address is fixed for the tensor's life), the optimizer watch runs outside the
        graph, and a graph Inductor does not capture is named in a CollageWarning with
        Inductor's reason.  Dynamo's guards and Inductor's wrappers still run per call
        (docs/speed.md).  Ignored on CPU, with a warning.
        :func:`collage_compile.compile_optimizer` with ``cudagraphs=True`` instead captures
        the whole optimizer step once and replays it (:mod:`collage_compile.replay`); it
        compiles with ``"step"``: graphs prepared for that capture, which Inductor does
        not capture one by one.
    """

    mode: str = "light"
    arithmetic: str = "fp32"
    plus_min_decay: float = 0.99
    metrics: bool = False
    every: int | Literal["metered"] = 1
    cudagraphs: bool | Literal["step"] = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"collage: mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 < self.plus_min_decay < 1.0:
            raise ValueError(
                f"collage: plus_min_decay must be in (0, 1), got {self.plus_min_decay!r}"
            )
        if not isinstance(self.metrics, bool):
            raise TypeError(f"collage: metrics must be True or False, got {self.metrics!r}")
        if not isinstance(self.cudagraphs, bool) and self.cudagraphs != "step":
            raise TypeError(
                f"collage: cudagraphs must be True, False or 'step', got {self.cudagraphs!r}"
            )
        if self.every != "metered" and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ValueError(f"collage: every must be an int >= 1 or 'metered', got {self.every!r}")
        if self.every != 1 and not self.metrics:
            raise ValueError(
                "collage: every= says how often metrics are measured: set metrics=True"
            )
        if self.arithmetic not in ARITHMETICS:
            raise ValueError(
                f"collage: arithmetic must be one of {ARITHMETICS}, got {self.arithmetic!r}"
            )
        if self.mode == "exact" and self.arithmetic != "fp32":
            raise ValueError(
                "collage: mode='exact' computes on fp32 values, bit for bit; arithmetic= "
                f"chooses how a (hi, lo) pair is updated and does not apply (got {self.arithmetic!r})"
            )

    @property
    def inductor_cudagraphs(self) -> bool:
        """Whether Inductor captures each compiled graph (``cudagraphs=True``)."""
        return self.cudagraphs is True

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
