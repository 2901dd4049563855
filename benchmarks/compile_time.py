"""Compile time of the AdamW step, plain Inductor against collage light and plus, per
shape family and tensor count, cold and warm.

    python -m benchmarks.compile_time [--shapes same gpt llama] [--counts 300 1000]
                                      [--variants plain light plus] [--repeats 1]
                                      [--threads 1] [--device cpu]

For every (shape family, tensor count) of ``benchmarks.shapes`` and every variant, one
round runs two fresh Python processes that share a fresh Inductor cache directory:

* ``cold``: the first process compiles ``torch.optim.AdamW(foreach=True)``'s step over
  bf16 parameters of those shapes with an empty cache (Dynamo, the rewrite, AOTAutograd,
  Inductor, the C++/Triton compiler), after paying Inductor's one-time process costs on a
  tiny function; the time is the compiled step's first call.
* ``2nd opt``: the same process then compiles a second optimizer of the same class over
  new parameters of the same shapes (a second model, a restarted run).
* ``warm``: a second process compiles the first optimizer's step again, with the cache the
  first one filled (the next run of the same job).

Each timed compile starts after ``gc.collect()``: a cold compile leaves millions of objects
behind, and a full collection of them (seconds) otherwise lands in whichever compile
allocates next, the ``2nd opt`` of one variant and not of another.

Variants are interleaved within a round (these machines are noisy); each number is the
median over rounds, and each ratio is the median of the rounds' ratios to plain's time in
the same round, which follows the machine's slow drifts less than a ratio of medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from benchmarks.shapes import FAMILIES, family_shapes

VARIANTS = ("plain", "light", "plus")
KINDS = ("cold", "2nd opt", "warm")


def adamw_step(variant: str, shapes: list, device: str) -> Callable[[], Any]:
    """A new ``AdamW(foreach=True)``'s step over bf16 parameters of ``shapes``, wrapped by
    ``torch.compile`` with ``variant``'s backend (not yet compiled: that is its first call)."""
    import torch

    import collage_compile
    from benchmarks.step import DEFAULT, make_params

    ps = make_params(shapes, device, torch.bfloat16)
    opt = DEFAULT.adamw(ps, foreach=True)
    backend = "inductor" if variant == "plain" else collage_compile.make_backend(mode=variant)
    return torch.compile(opt.step, backend=backend)


def _compile_once(variant: str, shapes: list, device: str) -> float:
    """Seconds until the first call of a new AdamW's compiled step returns."""
    from benchmarks.metrics_overhead import sync

    step = adamw_step(variant, shapes, device)
    # the previous compile's garbage (millions of objects after a cold one) is collected
    # before the clock starts, not by whichever compile's allocations trigger it next
    gc.collect()
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def _child(variant: str, shapes: list, device: str, second: bool) -> None:
    """One process; the Inductor cache directory comes from the environment."""
    import torch

    from benchmarks.metrics_overhead import sync

    x = torch.ones(8, device=device)
    torch.compile(lambda t: t * 2 + 1, backend="inductor")(x)
    sync(device)
    out = {"first": _compile_once(variant, shapes, device)}
    if second:
        out["second"] = _compile_once(variant, shapes, device)
    print(json.dumps(out))


def _run_child(
    args: argparse.Namespace, variant: str, family: str, count: int, cache: str, second: bool
) -> dict[str, float]:
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", variant]
    cmd += ["--shapes", family, "--counts", str(count), "--device", args.device]
    cmd += ["--threads", str(args.threads)] + (["--second"] if second else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _round(args: argparse.Namespace, family: str, count: int) -> dict[str, dict[str, float]]:
    times: dict[str, dict[str, float]] = {}
    for v in args.variants:
        cache = tempfile.mkdtemp(prefix="collage-ct-")
        try:
            cold = _run_child(args, v, family, count, cache, second=True)
            warm = _run_child(args, v, family, count, cache, second=False)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        times[v] = {"cold": cold["first"], "2nd opt": cold["second"], "warm": warm["first"]}
        print(
            f"  {family} x {count} {v}: " + " ".join(f"{k} {t:.1f} s" for k, t in times[v].items()),
            file=sys.stderr,
            flush=True,
        )
    return times


def _report(
    family: str, n: int, rounds: list[dict[str, dict[str, float]]], variants: list[str]
) -> None:
    for v in variants:
        cells = []
        for k in KINDS:
            med = statistics.median(r[v][k] for r in rounds)
            ratio = statistics.median(r[v][k] / r["plain"][k] for r in rounds)
            cells.append(f"{med:8.1f} {ratio:5.2f}")
        print(f"{family:6} {n:6} {v:6} " + "  ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--counts", nargs="+", type=int, default=[300, 1000])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--second", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.child:
        shapes = family_shapes(args.shapes[0], args.counts[0])
        _child(args.child, shapes, args.device, args.second)
        return
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")

    print(
        f"compile time of the AdamW(foreach=True) step, {args.device}, {args.threads} "
        f"thread(s), median of {args.repeats} round(s); s and ratio to plain"
    )
    print(f"{'shapes':6} {'tensors':>6} {'':6} " + "  ".join(f"{k:>14}" for k in KINDS))
    for family in args.shapes:
        for count in args.counts:
            n = len(family_shapes(family, count))
            rounds = [_round(args, family, count) for _ in range(args.repeats)]
            _report(family, n, rounds, args.variants)


if __name__ == "__main__":
    main()
