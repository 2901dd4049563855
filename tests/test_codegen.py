"""The code Inductor generates: the MCF roundings are in it, and the rewrite adds no kernels.

Inductor silently drops ``to(bf16)``/``to(float32)`` round trips inside a fused kernel, which
turns a correct-looking Fast2Sum into a no-op.  The rewrite rounds hi (which lo is the
remainder of) with a Veltkamp split in fp32 arithmetic, ``c = y * 2^16 + y; r = c - (c - y)``
for bf16 and ``2^13`` for fp16; these tests read the generated source and fail if that
signature disappears, on the C++ (CPU) backend and on Triton: on a GPU where there is one,
else run by Triton's interpreter with a GPU's rounding (tests/triton_interp.py).
``bit_roundings`` finds the bit-pattern rounding (``(bits + lsb + 0x7FFF) & -65536``) of
:func:`collage_compile.mcf.round_to`, which the ``"storage"`` arithmetic uses.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import mcf_value, relative_error

import collage_compile
from collage_compile import _compat

_ASSIGN = re.compile(r"^\s*(?:auto\s+)?(tmp\d+)\s*=\s*(tmp\d+)\s*-\s*(tmp\d+)\s*;?\s*$")


def veltkamp_roundings(code: str) -> int:
    """How many ``r = c - d`` follow a ``d = c - y`` (the split's signature)."""
    diffs: dict[str, tuple[str, str]] = {}
    count = 0
    for line in code.splitlines():
        m = _ASSIGN.match(line)
        if not m:
            continue
        out, a, b = m.groups()
        if b in diffs and diffs[b][0] == a:
            count += 1
        diffs[out] = (a, b)
    return count


_LINE = re.compile(r"^\s*(?:auto\s+)?(tmp\d+)\s*=\s*(.+?);?\s*$")


def bit_roundings(code: str) -> int:
    """How many ``x & m`` have ``m`` the bf16 mask -65536 (0xFFFF0000), directly or through a
    broadcast of a variable holding it (the bit rounding's signature)."""
    masks: set[str] = set()
    count = 0
    for line in code.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        out, rhs = m.groups()
        operands = set(re.findall(r"\btmp\d+\b", rhs))
        if "&" in rhs and ("-65536" in rhs or operands & masks):
            count += 1
        elif "-65536" in rhs or (operands and operands <= masks):
            masks.add(out)  # the constant, or a vector broadcast of it
    return count


def kernel_names(code: str) -> set[str]:
    return set(re.findall(r"\b((?:cpp|triton)_\w+?_\d+)\b\s*(?:\(|=|\.run)", code))


def _step(opt_name: str, params, backend):
    if opt_name == "sgd":
        opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
    return torch.compile(opt.step, backend=backend)


def _params(device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    ps = [
        torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype))
        for s in [(64, 32), (32,)]
    ]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_generated_cpp_keeps_the_roundings(opt_name):
    ps = _params()
    _, code = _compat.run_and_get_kernel_code(_step(opt_name, ps, collage_compile.backend))
    src = "\n".join(code)
    # one explicit rounding per upgraded tensor: hi's, which lo (the remainder) is computed
    # from; hi and lo are then rounded by their bf16 stores
    assert "65536.0" in src and veltkamp_roundings(src) >= len(ps)


def test_generated_cpp_of_the_storage_arithmetic_rounds_every_operation():
    ps = _params()
    backend = collage_compile.make_backend(arithmetic="storage")
    _, code = _compat.run_and_get_kernel_code(_step("sgd", ps, backend))
    # the paper's Grow: five roundings per element, each masking off the low 16 bits
    assert bit_roundings("\n".join(code)) >= 5 * len(ps)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_the_rewrite_adds_no_kernels(opt_name):
    _, plain = _compat.run_and_get_kernel_code(_step(opt_name, _params(), "inductor"))
    torch._dynamo.reset()
    _, ours = _compat.run_and_get_kernel_code(_step(opt_name, _params(), collage_compile.backend))
    n_plain, n_ours = len(kernel_names("\n".join(plain))), len(kernel_names("\n".join(ours)))
    assert n_plain >= 1
    assert n_ours == n_plain


