"""A bf16 Linear trained with stock SGD and AdamW: plain bf16 vs collage vs float64.

    python examples/quickstart.py

All three runs start from the same bf16 weights and see the same data.  Printed per optimizer:
the share of weights the first step left unmoved, and each run's distance to the float64 run
relative to how far the float64 weights moved (0 = no update lost, 1 = nothing applied).
"""

from __future__ import annotations

import warnings

import torch

import collage_compile

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def train(init, make_opt, dtype, backend, steps):
    model = torch.nn.Linear(init.shape[1], init.shape[0], bias=False).to(dtype)
    with torch.no_grad():
        model.weight.copy_(init)
    opt = make_opt(model.parameters())
    step = torch.compile(opt.step, backend=backend) if backend else opt.step
    gen = torch.Generator().manual_seed(1)
    unmoved = None
    for _ in range(steps):
        x = torch.randn(32, init.shape[1], generator=gen)
        target = torch.randn(32, init.shape[0], generator=gen)
        before = model.weight.detach().clone()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).double(), target.double())
        opt.zero_grad()
        loss.backward()
        step()
        if unmoved is None:
            unmoved = (model.weight.detach() == before).float().mean().item()
    return model.weight, unmoved


def main() -> None:
    init = (torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.5).bfloat16()
    cases = {
        "SGD lr=1e-3": lambda ps: torch.optim.SGD(ps, lr=1e-3),
        "AdamW lr=1e-5, weight_decay=0.01": lambda ps: torch.optim.AdamW(
            ps, lr=1e-5, weight_decay=0.01
        ),
    }
    steps = 100
    for name, make_opt in cases.items():
        ref, _ = train(init, make_opt, torch.float64, None, steps)
        plain, plain_unmoved = train(init, make_opt, torch.bfloat16, "inductor", steps)
        torch._dynamo.reset()
        ours, ours_unmoved = train(init, make_opt, torch.bfloat16, collage_compile.backend, steps)
        torch._dynamo.reset()
        moved = (ref.detach() - init.double()).norm()

        def lost(w: torch.Tensor, ref=ref, moved=moved) -> float:
            return ((w.detach().double() - ref.detach()).norm() / moved).item()

        print(f"{name}, {steps} steps, bf16 weights N(0, 0.5^2), 256x256:")
        print(
            f"  unmoved by the first step   plain bf16 {plain_unmoved:6.1%}   collage hi {ours_unmoved:6.1%}"
        )
        print(
            f"  distance to float64 run     plain bf16 {lost(plain):6.3f}   collage hi {lost(ours):6.3f}"
            f"   collage hi+lo {lost(collage_compile.value(ours)):.4f}"
        )


if __name__ == "__main__":
    main()
