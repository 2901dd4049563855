"""How much of each update a precision strategy applies, measured inside the compiled step.

The paper's effective descent quality (Collage, arXiv 2405.03637, section 5):

    EDQ = <dθ_effective, dθ_intended> / ||dθ_intended||²

with dθ_intended the update the optimizer computed (fp32, before any rounding into storage)
and dθ_effective the change of the stored value.  With ``make_backend(metrics=True)`` every
parameter update the backend finds also yields, per tensor and step:

==============  ==============================================================================
``edq``         EDQ of the value the optimizer tracks, hi + lo (plain arithmetic: hi)
``edq_hi``      EDQ of hi alone, the weights the forward pass sees
``imprecision`` share of elements whose hi did not move although their intended update is
                non-zero (the paper's "imprecision percentage", as a fraction)
``lo_rel``      ||lo|| / ||hi|| after the step (0 in plain arithmetic)
==============  ==============================================================================

Only sums leave the kernel: five fp32 reductions per tensor (:data:`FIELDS`; four in plain
arithmetic), computed from values the update already has in registers, inside the update's
kernel (``tests/test_metrics.py`` counts the kernels and loops).  ``lo_rel`` needs no
per-step information: it is computed from the tensors when the metrics are read.  They
stay on the device until :func:`last_metrics` reads them: no host sync inside the step.
Tensors combine as one long vector (sums are added before dividing), so a large tensor
weighs more than a small one, as in the paper.

``mode="off"`` rewrites nothing and measures the same sums around the unchanged writes, so
strategies can be compared in one run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from collage_compile import names, state

__all__ = [
    "FIELDS",
    "intended_delta",
    "last_metrics",
    "measuring",
    "metered",
    "reset_metrics",
    "step_sums",
]

log = logging.getLogger("collage_compile.metrics")

# what a step's sums tensor holds, in order: sum of (dhi * d), of d^2, the stuck and moving
# element counts, and (pairs only) sum of (dlo * d), where dhi / dlo are the effective
# changes of hi / lo and d the intended update
FIELDS = ("dot_hi", "norm", "stuck", "moving", "dot_lo")


# ---- the arithmetic: plain torch functions (eager tensors or fx proxies) ------------------


def intended_delta(old_hi: Any, old_lo: Any, trace: list[tuple[str, tuple[Any, ...]]]) -> Any:
    """The update the optimizer asked for, in fp32: new - old for the step sequence
    ``trace`` applied exactly to old = old_hi + old_lo (fp32 tensors; old_lo may be 0).

    Tracked as a difference d (never as old + d, which would round a small update against
    a large weight): ``add u``: d + u; ``mul c``: d*c + old*(c - 1), with c - 1 taken from the
    constant's two fp32 parts; ``div c``: d/c + old*(1 - c)/c; ``lerp(end, w)``:
    d + (end - old - d)*w; ``set v``: v - old; ``max y``: y - old where y exceeds
    old + d, else d (``min y`` where y is below it).
    """
    d: Any = 0.0  # a Python 0 until a step makes it a tensor (fewer ops in the kernel)
    full = False  # d has old_hi's shape (a step read old_hi)
    for kind, args in trace:
        if kind == "add":
            d = d + args[0] if _nonzero(d) else args[0]
        elif kind == "mul":
            c_hi, c_lo = args
            cm1 = (c_hi - 1.0) + c_lo  # c_hi - 1 is exact for c_hi in [0.5, 2] (Sterbenz)
            moved = old_hi * cm1 + old_lo * cm1 if _nonzero(old_lo) else old_hi * cm1
            d = d * (c_hi + c_lo) + moved if _nonzero(d) else moved
            full = True
        elif kind == "div":
            (c,) = args
            d = d / c + (old_hi + old_lo) * ((1.0 - c) / c)
            full = True
        elif kind == "lerp":
            end, w = args
            d = d + (((end - old_hi) - old_lo) - d) * w
            full = True
        elif kind == "set":
            d = (args[0] - old_hi) - old_lo
            full = True
        elif kind in ("max", "min"):
            (y,) = args
            past = ((old_hi - y) + old_lo) + d  # old + d - y
            take = ((past < 0) if kind == "max" else (past > 0)) | torch.isnan(y)
            d = torch.where(take, (y - old_hi) - old_lo, d)
            full = True
        else:
            raise ValueError(f"unknown step kind {kind!r}")
    # an update made of scalars (or 0-dim tensors) alone moves every element
    return d if full else torch.zeros_like(old_hi) + d


def _nonzero(x: Any) -> bool:
    return not (isinstance(x, float) and x == 0.0)


def step_sums(old_hi: Any, old_lo: Any, new_hi: Any, new_lo: Any, delta: Any) -> Any:
    """The sums of :data:`FIELDS` for one tensor and step, as one fp32 tensor.

    ``old_*`` are fp32, ``new_*`` the stored results (``new_lo`` None in plain arithmetic),
    ``delta`` the intended update.  Differences of storage values are exact in fp32.

    Written for Inductor's C++ scheduler: a reduction whose input it materializes (an
    expression of more than ``realize_opcount_threshold`` ops) gets its own loop over that
    buffer, so each summand here is a few ops on values the update already computed; the
    dot product of hi + lo is split into its hi and lo parts for that reason.
    """
    eff_hi = new_hi.float() - old_hi
    moving = torch.where(delta != 0, 1.0, 0.0)
    sums = [
        (eff_hi * delta).sum(),
        (delta * delta).sum(),
        torch.where(eff_hi == 0, moving, 0.0).sum(),
        moving.sum(),
    ]
    if new_lo is not None:
        sums.append(((new_lo.float() - old_lo) * delta).sum())
    return torch.stack(sums)


def summarize(sums: list[float]) -> dict[str, float]:
    """The metrics of summed :data:`FIELDS` (one tensor's, or several tensors' added)."""
    dot_hi, norm, stuck, moving, dot_lo, lo_sq, hi_sq = sums
    nan = math.nan
    return {
        "edq": (dot_hi + dot_lo) / norm if norm > 0 else nan,
        "edq_hi": dot_hi / norm if norm > 0 else nan,
        "imprecision": stuck / moving if moving > 0 else 0.0,
        "lo_rel": math.sqrt(lo_sq / hi_sq) if hi_sq > 0 else 0.0,
    }


# ---- what the compiled graphs record ---------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One measured tensor of a graph."""

    source: str  # Dynamo's source expression (names.display turns it into a name)
    ref: weakref.ref | None  # the tensor, when known at compile time (get_attr)
    input_index: int | None  # else its position among the graph's inputs


