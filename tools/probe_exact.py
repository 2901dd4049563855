"""Exact mode against fp32 steps on one device: which weights differ, by how many ulps.

    python tools/probe_exact.py [--device cuda] [--code FILE]

The stream of tests/test_replay.py's exact tests (AdamW, two param groups, a warmup from
lr = 0, 12 steps).  Each row is the fp32 weights one way of stepping gave, against the
fp32 step compiled by ``compile_optimizer`` (Inductor's defaults, FMA contraction on a
GPU) and against torch's eager foreach step, and its error against float64.  Rows with
``epc`` ran under ``emulate_precision_casts``, with which Inductor compiles Triton
kernels without FMA contraction (``enable_fp_fusion``).  ``--code`` writes the Inductor
code of the compiled fp32 and exact steps.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_replay
from conftest import drifting_stream

import collage_compile
from collage_compile import _compat

EPC = {"emulate_precision_casts": True}


def weights(device, dtype, patches=None, code=None, **options):
    start, grads = drifting_stream([(64, 32), (32,), (32, 32)], 12)
    start = [t.to(device) for t in start]
    grads = [[g.to(device) for g in gs] for gs in grads]
    torch._dynamo.reset()
    with torch._inductor.config.patch(patches or {}):
        (ps, _), kept = _compat.run_and_keep_kernel_code(
            lambda: test_replay._train(start, grads, dtype, **options), fresh=True
        )
    if code is not None:
        code.extend(kept)
    vals = [collage_compile.value(p) if dtype == torch.bfloat16 else p.detach() for p in ps]
    return [v.cpu() for v in vals], [t.cpu() for t in start]


def rel(vals, ref, start):
    return max(
        float((v.double() - r).norm() / (r - s.double()).norm())
        for v, r, s in zip(vals, ref, start)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--code", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    dev = args.device
    code: list[str] = []
    ref, start = weights(dev, torch.float64, compiled=False)
    rows = {
        "fp32 eager foreach": weights(dev, torch.float32, compiled=False)[0],
        "fp32 compiled": weights(dev, torch.float32, code=code)[0],
        "fp32 compiled epc": weights(dev, torch.float32, EPC)[0],
        "exact compiled": weights(dev, torch.bfloat16, code=code, mode="exact")[0],
        "exact compiled epc": weights(dev, torch.bfloat16, EPC, mode="exact")[0],
        "exact replayed": weights(dev, torch.bfloat16, mode="exact", cudagraphs=True)[0],
        "bf16 eager (plain)": weights(dev, torch.bfloat16, compiled=False)[0],
    }
    base, eager = rows["fp32 compiled"], rows["fp32 eager foreach"]
    print(f"{dev}, torch {torch.__version__}: max ulps (elements differing) of 3104 weights")
    print(f"{'variant':<22}{'vs fp32 compiled':>20}{'vs fp32 eager':>18}{'err vs f64':>12}")
    for name, vals in rows.items():
        a = [test_replay.ulps(v.float(), b.float()) for v, b in zip(vals, base)]
        e = [test_replay.ulps(v.float(), b.float()) for v, b in zip(vals, eager)]
        fa = f"{max(x for x, _ in a)} ({sum(n for _, n in a)})"
        fe = f"{max(x for x, _ in e)} ({sum(n for _, n in e)})"
        print(f"{name:<22}{fa:>20}{fe:>18}{rel(vals, ref, start):>12.3e}")
    if args.code:
        Path(args.code).write_text("\n\n# ==== next file ====\n\n".join(code))


if __name__ == "__main__":
    main()
