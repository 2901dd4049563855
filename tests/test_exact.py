"""``mode="exact"``: bf16 parameters and state with 16-bit remainders train bit for bit as
the same stock optimizer on fp32 tensors.

Each optimizer runs 200 steps of one gradient stream (clipped, as a user's loop clips) under
a warmup + cosine schedule that also moves beta1 / momentum and weight decay, four ways:

- ``exact``: bf16 parameters, compiled with ``make_backend(mode="exact")``;
- ``fp32``: fp32 parameters (the bf16 starting weights, exactly), fed the same gradients,
  compiled with plain Inductor.  Under a schedule plain Inductor recompiles for every
  learning rate and falls back to eager at the recompile limit, so the reference graph also
  gets the one pass the backend applies to every graph it compiles, which keeps changing
  hyperparameters as graph inputs with the arithmetic unchanged (``passes/scalars.py``;
  :func:`test_without_a_schedule_exact_is_plain_inductors_fp32_step` compares with plain
  Inductor itself);
- ``light``: the same bf16 stream in ``mode="light"``, which must *not* be bit-identical
  (so this test fails if the exact path silently became light);
- eager fp32 and eager plain bf16: the first within fp32 rounding of ``exact``, the second
  far from it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo.testing
import user_optimizers
from test_all_optimizers import schedule

import collage_compile
from collage_compile import _compat
from collage_compile.passes import scalars

STEPS = 200
SHAPES = [(16, 32), (32,)]

# name -> (class, kwargs, foreach, scheduled); weight decay wherever the optimizer has it
CASES = {
    "SGD-momentum-nesterov": (
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        True,
        True,
    ),
    "SGD-single": (
        torch.optim.SGD,
        {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01},
        False,
        True,
    ),
    "Adam-amsgrad": (
        torch.optim.Adam,
        {"lr": 1e-3, "amsgrad": True, "weight_decay": 0.01},
        True,
        True,
    ),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}, True, True),
    "AdamW-single": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}, False, True),
    "NAdam": (
        torch.optim.NAdam,
        {"lr": 1e-3, "weight_decay": 0.01, "decoupled_weight_decay": True},
        True,
        True,
    ),
    "RAdam": (
        torch.optim.RAdam,
        {"lr": 1e-3, "weight_decay": 0.01, "decoupled_weight_decay": True},
        True,
        True,
    ),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-3, "weight_decay": 0.01}, True, True),
    "Adagrad": (
        torch.optim.Adagrad,
        {"lr": 1e-2, "weight_decay": 0.01, "lr_decay": 1e-3},
        True,
        True,
    ),
    "RMSprop-centered": (
        torch.optim.RMSprop,
        {"lr": 1e-4, "centered": True, "momentum": 0.9, "weight_decay": 0.01},
        True,
        True,
    ),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.3, "weight_decay": 0.01}, True, True),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2, "weight_decay": 0.01}, True, True),
    # Adafactor: Tensor.item() captured, a constant lr (a scheduled one
    # recompiles per value in Python, plain Inductor alike: test_all_optimizers), and eps1
    # given (its default is the parameter dtype's eps, which differs between bf16 and fp32).
    # Not bit for bit on CPU: its norms sum in another order (ROUNDED below)
    "Adafactor": (
        torch.optim.Adafactor,
        {"lr": 1e-2, "eps": (1e-10, 1e-3), "weight_decay": 0.01},
        True,
        False,
    ),
}


# Inductor's C++ backend does not vectorize a loop that loads int16 (the remainders), and a
# sum in a loop of one element at a time adds in another order than the vectorized fp32 sum:
# Adafactor's RMS norms of the weights and updates are a few fp32 ulps apart, and so then
# are its weights (docs/numerics.md).  Element-wise steps round alike in either loop.
ROUNDED = {"Adafactor": 1e-6}


def _plain_with_scalars(gm, example_inputs):
    """Plain Inductor, with changing hyperparameters kept as graph inputs (module docstring)."""
    gm = _compat.copy_graph_module(gm)
    scalars.run(gm)
    gm.recompile()
    return _compat.compile_with_inductor(gm, example_inputs)


def _stream(seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Starting bf16 weights and STEPS steps of bf16 gradients, clipped to norm 0.05."""
    g = torch.Generator().manual_seed(seed)
    init = [(torch.randn(s, generator=g) * 0.5).to(torch.bfloat16) for s in SHAPES]
    grads = []
    for _ in range(STEPS):
        step = [(0.01 * torch.randn(s, generator=g)).to(torch.bfloat16) for s in SHAPES]
        torch.nn.utils.clip_grad_norm_(step, 0.05)
        grads.append(step)
    return init, grads