class GraphMetrics:
    """The measured tensors of one compiled graph and the sums of its latest call."""

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self._input_rows = [row for row in rows if row.input_index is not None]
        self.latest: torch.Tensor | None = None
        self.seq = 0
        with _lock:
            _graphs.add(self)

    def record(self, sums: torch.Tensor, args: tuple[Any, ...]) -> None:
        """Called after every call of the graph: keeps the sums tensor (no sync, and no
        work per tensor but for tensors passed in, whose object may change per call)."""
        for row in self._input_rows:
            t = args[row.input_index]
            if row.ref is None or row.ref() is not t:
                row.ref = weakref.ref(t)
        self.latest = sums
        self.seq = next(_seq)


_graphs: weakref.WeakSet[GraphMetrics] = weakref.WeakSet()
_seq = itertools.count(1)
_lock = threading.Lock()


def last_metrics(by: str = "total") -> dict[str, float]:
    """The metrics of the most recent step, read from the device (the one host sync).

    For each live tensor, the sums of the latest compiled call that updated it;
    ``by="total"``: all of them as one vector, keys ``edq``, ``edq_hi``, ``imprecision``,
    ``lo_rel``; ``by="group"``: per optimizer group (``group0/edq``, ...); ``by="tensor"``:
    per tensor name (``fc1.weight/edq``, ...; see :func:`collage_compile.name_tensors`).
    Empty when no graph compiled with ``metrics=True`` has run.
    """
    if by not in ("total", "group", "tensor"):
        raise ValueError(
            f"collage: last_metrics(by=...) takes 'total', 'group' or 'tensor', not {by!r}"
        )
    latest: dict[Any, tuple[int, GraphMetrics, int, torch.Tensor | None]] = {}
    with _lock:
        graphs = [g for g in _graphs if g.latest is not None]
    for g in graphs:
        for i, row in enumerate(g.rows):
            t = row.ref() if row.ref is not None else None
            if row.ref is not None and t is None:
                continue  # the tensor is gone
            key = id(t) if t is not None else (id(g), i)
            if key not in latest or latest[key][0] < g.seq:
                latest[key] = (g.seq, g, i, t)
    values = {
        id(g): g.latest.detach().double().cpu().tolist() for g in {e[1] for e in latest.values()}
    }
    totals: dict[str, list[float]] = {}
    for _, g, i, t in sorted(latest.values(), key=lambda e: (e[0], e[2])):
        row = g.rows[i]
        sums = values[id(g)][i] + [0.0] * (len(FIELDS) - len(values[id(g)][i]))
        sums += _sizes(t)
        if by == "total":
            key = ""
        elif by == "group":
            key = names.group_of(t, row.source) or "ungrouped"
        else:
            key = names.display(t, row.source)
        acc = totals.setdefault(key, [0.0] * len(sums))
        for j, v in enumerate(sums):
            acc[j] += v
    out: dict[str, float] = {}
    for key, sums in totals.items():
        for name, v in summarize(sums).items():
            out[f"{key}/{name}" if key else name] = v
    return out


