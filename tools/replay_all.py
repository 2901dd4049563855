"""Every stock torch.optim optimizer replayed whole against the same step compiled.

    python tools/replay_all.py [--device cuda] [NAME ...]

For each optimizer and variant of ``tests/test_all_optimizers.py`` (foreach off and on where
it has both paths): two param groups under a warmup (a new lr every step), new gradient
tensors every step, 12 steps, once through ``compile_optimizer(opt)`` and once through
``compile_optimizer(opt, cudagraphs=True)``.  A row says whether the weights and their pairs
are the same bit for bit, how many steps were replayed, and why a step was not (a refusal,
named in a CollageWarning, or the reasons a replay gave way).  On a CPU a replay calls the
recorded graphs directly; on CUDA it is one CUDA graph.  The suite pins the families
(``tests/test_replay.py``: AdamW's four ways, SGD under OneCycleLR, Muon); this covers the
rest without adding minutes to it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_all_optimizers as table
from conftest import drifting_stream, mcf_value

import collage_compile

STEPS = 12


def run(cls, kwargs, foreach, whole, shapes, device):
    """The weights after STEPS steps, the optimizer and the CollageWarnings given."""
    torch._dynamo.reset()
    start, grads = drifting_stream(list(shapes), STEPS)
    ps = [torch.nn.Parameter(t.to(device, copy=True)) for t in start]
    groups = [{"params": ps[:1]}, {"params": ps[1:]}]
    has_flag = "foreach" in inspect.signature(cls.__init__).parameters  # Muon has none
    flags = {"foreach": foreach} if has_flag else {}
    opt = cls(groups, **kwargs, **flags)
    collage_compile.compile_optimizer(opt, cudagraphs=whole)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 5))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", collage_compile.CollageWarning)
        for gs in grads:
            opt.zero_grad()
            for p, g in zip(ps, gs):
                p.grad = 0.01 * g.to(device)
            opt.step()
            sched.step()
    said = [str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)]
    return ps, opt, said


def cases(names):
    """(name, variant, class, kwargs, foreach, shapes) of the stock optimizers named."""
    for name in names:
        cls, variants, _ = table.OPTIMIZERS[name]
        if not cls.__module__.startswith("torch.optim"):
            continue  # the user-written ones: never replayed (replay.py says why)
        shapes = table.SHAPES.get(name, table.MATRIX_AND_VECTOR)
        for variant, kwargs in variants.items():
            for foreach in (False, True):
                if foreach and name in table.SINGLE_PATH_ONLY:
                    continue
                if not foreach and name not in table.TRACEABLE_SINGLE:
                    continue
                yield name, variant, cls, kwargs, foreach, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("names", nargs="*", default=list(table.OPTIMIZERS))
    args = ap.parse_args()
    torch._dynamo.config.capture_scalar_outputs = True  # Adafactor's .item()
    print(f"torch {torch.__version__}, {args.device}, {STEPS} steps")
    failed = 0
    for name, variant, cls, kwargs, foreach, shapes in cases(args.names):
        compiled, _, _ = run(cls, kwargs, foreach, False, shapes, args.device)
        replayed, opt, said = run(cls, kwargs, foreach, True, shapes, args.device)
        same = all(
            torch.equal(a, b) and torch.equal(mcf_value(a), mcf_value(b))
            for a, b in zip(compiled, replayed)
        )
        failed += not same
        whole = opt.step.whole_step
        why = whole.refused or ", ".join(sorted(set(whole.given_way))) or "-"
        named = "named" if whole.refused and any("not replayed" in m for m in said) else ""
        print(
            f"{name:9s} {variant:30s} {'foreach' if foreach else 'single ':7s} "
            f"{'same bits' if same else 'DIFFERENT'}  replayed {whole.replays:2d} of {STEPS}  "
            f"{why[:90]} {named}",
            flush=True,
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
