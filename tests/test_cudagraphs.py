"""What a CUDA graph needs from a collage step, checked where CI runs (a CPU).

``cudagraphs=True`` (``torch.compile(..., mode="reduce-overhead")``) asks Inductor to
capture every compiled graph as a CUDA graph, so a step costs one replay of host work.
Inductor captures a graph only if it runs no Python, writes no CPU tensor, and writes
only inputs whose address is fixed; these tests check each on the graphs the backend
hands to Inductor.  Whether the capture happens, and what it saves, needs a GPU
(``tests/test_triton.py``, docs/speed.md).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import CompiledGraphs, drifting_stream, relative_error, step_compiles
from torch._dynamo.testing import CompileCounterWithBackend
from user_optimizers import Lion

import collage_compile
from collage_compile import _compat

Warning = collage_compile.CollageWarning
STEPS = 40


def _run(start, grads, dtype, compile_step):
    ps = [torch.nn.Parameter(t.to(dtype, copy=True)) for t in start]
    opt = torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True)
    step = compile_step(opt)
    for gs in grads:
        for p, gr in zip(ps, gs):
            p.grad = gr.to(dtype)
        step()
    return ps


def test_reduce_overhead_on_cpu_compensates_and_says_once_that_nothing_is_captured():
    """The user's own ``mode="reduce-overhead"`` reaches the backend (it rejected every
    mode but the default before): on a CPU the step compiles, stays compensated, and one
    CollageWarning says no CUDA graph is captured."""
    start, grads = drifting_stream([(16, 8), (8,)], STEPS)
    ref = _run(start, grads, torch.float64, lambda opt: opt.step)
    plain = _run(start, grads, torch.bfloat16, lambda opt: opt.step)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        compiled = _run(
            start,
            grads,
            torch.bfloat16,
            lambda opt: torch.compile(opt.step, backend="collage", mode="reduce-overhead"),
        )
    said = [str(w.message) for w in rec if issubclass(w.category, Warning)]
    assert len(said) == 1 and "has no CUDA tensor" in said[0], said
    for p, r, p0, q in zip(compiled, ref, start, plain):
        err = relative_error(collage_compile.value(p), r.detach(), p0)
        plain_err = relative_error(q.detach(), r.detach(), p0)
        print(f"collage {err:.3g}  plain bf16 {plain_err:.3g}")
        assert err <= 0.02 < 0.5 < plain_err


def test_only_a_graph_with_cpu_work_is_named_as_not_captured():
    """torch.optim's step breaks its graph at ``_optimizer_step_code``; what Dynamo captures
    after it only ticks the optimizer watch (a CPU tensor), nothing a CUDA graph holds.  On
    the GPU image that graph was named "has no CUDA tensor" beside a captured CUDA step,
    a false alarm; the step's own graph on a CPU is still named."""
    from collage_compile import compiler, diagnostics, watch
    from collage_compile.config import CollageConfig

    watch.install()  # what puts the watch's op into the graph after the step
    config = CollageConfig(cudagraphs=True)
    graphs = []  # (only ticks the watch, what the backend said of it)

    def backend(gm, example_inputs):
        diagnostics.reset_warnings()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            compiled = compiler.compile_graph(gm, example_inputs, config)
        said = [str(w.message) for w in rec if "has no CUDA tensor" in str(w.message)]
        graphs.append((_compat.is_step_tick_graph(gm), said))
        return compiled

    torch._dynamo.reset()
    start, grads = drifting_stream([(16, 8), (8,)], STEPS)
    _run(start, grads[:2], torch.bfloat16, lambda opt: torch.compile(opt.step, backend=backend))
    assert sorted(ticks for ticks, _ in graphs) == [False, True], graphs
    for ticks, said in graphs:
        assert len(said) == (0 if ticks else 1), (ticks, said)


def test_every_input_a_rewritten_step_writes_keeps_its_address(monkeypatch):
    """Under cudagraph trees Inductor captures a graph only if every input it writes is
    static.  The step writes each parameter, its state and its lo: Dynamo marks the
    first two static, the backend marks the lo (``_compat.mark_static_input``); without
    that mark the lo inputs are the ones a capture would be refused for."""

    def written_not_static(mark=True):
        torch._dynamo.reset()
        if not mark:
            monkeypatch.setattr(_compat, "mark_static_input", lambda node: None)
        start, grads = drifting_stream([(16, 8), (8,), (8,)], STEPS)
        with _compat.cudagraph_inputs() as seen:
            _run(
                start,
                grads[:2],
                torch.bfloat16,
                lambda opt: torch.compile(
                    opt.step, backend=collage_compile.make_backend(mode="plus", cudagraphs=True)
                ),
            )
        ((written, static),) = [s for s in seen if s[0]]
        return written, written - static

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Warning)  # "no CUDA tensor": the test above
        written, refused = written_not_static()
        # 3 weights, 3 first moments, 3 second moments, 3 step counts, 3 + 3 lo
        assert len(written) == 18 and refused == set()
        _, unmarked = written_not_static(mark=False)
    assert len(unmarked) == 6, unmarked  # the six lo