def _sizes(t: torch.Tensor | None) -> list[float]:
    """[||lo||^2, ||hi||^2] of a tensor now (read when asked, not measured per step: it
    needs no rounding information, and two more reductions in the step would cost loops)."""
    if t is None:
        return [0.0, 0.0]
    lo = state.residual(t)  # a remainder's value less hi; a pair's lo
    with torch.no_grad():
        lo_sq = float(lo.double().square().sum()) if lo is not None else 0.0
        return [lo_sq, float(t.double().square().sum())]


def reset_metrics() -> None:
    """Forget every recorded step (graphs keep measuring; their next call records again)."""
    with _lock:
        for g in _graphs:
            g.latest = None


_measuring = 0  # measuring() blocks open


@contextlib.contextmanager
def measuring() -> Iterator[None]:
    """Every graph compiled with ``metrics=True`` that runs inside this block measures its
    call, whatever its ``every``, so :func:`last_metrics` read after the block describes
    this step (:func:`metered` wraps the steps it reports in it).

        with collage_compile.measuring():
            train_step(batch)
        logger.log(collage_compile.last_metrics(), step=i)

    The block holds for the whole process, every thread.  Open it around the compiled
    call, not inside a compiled function (Dynamo would trace it away)."""
    global _measuring
    with _lock:
        _measuring += 1
    try:
        yield
    finally:
        with _lock:
            _measuring -= 1


def measuring_now() -> bool:
    """Whether a :func:`measuring` block is open (the compiled graphs' wrapper asks)."""
    return _measuring > 0


def metered(
    iterable: Iterable[Any],
    every: int = 1,
    callback: Callable[[int, dict[str, float]], Any] | None = None,
    by: str = "total",
) -> Iterator[Any]:
    """Wrap a training loop's iterable: after every ``every``-th iteration's body, read
    :func:`last_metrics` and hand ``(step, metrics)`` to ``callback`` (default: an INFO
    line on the ``collage_compile.metrics`` logger).  Only those steps sync with the device.

        for step, batch in collage_compile.metered(enumerate(loader), every=50,
                                                   callback=lambda i, m: wandb.log(m, step=i)):
            train_step(batch)

    The body of each reported iteration runs inside :func:`measuring`: what is reported
    is that step's, also with ``make_backend(every=K)``, whose graphs measure one call in
    K otherwise, and ``make_backend(every="metered")``, whose graphs measure only then
    (the optimizer step must run in that body: with gradient accumulation, iterate over
    optimizer steps).  A ``for`` loop that breaks or raises closes the block; an iterator
    kept in a variable and left unfinished must be closed (``it.close()``), or every
    step keeps measuring until it is collected.
    """
    if every < 1:
        raise ValueError(f"collage: metered(every=...) must be >= 1, got {every!r}")
    emit = callback or _log_line
    for step, item in enumerate(iterable):
        if (step + 1) % every:
            yield item
            continue
        with measuring():
            yield item
        m = last_metrics(by)
        if m:
            emit(step, m)


def _log_line(step: int, m: dict[str, float]) -> None:
    log.info("step %d: %s", step, "  ".join(f"{k}={v:.4g}" for k, v in m.items()))
