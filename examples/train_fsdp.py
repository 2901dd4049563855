"""The demo GPT trained with FSDP2 on every rank torchrun starts, one strategy after another.

    torchrun --nproc-per-node 2 examples/train_fsdp.py            # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_fsdp.py --steps 2000   # GPUs: nccl

Each block is sharded on its own and the rest at the root (``fully_shard``), the step is
AdamW with a warmup + cosine schedule stepped every iteration, ``opt.step`` is compiled with
the strategy's backend, and every rank reads its own slice of the same global batches.
Strategies: ``fp32`` (fp32 sharded parameters and state, bf16 compute through
``MixedPrecisionPolicy``: the usual master-weight set-up), ``bf16`` (plain Inductor on bf16
parameters: updates lost to rounding), collage ``light`` and ``plus`` (bf16 parameters,
each lo sharded like its parameter) and ``exact`` (bf16 parameters and state, each with an
int16 remainder sharded like it: fp32's arithmetic in 12 bytes per parameter).  Rank 0 prints the validation loss of each and its
gap to fp32's.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import collage_compile
from collage_compile.demo import GPT, batch_starts, get_batch, load_data

STRATEGIES = ("fp32", "bf16", "light", "plus", "exact")


def build(args: argparse.Namespace, strategy: str, device: str) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    model = GPT(256, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    policy = None
    if strategy == "fp32":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    else:
        model = model.to(torch.bfloat16)
    kw = {"mp_policy": policy} if policy is not None else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def train(args: argparse.Namespace, strategy: str, data: tuple, device: str) -> dict[str, float]:
    train_tokens, val_tokens = data
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, strategy, device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        foreach=True,
    )

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    backend = (
        "inductor" if strategy in ("fp32", "bf16") else collage_compile.make_backend(mode=strategy)
    )
    step = torch.compile(opt.step, backend=backend)
    starts = batch_starts(
        len(train_tokens), args.block_size, args.steps, args.batch_size * world, args.seed
    )
    t0 = time.perf_counter()
    for i in range(args.steps):
        mine = starts[i].chunk(world)[rank]
        x, y = get_batch(train_tokens, mine, args.block_size, device)
        model(x, y).backward()
        step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val = batch_starts(
            len(val_tokens), args.block_size, args.eval_batches, args.batch_size * world, 1
        )
        losses = [
            model(
                *get_batch(val_tokens, val[j].chunk(world)[rank], args.block_size, device)
            ).float()
            for j in range(args.eval_batches)
        ]
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
    torch._dynamo.reset()
    return {"val": loss.item() / world, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    train_tokens, val_tokens, desc = load_data(None)
    results = {}
    for strategy in args.strategies.split(","):
        results[strategy] = train(args, strategy, (train_tokens, val_tokens), device)
        if rank == 0:
            print(f"{strategy:6s} done in {results[strategy]['seconds']:.0f} s", flush=True)
    if rank == 0:
        print(
            f"\nFSDP2 on {dist.get_world_size()} ranks ({'nccl' if cuda else 'gloo'}), {args.steps} "
            f"steps, warmup {args.warmup} + cosine, AdamW lr {args.lr}; data: {desc}"
        )
        base = results.get("fp32", {}).get("val")
        print(f"{'strategy':8s} {'val loss':>9s} {'vs fp32':>8s}")
        for name, r in results.items():
            gap = f"{100 * (r['val'] - base) / base:+.2f} %" if base else "-"
            print(f"{name:8s} {r['val']:9.4f} {gap:>8s}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
