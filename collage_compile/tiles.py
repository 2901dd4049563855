"""Graphs whose CPU kernels would read a bf16/fp16 tensor through transposed tiles.

Where two tensors of one shape are laid out in different orders (a gradient stored
column-major beside its row-major parameter), Inductor's vectorized C++ kernel loops over
one layout and loads the other through 32x32 tiles it transposes in a stack buffer
(``transpose_mxn``).  For bf16 and fp16 on AVX-512, GCC 12.2 at Inductor's ``-O3``
miscompiles that transpose: in Inductor's kernels once a kernel stores two outputs (it
then transposes the same tile twice), and in a standalone call of the header's function
compiled with Inductor's flags.  The kernel reads garbage, silently, NaN included.
Measured on this project's machine with torch 2.11 and 2.13, plain Inductor too
(``tools/probe_tiles.py``), and every MCF kernel stores two outputs, hi and lo: a light SGD
step went NaN.  ``-fno-tree-loop-distribute-patterns`` or ``-fno-ipa-cp-clone`` compiles
the header right, and float32 tiles are right.

A graph that writes low-precision tensors (an optimizer step) and reads such a mixed
layout is compiled without vectorization where Inductor vectorizes with AVX-512
(:func:`_compat.unvectorized_cpp`), which is correct and slower, and the user is told
once, with the tensors named.  The check is by the inputs' layouts, so it is cautious: a
kernel over partial tiles (a channels-last 3x3 conv weight beside contiguous state) came
out right before, and pays too.  AVX2 kernels transpose bf16 element by element (no
such header code), graphs that write nothing (a forward pass) are left to Inductor as
they are, and CUDA kernels (Triton) have no such tiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from collage_compile import _compat, names
from collage_compile.diagnostics import warn_once

__all__ = ["untiled_if_transposed"]

_LOW = (torch.bfloat16, torch.float16)


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, the order of its dimensions from outermost to innermost), for a CPU
    floating tensor with two or more dimensions longer than 1 (a DTensor by its shard);
    None for anything a kernel cannot read transposed."""
    t = _compat.local_tensor(t)
    if t.device.type != "cpu" or not t.dtype.is_floating_point:
        return None
    shape = tuple(_compat.size_hint(s) for s in t.shape)
    strides = tuple(_compat.size_hint(s) for s in t.stride())
    dims = [d for d, n in enumerate(shape) if n != 1]
    if len(dims) < 2:
        return None
    return shape, tuple(sorted(dims, key=lambda d: -strides[d]))


def transposed_pair(gm: Any, example_inputs: list[Any]) -> tuple[str, str] | None:
    """Two tensors of the graph (inputs or attributes) of one shape laid out in different
    orders, one of them bf16 or fp16, by their display names; None if there are none."""
    seen: dict[tuple[int, ...], tuple[tuple[int, ...], torch.dtype, str]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [(n, v) for n, v in zip(placeholders, example_inputs)]
    values += [(n, _compat.example_value(n)) for n in gm.graph.find_nodes(op="get_attr")]
    for node, value in values:
        if not isinstance(value, torch.Tensor) or (layout := _layout(value)) is None:
            continue
        shape, order = layout
        shown = f"{names.pretty(names.source_name(node))} (strides {tuple(value.stride())})"
        if shape not in seen:
            seen[shape] = (order, value.dtype, shown)
            continue
        first_order, first_dtype, first_shown = seen[shape]
        if order != first_order and (value.dtype in _LOW or first_dtype in _LOW):
            return first_shown, shown
    return None


@contextlib.contextmanager
def untiled_if_transposed(
    gm: Any, example_inputs: list[Any], writes: bool, shown: str
) -> Iterator[bool]:
    """Inside: Inductor compiles without vectorization if the graph ``writes`` and reads a
    low-precision tensor laid out otherwise than another of its shape (said once, naming
    both).  Yields whether it does."""
    pair = transposed_pair(gm, example_inputs) if writes else None
    if pair is None or not _compat.cpp_vectorizes_avx512():  # AVX2 transposes element-wise
        yield False
        return
    warn_once(
        ("transposed-tiles", *pair),
        f"collage: {pair[0]} and {pair[1]} have one shape and different layouts, in "
        f"{shown}.  Inductor's vectorized C++ kernels read such a bf16/fp16 tensor through "
        "transposed tiles, which GCC 12 at -O3 can miscompile on AVX-512 CPUs (silently "
        "wrong values, NaN), so this graph is compiled without vectorization: correct, and "
        "slower.  Keep gradients and optimizer state in their parameter's layout "
        "(docs/limits.md).",
    )
    with _compat.unvectorized_cpp():
        yield True
