"""The Triton path on a CPU: Inductor's Triton kernels, run by Triton's interpreter with a
GPU's bf16 rounding (tests/triton_interp.py), compute what the C++ path computes.

Bit for bit, not within a tolerance: both paths generate the same fp32 arithmetic with the
same roundings (the interpreter's numpy ops are IEEE fp32, as C++ without fast-math is;
libdevice stand-ins are the C++ path's functions), so any difference is a rounding one path
dropped.  First plain Inductor, which checks the harness itself; then collage's steps in
each mode and arithmetic.  Kernel counts: the rewrite adds no Triton kernels either
(foreach chains are one horizontal kernel, :func:`collage_compile._compat._join_foreach_group`).

What the interpreter cannot show (a GPU run of tests/test_codegen.py -k triton does): FMA
contraction, approximate fp32 division, libdevice's own ulps, compile errors.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_codegen import kernel_names

import collage_compile
from collage_compile import _compat, state

SHAPES = [(16, 8), (8,), (5, 3)]  # one odd size: the combo kernel's masks
STEPS = 3


def _sgd(ps, foreach=True):
    return torch.optim.SGD(ps, lr=1e-3, foreach=foreach)


def _sgd_momentum(ps, foreach=True):
    return torch.optim.SGD(
        ps, lr=1e-3, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=foreach
    )


def _adamw(ps, foreach=True):
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=foreach)


def _adamw_single(ps):
    return _adamw(ps, foreach=False)


# (optimizer, backend options)
CASES = {
    "sgd-light": (_sgd, {}),
    "sgd-momentum-light": (_sgd_momentum, {}),
    "sgd-storage": (_sgd, {"arithmetic": "storage"}),
    "adamw-light": (_adamw, {}),
    "adamw-plus": (_adamw, {"mode": "plus"}),
    "adamw-plus-single": (_adamw_single, {"mode": "plus"}),
    # exact: int16 remainders joined into fp32 and split back, integer ops on bit patterns
    "adamw-exact": (_adamw, {"mode": "exact"}),
}

# metrics=True: each parameter's chain stays inline and feeds its metrics' sums, per-tensor
# reductions a Triton foreach kernel does not take, so the step is more kernels than plain
# Inductor's (the C++ backend fuses it all into one loop).  AdamW's ``denom`` (bf16 in eager)
# then crosses a kernel boundary, stored to bf16, where the C++ kernel keeps it in fp32
# registers: the update differs in its last fp32 bits and lo by up to one bf16 ulp of lo.
# A difference of where Inductor's kernels end, on a GPU too, not of GPU arithmetic.
# every=3 over the 3 steps: step 0 runs the measuring graph, steps 1 and 2 the other one.
METRICS_CASES = {
    "sgd-metrics": (_sgd, {"metrics": True}, True),
    "sgd-metrics-every3": (_sgd, {"metrics": True, "every": 3}, True),
    "adamw-metrics": (_adamw, {"metrics": True}, False),
}


def _run(
    make_opt, options: dict | None, device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> tuple[list[torch.Tensor], int, dict[str, float]]:
    """Every tensor the step leaves behind (weights, lo, optimizer state; on the CPU) after
    STEPS compiled steps, how many kernels its first compile generated, and the metrics
    (``last_metrics(by="tensor")``).  ``options=None``: plain Inductor; with ``dtype``
    float64, the same stream run eagerly in float64 (the reference: its weights, then
    their starting values)."""
    _compat.reset_dynamo()
    state.clear()
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g).bfloat16() for s in SHAPES]
    ps = [torch.nn.Parameter(t.to(device, dtype)) for t in start]
    opt = make_opt(ps)
    if dtype == torch.float64:
        step = opt.step
    else:
        backend = "inductor" if options is None else collage_compile.make_backend(**options)
        step = torch.compile(opt.step, backend=backend)
    kernels = 0
    for i in range(STEPS):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).bfloat16().to(device, dtype)
        if dtype == torch.float64:
            step()
            continue
        if i == 0:
            _, code = _compat.run_and_get_kernel_code(step)
            kernels = len(kernel_names("\n".join(code)))
        else:
            step()
    out = [p.detach().cpu() for p in ps]
    if dtype == torch.float64:  # the reference, then where it started
        return out + [t.double() for t in start], 0, {}
    if options is not None:
        out += [collage_compile.value(p).cpu() for p in ps]
    for s in opt.state.values():
        out += [v.cpu() for v in s.values() if isinstance(v, torch.Tensor)]
    # the last measured step's, per weight (read while the weights are alive)
    metrics = collage_compile.last_metrics(by="tensor")
    return out, kernels, metrics


def _assert_bitwise_equal(cpp: list[torch.Tensor], triton: list[torch.Tensor]) -> None:
    assert len(cpp) == len(triton)
    for i, (a, b) in enumerate(zip(cpp, triton)):
        assert a.dtype == b.dtype and a.shape == b.shape
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        assert torch.equal(a.view(-1), b.view(-1)), f"tensor {i}: max |cpp - triton| = {diff}"


@pytest.mark.parametrize("make_opt", [_sgd, _sgd_momentum, _adamw], ids=["sgd", "sgd-m", "adamw"])
def test_plain_inductor_under_the_interpreter_equals_the_cpp_path(make_opt, interpreted_triton):
    # the harness's own check: stock Inductor kernels, no collage, the same bits
    cpp, _, _ = _run(make_opt, None)
    with interpreted_triton():
        triton, _, _ = _run(make_opt, None)
    _assert_bitwise_equal(cpp, triton)


@pytest.mark.parametrize("case", list(CASES))
def test_collage_triton_step_equals_the_cpp_path_and_adds_no_kernels(case, interpreted_triton):
    make_opt, options = CASES[case]
    cpp, _, _ = _run(make_opt, options)
    with interpreted_triton():
        triton, n_ours, _ = _run(make_opt, options)
        _, n_plain, _ = _run(make_opt, None)
    _assert_bitwise_equal(cpp, triton)
    print(f"{case}: Triton kernels plain {n_plain}, collage {n_ours}")
    assert n_plain >= 1
    assert n_ours <= n_plain


@pytest.mark.parametrize("case", list(METRICS_CASES))
def test_collage_triton_step_with_metrics_matches_the_cpp_path(case, interpreted_triton):
    make_opt, options, exact = METRICS_CASES[case]
    cpp, _, cpp_metrics = _run(make_opt, options)
    with interpreted_triton():
        triton, _, triton_metrics = _run(make_opt, options)
    # edq, edq_hi, imprecision and lo_rel of each weight, from sums whose order of
    # addition is each backend's own (fp32 sums of 8 to 128 terms)
    assert list(triton_metrics) == list(cpp_metrics) and len(cpp_metrics) == 4 * len(SHAPES)
    m_cpp = torch.tensor(list(cpp_metrics.values()), dtype=torch.float64)
    m_triton = torch.tensor(list(triton_metrics.values()), dtype=torch.float64)
    if options.get("every", 1) != 1:
        # step 0's values: the later steps ran the unmeasured graph
        _, _, last_step = _run(make_opt, {"metrics": True})
        assert [v for k, v in last_step.items() if "lo_rel" not in k] != [
            v for k, v in cpp_metrics.items() if "lo_rel" not in k
        ]
    if exact:
        torch.testing.assert_close(m_triton, m_cpp, rtol=1e-5, atol=1e-9)
        _assert_bitwise_equal(cpp, triton)
        return
    # a weight's hi may move by one ulp more or less (below), which moves edq_hi and
    # imprecision by an element's share; edq (hi + lo) stays near 1 in both (its distance
    # from 1, the pair's own rounding, is of the update's size in the 8-element bias)
    torch.testing.assert_close(m_triton[::4], m_cpp[::4], rtol=0, atol=1e-2)
    assert (m_cpp[::4] - 1).abs().max() < 1e-2
    # bf16 denom differs by up to half its ulp (2^-9 relative), so does each update
    # (lr = 1e-3 in size): value() (hi + lo) moves by at most that over the steps; a bf16
    # tensor (hi, the moments) by at most one ulp (the same value rounded across a tie)
    atol = STEPS * 1e-3 * 2.0**-9
    n = len(SHAPES)
    for i, (a, b) in enumerate(zip(cpp, triton)):
        rtol = 2.0**-15 if n <= i < 2 * n else 2.0**-7
        torch.testing.assert_close(b.double(), a.double(), rtol=rtol, atol=atol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(CASES))
def test_collage_cuda_step_tracks_float64_as_the_cpp_path_does(case):
    """On a GPU: the real Triton step against the C++ path on the same data.  Bit for bit
    where they agree; where the GPU's fused multiply-adds or its division round otherwise,
    the pair (hi + lo) must stay as close to the float64 run of the same stream as the C++
    path's (docs/numerics.md).  Printed: which of the two it was."""
    make_opt, options = CASES[case]
    cpp, _, _ = _run(make_opt, options)
    cuda, _, _ = _run(make_opt, options, device="cuda")
    ref, _, _ = _run(make_opt, options, dtype=torch.float64)
    n = len(SHAPES)
    same = len(cpp) == len(cuda) and all(torch.equal(a, b) for a, b in zip(cpp, cuda))
    for i in range(n):
        moved = (ref[i] - ref[n + i]).norm().item()  # the float64 run's movement
        err_cpp = (cpp[n + i].double() - ref[i]).norm().item() / moved
        err_cuda = (cuda[n + i].double() - ref[i]).norm().item() / moved
        print(
            f"{case} tensor {i}: bit-identical {same}, error cpp {err_cpp:.3g} cuda {err_cuda:.3g}"
        )
        hi_only = (cuda[i].double() - ref[i]).norm().item() / moved  # what bf16 alone holds
        assert err_cuda <= 2 * err_cpp + 1e-5 and 10 * err_cuda < hi_only, (err_cuda, err_cpp)


