"""Inductor's Triton code generation on a CPU, run by Triton's interpreter, with GPU numerics.

``torch._inductor.config.cpu_backend = "triton"`` makes Inductor generate Triton kernels
for CPU tensors, and ``TRITON_INTERPRET=1`` makes Triton run them in numpy instead of
compiling them for a GPU.  Out of the box that is not the arithmetic a GPU does:

- the interpreter converts fp32 to bf16 by truncation, where a GPU rounds to nearest even
  (and MCF's pair *is* that rounding: a truncated hi leaves a lo of the wrong sign);
- ``libdevice`` functions (``libdevice.pow`` in every Adam kernel) are empty stubs that
  return None;
- ``torch.utils._triton.triton_hash_with_backend`` needs an active GPU driver.

:func:`interpreted_triton` installs the smallest shims that close those gaps (each names
the GPU behaviour it stands for), sets the interpreter up, and checks with a one-element
kernel that a bf16 store rounds to nearest even before anything is tested under it.

What the interpreter still cannot show, so a GPU run must: Triton's compile errors, FMA
contraction (``enable_fp_fusion``: ``a * b + c`` on a GPU may round once), fp32 ``x / y``
(``div.full.f32``, within 2 ulp, unless Inductor's ``eager_numerics.division_rounding``),
libdevice's own accuracy (the stand-ins are torch's CPU functions, the C++ path's), and
CUDA-only heuristics (block sizes, persistent reductions, autotuning).

The private APIs used here, checked on torch 2.13.0 with triton 3.7.1 (the version torch
2.13's CUDA build pins) and on torch 2.11.0 with triton 3.6.0 (the GPU image's; there the
CUDA build from PyPI, run on this CPU, passed tests/test_triton.py): ``triton.runtime.interpreter._convert_float`` and
``TensorHandle``, ``triton.runtime.jit.JITFunction``, ``torch.utils._triton.
triton_hash_with_backend``, ``torch._inductor.runtime.triton_helpers.libdevice``.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

CHECKED_VERSIONS = {"torch": ("2.11", "2.13"), "triton": ("3.6", "3.7")}


def available() -> str | None:
    """None when the harness can run here, else why not (a skip reason)."""
    try:
        import numpy  # noqa: F401  (the interpreter computes in numpy)
        import triton
    except ImportError as e:
        return f"needs triton and numpy ({e})"
    torch_v = torch.__version__.split("+")[0].rsplit(".", 1)[0]
    triton_v = triton.__version__.rsplit(".", 1)[0]
    if torch_v not in CHECKED_VERSIONS["torch"] or triton_v not in CHECKED_VERSIONS["triton"]:
        return (
            f"the interpreter shims are checked on torch {CHECKED_VERSIONS['torch']} and "
            f"triton {CHECKED_VERSIONS['triton']}, not {torch.__version__} / {triton.__version__}"
        )
    return None


def _to_torch(handle_data):
    import numpy as np

    if handle_data.dtype == np.uint16:  # the interpreter keeps bf16 as its bits
        return torch.from_numpy(handle_data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(handle_data)


def _from_torch(t: torch.Tensor):
    import numpy as np

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _round_to_nearest_even(original: Callable) -> Callable:
    """fp32 <-> bf16 conversion as a GPU does it: ``cvt.rn.bf16.f32`` rounds to nearest,
    ties to even (Triton's default ``fp_downcast_rounding`` for bf16), and widening is
    exact.  torch's CPU conversion does exactly that; the interpreter's own truncates (no
    rounding mode) or rounds ties away from zero (RTNE), so every other conversion (an
    explicit ``rtz``, fp8) is left to it."""
    import numpy as np
    from triton import language as tl
    from triton._C.libtriton import ir

    pair = {tl.float32, tl.bfloat16}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if {input_dtype, output_dtype} != pair or rounding_mode not in (
            None,
            ir.ROUNDING_MODE.RTNE,
        ):
            return original(data, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.float32:
            src = torch.from_numpy(np.ascontiguousarray(data).view(np.float32))
            out = src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        else:
            src = torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16)
            out = src.float().numpy().view(np.uint32)
        return out.reshape(data.shape)

    return convert


# libdevice function -> the torch function computing it, the result's dtype (None: the
# first argument's).  Inductor's pointwise ops that reach libdevice (torch/_inductor/codegen/
# triton.py, TritonOverrides); add one here when a kernel under test needs it.
_LIBDEVICE: dict[str, tuple[Callable, object]] = {
    "pow": (torch.pow, None),
    "rsqrt": (torch.rsqrt, None),
    "exp": (torch.exp, None),
    "log": (torch.log, None),
    "log1p": (torch.log1p, None),
    "expm1": (torch.expm1, None),
    "tanh": (torch.tanh, None),
    "floor": (torch.floor, None),
    "ceil": (torch.ceil, None),
    "trunc": (torch.trunc, None),
    "nearbyint": (torch.round, None),  # round half to even, as rint
    "fmod": (torch.fmod, None),
    "copysign": (torch.copysign, None),
    "isnan": (torch.isnan, "int1"),
    "isinf": (torch.isinf, "int1"),
    "signbit": (torch.signbit, "int1"),
}


class _StandInLibdevice(types.SimpleNamespace):
    """GPU ``libdevice`` (``__nv_powf``, ``__nv_rsqrtf``, ...) replaced by torch's CPU
    functions on the interpreter's numpy arrays: the functions the C++ path calls, so the
    two paths agree bit for bit.  A GPU's libdevice is accurate to a few ulp, not
    necessarily the same ones (``__nv_powf``: 2 ulp); only a GPU run shows those.  A
    function without a stand-in fails loudly instead of returning None."""

    def __getattr__(self, name: str):
        raise NotImplementedError(
            f"libdevice.{name} has no interpreter stand-in: add it to tests/triton_interp.py"
        )


def _stand_in(fn: Callable, result: object) -> Callable:
    from triton import language as tl
    from triton.runtime.interpreter import TensorHandle

    def call(*args):
        tensors = [a for a in args if isinstance(a, tl.tensor)]
        like = tensors[0]
        values = [
            _to_torch(a.handle.data) if isinstance(a, tl.tensor) else getattr(a, "value", a)
            for a in args
        ]
        out = fn(*values)
        dtype = tl.int1 if result == "int1" else like.dtype
        if result == "int1":
            data = out.numpy()
        else:
            data = _from_torch(out.to(values[0].dtype))
        ty = (
            like.type
            if result is None
            else tl.block_type(dtype, like.shape)
            if like.shape
            else dtype
        )
        return tl.tensor(TensorHandle(data, dtype.scalar), ty)

    return call


def _interpreted_helpers(module: types.ModuleType, patch: pytest.MonkeyPatch) -> None:
    """Triton decides at ``@triton.jit`` time whether a function is compiled or
    interpreted, and an interpreted kernel cannot call a compiled one.  ``triton.language``
    (``tl.cdiv`` in every combo kernel) and Inductor's ``triton_helpers`` are decorated
    when first imported, usually before ``TRITON_INTERPRET`` is set here, so their
    compiled functions are swapped for interpreted ones of the same Python functions."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, value in list(vars(module).items()):
        if isinstance(value, JITFunction):
            patch.setattr(module, name, InterpretedFunction(value.fn))


def _language_objects() -> list[object]:
    """What the interpreter's ``_patch_lang`` patches (triton 3.6 and 3.7)."""
    from triton import language as tl

    objs = [tl, tl.core, tl.math, tl.tensor, tl.core.tensor]
    objs.append(getattr(tl.core, "tensor_descriptor_base", None))
    return [o for o in dict.fromkeys(objs) if o is not None]


@contextlib.contextmanager
def _language_restored() -> Iterator[None]:
    """``triton.language`` as it was, after the interpreter has run.  The interpreter
    patches the language's builtins for each call of an interpreted device function
    (``InterpretedFunction.__call__``, which the helpers below become) and never restores
    them, so a real Triton compile later in the process failed: "'ir.value' object has no
    attribute 'dtype'" at the first ``tl.cdiv`` of a combo kernel (seen on the GPU image,
    triton 3.6, in a CUDA test that ran after an interpreter test in one pytest worker)."""
    saved = [(o, dict(vars(o))) for o in _language_objects()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_MISSING = object()


@contextlib.contextmanager
def interpreted_triton() -> Iterator[None]:
    """Inductor generates Triton for CPU tensors and Triton's interpreter runs it with a
    GPU's bf16 rounding and libdevice stand-ins (module docstring).  Fails, rather than
    runs with the interpreter's own numerics, if the shims are not in effect."""
    reason = available()
    if reason:
        pytest.skip(reason)
    import numpy as np
    import torch._inductor.config as inductor_config
    import torch.utils._triton
    import triton.runtime.interpreter as interpreter
    from triton import language as tl

    with warnings.catch_warnings():
        # "Could not find an active CPU backend": the interpreter needs none
        warnings.simplefilter("ignore", UserWarning)
        from torch._inductor.runtime import triton_helpers

    with (
        _language_restored(),
        pytest.MonkeyPatch.context() as patch,
        # Inductor's compile workers are processes started once, with the environment of
        # that moment: started here, they would interpret every later kernel of the
        # process (on the GPU image, each CUDA test after an interpreter test in one
        # pytest worker failed: "'InterpretedFunction' object has no attribute
        # 'params'"); with one compile thread Inductor starts none, and the interpreter
        # loads each kernel in this process anyway
        inductor_config.patch(cpu_backend="triton", compile_threads=1),
        # a combo kernel's masked-off lanes divide 0 by 0; their results are never stored
        np.errstate(divide="ignore", invalid="ignore"),
    ):
        # read when a kernel module is loaded (@triton.jit) and when Inductor launches it
        patch.setenv("TRITON_INTERPRET", "1")
        # the FX graph and autotune caches key on the backend (GPU arch + driver); the
        # interpreter has neither, and "INTERPRET" keeps its entries apart from a GPU's
        patch.setattr(torch.utils._triton, "triton_hash_with_backend", lambda: "INTERPRET")
        patch.setattr(
            interpreter, "_convert_float", _round_to_nearest_even(interpreter._convert_float)
        )
        libdevice = _StandInLibdevice(
            **{name: _stand_in(fn, result) for name, (fn, result) in _LIBDEVICE.items()}
        )
        patch.setattr(triton_helpers, "libdevice", libdevice)
        for module in (tl, tl.standard, triton_helpers):
            _interpreted_helpers(module, patch)
        _self_check()
        yield


def _self_check() -> None:
    """Once per process, one compiled kernel that must (1) be Triton run by the
    interpreter, (2) round fp32 sums to bf16 to nearest even, ties included, and (3) call
    the libdevice.pow stand-in; every time, the shims must be the ones installed."""
    import triton.runtime.interpreter as interpreter
    from torch._inductor.runtime import triton_helpers

    assert isinstance(triton_helpers.libdevice, _StandInLibdevice)
    assert interpreter._convert_float.__qualname__.startswith("_round_to_nearest_even")
    if _SELF_CHECKED:
        return
    from torch._inductor.utils import run_and_get_code

    # 1 + 2^-8 + 2^-9 is above the tie: rounds up to 1 + 2^-7 (truncation gives 1);
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even, 1 (round-half-away gives 1 + 2^-7)
    a = torch.tensor([1.0, 1.0, -1.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8 + 2.0**-9, 2.0**-8, -(2.0**-8 + 2.0**-9)])
    e = torch.tensor([0.5, 1.5, 2.5])

    def f(a, b, e):
        return (a.float() + b).to(torch.bfloat16), torch.pow(b.abs(), e)

    torch._dynamo.reset()
    (out, p), code = run_and_get_code(torch.compile(f, backend="inductor", dynamic=False), a, b, e)
    torch._dynamo.reset()
    src = "\n".join(code)
    assert "@triton.jit" in src, "the harness did not make Inductor generate Triton"
    assert "libdevice.pow" in src
    expected = torch.tensor([1.0 + 2.0**-7, 1.0, -(1.0 + 2.0**-7)], dtype=torch.bfloat16)
    assert torch.equal(out, expected), (
        f"bf16 stores do not round to nearest even under the interpreter: {out} != {expected}"
    )
    assert torch.equal(p, torch.pow(b.abs(), e)), "libdevice.pow stand-in is not torch.pow"
    _SELF_CHECKED.append(True)


_SELF_CHECKED: list[bool] = []


@contextlib.contextmanager
def triton_device() -> Iterator[str]:
    """``"cuda"`` where a GPU is (Inductor's own Triton path, nothing patched), else
    ``"cpu"`` with :func:`interpreted_triton` in effect."""
    if torch.cuda.is_available():
        yield "cuda"
        return
    with interpreted_triton():
        yield "cpu"
