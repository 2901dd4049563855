"""Train a small GPT with each precision strategy side by side: same data, seed and batches.

    python examples/train_gpt.py                # or: python -m collage_compile.demo, collage-demo
    python examples/train_gpt.py --steps 1000 --lr 3e-4 --data my.txt --device cuda

A byte-level GPT (nanoGPT-style: causal self-attention, MLP, LayerNorm, tied embeddings; no
biases) is trained with a stock ``torch.optim.AdamW`` under a warmup + cosine ``LambdaLR``
stepped every step (``--schedule constant`` for a fixed lr), five ways:

================  ==========================================================================
``fp32-master``   bf16 model, fp32 master weights and fp32 AdamW state: the (16, 32) baseline,
                  its step compiled (plain Inductor's arithmetic; a changing lr stays an input)
``bf16``          bf16 weights and state, plain arithmetic (``make_backend(mode="off")``)
``collage-light`` bf16 weights and state, parameter updates carried as (hi, lo) pairs
``collage-plus``  also AdamW's second moment as a pair (β2 = 0.999 rounds to 1 in bf16)
``collage-exact`` bf16 weights and state, each with an int16 remainder: fp32's arithmetic
================  ==========================================================================

Every strategy starts from the same bf16 weights, sees the same batches and is evaluated the
same way: on the bf16 weights the forward pass uses (hi), never on a master copy or hi + lo.

Data: by default the running Python's standard-library sources (the top-level ``*.py`` files,
sorted by name, concatenated; the last 10 % is the validation split), so no download is
needed; the numbers then depend on the Python version.  ``--data PATH``: any text file.

Output: a table, ``<out>/train_gpt.png`` (loss and EDQ curves), ``<out>/train_gpt.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import platform
import statistics
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import collage_compile

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

STRATEGIES = ("fp32-master", "bf16", "collage-light", "collage-plus", "collage-exact")
# the backend mode behind each bf16-only strategy ("off": nothing rewritten, still measured)
MODES = {"bf16": "off", "collage-light": "light", "collage-plus": "plus", "collage-exact": "exact"}


# ---- the model ---------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=False),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A byte-level GPT: token + position embeddings, pre-LayerNorm blocks, tied output layer."""

    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, updated once
        # GPT-2's initialization (as nanoGPT): N(0, 0.02), residual projections scaled down
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("c_proj.weight", "mlp.2.weight"))
                std = 0.02 / math.sqrt(2 * n_layer) if residual else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        # the loss in fp32: the logits are bf16, their softmax is not where precision is lost
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# ---- data --------------------------------------------------------------------------------------


def stdlib_corpus() -> tuple[bytes, str]:
    """The running Python's top-level standard-library sources, sorted by name: present on
    every machine, so the demo needs no download."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    data = b"".join(f.read_bytes() for f in files)
    return data, f"{len(files)} stdlib *.py files of Python {platform.python_version()} ({root})"


def load_data(path: str | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Bytes of the corpus as int64 tokens, split 90 % train / 10 % validation."""
    if path is None:
        raw, desc = stdlib_corpus()
    else:
        raw, desc = Path(path).read_bytes(), path
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n = int(0.9 * len(tokens))
    return tokens[:n], tokens[n:], f"{desc}: {len(tokens):,} bytes"


