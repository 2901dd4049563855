"""Optimizers a user would write in plain torch ops, with no knowledge of collage.

Nothing here is special-cased by the backend: the tests check that it upgrades them as they
are (test_all_optimizers.py runs them through the same float64-shadow harness).
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): sign of an interpolated momentum; decoupled weight decay."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, foreach=False):
        super().__init__(
            params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach}
        )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            if group["foreach"]:
                if wd:
                    torch._foreach_mul_(params, 1 - lr * wd)
                updates = torch._foreach_mul(exp_avgs, b1)
                torch._foreach_add_(updates, grads, alpha=1 - b1)
                torch._foreach_sign_(updates)
                torch._foreach_add_(params, updates, alpha=-lr)
                torch._foreach_mul_(exp_avgs, b2)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - b2)
            else:
                for p, g, m in zip(params, grads, exp_avgs):
                    if wd:
                        p.mul_(1 - lr * wd)
                    update = m.mul(b1).add(g, alpha=1 - b1).sign_()
                    p.add_(update, alpha=-lr)
                    m.mul_(b2).add_(g, alpha=1 - b2)


class SignSGD(torch.optim.Optimizer):
    """signSGD with momentum (signum): ``buf = beta*buf + (1-beta)*g; p -= lr*sign(buf)``."""

    def __init__(self, params, lr=1e-4, beta=0.9, foreach=False):
        super().__init__(params, {"lr": lr, "beta": beta, "foreach": foreach})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, beta = group["lr"], group["beta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(beta).add_(p.grad, alpha=1 - beta)
                p.add_(torch.sign(buf), alpha=-lr)
