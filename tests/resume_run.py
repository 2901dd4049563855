"""A small bf16 training run for the checkpoint tests, run in fresh processes.

    python tests/resume_run.py full CKPT OUT [MODE]    100 steps; a checkpoint at step 50
    python tests/resume_run.py resume CKPT OUT [MODE]  loads CKPT (with attach), 50 more steps

AdamW in plus mode (params and second moment carry pairs; MODE=exact: every tensor carries
a remainder) and an AveragedModel EMA of the
weights, both compiled with the collage backend; eager forward/backward on one thread, so
that two processes given the same state compute the same bits.  ``OUT`` receives every
final tensor (params, their lo, optimizer state and its lo, EMA and its lo).  ``resume``
also writes ``OUT.nolo``: the same resume from the checkpoint without its lo components
(as saved without ``attach``), which must *not* match.
"""

from __future__ import annotations

import sys

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import collage_compile

STEPS, SAVE_AT = 100, 50


MODE = "plus"


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    ).to(torch.bfloat16)
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-5, betas=(0.9, 0.999), weight_decay=0.01, foreach=False
    )
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=False)
    backend = collage_compile.make_backend(mode=MODE)
    step = torch.compile(opt.step, backend=backend)
    update = torch.compile(ema.update_parameters, backend=backend)

    def train(k: int) -> None:
        g = torch.Generator().manual_seed(1000 + k)
        x = torch.randn(8, 16, generator=g).to(torch.bfloat16)
        y = torch.randn(8, 8, generator=g).to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        step()
        update(model)

    return model, opt, ema, train


def final_state(model, opt, ema) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p.detach().clone()
        lo = collage_compile.components(p)[1]
        out[f"param.{name}.lo"] = lo.clone()
        for key, v in opt.state[p].items():
            out[f"opt.{name}.{key}"] = v.clone()
            vlo = collage_compile.components(v)[1]
            if vlo is not None:
                out[f"opt.{name}.{key}.lo"] = vlo.clone()
    for name, p in ema.module.named_parameters():
        out[f"ema.{name}"] = p.detach().clone()
        out[f"ema.{name}.lo"] = collage_compile.components(p)[1].clone()
    return out


def resume(ckpt: str, with_lo: bool) -> dict[str, torch.Tensor]:
    model, opt, ema, train = build()
    if with_lo:
        collage_compile.attach(opt, ema)
    saved = torch.load(ckpt)
    if not with_lo:  # the checkpoint as it would be without attach
        saved["ema"] = {k: v for k, v in saved["ema"].items() if "_collage_" not in k}
        for entry in saved["opt"]["state"].values():
            for k in [k for k in entry if k.startswith("collage_")]:
                del entry[k]
    # the optimizer first: its lo waits for the weights loaded after it (checksum)
    opt.load_state_dict(saved["opt"])
    model.load_state_dict(saved["model"])
    ema.load_state_dict(saved["ema"])
    for k in range(SAVE_AT, STEPS):
        train(k)
    return final_state(model, opt, ema)


def main() -> None:
    global MODE
    torch.set_num_threads(1)
    what, ckpt, out = sys.argv[1:4]
    MODE = sys.argv[4] if len(sys.argv) > 4 else MODE
    if what == "full":
        model, opt, ema, train = build()
        collage_compile.attach(opt, ema)
        for k in range(STEPS):
            if k == SAVE_AT:
                state = {"model": model.state_dict(), "opt": opt.state_dict()}
                torch.save({**state, "ema": ema.state_dict()}, ckpt)
            train(k)
        torch.save(final_state(model, opt, ema), out)
    elif what == "resume":
        torch.save(resume(ckpt, with_lo=True), out)
        torch._dynamo.reset()
        torch.save(resume(ckpt, with_lo=False), out + ".nolo")
    else:
        raise SystemExit(f"unknown run {what!r}")


if __name__ == "__main__":
    main()
