"""Third-party optimizers under ``compile_optimizer``, each against a float64 run of itself.

    pip install pytorch_optimizer==4.1.0 schedulefree==1.4.1
    pip install --no-deps timm==1.0.31            # its optimizers, without torchvision
    python tools/third_party.py [name ...]      # pytorch_optimizer names, sf_adamw, sf_sgd,
                                                # timm:<module>.<Class>, hf_adafactor,
                                                # adafactor_fp32_momentum

Not part of the suite (the packages are not dependencies; 40 optimizers take about 10
minutes on 2 cores).  Per optimizer: a (64, 32) matrix and a (64,) vector in bf16, 60 steps
of gradients 0.01 +- 0.005, lr 1e-4; the error is ||value - float64|| / ||float64's
movement|| of the same optimizer run in float64 on the same gradients (its own algebra in
bf16 state counts too, so "plain" is the bar, not zero), for plain bf16 (eager), then
light and plus with the CollageWarnings each run raised; and exact mode against the
optimizer's own fp32 run (exact mode's promise: the fp32 step), eager and compiled by
plain Inductor (which sums reductions in another order than eager).
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

import collage_compile

STEPS = 60
DEFAULT = (
    "adamw sgd lion tiger adan lamb adabelief came adopt ademamix laprop mars stableadamw "
    "adamp madgrad emonavi novograd yogi apollo sgdw qhadam aggmo lars scion adalite grams "
    "simplifiedademamix amos kron splus ranger adafactor dadaptadam sf_adamw sf_sgd "
    "timm:adabelief.AdaBelief timm:radam.RAdamLegacy timm:nadamw.NAdamW timm:adan.Adan "
    "timm:lion.Lion timm:laprop.LaProp timm:muon.Muon timm:adopt.Adopt timm:mars.Mars "
    "timm:adafactor_bv.AdafactorBigVision timm:rmsprop_tf.RMSpropTF timm:sgdw.SGDW "
    "timm:madgrad.MADGRAD timm:adamp.AdamP timm:nvnovograd.NvNovoGrad timm:adafactor.Adafactor "
    "hf_adafactor"
).split()


def _timm(path: str):
    """timm's optimizer ``module.Class``, its package's ``__init__`` skipped (it imports
    torchvision, which needs a torch of its own build)."""
    import importlib
    import importlib.util
    import os
    import types

    if "timm.optim" not in sys.modules:
        root = importlib.util.find_spec("timm").submodule_search_locations[0]
        for name, where in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
            package = types.ModuleType(name)
            package.__path__ = [where]
            sys.modules[name] = package
    module, cls = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"timm.optim.{module}"), cls)


def factory(name: str):
    if name.startswith("timm:"):
        cls = _timm(name[len("timm:") :])
        return lambda params: cls(params, lr=1e-4)
    if name == "hf_adafactor":
        from transformers.optimization import Adafactor

        flags = {"scale_parameter": False, "relative_step": False, "warmup_init": False}
        return lambda params: Adafactor(params, lr=1e-4, **flags)
    if name.startswith("sf_"):
        import schedulefree

        cls = {"sf_adamw": schedulefree.AdamWScheduleFree, "sf_sgd": schedulefree.SGDScheduleFree}

        def make(params):
            opt = cls[name](params, lr=1e-4 if name == "sf_adamw" else 1e-3, warmup_steps=0)
            opt.train()
            return opt

        return make
    import pytorch_optimizer

    if name == "adafactor_fp32_momentum":  # its momentum in fp32 (bf16 by default)
        cls = pytorch_optimizer.load_optimizer("adafactor")
        return lambda params: cls(params, lr=1e-4, momentum_dtype=torch.float32)
    cls = pytorch_optimizer.load_optimizer(name)
    lr = 1.0 if name.startswith("dadapt") else 1e-4
    return lambda params: cls(params, lr=lr)


def gradients() -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=g) * 0.5, torch.randn(64, generator=g) * 0.5]
    grads = [
        tuple((0.01 + 0.005 * torch.randn(s.shape, generator=g)).bfloat16() for s in start)
        for _ in range(STEPS)
    ]
    return [s.bfloat16() for s in start], grads


def run(make, dtype: torch.dtype, mode: str | None) -> tuple[torch.Tensor, list[str]]:
    torch._dynamo.reset()  # each run its own recompile limit (optimizers share torch.optim's)
    start, grads = gradients()
    params = [torch.nn.Parameter(s.to(dtype)) for s in start]
    opt = make(params)
    if mode == "inductor":
        opt.step = torch.compile(opt.step)
    elif mode is not None:
        collage_compile.compile_optimizer(opt, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.to(dtype).clone()  # some optimizers write their gradient
            opt.step()
    named = sorted(
        {str(w.message)[:110] for w in caught if w.category.__name__ == "CollageWarning"}
    )
    value = collage_compile.value if mode not in (None, "inductor") else torch.Tensor.detach
    return torch.cat([value(p).double().flatten() for p in params]), named


def measure(name: str) -> None:
    make = factory(name)
    origin = torch.cat([s.double().flatten() for s in gradients()[0]])
    ref, _ = run(make, torch.float64, None)
    error = lambda v: ((v - ref).norm() / (ref - origin).norm()).item()
    row = [f"{name:20s} plain {error(run(make, torch.bfloat16, None)[0]):7.3g}"]
    notes = []
    for mode in ("light", "plus"):
        t = time.perf_counter()
        try:
            value, named = run(make, torch.bfloat16, mode)
        except Exception as e:  # an optimizer Dynamo or Inductor cannot compile
            row.append(f"{mode} failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}")
            continue
        row.append(f"{mode} {error(value):7.3g} ({time.perf_counter() - t:3.0f} s)")
        notes += [f"    {mode}: {n}" for n in named]
    fp32, _ = run(make, torch.float32, None)
    try:
        fp32_inductor, _ = run(make, torch.float32, "inductor")
    except Exception as e:  # plain Inductor's own failure (Ranger: a KeyError in codegen)
        fp32_inductor = None
        notes.append(f"    fp32 Inductor failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}")
    try:
        value, named = run(make, torch.bfloat16, "exact")
        moved = (fp32 - origin).norm()
        off = lambda ref: (
            f"{((value - ref).norm() / moved).item():7.3g}" if ref is not None else "-"
        )
        row.append(f"exact vs fp32 {off(fp32)}, vs fp32 Inductor {off(fp32_inductor)}")
        notes += [f"    exact: {n}" for n in named]
    except Exception as e:
        row.append(f"exact failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}")
    print("  ".join(row), *notes, sep="\n", flush=True)


if __name__ == "__main__":
    torch._dynamo.config.capture_scalar_outputs = True  # Adafactor-style .item()
    for name in sys.argv[1:] or DEFAULT:
        measure(name)
