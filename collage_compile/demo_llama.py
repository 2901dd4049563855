"""Train a Hugging Face Llama with each precision strategy side by side: the GPU main job.

    python examples/train_llama.py                      # on a GPU: --device cuda
    python examples/train_llama.py --strategies fp32-amp,collage-light --cudagraphs

A ``transformers.LlamaForCausalLM`` built from a config (default: 8 layers x 512, 25.2M
parameters, a byte vocabulary of 256) is trained four ways from the same bf16 weights on the
same batches, the way its users train it: AdamW (betas 0.9/0.95, weight decay 0.1 on
matrices only), ``get_cosine_schedule_with_warmup`` from lr = 0, ``clip_grad_norm_(1.0)``:

================  ==========================================================================
``fp32-amp``      fp32 weights and AdamW state, bf16 autocast, ``AdamW(fused=True)``
``bf16``          bf16 weights and state, ``AdamW(fused=True)``: plain bf16 arithmetic
``collage-light`` bf16 weights and state, ``compile_optimizer(opt, mode="light")``
``collage-plus``  the same with ``mode="plus"`` (AdamW's second moment as a pair too)
================  ==========================================================================

It prints, per strategy: validation loss and its gap to fp32-amp, tokens/s, the train step's
time, the optimizer step's and forward + backward's, peak memory (CUDA), bytes per parameter
kept, and the CollageWarnings the run gave.  The times are measured after training, side by
side: rounds of a few steps of each strategy in turn (``--timing-rounds``), so that a
machine whose speed drifts over minutes slows every strategy alike.  The loop, data and
measurements are the GPT demo's (:mod:`collage_compile.demo`): text shipped with Python, no
download.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import collage_compile
from collage_compile import demo

STRATEGIES = ("fp32-amp", "bf16", "collage-light", "collage-plus")
MODES = {"collage-light": "light", "collage-plus": "plus"}


class ByteLlama(nn.Module):
    """``LlamaForCausalLM`` over bytes, called as the demo's loop calls its model:
    ``model(idx, targets) -> loss`` (the targets are the inputs shifted by one already)."""

    def __init__(self, s: demo.Settings):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=256,
            hidden_size=s.n_embd,
            intermediate_size=max(64, int(8 * s.n_embd / 3) // 64 * 64),
            num_hidden_layers=s.n_layer,
            num_attention_heads=s.n_head,
            num_key_value_heads=s.n_head,
            max_position_embeddings=s.block_size,
            tie_word_embeddings=False,
        )
        self.llama = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.llama(input_ids=idx).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parameter_shapes(argv: Sequence[str] = ()) -> list[tuple[int, ...]]:
    """The shapes of the model's parameters at these arguments (default: the demo's 75
    tensors, 25.17M parameters), in order; built on the meta device, so nothing is
    allocated (``benchmarks.step --size demo`` times the optimizer step on them)."""
    with torch.device("meta"):
        model = ByteLlama(settings(parse_args(list(argv))))
    return [tuple(p.shape) for p in model.parameters()]


def _adamw(s: demo.Settings, params: dict[str, torch.Tensor], **kw: Any) -> torch.optim.AdamW:
    groups = demo.param_groups(params, s.weight_decay)
    return torch.optim.AdamW(groups, lr=s.lr, betas=(s.beta1, s.beta2), **kw)


def fp32_amp(params: dict[str, torch.Tensor], s: demo.Settings) -> demo.Strategy:
    """fp32 weights and state, bf16 autocast, torch's fused AdamW."""
    opt = _adamw(s, params, fused=True)
    device = torch.device(s.device).type
    return demo.Strategy(
        opt,
        lambda: opt.step(),  # looked up per call: the LR scheduler wraps it after this
        lambda: list(params.values()) + demo._state(opt),
        autocast=lambda: torch.autocast(device, torch.bfloat16),
    )


def bf16_fused(params: dict[str, torch.Tensor], s: demo.Settings) -> demo.Strategy:
    """bf16 weights and state, torch's fused AdamW: plain bf16 arithmetic."""
    opt = _adamw(s, params, fused=True)
    return demo.Strategy(opt, lambda: opt.step(), lambda: list(params.values()) + demo._state(opt))


def collage(
    params: dict[str, torch.Tensor], s: demo.Settings, mode: str, cudagraphs: bool
) -> demo.Strategy:
    """bf16 weights and state, the stock foreach AdamW compiled by the backend."""
    opt = _adamw(s, params, foreach=True)
    collage_compile.compile_optimizer(opt, mode=mode, cudagraphs=cudagraphs)
    return demo.Strategy(opt, lambda: opt.step(), lambda: list(params.values()) + demo._state(opt))


