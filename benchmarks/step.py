"""Optimizer step speed, memory and compile time against the alternatives, side by side.

    python -m benchmarks.step [--size small|cpu|gpu|demo] [--device cpu|cuda] [--no-foreach]
                              [--variants fused light plus exact cudagraphs eager others]
                              [--shapes same|gpt|llama --count 300]
                              [--threads N] [--clock wall|cpu] [--rounds 15] [--jobs N]
                              [--new-grads] [--json PATH] [--plot PATH]

One GPT-style layer list of bf16 parameters (``benchmarks.metrics_overhead.layer_shapes``)
and one stock ``torch.optim.AdamW`` (lr 1e-3, weight decay 0.01) per variant; ``--size
demo``: the 75 parameters of ``examples/train_llama.py``'s Llama (25.17M) and its AdamW
(betas (0.9, 0.95), weight decay 0.1 on matrices only: two param groups), so that the
step timed is the example's:

* ``fp32 master``: (16, 32) mixed precision.  fp32 master weights, fp32 grads and state,
  compiled with plain Inductor; the step also writes the bf16 model copy the forward pass
  reads (``torch._foreach_copy_``), as such training must.
* ``plain bf16``: bf16 parameters and state, plain Inductor (``backend="inductor"``).
* ``fp32 fused`` / ``bf16 fused``: torch's own ``AdamW(fused=True)``, eager, on fp32 master
  weights (writing the bf16 model copy after it) and on bf16 weights.
* ``collage light`` / ``collage plus`` / ``collage exact``: this backend.
* ``... cudagraphs`` (CUDA only): plain bf16 with ``mode="reduce-overhead"`` (Inductor's
  cudagraph trees), collage light and plus with ``compile_optimizer(opt,
  cudagraphs=True)``: the whole step captured once and replayed (:mod:`collage_compile.replay`).
* ``eager Collage``: the paper's Collage-light AdamW written op by op with eager bf16
  ``torch._foreach_*`` ops (:class:`EagerCollageAdamW`), the reference-implementation baseline.
* ``optimi Kahan`` / ``torchao bf16 SR``: when those packages are installed (skipped otherwise).

Steps are timed interleaved (round-robin over the variants and a copy of the same bytes,
several rounds) and the median is reported as ms/step and ns/param, with the ratio to the
fp32-master and the plain-bf16 steps, the bytes each step must move (counted per parameter:
the floor), the bandwidth that implies against the copy bandwidth measured in the same run,
persistent bytes/param (measured from the tensors), peak memory during a step, cold compile
time (a fresh Inductor cache directory per run) and the kernels / parallel loop nests read
from the generated code.  Each round also times every variant's step alone, between two
synchronizations (``synced ms``, with its ratios to the fused steps), as
``examples/train_llama.py`` times its optimizer step: the host work before the step's
kernels start plus their device time, which back-to-back steps overlap.

``--new-grads``: every step's gradients are new tensors (two sets of copies, alternated), as a
training loop's ``zero_grad()`` and ``backward()`` make them, as in the demo; without it the
gradients stay the same tensors from step to step.  A whole-step replay copies each step's
gradients into buffers of its own either way (4 bytes a parameter more than its floor).

Compiles: with ``--jobs N`` > 1 (on CUDA the default is up to 8), each compiled variant is
first compiled cold in a process of its own, N at a time, into the run's cache; the table's
compile time is that process's, and this process then compiles each from the cache.  A
cold compile is mostly one Python thread, so at ``--size gpu`` (seven compiled variants of
144 tensors, about a minute each on an H100 host) one after another did not finish in 5
minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import collage_compile
from benchmarks.metrics_overhead import SIZES, count_code, layer_shapes, sync
from benchmarks.shapes import FAMILIES, family_shapes
from collage_compile import _compat

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


@dataclasses.dataclass(frozen=True)
class Hyper:
    """The AdamW every variant runs.  ``matrices_only``: weight decay on the parameters of
    two or more dimensions, none on the others (two param groups, as the demos make)."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    matrices_only: bool = False

    def groups(self, params: list[torch.Tensor]) -> list[dict[str, Any]]:
        """``params`` as param groups with their weight decay."""
        if not self.matrices_only:
            return [{"params": params, "weight_decay": self.weight_decay}]
        matrices = [p for p in params if p.dim() >= 2]
        return [
            {"params": matrices, "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    def adamw(self, params: list[torch.Tensor], cls: Any = None, **kw: Any) -> Any:
        """``cls`` (torch's AdamW by default) over ``params`` with these settings."""
        cls = cls or torch.optim.AdamW
        return cls(self.groups(params), lr=self.lr, betas=self.betas, eps=self.eps, **kw)

    def decay_of(self, p: torch.Tensor) -> float:
        return self.weight_decay if p.dim() >= 2 or not self.matrices_only else 0.0

    def describe(self) -> str:
        on = " on matrices" if self.matrices_only else ""
        return f"lr {self.lr:g}, betas {self.betas}, weight decay {self.weight_decay:g}{on}"


DEFAULT = Hyper()
# examples/train_llama.py's AdamW at its defaults (its peak lr; the schedule moves only lr)
DEMO = Hyper(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), matrices_only=True)

# Bytes a step must read and write per parameter (the memory-bound floor), AdamW:
# fp32 master: master r/w 8, fp32 grad 4, m r/w 8, v r/w 8, bf16 model copy written 2;
# bf16: p r/w 4, grad 2, m r/w 4, v r/w 4; light adds lo r/w 4; plus also v's lo r/w 4;
# exact: p, m and v each with its remainder r/w 8, grad 2.
FLOOR_BYTES = {"fp32": 30, "bf16": 14, "light": 18, "plus": 22, "exact": 26}


def floor_bytes(mode: str, hyper: Hyper) -> int:
    """:data:`FLOOR_BYTES`, where plus pairs the second moment only at ``beta2 >=
    plus_min_decay`` (0.99): below it plus moves light's bytes."""
    if mode == "plus" and hyper.betas[1] < collage_compile.CollageConfig().plus_min_decay:
        return FLOOR_BYTES["light"]
    return FLOOR_BYTES[mode]


@dataclasses.dataclass
class Variant:
    name: str
    step: Callable[[], Any]
    tensors: Callable[[], list[torch.Tensor]]  # everything the step keeps between steps
    floor: int | None  # bytes/param the step must move (None: not counted)
    params: list[torch.Tensor]  # the tensors whose gradients the step reads
    compiled: bool = True
    compile_s: float | None = None
    kernels: int | None = None
    loops: int | None = None
    samples: list[float] = dataclasses.field(default_factory=list)
    synced: list[float] = dataclasses.field(default_factory=list)  # one step between syncs
    peak_bytes: int | None = None
    compile_here_s: float | None = None  # compiled cold elsewhere: this process's compile


def make_params(
    shapes: list[tuple[int, ...]], device: str, dtype: torch.dtype
) -> list[torch.nn.Parameter]:
    """The same values for every variant (seeded), stored in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device, dtype))
        p.grad = (torch.randn(s, generator=g) * 1e-3).to(device, dtype)
        ps.append(p)
    return ps


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class EagerCollageAdamW:
    """Collage-light AdamW (arXiv 2405.03637, Algorithm 2 with Grow), op by op in eager bf16.

    Every operation is a ``torch._foreach_*`` op on bf16 tensors, so each one is rounded
    to bf16 as the paper's algorithm specifies and each is its own pass over memory: the
    cost of the algorithm without a compiler.  Moments are plain bf16 (light); the weight
    update ``u = -lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)`` is added to the pair
    ``(p, dp)`` with Grow: ``s = p + u; dp += u - (s - p); p = s + dp; dp -= p - s``.
    """

    def __init__(self, params: list[torch.Tensor], hyper: Hyper = DEFAULT):
        self.params, self.hyper = params, hyper
        self.decay = [hyper.decay_of(p) for p in params]
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.dp = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        h = self.hyper
        b1, b2 = h.betas
        self.t += 1
        grads = [p.grad for p in self.params]
        torch._foreach_lerp_(self.m, grads, 1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, grads, grads, 1 - b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_div_(denom, (1 - b2**self.t) ** 0.5)
        torch._foreach_add_(denom, h.eps)
        u = torch._foreach_div(self.m, denom)
        decay = torch._foreach_mul(self.params, [wd * (1 - b1**self.t) for wd in self.decay])
        torch._foreach_add_(u, decay)
        torch._foreach_mul_(u, -h.lr / (1 - b1**self.t))
        s = torch._foreach_add(self.params, u)  # Grow
        torch._foreach_add_(u, torch._foreach_sub(s, self.params), alpha=-1)
        torch._foreach_add_(self.dp, u)
        new_p = torch._foreach_add(s, self.dp)
        torch._foreach_add_(self.dp, torch._foreach_sub(new_p, s), alpha=-1)
        torch._foreach_copy_(self.params, new_p)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.m, *self.v, *self.dp]


FUSED32 = "fp32 fused (16,32)"
FUSED16 = "bf16 fused"
MASTER = "fp32 master (16,32)"
OPTIONAL = ("fused", "light", "plus", "exact", "cudagraphs", "eager", "others")


def build_variants(
    shapes: list[tuple[int, ...]],
    device: str,
    foreach: bool,
    only: tuple[str, ...] = OPTIONAL,
    keep: str | None = None,
    hyper: Hyper = DEFAULT,
) -> list[Variant]:
    """fp32 master and plain bf16 (the references of every ratio), then those of
    :data:`OPTIONAL` named in ``only``; ``keep``: only the variant of that name (a
    compile worker builds nothing else: at ``--size gpu`` each variant's tensors are GBs)."""
    factories = _factories(shapes, device, foreach, only, hyper)
    if "cudagraphs" in only and device != "cuda" and keep is None:
        print("skipped: cudagraphs rows (CUDA graphs capture CUDA work only)", file=sys.stderr)
    if keep is not None:
        return factories[keep]()
    return [v for make in factories.values() for v in make()]


def _factories(
    shapes: list[tuple[int, ...]],
    device: str,
    foreach: bool,
    only: tuple[str, ...],
    hyper: Hyper = DEFAULT,
) -> dict[str, Callable[[], list[Variant]]]:
    """Each variant's name (a group's, for ``others``) and what builds it, in table order."""

    def stock(name: str, backend: Any, floor: int, mode: str | None = None) -> list[Variant]:
        ps = make_params(shapes, device, torch.bfloat16)
        opt = hyper.adamw(ps, foreach=foreach)

        def tensors() -> list[torch.Tensor]:
            los = [collage_compile.components(p)[1] for p in ps]
            los += [collage_compile.components(t)[1] for t in _state_tensors(opt)]
            return [*ps, *_state_tensors(opt), *(lo for lo in los if lo is not None)]

        step = torch.compile(opt.step, backend=backend, mode=mode)
        return [Variant(name, step, tensors, floor, ps)]

    out: dict[str, Callable[[], list[Variant]]] = {
        MASTER: lambda: [_master(shapes, device, foreach, hyper)],
        "plain bf16": lambda: stock("plain bf16", "inductor", FLOOR_BYTES["bf16"]),
    }
    if "fused" in only:
        out[FUSED32] = lambda: [_fused32(shapes, device, hyper)]
        out[FUSED16] = lambda: [_fused16(shapes, device, hyper)]
    for mode in ("light", "plus", "exact"):
        if mode in only:
            out[f"collage {mode}"] = functools.partial(
                lambda m: stock(
                    f"collage {m}", collage_compile.make_backend(mode=m), floor_bytes(m, hyper)
                ),
                mode,
            )
    if "cudagraphs" in only and device == "cuda":
        # Inductor's own option for plain bf16; the whole-step replay for collage
        out["plain bf16 cudagraphs"] = lambda: stock(
            "plain bf16 cudagraphs", "inductor", FLOOR_BYTES["bf16"], "reduce-overhead"
        )
        for mode in ("light", "plus"):  # with or without their uncaptured rows
            name = f"collage {mode} cudagraphs"
            out[name] = functools.partial(
                lambda n, m: [_replayed(n, m, shapes, device, hyper)], name, mode
            )
    if "eager" in only:
        out["eager Collage (ref)"] = lambda: [_eager(shapes, device, hyper)]
    if "others" in only:
        out["others"] = lambda: _third_party(shapes, device, foreach, hyper)
    return out


def _master(
    shapes: list[tuple[int, ...]], device: str, foreach: bool, hyper: Hyper = DEFAULT
) -> Variant:
    """(16, 32): fp32 master weights and state; the bf16 model copy written every step."""
    master = make_params(shapes, device, torch.float32)
    model = [p.detach().to(torch.bfloat16) for p in master]
    opt32 = hyper.adamw(master, foreach=foreach)

    def step32(opt=opt32, master=master, model=model):
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(model, master)

    return Variant(
        MASTER,
        torch.compile(step32, backend="inductor"),
        lambda: [*master, *model, *_state_tensors(opt32)],
        FLOOR_BYTES["fp32"],
        master,
    )


def _eager(shapes: list[tuple[int, ...]], device: str, hyper: Hyper = DEFAULT) -> Variant:
    ref = EagerCollageAdamW(make_params(shapes, device, torch.bfloat16), hyper)
    return Variant("eager Collage (ref)", ref.step, ref.tensors, 18, ref.params, compiled=False)


def _replayed(
    name: str, mode: str, shapes: list[tuple[int, ...]], device: str, hyper: Hyper = DEFAULT
) -> Variant:
    """``compile_optimizer(opt, mode=mode, cudagraphs=True)``: the step replayed whole."""
    ps = make_params(shapes, device, torch.bfloat16)
    opt = hyper.adamw(ps, foreach=True)
    collage_compile.compile_optimizer(opt, mode=mode, cudagraphs=True)

    def tensors() -> list[torch.Tensor]:
        los = [collage_compile.components(t)[1] for t in [*ps, *_state_tensors(opt)]]
        return [*ps, *_state_tensors(opt), *(lo for lo in los if lo is not None)]

    return Variant(name, opt.step, tensors, floor_bytes(mode, hyper), ps)


def _fused32(shapes: list[tuple[int, ...]], device: str, hyper: Hyper = DEFAULT) -> Variant:
    """torch's ``AdamW(fused=True)``, eager as users run it, on fp32 master weights (with
    the bf16 model copy written after it)."""
    master = make_params(shapes, device, torch.float32)
    model = [p.detach().to(torch.bfloat16) for p in master]
    opt32 = hyper.adamw(master, fused=True)

    def step32() -> None:
        opt32.step()
        with torch.no_grad():
            torch._foreach_copy_(model, master)

    return Variant(
        FUSED32,
        step32,
        lambda: [*master, *model, *_state_tensors(opt32)],
        FLOOR_BYTES["fp32"],
        master,
        compiled=False,
    )


def _fused16(shapes: list[tuple[int, ...]], device: str, hyper: Hyper = DEFAULT) -> Variant:
    """torch's ``AdamW(fused=True)`` on bf16 weights (plain low precision)."""
    ps = make_params(shapes, device, torch.bfloat16)
    opt16 = hyper.adamw(ps, fused=True)
    return Variant(
        FUSED16,
        opt16.step,
        lambda: [*ps, *_state_tensors(opt16)],
        FLOOR_BYTES["bf16"],
        ps,
        compiled=False,
    )


def _third_party(
    shapes: list[tuple[int, ...]], device: str, foreach: bool, hyper: Hyper = DEFAULT
) -> list[Variant]:
    """optimi's Kahan-summation AdamW and torchao's bf16 stochastic-rounding AdamW, when
    installed (their own kernels, run as their authors ship them)."""
    out = []
    try:
        import optimi  # type: ignore[import-not-found]
    except ImportError:
        print("skipped: optimi Kahan AdamW (torch-optimi not installed)", file=sys.stderr)
    else:
        ps = make_params(shapes, device, torch.bfloat16)
        # optimi's defaults differ (betas (0.9, 0.99), eps 1e-6): the same AdamW as the others
        opt = hyper.adamw(ps, optimi.AdamW, kahan_sum=True, foreach=foreach)
        out.append(
            Variant(
                "optimi Kahan",
                opt.step,
                lambda ps=ps, opt=opt: [*ps, *_state_tensors(opt)],
                FLOOR_BYTES["light"],
                ps,
                compiled=False,
            )
        )
    TorchaoAdamW = _torchao_adamw()
    if TorchaoAdamW is None:
        print("skipped: torchao bf16 SR AdamW (torchao not installed)", file=sys.stderr)
    else:
        ps = make_params(shapes, device, torch.bfloat16)
        opt = hyper.adamw(ps, TorchaoAdamW, bf16_stochastic_round=True)
        out.append(
            Variant(
                "torchao bf16 SR",
                opt.step,
                lambda ps=ps, opt=opt: [*ps, *_state_tensors(opt)],
                FLOOR_BYTES["bf16"],
                ps,
                compiled=False,  # torchao compiles its own step internally
            )
        )
    return out


def _torchao_adamw() -> Any:
    """torchao's full-precision-state AdamW with ``bf16_stochastic_round``: named
    ``torchao.optim.AdamW`` in earlier releases, ``_AdamW`` in 0.18.0 (checked here)."""
    try:
        import torchao.optim as tao  # type: ignore[import-not-found]
    except ImportError:
        return None
    return getattr(tao, "AdamW", None) or getattr(tao, "_AdamW", None)


def _warm_up_inductor(device: str) -> None:
    """Pay the process's one-time Inductor costs (imports, compiler probing) before the
    first timed compile."""
    x = torch.ones(8, device=device)
    torch.compile(lambda t: t * 2 + 1, backend="inductor")(x)
    sync(device)


def compile_variant(v: Variant, device: str) -> None:
    """First call: compile time (whole first step) and the generated code's kernels."""
    t0 = time.perf_counter()
    if v.compiled:
        _, code = _compat.run_and_keep_kernel_code(v.step)
        v.kernels, v.loops = count_code(code)
    else:
        v.step()
    sync(device)
    if v.compiled:
        v.compile_s = time.perf_counter() - t0


COLD_KEYS = ("compile_s", "kernels", "loops")


def _jobs(args: argparse.Namespace) -> int:
    """Processes compiling at once: ``--jobs``, else on CUDA up to 8 (half the host's cores;
    a cold compile is mostly one Python thread, and ``--size gpu`` compiles seven
    variants), on a CPU 1 (the timed kernels use the cores)."""
    if args.jobs:
        return args.jobs
    return max(1, min(8, _cores() // 2)) if args.device == "cuda" else 1


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cold_compiles(args: argparse.Namespace, names: list[str], jobs: int) -> dict[str, Any]:
    """With ``jobs`` > 1: each variant named compiled cold in a process of its own,
    ``jobs`` at a time, into this run's fresh Inductor cache (inherited), so that this
    process then compiles each from the cache.  Returns, per name, the worker's
    :data:`COLD_KEYS`; nothing with ``jobs`` = 1 (each compiles cold here)."""
    if jobs <= 1 or not names:
        return {}
    import concurrent.futures
    import subprocess

    base = [sys.executable, "-m", "benchmarks.step", "--device", args.device]
    base += ["--shapes", args.shapes, "--count", str(args.count)] if args.shapes else []
    base += ["--size", args.size, "--variants", *args.variants]
    base += ["--foreach" if args.foreach else "--no-foreach", "--threads", str(args.threads)]

    # each worker's share of the cores for Triton's (or the C++ compiler's) compile pool
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, _cores() // jobs))}

    def one(name: str) -> dict[str, Any]:
        cmd = [*base, "--compile-only", name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            raise RuntimeError(
                f"compiling {name} in its own process failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-3000:]}"
            )
        return json.loads(lines[-1])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        out = dict(zip(names, pool.map(one, names)))
    print(
        f"compiled {len(names)} variants cold, {jobs} processes at a time: "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return out


def _compile_only(args: argparse.Namespace, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    """A compile worker (``--compile-only NAME``): builds that variant alone and compiles it."""
    (v,) = build_variants(
        shapes, args.device, args.foreach, tuple(args.variants), args.compile_only, _hyper(args)
    )
    compile_variant(v, args.device)
    return {k: getattr(v, k) for k in COLD_KEYS}


def peak_during_step(v: Variant, device: str) -> int | None:
    """Peak bytes allocated during one step, persistent tensors included.

    CUDA: the caching allocator's peak.  CPU: the live-bytes high-water mark of the
    allocations the profiler records during the step, added to the persistent bytes."""
    persistent = sum(t.nbytes for t in v.tensors())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        v.step()
        torch.cuda.synchronize()
        return persistent + torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.step()
    live = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        if ev.name == "[memory]":
            live += ev.cpu_memory_usage
            peak = max(peak, live)
    return persistent + peak


def copy_bandwidth_step(n: int, device: str) -> tuple[Callable[[], Any], int]:
    """A copy of ``n`` fp32 values: the bandwidth reference, timed in the same rounds."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.nbytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch._dynamo.config.recompile_limit = 64  # one cache entry per variant of AdamW.step
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (torch.get_num_threads() != 1 or args.device != "cpu"):
        raise SystemExit("--clock cpu measures one thread's CPU time: use --threads 1 on cpu")
    shapes = _shapes(args)
    n = sum(torch.Size(s).numel() for s in shapes)
    _warm_up_inductor(args.device)
    if args.compile_only:
        return _compile_only(args, shapes)
    hyper = _hyper(args)
    variants = build_variants(shapes, args.device, args.foreach, tuple(args.variants), hyper=hyper)
    jobs = _jobs(args)
    cold = _cold_compiles(args, [v.name for v in variants if v.compiled], jobs)
    for v in variants:
        _prepare(v, args, cold)
    copy_gbs = _measure(variants, n, args)
    return {
        "command": "python -m benchmarks.step " + " ".join(sys.argv[1:]),
        "device": args.device,
        "machine": _machine(args.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": n,
        "tensors": len(shapes),
        "foreach": args.foreach,
        "adamw": hyper.describe(),
        "new_grads": args.new_grads,
        "rounds": args.rounds,
        "jobs": jobs if cold else 1,
        "compile": (
            f"cold, each variant in a process of its own, {jobs} at a time"
            if cold
            else "cold, one variant after another in this process"
        ),
        "steps_per_sample": args.steps,
        "clock": "thread CPU time" if args.clock == "cpu" else "wall",
        "copy_GBps": copy_gbs,
        "rows": _rows(variants, n, copy_gbs),
    }


def _prepare(v: Variant, args: argparse.Namespace, cold: dict[str, Any]) -> None:
    """Compile ``v`` (from the cache where ``cold`` compiled it in a process of its own),
    record its peak memory, and take the calls a replayed step needs before its capture."""
    compile_variant(v, args.device)
    if v.name in cold:  # compiled cold in a process of its own; here from the cache
        v.compile_here_s = v.compile_s
        v.compile_s, v.kernels, v.loops = (cold[v.name][k] for k in COLD_KEYS)
    v.peak_bytes = peak_during_step(v, args.device)
    v.step()  # a replayed step is captured at its third call: before the timing
    whole = getattr(v.step, "whole_step", None)
    if whole is not None and whole.plan is None:
        print(f"{v.name}: not replayed ({whole.refused})", file=sys.stderr)
    here = f" (here, from the cache: {v.compile_here_s:.1f} s)" if v.name in cold else ""
    print(f"compiled {v.name}: {v.compile_s or 0:.1f} s{here}", file=sys.stderr, flush=True)
    if args.new_grads:
        v.step = _with_new_grads(v.step, v.params)


def _measure(variants: list[Variant], n: int, args: argparse.Namespace) -> float:
    """Time every variant in interleaved rounds (``v.samples``: back to back; ``v.synced``:
    one step between two synchronizations) beside a copy of ``n`` fp32 values; the copy's
    bandwidth in GB/s."""
    copy_fn, copy_bytes = copy_bandwidth_step(n, args.device)
    copy_fn()
    copy_samples: list[float] = []

    # "cpu": the stepping thread's CPU time, which other processes on a shared machine do not
    # inflate (preemption is not counted); meaningful with --threads 1 on a CPU device only
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    def timed(fn: Callable[[], Any]) -> float:
        sync(args.device)
        t0 = clock()
        for _ in range(args.steps):
            fn()
        sync(args.device)
        return (clock() - t0) / args.steps

    def timed_alone(fn: Callable[[], Any]) -> float:
        """One step between two synchronizations, as train_llama times its optimizer step:
        the host work before its kernels start plus their device time, where back-to-back
        steps overlap one step's device time with the next one's host work."""
        sync(args.device)
        t0 = clock()
        fn()
        sync(args.device)
        return clock() - t0

    for _ in range(args.rounds):
        copy_samples.append(timed(copy_fn))
        for v in variants:
            v.samples.append(timed(v.step))
            v.synced.append(timed_alone(v.step))
    return copy_bytes / statistics.median(copy_samples) / 1e9


def _rows(variants: list[Variant], n: int, copy_gbs: float) -> list[dict[str, Any]]:
    """One row per variant: its median times and their ratios to the baselines."""
    med = {v.name: statistics.median(v.samples) for v in variants}
    alone = {v.name: statistics.median(v.synced) for v in variants}
    fused, fused16 = FUSED32 in med, FUSED16 in med
    rows = []
    for v in variants:
        t = med[v.name]
        persistent = sum(x.nbytes for x in v.tensors())
        gbs = v.floor * n / t / 1e9 if v.floor else None
        rows.append(
            {
                "variant": v.name,
                "ms_per_step": t * 1e3,
                "ns_per_param": t * 1e9 / n,
                "vs_fp32_master": t / med[MASTER],
                "vs_plain_bf16": t / med["plain bf16"],
                "vs_fused_fp32": t / med[FUSED32] if fused else None,
                "vs_fused_bf16": t / med[FUSED16] if fused16 else None,
                "synced_ms": alone[v.name] * 1e3,
                "synced_vs_fused_fp32": alone[v.name] / alone[FUSED32] if fused else None,
                "synced_vs_fused_bf16": alone[v.name] / alone[FUSED16] if fused16 else None,
                "floor_bytes_per_param": v.floor,
                "floor_GBps": gbs,
                "of_copy_bandwidth": gbs / copy_gbs if gbs else None,
                "persistent_bytes_per_param": persistent / n,
                "peak_MB": v.peak_bytes / 1e6 if v.peak_bytes is not None else None,
                "compile_s": v.compile_s,
                "compile_here_s": v.compile_here_s,
                "kernels": v.kernels,
                "loops": v.loops,
            }
        )
    return rows


def _hyper(args: argparse.Namespace) -> Hyper:
    """The example's AdamW at ``--size demo`` (its parameters, its settings), else
    :data:`DEFAULT`."""
    return DEMO if args.size == "demo" and not args.shapes else DEFAULT


def _shapes(args: argparse.Namespace) -> list[tuple[int, ...]]:
    if args.shapes:
        return family_shapes(args.shapes, args.count)
    if args.size == "demo":
        from collage_compile import demo_llama

        return demo_llama.parameter_shapes()
    return layer_shapes(*SIZES[args.size])


def _with_new_grads(step: Callable[[], Any], params: list[torch.Tensor]) -> Callable[[], Any]:
    """``step`` with new gradient tensors before each call (``--new-grads``): two sets of
    copies of the ones it has, in turn, never the ones it has (Dynamo and Inductor's
    cudagraph trees see the tensors they were given before as the same gradient)."""
    sets = itertools.cycle([[p.grad.clone() for p in params] for _ in range(2)])

    def stepped() -> Any:
        for p, g in zip(params, next(sets)):
            p.grad = g
        return step()

    return stepped


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores"


def format_table(res: dict[str, Any]) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"AdamW step ({res.get('adamw', DEFAULT.describe())}), {res['params'] / 1e6:.2f}M "
        f"params in {res['tensors']} tensors, foreach={res['foreach']}, "
        + ("new gradient tensors every step, " if res.get("new_grads") else "")
        + f"{res['device']} ({res['machine']}), torch {res['torch']}, "
        f"{res['threads']} threads; median of {res['rounds']} interleaved rounds x "
        f"{res['steps_per_sample']} steps ({res['clock']}); copy bandwidth "
        f"{res['copy_GBps']:.1f} GB/s"
        + ("; compile s: " + res["compile"] if res.get("jobs", 1) > 1 else ""),
        f"{'variant':<24} {'ms/step':>8} {'ns/param':>8} {'vs fp32':>7} {'vs bf16':>7} "
        f"{'vs fused32':>10} {'vs fused16':>10} {'synced ms':>9} {'vs f32':>6} {'vs f16':>6} "
        f"{'B/param':>7} {'GB/s':>6} {'of copy':>7} {'state B/p':>9} {'peak MB':>8} "
        f"{'compile s':>9} {'kernels':>7} {'loops':>5}",
    ]
    for r in res["rows"]:
        lines.append(
            f"{r['variant']:<24} {r['ms_per_step']:8.2f} {r['ns_per_param']:8.3f} "
            f"{r['vs_fp32_master']:7.2f} {r['vs_plain_bf16']:7.2f} "
            f"{f(r['vs_fused_fp32'], '.2f'):>10} {f(r.get('vs_fused_bf16'), '.2f'):>10} "
            f"{f(r.get('synced_ms'), '.2f'):>9} {f(r.get('synced_vs_fused_fp32'), '.2f'):>6} "
            f"{f(r.get('synced_vs_fused_bf16'), '.2f'):>6} "
            f"{f(r['floor_bytes_per_param'], 'd'):>7} {f(r['floor_GBps'], '.1f'):>6} "
            f"{f(r['of_copy_bandwidth'], '.0%'):>7} {r['persistent_bytes_per_param']:9.2f} "
            f"{f(r['peak_MB'], '.0f'):>8} {f(r['compile_s'], '.1f'):>9} "
            f"{f(r['kernels'], 'd'):>7} {f(r['loops'], 'd'):>5}"
        )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["variant"] for r in rows], [r["ns_per_param"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ns / parameter / step (lower is better)")
    ax.set_title(f"AdamW step, {res['params'] / 1e6:.1f}M params, {res['device']}")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size",
        choices=[*SIZES, "demo"],
        default="cpu",
        help="GPT layers (metrics_overhead.SIZES); demo: examples/train_llama.py's parameters",
    )
    ap.add_argument(
        "--shapes",
        choices=FAMILIES,
        help="a shape family of benchmarks.shapes instead of --size's GPT layers",
    )
    ap.add_argument("--count", type=int, default=300, help="tensors, with --shapes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=OPTIONAL,
        default=list(OPTIONAL),
        help="which to run besides fp32 master and plain bf16 (fused: torch's AdamW(fused=True) "
        "on fp32 master and on bf16 weights; cudagraphs: plain, light and plus captured as "
        "CUDA graphs, CUDA only; others: optimi, torchao)",
    )
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="steps per timed sample")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or (with --threads 1) the thread's CPU time, robust to other load",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="compile the variants cold in this many processes at once, then here from their "
        "cache (0: up to 8 on CUDA, 1 on a CPU)",
    )
    ap.add_argument(
        "--new-grads",
        action="store_true",
        help="new gradient tensors every step, as zero_grad() and backward() make them",
    )
    ap.add_argument("--compile-only", metavar="VARIANT", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="write a bar chart (matplotlib)")
    args = ap.parse_args()
    # A cold cache, so compile times are comparable between variants and between runs (set
    # before the first compile starts Inductor's compile workers, which inherit it; not at
    # import, where it would move the cache of the process that imports this module).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="collage-bench-"))
    res = run(args)
    if args.compile_only:  # one line for the process that started this one
        print(json.dumps(res))
        return
    print(format_table(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    if args.plot:
        plot(res, args.plot)


if __name__ == "__main__":
    main()