def test_fp16_rounding_uses_the_fp16_split():
    ps = _params(dtype=torch.float16)
    _, code = _compat.run_and_get_kernel_code(_step("sgd", ps, collage_compile.backend))
    src = "\n".join(code)
    assert "8192.0" in src and veltkamp_roundings(src) >= len(ps)


def loop_bodies(code: str, numel: int) -> list[str]:
    """The bodies of the C++ loops that run over ``numel`` elements (brace-matched)."""
    bodies, lines = [], code.splitlines()
    head = f"<static_cast<int64_t>({numel}L);"
    for i, line in enumerate(lines):
        if not (line.lstrip().startswith("for(") and head in line):
            continue
        depth, body = 0, []
        for inner in lines[i + 1 :]:
            depth += inner.count("{") - inner.count("}")
            body.append(inner)
            if depth <= 0:
                break
        bodies.append("\n".join(body))
    return bodies


def test_cpp_loops_load_the_steps_scalars_instead_of_computing_them_per_vector():
    """AdamW's ``1 - beta2**step`` and its square root are computed once per kernel, not
    by a ``pow``/``sqrt`` libm call in every vector of a long C++ loop
    (``_compat.realize_scalars_pass``; a libm call spills the MCF chain's live vector
    registers).  The loop loads them instead; the numerics tests check the values."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64, generator=g).bfloat16())]
    ps[0].grad = torch.randn_like(ps[0]) * 1e-3
    _, code = _compat.run_and_get_kernel_code(_step("adamw", ps, collage_compile.backend))
    src = "\n".join(code)
    bodies = loop_bodies(src, 64 * 64)
    assert bodies and "std::pow(" in src  # the scalars, computed outside the loop
    for body in bodies:
        assert not re.search(r"\bpow\(|std::sqrt\(", body), body
        assert "65536.0" in body  # the loop is the MCF chain's


# Triton: on a CUDA GPU where there is one, else Triton's interpreter on the CPU with a GPU's
# bf16 rounding (the ``triton_device`` fixture, tests/triton_interp.py)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_generated_triton_keeps_the_roundings_and_the_numerics(opt_name, triton_device):
    ps = _params(triton_device)
    _, code = _compat.run_and_get_kernel_code(_step(opt_name, ps, collage_compile.backend))
    src = "\n".join(code)
    assert "@triton.jit" in src
    assert "65536.0" in src and veltkamp_roundings(src) >= len(ps)
    # and the compensation works after Triton compilation: SGD stream as in the CPU tests
    # (fewer elements in the interpreter, which runs a kernel in numpy)
    torch._dynamo.reset()
    n = 4096 if triton_device == "cuda" else 256
    g = torch.Generator(device=triton_device).manual_seed(1)
    p = torch.nn.Parameter((torch.randn(n, device=triton_device, generator=g) * 0.5).bfloat16())
    ref = p.detach().double().clone()
    start = ref.clone()
    opt = torch.optim.SGD([p], lr=1e-3, foreach=True)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for _ in range(300):
        grad = (0.01 + 0.005 * torch.randn(n, device=triton_device, generator=g)).bfloat16()
        p.grad = grad
        step()
        ref.add_(grad.double(), alpha=-1e-3)
    assert relative_error(mcf_value(p), ref, start) <= 0.02
    assert relative_error(p.detach().double(), ref, start) >= 0.25


def test_generated_triton_of_the_storage_arithmetic_rounds_every_operation(triton_device):
    ps = _params(triton_device)
    backend = collage_compile.make_backend(arithmetic="storage")
    _, code = _compat.run_and_get_kernel_code(_step("sgd", ps, backend))
    assert bit_roundings("\n".join(code)) >= 5 * len(ps)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_the_rewrite_adds_no_triton_kernels(opt_name, triton_device):
    # the chains replacing one foreach op are one horizontal (combo) kernel, as the op is
    _, plain = _compat.run_and_get_kernel_code(_step(opt_name, _params(triton_device), "inductor"))
    torch._dynamo.reset()
    ps = _params(triton_device)
    _, ours = _compat.run_and_get_kernel_code(_step(opt_name, ps, collage_compile.backend))
    n_plain, n_ours = len(kernel_names("\n".join(plain))), len(kernel_names("\n".join(ours)))
    assert n_plain >= 1
    assert n_ours == n_plain
