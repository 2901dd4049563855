"""Cold compile time of the AdamW step: plain Inductor against collage light and plus.

    python -m benchmarks.compile_time [--size small|cpu|gpu] [--repeats 3] [--threads 1]

Each measurement is a fresh Python process with a fresh Inductor cache directory that
compiles one variant's step (the same parameter list and ``torch.optim.AdamW(foreach=True)``
as ``benchmarks.step``), after paying Inductor's one-time process costs on a tiny function;
the time is the first call of the compiled step (Dynamo, the rewrite, AOTAutograd, Inductor,
the C++/Triton compiler).  Variants are interleaved round by round (these machines are
noisy) and the median per variant is reported with its ratio to plain Inductor, and the
median of each round's ratio to that round's plain compile.
``benchmarks.step`` compiles its variants one after another in one process, where each
later compile finds the process warmer; this is the comparison the numbers in README use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("plain", "light", "plus")


def _child(variant: str, size: str, device: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="collage-ct-")
    import time

    import torch

    import collage_compile
    from benchmarks.metrics_overhead import SIZES, layer_shapes, sync
    from benchmarks.step import LR, WD, make_params

    x = torch.ones(8, device=device)
    torch.compile(lambda t: t * 2 + 1, backend="inductor")(x)
    sync(device)
    ps = make_params(layer_shapes(*SIZES[size]), device, torch.bfloat16)
    opt = torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=True)
    backend = "inductor" if variant == "plain" else collage_compile.make_backend(mode=variant)
    step = torch.compile(opt.step, backend=backend)
    t0 = time.perf_counter()
    step()
    sync(device)
    print(json.dumps({"variant": variant, "compile_s": time.perf_counter() - t0}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each child")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        _child(args.child, args.size, args.device)
        return

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for v in VARIANTS:
            cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", v]
            cmd += ["--size", args.size, "--device", args.device, "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            t = json.loads(out.strip().splitlines()[-1])["compile_s"]
            times[v].append(t)
            print(f"round {r + 1}: {v} {t:.1f} s", file=sys.stderr, flush=True)
    base = statistics.median(times["plain"])
    print(
        f"cold compile of the AdamW step, --size {args.size}, {args.device}, "
        f"median of {args.repeats} fresh processes each"
    )
    # each round's ratio to the plain compile of the same round, whose median follows the
    # machine's slow drifts in speed less than the ratio of the medians does
    print(f"{'variant':8} {'median s':>8} {'vs plain':>8} {'per round':>9}  all runs")
    for v in VARIANTS:
        med = statistics.median(times[v])
        paired = statistics.median(t / p for t, p in zip(times[v], times["plain"]))
        runs = " ".join(f"{t:.1f}" for t in times[v])
        print(f"{v:8} {med:8.1f} {med / base:8.2f} {paired:9.2f}  {runs}")


if __name__ == "__main__":
    main()
