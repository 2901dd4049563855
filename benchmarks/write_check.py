"""What detecting outside writes costs per step: the check before and the record after
each compiled call, for every tensor that carries a pair (host-side work, no kernel).

    python -m benchmarks.write_check [--tensors 48] [--numel 1327104] [--steps 200]

Prints microseconds per tensor per step; multiply by the number of upgraded tensors
(params, plus mode: also second moments) for the per-step cost.
"""

from __future__ import annotations

import argparse
import time

import torch

from collage_compile import state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--numel", type=int, default=576 * 2304)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    ts = [torch.zeros(args.numel, dtype=torch.bfloat16) for _ in range(args.tensors)]
    los = [state.lo_for(t) for t in ts]
    for t, lo in zip(ts, los):
        state.stamp(t, lo)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        for t, lo in zip(ts, los):
            state.check(t, lo)
        for t, lo in zip(ts, los):
            state.stamp(t, lo)
    per_step = (time.perf_counter() - t0) / args.steps
    print(
        f"{args.tensors} tensors of {args.numel} bf16 elements, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads: {per_step * 1e3:.3f} ms/step, "
        f"{per_step / args.tensors * 1e6:.1f} us per tensor"
    )


if __name__ == "__main__":
    main()
