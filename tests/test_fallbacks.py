"""Never a silent fallback: a step that runs without a collage graph is named to the user.

Each test forces one way a compensated optimizer or EMA can end up stepped in plain low
precision (an uncompiled ``opt.step``, ``torch.compiler.disable``, an update left to eager
inside the step, Dynamo's recompile limit, an EMA updated eagerly) and asserts exactly one
:class:`collage_compile.CollageWarning` naming it; a normal scheduled run gives none.  After
an eager optimizer step the pair's lo is kept (the step was a valid plain update of hi; lo
still holds what earlier steps left in it), and the next compiled step resumes from it.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import collage_compile
from collage_compile import state, watch

Warning = collage_compile.CollageWarning


def _setup(steps: int = 3):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.5).to(torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for _ in range(steps):
        _grad(p, g)
        step()
    return p, opt, step, g


def _grad(p, g):
    p.grad = (0.01 * torch.randn(p.shape, generator=g)).to(p.dtype)


def _collage_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, Warning)]


def test_a_normal_scheduled_run_with_an_ema_gives_no_warning():
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.5).to(torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-4, total_steps=40)
    collage_compile.compile_optimizer(opt)
    step = opt.step
    ema = [p.detach().clone()]
    ema_update = torch.compile(
        lambda: torch._foreach_lerp_(ema, [p.detach()], 0.01), backend=collage_compile.backend
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)
        for _ in range(40):
            _grad(p, g)
            step()
            sched.step()
            ema_update()
    assert collage_compile.components(ema[0])[1] is not None


def test_an_uncompiled_step_is_named_and_keeps_lo():
    p, opt, step, g = _setup()
    lo_before = state.get_lo(p).clone()
    _grad(p, g)
    with pytest.warns(
        Warning, match=r"AdamW\.step ran without a graph compiled by the collage"
    ) as rec:
        opt.step()  # the uncompiled step
    (msg,) = _collage_warnings(rec)
    assert "1 of its 1 parameters" in msg and "uncompiled call of opt.step" in msg
    # kept: the same lo, now the lo of the new hi; the next compiled step does not drop it
    assert torch.equal(collage_compile.components(p)[1], lo_before)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)  # no "outside write" for an eager step
        _grad(p, g)
        step()
    assert not torch.equal(state.get_lo(p), lo_before)  # and it went on upgrading
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        _grad(p, g)
        opt.step()
    assert not _collage_warnings(again)  # once per optimizer


def test_compiler_disable_around_the_step_is_named():
    p, _opt, step, g = _setup()
    _grad(p, g)
    with pytest.warns(Warning, match=r"AdamW\.step ran without a graph") as rec:
        torch.compiler.disable(step)()
    assert len(_collage_warnings(rec)) == 1


class _LoggingSGD(torch.optim.Optimizer):
    """SGD that reads each update's size on the host (a graph break inside its loop over
    parameters: Dynamo cannot resume there, skips the frame and runs it eagerly)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.sizes = []

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                self.sizes.append(p.grad.norm().item())
                p.add_(p.grad, alpha=-group["lr"])


def test_a_graph_break_that_leaves_the_step_to_eager_is_named():
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, generator=g).to(torch.bfloat16)) for _ in range(2)]
    opt = _LoggingSGD(ps, lr=1e-4)
    # the same update, compiled without the host read: both parameters get their pair
    plain_sgd = torch.compile(
        lambda: [p.add_(p.grad, alpha=-1e-4) for p in ps], backend=collage_compile.backend
    )
    for p in ps:
        _grad(p, g)
    with torch.no_grad():
        plain_sgd()
    opt.step()  # an eager step before the watch has a window for this optimizer: not judged
    assert all(state.get_lo(p) is not None for p in ps)
    step = torch.compile(opt.step, backend=collage_compile.backend)
    for p in ps:
        _grad(p, g)
    with pytest.warns(Warning, match=r"_LoggingSGD\.step ran without a graph") as rec:
        step()
    assert "2 of its 2 parameters" in _collage_warnings(rec)[0]


