"""Parameter lists of a given tensor count, in the shape families compile time depends on.

* ``same``: every tensor 4096 elements, as many same-shaped tensors as a model's norm
  weights (Inductor's and our per-shape caches see one shape).
* ``gpt``: GPT layers of width 32 (``benchmarks.metrics_overhead.layer_shapes``): 12
  tensors per layer in 8 shapes.
* ``llama``: Llama layers of small dims: 4 attention matrices (k and v grouped-query
  sized), 3 MLP matrices and 2 RMSNorm weights per layer, plus the embedding, the final
  norm and the output head (a 7B Llama has 32 layers: 291 tensors).

The list is cut or padded with whole layers to the nearest count, so ``count`` is met
to within one layer.
"""

from __future__ import annotations

from benchmarks.metrics_overhead import layer_shapes

FAMILIES = ("same", "gpt", "llama")


def _llama(layers: int, dim: int = 64, hidden: int = 176, vocab: int = 256) -> list:
    kv = dim // 4
    shapes: list[tuple[int, ...]] = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(dim, dim), (kv, dim), (kv, dim), (dim, dim)]
        shapes += [(hidden, dim), (hidden, dim), (dim, hidden)]
        shapes += [(dim,), (dim,)]
    return [*shapes, (dim,), (vocab, dim)]


def family_shapes(family: str, count: int) -> list[tuple[int, ...]]:
    """About ``count`` parameter shapes of ``family`` (see the module docstring)."""
    if family == "same":
        return [(4096,)] * count
    if family == "gpt":
        return layer_shapes(max(1, round(count / 12)), 32)
    if family == "llama":
        return _llama(max(1, round((count - 3) / 9)))
    raise ValueError(f"unknown shape family {family!r}; one of {FAMILIES}")
