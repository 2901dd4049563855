"""Host time of the compiled AdamW step: what the backend's wrapper adds per call.

    python -m benchmarks.host [--tensors 48,300] [--rounds 7] [--steps 200]

Each parameter holds 8 bf16 elements, so the kernels cost next to nothing and the time of a
step is the host's: Dynamo's guards, the compiled module's call, and for collage the
wrapper around it (lo inputs, the outside-write check, the optimizer watch).  Plain
Inductor, collage light and plus, each compiled once per tensor count, then timed in
interleaved rounds (thread CPU time, one torch thread) so the machine's drift hits all
alike; the median per step and the ratio to plain Inductor are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VARIANTS = ("plain", "light", "plus")


def build(variant: str, n: int):
    import collage_compile

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8, generator=g).to(torch.bfloat16)) for _ in range(n)]
    for p in ps:
        p.grad = (1e-3 * torch.randn(8, generator=g)).to(torch.bfloat16)
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True)
    backend = "inductor" if variant == "plain" else collage_compile.make_backend(mode=variant)
    step = torch.compile(opt.step, backend=backend)
    for _ in range(5):  # compile, then settle
        step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="48,300")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    counts = [int(x) for x in args.tensors.split(",")]
    steps = {(v, n): build(v, n) for n in counts for v in VARIANTS}
    times: dict[tuple[str, int], list[float]] = {k: [] for k in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            t0 = time.thread_time()
            for _ in range(args.steps):
                step()
            times[key].append((time.thread_time() - t0) / args.steps * 1e6)
    print(
        f"host time of a compiled AdamW step (foreach, 8 bf16 elements per tensor), torch "
        f"{torch.__version__}, 1 thread; median of {args.rounds} interleaved rounds of "
        f"{args.steps} steps (thread CPU time)"
    )
    print(f"{'tensors':>7} {'variant':8} {'us/step':>9} {'vs plain':>8} {'us/tensor':>9}")
    for n in counts:
        base = statistics.median(times["plain", n])
        for v in VARIANTS:
            med = statistics.median(times[v, n])
            print(f"{n:7d} {v:8} {med:9.1f} {med / base:8.2f} {med / n:9.2f}")


if __name__ == "__main__":
    main()
