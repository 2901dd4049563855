"""Where a cold compile of the AdamW step spends its time: cProfile of one compile.

    python -m benchmarks.compile_profile --variant plus [--shapes same|gpt|llama] [--count 300]
                                         [--second]

One fresh process, a fresh Inductor cache, one torch thread (``--second``: the compile of
a second optimizer of the same class and shapes, after an unprofiled first); prints the
total, Dynamo's
per-stage compile times (``torch._dynamo.utils.compile_times``) and the functions with the
most cumulative time.  The profiler inflates Python-heavy stages, so compare variants with
each other, not with ``benchmarks.compile_time``'s unprofiled seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time

from benchmarks.shapes import FAMILIES, family_shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("plain", "light", "plus"), default="plus")
    ap.add_argument("--shapes", choices=FAMILIES, default="gpt")
    ap.add_argument("--count", type=int, default=300, help="number of parameter tensors")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--second", action="store_true", help="profile a second optimizer's compile")
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="collage-prof-")
    import torch
    from torch._dynamo.utils import compile_times

    from benchmarks.compile_time import adamw_step

    torch.set_num_threads(1)
    torch.compile(lambda t: t * 2 + 1, backend="inductor")(torch.ones(8))
    shapes = family_shapes(args.shapes, args.count)
    if args.second:
        adamw_step(args.variant, shapes, "cpu")()
    step = adamw_step(args.variant, shapes, "cpu")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    step()
    prof.disable()
    which = "second optimizer" if args.second else "cold"
    print(
        f"{args.variant} {args.shapes} x {len(shapes)}, {which}: "
        f"{time.perf_counter() - t0:.1f} s (profiled)"
    )
    print(compile_times(repr="str", aggregate=True))
    rows = sorted(
        (
            (ct, f"{os.path.basename(f)}:{fn}")
            for (f, _, fn), (_, _, _, ct, _) in pstats.Stats(prof).stats.items()
        ),
        reverse=True,
    )
    for ct, name in rows[: args.top]:
        print(f"{ct:8.1f} {name}")


if __name__ == "__main__":
    main()