def train_one(
    strategy: str,
    init: dict[str, torch.Tensor],
    train: torch.Tensor,
    val: torch.Tensor,
    s: demo.Settings,
    cudagraphs: bool,
    progress: Callable[..., Any],
) -> tuple[dict[str, Any], demo._Run]:
    """One strategy from the shared bf16 init; its numbers and the CollageWarnings given,
    and the run, kept for the side-by-side timing (:func:`side_by_side`).  Its peak memory
    is counted above what the strategies before it still hold."""
    from transformers import get_cosine_schedule_with_warmup

    gc.collect()  # what the last strategy left in reference cycles
    baseline = 0
    if s.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    dtype = torch.float32 if strategy == "fp32-amp" else torch.bfloat16
    model = ByteLlama(s).to(s.device, dtype)
    model.load_state_dict(init)
    params = dict(model.named_parameters())
    if strategy == "fp32-amp":
        st = fp32_amp(params, s)
    elif strategy == "bf16":
        st = bf16_fused(params, s)
    else:
        st = collage(params, s, MODES[strategy], cudagraphs)
    sched = get_cosine_schedule_with_warmup(st.opt, s.warmup, s.steps)
    run = demo._Run(strategy, st, sched, model, model, train, val, s)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", collage_compile.CollageWarning)
        run.loop(progress)
    said = _collage_warnings(rec)
    out = run.summary(sum(p.numel() for p in params.values()), time.perf_counter() - t0)
    out["collage_warnings"] = said
    if out["peak_memory_bytes"] is not None:
        out["peak_memory_bytes"] -= baseline
    whole = getattr(st.opt.step, "whole_step", None)  # cudagraphs=True: the step replayed
    out["replayed_steps"] = whole.replays if whole is not None else None
    return out, run


def side_by_side(runs: list[tuple[dict[str, Any], demo._Run]], rounds: int, steps: int) -> None:
    """After training, ``rounds`` rounds of ``steps`` training steps of every strategy in
    turn (the order rotating each round), timed as in training: noise that drifts over the
    minutes one strategy trains (on the H100, bf16's median forward and backward went from
    21 to 29 ms between the halves of its run) lands on every strategy alike.  Each row's
    step, optimizer and forward-and-backward times become these (the 20th percentile);
    the training's are kept under ``training_times``."""
    times: dict[str, tuple[list[float], ...]] = {r.strategy: ([], [], []) for _, r in runs}
    for k in range(rounds):
        for out, r in runs[k % len(runs) :] + runs[: k % len(runs)]:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always", collage_compile.CollageWarning)
                for i in range(steps):
                    t = r.step(k * steps + i)
                    for column, value in zip(times[r.strategy], t[1:]):
                        column.append(value)
            out["collage_warnings"] += _collage_warnings(rec)
    for out, r in runs:
        measured = demo.step_times(*times[r.strategy], skip=0)
        out["training_times"] = {k: out[k] for k in measured}
        out.update(measured)
        out["tokens_per_s"] = demo.tokens_per_s(r.s, out["ms_per_step"])
        out["side_by_side"] = {"rounds": rounds, "steps": steps}


def _collage_warnings(rec: list[warnings.WarningMessage]) -> list[str]:
    """The CollageWarnings recorded; the others are shown, not ours to swallow."""
    for w in rec:
        if not issubclass(w.category, collage_compile.CollageWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return [str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)]


def table(results: list[dict[str, Any]]) -> str:
    """The side-by-side table (plain text, also valid as a Markdown table)."""
    ref = next((r for r in results if r["strategy"] == "fp32-amp"), None)
    lines = demo.table_head(
        "| strategy | val loss | vs fp32-amp | tokens/s | step ms | opt ms | opt host ms "
        "| fwd+bwd ms | peak memory | bytes/param | CollageWarnings |"
    )
    for r in results:
        gap = demo.val_gap(r, ref)
        peak = r["peak_memory_bytes"]
        lines.append(
            f"| {r['strategy']} | {r['final_val_loss']:.4f} | {gap} | {r['tokens_per_s']:.0f} "
            f"| {r['ms_per_step']:.2f} | {r['opt_ms_per_step']:.2f} "
            f"| {r['opt_host_ms_per_step']:.2f} | {r['fwd_bwd_ms_per_step']:.2f} "
            f"| {'-' if peak is None else f'{peak / 2**30:.2f} GiB'} "
            f"| {r['bytes_per_param']:.2f} | {len(r['collage_warnings'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="train_llama",
        description="Train a Hugging Face Llama with each precision strategy side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=None, help="default: a tenth of --steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="train_llama_out", help="folder for the JSON")
    ap.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="a comma-separated subset of these"
    )
    ap.add_argument(
        "--timing-rounds",
        type=int,
        default=10,
        help="after training, time the strategies side by side: this many rounds of "
        "--timing-steps steps of each in turn (0: time the training steps instead)",
    )
    ap.add_argument("--timing-steps", type=int, default=10)
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="run this many steady steps of each strategy under torch.profiler (untimed) and "
        "print where each region's time went",
    )
    ap.add_argument(
        "--cudagraphs",
        action="store_true",
        help="collage strategies with compile_optimizer(cudagraphs=True): each step after the "
        "third one CUDA graph replay (on a CPU, the compiled graphs called without Dynamo)",
    )
    args = ap.parse_args(argv)
    demo.check_strategies(ap, args.strategies, STRATEGIES)
    return args


