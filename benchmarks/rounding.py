"""What rounding fp32 to bf16 costs inside a compiled kernel, by method.

    python -m benchmarks.rounding [--n 1327104] [--rounds 9] [--threads 1]

A step's kernel reads a bf16 weight and an update, stores the new weight and sums the
change it applied; the change is taken from the new value rounded as the store rounds it,
by :func:`collage_compile.mcf.round_to` (integer arithmetic on the bit pattern),
:func:`collage_compile.mcf.round_to_float_ops` (the same bits in fp32 arithmetic) or
:func:`collage_compile.mcf.split_round` (the branch-free split, exact on normal numbers
only), and without rounding at all (a wrong answer, the floor).  Compiled with
Inductor over the same tensors, timed in interleaved rounds (thread CPU time); the median
per call and the ratio to the kernel that only stores are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from collage_compile import mcf

METHODS = {
    "store only": None,
    "no rounding": lambda x: x,
    "round_to": lambda x: mcf.round_to(x, torch.bfloat16),
    "round_to_float_ops": lambda x: mcf.round_to_float_ops(x, torch.bfloat16),
    "split_round": lambda x: mcf.split_round(x, torch.bfloat16),
}


def kernel(rnd):
    def step(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
        old = p.float()
        new = old * 0.99999 + g.float() * 1e-3
        p.copy_(new)
        if rnd is None:
            return None
        return ((rnd(new) - old) * (new - old)).sum()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=576 * 2304)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    # every method steps the same tensors (copies of their own would sit elsewhere in
    # memory, which alone moves a kernel's time by several percent)
    data = (
        (torch.randn(args.n, generator=gen) * 0.02).bfloat16(),
        (torch.randn(args.n, generator=gen) * 1e-3).bfloat16(),
    )
    fns = {}
    for name, rnd in METHODS.items():
        fns[name] = torch.compile(kernel(rnd), dynamic=False)
        fns[name](*data)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(args.calls):
                fn(*data)
            samples[name].append((time.thread_time() - t0) / args.calls)
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(
        f"{args.n} bf16 elements, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"median of {args.rounds} interleaved rounds (thread CPU time)"
    )
    for name in fns:
        print(f"{name:<18} {med[name] * 1e3:7.3f} ms  {med[name] / med['store only']:5.2f}x")


if __name__ == "__main__":
    main()
