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


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-free AdamW (Defazio et al. 2024), its train-mode step as the reference
    implementation (facebookresearch/schedule_free, ``AdamWScheduleFree``) writes it, without
    warmup: the parameters hold ``y``, interpolated toward the iterate ``z`` (optimizer state
    updated by additions alone) by ``ckp1 = lr^2 / sum of lr^2``, a float that changes every
    step.  ``foreach=True``: its foreach form (the package's default), whose
    ``torch._foreach_lerp_(y, z, weight=ckp1)`` passes the changing float by keyword."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False
    ):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, "k": 0, "weight_sum": 0.0, "lr_max": -1.0})
        self.foreach = foreach

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (beta1, beta2), lr, k = group["betas"], group["lr"], group["k"]
            bias_correction2 = 1 - beta2 ** (k + 1)
            # its weight as it writes it (r = 0, weight_lr_power = 2): torch 2.11's float
            # tensorification specialized max() and a step count's power (passes/_common)
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = ((k + 1) ** 0.0) * (lr_max**2.0)
            group["weight_sum"] = weight_sum = group["weight_sum"] + weight
            ckp1 = weight / weight_sum
            active = [p for p in group["params"] if p.grad is not None]
            for p in active:
                if "z" not in self.state[p]:
                    self.state[p]["z"] = torch.clone(p)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
            if self.foreach:
                self._foreach_step(group, active, bias_correction2, ckp1)
                group["k"] = k + 1
                continue
            for p in active:
                state = self.state[p]
                z, exp_avg_sq = state["z"], state["exp_avg_sq"]
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = exp_avg_sq.div(bias_correction2).sqrt_().add_(group["eps"])
                grad_normalized = p.grad.div(denom)
                if group["weight_decay"]:
                    grad_normalized.add_(p, alpha=group["weight_decay"])
                p.lerp_(end=z, weight=ckp1)
                p.add_(grad_normalized, alpha=lr * (beta1 * (1 - ckp1) - 1))
                z.sub_(grad_normalized, alpha=lr)
            group["k"] = k + 1

    def _foreach_step(self, group, active, bias_correction2, ckp1):
        (beta1, beta2), lr = group["betas"], group["lr"]
        grads = [p.grad for p in active]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in active]
        zs = [self.state[p]["z"] for p in active]
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denoms = torch._foreach_div(exp_avg_sqs, bias_correction2)
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, group["eps"])
        torch._foreach_div_(grads, denoms)  # the gradients normalized in place, as it does
        if group["weight_decay"]:
            torch._foreach_add_(grads, active, alpha=group["weight_decay"])
        torch._foreach_lerp_(active, zs, weight=ckp1)
        torch._foreach_add_(active, grads, alpha=lr * (beta1 * (1 - ckp1) - 1))
        torch._foreach_sub_(zs, grads, alpha=lr)


class Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) around another optimizer, as timm writes it: every
    ``k`` steps the slow weights move ``alpha`` of the way toward the fast ones and the fast
    weights restart from them; the slow weights are created in the base optimizer's state
    at the first sync.  ``form``: ``"timm"`` (``slow.add_(p - slow, alpha=a);
    p.copy_(slow)``) or ``"average"`` (torch-optimizer's: ``p.mul_(a).add_(slow,
    alpha=1 - a); slow.copy_(p)``) or ``"average-product"`` (``add_(slow * (1 - a))``)."""

    def __init__(self, base, alpha=0.5, k=5, form="timm"):
        self.base, self.form = base, form
        self.param_groups, self.state, self.defaults = base.param_groups, base.state, base.defaults
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        for group in self.param_groups:
            group.update(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)

    @torch.no_grad()
    def update_slow(self, group):
        a = group["lookahead_alpha"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.base.state[p]
            if "slow" not in state:
                state["slow"] = torch.empty_like(p)
                state["slow"].copy_(p)
            slow = state["slow"]
            if self.form == "timm":
                slow.add_(p - slow, alpha=a)
                p.copy_(slow)
            elif self.form == "average":
                p.mul_(a).add_(slow, alpha=1 - a)
                slow.copy_(p)
            else:  # "average-product": what torch 2.11's Dynamo traces "average" into
                p.mul_(a).add_(slow * (1 - a))
                slow.copy_(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.base.step(closure)
        for group in self.base.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss


class AggMo(torch.optim.Optimizer):
    """Aggregated momentum (Lucas et al. 2019) as pytorch_optimizer writes it: one momentum
    buffer per beta, created as zeros in the first step and written ``buf.mul_(b).add_(g)``
    (Inductor folds the first step's ``0 * b + g`` to ``g``), and a step count kept in the
    optimizer's own state under a string key, as its MADGRAD keeps ``state["k"]``."""

    def __init__(self, params, lr=1e-3, betas=(0.0, 0.9, 0.99), foreach=False):
        super().__init__(params, {"lr": lr, "betas": betas, "foreach": foreach})

    @torch.no_grad()
    def step(self):
        if "k" not in self.state:
            self.state["k"] = torch.zeros((), dtype=torch.long)
        self.state["k"].add_(1)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = {
                        b: torch.zeros_like(p) for b in group["betas"]
                    }
            step_size = -group["lr"] / len(group["betas"])
            for b in group["betas"]:
                bufs = [self.state[p]["momentum_buffer"][b] for p in params]
                if group["foreach"]:
                    torch._foreach_mul_(bufs, b)
                    torch._foreach_add_(bufs, [p.grad for p in params])
                    torch._foreach_add_(params, bufs, alpha=step_size)
                else:
                    for p, buf in zip(params, bufs):
                        buf.mul_(b).add_(p.grad)
                        p.add_(buf, alpha=step_size)


class AdaBeliefFP32(torch.optim.Optimizer):
    """AdaBelief (Zhuang et al. 2020) as timm writes it for bf16 weights: the step on an
    fp32 copy of the weight (decoupled weight decay, then ``addcdiv_``), copied back with
    ``p.copy_(p_fp32)``, as Hugging Face's Adafactor and timm's RAdam and Adafactor do."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-16, weight_decay=0.01):
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_var"] = torch.zeros_like(p, dtype=torch.float32)
                p_fp32 = p
                if p.dtype in {torch.float16, torch.bfloat16}:
                    p_fp32 = p_fp32.float()
                p_fp32.mul_(1.0 - lr * group["weight_decay"])
                state["step"] += 1
                exp_avg, exp_avg_var = state["exp_avg"], state["exp_avg_var"]
                exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
                diff = grad - exp_avg
                exp_avg_var.mul_(b2).addcmul_(diff, diff, value=1 - b2)
                bias1 = 1 - b1 ** state["step"]
                bias2 = 1 - b2 ** state["step"]
                denom = (exp_avg_var.add_(group["eps"]).sqrt() / bias2.sqrt()).add_(group["eps"])
                p_fp32.addcdiv_(exp_avg, denom, value=-lr / bias1)
                if p.dtype in {torch.float16, torch.bfloat16}:
                    p.copy_(p_fp32)


class FactoredMomentum(torch.optim.Optimizer):
    """CAME (Luo et al. 2023) in miniature, as pytorch_optimizer writes it: the second
    moment of a matrix factored into row and column means (Adafactor) and a momentum
    scaled by the factored variance of its residual; the factors made with
    ``torch.zeros(..., dtype=grad.dtype)`` on the first step, and ``g * g`` computed from
    the gradient alone into a buffer the step then writes with ``out=``.  It reads ``p.grad`` as any code outside torch.optim does (not
    through ``_init_group``).  Matrices only."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @staticmethod
    def _factors(row, col):
        return (row / row.mean()).rsqrt().unsqueeze(-1), col.rsqrt().unsqueeze(-2)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2, b3), lr = group["betas"], group["lr"]
            for p in group["params"]:
                grad = p.grad / p.grad.norm()  # a unit gradient, as NovoGrad and LARS take
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    for key, shape in (("row", grad.shape[:-1]), ("col", grad.shape[-1:])):
                        state[key] = torch.zeros(shape, dtype=grad.dtype)
                        state[key + "_res"] = torch.zeros(shape, dtype=grad.dtype)
                update = grad * grad + 1e-30
                state["row"].mul_(b2).add_(update.mean(dim=-1), alpha=1 - b2)
                state["col"].mul_(b2).add_(update.mean(dim=-2), alpha=1 - b2)
                torch.mul(*self._factors(state["row"], state["col"]), out=update)
                update.mul_(grad)
                exp_avg = state["exp_avg"]
                exp_avg.lerp_(update, 1 - b1)
                res = (update - exp_avg) ** 2 + 1e-16
                state["row_res"].mul_(b3).add_(res.mean(dim=-1), alpha=1 - b3)
                state["col_res"].mul_(b3).add_(res.mean(dim=-2), alpha=1 - b3)
                torch.mul(*self._factors(state["row_res"], state["col_res"]), out=update)
                p.add_(update.mul_(exp_avg), alpha=-lr)


