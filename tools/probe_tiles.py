"""Does this machine's Inductor read a transposed bf16/fp16 tile right?

    python tools/probe_tiles.py

Plain ``torch.compile`` (no collage) of ``(a + g, a - g)`` for a row-major ``a`` and a
column-major ``g``: a kernel with two outputs over transposed 32x32 tiles.  Each row says
whether the compiled result equals eager's, vectorized and not, and with the rule the
backend applies to an optimizer step (``_compat.no_low_precision_tiles``); the first line
names the C++ compiler and the CPU capability.  Measured here (Debian 12, GCC 12.2,
AVX-512, torch 2.11 and 2.13): bf16 and fp16 vectorized wrong (NaN), float32 right, and
every row right without vectorization or with the rule.
"""

from __future__ import annotations

import contextlib
import subprocess

import torch
from torch._inductor import config as inductor_config
from torch._inductor.cpp_builder import get_cpp_compiler

from collage_compile import _compat


def two_outputs(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a + g, a - g


def main() -> None:
    cxx = get_cpp_compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, ", end="")
    print(f"{version.splitlines()[0] if version else cxx}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in [(64, 32), (256, 128)]:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(shape, generator=gen).to(dtype)
            g = torch.randn(shape[::-1], generator=gen).to(dtype).t()  # column-major
            want = two_outputs(a, g)
            results = {}
            ways = {
                "vectorized": contextlib.nullcontext,
                "scalar": lambda: inductor_config.patch({"cpp.simdlen": 0}),
                "collage's rule": _compat.no_low_precision_tiles,
            }
            for way, context in ways.items():
                torch._dynamo.reset()
                with context():
                    got = torch.compile(two_outputs)(a, g)
                same = all(torch.equal(w, x) for w, x in zip(want, got))
                results[way] = "right" if same else "WRONG"
            row = ", ".join(f"{k} {v}" for k, v in results.items())
            print(f"{dtype!s:15s} {shape}: {row}")


if __name__ == "__main__":
    main()
