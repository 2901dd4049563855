"""The whole optimizer step as one replay (``compile_optimizer(opt, cudagraphs=True)``).

On a CPU a replay calls the recorded graphs directly, without Dynamo; on CUDA it launches
one CUDA graph.  Everything but the launch is the same code: what a replay checks, what
it refreshes (scheduled floats, new gradients) and what it does after.  So these tests
run where CI runs, against the compiled step the replay stands in for, bit for bit; the
CUDA test at the end runs on a GPU.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import drifting_stream, mcf_value, relative_error
from user_optimizers import Lion

import collage_compile

Warning = collage_compile.CollageWarning
STEPS = 30
# a test run on a CPU, and on CUDA where there is a GPU (its CUDA graph replay)
ON_CPU_AND_CUDA = pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="CUDA graphs need a GPU"
            ),
        ),
    ],
)


def _train(
    start,
    grads,
    dtype,
    events=None,
    optimizer=torch.optim.AdamW,
    capturable=False,
    foreach=True,
    schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, i / 10)),
    **options,
):
    """Two param groups (decay on the matrix only) under a warmup from lr = 0, a new float
    lr per group every step, ``zero_grad()`` (set_to_none) and new gradient tensors every
    step, as a training loop makes them; ``events[i](ps, opt)`` runs before step ``i``.
    ``options``: None for eager, else those of ``compile_optimizer``; ``schedule(opt)``
    the scheduler.  Returns the weights and the optimizer."""
    ps = [torch.nn.Parameter(t.to(dtype, copy=True)) for t in start]
    groups = [{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}]
    opt = optimizer(groups, lr=1e-3, weight_decay=0.1, foreach=foreach, capturable=capturable)
    if options.get("compiled", True):
        options.pop("compiled", None)
        collage_compile.compile_optimizer(opt, **options)
    sched = schedule(opt)
    for i, gs in enumerate(grads):
        opt.zero_grad()
        for p, gr in zip(ps, gs):
            p.grad = gr.to(dtype)
        if events and i in events:
            events[i](ps, opt)
        opt.step()
        sched.step()
    return ps, opt


def _compiled_and_replayed(start, grads, events=None):
    """The same bf16 stream compiled and replayed: ``{False: (weights, optimizer), True:
    ...}``, and the messages of the warnings each run gave."""
    runs, said = {}, {}
    for whole in (False, True):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            runs[whole] = _train(start, grads, torch.bfloat16, events, cudagraphs=whole)
        said[whole] = [str(w.message) for w in rec]
    return runs, said


def _same_bits(compiled, replayed):
    """The replayed weights and their pairs (or remainders) are the compiled step's."""
    for c, r in zip(compiled, replayed):
        assert torch.equal(c, r)
        assert torch.equal(mcf_value(c), mcf_value(r))


def _errors(replayed, ref, plain, start):
    """The largest error against float64 of the replayed run and of plain bf16."""
    err = max(relative_error(mcf_value(r), q, s) for r, q, s in zip(replayed, ref, start))
    err_plain = max(relative_error(p, q, s) for p, q, s in zip(plain, ref, start))
    return err, err_plain


# how the step is built: the optimizer's flags and compile_optimizer's options
REPLAYED = {
    "cpu-path": {},
    # the step Dynamo compiles on CUDA (it sets the flag there): step counts in tensors
    "cuda-path": {"capturable": True},
    # the single-tensor step reads the lr as tensor arithmetic (lr / bias_correction1)
    "single-tensor": {"capturable": True, "foreach": False},
    # exact mode: the optimizer's own ops on fp32 values, the lr through passes.scalars
    "exact": {"capturable": True, "mode": "exact"},
}