_CDIV_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def combo_head(out_ptr):
    XBLOCK: tl.constexpr = 1024
    num_xblocks_0 = tl.cdiv(128, XBLOCK)
    num_xblocks_1 = num_xblocks_0 + tl.cdiv(8, XBLOCK)
    tl.store(out_ptr, num_xblocks_1)
"""


def test_the_interpreter_leaves_triton_able_to_compile_for_a_gpu(interpreted_triton, tmp_path):
    """After an interpreted step, Triton's front end still builds a CUDA kernel's IR (no GPU
    needed).  The interpreter patched ``triton.language`` for good at the first interpreted
    device-function call, so on the GPU image a CUDA test that ran after an interpreter test
    in the same process failed to compile its combo kernel (the header of Inductor's
    ``triton_for_fused`` kernels, above); :func:`triton_interp._language_restored`."""
    import importlib.util

    import triton_interp
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    before = [dict(vars(o)) for o in triton_interp._language_objects()]
    with interpreted_triton():
        _run(_sgd, {})  # Inductor's helpers (tl.cdiv among them) run as device functions
    after = [dict(vars(o)) for o in triton_interp._language_objects()]
    changed = [k for b, a in zip(before, after) for k in b if a.get(k) is not b[k]]
    assert not changed, f"triton.language left patched: {changed[:5]}"

    path = tmp_path / "combo_head.py"
    path.write_text(_CDIV_KERNEL)
    spec = importlib.util.spec_from_file_location("combo_head", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({"debug": True})
    from triton._C.libtriton import ir

    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(module.combo_head, {"out_ptr": "*i32"}, {})
    codegen = backend.get_codegen_implementation(options)
    assert source.make_ir(target, options, codegen, backend.get_module_map(), context)


def test_the_interpreter_starts_no_compile_workers(interpreted_triton):
    """Inductor's compile workers are processes started once per process, with the
    environment of that moment (Inductor's Triton code generation starts them).
    Started under the interpreter (``TRITON_INTERPRET=1``), they interpreted every later
    kernel: on the GPU image (16 cores, so Inductor compiles in workers) every CUDA test
    that ran after an interpreter test in one pytest worker failed with
    "'InterpretedFunction' object has no attribute 'params'".  Under the harness Inductor
    compiles in the test's process, so none starts there, even where the machine would
    use several."""
    from torch._inductor import async_compile

    async_compile.AsyncCompile.process_pool.cache_clear()  # one started before stays apart
    before = set(map(id, async_compile._pool_set))
    # a kernel generated, not loaded from the cache: Triton's code generation starts them
    no_cache = {"fx_graph_cache": False, "compile_threads": 4}
    with torch._inductor.config.patch(no_cache), interpreted_triton():
        out = torch.compile(lambda x: x * 2, backend="inductor")(torch.ones(4))
    assert torch.equal(out, torch.full((4,), 2.0))
    started = [p for p in async_compile._pool_set if id(p) not in before]
    assert not started, f"compile workers started under TRITON_INTERPRET=1: {started}"


def test_light_adds_no_combo_kernels_to_plain_inductors_step(interpreted_triton):
    """Inductor splits a foreach step's Triton combo kernels at 250 buffers read or written
    (``combo_kernel_max_num_args``), and each lo is one more read and write: at that limit
    light's AdamW over 4 GPT layers (48 tensors) was 5 kernels and plus's 6 where plain
    Inductor makes 4.  The backend grows the limit by the pairs' share, to at most 350
    (``_compat.combo_args_patch``): light launches what plain launches, plus one more.
    Each sub-kernel takes plain's pointers and its lo in and out, no realized scalar (the step's
    scalars stay inline in Triton's loops, ``_compat.realize_scalars_pass`` is for C++
    loops; realized, they were two pointers more per sub-kernel).  The kernels compute
    what the C++ path computes, bit for bit (weights, lo, state)."""
    from benchmarks.metrics_overhead import layer_shapes

    def run(options, steps=1):
        _compat.reset_dynamo()
        state.clear()
        g = torch.Generator().manual_seed(0)
        shapes = layer_shapes(4, 64)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
        backend = "inductor" if options is None else collage_compile.make_backend(**options)
        step = torch.compile(opt.step, backend=backend)
        for i in range(steps):
            for p in ps:
                p.grad = (1e-2 * torch.randn(p.shape, generator=g)).bfloat16()
            if i == 0:
                _, code = _compat.run_and_get_kernel_code(step)
            else:
                step()
        out = [p.detach().clone() for p in ps]
        if options is not None:
            out += [collage_compile.value(p) for p in ps]
        out += [v.clone() for st in opt.state.values() for v in st.values()]
        code = "\n".join(code)
        pointers = [
            len(re.findall(r"\w*ptr\d+", a)) for a in re.findall(r"def triton_\w+\((.*?)\):", code)
        ]
        launches = len(re.findall(r"^\s+\w+\.run\(", code, re.M))
        return (launches, max(pointers, default=0), sum(pointers)), out

    cpp = run({"mode": "plus"}, steps=2)[1]
    with interpreted_triton():
        plain = run(None)[0]
        light = run({})[0]
        plus, triton = run({"mode": "plus"}, steps=2)
    print(f"Triton (launches, widest, all pointers) over 48 tensors: {plain} {light} {plus}")
    assert plain[0] >= 2  # the limit splits plain's step too
    assert light[0] <= plain[0] and plus[0] <= plain[0] + 1
    assert plain[1] <= 250 and max(light[1], plus[1]) <= 350
    assert light[2] == plain[2] + 2 * 48  # each sub-kernel: plain's pointers, its lo in and out
    _assert_bitwise_equal(cpp, triton)


def test_combo_args_grow_by_the_pairs_share_up_to_the_cap():
    import torch._inductor.config as inductor_config

    patch = _compat.combo_args_patch
    assert patch(0, 3) == {} and patch(10, 0) == {}
    assert patch(240, 96) == {"combo_kernel_max_num_args": 350}  # AdamW light, 48 tensors
    assert patch(100, 10) == {"combo_kernel_max_num_args": 300}
    assert patch(100, 100) == {"combo_kernel_max_num_args": _compat.combo_args_max}
    with inductor_config.patch(combo_kernel_max_num_args=1000):  # a user's own, higher limit
        assert patch(100, 100) == {"combo_kernel_max_num_args": 1000}