def _train(case, init, grads, dtype, backend, after_step=None):
    """Train copies of ``init`` in ``dtype`` on the stream; ``backend`` None: eagerly;
    ``after_step(params, opt)`` after every step."""
    cls, kwargs, foreach, scheduled = CASES[case]
    _compat.reset_dynamo()
    params = [torch.nn.Parameter(t.to(dtype, copy=True)) for t in init]
    opt = cls(params, foreach=foreach, **kwargs)
    initial = dict(opt.param_groups[0])
    step = opt.step if backend is None else torch.compile(opt.step, backend=backend)
    for k, step_grads in enumerate(grads):
        for p, grad in zip(params, step_grads):
            p.grad = grad.to(dtype)
        step()
        if after_step is not None:
            after_step(params, opt)
        if scheduled:
            schedule(opt.param_groups[0], initial, k, len(grads))
    return params, opt


class _Ties:
    """Where an fp32 run's weights or state ever sat exactly half-way above an even bf16
    value: the one fp32 value a remainder cannot hold (test_remainder), kept one ulp below
    by exact mode, whose later steps at that element then start from there.  Element-wise
    optimizers keep it to that element."""

    def __init__(self):
        self.masks: list[torch.Tensor] | None = None

    def __call__(self, params, opt):
        if self.masks is None:
            self.masks = [torch.zeros(p.shape, dtype=torch.bool) for p in params]
        for mask, p in zip(self.masks, params):
            for t in [p, *opt.state[p].values()]:
                if torch.is_tensor(t) and t.dtype == torch.float32 and t.shape == p.shape:
                    bits = _bits(t)
                    mask |= (bits & 0xFFFF == 0x8000) & ((bits >> 16) & 1 == 0)

    def flat(self) -> torch.Tensor:
        return torch.cat([m.flatten() for m in self.masks])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _state_values(opt, params):
    """Every floating state tensor of every parameter, as the fp32 value it holds."""
    out = []
    for p in params:
        for name, v in sorted(opt.state[p].items()):
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                out.append((name, collage_compile.value(v) if v.dtype == torch.bfloat16 else v))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_exact_mode_is_the_fp32_step_bit_for_bit_but_at_ties(case):
    init, grads = _stream()
    capture = case == "Adafactor"
    with torch._dynamo.config.patch(capture_scalar_outputs=capture), warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        exact, exact_opt = _train(
            case, init, grads, torch.bfloat16, collage_compile.make_backend(mode="exact")
        )
        ties = _Ties()
        fp32, fp32_opt = _train(case, init, grads, torch.float32, _plain_with_scalars, ties)
        light, _ = _train(
            case, init, grads, torch.bfloat16, collage_compile.make_backend(mode="light")
        )
    eager, _ = _train(case, init, grads, torch.float32, None)
    plain, _ = _train(case, init, grads, torch.bfloat16, None)

    value = torch.cat([collage_compile.value(p).flatten() for p in exact])
    target = torch.cat([p.detach().flatten() for p in fp32])
    moved = (target - torch.cat([t.float().flatten() for t in init])).norm()
    if case in ROUNDED:
        err = float((value - target).norm() / moved)
        print(f"{case:22s} {err:.1e} of the movement from the fp32 step")
        assert 0 < err < ROUNDED[case]
    else:
        # the fp32 value the pair holds, hi (what the forward pass reads) and every state
        # tensor, bit for bit
        n = _assert_bit_for_bit(exact, exact_opt, fp32, fp32_opt, ties.flat())
        print(f"{case:22s} bit for bit but {n} elements once exactly half-way above an even bf16")

    light_value = torch.cat([collage_compile.value(p).flatten() for p in light])
    assert not torch.equal(_bits(light_value), _bits(target)), "light mode matched fp32 bit for bit"
    eager_err = float((torch.cat([p.detach().flatten() for p in eager]) - target).norm() / moved)
    plain = torch.cat([p.detach().float().flatten() for p in plain])
    plain_err = float((plain - target).norm() / moved)
    print(f"{'':22s} eager fp32 {eager_err:.1e}  plain bf16 {plain_err:.2f} of the movement")
    # compiled and eager fp32 compute some steps in another order (torch.optim's compiled
    # formulas), a few fp32 roundings apart per step; RAdam's, compounded, the most (3e-4)
    assert eager_err < 1e-3
    assert plain_err > 100 * max(eager_err, 1e-5)