def profile_lines(r: dict[str, Any], top: int = 6) -> str:
    """A strategy's profiled steps (``--profile-steps``): per step, each region's host and
    device ms, and the ops with the most host time of their own."""
    p = r["profile"]
    regions = ", ".join(
        f"{k} {v['host_ms']:.2f} ms host / {v['device_ms']:.2f} ms device"
        for k, v in p["regions"].items()
    )
    ops = "; ".join(f"{name} {ms:.2f} ms x{calls:g}" for name, ms, calls in p["top_host"][:top])
    return f"{r['strategy']} profiled ({p['steps']} steps), per step: {regions}\n  host: {ops}"


def _timing_note(s: demo.Settings, args: argparse.Namespace) -> str:
    if args.timing_rounds:
        when = (
            f"measured after training, {args.timing_rounds} rounds of {args.timing_steps} steps "
            "of each strategy in turn; each the 20th percentile"
        )
    else:
        when = "each the 20th percentile of the training steps after the first 3 (which compile)"
    return (
        "step ms: train step (forward, backward, clipping, optimizer); opt ms: the optimizer "
        "step, between two synchronizations; opt host ms: of that, until step() returned (the "
        f"rest is waiting for the device); fwd+bwd ms: the rest; {when}. peak memory: CUDA "
        "only." + (" With so few steps these timings are a smoke test." if s.steps < 50 else "")
    )


def settings(args: argparse.Namespace) -> demo.Settings:
    return demo.Settings.from_args(
        args, schedule="cosine", beta1=0.9, beta2=0.95, metrics=False, compile_forward=False
    )


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every strategy; print the table; returns what the JSON holds."""
    args = parse_args(argv)
    logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(
        lambda r: "Profiler record function" not in r.getMessage()
    )
    s = settings(args)
    train, val, data_desc = demo.load_data(None)
    torch.manual_seed(s.seed)
    init = {k: v.to(torch.bfloat16) for k, v in ByteLlama(s).state_dict().items()}
    n_params = sum(v.numel() for v in init.values())
    header = (
        f"LlamaForCausalLM, {n_params / 1e6:.2f}M params ({s.n_layer} layers x {s.n_embd}, "
        f"{s.n_head} heads, bytes), {s.batch_size}x{s.block_size} tokens a step, {s.steps} "
        f"steps, AdamW lr={s.lr:g} (HF cosine, {s.warmup}-step warmup from 0), betas "
        f"(0.9, 0.95), wd {s.weight_decay:g} on matrices, clip {s.clip:g}; {s.device}, torch "
        f"{torch.__version__}\ndata: {data_desc}"
    )
    print(header, flush=True)
    strategies = [k for k in STRATEGIES if k in args.strategies.split(",")]
    t0 = time.perf_counter()
    runs = []
    for k in strategies:  # each row as it comes: a run stopped at a time limit keeps them
        runs.append(train_one(k, init, train, val, s, args.cudagraphs, demo._progress()))
        print(table([out for out, _ in runs]).splitlines()[-1], flush=True)
    if args.timing_rounds:
        side_by_side(runs, args.timing_rounds, args.timing_steps)
    results = [out for out, _ in runs]
    text = table(results)
    print(f"\n{text}\n{_timing_note(s, args)}", flush=True)
    for r in results:
        if r["profile"] is not None:
            print(profile_lines(r))
        if r["replayed_steps"] is not None:
            print(
                f"{r['strategy']}: {r['replayed_steps']} of {s.steps} optimizer steps replayed whole"
            )
        for w in dict.fromkeys(r["collage_warnings"]):
            print(f"{r['strategy']}: {w}")
    result = demo._finite(
        {
            "settings": dataclasses.asdict(s),
            "cudagraphs": args.cudagraphs,
            "side_by_side": {"rounds": args.timing_rounds, "steps": args.timing_steps},
            "n_params": n_params,
            "torch": torch.__version__,
            "total_s": time.perf_counter() - t0,
            "table": text,
            "results": results,
        }
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_llama.json").write_text(json.dumps(result, indent=1, allow_nan=False))
    print(f"wrote {out / 'train_llama.json'}")
    return result


def main(argv: Sequence[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
