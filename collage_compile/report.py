"""What the backend found in each graph, and one-time warnings for what it could not upgrade."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from collage_compile import _compat, names
from collage_compile.accumulators import readable_name, real_value, storage_key
from collage_compile.diagnostics import CollageWarning, reset_warnings, warn_once
from collage_compile.mcf import LOW_PRECISION as _LOW

__all__ = [
    "CollageWarning",
    "Explanation",
    "GraphReport",
    "explain",
    "record",
    "reports",
    "reset_warnings",
    "warn_once",
]

log = logging.getLogger("collage_compile")

_reports: collections.deque[GraphReport] = collections.deque(maxlen=256)
_graph_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class Entry:
    tensor: str  # readable name
    shape: tuple[int, ...]
    dtype: str
    role: str  # "param" / "tensor"
    pattern: str  # e.g. "add_", "copy_(fma)", "_fused_adamw_"
    applied: bool
    reason: str = ""
    warn: bool = False  # not upgraded although the mode asks for it: warned about once
    ref: Any = dataclasses.field(default=None, compare=False, repr=False)  # weakref, if known

    @property
    def name(self) -> str:
        """The tensor's name as shown (see :mod:`collage_compile.names`)."""
        return names.display(self.ref() if self.ref is not None else None, self.tensor)


# reason -> the live tensors named for it, each with a number of its own (never reused,
# unlike an id): another model's or optimizer's tensors of the same names (a sweep in one
# process, torch._dynamo.reset() between runs) are named again
_told: dict[str, WeakIdKeyDictionary] = {}
_numbers = itertools.count()


def _untold(reason: str, entries: list[Entry]) -> list[str] | None:
    """Ids of the tensors of ``entries`` not named for ``reason`` yet (all of them then
    marked named): empty where every one was; None where none is known (then the names
    alone say whether it was)."""
    told = _told.setdefault(reason, WeakIdKeyDictionary())
    live = [t for e in entries if e.ref is not None and (t := e.ref()) is not None]
    if not live:
        return None
    new = [t for t in live if t not in told]
    for t in new:
        told[t] = next(_numbers)
    return [str(told[t]) for t in new]


@dataclasses.dataclass
class GraphReport:
    entries: list[Entry]
    mode: str
    arithmetic: str
    graph_id: int = dataclasses.field(default_factory=lambda: next(_graph_ids))

    @classmethod
    def build(
        cls, info: Any, sites: dict[Any, Any], unsupported: list[Any], config: Any
    ) -> GraphReport:
        fused = _compat.fused_optimizer_ops()
        entries = []
        for w in info.writes:
            acc = w.acc
            shape = tuple(int(s) if _is_int(s) else -1 for s in acc.example.shape)
            dtype = str(acc.dtype).replace("torch.", "")
            site = sites.get(w)
            if site is not None:
                pattern, applied, reason, warn = site.pattern, True, "", False
            elif not acc.eligible:
                pattern, applied, reason, warn = w.op, False, acc.reason, acc.warn
            else:
                pattern, applied, reason, warn = w.op, False, _why(w, fused), True
            entries.append(
                Entry(
                    acc.name,
                    shape,
                    dtype,
                    acc.role,
                    pattern,
                    applied,
                    reason,
                    warn,
                    ref=_ref_of(info, acc.node),
                )
            )
        entries.extend(_other_writes(info))
        if config.mode in ("light", "plus", "all"):
            entries.extend(_replaced_state(info, config.mode))
        return cls(entries, config.mode, config.arithmetic)

    def warn_unsupported(self) -> None:
        """One warning per reason: the tensors it leaves (four shown) and their writes."""
        by_reason: dict[str, dict[tuple[Any, ...], list[Any]]] = {}
        for e in self.entries:
            if e.applied or not e.warn:
                continue
            tensors = by_reason.setdefault(e.reason, {})
            tensors.setdefault((e.tensor, e.shape, e.dtype), [e, []])[1].append(e.pattern)
        for reason, tensors in by_reason.items():
            patterns = list(dict.fromkeys(p for _, ps in tensors.values() for p in ps))
            shown = [f"{e.name} (shape {list(e.shape)}, {e.dtype})" for e, _ in tensors.values()]
            more = f", and {len(shown) - 4} more" if len(shown) > 4 else ""
            untold = _untold(reason, [e for e, _ in tensors.values()])
            if untold == []:
                continue  # every one of them named for it already
            warn_once(
                (reason, *map(str, tensors), *(untold or ())),
                f"collage: not upgraded: {' + '.join(patterns)} on {', '.join(shown[:4])}{more}: "
                f"{reason}",
                stacklevel=3,
            )

    def rows(self) -> list[tuple[str, ...]]:
        """One row per tensor and outcome: (tensor, shape, dtype, patterns, upgraded, reason);
        the writes of one tensor with the same outcome are merged (``mul_ + addcdiv_``)."""
        merged: dict[tuple[Any, ...], list[Any]] = {}
        for e in self.entries:
            key = (e.tensor, e.shape, e.dtype, e.applied, e.reason)
            if key in merged:
                if e.pattern not in merged[key][1]:
                    merged[key][1].append(e.pattern)
            else:
                merged[key] = [e, [e.pattern]]
        rows = []
        for e, patterns in merged.values():
            rows.append(
                (
                    e.name,
                    str(list(e.shape)),
                    e.dtype,
                    " + ".join(patterns),
                    f"yes ({self.mode})" if e.applied else "no",
                    e.reason,
                )
            )
        return rows

    def summary(self) -> str:
        head = f"graph {self.graph_id} (mode={self.mode!r}, arithmetic={self.arithmetic!r})"
        if not self.entries:
            return f"{head}: writes no persistent tensor (nothing to upgrade)"
        upgraded = {e.tensor for e in self.entries if e.applied}
        left = {e.tensor for e in self.entries if not e.applied} - upgraded
        sites = sum(e.applied for e in self.entries)
        return (
            f"{head}: {len(upgraded)} tensors upgraded ({sites} writes), "
            f"{len(left)} left as written"
        )

    def format(self) -> str:
        if not self.entries:
            return self.summary()
        return self.summary() + "\n" + _table(self.rows())


