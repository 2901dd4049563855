"""A training loop as users write it, with collage: schedule, clipping, accumulation.

    python examples/real_loop.py [--steps 1000]

bf16 weights only; stock AdamW with decay / no-decay groups; a warmup + cosine schedule that
starts at lr = 0 (as Hugging Face's do); gradient clipping; two micro-batches per step.  The
one collage line is ``collage_compile.compile_optimizer(opt)``.  The same loop runs in
float64 (the reference) and in plain bf16, from the same start on the same batches, and the
script prints how far each ends from float64 (relative to float64's total movement), how
many graphs the backend compiled, and the warnings it gave.
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings

import torch
import torch.nn.functional as F

import collage_compile


class Model(torch.nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(self.ln(self.emb(x)))))


def warmup_cosine(steps: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup  # from exactly 0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    return factor


def train(base: Model, dtype: torch.dtype, steps: int, use_collage: bool) -> Model:
    model = copy.deepcopy(base).to(dtype)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, steps // 10))
    if use_collage:
        collage_compile.compile_optimizer(opt, mode="plus")  # the one line
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(2):  # gradient accumulation
            x = torch.randint(0, 64, (8, 16), generator=g)
            loss = F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return model


def flat(model: Model, value: bool) -> torch.Tensor:
    get = collage_compile.value if value else (lambda p: p.detach())
    return torch.cat([get(p).double().flatten() for p in model.parameters()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    steps = ap.parse_args().steps
    torch.manual_seed(0)
    base = Model().to(torch.bfloat16)  # every run starts from the same bf16 values
    graphs = len(collage_compile.explain().graphs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", collage_compile.CollageWarning)
        collage = train(base, torch.bfloat16, steps, use_collage=True)
    compiled = len(collage_compile.explain().graphs) - graphs
    ref = train(base, torch.float64, steps, use_collage=False)
    plain = train(base, torch.bfloat16, steps, use_collage=False)
    start, target = flat(base, False), flat(ref, False)
    moved = (target - start).norm()
    print(f"AdamW, warmup + cosine from lr = 0, clipping, 2 micro-batches, {steps} steps")
    for name, model, value in (("collage (plus)", collage, True), ("plain bf16", plain, False)):
        err = (flat(model, value) - target).norm() / moved
        print(f"  {name:15s} distance to the float64 run: {err:.4f} of its movement")
    warned = [w for w in caught if issubclass(w.category, collage_compile.CollageWarning)]
    print(f"  optimizer graphs compiled: {compiled}; CollageWarnings: {len(warned)}")


if __name__ == "__main__":
    main()