def _scheduled(start, grads, dtype, backend=None, device="cpu"):
    """Two param groups (decay on matrices only) under a warmup from lr = 0: a new float
    lr per group every step.  Returns the weights, how many graphs ``backend`` compiled
    (``None``: eager) and a function that runs one more step."""
    ps = [torch.nn.Parameter(t.to(device, dtype, copy=True)) for t in start]
    groups = [{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, i / 10))
    counter = CompiledGraphs(backend) if backend is not None else None
    step = torch.compile(opt.step, backend=counter) if counter is not None else opt.step

    def one(gs):
        for p, gr in zip(ps, gs):
            p.grad = gr.to(device, dtype)
        step()
        sched.step()

    def again():  # new gradient tensors, made before the step so that a profile sees it alone
        for p, gr in zip(ps, grads[-1]):
            p.grad = gr.to(device, dtype, copy=True)
        with torch.profiler.record_function("step"):
            step()
        sched.step()

    for gs in grads:
        one(gs)
    return ps, step_compiles(counter) if counter is not None else 0, again


def test_a_scheduled_lr_reaches_a_captured_step_as_a_tensor_that_keeps_its_address():
    """A scheduled lr reaches the step as a 0-dim CPU float64 input.  Captured, Inductor
    copied it to the device outside the CUDA graph into a new tensor each step, and the
    replay's one ``_foreach_copy_`` of non-static inputs took its per-tensor loop for
    the float64 among bf16 gradients (on the H100, 41 of the 142 ms that 100 profiled
    steps of 75 tensors took).  With
    ``cudagraphs=True`` the backend passes each lr in a tensor of its own on the step's
    device, marked static (``rewrite.scalars_as_static_inputs``): one static input more
    per param group, the same weights bit for bit, one compile for every lr."""
    start, grads = drifting_stream([(16, 8), (8,)], STEPS)
    ref, _, _ = _scheduled(start, grads, torch.float64)
    plain, _, _ = _scheduled(start, grads, torch.bfloat16)
    runs = {}
    for cg in (False, True):
        torch._dynamo.reset()
        backend = collage_compile.make_backend(mode="light", cudagraphs=cg)
        with _compat.cudagraph_inputs() as seen, warnings.catch_warnings():
            warnings.simplefilter("ignore", Warning)  # "no CUDA tensor": a CPU
            ps, compiles, _ = _scheduled(start, grads, torch.bfloat16, backend)
        ((_, static),) = [s for s in seen if s[0]]
        runs[cg] = ps, compiles, static
    (uncaptured, n0, static0), (captured, n1, static1) = runs[False], runs[True]
    assert n0 == n1 == 1, (n0, n1)
    assert len(static1) == len(static0) + 2, (static0, static1)  # an lr per group
    for a, b in zip(captured, uncaptured):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(collage_compile.components(a)[1], collage_compile.components(b)[1])
    for p, r, p0, q in zip(captured, ref, start, plain):
        err = relative_error(collage_compile.value(p), r.detach(), p0)
        plain_err = relative_error(q.detach(), r.detach(), p0)
        print(f"collage {err:.3g}  plain bf16 {plain_err:.3g}")
        assert err <= 0.02 < 0.5 < plain_err