@pytest.mark.parametrize("mode", ["light", "off"])
def test_a_step_left_to_eager_is_named_before_any_weight_carries_a_pair(mode):
    """``torch.compile(opt.step, backend="collage")`` of a step whose loop reads the host
    (Dynamo runs its body eagerly) never gives its weights a pair, so the check above has
    nothing to compare; the step's own code ran in a collage graph (the watch's tick), and
    that names it.  The weights are those of the same stream stepped in plain bf16, bit
    for bit: what is named is the uncompensated path.  ``mode="off"`` asked for none: no
    warning."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2)]
    grads = [
        [(0.01 * torch.randn(64, generator=g)).to(torch.bfloat16) for _ in start] for _ in range(3)
    ]

    def run(compiled: bool):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = _LoggingSGD(ps, lr=1e-4)
        backend = collage_compile.make_backend(mode=mode)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            step()
        return ps

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ps = run(compiled=True)
    assert all(state.get_lo(p) is None for p in ps)
    assert all(torch.equal(p, q) for p, q in zip(ps, run(compiled=False)))
    named = _collage_warnings(rec)
    if mode == "off":
        assert not named
        return
    (msg,) = named
    assert "_LoggingSGD.step ran without a graph" in msg and "2 bfloat16 parameters" in msg
    assert "step's code was compiled with the collage" in msg


class _DataMomentum(torch.optim.Optimizer):
    """Momentum SGD as older code writes it (timm's AdamP, NvNovoGrad): the weights
    through ``p.data``, whose version counter is not the weight's, the momentum made on
    the first step, and a host read in its loop (run eagerly, as _LoggingSGD)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad)
                if p.grad.norm().item() > 0:
                    p.data.add_(state["m"], alpha=-group["lr"])


@pytest.mark.parametrize("mode", ["light", "exact"])
def test_a_compiled_first_step_that_writes_no_weight_is_not_named(mode):
    """ADOPT's first step only fills its second moment (tests/user_optimizers.py's
    Adopt): no collage graph wrote a weight, and the check for steps that ran without one
    named it, a false alarm on every ADOPT run (pytorch_optimizer's and timm's).  The
    step's code ran in a collage graph, which made the state, and no weight's version
    moved: nothing to name.  The next steps give the weights their pairs."""
    import user_optimizers

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.5).to(torch.bfloat16))
    opt = collage_compile.compile_optimizer(user_optimizers.Adopt([p], lr=1e-3), mode=mode)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            _grad(p, g)
            opt.step()
    assert not _collage_warnings(rec)
    assert collage_compile.components(p)[1] is not None


