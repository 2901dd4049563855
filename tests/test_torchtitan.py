"""torchtitan adopts collage with one config entry (``collage_compile.torchtitan``).

torchtitan's smallest Llama (``llama3`` ``debugmodel``, cut to one layer) trained on 2 gloo
ranks with torchtitan's own parts: its model config and weight init, FSDP2 over each layer
and the root (as its ``parallelize_llama`` applies it), its optimizer container built from
its config (``collage_adamw`` in place of ``default_adamw``), its LR scheduler container
(warmup, then linear decay), its gradient clipping, and its DCP checkpoint objects
(``ModelWrapper`` and the containers as ``Stateful``).  torchtitan's ``Trainer`` itself
does not start on a CPU (it sets a CUDA device when there is no accelerator), and its
attention (Flex, varlen) has no backward on a CPU in torch 2.13, so the loop is
torchtitan's train step written out and the layer uses torchtitan's SDPA attention.

Compared on the same batches with the same loop on float64 and fp32 weights (plain
AdamW) and on plain bf16 weights; a checkpoint saved halfway and resumed by fresh objects
continues bit for bit.
"""

from __future__ import annotations

import pytest
import torch

# torchtitan 0.3.0's models import what torch 2.11 lacks (DataParallelMeshDims): on 2.11
# this skips with that ImportError, as without torchtitan
pytest.importorskip("torchtitan.models.llama3", exc_type=ImportError)
from _dist import run_ranks

STEPS = 8
LR = 1e-4


def _model(dtype):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:1]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_weights()
    # every run starts from the same bf16 values (torchtitan's training.dtype="bfloat16"
    # builds the model in bf16 itself)
    return model.to(torch.bfloat16).to(dtype), config


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers.values() if hasattr(model.layers, "values") else model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _parts(dtype, collage):
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from collage_compile.torchtitan import collage_adamw

    model, _ = _model(dtype)
    model = _shard(model)
    if collage:
        opt_config = collage_adamw(lr=LR, mode="light")
    else:
        opt_config = default_adamw(lr=LR)
        opt_config.implementation = "foreach"
    optimizers = opt_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.1
    ).build(optimizers=optimizers, training_steps=STEPS)
    return model, optimizers, schedulers


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 2048, (2, 33), generator=g)


def _train(model, optimizers, schedulers, rank, steps):
    from torchtitan.distributed.utils import clip_grad_norm_

    loss = None
    for step in steps:
        tokens = _batch(rank, step)
        out = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
    return loss.item()


def _full(model, value=False):
    import collage_compile

    out = []
    for p in model.parameters():
        t = collage_compile.value(p) if value else p.detach().float()
        out.append(t.full_tensor().double() if hasattr(t, "full_tensor") else t.double())
    return out


def _everything(model, optimizers):
    """Every local shard the run keeps: weights, lo, optimizer state and its lo."""
    import collage_compile

    out = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                for t in [p, *[v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]]:
                    lo = collage_compile.components(t)[1]
                    for x in (t.detach(), lo):
                        local = getattr(x, "to_local", lambda x=x: x)() if x is not None else None
                        out.append(None if local is None else local.clone())
    return out


def _ranks(rank, world, ckpt_dir):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    import collage_compile

    warnings.simplefilter("error", collage_compile.CollageWarning)
    torch._dynamo.config.recompile_limit = 32
    runs = {}
    for name, dtype, collage in [
        ("float64", torch.float64, False),
        ("fp32", torch.float32, False),
        ("bf16", torch.bfloat16, False),
        ("collage", torch.bfloat16, True),
    ]:
        model, optimizers, schedulers = _parts(dtype, collage)
        loss = _train(model, optimizers, schedulers, rank, range(STEPS))
        runs[name] = (loss, _full(model, value=collage), model, optimizers)
    start = _full(_model(torch.float64)[0])

    # halfway, a DCP checkpoint of torchtitan's Stateful objects; fresh objects resume it
    model, optimizers, schedulers = _parts(torch.bfloat16, True)
    _train(model, optimizers, schedulers, rank, range(STEPS // 2))
    state = {"model": ModelWrapper(model), "optimizer": optimizers, "lr_scheduler": schedulers}
    dcp.save(state, checkpoint_id=ckpt_dir)
    model, optimizers, schedulers = _parts(torch.bfloat16, True)
    state = {"model": ModelWrapper(model), "optimizer": optimizers, "lr_scheduler": schedulers}
    dcp.load(state, checkpoint_id=ckpt_dir)
    resumed_loss = _train(model, optimizers, schedulers, rank, range(STEPS // 2, STEPS))

    ref = runs["float64"][1]

    def distance(weights):
        num = sum(((w - r) ** 2).sum().item() for w, r in zip(weights, ref))
        den = sum(((r - s) ** 2).sum().item() for r, s in zip(ref, start))
        return (num / den) ** 0.5

    uninterrupted = _everything(runs["collage"][2], runs["collage"][3])
    again = _everything(model, optimizers)
    same = len(uninterrupted) == len(again) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(uninterrupted, again)
    )
    lo_held = any(x is not None and x.any() for x in again[1::2])
    return {
        "loss": {k: v[0] for k, v in runs.items()},
        "resumed_loss": resumed_loss,
        "distance": {k: distance(v[1]) for k, v in runs.items() if k != "float64"},
        "bit_identical": same,
        "lo_held": lo_held,
    }


def test_torchtitan_llama_on_two_ranks_compensated_and_resumed_bit_for_bit(tmp_path):
    results = run_ranks(_ranks, 2, str(tmp_path / "ckpt"), timeout=600)
    r = results[0]
    loss, d = r["loss"], r["distance"]
    print(
        f"\nloss: float64 {loss['float64']:.4f}, fp32 {loss['fp32']:.4f}, bf16 {loss['bf16']:.4f}, "
        f"collage {loss['collage']:.4f} (resumed: {r['resumed_loss']:.4f})\n"
        f"distance: fp32 {d['fp32']:.4f}, bf16 {d['bf16']:.4f}, collage light "
        f"{d['collage']:.4f}; resumed bit for bit: {r['bit_identical']}"
    )
    for rank in results:
        assert rank["bit_identical"] and rank["lo_held"]
        assert rank["resumed_loss"] == rank["loss"]["collage"]
    assert d["collage"] <= 0.1 * d["bf16"], d
    assert abs(r["loss"]["collage"] / r["loss"]["fp32"] - 1) < 0.01, r["loss"]