def test_the_optimizer_watch_runs_after_a_graph_that_holds_the_step(capture):
    """A step Dynamo captures whole (a user's optimizer) has the watch's op in its graph;
    the backend takes it out (it runs Python on a CPU tensor, which keeps a CUDA graph
    from being captured) and its wrapper runs the watch after the call: an EMA written
    eagerly is named right after the next step, before its own graph runs again."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(32, generator=g).bfloat16())
    opt = Lion([p], lr=1e-3)
    counter = CompileCounterWithBackend(collage_compile.backend)
    step = torch.compile(opt.step, backend=counter)
    ema = [p.detach().clone()]

    def ema_update():
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p], 0.01)

    ema_step = torch.compile(ema_update, backend=collage_compile.backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)
        for _ in range(3):
            p.grad = torch.randn(32, generator=g).bfloat16()
            step()
            ema_step()
    tick = "collage.optimizer_stepped"
    assert any(_compat.has_step_ticks(gm) for gm in counter.graphs)
    assert capture.graphs and not any(tick in text for text in capture.graphs)
    with torch.no_grad():
        ema[0].mul_(0.5)  # eagerly: the pair's lo no longer belongs to it
    p.grad = torch.randn(32, generator=g).bfloat16()
    with pytest.warns(Warning, match="written outside every collage-compiled step"):
        step()


def test_a_graph_inductor_does_not_capture_is_named_by_what_it_updates():
    """Inductor says it skips a capture through ``log_cudagraph_skip_and_bump_counter``
    (at compile time, or when cudagraph trees first run a graph); while a collage graph
    is being compiled or called, the backend turns that into a CollageWarning naming the
    graph.  Skips outside a collage graph are Inductor's to report."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from collage_compile import watch

    watch.install()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a reason of its own")
        with watch.in_call("the graph that updates fc1.weight"):
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1)")
    said = [str(w.message) for w in rec if issubclass(w.category, Warning)]
    assert len(said) == 1, said
    assert "the graph that updates fc1.weight as a CUDA graph" in said[0]
    assert "mutated inputs (1)" in said[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_step_is_captured_once_and_replayed_compensated():
    """On a GPU: ``mode="reduce-overhead"`` captures the collage step (no cudagraph skip,
    no CollageWarning) and every replay stays compensated against float64."""
    from torch._dynamo.utils import counters

    start, grads = drifting_stream([(256, 64), (64,)], STEPS)
    dev = [[gr.cuda() for gr in gs] for gs in grads]
    ref = _run([t.cuda() for t in start], dev, torch.float64, lambda opt: opt.step)
    plain = _run([t.cuda() for t in start], dev, torch.bfloat16, lambda opt: opt.step)
    skips = counters["inductor"]["cudagraph_skips"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)
        compiled = _run(
            [t.cuda() for t in start],
            dev,
            torch.bfloat16,
            lambda opt: torch.compile(opt.step, backend="collage", mode="reduce-overhead"),
        )
    assert counters["inductor"]["cudagraph_skips"] == skips
    for p, r, p0, q in zip(compiled, ref, start, plain):
        err = relative_error(collage_compile.value(p).cpu(), r.detach().cpu(), p0)
        plain_err = relative_error(q.detach().cpu(), r.detach().cpu(), p0)
        assert err <= 0.02 < 0.5 < plain_err, (err, plain_err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_captured_cuda_step_takes_a_scheduled_lr_without_a_copy_per_gradient():
    """On a GPU, under a warmup from lr = 0: the captured step compiles once and stays
    compensated; its code does no CPU work before the replay (before
    ``rewrite.scalars_as_static_inputs``: a C++ kernel writing the lr into a pinned buffer
    copied to the device); a steady step copies its gradients into the graph's inputs
    with one ``_foreach_copy_``, not one ``aten::copy_`` per gradient (its per-tensor
    loop, which a float64 lr among the bf16 gradients caused)."""
    start, grads = drifting_stream([(256, 64), (64,), (64, 32), (32,)], STEPS)
    ref, _, ref_again = _scheduled(start, grads, torch.float64, device="cuda")
    plain, _, plain_again = _scheduled(start, grads, torch.bfloat16, device="cuda")
    ref_again(), plain_again()  # the profiled step below is one more step of the stream
    torch._dynamo.reset()
    backend = collage_compile.make_backend(mode="light", cudagraphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Warning)
        (ps, compiles, again), code = _compat.run_and_keep_kernel_code(
            _scheduled, start, grads, torch.bfloat16, backend, "cuda", fresh=True
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            again()
    assert compiles == 1, compiles
    cpu_work = ("empty_strided_cpu_pinned((", "empty_strided_cpu((", "cpp_fused_")
    prologue = [c for c in code if any(w in c for w in cpu_work)]
    assert not prologue, prologue[0][-3000:]
    (window,) = [e for e in prof.events() if e.name == "step"]
    inside = window.time_range
    copies = [
        e.name
        for e in prof.events()
        if e.name == "aten::copy_" and inside.start <= e.time_range.start <= inside.end
    ]
    # one per gradient: _foreach_copy_'s slow loop (the first GPU run counted the test's
    # own host-to-device copies of the new gradients, made before the step)
    assert len(copies) < len(ps), copies
    for p, r, p0, q in zip(ps, ref, start, plain):
        err = relative_error(collage_compile.value(p).cpu(), r.detach().cpu(), p0)
        plain_err = relative_error(q.detach().cpu(), r.detach().cpu(), p0)
        assert err <= 0.02 < 0.5 < plain_err, (err, plain_err)


def test_a_mode_the_backend_does_not_take_is_refused_by_name():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    opt = torch.optim.SGD([p], lr=0.1)
    step = torch.compile(opt.step, backend="collage", mode="max-autotune")
    with pytest.raises(Exception, match="only 'default' and 'reduce-overhead'"):
        step()