def _assert_bit_for_bit(exact, exact_opt, fp32, fp32_opt, ties) -> int:
    """The fp32 values the weights and state hold and the bf16 weights (what the forward
    pass reads, the fp32 weights' cast) equal the fp32 run's bit for bit, but at elements
    that were once at a tie, where they are a few fp32 ulps apart."""
    value = torch.cat([collage_compile.value(p).flatten() for p in exact])
    target = torch.cat([p.detach().flatten() for p in fp32])
    hi = torch.cat([p.detach().flatten() for p in exact])
    cast = target.to(torch.bfloat16)
    assert torch.equal(_bits(value)[~ties], _bits(target)[~ties])
    assert torch.equal(_bits(hi)[~ties], _bits(cast)[~ties])
    ulps = (_bits(value)[ties].long() - _bits(target)[ties].long()).abs()
    assert ulps.numel() == 0 or int(ulps.max()) <= 8
    sizes = [p.numel() for p in exact]
    pairs = zip(_state_values(exact_opt, exact), _state_values(fp32_opt, fp32))
    for (name, v), (ref_name, r) in pairs:
        assert name == ref_name, name
        off = ties.split(sizes)[[p.numel() for p in exact].index(v.numel())].view(v.shape)
        v, r = _bits(v.float()), _bits(r.float())
        assert torch.equal(v[~off], r[~off]), name
    return int(ties.sum())


def _outside_run(name, init, grads, dtype, backend, ties=None):
    """``ties``: a dict the fp32 run fills, per state key, with where its value was ever a
    tie (:func:`_tie_mask`), which exact mode holds one ulp low and then steps from."""
    _compat.reset_dynamo()
    p = torch.nn.Parameter(init.to(dtype, copy=True))
    opt = getattr(user_optimizers, name)([p], lr=1e-3)
    step = opt.step if backend is None else torch.compile(opt.step, backend=backend)
    for grad in grads:
        p.grad = grad.to(dtype)
        step()
        if ties is not None:
            for key, v in [("p", p.detach()), *opt.state[p].items()]:
                ties[key] = ties.get(key, torch.zeros(v.shape, dtype=torch.bool)) | _tie_mask(v)
    return p, opt


def _tie_mask(t: torch.Tensor) -> torch.Tensor:
    """Where an fp32 tensor sits exactly half-way above an even bf16 value (_Ties)."""
    bits = _bits(t)
    return (bits & 0xFFFF == 0x8000) & ((bits >> 16) & 1 == 0)


# name -> the steps after which the fp32 step is matched bit for bit (ADOPT's first step
# moves no weight)
OUTSIDE = {"FactoredMomentum": 1, "Adopt": 2, "FunctionalAdam": 2}


