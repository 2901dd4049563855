"""Shared test fixtures: a clean Dynamo/lo/warning state per test, and small helpers."""

from __future__ import annotations

import re

import pytest
import torch

import collage_compile
from collage_compile import _compat, report, state

# Two cores: keep intra-op threads from oversubscribing while gcc compiles kernels.
torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_state():
    _compat.reset_dynamo()
    state.clear()
    report.reset_warnings()
    yield
    _compat.reset_dynamo()


def normalize_gm(text: str) -> str:
    """Graph text without comments (file paths), trailing spaces, or blank runs."""
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        lines.append(line.rstrip())
    out = "\n".join(lines)
    return re.sub(r"0x[0-9a-f]+", "0x...", out)


class GraphCapture:
    """Records the graph module the backend hands to Inductor (after the rewrite)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.graphs: list[str] = []
        original = _compat.compile_with_inductor

        def spy(gm, example_inputs, config_patches=None):
            self.graphs.append(
                gm.print_readable(print_output=False, include_stride=False, include_device=False)
            )
            return original(gm, example_inputs, config_patches)

        monkeypatch.setattr(_compat, "compile_with_inductor", spy)


@pytest.fixture
def capture(monkeypatch):
    return GraphCapture(monkeypatch)


def relative_error(value: torch.Tensor, ref: torch.Tensor, start: torch.Tensor) -> float:
    """||value - ref|| relative to the total movement ||ref - start|| (float64)."""
    value, ref, start = value.double(), ref.double(), start.double()
    return ((value - ref).norm() / (ref - start).norm()).item()


def mcf_value(p: torch.Tensor) -> torch.Tensor:
    return collage_compile.value(p).double()


def bf16_param(n=512, seed=0, scale=0.5, dtype=torch.bfloat16) -> torch.nn.Parameter:
    """A parameter of ``n`` weights N(0, scale^2), stored in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(n, generator=g) * scale).to(dtype))


def grad_stream(n, steps, seed=1, mean=0.01, std=0.005) -> list[torch.Tensor]:
    """``steps`` bf16 gradients of ``n`` elements, mean +- std."""
    g = torch.Generator().manual_seed(seed)
    return [(mean + std * torch.randn(n, generator=g)).to(torch.bfloat16) for _ in range(steps)]


def eager_grow(hi: torch.Tensor, lo: torch.Tensor, u: torch.Tensor):
    """The paper's Grow, each operation an eager op in the storage dtype."""
    s = hi + u
    lo = lo + (u - (s - hi))
    hi = s + lo
    return hi, lo - (hi - s)
