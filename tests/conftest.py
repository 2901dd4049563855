"""Shared test fixtures: a clean Dynamo/lo/warning state per test, and small helpers."""

from __future__ import annotations

import difflib
import os
import pathlib
import re

import pytest
import torch

import collage_compile
from collage_compile import _compat, metrics, report, state, watch

# Two cores: keep intra-op threads from oversubscribing while gcc compiles kernels.
torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_state():
    _compat.reset_dynamo()
    state.clear()
    report.reset_warnings()
    metrics.reset_metrics()
    watch.reset()
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


def compact_graph(gm: torch.fx.GraphModule) -> str:
    """A graph one line per node, each emitted MCF chain folded into one line naming the
    tensor, its lo input and its steps (the full arithmetic is pinned by test_snapshots)."""
    import torch.fx as fx

    def show(x):
        if isinstance(x, fx.Node):
            return x.name
        if isinstance(x, (list, tuple)):
            inner = ", ".join(show(v) for v in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k}={show(v)}" for k, v in x.items()) + "}"
        if isinstance(x, float):
            return repr(round(x, 12))
        return re.sub(r"0x[0-9a-f]+", "0x...", str(x))

    def target(node):
        if node.op == "call_method":
            return f".{node.target}"
        if node.op in ("call_function",):
            name = getattr(node.target, "__name__", str(node.target))
            mod = getattr(node.target, "__module__", "") or ""
            return f"{mod.replace('torch._ops.', '')}.{name}" if "ops" in mod else name
        return node.op

    def stable(text: str) -> str:
        # the optimizer watch's op: its optimizer id and the cell holding its counter vary
        text = re.sub(r"optimizer_stepped\.default\(\d+,", "optimizer_stepped.default(<id>,", text)
        return re.sub(r"\w*optimizer_step_code_closure_\d+_cell_contents", "<ticks>", text)

    lines, last = [], None
    for node in gm.graph.nodes:
        chain = node.meta.get("collage_chain")
        if chain is not None:
            if chain != last:
                lines.append(f"MCF {chain}")
            last = chain
            continue
        last = None
        if node.op in ("placeholder", "get_attr"):
            ex = node.meta.get("example_value")
            dtype = str(getattr(ex, "dtype", "")).replace("torch.", "")
            lines.append(f"{node.op} {node.name} {dtype}")
        elif node.op == "output":
            lines.append(f"output {show(node.args)}")
        else:
            args = ", ".join(
                [show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()]
            )
            lines.append(f"{node.name} = {target(node)}({args})")
    return stable("\n".join(lines))


def readable_with_chains(gm: torch.fx.GraphModule) -> str:
    """``gm`` printed, each ``collage::chain`` key numbered in order of appearance and the
    aten arithmetic behind it printed after the graph (what Inductor lowers inline)."""
    from collage_compile import fuse

    def readable(m):
        return m.print_readable(print_output=False, include_stride=False, include_device=False)

    text = readable(gm)
    keys = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.collage.chain.default and node.args[0] not in keys:
            keys.append(node.args[0])
    for i, key in enumerate(keys):
        text = text.replace(repr(key), f"'chain_{i}'")
        body = readable(fuse.chain_graph(key)).split("\n", 1)[1]
        text += f"\nclass chain_{i}(torch.nn.Module):\n{body}"
    return text


class GraphCapture:
    """Records the graph module the backend hands to Inductor (after the rewrite)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.graphs: list[str] = []
        self.compact: list[str] = []
        self.modules: list[torch.fx.GraphModule] = []
        original = _compat.compile_with_inductor

        def spy(gm, example_inputs, config_patches=None, cudagraphs=False):
            self.graphs.append(readable_with_chains(gm))
            self.compact.append(compact_graph(gm))
            self.modules.append(gm)
            return original(gm, example_inputs, config_patches, cudagraphs)

        monkeypatch.setattr(_compat, "compile_with_inductor", spy)


@pytest.fixture
def capture(monkeypatch):
    return GraphCapture(monkeypatch)


class CompiledGraphs:
    """A backend that records every graph ``backend`` compiled.  Unlike
    ``torch._dynamo.testing.CompileCounterWithBackend`` it does not count a graph the
    backend sent back to be traced again (a scheduled lr Dynamo took as a constant:
    ``_compat.retrace_with_dynamic_floats``): that costs a trace, not a compile."""

    def __init__(self, backend):
        self.backend = backend
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        compiled = self.backend(gm, example_inputs)
        self.graphs.append(gm)
        return compiled


def step_compiles(counter: CompiledGraphs) -> int:
    """Graphs compiled, less the optimizer watch's one-op graphs
    (``collage::optimizer_stepped`` after a torch.optim step's graph break)."""
    return sum(not _compat.is_step_tick_graph(gm) for gm in counter.graphs)


def drifting_stream(shapes, steps, seed=0):
    """bf16 start values and ``steps`` lists of bf16 gradients, one per shape: noise around a
    direction the steps agree on (so plain bf16 loses updates that a pair keeps)."""
    g = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=g).bfloat16() for s in shapes]
    drift = [torch.randn(s, generator=g) for s in shapes]
    grads = [
        [(d + 0.5 * torch.randn(s, generator=g)).bfloat16() for s, d in zip(shapes, drift)]
        for _ in range(steps)
    ]
    return start, grads


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


SNAPSHOTS = pathlib.Path(__file__).parent / "snapshots"


def assert_snapshot(name: str, text: str) -> None:
    """``text`` equals ``tests/snapshots/<name>.txt``; ``EXPECTTEST_ACCEPT=1`` (expecttest's
    switch, as for the inline snapshots) rewrites the file instead.  Review the diff."""
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("EXPECTTEST_ACCEPT"):
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text + "\n")
        return
    assert path.exists(), f"no snapshot {path}: run with EXPECTTEST_ACCEPT=1 and review it"
    expected = path.read_text().rstrip("\n")
    if text != expected:
        diff = "\n".join(
            difflib.unified_diff(expected.splitlines(), text.splitlines(), "expected", "actual")
        )
        raise AssertionError(f"graph snapshot {name} changed:\n{diff}")


@pytest.fixture
def interpreted_triton():
    """A context manager: Inductor generates Triton for CPU tensors and Triton's interpreter
    runs it with a GPU's bf16 rounding (tests/triton_interp.py); skips without triton."""
    import triton_interp

    reason = triton_interp.available()
    if reason:
        pytest.skip(reason)
    return triton_interp.interpreted_triton


@pytest.fixture
def triton_device():
    """Where a Triton test runs: ``"cuda"`` on a GPU (nothing patched), else ``"cpu"`` with
    Triton's interpreter standing in for the GPU (tests/triton_interp.py)."""
    import triton_interp

    with triton_interp.triton_device() as device:
        yield device
