"""What ``metrics=True`` costs on a compiled AdamW step, measured side by side in one run.

    python -m benchmarks.metrics_overhead [--size small|cpu|gpu] [--foreach] [--rounds 7]
                                          [--every 64]

bf16 parameters (a GPT-style layer list) with a stock ``torch.optim.AdamW`` for each of
collage light, collage plus and ``mode="off"`` (plain bf16, the graph Inductor would
compile), whose step is compiled three times over the same parameters and state: without
metrics, with metrics on every step, and with ``every=K`` (one step in K measured, the
others run the graph compiled without the measurement), and once more without metrics
(the comparison's noise floor).  Each timed sample is K steps of one variant (so an
every=K sample holds exactly one measured step), taken round-robin over several rounds;
the median per step is printed, with the page faults per step and the kernels and loop
nests Inductor generated (read from its C++ / Triton source).  The overhead of a variant
is the median over rounds of its sample divided by its mode's sample without metrics in
the same round (a few seconds apart), so a drift of the machine between rounds cancels
out; each sample follows an untimed step of the same parameters.
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import collage_compile
from collage_compile import _compat

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

MODES = ("light", "plus", "off")
SIZES = {
    # (layers, width): a GPT block is qkv (w, 3w), proj (w, w), fc (w, 4w), fc2 (4w, w),
    # their biases and two LayerNorms
    "tiny": (1, 32),  # the smoke test of benchmarks.step
    "small": (2, 256),
    "cpu": (4, 576),
    "gpu": (12, 1024),
    "large": (4, 2560),  # 315M params in 48 tensors: a GPU step where memory dominates
    "t300": (25, 32),  # 300 small tensors: compile time at a Llama-7B tensor count
}


def layer_shapes(layers: int, width: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(4 * width, width), (4 * width,), (width, 4 * width), (width,)]
        shapes += [(width,)] * 4
    return shapes


def make_params(shapes, device):
    g = torch.Generator().manual_seed(0)
    ps = [
        torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device, torch.bfloat16))
        for s in shapes
    ]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device, torch.bfloat16)
    return ps


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def minor_faults() -> int:
    """Page faults this thread took so far (memory the kernel had to map in: a large
    buffer allocated afresh faults once per page on first touch)."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def count_code(code: list[str]) -> tuple[int, int]:
    src = "\n".join(code)
    kernels = len(set(re.findall(r"\b((?:cpp|triton)_\w+?_\d+)\b\s*(?:\(|=|\.run)", src)))
    loops = src.count("#pragma omp for") + src.count("@triton.jit")
    return kernels, loops


def main() -> None:
    args = _parse()
    # nine AdamW instances share torch.optim's step code: Dynamo's limit of 8 graphs per
    # code object would leave the last ones eager (docs/limits.md)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = layer_shapes(*SIZES[args.size])
    variants = _variants(args.every)
    steps, info = _compile(variants, shapes, args)
    samples, faults = _time(variants, steps, args)
    _report(variants, info, samples, faults, shapes, args)


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=SIZES, default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--every", type=int, default=64, help="K of the every=K variants")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time (with --threads 1 all the work is on this thread; "
        "robust to other jobs on a shared machine)",
    )
    return ap.parse_args()


def _variants(every: int) -> dict[str, dict[str, Any]]:
    """Per mode: the step, with metrics every step, every ``every`` steps, and compiled again
    without them; name -> :func:`collage_compile.make_backend` options."""
    variants: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        variants[mode] = dict(mode=mode)
        variants[f"{mode}+metrics"] = dict(mode=mode, metrics=True)
        variants[f"{mode}+metrics/{every}"] = dict(mode=mode, metrics=True, every=every)
        # the same step compiled once more without metrics: what this comparison reads
        # when nothing differs (the machine's noise)
        variants[f"{mode} again"] = dict(mode=mode)
    return variants


def _compile(
    variants: dict[str, dict[str, Any]], shapes: list[tuple[int, ...]], args: argparse.Namespace
) -> tuple[dict[str, Callable[[], Any]], dict[str, tuple[float, int, int]]]:
    """Each variant's compiled step, and its (compile seconds, kernels, loops)."""
    steps, info = {}, {}
    for mode in MODES:
        # the variants of a mode step the same parameters, pairs and optimizer state (the
        # metrics change no update): a copy of its own for each would put each variant's
        # 16M parameters elsewhere in memory, which alone moved a step by 10 %
        ps = make_params(shapes, args.device)
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=args.foreach)
        names = [name for name, options in variants.items() if options["mode"] == mode]
        for name in names:  # each backend compiles its own graph of the same step
            steps[name] = torch.compile(
                opt.step, backend=collage_compile.make_backend(**variants[name])
            )
        for name in names:
            t0 = time.perf_counter()
            _, code = _compat.run_and_keep_kernel_code(steps[name])
            sync(args.device)
            info[name] = (time.perf_counter() - t0, *count_code(code))
    return steps, info


def _time(
    variants: dict[str, dict[str, Any]],
    steps: dict[str, Callable[[], Any]],
    args: argparse.Namespace,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant, the seconds and minor page faults per step of each round."""
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            # an untimed step of the same parameters first: a sample that follows another
            # mode's would otherwise pay for bringing its tensors back into the caches
            steps[variants[name]["mode"]]()
            sync(args.device)
            f0, t0 = minor_faults(), clock()
            for _ in range(args.every):
                fn()
            sync(args.device)
            samples[name].append((clock() - t0) / args.every)
            faults[name].append((minor_faults() - f0) / args.every)
    return samples, faults


def _report(variants, info, samples, faults, shapes, args) -> None:
    """The table of medians, then each mode's metrics overhead as ratios per round."""
    n = sum(torch.Size(s).numel() for s in shapes)
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(
        f"AdamW step, {n / 1e6:.2f}M bf16 params in {len(shapes)} tensors, "
        f"foreach={args.foreach}, {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; median of {args.rounds} interleaved rounds of "
        f"{args.every} steps ({'thread CPU' if args.clock == 'cpu' else 'wall-clock'} time)"
    )
    print(
        f"{'variant':<18} {'ms/step':>8} {'ns/param':>9} {'faults/step':>12} {'compile s':>10} "
        f"{'kernels':>8} {'loops':>6}"
    )
    for name in variants:
        c, k, lp = info[name]
        print(
            f"{name:<18} {med[name] * 1e3:8.2f} {med[name] * 1e9 / n:9.3f} "
            f"{statistics.median(faults[name]):12.0f} {c:10.1f} {k:8d} {lp:6d}"
        )

    def overhead(name: str, base: str) -> float:
        return statistics.median(v / b for v, b in zip(samples[name], samples[base]))

    k = args.every
    for mode in MODES:
        every_step = overhead(mode + "+metrics", mode)
        print(
            f"overhead of metrics, {mode}: every step {every_step:.3f}x, "
            f"every={k} {overhead(f'{mode}+metrics/{k}', mode):.3f}x "
            f"(one measured step in {k}: {1 + (every_step - 1) / k:.3f}x expected; "
            f"no metrics, compiled again: {overhead(mode + ' again', mode):.3f}x)"
        )


if __name__ == "__main__":
    main()
