"""Host time of the compiled AdamW step: what the backend's wrapper adds per call.

    python -m benchmarks.host [--tensors 48,300] [--rounds 7] [--steps 200]
    python -m benchmarks.host --device cuda --tensors 75 --schedule \\
        --variants plain,fused32,fused16,light,plain-cg,light-cg,plus-cg --profile light-cg

Each parameter holds 8 bf16 elements, so the kernels cost next to nothing and the time of a
step is the host's: Dynamo's guards, the compiled module's call, and for collage the
wrapper around it (lo inputs, the outside-write check, the optimizer watch).  Each variant
is compiled once per tensor count, then timed in interleaved rounds so the machine's drift
hits all alike; the median per step and the ratio to plain Inductor are printed.

On a CPU the clock is thread CPU time with one torch thread.  On CUDA it is wall time, the
device synchronized at the end of each round: with kernels this small the device waits for
the host, so that is the host's time per step, launches included.  There ``fused32`` and
``fused16`` are torch's ``AdamW(fused=True)`` run eagerly (fp32 and bf16 weights), and
``-cg`` variants are captured as CUDA graphs: plain Inductor's with
``mode="reduce-overhead"`` (cudagraph trees, CUDA only), collage's with
``compile_optimizer(opt, cudagraphs=True)``, the whole step as one replay
(:mod:`collage_compile.replay`; on a CPU its graphs called directly, without Dynamo).
Collage variants are compiled by ``compile_optimizer``.
``--schedule`` adds a LambdaLR that sets a new learning rate after every step: a Python
float, except for plain Inductor, which recompiles for each new float and gets a tensor lr
on the step's device, as torch advises.  ``--profile VARIANT`` prints where that variant's
host time goes (cProfile, the 25 costliest functions by their own time, then with their
callees).  ``--code DIR`` writes the code
Inductor generated for each variant there and prints, per variant, what a captured step
costs beyond one replay: graph partitions (each replayed and checked on its own; Inductor
splits a captured graph at CPU work and device copies), host reads of 0-dim CPU inputs
(``.item()``) and CPU buffers (work outside the replay: a CPU scalar input that Inductor
copies to the device, through a pinned buffer, into a new tensor each step).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable

import torch

VARIANTS = ("plain", "light", "plus")
REPLAYED = ("light-cg", "plus-cg")
CUDA_ONLY = ("plain-cg",)
EAGER = ("fused32", "fused16")


def build(variant: str, n: int, device: str = "cpu", schedule: bool = False) -> Callable[[], None]:
    """One variant's step on ``n`` tensors, compiled and settled; with ``schedule`` a
    LambdaLR after it, as a training loop calls them."""
    import collage_compile

    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if variant == "fused32" else torch.bfloat16
    ps = [torch.nn.Parameter(torch.randn(8, generator=g).to(device, dtype)) for _ in range(n)]
    for p in ps:
        p.grad = (1e-3 * torch.randn(8, generator=g)).to(device, dtype)
    fused = variant in EAGER
    mode, _, captured = variant.partition("-")
    # stock Inductor recompiles for each new float lr: torch's advice is a tensor lr (which
    # foreach=True takes with capturable=True; without foreach the CPU's default is a
    # per-tensor loop that costs 5x the host time)
    tensor_lr = schedule and mode == "plain"
    opt = torch.optim.AdamW(
        ps,
        # on the step's device: a CPU tensor lr would be copied to it before each replay
        lr=torch.tensor(1e-4, device=device) if tensor_lr else 1e-4,
        weight_decay=0.01,
        foreach=None if fused else True,
        fused=fused or None,
        capturable=tensor_lr,
    )
    if not fused and mode != "plain":  # before the scheduler, as the GPU demo does
        collage_compile.compile_optimizer(opt, mode=mode, cudagraphs=bool(captured))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 + (i % 97) / 97)
    step = opt.step
    if mode == "plain":
        step = torch.compile(opt.step, mode="reduce-overhead" if captured else None)

    # the step holds the optimizer and its scheduler alive: a compiled opt.step holds the
    # optimizer weakly (AttributeError on '_opt_called' once built() returned)
    def run(kept: tuple = (opt, sched)) -> None:
        step()
        if schedule:
            kept[1].step()

    for _ in range(5):  # compile (and capture), then settle
        run()
    whole = getattr(opt.step, "whole_step", None)
    if whole is not None and whole.plan is None:
        print(f"{variant}: not replayed ({whole.refused})", file=sys.stderr)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="48,300")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"a comma-separated subset of {VARIANTS + EAGER + REPLAYED + CUDA_ONLY} "
        "('plain' first)",
    )
    ap.add_argument("--schedule", action="store_true", help="a new lr after every step (LambdaLR)")
    ap.add_argument("--profile", metavar="VARIANT", help="cProfile this variant's steps")
    ap.add_argument("--code", metavar="DIR", help="write each variant's generated code here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS + EAGER + REPLAYED + CUDA_ONLY)
    if unknown or variants[0] != "plain":
        raise SystemExit(f"--variants: 'plain' first, then any of the others ({sorted(unknown)})")
    if args.device == "cpu" and set(variants) & set(CUDA_ONLY):
        raise SystemExit(f"{CUDA_ONLY} capture CUDA graphs: --device cuda")
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # one cache entry per variant of AdamW.step
    counts = [int(x) for x in args.tensors.split(",")]
    steps, codes = {}, {}
    for n in counts:
        for v in variants:
            try:  # a variant that fails on this torch costs its own row, not the others'
                steps[v, n] = built(v, n, args, codes)
            except Exception as e:
                print(f"{v} at {n} tensors failed: {type(e).__name__}: {e}", file=sys.stderr)
    times = timed(steps, args.rounds, args.steps, args.device)
    clock = "thread CPU time" if args.device == "cpu" else "wall, synchronized per round"
    print(
        f"host time of an AdamW step (8 bf16 elements per tensor), {args.device}, torch "
        f"{torch.__version__}, 1 thread{', a new lr every step' if args.schedule else ''}; "
        f"median of {args.rounds} interleaved rounds of {args.steps} steps ({clock})"
    )
    print(f"{'tensors':>7} {'variant':8} {'us/step':>9} {'vs plain':>8} {'us/tensor':>9}")
    for n in counts:
        base = statistics.median(times["plain", n]) if ("plain", n) in times else None
        for v in variants:
            if (v, n) not in times:
                continue
            med = statistics.median(times[v, n])
            ratio = f"{med / base:8.2f}" if base else f"{'-':>8}"
            print(f"{n:7d} {v:8} {med:9.1f} {ratio} {med / n:9.2f}")
    if codes:
        print(f"\ngenerated code, in {args.code}: files, then summed over them")
        print(
            f"{'tensors':>7} {'variant':8} {'files':>5} {'partitions':>10} {'.item()':>7} "
            f"{'cpu buffers':>11}"
        )
        for (v, n), texts in codes.items():
            parts = sum(len(re.findall(r"= self\.partitions\[\d+\]\(", t)) for t in texts)
            items = sum(t.count(".item()") for t in texts)
            cpu = sum(len(re.findall(r"empty_strided_cpu(?:_pinned)?\(\(", t)) for t in texts)
            print(f"{n:7d} {v:8} {len(texts):5d} {parts:10d} {items:7d} {cpu:11d}")
    if args.profile and (args.profile, counts[-1]) in steps:
        profile(steps[args.profile, counts[-1]], args.steps)


def built(variant: str, n: int, args: argparse.Namespace, codes: dict) -> Callable[[], None]:
    """:func:`build`; with ``--code``, the code Inductor generated meanwhile is kept in
    ``codes`` and written to files."""
    if not args.code:
        return build(variant, n, args.device, args.schedule)
    from collage_compile import _compat

    step, texts = _compat.run_and_keep_kernel_code(
        build, variant, n, args.device, args.schedule, fresh=True
    )
    os.makedirs(args.code, exist_ok=True)
    for i, text in enumerate(texts):
        with open(os.path.join(args.code, f"{variant}-{n}-{i}.py"), "w") as f:
            f.write(text)
    codes[variant, n] = texts
    return step


def timed(steps: dict, rounds: int, n_steps: int, device: str) -> dict:
    """Microseconds per step of each entry, one sample per round."""
    cuda = device == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    times: dict = {k: [] for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
            t0 = clock()
            for _ in range(n_steps):
                step()
            if cuda:
                torch.cuda.synchronize()
            times[key].append((clock() - t0) / n_steps * 1e6)
    return times


def profile(step: Callable[[], None], n_steps: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n_steps):
        step()
    prof.disable()
    for key, what in (("tottime", "own time"), ("cumulative", "time with callees")):
        print(f"\nwhere the host time of {n_steps} steps goes (cProfile, by {what}):")
        pstats.Stats(prof).sort_stats(key).print_stats(25)


if __name__ == "__main__":
    main()