@pytest.mark.parametrize("hook", [False, True], ids=["", "post_hook"])
def test_an_eager_first_step_through_p_data_is_named(hook):
    """The same check for a step whose body ran eagerly and wrote its weights through
    ``p.data`` (no version counter of the weights moves): it made its state itself, no
    collage graph did, and it is named as a step that ran without a graph
    (``MUT=state_alone_always``).  A step post-hook that keeps a copy of the weights is
    traced into the graph of the step's tick, whose outputs then hold a new tensor of
    each weight's shape: the next step finds it is not their state, and names the step
    (``MUT=made_state_unchecked``)."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.5).to(torch.bfloat16))
    start = p.detach().clone()
    opt = _DataMomentum([p], lr=1e-3)
    if hook:
        kept = []
        opt.register_step_post_hook(lambda o, *_: kept.append(p.detach().clone()))
    collage_compile.compile_optimizer(opt)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            _grad(p, g)
            opt.step()
    assert not torch.equal(p.detach(), start)  # the weights moved, in plain bf16
    (msg,) = [m for m in _collage_warnings(rec) if "compiled by compile_optimizer" in m]
    assert "_DataMomentum.step" in msg and "1 of its bfloat16 parameters" in msg


@pytest.mark.parametrize("backend", ["collage", "off", "inductor", "collage+off"])
def test_a_model_compiled_with_collage_beside_an_eager_optimizer_is_named(backend):
    """``torch.compile(model, backend="collage")`` compensates nothing of an optimizer
    stepped eagerly: its weights, read by collage graphs, are named once.  A model
    compiled with ``mode="off"`` or by plain Inductor asked for no compensation, nor
    did an optimizer ``compile_optimizer(opt, mode="off")`` compiled: no warning."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if backend == "collage+off":
        collage_compile.compile_optimizer(opt, mode="off")
    chosen = {
        "collage": collage_compile.backend,
        "collage+off": collage_compile.backend,
        "off": collage_compile.make_backend(mode="off"),
        "inductor": "inductor",
    }[backend]
    forward = torch.compile(model, backend=chosen)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            forward(torch.randn(4, 16, generator=g).to(torch.bfloat16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    named = _collage_warnings(rec)
    if backend != "collage":
        assert not named
        return
    (msg,) = named
    assert "AdamW.step ran without a graph" in msg and "2 bfloat16 parameters" in msg
    assert 'a model compiled with backend="collage"' in msg


def test_the_recompile_limit_is_named_once():
    p, opt, step, g = _setup(1)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for k in range(4):  # maximize toggled: a bool guard no backend can make dynamic
            opt.param_groups[0]["maximize"] = bool(k % 2 == 0)
            _grad(p, g)
            step()
    msgs = _collage_warnings(rec)
    assert len(msgs) == 1, msgs
    assert "hit config.recompile_limit (1)" in msgs[0] and "'step'" in msgs[0]
    assert "plain low precision" in msgs[0]


def test_the_recompile_limit_is_named_again_for_a_new_run_after_a_reset():
    """Two runs in one process (a sweep in a notebook), ``torch._dynamo.reset()`` before
    each, both past the limit: the second run's tensors were marked named (so that its
    eager steps are not named twice) while the warning, given once per function, said
    nothing: it trained in plain bf16 with no warning (pytorch_optimizer's LAMB after its
    Adan in ``python tools/third_party.py``, each compiled again every step for
    ``math.pow(beta, step)`` of a Python int).  Each run's tensors are named now."""
    named = []
    for _ in range(2):
        torch._dynamo.reset()
        p, opt, step, g = _setup(1)
        with (
            torch._dynamo.config.patch(recompile_limit=1),
            warnings.catch_warnings(record=True) as rec,
        ):
            warnings.simplefilter("always")
            for k in range(4):
                opt.param_groups[0]["maximize"] = bool(k % 2 == 0)
                _grad(p, g)
                step()
        named.append(_collage_warnings(rec))
    assert [len(m) for m in named] == [1, 1], named
    assert all("hit config.recompile_limit (1)" in m[0] for m in named), named


def _abs_step(p):
    with torch.no_grad():
        p.add_(1e-3).abs_()  # abs_: a write the pair cannot carry


def test_a_write_left_as_written_is_named_for_each_model_of_the_same_names():
    """The not-upgraded warning was given once per reason and tensor *name*: a second model
    in the process whose tensors bear the same names (a sweep, ``torch._dynamo.reset()``
    between runs; timm's RAdam after its AdaBelief, both ``param_groups[0].params[0]``)
    lost its lo every step unnamed.  Each model's tensors are named now, and a recompile
    of the same tensors' graph says nothing again."""
    named = []
    for _ in range(2):
        torch._dynamo.reset()
        p = torch.nn.Parameter(torch.randn(8).bfloat16())
        step = torch.compile(_abs_step, backend=collage_compile.backend)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            step(p)
            torch._dynamo.reset()  # the same tensor's graph compiled again
            step(p)
        named.append([m for m in _collage_warnings(rec) if "not upgraded" in m])
    assert [len(m) for m in named] == [1, 1], named
    assert all("abs_" in m[0] and "p (shape [8]" in m[0] for m in named), named


def test_an_optimizer_whose_step_never_compiles_is_named():
    """Every optimizer runs torch.optim's step wrapper, and Dynamo guards each compiled
    optimizer by identity there.  Optimizers ``compile_optimizer`` compiled leave room
    for each other under the recompile limit (``tests/test_real_loop.py -k in_backward``);
    ones compiled otherwise (here two fp32 optimizers by plain ``torch.compile``) fill it:
    past it (here 2) the optimizer ``compile_optimizer`` compiled never gets a graph and
    steps eagerly.  Its weights carry no pair yet, so the check on pairs saw nothing: it
    is named from its first step on, with the cause."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    others = [torch.nn.Parameter(torch.randn(8, generator=g)) for _ in range(2)]
    steps = [torch.compile(torch.optim.AdamW([q], lr=1e-3).step, backend="eager") for q in others]
    p = torch.nn.Parameter(torch.randn(8, generator=g).bfloat16())
    opt = collage_compile.compile_optimizer(torch.optim.AdamW([p], lr=1e-3))
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            for q, step in zip(others, steps):
                _grad(q, g)
                step()
            _grad(p, g)
            opt.step()
    msgs = [m for m in _collage_warnings(rec) if "compiled by compile_optimizer" in m]
    assert len(msgs) == 1, _collage_warnings(rec)
    assert "1 of its bfloat16 parameters" in msgs[0], msgs
    assert "recompile_limit (2)" in msgs[0] and "optimizer.py" in msgs[0], msgs
    assert state.get_lo(p) is None


def test_compiling_an_optimizer_again_with_other_options_is_an_error():
    """``compile_optimizer`` a second time with other options used to return at once: a
    user who went from ``mode="off"`` to ``"plus"`` (or light to plus) trained on
    uncompensated, or less compensated, and unwarned.  Now the same options (spelled out
    or left to their defaults) are a no-op, and other ones a ``ValueError`` naming each
    option compiled and asked for, before any step."""
    p = torch.nn.Parameter(torch.randn(8).bfloat16())
    opt = collage_compile.compile_optimizer(torch.optim.AdamW([p], lr=1e-3), mode="off")
    compiled = opt.step
    with pytest.raises(ValueError, match=r"mode='off' \(asked: 'plus'\)"):
        collage_compile.compile_optimizer(opt, mode="plus")
    assert collage_compile.compile_optimizer(opt, mode="off") is opt
    assert opt.step is compiled
    light = collage_compile.compile_optimizer(torch.optim.AdamW([p], lr=1e-3))
    collage_compile.compile_optimizer(light, mode="light")  # the default, spelled out
    with pytest.raises(ValueError, match=r"metrics=False \(asked: True\)"):
        collage_compile.compile_optimizer(light, metrics=True)
    with pytest.raises(TypeError, match="unknown option"):
        collage_compile.compile_optimizer(light, mdoe="plus")


@pytest.mark.parametrize("first_model", ["deleted", "kept"])
def test_plain_inductor_reaching_the_limit_after_collage_is_not_named(first_model):
    """The same code compiled by collage, then ``torch._dynamo.reset()`` (which discards
    every compiled graph), then by plain Inductor, which reaches the limit: nothing of
    collage's loses compensation, so no warning, whether the first model is gone or
    still alive (``kept``: it used to be blamed, found by a new-user test)."""
    p, opt, step, g = _setup(1)
    first = (p, opt, step)
    del p, opt, step
    if first_model == "deleted":
        del first
    torch._dynamo.reset()
    gc.collect()  # the model is gone (a reference cycle in Dynamo's frames may hold it)
    q = torch.nn.Parameter(torch.randn(32, 16, generator=g).to(torch.bfloat16))
    opt = torch.optim.AdamW([q], lr=1e-4)
    plain = torch.compile(opt.step, backend="inductor")
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for k in range(3):
            opt.param_groups[0]["maximize"] = bool(k % 2 == 0)
            _grad(q, g)
            plain()
    assert watch._limits, "plain Inductor did not reach the limit: the test shows nothing"
    assert _collage_warnings(rec) == []


def test_an_ema_updated_eagerly_is_named_and_its_lo_is_not_used():
    p, _opt, step, g = _setup(0)
    ema = [p.detach().clone()]

    def ema_update():
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p], 0.01)

    compiled = torch.compile(ema_update, backend=collage_compile.backend)
    for _ in range(3):
        _grad(p, g)
        step()
        compiled()
    assert collage_compile.components(ema[0])[1] is not None
    ema_update()  # eagerly: plain bf16
    # value() no longer adds a lo that belonged to the old values
    assert collage_compile.components(ema[0])[1] is None
    assert torch.equal(collage_compile.value(ema[0]), ema[0].float())
    with pytest.warns(Warning, match="written outside every collage-compiled step") as rec:
        _grad(p, g)
        step()  # the optimizer's post-step check finds it
    assert len(_collage_warnings(rec)) == 1


def test_optimizer_state_written_outside_the_step_is_named_by_its_key():
    """Foreach AdamW's second moments (plus mode) scaled by hand: one warning names each
    by its parameter's position and key, as torch's state_dict() numbers them, where
    Dynamo's source gives the key's position ("state[0][2]", found by a new-user test)."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).bfloat16()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    collage_compile.compile_optimizer(opt, mode="plus")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in m.parameters():
            _grad(p, g)
        opt.step()
    with torch.no_grad():
        for st in opt.state.values():
            st["exp_avg_sq"].mul_(0.5)
    with pytest.warns(Warning, match="written outside every collage-compiled step") as rec:
        for p in m.parameters():
            _grad(p, g)
        opt.step()
    (msg,) = _collage_warnings(rec)
    shown = msg.split(" carrying")[0].removeprefix("collage: ").split(", ")
    assert sorted(shown) == [f"state[{i}].exp_avg_sq" for i in range(4)], msg


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW], ids=lambda c: c.__name__)
def test_lr_zero_writes_no_nan(cls, amsgrad, foreach):
    """Hugging Face's warmup starts at lr = 0.0.  Adam's traced single-tensor formula
    divides by the step size (PyTorch issue 126514): 0 / -0.0 = NaN wherever the second
    moment is 0 (embedding rows no token hit), in plain Inductor.  The intended update is 0:
    after a step at lr = 0, every weight is unchanged; then the run trains normally."""
    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Parameter((torch.randn(16, 8, generator=g) * 0.02).to(torch.bfloat16))
    start = emb.detach().clone()

    def grads():
        gr = 0.01 * torch.randn(16, 8, generator=g)
        gr[:5] = 0  # rows no token hit
        return gr.to(torch.bfloat16)

    decay = 0.1 if cls is torch.optim.AdamW else 0.0  # Adam's would be part of the gradient

    def run(backend):
        w = torch.nn.Parameter(start.clone())
        opt = cls([w], lr=0.0, weight_decay=decay, amsgrad=amsgrad, foreach=foreach)
        step = torch.compile(opt.step, backend=backend)
        w.grad = grads()
        step()
        return w, opt, step

    w, opt, step = run(collage_compile.backend)
    assert not collage_compile.value(w).isnan().any()
    assert torch.equal(collage_compile.value(w), start.float())
    shrink = 1.0
    for k in range(5):  # the warmup goes on: finite, and rows without gradient only decay
        lr = 1e-4 * (k + 1)
        opt.param_groups[0]["lr"] = lr
        shrink *= 1 - lr * decay
        w.grad = grads()
        step()
    value = collage_compile.value(w).double()
    assert torch.isfinite(value).all()
    expected = start[:5].double() * shrink
    assert (value[:5] - expected).abs().max() <= 2**-16 * start.abs().max()
    assert not torch.equal(value[5:], start[5:].double())
    plain, _, _ = run("inductor")
    if not foreach and collage_compile._compat.torch_version().startswith("2.13"):
        assert plain.isnan().any()  # the hazard this guards against, as torch 2.13 compiles it


def test_the_watch_adds_no_graph_break():
    """The check after each step is an op inside the compiled step: an optimizer with no
    graph break of its own still compiles with fullgraph=True, with the collage backend and
    with plain Inductor in the same process."""
    import user_optimizers

    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8, generator=g).to(torch.bfloat16))
    opt = user_optimizers.Lion([p], lr=1e-4)
    for backend in (collage_compile.backend, "inductor"):
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend=backend, fullgraph=True)
        for _ in range(2):
            _grad(p, g)
            step()
    assert state.get_lo(p) is not None
