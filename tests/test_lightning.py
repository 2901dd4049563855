"""Lightning adopts collage with one callback (``collage_compile.lightning``).

A LightningModule whose ``configure_optimizers`` returns a stock AdamW and a warmup
scheduler stepped every step, trained by Lightning's own ``Trainer`` as its users train:
``precision="bf16-true"``, ``gradient_clip_val``, ``accumulate_grad_batches`` (so every
optimizer step gets Lightning's closure), a checkpoint saved by ``trainer.save_checkpoint``
and resumed by ``fit(ckpt_path=...)``.  Compared with the same Trainer on float64 weights
(``"64-true"``, the reference) and on bf16 weights without the callback.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import collage_compile

L = pytest.importorskip("lightning.pytorch")
from collage_compile.lightning import CollageCallback  # noqa: E402

EPOCHS = 4  # 16 batches of 4, two per optimizer step: 8 steps an epoch


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.net.to(torch.bfloat16).to(torch.float32)  # every run starts from bf16 values

    def training_step(self, batch, index):
        x, y = batch
        return F.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _fit(precision, callbacks, epochs=EPOCHS, ckpt_path=None, save=None):
    module = Regressor()
    trainer = L.Trainer(
        max_epochs=epochs,
        precision=precision,
        callbacks=callbacks,
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return module, trainer


def _everything(module, trainer):
    """Weights, their lo, and the optimizer's state tensors and their lo."""
    opt = trainer.optimizers[0]
    out = []
    for p in module.parameters():
        out += [p.detach().clone(), collage_compile.components(p)[1]]
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                out += [v.clone(), collage_compile.components(v)[1]]
    return out


def test_lightning_trains_compensated_and_resumes_bit_for_bit(tmp_path):
    start = Regressor()
    ref, _ = _fit("64-true", [])
    plain, _ = _fit("bf16-true", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        collage, trainer = _fit("bf16-true", [CollageCallback(mode="light")])
        ckpt = tmp_path / "half.ckpt"
        _fit("bf16-true", [CollageCallback(mode="light")], EPOCHS // 2, save=ckpt)
        resumed, trainer2 = _fit("bf16-true", [CollageCallback(mode="light")], ckpt_path=ckpt)

    opt = trainer.optimizers[0]
    assert getattr(opt.step, "_collage_compiled", False)
    assert opt.state[next(collage.parameters())]["step"].item() == 8 * EPOCHS

    def error(module, value):
        num = den = 0.0
        for p, r, p0 in zip(module.parameters(), ref.parameters(), start.parameters()):
            w = (collage_compile.value(p) if value else p.detach()).double()
            r, p0 = r.detach().double(), p0.detach().double()
            num += ((w - r) ** 2).sum().item()
            den += ((r - p0) ** 2).sum().item()
        return (num / den) ** 0.5

    err, plain_err = error(collage, True), error(plain, False)
    print(f"Lightning, vs float64 weights: collage light {err:.2e}  plain bf16 {plain_err:.2f}")
    assert err <= 0.05 and plain_err >= max(0.3, 10 * err)

    # the checkpoint carried every lo: the resumed run is the uninterrupted one, bit for bit
    for i, (a, b) in enumerate(zip(_everything(collage, trainer), _everything(resumed, trainer2))):
        assert (a is None) == (b is None), i
        assert a is None or torch.equal(a, b), i
    assert any(lo is not None and lo.any() for lo in _everything(resumed, trainer2)[1::2])


def test_a_closure_runs_once_before_the_compiled_step_and_its_loss_is_returned():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = collage_compile.compile_optimizer(torch.optim.SGD([p], lr=0.5))
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        p.grad = torch.ones_like(p)
        return torch.tensor(3.0)

    with torch.no_grad():
        loss = opt.step(closure)
    assert calls == [True] and loss.item() == 3.0
    assert torch.equal(p.detach(), torch.full((4,), 0.5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="LBFGS calls its closure"):
        collage_compile.compile_optimizer(torch.optim.LBFGS([p]))


def test_mixed_precision_weights_are_fp32_and_the_callback_says_nothing_is_upgraded():
    """``precision="bf16-mixed"`` keeps fp32 weights: there is nothing to compensate, and a
    user who added the callback hears so once, by name (not an INFO line)."""
    trainer = L.Trainer(
        max_steps=1,
        precision="bf16-mixed",
        callbacks=[CollageCallback()],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(collage_compile.CollageWarning, match="holds no bf16 or fp16 parameter"):
        trainer.fit(Regressor(), _loader())
