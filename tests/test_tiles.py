"""A gradient laid out otherwise than its parameter from the first step (``tiles.py``).

Inductor's vectorized C++ kernel reads such a bf16 gradient through transposed 32x32 tiles,
and GCC 12 at -O3 miscompiles that transpose on AVX-512 CPUs once a kernel stores two
outputs, as every MCF kernel does (hi and lo): the compiled step went NaN, silently.  Such
a step is now compiled without vectorization, said once.  Where Inductor does not
vectorize with AVX-512 the step was right before too and is left as it is: the tests then
check the numerics and that nothing is said.
"""

from __future__ import annotations

import os
import warnings

import torch
from conftest import drifting_stream, mcf_value, relative_error

import collage_compile
from collage_compile import _compat

SHAPE = (64, 32)  # two 32x32 tiles: what Inductor transposes
STEPS = 12


def _column_major(g: torch.Tensor) -> torch.Tensor:
    return g.t().contiguous().t()


def _train(start, grads, dtype, compiled=True, wrap=lambda g, p: g):
    """AdamW on one matrix; each step's gradient (``wrap``-ped) laid out column-major."""
    p = torch.nn.Parameter(start.to(dtype, copy=True))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, foreach=True)
    if compiled:
        collage_compile.compile_optimizer(opt)
    for g in grads:
        p.grad = wrap(_column_major(g.to(dtype)), p)
        opt.step()
    return p


def _said(rec) -> list[str]:
    return [str(w.message) for w in rec if "compiled without vectorization" in str(w.message)]


def test_a_gradient_column_major_from_the_first_step_is_read_right():
    """Before: the step compiled for the column-major gradient ended NaN on this machine
    (GCC 12.2, AVX-512), plain bf16 finite and 0.9 off, with no word."""
    start, stream = drifting_stream([SHAPE], STEPS)
    grads = [gs[0] for gs in stream]
    ref = _train(start[0], grads, torch.float64, compiled=False)
    plain = _train(start[0], grads, torch.bfloat16, compiled=False)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        compiled = _train(start[0], grads, torch.bfloat16)
    err = relative_error(mcf_value(compiled), ref, start[0])
    err_plain = relative_error(plain, ref, start[0])
    print(f"column-major gradient: {err:.2%} from float64, plain bf16 {err_plain:.2%}")
    assert err < 3e-3 and err_plain > 30 * err, (err, err_plain)
    said = _said(rec)
    if _compat.cpp_vectorizes_avx512():  # else the step was never at risk: no word
        assert len(said) == 1 and "params[0].grad (strides (1, 64))" in said[0], said
    else:
        assert not said, said


def test_a_dtensor_gradient_recompiled_for_another_layout_is_read_right(tmp_path):
    """FSDP2's gradients are DTensors, and Dynamo does guard their shards' strides: a
    shard laid out otherwise recompiles the step, and that graph transposed tiles, NaN
    (one rank, gloo, in this process).  Now it is compiled without vectorization too."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    start, stream = drifting_stream([SHAPE], STEPS)
    grads = [gs[0] for gs in stream]
    ref = _train(start[0], grads, torch.float64, compiled=False)
    plain = _train(start[0], grads, torch.bfloat16, compiled=False)
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard

        def shard(g, p):  # every other step row-major: the step compiles for both
            shard.calls += 1
            g = g.contiguous() if shard.calls % 2 else g
            return DTensor.from_local(g, p.device_mesh, p.placements)

        shard.calls = 0
        model = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False).bfloat16()
        with torch.no_grad():
            model.weight.copy_(start[0])
        fully_shard(model)
        opt = torch.optim.AdamW([model.weight], lr=1e-3, weight_decay=0.1, foreach=True)
        collage_compile.compile_optimizer(opt)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for g in grads:
                model.weight.grad = shard(_column_major(g.bfloat16()), model.weight)
                opt.step()
        value = mcf_value(model.weight).to_local()
    finally:
        dist.destroy_process_group()
    err = relative_error(value, ref, start[0])
    err_plain = relative_error(plain, ref, start[0])
    assert err < 3e-3 and err_plain > 30 * err, (err, err_plain)
    assert len(_said(rec)) == int(_compat.cpp_vectorizes_avx512()), [str(w.message) for w in rec]