@pytest.mark.parametrize("long", [False, True], ids=["first", "100"])
@pytest.mark.parametrize("name", list(OUTSIDE))
def test_exact_mode_of_an_optimizer_outside_torch_optim_is_the_fp32_step(name, long, capture):
    """Optimizers written as third-party code writes them (tests/user_optimizers.py), where
    exact mode fell short of the fp32 step with no warning, each a defect found in
    pytorch_optimizer's and timm's optimizers (tools/third_party.py):

    - they read ``p.grad`` themselves, which Dynamo names ``AttrSource(.., 'grad')``, not
      torch.optim's ``GradSource``: ops on the gradient alone computed in bf16
      (``MUT=attr_grads_unpromoted``);
    - FactoredMomentum (CAME's shape) makes its factors with ``torch.zeros(shape,
      dtype=grad.dtype)``: they were computed in bf16 with no remainder, and a factor
      written from fp32 values came back as the zeros it was made as
      (``MUT=made_state_left_low``); CAME ended 0.066 of its movement from its fp32 run;
    - ADOPT's first step writes no input (it only fills its second moment): the graph went
      to plain Inductor and the state started one bf16 rounding off (``MUT=no_state_made``);
    - FunctionalAdam replaces its moments (``state["v"] = b2 * v + ...``): the next step
      read them as bf16 without their remainders (``MUT=paired_reads_dropped``; AdaLite).

    Now no op of the steps computes in bf16 (Inductor's C++ kernels kept a bf16 ``g * g``
    in fp32 registers, which hid the first: the graphs are checked), the first steps are
    the fp32 step bit for bit, weights and every state tensor but where the fp32 value is
    a tie (``g * g`` of a bf16 gradient has 16 significant bits: often one), and 100 steps
    stay within the order reductions sum in (as Adafactor's, ROUNDED)."""
    init, stream = _stream()
    grads = [g[0] for g in stream[: 100 if long else OUTSIDE[name]]]
    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        exact, exact_opt = _outside_run(
            name, init[0], grads, torch.bfloat16, collage_compile.make_backend(mode="exact")
        )
    for gm in capture.modules:
        low = [
            n.name
            for n in gm.graph.nodes
            if n.op not in ("placeholder", "get_attr")
            and getattr(_compat.example_value(n), "dtype", None) == torch.bfloat16
        ]
        assert not low, f"computed in bf16: {low}"  # the split's own ops carry no example value
    ties = {}
    fp32, fp32_opt = _outside_run(name, init[0], grads, torch.float32, _plain_with_scalars, ties)
    plain, _ = _outside_run(name, init[0], grads, torch.bfloat16, None)
    value, target = collage_compile.value(exact), fp32.detach()
    moved = (target - init[0].float()).norm()
    err = float((value - target).norm() / moved)
    plain_err = float((plain.detach().float() - target).norm() / moved)
    print(
        f"\n{name} {len(grads)} steps: exact {err:.1e} of the movement from the fp32 step, plain bf16 {plain_err:.2f}"
    )
    states = [
        (k, collage_compile.value(v), fp32_opt.state[fp32][k])
        for k, v in exact_opt.state[exact].items()
    ]
    assert len(states) == len(fp32_opt.state[fp32])
    if not long:
        for key, v, r in [("p", value, target), *states]:
            at = ties[key]
            assert torch.equal(_bits(v)[~at], _bits(r)[~at]), key
            ulps = (_bits(v)[at].long() - _bits(r)[at].long()).abs()
            assert ulps.numel() == 0 or int(ulps.max()) <= 8, key
    else:
        assert err < 1e-6
        for key, v, r in states:
            assert float((v - r).abs().max()) <= 1e-5 * float(r.abs().max()), key
    assert plain_err > 1e3 * max(err, 1e-6)


def test_exact_mode_reads_a_temporary_written_from_fp32_values_under_each_of_its_names():
    """A bf16 temporary the graph makes and then writes from a promoted value through an
    in-place op's result (``t.mul_(0.5).add_(p)`` writes ``t`` as ``mul_``) is computed as
    its fp32 copy; a later read of ``t`` read the zeros it was made as, and the weight
    decay below was lost without a word (``MUT=upcast_names_stale``)."""

    def step(p):
        with torch.no_grad():
            t = torch.zeros(p.shape, dtype=torch.bfloat16)
            t.mul_(0.5).add_(p, alpha=-1e-3)
            p.add_(t)

    ref = torch.linspace(-1, 1, 8).bfloat16().float()
    p = torch.nn.Parameter(ref.bfloat16())
    plain = p.detach().clone()
    compiled = torch.compile(step, backend=collage_compile.make_backend(mode="exact"))
    for _ in range(10):
        compiled(p)
        ref.add_(ref, alpha=-1e-3)
        plain.add_(plain, alpha=-1e-3)
    assert torch.equal(collage_compile.value(p), ref)
    assert not torch.equal(plain.float(), ref)  # bf16 alone loses the decay