class Adopt(torch.optim.Optimizer):
    """ADOPT (Taniguchi et al. 2024) as timm writes it: the first step only fills the
    second moment (``exp_avg_sq.addcmul_(g, g)``) and leaves the weights; later steps
    normalize the gradient by the second moment of the steps before it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.9999), eps=1e-6):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                grad, state = p.grad, self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["exp_avg_sq"].addcmul_(grad, grad)
                    continue
                normed = grad / torch.clamp(state["exp_avg_sq"].sqrt(), group["eps"])
                state["exp_avg"].lerp_(normed, 1 - b1)
                p.add_(state["exp_avg"], alpha=-lr)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)


class FunctionalAdam(torch.optim.Optimizer):
    """Adam (no bias correction) with its moments replaced, not updated in place:
    ``state["v"] = b2 * v + (1 - b2) * g * g``, as research code and AdaLite write it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                grad, state = p.grad, self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"] = b1 * state["m"] + (1 - b1) * grad
                state["v"] = b2 * state["v"] + (1 - b2) * grad * grad
                p.add_(state["m"] / (state["v"].sqrt() + group["eps"]), alpha=-lr)


class IntStepAdam(torch.optim.Optimizer):
    """Adam as pytorch_optimizer writes it: the step count a Python int in the param
    group (``group["step"] += 1``), the bias corrections through ``math.pow`` (its
    ``debias``: ``1 - math.pow(beta, step)``)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        import math

        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), lr = group["betas"], group["lr"]
            bias1 = 1.0 - math.pow(b1, group["step"])
            bias2_sqrt = math.sqrt(1.0 - math.pow(b2, group["step"]))
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v.sqrt() / bias2_sqrt).add_(group["eps"])
                p.addcdiv_(m, denom, value=-lr / bias1)


class TrustRatioAdam(torch.optim.Optimizer):
    """LAMB (You et al. 2020) as pytorch_optimizer's foreach path writes it: each tensor's
    Adam update scaled by its trust ratio ``||w|| / ||update||``, the norms of all tensors
    stacked, the ratios taken with ``torch.where`` and unbound into views of one tensor
    for ``_foreach_mul_``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            (b1, b2), eps = group["betas"], group["eps"]
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            for p in params:
                if not self.state[p]:
                    self.state[p]["m"], self.state[p]["v"] = (
                        torch.zeros_like(p),
                        torch.zeros_like(p),
                    )
            ms = [self.state[p]["m"] for p in params]
            vs = [self.state[p]["v"] for p in params]
            torch._foreach_lerp_(ms, grads, 1 - b1)
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
            updates = torch._foreach_sqrt(vs)
            torch._foreach_add_(updates, eps)
            torch._foreach_reciprocal_(updates)
            torch._foreach_mul_(updates, ms)
            w = torch.stack(torch._foreach_norm(params)).clamp_(max=10.0)
            u = torch.stack(torch._foreach_norm(updates))
            ratios = torch.where((w != 0) & (u != 0), w / (u + eps), 1.0)
            torch._foreach_mul_(updates, ratios.unbind())
            torch._foreach_add_(params, updates, alpha=-group["lr"])


class TensorStepAdam(torch.optim.Optimizer):
    """Adam with MADGRAD's step counter, as pytorch_optimizer writes it: a one-element
    long tensor in ``self.state["k"]``, read through ``math.pow(k + 1, 0.5)``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        import math

        if "k" not in self.state:
            self.state["k"] = torch.tensor([0], dtype=torch.long)
        scale = math.pow(self.state["k"] + 1, 0.5)
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.addcdiv_(m, (v.sqrt() * scale).add_(group["eps"]), value=-lr * scale)
        self.state["k"] += 1


class StepSizeListLaProp(torch.optim.Optimizer):
    """LaProp (Ziyin et al. 2020) as pytorch_optimizer's foreach path writes it: each
    tensor's bias correction a Python float in its state (``exp_avg_lr_1``, an average of
    the learning rates), the step sizes made with ``torch.tensor([...])`` of those floats
    and unbound for ``_foreach_addcmul_``; the momentum averages the normalized gradient."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-15):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), lr = group["betas"], group["lr"]
            params = [p for p in group["params"] if p.grad is not None]
            sizes = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    state["exp_avg_lr_1"] = 0.0
                state["exp_avg_lr_1"] = state["exp_avg_lr_1"] * b1 + (1.0 - b1) * lr
                sizes.append(-1.0 / (state["exp_avg_lr_1"] / lr))
            step_sizes = torch.tensor(sizes, dtype=torch.float32, device=params[0].device)
            grads = [p.grad for p in params]
            ms = [self.state[p]["exp_avg"] for p in params]
            vs = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, grads, grads, value=1.0 - b2)
            denoms = torch._foreach_sqrt(vs)
            torch._foreach_div_(denoms, (1.0 - b2 ** group["step"]) ** 0.5)
            torch._foreach_add_(denoms, group["eps"])
            torch._foreach_mul_(ms, b1)
            torch._foreach_addcdiv_(ms, grads, denoms, value=(1.0 - b1) * lr)
            torch._foreach_addcmul_(params, ms, step_sizes.unbind())
