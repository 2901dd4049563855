"""What the backend does to a stock AdamW train step: ``collage_compile.explain``.

    python examples/explain.py [--mode light|plus|all|off]

A small bf16 MLP with LayerNorm, ``torch.optim.AdamW`` (default single-tensor path on CPU),
forward + backward + step + zero_grad in one compiled function.  Prints the table of every
accumulation site found in each captured graph: which tensors were upgraded and how, which
were left and why.  ``name_tensors`` gives the rows the module's names and names the
optimizer's state after its parameter; without it the names come from the forward graph
(``model.0.weight``) and Dynamo's sources (``state[1].exp_avg``).
"""

from __future__ import annotations

import argparse
import warnings

import torch

import collage_compile

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="light", choices=["light", "plus", "all", "off"])
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256), torch.nn.Linear(256, 10)
    ).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    collage_compile.name_tensors(model, opt)

    @torch.compile(backend=collage_compile.make_backend(mode=args.mode))
    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(32, 64).bfloat16(), torch.randint(0, 10, (32,))
    print(collage_compile.explain(train_step, x, y))


if __name__ == "__main__":
    main()
