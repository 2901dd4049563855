"""An fp32 working copy of a weight, updated in place and copied back, spelled out of place.

Before (Hugging Face's ``Adafactor``, timm's ``AdaBelief`` and ``Adafactor``: optimizers
that support bf16 weights compute their step on an fp32 copy)::

    p_fp32 = p.float()
    p_fp32.add_(p_fp32, alpha=-wd * lr)
    p_fp32.add_(-update)
    p.copy_(p_fp32)

After::

    w0 = p.float()
    w1 = w0.add(w0, alpha=-wd * lr)
    w2 = w1.add(-update)
    p.copy_(w2)

which :mod:`~collage_compile.passes.copy_expr` reads as an affine update of ``p``'s old
value (here a decay, then an addition) and carries on the pair.

Why: the families follow values, not writes to a temporary, so the copy back read as an
expression they could not walk: it was named ("not an accumulation") and ``lo`` restarted
every step, the weights no better than plain bf16.  Out of place, each in-place op is the
same fp32 arithmetic.  Only where that holds: the copy is a new tensor (a cast that
changes the dtype, not ``p`` itself), every use of it until the copy back is an in-place
op listed here on it, a read that makes a new tensor, or the copy back; a view of it (whose
later reads would see the writes) leaves the graph as it is.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch
import torch.fx as fx

from collage_compile import _compat
from collage_compile.accumulators import storage_key
from collage_compile.mcf import LOW_PRECISION

_CASTS = {"float", "to", "type"}
_IN_PLACE = {"add_", "sub_", "mul_", "div_", "addcdiv_", "addcmul_", "lerp_", "neg_"}


def run(gm: fx.GraphModule) -> int:
    """Rewrite each working copy's in-place ops out of place; returns how many copies."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    n = 0
    for node in list(order):
        if _is_working_copy(node):
            ops = _in_place_ops(node, order)
            if ops:
                _out_of_place(gm.graph, node, ops, order)
                n += 1
    return n


def _is_working_copy(node: fx.Node) -> bool:
    """A cast of a low-precision tensor to a wider float: a new tensor."""
    if node.op != "call_method" or node.target not in _CASTS or not node.args:
        return False
    src, value = node.args[0], _compat.example_value(node)
    source = _compat.example_value(src) if isinstance(src, fx.Node) else None
    return (
        isinstance(value, torch.Tensor)
        and isinstance(source, torch.Tensor)
        and source.dtype in LOW_PRECISION
        and value.dtype.is_floating_point
        and value.dtype.itemsize > source.dtype.itemsize
        and storage_key(value) != storage_key(source)
    )


def _in_place_ops(cast: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The in-place ops on the copy, in order, if it is copied back into its source after
    them and is never viewed; else None.  Visits the uses of the copy alone, in order."""
    src, key = cast.args[0], storage_key(_compat.example_value(cast))
    aliases, ops = {cast}, []
    queue = [(order[u], u) for u in cast.users]
    heapq.heapify(queue)
    seen = set()
    while queue:
        _, node = heapq.heappop(queue)
        if node in seen:
            continue
        seen.add(node)
        if _in_place_on(node, aliases):
            ops.append(node)
            aliases.add(node)
            for u in node.users:
                heapq.heappush(queue, (order[u], u))
        elif _copies_back(node, src, aliases):
            return ops if ops and _chained(ops, node) else None
        elif _shares(node, key):
            return None  # a view of the copy, or a write through one
    return None


def _chained(ops: list[fx.Node], back: fx.Node) -> bool:
    """Whether each op's result is used only by the next op, as the copy it writes (the
    last op's: by the copy back): a result read anywhere else is the copy itself, whose
    later value the rewrite would not give it."""
    for k, op in enumerate(ops):
        following = ops[k + 1] if k + 1 < len(ops) else back
        for u in op.users:
            if u is not following or u.args[0 if u is not back else 1] is not op:
                return False
    return True


def _in_place_on(node: fx.Node, aliases: set[fx.Node]) -> bool:
    """An op listed here on the copy, or a ``copy_`` into it of a value of its dtype and
    shape (how Dynamo spells ``addcdiv_`` with a symbolic ``value``: ``fma`` then ``copy_``)."""
    if node.op != "call_method" or not node.args or node.args[0] not in aliases:
        return False
    if node.target in _IN_PLACE:
        return True
    return node.target == "copy_" and len(node.args) == 2 and not node.kwargs and _same(node)


def _same(copy: fx.Node) -> bool:
    """A ``copy_`` into the copy of a value computed for it alone (of its dtype and shape,
    used nowhere else), which the copy can become: not another tensor, whose later
    writes the copy would then share."""
    src = copy.args[1]
    if not isinstance(src, fx.Node) or src.op not in ("call_function", "call_method"):
        return False
    if len(src.users) != 1:
        return False
    dst, value = _compat.example_value(copy.args[0]), _compat.example_value(src)
    return (
        isinstance(dst, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and (value.dtype, value.shape) == (dst.dtype, dst.shape)
    )


def _copies_back(node: fx.Node, src: Any, aliases: set[fx.Node]) -> bool:
    return (
        node.op == "call_method"
        and node.target == "copy_"
        and len(node.args) == 2
        and node.args[0] is src
        and node.args[1] in aliases
        and not node.kwargs
    )


def _shares(node: fx.Node, key: Any) -> bool:
    value = _compat.example_value(node)
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and storage_key(v) == key for v in values)


def _out_of_place(
    graph: fx.Graph, cast: fx.Node, ops: list[fx.Node], order: dict[fx.Node, int]
) -> None:
    """Each op becomes its out-of-place form on the copy's latest value, and every later
    use of the copy itself reads the value the ops before it left."""
    current, versions = cast, []
    for op in ops:
        if op.target == "copy_":  # the copy's new value is the source
            new = op.args[1]
        else:
            args = (current, *_replaced(op.args[1:], cast, current))
            kwargs = _replaced(dict(op.kwargs), cast, current)
            with graph.inserting_before(op):
                new = graph.call_method(op.target[:-1], args, kwargs)
            new.meta = _fresh(op.meta)
            order[new] = order[op]  # its place in the graph: later copies' walks read it
        op.replace_all_uses_with(new)
        graph.erase_node(op)
        versions.append((order[op], new))
        current = new
    made = {new for at, new in versions if order[new] == at}
    for user in list(cast.users):
        if user not in made:  # it reads the value the ops before it left
            latest = [new for at, new in versions if at < order[user]]
            if latest:
                user.args, user.kwargs = _replaced((user.args, user.kwargs), cast, latest[-1])


def _fresh(meta: dict[str, Any]) -> dict[str, Any]:
    """The in-place op's metadata for its out-of-place form: a value of its own (the op's
    shares the copy's storage, which later passes would read as an alias)."""
    meta = dict(meta)
    for key in ("example_value", "val"):
        if isinstance(meta.get(key), torch.Tensor):
            meta[key] = meta[key].clone()
    return meta


def _replaced(x: Any, cast: fx.Node, new: fx.Node) -> Any:
    """``x`` with the copy (``cast``) read as ``new``."""
    if isinstance(x, fx.Node):
        return new if x is cast else x
    if isinstance(x, tuple):
        return tuple(_replaced(v, cast, new) for v in x)
    if isinstance(x, list):
        return [_replaced(v, cast, new) for v in x]
    if isinstance(x, dict):
        return {k: _replaced(v, cast, new) for k, v in x.items()}
    return x