def batch_starts(n_tokens: int, block: int, count: int, batch: int, seed: int) -> torch.Tensor:
    """``count`` x ``batch`` window offsets drawn once, so every strategy sees the same batches."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - block - 1, (count, batch), generator=g)


def get_batch(
    tokens: torch.Tensor, starts: torch.Tensor, block: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(block + 1)
    win = tokens[idx]
    return win[:, :-1].to(device), win[:, 1:].to(device)


# ---- one strategy -------------------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    steps: int
    lr: float
    schedule: str
    warmup: int
    beta1: float
    beta2: float
    weight_decay: float
    batch_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    eval_every: int
    eval_batches: int
    metrics: bool
    compile_forward: bool
    seed: int
    device: str
    clip: float | None = None  # clip_grad_norm_ before every step (None: no clipping)
    profile_steps: int = 0  # steady steps run under torch.profiler (StepProfile), untimed

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fixed: Any) -> Settings:
        """The fields a command line gives by name (``--warmup`` defaulting to a tenth of
        ``--steps``), then ``fixed``."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {n: getattr(args, n) for n in names if hasattr(args, n)}
        if values.get("warmup") is None:
            values["warmup"] = max(1, args.steps // 10)
        return cls(**{**values, **fixed})


def lr_factor(s: Settings) -> Callable[[int], float]:
    """The learning rate's multiplier at each step: a linear warmup to the peak over
    ``warmup`` steps (starting at 1/warmup, like LinearLR, not at 0: the fp32-master
    baseline computes as plain Inductor, whose compiled AdamW writes NaN at lr = 0), then a cosine
    decay to a tenth of the peak ("cosine"), or the peak throughout ("constant")."""

    def factor(step: int) -> float:
        if s.schedule == "constant":
            return 1.0
        if step < s.warmup:
            return (step + 1) / s.warmup
        progress = (step - s.warmup) / max(1, s.steps - s.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def param_groups(params: dict[str, torch.Tensor], wd: float) -> list[dict[str, Any]]:
    """nanoGPT's groups: weight decay on matrices and embeddings, none on LayerNorm gains."""
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def persistent_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors and of every lo the backend keeps for them, counted from storage."""
    total = 0
    for t in tensors:
        total += t.numel() * t.element_size()
        lo = collage_compile.components(t)[1]
        if lo is not None:
            total += lo.numel() * lo.element_size()
    return total


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclasses.dataclass
class Strategy:
    """What the training loop needs of one strategy: the optimizer its schedule steps, the
    optimizer step, the tensors it keeps between steps, and how a sampled step is measured
    (``snapshot`` before it, untimed; ``measured`` around it; ``metrics`` after it), and
    the context its forward passes run in (``autocast``: mixed precision's)."""

    opt: torch.optim.Optimizer
    step: Callable[[], None]
    persistent: Callable[[], list[torch.Tensor]]
    autocast: Callable[[], Any] = contextlib.nullcontext
    snapshot: Callable[[], Any] = lambda: None
    measured: Callable[[], Any] = contextlib.nullcontext
    metrics: Callable[[Any], dict[str, float]] = lambda _: collage_compile.last_metrics()


def fp32_master(params: dict[str, torch.Tensor], s: Settings) -> Strategy:
    """(16, 32): fp32 copies are what AdamW updates (fp32 m and v); the bf16 model only
    runs forward and backward, and gets the rounded masters after every step.  Its step is
    compiled with the backend in ``mode="off"``, which on fp32 tensors is plain Inductor's
    arithmetic with the scheduled lr kept a graph input: plain Inductor itself recompiles
    for every lr and runs the step eagerly from its eighth value on."""
    masters = {k: p.detach().float().requires_grad_() for k, p in params.items()}
    opt = torch.optim.AdamW(param_groups(masters, s.weight_decay), **_adamw(s))
    collage_compile.compile_optimizer(opt, mode="off")
    model_p, master_p = list(params.values()), list(masters.values())

    def step() -> None:
        for m, p in zip(master_p, model_p):
            m.grad = p.grad.float()
        opt.step()  # looked up per call: the LR scheduler wraps it after this
        with torch.no_grad():
            for p, m in zip(model_p, master_p):
                p.copy_(m)

    return Strategy(
        opt,
        step,
        lambda: model_p + master_p + _state(opt),
        # measured outside the timed step: its intended update is the masters' change, and
        # hi is the bf16 copy the forward pass uses
        snapshot=lambda: [t.detach().clone() for t in master_p + model_p],
        metrics=lambda before: _copy_metrics(before, master_p, model_p),
    )


def bf16_only(params: dict[str, torch.Tensor], s: Settings, mode: str) -> Strategy:
    """bf16 weights and state, the step compiled with the backend in ``mode``; measured
    inside the compiled step on the sampled steps alone (``every="metered"``)."""
    opt = torch.optim.AdamW(param_groups(params, s.weight_decay), **_adamw(s))
    every = "metered" if s.metrics else 1
    collage_compile.compile_optimizer(opt, mode=mode, metrics=s.metrics, every=every)
    return Strategy(
        opt,
        lambda: opt.step(),  # looked up per call: the LR scheduler wraps it after this
        lambda: list(params.values()) + _state(opt),
        measured=collage_compile.measuring,
    )


def _adamw(s: Settings) -> dict[str, Any]:
    return dict(lr=s.lr, betas=(s.beta1, s.beta2))


def train_one(
    strategy: str,
    init: dict[str, torch.Tensor],
    model_args: dict[str, int],
    train: torch.Tensor,
    val: torch.Tensor,
    s: Settings,
    progress: Callable[..., Any],
) -> dict[str, Any]:
    """Train a fresh copy of the model from ``init`` with one strategy; its curves and numbers."""
    torch._dynamo.reset()  # each strategy compiles its own step, with nothing left over
    collage_compile.reset_metrics()
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = GPT(**model_args).to(s.device, torch.bfloat16)
    model.load_state_dict(init)
    params = dict(model.named_parameters())
    if strategy == "fp32-master":
        st = fp32_master(params, s)
    else:
        st = bf16_only(params, s, MODES[strategy])
    sched = torch.optim.lr_scheduler.LambdaLR(st.opt, lr_factor(s))
    # Forward and backward run eagerly by default: at the default size on 2 CPU cores eager and
    # Inductor-compiled forward + backward both took ~48 ms (measured), and compiling would
    # add its time to every strategy.  --compile-forward compiles them (the same way for
    # every strategy; later strategies hit Inductor's cache, as the shapes are the same).
    fwd = torch.compile(model) if s.compile_forward else model
    run = _Run(strategy, st, sched, model, fwd, train, val, s)
    t_start = time.perf_counter()
    run.loop(progress)
    wall = time.perf_counter() - t_start
    n_params = sum(p.numel() for p in params.values())
    return run.summary(n_params, wall)


class StepProfile:
    """``count`` steady steps from the middle of a run under ``torch.profiler``: each step's
    forward and backward (with clipping) and its optimizer step as labelled regions, and
    the ops that took the most host and device time.  Where a strategy's step is slower
    than another's, this says in which region and which ops.  ``count`` 0: nothing runs."""

    TOP = 12

    def __init__(self, count: int, steps: int, device: str):
        self.first = max(3, steps // 2) if count else steps
        self.last = min(steps, self.first + count) - 1
        self.cuda = device.startswith("cuda")
        self.prof: Any = None
        self.summary: dict[str, Any] | None = None

    def start(self, i: int) -> bool:
        """Starts the window at its first step; whether step ``i`` is profiled."""
        if i == self.first:
            acts = [torch.profiler.ProfilerActivity.CPU]
            acts += [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        return self.prof is not None

    def region(self, name: str) -> Any:
        return torch.profiler.record_function(name) if self.prof else contextlib.nullcontext()

    def stop(self, i: int) -> None:
        if self.prof is not None and i == self.last:
            self.prof.__exit__(None, None, None)
            self.summary = self._summarize(self.prof.key_averages(), self.last - self.first + 1)
            self.prof = None

    @classmethod
    def _summarize(cls, events: Any, n: int) -> dict[str, Any]:
        """Per step, in ms: each region's host time (inclusive) and device time, and the
        top ops by their own host time and by their own device time."""

        def dev(e: Any, own: bool) -> float:
            name = ("self_" if own else "") + "device_time_total"
            legacy = ("self_" if own else "") + "cuda_time_total"
            return getattr(e, name, getattr(e, legacy, 0.0)) / 1e3 / n

        regions = {
            e.key: {"host_ms": e.cpu_time_total / 1e3 / n, "device_ms": dev(e, own=False)}
            for e in events
            if e.key in ("fwd+bwd", "optimizer")
        }
        ops = [e for e in events if e.key not in regions]

        def top(key: Callable[[Any], float]) -> list[list[Any]]:
            best = sorted(ops, key=key, reverse=True)[: cls.TOP]
            return [[e.key, round(key(e), 4), e.count / n] for e in best if key(e) > 0]

        return {
            "steps": n,
            "regions": regions,
            "top_host": top(lambda e: e.self_cpu_time_total / 1e3 / n),
            "top_device": top(lambda e: dev(e, own=True)),
        }


class StepTime(NamedTuple):
    """One training step: its loss; its time, its optimizer step's, and of that the time
    until ``step()`` returned (the host's part: what follows is waiting for the device), in
    ms."""

    loss: float
    step_ms: float
    opt_ms: float
    opt_host_ms: float


class _Run:
    """One strategy's training loop and what it records."""

    def __init__(
        self,
        strategy: str,
        st: Strategy,
        sched: Any,
        model: nn.Module,
        fwd: Any,
        train: torch.Tensor,
        val: torch.Tensor,
        s: Settings,
    ):
        self.strategy, self.st, self.sched, self.s = strategy, st, sched, s
        self.model, self.fwd, self.train, self.val = model, fwd, train, val
        self.starts = batch_starts(len(train), s.block_size, s.steps, s.batch_size, s.seed + 1)
        self.eval_starts = {
            split: batch_starts(len(data), s.block_size, s.eval_batches, s.batch_size, s.seed + 2)
            for split, data in (("train", train), ("val", val))
        }
        self.curve: dict[str, list[float]] = {"step": [], "train": [], "val": []}
        self.edq: dict[str, list[float]] = {"step": [], "edq": [], "edq_hi": [], "imprecision": []}
        self.step_loss: list[float] = []
        self.step_ms: list[float] = []
        self.opt_ms: list[float] = []
        self.opt_host_ms: list[float] = []
        self.profile = StepProfile(s.profile_steps, s.steps, s.device)

    @torch.no_grad()
    def evaluate(self, step: int) -> None:
        # no dropout or batch statistics: train mode is eval mode (and flipping it would
        # recompile the forward)
        s = self.s
        self.curve["step"].append(step)
        for split, data in (("train", self.train), ("val", self.val)):
            with self.st.autocast():
                losses = [
                    self.fwd(*get_batch(data, st, s.block_size, s.device)).item()
                    for st in self.eval_starts[split]
                ]
            self.curve[split].append(statistics.fmean(losses))

    def loop(self, progress: Callable[..., Any]) -> None:
        s, st = self.s, self.st
        self.evaluate(0)
        bar = progress(range(s.steps), desc=f"{self.strategy:>13}", unit="step", leave=True)
        sample_every = max(1, s.eval_every // 4)
        for i in bar:
            sampled = s.metrics and (i + 1) % sample_every == 0
            before = st.snapshot() if sampled else None
            profiled = self.profile.start(i)
            t = self.step(i, st.measured() if sampled else None)
            self.profile.stop(i)
            if not profiled:  # the profiler's own cost is not the step's
                self.step_ms.append(t.step_ms)
                self.opt_ms.append(t.opt_ms)
                self.opt_host_ms.append(t.opt_host_ms)
            self.step_loss.append(t.loss)
            if sampled:
                self.record_metrics(i + 1, st.metrics(before))
            if (i + 1) % s.eval_every == 0 or i + 1 == s.steps:
                self.evaluate(i + 1)
                bar.set_postfix(val=f"{self.curve['val'][-1]:.4f}")
        bar.close()

    def step(self, i: int, measured: Any = None) -> StepTime:
        """One training step on batch ``i`` (modulo the run's), the scheduler's step after
        it: its loss and times (synchronized before and after the optimizer step)."""
        s, st, region = self.s, self.st, self.profile.region
        x, y = get_batch(self.train, self.starts[i % len(self.starts)], s.block_size, s.device)
        _sync(s.device)
        t0 = time.perf_counter()
        with region("fwd+bwd"):
            with st.autocast():
                loss = self.fwd(x, y)
            st.opt.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            loss.backward()
            if s.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.clip)
            _sync(s.device)
        t1 = time.perf_counter()
        with region("optimizer"), measured or contextlib.nullcontext():
            st.step()
            returned = time.perf_counter()
            _sync(s.device)
        t2 = time.perf_counter()
        self.sched.step()
        return StepTime(loss.item(), 1e3 * (t2 - t0), 1e3 * (t2 - t1), 1e3 * (returned - t1))

    def record_metrics(self, step: int, m: dict[str, float]) -> None:
        if m:
            self.edq["step"].append(step)
            for k in ("edq", "edq_hi", "imprecision"):
                self.edq[k].append(m[k])

    def summary(self, n_params: int, wall: float) -> dict[str, Any]:
        cuda = self.s.device.startswith("cuda")
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "mode": MODES.get(self.strategy),
            # the backend measured EDQ inside the compiled step, on the sampled steps alone
            "metrics_in_step": bool(self.s.metrics and self.strategy != "fp32-master"),
            "final_train_loss": self.curve["train"][-1],
            "final_val_loss": self.curve["val"][-1],
            "curve": self.curve,
            "step_loss": self.step_loss,
            "edq_curve": self.edq,
            **step_times(self.step_ms, self.opt_ms, self.opt_host_ms, skip=3),
            "step_ms": self.step_ms,
            "profile": self.profile.summary,
            "opt_ms": self.opt_ms,
            "opt_host_ms": self.opt_host_ms,
            "first_step_s": self.step_ms[0] / 1e3,
            "wall_s": wall,
            "n_params": n_params,
            "persistent_bytes": persistent_bytes(self.st.persistent()),
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        }
        out["bytes_per_param"] = out["persistent_bytes"] / n_params
        out["tokens_per_s"] = tokens_per_s(self.s, out["ms_per_step"])
        for k in ("edq", "edq_hi", "imprecision"):
            vals = [v for v in self.edq[k] if not math.isnan(v)]
            out[k] = statistics.fmean(vals) if vals else None
        return out


def step_times(
    step_ms: list[float], opt_ms: list[float], opt_host_ms: list[float], skip: int
) -> dict[str, float]:
    """A step's time, its optimizer step's, the part of that until ``step()`` returned
    (host work; the rest is the device finishing) and the rest of the step's (forward,
    backward, clipping) in ms, after the first ``skip`` steps (which compile and warm
    caches).  On a shared machine other processes stall some steps by whole scheduler
    slices, so the 20th percentile says what the code costs better than the median (also
    given)."""
    warm = step_ms[min(skip, len(step_ms) - 1) :]
    warm_opt = opt_ms[min(skip, len(opt_ms) - 1) :]
    warm_host = opt_host_ms[min(skip, len(opt_host_ms) - 1) :]
    return {
        "ms_per_step": _quantile(warm, 0.2),
        "opt_ms_per_step": _quantile(warm_opt, 0.2),
        "opt_host_ms_per_step": _quantile(warm_host, 0.2),
        "fwd_bwd_ms_per_step": _quantile([t - o for t, o in zip(warm, warm_opt)], 0.2),
        "ms_per_step_median": statistics.median(warm),
        "opt_ms_per_step_median": statistics.median(warm_opt),
    }


def tokens_per_s(s: Settings, ms_per_step: float) -> float:
    return s.batch_size * s.block_size / (ms_per_step / 1e3)


@torch.no_grad()
def _copy_metrics(
    before: list[torch.Tensor], masters: list[torch.Tensor], model: list[torch.Tensor]
) -> dict[str, float]:
    """EDQ of the bf16 copy against the masters' update, and the share of stuck elements (as
    collage_compile.metrics defines them); float64 sums over all tensors as one vector."""
    n = len(masters)
    dot = norm = stuck = moving = 0.0
    for m0, m1, h0, h1 in zip(before[:n], masters, before[n:], model):
        d = (m1 - m0).double()
        dh = (h1 - h0).double()
        dot += float((dh * d).sum())
        norm += float((d * d).sum())
        nonzero = d != 0
        moving += float(nonzero.sum())
        stuck += float((nonzero & (dh == 0)).sum())
    nan = math.nan
    return {
        "edq": nan,  # the masters' change is the intended update itself: nothing to measure
        "edq_hi": dot / norm if norm > 0 else nan,
        "imprecision": stuck / moving if moving > 0 else 0.0,
    }


def _finite(x: Any) -> Any:
    """``x`` with every NaN replaced by None (null): strict JSON readers reject NaN."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (m, v, and the step counters)."""
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# ---- output --------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table_head(head: str) -> list[str]:
    """A Markdown table's header and rule (the first column left-aligned, the rest right)."""
    return [head, "|---|" + "---:|" * (head.count("|") - 2)]


def val_gap(r: dict[str, Any], ref: dict[str, Any] | None) -> str:
    """``r``'s final validation loss relative to ``ref``'s, in percent."""
    if ref is None:
        return "-"
    return f"{100 * (r['final_val_loss'] / ref['final_val_loss'] - 1):+.2f} %"


def table(results: list[dict[str, Any]]) -> str:
    """The side-by-side table (plain text, also valid as a Markdown table)."""
    ref = next((r for r in results if r["strategy"] == "fp32-master"), None)
    lines = table_head(
        "| strategy | train loss | val loss | val vs fp32-master | EDQ | EDQ hi | imprecision "
        "| ms/step | opt ms/step | bytes/param | peak memory |"
    )
    for r in results:
        rel = val_gap(r, ref)
        peak = r["peak_memory_bytes"]
        lines.append(
            f"| {r['strategy']} | {r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} "
            f"| {rel} | {_fmt(r['edq'], '.4f')} | {_fmt(r['edq_hi'], '.4f')} "
            f"| {_fmt(r['imprecision'], '.4f')} | {r['ms_per_step']:.1f} "
            f"| {r['opt_ms_per_step']:.1f} | {r['bytes_per_param']:.2f} "
            f"| {'-' if peak is None else f'{peak / 2**20:.1f} MiB'} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Loss curves, the validation gap to fp32-master and EDQ curves per strategy; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = dict(zip(STRATEGIES, ("black", "tab:red", "tab:blue", "tab:green", "tab:purple")))
    ref = next((r for r in results if r["strategy"] == "fp32-master"), None)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=72)
    (ax_val, ax_gap), (ax_train, ax_edq) = axes
    for r in results:
        c, color, name = r["curve"], colors[r["strategy"]], r["strategy"]
        ax_val.plot(c["step"], c["val"], marker=".", color=color, label=name)
        if ref is not None and ref is not r:
            gap = [v - w for v, w in zip(c["val"], ref["curve"]["val"])]
            ax_gap.plot(c["step"], gap, marker=".", color=color, label=name)
        steps = range(1, len(r["step_loss"]) + 1)
        ax_train.plot(steps, _smooth(r["step_loss"]), color=color, label=name, linewidth=1)
        e = r["edq_curve"]
        if e["step"] and name == "fp32-master":
            ax_edq.plot(e["step"], e["edq_hi"], ":", color=color, label=f"{name} bf16 copy")
        elif e["step"]:
            plain = r["mode"] == "off"
            ax_edq.plot(e["step"], e["edq"], color=color, label=name if plain else f"{name} hi+lo")
            if not plain:
                ax_edq.plot(e["step"], e["edq_hi"], ":", color=color, label=f"{name} hi")
    ax_val.set(title="validation loss (evaluated on the bf16 weights)", xlabel="step")
    ax_gap.set(title="validation loss minus fp32-master's", xlabel="step")
    ax_gap.axhline(0.0, color="black", linewidth=0.8)
    ax_train.set(title="training loss (20-step moving average)", xlabel="step")
    ax_edq.set(title="EDQ: share of each update the weights received", xlabel="step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _smooth(xs: list[float], k: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _progress() -> Callable[..., Any]:
    try:
        from tqdm.auto import tqdm

        return lambda it, **kw: tqdm(it, file=sys.stderr, dynamic_ncols=True, **kw)
    except ImportError:  # a plain loop, with the postfix calls ignored
        return lambda it, **kw: _Plain(it)


class _Plain:
    def __init__(self, it: Any):
        self.it = it

    def __iter__(self) -> Any:
        return iter(self.it)

    def set_postfix(self, **kw: Any) -> None:
        pass

    def close(self) -> None:
        pass


# ---- command line ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="collage-demo",
        description="Train a small byte-level GPT with each precision strategy side by side.",
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    ap.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="cosine: linear warmup, then cosine decay to lr/10 (default); constant: lr",
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="warmup steps (default: a tenth of --steps)"
    )
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="a text file (default: stdlib sources)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--out", default="train_gpt_out", help="folder for the PNG and the JSON")
    ap.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated subset of {','.join(STRATEGIES)}",
    )
    ap.add_argument(
        "--no-metrics",
        action="store_true",
        help="compile the bf16 strategies without metrics=True (no EDQ)",
    )
    ap.add_argument(
        "--compile-forward",
        action="store_true",
        help="compile forward and backward with Inductor (default: eager)",
    )
    args = ap.parse_args(argv)
    check_strategies(ap, args.strategies, STRATEGIES)
    return args


def check_strategies(ap: argparse.ArgumentParser, chosen: str, known: Sequence[str]) -> None:
    """``--strategies``: a comma-separated subset of ``known``, or an argparse error."""
    bad = set(chosen.split(",")) - set(known)
    if bad:
        ap.error(f"unknown strategies {sorted(bad)}; choose from {', '.join(known)}")


def _describe_schedule(s: Settings) -> str:
    if s.schedule == "constant":
        return "constant"
    return f"peak; {s.warmup}-step warmup, cosine to lr/10"


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (``collage-demo``): run the demo, print the table, write the files."""
    run(argv)


def _header(s: Settings, n_params: int, data_desc: str) -> str:
    return (
        f"byte-level GPT, {n_params / 1e6:.2f}M params ({s.n_layer} layers, {s.n_embd} wide, "
        f"{s.n_head} heads, context {s.block_size}), bf16 weights at GPT-2 init scale (0.02)\n"
        f"AdamW lr={s.lr:g} ({_describe_schedule(s)}), betas=({s.beta1:g}, {s.beta2:g}), "
        f"weight_decay={s.weight_decay:g}; {s.steps} steps of {s.batch_size}x{s.block_size} "
        f"bytes, seed {s.seed}, {s.device}, torch {torch.__version__}\n"
        f"data: {data_desc}"
    )


def _notes(s: Settings) -> list[str]:
    """What the table's columns mean, printed under it."""
    notes = []
    if s.metrics:
        notes.append(
            f"EDQ: share of each update the optimizer's value received (hi + lo; plain bf16: "
            f"its weights); EDQ hi: the same for the bf16 weights the forward pass uses; "
            f"imprecision: share of weights whose bf16 value did not move although their "
            f"update was non-zero. Means over one step in {max(1, s.eval_every // 4)}, "
            f"measured inside the compiled step on those steps alone (metrics=True, "
            f"every='metered'); fp32-master's are measured on its bf16 copy against the "
            f"masters' change."
        )
    notes.append(
        "ms/step: train step (forward, backward, optimizer), opt ms/step: optimizer step "
        "alone; 20th percentile over the steps after the first 3 (medians in the JSON)."
    )
    notes.append(
        "bytes/param: persistent tensors (bf16 params, fp32 masters, AdamW m and v and step, "
        "lo or remainders), counted from the tensors. peak memory: CUDA only "
        "(torch.cuda.max_memory_allocated)."
    )
    return notes


def _write(
    out: Path,
    result: dict[str, Any],
    header: str,
    s: Settings,
    results: list[dict[str, Any]],
    total: float,
) -> None:
    """The JSON, and the plot where matplotlib is installed."""
    (out / "train_gpt.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    png = out / "train_gpt.png"
    title = header.split("\n")[0] + f"; AdamW lr={s.lr:g}, β2={s.beta2:g}, {s.steps} steps"
    if plot(results, png, title):
        print(f"wrote {png} and {out / 'train_gpt.json'} ({total:.0f} s)")
    else:
        print(
            f"wrote {out / 'train_gpt.json'} ({total:.0f} s); no PNG: matplotlib is not "
            "installed (pip install 'collage-compile[demo]')"
        )


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo; returns everything written to the JSON."""
    args = parse_args(argv)
    # Dynamo notes once that it skips the optimizer's profiler annotation; harmless here, and
    # it would land in the middle of the first progress bar
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(
        lambda r: "Profiler record function" not in r.getMessage()
    )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("collage-demo: --device cuda asked for, but torch sees no CUDA device")
    s = Settings.from_args(args, metrics=not args.no_metrics)
    strategies = [k for k in STRATEGIES if k in args.strategies.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train, val, data_desc = load_data(args.data)
    model_args = dict(
        vocab=256, block_size=s.block_size, n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd
    )
    torch.manual_seed(s.seed)
    init = {k: v.to(torch.bfloat16) for k, v in GPT(**model_args).state_dict().items()}
    n_params = sum(v.numel() for k, v in init.items() if k != "lm_head.weight")
    header = _header(s, n_params, data_desc)
    print(header, flush=True)
    print(
        "Regime chosen so that precision matters: a small learning rate against weights "
        "~0.02 (a bf16 ulp there is ~1.2e-4) and β2 = 0.999 (bf16(0.999) == 1).",
        flush=True,
    )

    progress = _progress()
    t0 = time.perf_counter()
    results = [train_one(k, init, model_args, train, val, s, progress) for k in strategies]
    total = time.perf_counter() - t0

    text = table(results)
    print("\n" + text + "\n" + "\n".join(_notes(s)), flush=True)

    result = {
        "settings": dataclasses.asdict(s),
        "data": data_desc,
        "n_params": n_params,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "total_s": total,
        "table": text,
        "results": results,
    }
    result = _finite(result)
    _write(out, result, header, s, results, total)
    return result


if __name__ == "__main__":
    main()