def test_exact_mode_leaves_a_forward_that_writes_buffers_to_autograd():
    """A bf16 body (Linear + BatchNorm, whose running statistics the forward writes)
    compiled with the exact backend after an exact optimizer step: the weights carry
    remainders, and joining them to read fp32 values cut them out of autograd (their
    ``.grad`` stayed None, training stopped without a word; review of ``_paired_reads``,
    ``MUT=paired_reads_everywhere``).  Only optimizer state is read with its remainder."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).bfloat16()
    backend = collage_compile.make_backend(mode="exact")
    opt = torch.optim.SGD(body.parameters(), lr=1e-2)
    for p in body.parameters():
        p.grad = torch.randn_like(p)
    torch.compile(opt.step, backend=backend)()
    assert collage_compile.components(body[0].weight)[1] is not None
    forward = torch.compile(body, backend=backend)
    x = torch.randn(8, 4).bfloat16()
    opt.zero_grad()
    (forward(x).float() ** 2).sum().backward()
    assert body[0].weight.grad is not None and float(body[0].weight.grad.float().norm()) > 0


def test_exact_mode_carries_a_gradient_accumulated_in_place():
    """``p.grad.add_(g)`` over 32 micro-batches, compiled in exact mode: the gradient is a
    sum the graph writes, carried with its remainder as before ``p.grad`` read by code
    outside torch.optim counted as a gradient (review: it was rounded every step, 0.087
    from the fp32 sum, unnamed; ``MUT=written_grads_upcast``)."""

    def accumulate(p, g):
        with torch.no_grad():
            p.grad.add_(g)

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(64).bfloat16())
    p.grad = torch.zeros(64).bfloat16()
    ref = torch.zeros(64)
    plain = torch.zeros(64).bfloat16()
    step = torch.compile(accumulate, backend=collage_compile.make_backend(mode="exact"))
    for g in [torch.randn(64).bfloat16() for _ in range(32)]:
        step(p, g)
        ref.add_(g.float())
        plain.add_(g)  # the same sum in plain bf16
    err = float((collage_compile.value(p.grad) - ref).abs().max())
    assert err < 1e-5
    assert float((plain.float() - ref).abs().max()) > 100 * max(err, 1e-6)


def test_exact_mode_leaves_a_training_forward_that_reads_a_gradient():
    """A forward that reads ``w.grad`` (look-ahead weights) writes nothing and returns a
    bf16 tensor: it is not an optimizer step making state, and stays differentiable
    (review of ``makes_state``: the backward no longer reached ``w``;
    ``MUT=grad_readers_make_state``)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    v = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    w.grad = torch.randn(4, 4).bfloat16()
    x = torch.randn(3, 4).bfloat16()

    def forward(x, w, v):
        return x @ (w - 0.1 * w.grad).t(), x @ v.t()

    before = w.grad.clone()
    a, b = torch.compile(forward, backend=collage_compile.make_backend(mode="exact"))(x, w, v)
    (a.float().sum() + b.float().sum()).backward()
    assert not torch.equal(w.grad, before) and v.grad is not None


def test_exact_mode_stores_a_write_next_to_a_read_of_the_same_memory():
    """``v = flat[:4]`` carries a remainder; a graph reads ``flat`` and writes ``v`` (two
    views of one storage: the write is named and left in plain bf16).  Reading ``flat``
    with a remainder made the write go to a copy never stored: ``v`` did not move (review
    of ``_paired_reads``; ``MUT=paired_reads_everywhere``)."""
    flat = torch.linspace(-1, 1, 8).bfloat16()
    v = flat[:4]

    def decay(v):
        with torch.no_grad():
            v.mul_(0.999)

    def both(flat, v):
        with torch.no_grad():
            v.add_(0.25)
            return flat.sum()

    backend = collage_compile.make_backend(mode="exact")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", collage_compile.CollageWarning)
        torch.compile(decay, backend=backend)(v)
        before = v.float().clone()
        torch.compile(both, backend=backend)(flat, v)
    assert torch.allclose(v.float() - before, torch.full((4,), 0.25), atol=1e-2)


def _view_before_write(p):
    with torch.no_grad():
        t = torch.zeros(p.shape, dtype=torch.bfloat16)
        v = t.view(2, 4)
        t.add_(p, alpha=-1e-3)
        p.add_(v.reshape(-1))


def _write_through_view(p):
    with torch.no_grad():
        t = torch.zeros(p.shape, dtype=torch.bfloat16)
        t.view(2, 4).add_(p.view(2, 4), alpha=-1e-3)
        p.add_(t)