@pytest.mark.parametrize("case", list(REPLAYED))
def test_a_replayed_step_is_the_compiled_step_bit_for_bit_under_a_schedule(case):
    """After one step that compiles and one that is recorded, every step is a replay
    (no Dynamo, no guard): the lr a scheduler sets per group reaches it, the new gradient
    tensors of each step are copied into the replay's own, and the weights and their
    pairs (exact mode: remainders) are those of the compiled step, bit for bit: 0.27 %
    from the float64 run, where plain bf16 is 93 % off (``-s`` prints them)."""
    options = REPLAYED[case]
    start, grads = drifting_stream([(16, 8), (8,)], STEPS)
    ref, _ = _train(start, grads, torch.float64, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    compiled, _ = _train(start, grads, torch.bfloat16, **options)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        replayed, opt = _train(start, grads, torch.bfloat16, cudagraphs=True, **options)
    assert not [w for w in rec if issubclass(w.category, Warning)], [str(w.message) for w in rec]
    whole = opt.step.whole_step
    assert whole.refused is None
    assert whole.replays == STEPS - 2
    _same_bits(compiled, replayed)
    err, err_plain = _errors(replayed, ref, plain, start)
    print(f"replayed {err:.2%} from float64, plain bf16 {err_plain:.2%} ({case})")
    assert err < 3e-3, err
    assert err_plain > 30 * err, (err_plain, err)


def _exact_runs(device):
    """Exact mode, compiled and replayed, and the same stock AdamW on fp32 weights fed the
    same (bf16) gradients under the same warmup from lr = 0, compiled by
    ``compile_optimizer`` too (its graph keeps the lr a tensor, as exact mode's does):
    their fp32 weights, and the stream's start and gradients."""
    start, grads = drifting_stream([(64, 32), (32,), (32, 32)], 12)
    start = [t.to(device) for t in start]
    grads = [[g.to(device) for g in gs] for gs in grads]
    fp32, _ = _train(start, grads, torch.float32)
    torch._dynamo.reset()
    compiled, _ = _train(start, grads, torch.bfloat16, mode="exact")
    torch._dynamo.reset()
    replayed, opt = _train(start, grads, torch.bfloat16, mode="exact", cudagraphs=True)
    whole = opt.step.whole_step
    assert whole.refused is None, whole.capture_error or whole.refused
    assert whole.replays >= 12 - 3, whole.replays
    values = [[collage_compile.value(p) for p in ps] for ps in (compiled, replayed)]
    return start, grads, [p.detach() for p in fp32], *values


def _values_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def ulps(a, b):
    """How many fp32 ulps apart two fp32 tensors are at most, and at how many elements
    (each pair of values of one sign: their bit patterns' distance)."""
    d = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
    return int(d.max()), int((d > 0).sum())


@ON_CPU_AND_CUDA
def test_a_replay_never_writes_a_gradient_the_user_holds(device):
    """Each step's gradients here are the stream's own tensors (``p.grad = g``), held by
    the test after the step, as a user holds a gradient kept for logging or a buffer of
    their own.  The replay used to write each new step's gradients into the ones its
    recorded step read: the first GPU run found that step's held gradients overwritten,
    and a float64 run computed from the stream afterwards 10 % off.  Now the stream is
    unchanged, the replayed weights are the compiled step's bit for bit, and float64
    computed from the stream after them agrees (plain bf16 far off)."""
    start, grads = drifting_stream([(64, 32), (32,)], STEPS)
    start = [t.to(device) for t in start]
    grads = [[g.to(device) for g in gs] for gs in grads]
    held = copy.deepcopy(grads)
    torch._dynamo.reset()
    compiled, _ = _train(start, grads, torch.bfloat16)
    torch._dynamo.reset()
    replayed, opt = _train(start, grads, torch.bfloat16, cudagraphs=True)
    assert opt.step.whole_step.replays >= STEPS - 3, opt.step.whole_step.replays
    changed = [
        (i, j)
        for i, (gs, hs) in enumerate(zip(grads, held))
        for j, (g, h) in enumerate(zip(gs, hs))
        if not torch.equal(g, h)
    ]
    assert not changed, f"gradients (step, tensor) written by the replay: {changed}"
    _same_bits(compiled, replayed)
    ref, _ = _train(start, grads, torch.float64, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    err, err_plain = _errors(replayed, ref, plain, start)
    assert err < 3e-3 and err_plain > 30 * err, (err, err_plain)


def test_a_gradient_laid_out_otherwise_is_read_by_its_values():
    """A gradient of the recorded shape but other strides (a matrix's gradient stored
    column-major every other step).  Dynamo does not guard an optimizer's gradients and the
    backend turns off Inductor's input asserts, so the compiled step read it in the layout
    it was compiled for: 0.71 from float64, where plain bf16 is 0.90 off, and no word.
    Now the wrapper compares the strides and copies such a gradient into the compiled
    layout, said once; the replay copies it into its own by value.  Compiled and replayed
    track float64 and are the same bit for bit."""
    start, grads = drifting_stream([(64, 32), (32,)], STEPS)
    for gs in grads[1::2]:
        gs[0] = gs[0].t().contiguous().t()
    assert grads[1][0].stride() == (1, 64)
    ref, _ = _train(start, grads, torch.float64, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        compiled, _ = _train(start, grads, torch.bfloat16)
    said = [str(w.message) for w in rec if "arrived with strides (1, 64)" in str(w.message)]
    assert len(said) == 1 and "['params'][0].grad" in said[0], said
    err, err_plain = _errors(compiled, ref, plain, start)
    assert err < 3e-3 and err_plain > 30 * err, (err, err_plain)
    torch._dynamo.reset()
    replayed, opt = _train(start, grads, torch.bfloat16, cudagraphs=True)
    assert opt.step.whole_step.replays >= STEPS - 4, opt.step.whole_step.replays
    _same_bits(compiled, replayed)


def test_a_gradient_that_turns_fp32_is_rounded_and_named_never_read_as_bf16():
    """``p.grad_dtype`` set mid-run (to None: any dtype): a bf16 parameter's gradient
    arrives in fp32.  Dynamo does not guard it, and the compiled step read its bytes as
    bf16, with no word.  The wrapper now rounds it to the dtype compiled for and says so
    once per gradient; the replay gives way to that call, then replays the step recorded
    with fp32 gradients.  Both are the run fed the same gradients in bf16 (exact in either
    dtype), bit for bit, and track float64 where plain bf16 does not (0.23 % against 90 %,
    ``-s`` prints them)."""
    start, grads = drifting_stream([(64, 32), (32,)], 16)

    def fp32_grads(ps, opt):
        for p in ps:
            g, p.grad = p.grad, None
            p.grad_dtype = None  # any dtype (torch's opt-in to diverging gradients)
            p.grad = g.float()

    events = {i: fp32_grads for i in range(8, 16)}
    bf16, _ = _train(start, grads, torch.bfloat16)
    runs, said = _compiled_and_replayed(start, grads, events)
    for whole in (False, True):
        fp32 = [m for m in said[whole] if "arrived as torch.float32" in m]
        assert len(fp32) == 2 and "rounded to torch.bfloat16" in fp32[0], fp32
        _same_bits(bf16, runs[whole][0])
    ref, _ = _train(start, grads, torch.float64, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    err, err_plain = _errors(runs[True][0], ref, plain, start)
    print(f"fp32 gradients replayed: {err:.2%} from float64, plain bf16 {err_plain:.2%}")
    assert err < 3e-3 and err_plain > 10 * err, (err, err_plain)
    assert runs[True][0][0].grad.dtype == torch.float32
    whole = runs[True][1].step.whole_step
    assert whole.given_way == ["a gradient's dtype changed"], whole.given_way
    assert whole.replays >= 16 - 5, whole.replays


def test_a_list_setting_changed_in_place_is_seen():
    """A hyperparameter held in a list (``group["betas"] = [0.9, 0.999]``) and changed in
    place is the same object: the replay compares its elements, as Dynamo's guards do, and
    gives way; the weights are the compiled step's, bit for bit, and track float64 where
    plain bf16 does not."""
    start, grads = drifting_stream([(16, 8), (8,)], 16)

    def as_list(ps, opt):
        opt.param_groups[0]["betas"] = [0.9, 0.999]

    def in_place(ps, opt):
        opt.param_groups[0]["betas"][0] = 0.5

    events = {2: as_list, 9: in_place}
    runs, _ = _compiled_and_replayed(start, grads, events)
    _same_bits(runs[False][0], runs[True][0])
    ref, _ = _train(start, grads, torch.float64, events, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, events, compiled=False)
    err, err_plain = _errors(runs[True][0], ref, plain, start)
    print(
        f"a list setting changed in place, replayed: {err:.2%} from float64, plain {err_plain:.2%}"
    )
    assert err < 3e-3 and err_plain > 10 * err, (err, err_plain)
    given_way = runs[True][1].step.whole_step.given_way
    assert given_way.count("a hyperparameter changed") == 2, given_way


def test_a_replay_follows_the_global_state_dynamo_guards():
    """Muon's Newton-Schulz matmuls under ``autocast`` from the sixth step on: Dynamo
    guards the global state and recompiles; the replay compares it too (autocast, grad
    mode, matmul precision, torch function modes) and gives way, then replays the step
    recorded under autocast.  The weights are the compiled step's, bit for bit."""
    start, grads = drifting_stream([(32, 16)], 12)
    runs = {}
    for whole in (False, True):
        torch._dynamo.reset()
        ps = [torch.nn.Parameter(t.clone()) for t in start]  # bf16 already: a copy
        opt = torch.optim.Muon(ps, lr=2e-2)
        collage_compile.compile_optimizer(opt, cudagraphs=whole)
        for i, gs in enumerate(grads):
            ps[0].grad = gs[0].bfloat16()
            with torch.autocast("cpu", dtype=torch.float16, enabled=i >= 6):
                opt.step()
        runs[whole] = ps, opt
    _same_bits(runs[False][0], runs[True][0])
    whole = runs[True][1].step.whole_step
    assert any("global state" in why for why in whole.given_way), whole.given_way
    assert whole.replays >= len(grads) - 5, whole.replays


def test_a_graph_called_twice_in_one_step_with_scheduled_floats_is_refused():
    """A replay fills each float a graph reads once (its own tensor); a step that called
    one such graph twice (once per param group, were its groups split by a graph break)
    would read the last value twice.  Built from a real recorded step with its call
    repeated, the plan is refused."""
    from collage_compile import replay

    start, grads = drifting_stream([(16, 8), (8,)], 3)
    _, opt = _train(start, grads, torch.bfloat16, cudagraphs=True)
    plan = opt.step.whole_step.plan
    calls = [(w, list(inputs), []) for w, inputs in zip(plan.wrappers, [c[1] for c in plan.calls])]
    with pytest.raises(replay._Refused, match="called twice"):
        replay._Plan(opt, calls + calls[:1])


@ON_CPU_AND_CUDA
def test_a_weight_saved_for_backward_and_stepped_since_is_named_by_autograd(device):
    """``loss = f(W)``, ``opt.step()``, then ``loss.backward()``: the step wrote W in place,
    and autograd raises ("modified by an inplace operation") because the compiled step's
    wrapper bumped W's version.  A CUDA graph's replay runs no host code: the replay bumps
    the versions the captured step bumped, so the error stays, at every step.  (On a CPU a
    replay calls the compiled graphs, which bump the versions themselves: that case pins
    the behaviour the CUDA replay must keep.)"""
    w = torch.nn.Parameter(torch.randn(64, 32, device=device).bfloat16())
    opt = torch.optim.AdamW([w], lr=1e-3, foreach=True)
    collage_compile.compile_optimizer(opt, cudagraphs=True)
    for _ in range(8):
        loss = (w * w).float().sum()  # mul saves w for its backward
        w.grad = torch.randn_like(w)
        before = w._version
        opt.step()
        assert w._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert opt.step.whole_step.replays >= 8 - 4, opt.step.whole_step.replays


def _muon_runs(dtype=torch.bfloat16, **options):
    """torch.optim.Muon on a wide and a tall matrix under a warmup, in ``dtype``, compiled
    by ``compile_optimizer(**options)`` (``compiled=False``: eager); its start, weights,
    optimizer and CollageWarnings."""
    start, grads = drifting_stream([(32, 64), (64, 32)], 12)
    ps = [torch.nn.Parameter(t.to(dtype)) for t in start]
    opt = torch.optim.Muon(ps, lr=1e-3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if options.get("compiled", True):
            collage_compile.compile_optimizer(opt, **options)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 5))
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = 0.01 * g.to(dtype)
            opt.step()
            sched.step()
    return start, ps, opt, [str(w.message) for w in rec if issubclass(w.category, Warning)]


def test_muon_is_replayed_too():
    """Muon's class says it lives in ``torch.optim`` itself (AdamW's in
    ``torch.optim.adamw``), and the replay refused it as "not one of torch.optim's
    optimizers", falsely.  Replayed, it is the compiled step bit for bit, and nearer a
    float64 run than plain bf16 by far (Muon's Newton-Schulz runs in bf16 whatever the
    weights, so the float64 run's updates differ by that rounding: ``-s`` prints them)."""
    start, ref, _, _ = _muon_runs(torch.float64, compiled=False)
    _, plain, _, _ = _muon_runs(compiled=False)
    torch._dynamo.reset()
    _, compiled, _, _ = _muon_runs()
    torch._dynamo.reset()
    _, replayed, opt, said = _muon_runs(cudagraphs=True)
    assert not said, said
    assert opt.step.whole_step.replays == 12 - 2
    _same_bits(compiled, replayed)
    err, err_plain = _errors(replayed, ref, plain, start)
    print(f"Muon replayed {err:.2%} from float64, plain bf16 {err_plain:.2%}")
    assert err < 0.02 and err_plain > 10 * err, (err, err_plain)


def test_a_replayed_exact_step_is_the_fp32_step_bit_for_bit():
    """``mode="exact"`` promises the fp32 step's weights (docs/numerics.md; the fp32
    weights here never sat on a bf16 tie, where a remainder cannot follow): replayed, too."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Warning)  # the fp32 one: nothing to compensate
        _, _, fp32, compiled, replayed = _exact_runs("cpu")
    assert _values_equal(compiled, fp32) and _values_equal(replayed, fp32)


def _rewind(snapshot):
    def event(ps, opt):
        opt.load_state_dict(snapshot[0])

    return event


def _keep(snapshot):
    def event(ps, opt):
        snapshot.append(copy.deepcopy(opt.state_dict()))

    return event


def _decay(ps, opt):
    opt.param_groups[0]["weight_decay"] = 0.05


def _outside_write(ps, opt):
    with torch.no_grad():
        ps[0].mul_(0.5)


def _no_grad(ps, opt):
    ps[1].grad = None


def _state_moved_back(ps, opt, away="cpu"):
    """The ``optimizer_to(device)`` helper users copy: each state tensor moved by ``v.data
    = v.data.to(...)``, off the device and back (on a CPU: a copy), so the same tensors sit
    on new storages.  The old storages are held until all moved: CUDA's caching allocator
    would otherwise hand each its old block back (the same address, which a replay reads
    right)."""
    held = []
    for st in opt.state.values():
        for v in st.values():
            held.append(v.data)
            if away == v.device.type:
                v.data = v.data.clone()
            else:
                device = v.device
                v.data = v.data.to(away)
                v.data = v.data.to(device)


def test_a_replay_gives_way_to_the_compiled_step_whenever_that_step_would_differ(monkeypatch):
    """What Dynamo would recompile for (a hyperparameter set by hand, a gradient that is
    None), what replaces the optimizer's state (``load_state_dict``), a state moved to
    new storage (which a CUDA graph would read at the old address) and a write to a
    weight outside the step (which the compiled step's wrapper names and answers by
    restarting that weight's lo) each make the next step run compiled, then be recorded
    and replayed again: the weights are those of the compiled step under the same events,
    bit for bit, and the outside write is named in both runs.  Each event costs at most
    one step that differs from the one recorded before it, so a replay that keeps giving
    way is not named even at 2 such steps in a row (``replay.MISSED``)."""
    from collage_compile import replay

    monkeypatch.setattr(replay, "MISSED", 2)
    start, grads = drifting_stream([(16, 8), (8,)], 24)
    runs = {}
    for whole in (False, True):
        torch._dynamo.reset()
        kept: list = []
        events = {4: _keep(kept), 7: _decay, 11: _rewind(kept), 15: _outside_write}
        events.update({19: _no_grad, 22: _state_moved_back})
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            runs[whole] = _train(start, grads, torch.bfloat16, events, cudagraphs=whole)
        named = [str(w.message) for w in rec if issubclass(w.category, Warning)]
        assert any("outside" in m for m in named), named
        assert not any("not replayed" in m or "ran compiled" in m for m in named), named
    (compiled, _), (replayed, opt) = runs[False], runs[True]
    _same_bits(compiled, replayed)
    whole = opt.step.whole_step
    reasons = " | ".join(whole.given_way)
    for why in ("hyperparameter", "state", "outside", "gradient", "new storage"):
        assert why in reasons, reasons
    # each event costs a compiled call and a recorded one, a recompile one more
    assert whole.replays >= 24 - 2 - 3 * len(whole.given_way), (whole.replays, reasons)


def _one_cycle(opt):
    # moves lr and momentum every step (cycle_momentum), as users run it
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)


def _sgd(groups, capturable, **kwargs):
    return torch.optim.SGD(groups, momentum=0.9, **kwargs)


def _no_momentum(ps, opt):
    opt.param_groups[0]["momentum"] = 0.0  # for this step: OneCycleLR sets it after


def test_a_replay_checks_what_the_compile_guards_on_a_scheduled_float():
    """OneCycleLR moves SGD's momentum every step, and the graph reads it from a tensor the
    replay fills; its compile guards on it (``if momentum != 0`` in torch's SGD).  A
    replay checks that guard as Dynamo would: momentum 0 for one step fails it, that step
    runs compiled (Dynamo compiles the other branch), and replays resume; the weights
    and pairs are the compiled step's under the same events, bit for bit, and track
    float64 where plain bf16 does not.  (SGD in two param groups under OneCycleLR crashed
    in its first compiled step, ``SpeculationLogDivergence``, until the backend cleared
    the log before the tensorification's restart: ``_compat.before_float_restart``.)"""
    start, grads = drifting_stream([(16, 8), (8,)], 16)
    events = {9: _no_momentum}
    runs = {}
    for name, options in [("ref", {"compiled": False}), ("plain", {"compiled": False})]:
        dtype = torch.float64 if name == "ref" else torch.bfloat16
        runs[name], _ = _train(start, grads, dtype, events, _sgd, schedule=_one_cycle, **options)
    # as on a first run: the tensorification runs (a cache hit skips it)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        warnings.catch_warnings(record=True) as rec,
    ):
        warnings.simplefilter("always")
        compiled, _ = _train(start, grads, torch.bfloat16, events, _sgd, schedule=_one_cycle)
        torch._dynamo.reset()
        replayed, opt = _train(
            start, grads, torch.bfloat16, events, _sgd, schedule=_one_cycle, cudagraphs=True
        )
    assert not [w for w in rec if issubclass(w.category, Warning)], [str(w.message) for w in rec]
    whole = opt.step.whole_step
    assert whole.refused is None
    assert any("fails a guard" in why for why in whole.given_way), whole.given_way
    assert whole.replays >= 16 - 3 - 4, whole.replays
    _same_bits(compiled, replayed)
    ref, plain = runs["ref"], runs["plain"]
    err, err_plain = _errors(replayed, ref, plain, start)
    print(f"replayed {err:.2%} from float64, plain bf16 {err_plain:.2%}, {whole.given_way}")
    assert err_plain > 10 * err, (err_plain, err)


def test_a_replay_that_keeps_giving_way_is_named_once():
    """A loop where every step differs from the one before it (here one parameter gets a
    gradient every other step) never replays: after ``replay.MISSED`` such steps one
    CollageWarning says so and why, and every step is the compiled one, bit for bit."""
    from collage_compile import replay

    steps = replay.MISSED + 6
    start, grads = drifting_stream([(16, 8), (8,)], steps)
    events = {i: _no_grad for i in range(1, steps, 2)}
    runs, said = _compiled_and_replayed(start, grads, events)
    named = [m for m in said[True] if f"last {replay.MISSED} steps ran compiled" in m]
    assert len(named) == 1 and "gradient appeared or went" in named[0], named
    (compiled, _), (replayed, opt) = runs[False], runs[True]
    assert opt.step.whole_step.replays == 0
    _same_bits(compiled, replayed)
    # and compensated: float64 tracked far closer than plain bf16 on the same stream
    ref, _ = _train(start, grads, torch.float64, events, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, events, compiled=False)
    err, err_plain = _errors(replayed, ref, plain, start)
    assert err_plain > 10 * err, (err_plain, err)


class _OwnAdamW(torch.optim.AdamW):
    """A user's subclass: its step may keep Python state a replay would not update."""


@pytest.mark.parametrize(
    "case",
    ["metrics", "hook", "not torch.optim"],
)
def test_a_step_that_cannot_be_replayed_is_named_once_and_runs_compiled(case):
    """Metrics returned per call, a step hook (Python a replay would skip) and an
    optimizer class outside torch.optim each get one CollageWarning naming why, and the
    step runs compiled every time: the same weights as without ``cudagraphs``."""
    start, grads = drifting_stream([(16, 8), (8,)], 6)
    options = {"metrics": True} if case == "metrics" else {}
    optimizer = _OwnAdamW if case == "not torch.optim" else torch.optim.AdamW
    calls = []

    def hooked(ps, opt):
        opt.register_step_post_hook(lambda *a: calls.append(1))

    events = {0: hooked} if case == "hook" else None
    expected, _ = _train(start, grads, torch.bfloat16, events, optimizer, **options)
    torch._dynamo.reset()
    calls.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got, opt = _train(
            start, grads, torch.bfloat16, events, optimizer, cudagraphs=True, **options
        )
    named = [str(w.message) for w in rec if "not replayed" in str(w.message)]
    assert len(named) == 1, named
    expected_why = {
        "metrics": "metrics",
        "hook": "hooks",
        "not torch.optim": "_OwnAdamW",
    }
    assert expected_why[case] in named[0], named
    assert opt.step.whole_step.replays == 0
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    if case == "hook":
        assert len(calls) == 6


def test_an_optimizer_with_python_state_in_its_step_is_not_replayed():
    """Lion (tests/user_optimizers.py) is not torch.optim's: its step is compiled, and
    named as not replayed, never frozen at one step's Python values."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ps = [torch.nn.Parameter(torch.randn(8).bfloat16())]
        opt = Lion(ps, lr=1e-3)
        collage_compile.compile_optimizer(opt, cudagraphs=True)
    assert any("Lion is not one of torch.optim" in str(w.message) for w in rec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["light", "exact"])
def test_on_cuda_a_replayed_step_is_one_graph_launch_and_the_compiled_step_bit_for_bit(mode):
    """On a GPU the steady step is one CUDA graph launch: the profiled step launches no
    kernel of the optimizer from the host (only the lr fills and the gradient copy) and
    one graph; the weights are those of the uncaptured compiled step, bit for bit, under
    a schedule from lr = 0 with new gradient tensors every step, and track float64.
    Exact mode reads the lr through ``passes.scalars``' float64 tensors, on the device
    here, where the uncaptured step moved a CPU one (not yet run on a GPU)."""
    start, grads = drifting_stream([(64, 32), (32,), (32, 32)], STEPS)
    start = [t.cuda() for t in start]
    grads = [[g.cuda() for g in gs] for gs in grads]
    ref, _ = _train(start, grads, torch.float64, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    compiled, _ = _train(start, grads, torch.bfloat16, mode=mode)
    torch._dynamo.reset()
    replayed, opt = _train(start, grads, torch.bfloat16, mode=mode, cudagraphs=True)
    whole = opt.step.whole_step
    why = whole.capture_error or whole.refused  # the capture's traceback, if it failed
    assert whole.refused is None and whole.plan is not None and whole.plan.graph is not None, why
    assert whole.replays == STEPS - 3  # compile, record, capture (replayed once)
    _same_bits(compiled, replayed)
    err, err_plain = _errors(replayed, ref, plain, start)
    assert err_plain > 10 * err, (err_plain, err)
    for p in replayed:
        p.grad = torch.randn_like(p)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        opt.step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert whole.replays == STEPS - 2
    # host launches: the graph once; Triton's (driver API) none; runtime launches only the
    # lr fills (one per group) and the gradient copy
    assert sum(n == "cudaGraphLaunch" for n in names) == 1, names
    assert not any(n.startswith("cuLaunchKernel") for n in names), names
    assert sum(n == "cudaLaunchKernel" for n in names) <= 6, names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_exact_mode_is_the_fp32_step_but_for_contraction():
    """On a GPU, Triton contracts ``a * b + c`` into one fused multiply-add (one rounding)
    where a kernel's expression allows, and exact mode's kernels are not the fp32 step's:
    they join and split around the step (and until 54e9a76 computed the step's scalars
    once, in a kernel of their own).  So the two round differently at a few weights.
    The first GPU run (an H200, torch 2.11; ``tools/probe_exact.py``, at 7fa4780): after
    12 steps, 33 of 3104 weights 1 or 2 fp32 ulps from the fp32 step, both 2.036e-05 of
    the movement from float64, and the fp32 step compiled without contraction 6 ulps from
    the default one, at 1573 weights.  Here: exact replayed is exact compiled bit for bit;
    each is within 4 ulps of the fp32 step at under 5 % of the weights and as close to
    float64, where plain bf16 is far off."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Warning)  # the fp32 one: nothing to compensate
        start, grads, fp32, compiled, replayed = _exact_runs("cuda")
        ref, _ = _train(start, grads, torch.float64, compiled=False)
        plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    assert _values_equal(compiled, replayed)
    apart = [ulps(c, f) for c, f in zip(compiled, fp32)]
    n = sum(f.numel() for f in fp32)
    print(f"exact vs fp32 on CUDA: {apart}, of {n} weights")
    assert max(u for u, _ in apart) <= 4 and sum(k for _, k in apart) < 0.05 * n, apart

    def err(ws):
        return max(relative_error(w, r, s) for w, r, s in zip(ws, ref, start))

    assert err(compiled) <= 1.01 * err(fp32) and 1000 * err(compiled) < err(plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_an_optimizer_that_stepped_eagerly_first_is_replayed():
    """An AdamW that stepped eagerly before it was compiled holds its step counts on the
    CPU (``capturable=False``).  Dynamo moves them to the parameters' device when it
    compiles the step (``OptimizerVariable.move_step_if_cpu``, torch 2.11 and 2.13), so
    the capture holds no CPU tensor: the step is replayed, with the weights of the step
    compiled without cudagraphs, bit for bit, and tracks float64.  (The first GPU run
    showed it: this test, which expected the step to be refused, found no refusal.)"""
    start, grads = drifting_stream([(64, 32), (32,)], STEPS)
    start = [t.cuda() for t in start]
    grads = [[g.cuda() for g in gs] for gs in grads]

    def eager_first(ps, opt):  # torch's own step, not the compiled one installed on opt
        torch.optim.AdamW.step(opt)

    ref, _ = _train(start, grads, torch.float64, compiled=False)
    plain, _ = _train(start, grads, torch.bfloat16, compiled=False)
    runs = {}
    for whole in (False, True):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            runs[whole] = _train(start, grads, torch.bfloat16, {0: eager_first}, cudagraphs=whole)
    named = [str(w.message) for w in rec if "not replayed" in str(w.message)]
    (replayed, opt), (compiled, _) = runs[True], runs[False]
    assert not named, named
    assert all(s["step"].device.type == "cuda" for s in opt.state.values())
    assert opt.step.whole_step.replays >= STEPS - 4, opt.step.whole_step.replays
    _same_bits(compiled, replayed)
    err, err_plain = _errors(replayed, ref, plain, start)
    assert err_plain > 10 * err, (err_plain, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_cuda_state_moved_off_the_device_and_back_is_followed():
    """A CUDA graph reads and writes by address.  ``v.data = v.data.cpu()`` and back, on
    every state tensor mid-run (the ``optimizer_to`` helper), leaves the same tensors on
    new storages: a replay that trusted identity would update the freed ones and leave the
    user's state frozen.  The replay gives way for a step and captures again: the weights
    are the compiled step's under the same event, bit for bit."""
    start, grads = drifting_stream([(64, 32), (32,)], STEPS)
    start = [t.cuda() for t in start]
    grads = [[g.cuda() for g in gs] for gs in grads]
    runs = {}
    for whole in (False, True):
        torch._dynamo.reset()
        runs[whole] = _train(
            start, grads, torch.bfloat16, {12: _state_moved_back}, cudagraphs=whole
        )
    (compiled, _), (replayed, opt) = runs[False], runs[True]
    whole = opt.step.whole_step
    assert any("new storage" in why for why in whole.given_way), whole.given_way
    assert whole.replays >= STEPS - 6, whole.replays
    _same_bits(compiled, replayed)
