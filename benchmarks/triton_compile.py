"""Triton's compile time for the AdamW step's kernels, plain Inductor against collage, on a CPU.

    python -m benchmarks.triton_compile [--layers 12] [--variants plain light plus]

Inductor generates the step's Triton kernels for bf16 parameters shaped as ``--layers`` GPT
layers (12 tensors each: ``benchmarks.step --size gpu`` is 12 layers, 144 tensors) under
Triton's interpreter (``tests/triton_interp.py``; the tensors are ``--width`` wide, tiny,
since a combo kernel's code depends on its tensors' count and kind, barely on their size).
Then Triton compiles each kernel for an H100 (sm_90, through ptxas), here on the CPU, one
at a time with an empty Triton cache.  Printed per variant: the kernels compiled (Inductor
compiles a kernel once however often the step launches it) and launched, the pointer
arguments of the largest, the seconds to compile them one after another, and the longest
single kernel, which is the floor of the compile's wall time when Inductor's compile
workers take the kernels in parallel.

What this leaves out, so a GPU run must show it: CUDA's own choices of block sizes and
kernel configs (the interpreter's device is a CPU), and the rest of a compile (Dynamo,
AOTAutograd, Inductor's lowering), which ``benchmarks.compile_time`` measures.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a generated wrapper defines each kernel as name = async_compile.triton('name', '''src''', ...)
KERNEL = re.compile(
    r"^\w+ = async_compile\.triton\('(\w+)', '''\n(.*?)''', device_str", re.S | re.M
)


def generated_code(variant: str, layers: int, width: int) -> str:
    """The wrapper code Inductor generates for ``variant``'s AdamW step, under the
    interpreter (one step run)."""
    import collage_compile
    from benchmarks.metrics_overhead import layer_shapes
    from collage_compile import _compat

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import triton_interp

    with triton_interp.interpreted_triton():
        _compat.reset_dynamo()
        g = torch.Generator().manual_seed(0)
        shapes = layer_shapes(layers, width)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
        for p in ps:
            p.grad = (1e-3 * torch.randn(p.shape, generator=g)).bfloat16()
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True)
        backend = "inductor" if variant == "plain" else collage_compile.make_backend(mode=variant)
        step = torch.compile(opt.step, backend=backend)
        _, codes = _compat.run_and_keep_kernel_code(step, fresh=True)
    return "\n".join(codes)


def compile_for_h100(code: str, workdir: str) -> list[tuple[str, int, float]]:
    """(kernel, pointer arguments, seconds) for each Triton kernel in ``code``, compiled
    for sm_90 with each of its configs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    out = []
    for name, source in KERNEL.findall(code):
        path = os.path.join(workdir, f"{name}_{len(out)}.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        kernel = getattr(module, name)  # Inductor's autotuner around the @triton.jit function
        signature = dict(kernel.triton_meta["signature"])
        pointers = sum(str(t).startswith("*") for t in signature.values())
        seconds = 0.0
        for config in kernel.configs:
            constants = {**kernel.triton_meta.get("constants", {}), **config.kwargs}
            sig = {k: "constexpr" if k in constants else t for k, t in signature.items()}
            sig.update({k: "constexpr" for k in config.kwargs if k not in sig})
            options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
            start = time.perf_counter()
            triton.compile(ASTSource(kernel.fn, sig, constants), target=target, options=options)
            seconds += time.perf_counter() - start
        out.append((name, pointers, seconds))
    return out


def _combo_args_max() -> int:
    from collage_compile import _compat

    return _compat.combo_args_max


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="GPT layers, 12 tensors each")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["plain", "light", "plus"])
    ap.add_argument(
        "--max-args",
        type=int,
        default=None,
        help="the most buffers a collage combo kernel may grow to (the backend's: 350; "
        "a value under Inductor's own limit, 250, keeps 250)",
    )
    args = ap.parse_args()
    if args.max_args is not None:
        from collage_compile import _compat

        _compat.combo_args_max = args.max_args
    codes = {v: generated_code(v, args.layers, args.width) for v in args.variants}
    print(
        f"Triton compile of the AdamW step's kernels for sm_90 on this CPU, {args.layers * 12} "
        f"tensors, torch {torch.__version__}, one kernel at a time, collage's combo kernels "
        f"at most {_combo_args_max()} buffers"
    )
    print(
        f"{'variant':8} {'kernels':>7} {'launches':>8} {'max ptrs':>8} {'total s':>8} {'longest s':>9}"
    )
    for variant, code in codes.items():
        with tempfile.TemporaryDirectory() as workdir:
            os.environ["TRITON_CACHE_DIR"] = os.path.join(workdir, "cache")
            kernels = compile_for_h100(code, workdir)
        total = sum(s for _, _, s in kernels)
        longest = max((s for _, _, s in kernels), default=0.0)
        widest = max((p for _, p, _ in kernels), default=0)
        launches = len(re.findall(r"^\s+\w+\.run\(", code, re.M))
        print(
            f"{variant:8} {len(kernels):7d} {launches:8d} {widest:8d} {total:8.1f} {longest:9.1f}"
        )


if __name__ == "__main__":
    main()
