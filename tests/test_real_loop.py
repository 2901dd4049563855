"""The loop users run: schedule, clipping, accumulation, param groups, frozen and tied weights.

One small model with everything a real run has: tied embedding and output head (one
Parameter, so one lo), LayerNorm and biases in a no-weight-decay group, a frozen submodule,
gradient accumulation over two micro-batches, ``zero_grad(set_to_none=False)``, gradient
clipping (by norm or by value), and a warmup + cosine ``LambdaLR`` from lr = 0 stepped every
step.  Trained with only ``opt.step`` compiled (:func:`collage_compile.compile_optimizer`)
and with the whole step compiled, and against it the same loop in float64 and in plain
bf16 (eager), from the same start on the same batches.  Asserted: collage's ``value()``
tracks float64 within 3 % of the movement, plain bf16 is far off, the frozen weights are
bit-identical, the tied weight has one lo, the step compiled at most twice, no
CollageWarning.  A second loop does the same in fp16 with dynamic loss scaling
(:class:`collage_compile.GradScaler`), skipped steps included.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import relative_error

import collage_compile
from collage_compile import _compat, report, state

STEPS = 30
WARMUP = 5
VOCAB, D = 32, 32


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, D)
        self.frozen = torch.nn.Linear(D, D)  # e.g. a pretrained adapter base
        self.frozen.requires_grad_(False)
        self.ln = torch.nn.LayerNorm(D)
        self.fc = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        h = h + torch.tanh(self.frozen(h))
        h = h + F.gelu(self.fc(self.ln(h)))
        return self.head(h)


def _schedule(step: int) -> float:
    if step < WARMUP:
        return step / WARMUP  # from exactly 0, as Hugging Face's warmups
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, VOCAB, (4, 8), generator=g) for _ in range(2)] for _ in range(STEPS)]


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-4},
    ]


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-4)


def _sgd(groups):
    return torch.optim.SGD(groups, lr=1e-4, momentum=0.9, nesterov=True)


def train(base, dtype, compiled, clip, scaler=None, skip=(), make_opt=_adamw):
    """STEPS steps of the full loop; ``compiled``: None (eager), "step" or "whole".  At the
    steps in ``skip`` the optimizer step is skipped: by Inf gradients the scaler finds, or
    (no scaler) by not calling it.  Returns (model, graphs the backend compiled)."""
    model = copy.deepcopy(base).to(dtype)
    opt = make_opt(_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    if compiled == "step":
        collage_compile.compile_optimizer(opt)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_of(x):
        logits = model(x[:, :-1]).float()
        return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()) / 2

    def clip_grads():
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            torch.nn.utils.clip_grad_value_(params, 0.05)

    def train_step(batch, skipped):
        for x in batch:  # gradient accumulation over two micro-batches
            loss = loss_of(x)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
            clip_grads()
            scaler.step(opt)
            scaler.update()
        else:
            clip_grads()
            if not skipped:
                opt.step()
        opt.zero_grad(set_to_none=False)

    step = train_step
    if compiled == "whole":
        step = torch.compile(train_step, backend=collage_compile.backend)
    # the id of the last graph compiled so far (the report log keeps the latest 256, so
    # its length stops growing in a long session)
    last = max((r.graph_id for r in report.reports()), default=0)
    for k, batch in enumerate(_batches()):
        hook = None
        if k in skip and scaler is not None:
            hook = params[-1].register_hook(lambda g: torch.full_like(g, float("inf")))
        step(batch, k in skip)
        if hook is not None:
            hook.remove()
        sched.step()
    return model, sum(r.graph_id > last for r in report.reports())


def _flat(model, value=True):
    return torch.cat(
        [
            (collage_compile.value(p) if value else p.detach()).double().flatten()
            for p in model.parameters()
            if p.requires_grad
        ]
    )


@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("compiled", ["step", "whole"])
def test_the_full_loop_tracks_float64(compiled, clip):
    torch.manual_seed(0)
    base = Tiny().to(torch.bfloat16)  # the start every run shares, bf16 values
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        model, frames = train(base, torch.bfloat16, compiled, clip)
    ref, _ = train(base, torch.float64, None, clip)
    plain, _ = train(base, torch.bfloat16, None, clip)
    start = _flat(base, value=False)
    err = relative_error(_flat(model), _flat(ref, value=False), start)
    plain_err = relative_error(_flat(plain, value=False), _flat(ref, value=False), start)
    print(f"{compiled:5s} clip={clip}: compiles {frames}  collage {err:.2e}  plain {plain_err:.2f}")
    assert err <= 0.03
    assert plain_err >= max(0.5, 10 * err)
    assert torch.equal(model.frozen.weight, base.frozen.weight)
    assert state.get_lo(model.frozen.weight) is None
    assert model.head.weight is model.emb.weight and state.get_lo(model.emb.weight) is not None
    # the optimizer's graph once, its scheduled lr an input from the first step (a constant
    # there, then an input again, was 2 graphs: compile_optimizer tells Dynamo beforehand,
    # the backend sends a whole step back to be traced again); the whole step adds the
    # forward/backward pieces around its graph breaks (4 before the backend did so)
    assert frames == (1 if compiled == "step" else 3)


@pytest.mark.parametrize("compiled", ["step", "whole"])
def test_fp16_weights_with_dynamic_loss_scaling(compiled):
    """fp16 weights, fp16 gradients: torch.amp.GradScaler refuses to unscale them;
    collage_compile.GradScaler does, and skips the steps with Inf gradients as torch's does.
    SGD with Nesterov momentum: Adam's second moment of fp16 gradients underflows (g^2 below
    6e-8 is 0 in fp16, and its default eps 1e-8 is 0 too), which no pair of the weights
    changes."""
    torch.manual_seed(0)
    base = Tiny().to(torch.float16)
    scaler = collage_compile.GradScaler("cpu", init_scale=2.0**10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        model, _ = train(
            base, torch.float16, compiled, "norm", scaler=scaler, skip=(7,), make_opt=_sgd
        )
    assert scaler.get_scale() < 2.0**10  # the Inf step was seen and skipped
    ref, _ = train(base, torch.float64, None, "norm", skip=(7,), make_opt=_sgd)
    plain_scaler = collage_compile.GradScaler("cpu", init_scale=2.0**10)
    plain, _ = train(
        base, torch.float16, None, "norm", scaler=plain_scaler, skip=(7,), make_opt=_sgd
    )
    start, target = _flat(base, value=False), _flat(ref, value=False)
    err = relative_error(_flat(model), target, start)
    plain_err = relative_error(_flat(plain, value=False), target, start)
    print(f"fp16 + GradScaler, {compiled}: collage {err:.2e}  plain fp16 {plain_err:.2f}")
    assert err <= 0.03
    assert plain_err >= max(0.5, 10 * err)
    half = Tiny().half()
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.scale(half(_batches()[0][0]).float().sum()).backward()
    with pytest.raises(ValueError, match="unscale FP16 gradients"):
        torch_scaler.unscale_(torch.optim.SGD(half.parameters(), lr=1e-4))


def _per_parameter(dtype=torch.bfloat16, device="cpu", compile=None, attach=False, schedule=True):
    """Five Linear layers (10 parameters, more than Dynamo's recompile limit of 8), one
    AdamW per parameter stepped in its gradient hook as torchtune's ``optimizer_in_bwd``
    does, each with the warmup + cosine schedule (``schedule``); ``compile``: the options
    of ``compile_optimizer`` for every optimizer, None for eager; ``attach``: every
    optimizer and the model.  Returns (model, param -> optimizer, schedules, hooks)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(5)]
    model = torch.nn.Sequential(*layers).bfloat16().to(device, dtype)  # one start for all
    params = list(model.parameters())
    opts = {p: torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1) for p in params}
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _schedule) for o in opts.values() if schedule]
    for opt in opts.values():
        if compile is not None:
            collage_compile.compile_optimizer(opt, **compile)
        if attach:
            collage_compile.attach(opt)
    if attach:
        collage_compile.attach(model)

    def hook(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    return model, opts, scheds, handles


def _train_in_backward(model, steps, g, scheds=(), reset_at=None):
    """``steps`` backward passes on a fixed stream of gradients: the loss is linear in the
    weights, so every run, float64 included, gets the same gradients."""
    params = list(model.parameters())
    for i in range(steps):
        if i == reset_at:
            torch._dynamo.reset()  # every graph discarded: each optimizer compiles again
        grads = [(1e-2 * torch.randn(p.shape, generator=g)).bfloat16().to(p) for p in params]
        sum((p * gr).sum() for p, gr in zip(params, grads)).backward()
        for s in scheds:
            s.step()


def _unhook(handles):
    # the hooks hold the parameters in a cycle: torch 2.11 segfaulted collecting such a dead
    # model while a later run's backward compiled (a user keeps one model and its hooks)
    for h in handles:
        h.remove()


def _in_backward(dtype, compiled, cudagraphs=False, device="cpu", reset_at=None):
    """:func:`_per_parameter` trained for STEPS steps: (start, values, optimizers)."""
    options = {"cudagraphs": cudagraphs} if compiled else None
    model, opts, scheds, handles = _per_parameter(dtype, device, options)
    start = [p.detach().double().clone() for p in model.parameters()]
    _train_in_backward(model, STEPS, torch.Generator().manual_seed(1), scheds, reset_at)
    _unhook(handles)
    return start, [collage_compile.value(p).double() for p in model.parameters()], opts


@pytest.mark.parametrize(
    "device, cudagraphs",
    [
        ("cpu", False),
        ("cpu", True),
        pytest.param(
            "cuda",
            True,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
    ids=["compiled", "replayed", "cuda-replayed"],
)
def test_one_optimizer_per_parameter_stepped_in_backward_is_compensated(device, cudagraphs):
    """Optimizer in backward compiles one optimizer per parameter, all running torch.optim's
    shared step code, where Dynamo guards each by identity: past its recompile limit (8)
    the rest stepped eagerly, in plain bf16 (named, not compensated).  ``compile_optimizer``
    leaves room under the limit for the optimizers it compiled while one of them steps
    (``optim._room``): all ten compile once and stay compensated, with no warning, also
    when ``torch._dynamo.reset()`` halfway discards their graphs and all compile again.
    ``replayed``: with ``cudagraphs=True`` each step after the second is a replay of the
    recorded graphs (on a CPU, called without Dynamo, whose guards check every optimizer's
    graphs in turn; on CUDA, each a CUDA graph captured and replayed inside backward, on
    autograd's device thread)."""
    torch._dynamo.reset()
    if _compat.compiling_in_backward_crashes():  # torch 2.11: refused, not a segfault
        with pytest.raises(RuntimeError, match="inside backward can crash"):
            _in_backward(torch.bfloat16, compiled=True, cudagraphs=cudagraphs, device=device)
        return
    start, ref, _ = _in_backward(torch.float64, compiled=False, device=device)
    _, plain, _ = _in_backward(torch.bfloat16, compiled=False, device=device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _, collage, opts = _in_backward(
            torch.bfloat16,
            compiled=True,
            cudagraphs=cudagraphs,
            device=device,
            reset_at=None if cudagraphs else STEPS // 2,
        )
    assert not [
        str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)
    ]
    assert all(state.get_lo(p) is not None for p in opts)
    if cudagraphs:
        assert [o.step.whole_step.replays for o in opts.values()] == [STEPS - 2] * len(opts)
    err = max(relative_error(c, r, s) for c, r, s in zip(collage, ref, start))
    err_plain = max(relative_error(c, r, s) for c, r, s in zip(plain, ref, start))
    print(
        f"optimizer in backward, 10 AdamW, {device}: collage {err:.3g}, plain bf16 {err_plain:.3g}"
    )
    assert err < 1e-2 and err_plain > 0.3, (err, err_plain)


def test_optimizer_in_backward_resumes_bit_for_bit_from_a_checkpoint():
    """torchtune saves the per-parameter optimizers of optimizer in backward as one state
    dict each.  With every optimizer and the model attached, a run saved at step 10 of 20
    (torch.save) and loaded into new optimizers ends where the uninterrupted run ends, bit
    for bit (hi and lo of every weight), with no CollageWarning."""
    if _compat.compiling_in_backward_crashes():
        pytest.skip("torch 2.11 refuses a compile inside backward")
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        kw = {"compile": {}, "attach": True, "schedule": False}
        model, _, _, handles = _per_parameter(**kw)
        _train_in_backward(model, 20, torch.Generator().manual_seed(1))
        full = [(p.detach().clone(), state.get_lo(p).clone()) for p in model.parameters()]
        _unhook(handles)
        model, opts, _, handles = _per_parameter(**kw)
        g = torch.Generator().manual_seed(1)
        _train_in_backward(model, 10, g)
        buf = io.BytesIO()
        torch.save(
            {"model": model.state_dict(), "opts": [o.state_dict() for o in opts.values()]}, buf
        )
        _unhook(handles)
        model, opts, _, handles = _per_parameter(**kw)
        buf.seek(0)
        saved = torch.load(buf)
        model.load_state_dict(saved["model"])
        for opt, sd in zip(opts.values(), saved["opts"]):
            opt.load_state_dict(sd)
        _train_in_backward(model, 10, g)
        _unhook(handles)
    assert not [
        str(w.message) for w in rec if issubclass(w.category, collage_compile.CollageWarning)
    ]
    resumed = [(p.detach(), state.get_lo(p)) for p in model.parameters()]
    assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(full, resumed))
    # and the run it equals is compensated: float64 and plain bf16 on the same stream
    runs = {}
    for dtype in (torch.float64, torch.bfloat16):
        ref_model, _, _, handles = _per_parameter(dtype, schedule=False)
        start = [p.detach().double().clone() for p in ref_model.parameters()]
        _train_in_backward(ref_model, 20, torch.Generator().manual_seed(1))
        _unhook(handles)
        runs[dtype] = [p.detach().double() for p in ref_model.parameters()]
    ref = runs[torch.float64]
    err = max(
        relative_error(h.double() + lo.double(), r, s) for (h, lo), r, s in zip(full, ref, start)
    )
    err_plain = max(relative_error(w, r, s) for w, r, s in zip(runs[torch.bfloat16], ref, start))
    assert err < 1e-2 and err_plain > 0.3, (err, err_plain)