_HEADER = ("tensor", "shape", "dtype", "pattern", "upgraded", "reason")


def _table(rows: list[tuple[str, ...]]) -> str:
    rows = [_HEADER, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


class Explanation:
    """What the backend did in a set of compiled graphs; ``print()`` it for a table.

    ``graphs``: the :class:`GraphReport` of each graph; ``upgraded`` / ``skipped``: the
    entries (one per tensor write) of all of them."""

    def __init__(self, graphs: list[GraphReport]):
        self.graphs = graphs

    @property
    def upgraded(self) -> list[Entry]:
        return [e for g in self.graphs for e in g.entries if e.applied]

    @property
    def skipped(self) -> list[Entry]:
        return [e for g in self.graphs for e in g.entries if not e.applied]

    def __str__(self) -> str:
        if not self.graphs:
            return "collage: no graph compiled with the collage backend yet"
        return "\n\n".join(g.format() for g in self.graphs)

    def __repr__(self) -> str:
        return f"<collage Explanation of {len(self.graphs)} graph(s)>\n{self}"


def explain(fn: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Explanation:
    """What the collage backend found and did.

    ``explain()``: every graph compiled with it so far (the latest 256).
    ``explain(fn, *args, **kwargs)``: calls ``fn(*args, **kwargs)`` (a function compiled
    with the backend) and explains the graphs that call compiled; nothing when it compiled
    none (already compiled: call ``torch._dynamo.reset()`` first, or use ``explain()``)."""
    if fn is None:
        return Explanation(reports())
    with _reports_lock:
        before = _reports[-1].graph_id if _reports else 0
    fn(*args, **kwargs)
    return Explanation([r for r in reports() if r.graph_id > before])


def _other_writes(info: Any) -> list[Entry]:
    """Entries for the graph's inputs it writes that are not low precision (fp32 step
    counters, fp32 master weights): left as written, nothing to compensate."""
    written = info.written_storages()
    if not written:
        return []
    low = {storage_key(a.example) for a in info.accumulators}
    entries = []
    for node in info.gm.graph.nodes:
        if node.op not in ("placeholder", "get_attr"):
            continue
        ex = _compat.example_value(node)
        if not isinstance(ex, torch.Tensor) or ex.dtype in _LOW:
            continue
        key = storage_key(ex)
        if key is None or key not in written or key in low:
            continue
        shape = tuple(int(s) if _is_int(s) else -1 for s in ex.shape)
        dtype = str(ex.dtype).replace("torch.", "")
        entries.append(
            Entry(
                readable_name(node),
                shape,
                dtype,
                "tensor",
                "written",
                False,
                f"{dtype} is not low precision: left as written",
                ref=_ref_of(info, node),
            )
        )
    return entries


def _replaced_state(info: Any, mode: str) -> list[Entry]:
    """Entries for optimizer state the step replaces instead of updating it in place
    (``state["v"] = b2 * v + (1 - b2) * g * g``, AdaLite's factors): an input reached
    through an optimizer's ``state`` that the graph reads and does not write, from which
    it computes a new tensor of the same shape and dtype that it returns (the new state,
    stored by Dynamo after the call).  The
    families follow writes: the new tensor has no pair, the rounding of every step is
    lost.  Named under plus and all, which promise to carry state; light leaves state by
    definition (listed, not warned).  ``mode="exact"`` carries it (new state returned with
    its remainder, read back with it)."""
    written = {w.acc for w in info.writes}
    state = {
        a.node: a
        for a in info.accumulators
        if a not in written
        and not a.is_weight
        and a.node.users
        and _compat.is_optimizer_state_input(a.node)
    }
    if not state:
        return []
    output = next(n for n in info.gm.graph.nodes if n.op == "output")
    new = [
        n
        for n in output.all_input_nodes
        if n.op not in ("placeholder", "get_attr")
        and isinstance(_compat.example_value(n), torch.Tensor)
    ]
    if not new:  # an in-place step returns nothing: the usual case costs nothing
        return []
    reads: dict[Any, set[Any]] = {}  # node -> the state inputs it is computed from
    for node in info.gm.graph.nodes:  # in order: inputs before their users
        reads[node] = {node} if node in state else set()
        for i in node.all_input_nodes:
            reads[node] |= reads[i]
    replaced: dict[Any, None] = {}
    for out in new:
        ex = _compat.example_value(out)
        for node in reads[out]:
            old = state[node].example
            if ex.dtype == old.dtype and tuple(ex.shape) == tuple(old.shape):
                replaced[node] = None
    entries = []
    for node in replaced:
        acc = state[node]
        shape = tuple(int(s) if _is_int(s) else -1 for s in acc.example.shape)
        entries.append(
            Entry(
                acc.name,
                shape,
                str(acc.dtype).replace("torch.", ""),
                acc.role,
                "replaced",
                False,
                "the step returns a new tensor computed from it (state[...] = b * v + ..., "
                f"not v.mul_(b).add_(...)), which has no pair: mode={mode!r} carries state "
                "updated in place only; update it in place, or use mode='exact'",
                warn=mode != "light",
                ref=_ref_of(info, node),
            )
        )
    return entries


def _ref_of(info: Any, node: Any) -> Any:
    """A weak reference to the real tensor behind an input node, if known at compile time."""
    real = real_value(info, node)
    if isinstance(real, torch.Tensor) and not _compat.is_fake(real):
        return weakref.ref(real)
    return None


def _is_int(x: Any) -> bool:
    try:
        int(x)
        return True
    except Exception:
        return False


def _why(write: Any, fused: dict[Any, str]) -> str:
    target = write.node.target
    if target in fused:
        return (
            f"torch.optim {fused[target]} runs one opaque kernel that cannot be rewritten; "
            "construct the optimizer with foreach=True (or foreach=False) instead"
        )
    if not write.full_alias:
        return "the write goes through a view of the tensor; lo restarts from zero after it, every call"
    return (
        f"{write.op} is not an accumulation the backend can carry exactly; lo restarts from "
        "zero after it, every call"
    )


_reports_lock = threading.Lock()


def record(rep: GraphReport) -> None:
    with _reports_lock:
        _reports.append(rep)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("collage: %s", rep.format())
    else:
        log.info("collage: %s", rep.summary())


def reports() -> list[GraphReport]:
    """Reports of the most recently compiled graphs (oldest first)."""
    with _reports_lock:
        return list(_reports)
