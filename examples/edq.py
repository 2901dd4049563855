"""How much of each SGD update bf16 weights keep: collage vs plain bf16, measured by EDQ.

    python examples/edq.py [--steps 20] [--size 1024]

A bf16 weight matrix ~ N(0, 1) trained with stock ``torch.optim.SGD(lr=1e-4)`` on gradients
~ 0.01 * N(0, 1): each update (~1e-6) is far below half an ulp of a bf16 weight (~2e-3 at
|w| ~ 1), the regime where plain bf16 silently drops updates.  The same weights and
gradients go through three compiled steps, all with ``metrics=True``:

- ``mode="light"``: collage (the update goes into the (hi, lo) pair);
- ``mode="plus"``: the same for SGD (no optimizer state to upgrade);
- ``mode="off"``: plain bf16, the graph Inductor compiles, measured the same way.

Printed per mode, averaged over the steps: EDQ on hi + lo (what the optimizer tracks), EDQ on
hi (what the forward pass sees), the share of elements whose hi did not move, and ||lo|| /
||hi|| after the last step.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

import collage_compile

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

MODES = ("light", "plus", "off")


def run(mode: str, size: int, steps: int, seed: int = 0) -> dict[str, float]:
    """Train one bf16 matrix for ``steps`` SGD steps; the metrics averaged over the steps."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(size, size, generator=g).bfloat16())
    opt = torch.optim.SGD([w], lr=1e-4)
    step = torch.compile(opt.step, backend=collage_compile.make_backend(mode=mode, metrics=True))
    per_step: list[dict[str, float]] = []
    for _ in collage_compile.metered(range(steps), callback=lambda i, m: per_step.append(m)):
        w.grad = (0.01 * torch.randn(size, size, generator=g)).bfloat16()
        step()
    out = {k: statistics.fmean(m[k] for m in per_step) for k in ("edq", "edq_hi", "imprecision")}
    out["lo_rel"] = per_step[-1]["lo_rel"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", type=int, default=1024)
    args = ap.parse_args()
    print(
        f"SGD lr=1e-4, bf16 weights ~ N(0,1) ({args.size}x{args.size}), "
        f"grads ~ 0.01*N(0,1), {args.steps} steps, mean over steps"
    )
    print(f"{'mode':<7} {'edq':>8} {'edq_hi':>8} {'imprecision':>12} {'lo_rel':>10}")
    for mode in MODES:
        m = run(mode, args.size, args.steps)
        print(
            f"{mode:<7} {m['edq']:8.4f} {m['edq_hi']:8.4f} {m['imprecision']:12.4f} "
            f"{m['lo_rel']:10.2e}"
        )
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
