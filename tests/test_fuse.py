"""One ``collage::chain`` node per MCF chain (``collage_compile.fuse``): same arithmetic, fewer
graph nodes for every compile stage to walk.

The outlined chain must compute exactly what the inline nodes computed once Inductor lowers
it (bit for bit, over a stream where plain bf16 loses), run eagerly to the same values, and
stay inline where it cannot be outlined safely.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    GraphCapture,
    grad_stream,
    mcf_value,
    readable_with_chains,
    relative_error,
)

import collage_compile
from collage_compile import _compat, fuse, state, watch


def _adamw_run(
    outline: bool,
    monkeypatch,
    foreach: bool,
    mode: str = "plus",
    steps: int = 40,
    shapes: tuple[tuple[int, ...], ...] = ((64, 32), (32,), (48, 16)),
):
    """The same AdamW stream through collage (``mode``) or plain Inductor (``mode=None``),
    compiled, with its float64 reference and the number of ``collage::chain`` nodes in the
    graphs handed to Inductor."""
    if not outline:
        monkeypatch.setattr(fuse, "outline", lambda *a, **k: None)
    capture = GraphCapture(monkeypatch)
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).bfloat16()) for s in shapes]
    start = [p.detach().double().clone() for p in ps]
    refs = [s.clone().requires_grad_() for s in start]
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=foreach)
    ref_opt = torch.optim.AdamW(refs, lr=1e-4, weight_decay=0.01)
    backend = "inductor" if mode is None else collage_compile.make_backend(mode=mode)
    step = torch.compile(opt.step, backend=backend)
    # each gradient a tensor of its own: a view's sizes reach the backend as SymInts, and a
    # chain reading it (the second moment's) then stays inline (fuse._concrete_tensor)
    streams = [
        [
            x.view(p.shape).clone()
            for x in grad_stream(p.numel(), steps, seed=i + 1, std=0.01, mean=0.0)
        ]
        for i, p in enumerate(ps)
    ]
    for t in range(steps):
        for p, r, s in zip(ps, refs, streams):
            p.grad = s[t]
            r.grad = s[t].double()
        step()
        ref_opt.step()
    chains = sum(t.count("torch.ops.collage.chain.default(") for t in capture.graphs)
    return ps, refs, start, chains


@pytest.mark.parametrize("foreach", [True, False])
def test_outlined_chains_compute_bit_for_bit_what_inline_chains_compute(monkeypatch, foreach):
    outlined, refs, start, chains = _adamw_run(True, monkeypatch, foreach)
    his = [p.detach().clone() for p in outlined]
    los = [collage_compile.components(p)[1].clone() for p in outlined]
    torch._dynamo.reset()
    with monkeypatch.context() as m:
        inline, _, _, inline_chains = _adamw_run(False, m, foreach)
    # the two runs really took the two paths: plus outlines the weight and the second
    # moment of each of the 3 parameters, and the patched run kept every chain inline
    assert (chains, inline_chains) == (6, 0), "collage::chain nodes (outlined, inline runs)"
    for p, hi, lo in zip(inline, his, los):
        assert torch.equal(p.detach(), hi)
        assert torch.equal(collage_compile.components(p)[1], lo)
    # and the pair carries what a real plain bf16 run of the same stream loses
    torch._dynamo.reset()
    plain, _, _, _ = _adamw_run(True, monkeypatch, foreach, mode=None)
    for p, q, r, s in zip(outlined, plain, refs, start):
        err = relative_error(mcf_value(p), r.detach(), s)
        plain_err = relative_error(q.detach().double(), r.detach(), s)
        assert err < plain_err / 10, (err, plain_err)


def _eager_plus_adamw(monkeypatch, outline: bool) -> tuple[list[torch.Tensor], str]:
    """Three plus-mode AdamW steps (foreach) whose rewritten graph runs eagerly, op by op,
    where Inductor would compile it: (each weight's and second moment's hi and lo after
    them, the rewritten graph as text)."""
    graphs = []

    def eager(gm, example_inputs, config_patches=None, cudagraphs=False):
        graphs.append(readable_with_chains(gm))
        return gm.forward

    with monkeypatch.context() as m:
        m.setattr(_compat, "compile_with_inductor", eager)
        if not outline:
            m.setattr(fuse, "outline", lambda *a, **k: None)
        torch._dynamo.reset()
        g = torch.Generator().manual_seed(0)
        shapes = [(8, 4), (4,)]
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
        step = torch.compile(opt.step, backend=collage_compile.make_backend(mode="plus"))
        for _ in range(3):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-3).bfloat16()
            step()
    tensors = [t for p in ps for t in (p, opt.state[p]["exp_avg_sq"])]
    pairs = [x.detach().clone() for t in tensors for x in collage_compile.components(t)]
    (text,) = graphs
    return pairs, text


def test_each_chain_is_one_node_whose_eager_op_computes_what_the_inline_nodes_compute(
    monkeypatch,
):
    """Run eagerly (any backend but Inductor), the ``collage::chain`` op executes its traced
    aten graph (Inductor's decompositions applied); the inline nodes it replaced execute as
    the torch ops the rewrite emitted.  Two code paths, the same bits over three steps."""
    outlined, text = _eager_plus_adamw(monkeypatch, outline=True)
    inline, inline_text = _eager_plus_adamw(monkeypatch, outline=False)
    # plus: the weight and the second moment of each parameter
    assert text.count("torch.ops.collage.chain.default(") == 4, "chains outlined"
    assert "65536.0" not in text.split("class chain_0")[0]  # no inline MCF arithmetic left
    assert "collage.chain" not in inline_text and "65536.0" in inline_text
    names = [f"{t}{i} {part}" for i in range(2) for t in ("weight", "v") for part in ("hi", "lo")]
    for name, a, b in zip(names, outlined, inline):
        assert torch.equal(a, b), f"{name}: the eager op differs from the inline nodes"
    assert all(lo.any() for lo in outlined[1::2])  # every lo carries something


def test_a_chain_autograd_would_record_stays_inline():
    # an EMA updated with grad mode on and a leaf requiring grad as operand: no autograd
    # formula for the op, so the chain stays as inline nodes
    import torch.fx as fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.mul, (x, 2.0))
    z = graph.call_function(torch.add, (y, 1.0))
    graph.output(z)
    x.meta["example_value"] = torch.ones(3, requires_grad=True)
    assert not fuse.outline(graph, [y, z], [z], grad_enabled=True)
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [torch.mul, torch.add]
    assert fuse.outline(graph, [y, z], [z], grad_enabled=False)
    assert next(n.target for n in graph.nodes if n.op == "call_function") is (
        torch.ops.collage.chain.default
    )


def _loop_bodies(mode: str | None, foreach: bool) -> tuple[int, int]:
    g = torch.Generator().manual_seed(0)
    ps = [
        torch.nn.Parameter(torch.randn(s, generator=g).bfloat16())
        for s in [(64, 32), (32,), (48, 16)]
    ]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=foreach)
    backend = "inductor" if mode is None else collage_compile.make_backend(mode=mode)
    torch._dynamo.reset()
    _, nodes, ops = _compat.run_and_count_loop_bodies(torch.compile(opt.step, backend=backend))
    return nodes, ops


@pytest.mark.parametrize("foreach", [True, False])
def test_inductor_walks_few_more_loop_bodies_than_for_plain_bf16(foreach):
    # Compile time after the rewrite grows with the scheduler nodes Inductor creates and
    # the FX nodes of their loop bodies (every stage of its C++ code generation runs
    # them).  Lowered node by node, a value the split reads three times was re-traced into
    # each reader and every output was computed into a buffer and copied: plus had 39
    # nodes / 1701 body nodes here (foreach), light 33 / 693, plain Inductor 18 / 300.
    # Measured at 109632e (torch 2.13): foreach plus 33 / 573, light 27 / 453; single-tensor
    # plus 39 / 678, light 33 / 555, plain 24 / 402.  Since each load checks that lo
    # belongs to hi (mcf.load_pair: five ops a load), about 8 % more.
    n_params = 3
    plain_nodes, plain_ops = _loop_bodies(None, foreach)
    light_nodes, light_ops = _loop_bodies("light", foreach)
    plus_nodes, plus_ops = _loop_bodies("plus", foreach)
    print(
        f"\nscheduler nodes / loop-body FX nodes (foreach={foreach}): plain "
        f"{plain_nodes} / {plain_ops}, light {light_nodes} / {light_ops}, "
        f"plus {plus_nodes} / {plus_ops}"
    )
    # light: the weight's correction word (computed once) and its lo, and the two step
    # scalars computed once per kernel; plus adds the second moment's pair
    assert light_nodes <= plain_nodes + 3 * n_params, (light_nodes, plain_nodes)
    assert plus_nodes <= plain_nodes + 5 * n_params, (plus_nodes, plain_nodes)
    assert light_ops <= 1.6 * plain_ops, (light_ops, plain_ops)
    assert plus_ops <= 2.2 * plain_ops, (plus_ops, plain_ops)


def _canonical(gm: torch.fx.GraphModule) -> str:
    """A graph's nodes with their targets and arguments, nodes named by position (names
    depend on how many nodes were made and erased before)."""
    index: dict[torch.fx.Node, int] = {}
    lines = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        lines.append(f"{n.op} {n.target if n.op != 'placeholder' else ''} {args}")
    return "\n".join(lines)


def _count_reuse(m: pytest.MonkeyPatch) -> list[bool]:
    """A list that gets, for every chain made from an earlier chain's plan
    (:func:`fuse.call_again`), whether it was made so."""
    made: list[bool] = []
    call_again = fuse.call_again

    def counted(*a, **k):
        out = call_again(*a, **k)
        made.append(out is not None)
        return out

    m.setattr(fuse, "call_again", counted)
    return made


def _rewritten_steps(monkeypatch, reuse_plans: bool) -> tuple[list[str], int]:
    """The graphs the backend hands Inductor for a few users' steps (run eagerly: the graph
    is the point here, the numerics tests run the same code through Inductor), and how
    many chains were made by reusing an earlier chain's plan."""
    from collage_compile import reuse

    graphs: list[str] = []

    def eager(gm, example_inputs, config_patches=None, cudagraphs=False):
        graphs.append(_canonical(gm))
        return gm.forward

    with monkeypatch.context() as m:
        m.setattr(_compat, "compile_with_inductor", eager)
        m.setattr(reuse, "ENABLED", reuse_plans)
        calls = _count_reuse(m)
        _compat.reset_dynamo()
        state.clear()
        watch.reset()
        g = torch.Generator().manual_seed(0)
        # plans differ by dtype, not by shape (a chain's trace is reused for another
        # shape where it is shape-free)
        shapes = [(8, 4), (4,), (8, 4), (4,), (8, 4), (3, 5), (8, 4), (6,), (8, 4)]
        half = (3, 6)
        ps = [
            torch.nn.Parameter(
                torch.randn(s, generator=g).to(torch.float16 if i in half else torch.bfloat16)
            )
            for i, s in enumerate(shapes)
        ]
        # AdamW plus with a schedule (the lr a symbolic float after the first change),
        # SGD with Nesterov momentum light, Adam one tensor at a time, an EMA's lerp
        adamw = torch.optim.AdamW(ps[:5], lr=1e-3, weight_decay=0.1, foreach=True)
        sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda k: 1.0 / (k + 1))
        sgd = torch.optim.SGD(ps[5:], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
        adam = torch.optim.Adam(ps[5:], lr=1e-3, foreach=False)
        ema = [p.detach().clone() for p in ps[:4]]
        steps = [
            torch.compile(adamw.step, backend=collage_compile.make_backend(mode="plus")),
            torch.compile(sgd.step, backend=collage_compile.make_backend(mode="light")),
            torch.compile(adam.step, backend=collage_compile.make_backend(mode="plus")),
        ]
        update_ema = torch.compile(
            lambda: torch._foreach_lerp_(ema, [p.detach() for p in ps[:4]], 0.1),
            backend="collage",
        )
        for _ in range(3):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
            for step in steps:
                step()
            sched.step()
            update_ema()
    return graphs, sum(calls)


def test_a_chain_of_an_earlier_chains_plan_is_its_call_on_other_tensors(monkeypatch):
    """``collage_compile.reuse``: a chain whose plan an earlier chain checked is emitted as
    that chain's call on its own inputs, without building its nodes; every graph is the one
    the full build makes, node for node (the numerics of such graphs are every other
    test's)."""
    built, none_reused = _rewritten_steps(monkeypatch, reuse_plans=False)
    reused, calls = _rewritten_steps(monkeypatch, reuse_plans=True)
    assert none_reused == 0
    assert calls > 0, "no chain was made from an earlier chain's plan"
    assert len(reused) == len(built) >= 4
    assert any("lerp" in g or "collage.chain" in g for g in built[-1:])
    for i, (a, b) in enumerate(zip(built, reused)):
        assert a == b, f"graph {i} differs when chains reuse plans"


def test_chains_made_from_an_earlier_chains_plan_compute_what_built_chains_compute(monkeypatch):
    """Compiled by Inductor: AdamW plus over five tensors, with chains made from an earlier
    chain's plan and with every chain built, gives the same bits, tracks the float64 run,
    and carries what plain bf16 loses on the same stream."""
    from collage_compile import reuse

    shapes = ((32, 16),) * 4 + ((16,),)
    with monkeypatch.context() as m:
        made = _count_reuse(m)
        reused, refs, start, _ = _adamw_run(True, m, True, steps=30, shapes=shapes)
    assert sum(made) >= 4, "chains made from an earlier chain's plan"
    torch._dynamo.reset()
    with monkeypatch.context() as m:
        m.setattr(reuse, "ENABLED", False)
        built, _, _, _ = _adamw_run(True, m, True, steps=30, shapes=shapes)
    for p, q in zip(reused, built):
        assert torch.equal(p.detach(), q.detach())
        assert torch.equal(collage_compile.components(p)[1], collage_compile.components(q)[1])
    torch._dynamo.reset()
    plain, _, _, _ = _adamw_run(True, monkeypatch, True, mode=None, steps=30, shapes=shapes)
    for p, q, r, s in zip(reused, plain, refs, start):
        err = relative_error(mcf_value(p), r.detach(), s)
        plain_err = relative_error(q.detach().double(), r.detach(), s)
        assert err < plain_err / 10, (err, plain_err)
