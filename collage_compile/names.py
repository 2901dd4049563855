"""Names for the tensors the backend reports on: ``fc1.weight``, not Dynamo's source strings.

Dynamo names a graph input by the expression that reached it, e.g.
``G['model']._modules['2']._parameters['bias']`` or
``L['self'].state[list(L['self'].state.keys())[1]]['exp_avg_sq']``.  :func:`pretty` shortens
those to ``model.2.bias`` and ``state[1].exp_avg_sq``.  Better names come from two places:

- learned: a graph whose inputs are module parameters (the forward graph of a train step,
  compiled before the optimizer's graph) names those tensors after the module path;
- given: :func:`name_tensors` (``model``, ``optimizer``) names parameters after
  ``model.named_parameters()`` and optimizer state after its parameter
  (``fc1.weight.exp_avg_sq``), and gives each parameter its optimizer group.

Names are resolved when a report or metric is read, so naming after compiling works too.
Everything is held weakly: naming keeps no tensor, module or optimizer alive.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from collage_compile._compat import is_fake

__all__ = [
    "display",
    "group_of",
    "name_tensors",
    "of_params",
    "pretty",
    "remember",
    "source_name",
]

_learned: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> name from a graph source
_given: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> name from name_tensors
_groups: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> optimizer group index
_optimizers: list[weakref.ref] = []  # whose state is named when a name is asked for
# optimizer state tensor -> "<its parameter's name>.<key>", or "state[i].<key>" where the
# parameter has none (Dynamo's source gives the key's position: "state[0][2]")
_derived: WeakIdKeyDictionary = WeakIdKeyDictionary()
_names_given = [0]  # bumped whenever a name is given or learned
_derived_at: list[tuple] = [()]  # (_names_given, (id, size) of each state) it was made at


def source_name(node: fx.Node) -> str:
    """Dynamo's source expression for a placeholder or get_attr node (its target if none)."""
    source = getattr(node, "_dynamo_source", None)
    if source is None and node.op == "get_attr":
        owner = node.graph.owning_module
        source = getattr(owner, "_param_name_to_source", {}).get(node.target)
    if source is not None:
        try:
            return str(source.name)
        except Exception:
            pass
    return str(node.target)


# list(L['self'].state.keys())[1] or list(dict.keys(L['self'].state))[1] (innermost first)
_DICT_KEY_INDEX = re.compile(r"list\((?:dict\.keys\(([^()]*)\)|([^()]*)\.keys\(\))\)\[(\d+)\]")
_SCOPE = re.compile(r"\b[LG]\['([^']+)'\]")
_MODULE_ENTRY = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")
_KEY = re.compile(r"\['([^']+)'\]")


def pretty(source: str) -> str:
    """``G['model']._modules['2']._parameters['bias']`` -> ``model.2.bias``;
    ``L['self'].state[list(L['self'].state.keys())[1]]['exp_avg_sq']`` -> ``state[1].exp_avg_sq``;
    ``L['self'].param_groups[0]['params'][3]`` -> ``param_groups[0].params[3]``."""
    s, prev = source, None
    while s != prev:
        prev, s = s, _DICT_KEY_INDEX.sub(r"\3", s)
    s = _SCOPE.sub(r"\1", s)
    s = _MODULE_ENTRY.sub(r".\1", s)
    s = _KEY.sub(r".\1", s)
    return s.removeprefix("self.")


_GROUP = re.compile(r"param_groups\[(\d+)\]")


def group_of(tensor: torch.Tensor | None, source: str) -> str | None:
    """The optimizer group of a parameter: given by :func:`name_tensors`, else read from a
    source ``...param_groups[i]...``; None when neither says."""
    if tensor is not None and tensor in _groups:
        return f"group{_groups[tensor]}"
    m = _GROUP.search(source)
    return f"group{m.group(1)}" if m else None


def display(tensor: torch.Tensor | None, source: str) -> str:
    """The name to show for ``tensor`` (None when not known at compile time)."""
    if tensor is not None:
        _name_optimizer_state()
        for names in (_given, _learned, _derived):
            if tensor in names:
                return names[tensor]
    return pretty(source)


def of_params(optimizer: Any, params: list[Any], limit: int = 4) -> str:
    """``optimizer``'s ``params`` as a user reads them: their names where known, else
    ``param_groups[g].params[i]``; the first ``limit``, then how many more."""
    where = {
        id(p): (g, i)
        for g, grp in enumerate(optimizer.param_groups)
        for i, p in enumerate(grp["params"])
    }
    shown = []
    for p in params[:limit]:
        g, i = where.get(id(p), (0, 0))
        shown.append(display(p, f"param_groups[{g}].params[{i}]"))
    more = f", and {len(params) - limit} more" if len(params) > limit else ""
    return ", ".join(shown) + more


def learn(gm: fx.GraphModule, example_inputs: list[Any]) -> None:
    """Name the module parameters and buffers among a graph's inputs after their module path
    (Dynamo passes the real tensors as example inputs)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if not isinstance(value, torch.Tensor) or is_fake(value) or value in _learned:
            continue
        source = source_name(node)
        if "_parameters[" in source or "_buffers[" in source:
            _learned[value] = pretty(source)
            _names_given[0] += 1


def name_tensors(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    prefix: str = "",
) -> None:
    """Name tensors in reports and metrics: parameters and buffers of ``model`` after their
    module path, the state of ``optimizer`` after its parameter (``fc.weight.exp_avg``),
    and parameters after their optimizer group (``last_metrics(by="group")``).

    Optional: without it, names come from the graphs (see module docstring).  Call it once,
    before or after compiling; it keeps no reference to the model or optimizer."""
    _names_given[0] += 1
    if model is not None:
        for name, p in model.named_parameters(prefix=prefix.rstrip(".")):
            _given[p] = name
        for name, b in model.named_buffers(prefix=prefix.rstrip(".")):
            _given[b] = name
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                _groups[p] = i
        remember(optimizer)


def remember(optimizer: torch.optim.Optimizer) -> None:
    """Name ``optimizer``'s state in reports (after its parameter where that has a name,
    else ``state[i].exp_avg_sq``); every optimizer collage steps is remembered (weakly)."""
    if not any(r() is optimizer for r in _optimizers):
        _optimizers[:] = [r for r in _optimizers if r() is not None]
        _optimizers.append(weakref.ref(optimizer))


def _name_optimizer_state() -> None:
    # state is created lazily by the first (compiled) step: named when a name is asked
    # for, again only when a name was given or learned or a state gained entries since
    live = [opt for opt in (r() for r in _optimizers) if opt is not None]
    # a load replaces the state dict: its id says so where the sizes stay the same
    made_at = (_names_given[0], *((id(opt.state), len(opt.state)) for opt in live))
    if made_at == _derived_at[0]:
        return
    _derived_at[0] = made_at
    for opt in live:
        # state[i]: the parameter's number in opt.state_dict() (its place in param_groups)
        index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        for p, st in opt.state.items():
            if not isinstance(p, torch.Tensor) or not isinstance(st, dict):
                continue  # an optimizer's own entry (MADGRAD's state["k"], a step count)
            base = _given.get(p) or _learned.get(p) or f"state[{index.get(id(p), '?')}]"
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    _derived[v] = f"{base}.{key}"