def _out_through_view(p):
    with torch.no_grad():
        t = torch.empty(p.shape, dtype=torch.bfloat16)
        v = t.view(2, 4)
        torch.mul(p, -1e-3, out=t)
        p.add_(v.reshape(-1))


@pytest.mark.parametrize("step", [_view_before_write, _write_through_view, _out_through_view])
def test_exact_mode_keeps_the_views_of_a_temporary_it_writes_from_fp32_values(step):
    """A bf16 temporary written from fp32 values was upcast where the write came: a view
    of it taken before (or the tensor under a write through a view) read the bf16 tensor
    as made: the decay was lost, and a view of ``torch.empty`` written with ``out=`` left
    the weight NaN (review; ``MUT=temporaries_made_low``).  A temporary the graph writes
    in place is made in fp32, so every view of it is a view of the fp32 value."""
    init = torch.linspace(-1, 1, 8).bfloat16()
    p = torch.nn.Parameter(init.clone())
    p32, plain = init.float().clone(), init.clone()
    exact = torch.compile(step, backend=collage_compile.make_backend(mode="exact"))
    fp32 = torch.compile(step, backend="inductor")
    for _ in range(5):
        exact(p)
        fp32(p32)
        step(plain)  # eager, plain bf16
    assert torch.equal(collage_compile.value(p), p32)
    assert float((plain.float() - p32).abs().max()) > 1e-3  # bf16 alone loses the decay


def test_exact_mode_scales_each_tensor_by_its_own_trust_ratio():
    """LAMB's foreach step (TrustRatioAdam) multiplies each tensor's update by its element
    of one stacked tensor of ratios, ``ratios.unbind()[k]``: a view.  The backend reads a
    computed fp32 scalar through ``as_strided`` in long C++ loops
    (``_compat.realize_scalars_pass``), and Inductor's lowering of that replaced the
    view's offset: every tensor took the first one's ratio, silently (pytorch_optimizer's
    LAMB under exact mode: 0.18 of its movement from its fp32 run;
    ``MUT=scalar_views_uncopied``).  The matrix has a C++ loop long enough for the scalar
    to be hoisted; the vector's ratio differs from it.  Each weight is measured against
    the fp32 step compiled by plain Inductor, which does not have the pass."""
    g = torch.Generator().manual_seed(0)
    init = [(torch.randn(s, generator=g) * 0.5).bfloat16() for s in ((64, 32), (64,))]
    grads = [
        [(0.01 + 0.005 * torch.randn(t.shape, generator=g)).bfloat16() for t in init]
        for _ in range(20)
    ]

    def run(dtype, backend):
        _compat.reset_dynamo()
        params = [torch.nn.Parameter(t.to(dtype, copy=True)) for t in init]
        opt = user_optimizers.TrustRatioAdam(params, lr=1e-3)
        step = opt.step if backend is None else torch.compile(opt.step, backend=backend)
        for step_grads in grads:
            for p, grad in zip(params, step_grads):
                p.grad = grad.to(dtype)
            step()
        return params

    with warnings.catch_warnings():
        warnings.simplefilter("error", collage_compile.CollageWarning)
        exact = run(torch.bfloat16, collage_compile.make_backend(mode="exact"))
    fp32 = run(torch.float32, "inductor")
    plain = run(torch.bfloat16, None)
    f64 = run(torch.float64, None)
    for k, (e, r, b, d, start) in enumerate(zip(exact, fp32, plain, f64, init)):
        moved = (r.detach() - start.float()).norm()
        err = float((collage_compile.value(e) - r.detach()).norm() / moved)
        plain_err = float((b.detach().float() - r.detach()).norm() / moved)
        # and against float64: exact as close as the fp32 step, plain bf16 far off
        exact64, fp32_64, plain64 = (
            float((v.double() - d.detach()).norm() / (d.detach() - start.double()).norm())
            for v in (collage_compile.value(e), r.detach(), b.detach())
        )
        print(
            f"\ntensor {k}: exact {err:.1e} of its movement, plain bf16 {plain_err:.2f}; "
            f"from float64: exact {exact64:.1e}, fp32 {fp32_64:.1e}, plain bf16 {plain64:.2f}"
        )
        assert err < 1e-6, k
        assert plain_err > 0.1
        assert exact64 <= fp32_64 + 1e-6 and exact64 < 1e-4, k
        assert plain64 > 100 * exact64, k
