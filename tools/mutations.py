"""A pytest plugin that breaks collage_compile in memory, never on disk, to show that a test
fails when the behaviour it names breaks (issue 30's closing note names one per test):

    PYTHONPATH=tools MUT=keep_restored_lo python -m pytest -p mutations \
        tests/test_checkpoint.py::test_a_restored_lo_is_dropped_when_other_weights_are_loaded_after_it

must FAIL.  ``MUT`` takes comma-separated names (see ``_apply``); some read ``MUT_BITS``,
``MUT_K`` or ``MUT_MATCH``.  Not part of the suite: each run is one test under one mutation.
"""

import operator
import os
import types
from collections.abc import Callable

import torch


def pytest_configure(config):
    names = list(filter(None, os.environ.get("MUT", "").split(",")))
    if names:
        # a kernel cached by an unbroken run would hide the mutation: the keys of the
        # backend's Inductor passes hash their source files, not what they do in memory
        torch.compiler.config.force_disable_caches = True
    for name in names:
        _apply(name)


# name -> the function that applies it; prefix -> the same for a family of names
_MUTATIONS: dict[str, Callable[[str], None]] = {}
_FAMILIES: dict[str, Callable[[str], None]] = {}


def _apply(name: str) -> None:
    apply = _MUTATIONS.get(name)
    if apply is None:
        apply = next((f for p, f in _FAMILIES.items() if name.startswith(p)), None)
    if apply is None:
        raise SystemExit(f"unknown MUT={name}")
    apply(name)
    print(f"\n*** mutation applied: {name}")


def _mutation(*names: str, family: str | None = None):
    """Register the decorated function as the mutation(s) ``names`` (or every name that
    starts with ``family``); it is called with the name asked for."""

    def register(fn):
        _MUTATIONS.update(dict.fromkeys(names, fn))
        if family is not None:
            _FAMILIES[family] = fn
        return fn

    return register


@_mutation("keep_restored_lo")
def _keep_restored_lo(name):
    """Item 1: skip the drop of a restored lo."""
    from collage_compile import state

    orig = state.check

    def check(t, lo, name=""):
        saved = lo.detach().clone()
        why = orig(t, lo, name)
        if why is not None and "saved with" in why:
            with torch.no_grad():
                lo.copy_(saved)
        return why

    state.check = check


@_mutation("eager_op_drops_lo")
def _eager_op_drops_lo(name):
    """Item 2: the op's eager kernel is not the chain."""
    import copy

    from collage_compile import fuse

    orig = fuse._graph
    cache = {}

    def _graph(key):
        if key not in cache:
            gm = copy.deepcopy(orig(key))
            out = next(n for n in gm.graph.nodes if n.op == "output")
            vals = list(out.args[0])
            with gm.graph.inserting_before(out):
                for i in range(1, len(vals), 2):  # every lo output times zero
                    vals[i] = gm.graph.call_function(torch.ops.aten.mul.Tensor, (vals[i], 0.0))
            out.args = (tuple(vals),)
            gm.recompile()
            cache[key] = gm
        return cache[key]

    fuse._graph = _graph


@_mutation("outline_patch_unseen")
def _outline_patch_unseen(name):
    """Item 3: rewrite binds outline at import."""
    from collage_compile import fuse, rewrite

    real = fuse.outline
    rewrite.fuse = types.SimpleNamespace(outline=real)


@_mutation("outline_noop")
def _outline_noop(name):
    """Fuse.outline keeps every chain inline."""
    from collage_compile import fuse

    fuse.outline = lambda *a, **k: False


@_mutation("report_drops_params")
def _report_drops_params(name):
    """The report loses its parameter rows."""
    from collage_compile import report

    orig_build = report.GraphReport.build.__func__

    def build(cls, *a, **k):
        rep = orig_build(cls, *a, **k)
        rep.entries = [e for e in rep.entries if e.role != "param"]
        return rep

    report.GraphReport.build = classmethod(build)


@_mutation("restore_zero_lo")
def _restore_zero_lo(name):
    """A restored all-zero lo is allocated, not skipped."""
    from collage_compile import checkpoint

    checkpoint._all_zero = lambda lo: False


@_mutation("complex32_unmoved")
def _complex32_unmoved(name):
    """The backend's step leaves complex32 weights as they were."""
    from collage_compile import compiler

    orig = compiler._compile_graph

    def _compile_graph(gm, ex, config, record=True):
        fn = orig(gm, ex, config, record)
        attrs = [
            getattr(gm, n.target)
            for n in gm.graph.nodes
            if n.op == "get_attr" and getattr(gm, n.target).dtype == torch.complex32
        ]

        def run(*args):
            saved = [t.detach().clone() for t in attrs]
            out = fn(*args)
            with torch.no_grad():
                for t, s in zip(attrs, saved):
                    t.copy_(s)
            return out

        return run

    compiler._compile_graph = _compile_graph


@_mutation("gpt_zero_grads", "gpt_head_detached")
def _gpt_forward(name):
    """The GPT demo's gradients all zero, or its output layer detached from the shared
    matrix."""
    import torch.nn.functional as F

    from collage_compile import demo

    orig_forward = demo.GPT.forward

    def forward(self, idx, targets):
        if name == "gpt_zero_grads":  # every grad exists and is zero
            loss = orig_forward(self, idx, targets)
            return loss.detach() + 0 * loss
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        # the output layer reads the shared matrix without a gradient
        logits = F.linear(self.ln_f(x), self.wte.weight.detach())
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    demo.GPT.forward = forward


@_mutation(family="bench_")
def _bench(name):
    """``benchmarks.step`` as if it reported a broken number."""
    import json
    import pathlib
    import subprocess

    kind = name[len("bench_") :]
    orig_run = subprocess.run

    def run(cmd, *a, **k):
        proc = orig_run(cmd, *a, **k)
        if not (isinstance(cmd, list) and "benchmarks.step" in cmd):
            return proc
        out = pathlib.Path(cmd[cmd.index("--json") + 1])
        res = json.loads(out.read_text())
        rows = {r["variant"]: r for r in res["rows"]}
        for r in res["rows"]:
            if kind == "compile_warm" and r["compile_s"] is not None:
                r["compile_s"] = r["ms_per_step"] / 1e3  # timed a warm call
            elif kind == "peak_mib":
                r["peak_MB"] = r["peak_MB"] * 1e6 / 2**20
            elif kind == "ms_in_s":
                r["ms_per_step"] /= 1e3
            elif kind == "bandwidth_bits":
                r["of_copy_bandwidth"] *= 8
        if kind == "step_did_nothing":  # every column consistent with a 20x faster step
            r, base = rows["collage plus"], rows["plain bf16"]["ms_per_step"]
            ms = r["ms_per_step"] = base / 20
            r["ns_per_param"] = ms * 1e6 / res["params"]
            r["vs_plain_bf16"] = ms / base
            r["vs_fp32_master"] = ms / rows["fp32 master (16,32)"]["ms_per_step"]
            r["floor_GBps"] = r["floor_bytes_per_param"] * res["params"] / (ms / 1e3) / 1e9
            r["of_copy_bandwidth"] = r["floor_GBps"] / res["copy_GBps"]
        out.write_text(json.dumps(res))
        return proc

    subprocess.run = run


@_mutation(family="demo_")
def _demo(name):
    """The demo's summary as if it reported a broken number."""
    from collage_compile import demo

    orig_summary = demo._Run.summary

    def summary(self, n_params, wall):
        out = orig_summary(self, n_params, wall)
        if name == "demo_ms_in_s":
            out["ms_per_step"] /= 1e3
        elif name == "demo_opt_from_t0":  # optimizer time measured from the step's start
            out["opt_ms"], out["opt_ms_per_step"] = out["step_ms"], out["ms_per_step"]
        elif name == "demo_first_step":  # the compiling first step as ms/step
            out["ms_per_step"] = out["step_ms"][0]
        elif name == "demo_tied_twice":  # the tied matrix counted twice
            out["n_params"] += 256 * 16
            out["bytes_per_param"] = out["persistent_bytes"] / out["n_params"]
        return out

    demo._Run.summary = summary


@_mutation("rewrite_nothing")
def _rewrite_nothing(name):
    """The pass rewrites nothing (report unchanged)."""
    from collage_compile import rewrite

    rewrite.emit = lambda *a, **k: []


@_mutation("lo_not_fed")
def _lo_not_fed(name):
    """Lo allocated, never read or written: plain bf16 numerics."""
    from collage_compile import compiler

    orig_call = compiler._LoInputs.__call__

    def call(self, *args):
        compiled = self.compiled
        n = len(self._call_los)

        def run(*a):
            head, los = a[: len(a) - n], a[len(a) - n :]
            return compiled(*head, *[torch.zeros_like(x) for x in los])

        self.compiled = run
        try:
            return orig_call(self, *args)
        finally:
            self.compiled = compiled

    compiler._LoInputs.__call__ = call


@_mutation("zero_lo_at_call")
def _zero_lo_at_call(name):
    """Each graph drops its lo once, at its MUT_K-th call."""
    from collage_compile import compiler

    orig_call = compiler._LoInputs.__call__
    k = int(os.environ.get("MUT_K", "2"))

    def call(self, *args):
        self._mut_calls = getattr(self, "_mut_calls", 0) + 1
        if self._mut_calls == k:
            self._refresh(self._attr_tensors())
            for lo in self._call_los:
                if lo is not None:
                    lo.zero_()
        return orig_call(self, *args)

    compiler._LoInputs.__call__ = call


@_mutation("lo_bits")
def _lo_bits(name):
    """After each call, keep only MUT_BITS mantissa bits of each lo."""
    from collage_compile import compiler

    orig_call = compiler._LoInputs.__call__
    bits = int(os.environ.get("MUT_BITS", "2"))
    mask = ~((1 << (7 - bits)) - 1) & 0xFFFF

    def call(self, *args):
        out = orig_call(self, *args)
        for lo in self._call_los:
            if lo is not None and lo.dtype == torch.bfloat16:
                v = lo.view(torch.int16)
                v.copy_((v.to(torch.int32) & mask).to(torch.int16))
        return out

    compiler._LoInputs.__call__ = call


@_mutation("zero_lo_on_recompile")
def _zero_lo_on_recompile(name):
    """Lo kept by identity but zeroed at a recompile."""
    from collage_compile import compiler, state

    orig = compiler._compile_graph
    calls = []

    def _compile_graph(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            for _, lo in list(state._entries.values()):
                lo.zero_()
        return orig(*a, **k)

    compiler._compile_graph = _compile_graph


@_mutation("keep_lo_after_non_accumulation")
def _keep_lo_after_non_accumulation(name):
    """Item 7: no restart after a write that is not an accumulation (abs_)."""
    from collage_compile import compiler, rewrite

    compiler._LoInputs._reset_unchained = lambda self, args: None
    orig_emit = rewrite.emit

    def emit(gm, info, chains, unsupported, *a, **k):
        return orig_emit(gm, info, chains, [], *a, **k)

    rewrite.emit = emit


@_mutation("mode_off_where")
def _mode_off_where(name):
    """``mode="off"`` for graphs whose code has MUT_MATCH."""
    import dataclasses

    from collage_compile import compiler

    orig = compiler._compile_graph
    match = os.environ["MUT_MATCH"]

    def _compile_graph(gm, ex, config, record=True):
        if match in gm.code:
            config = dataclasses.replace(config, mode="off")
        return orig(gm, ex, config, record)

    compiler._compile_graph = _compile_graph


@_mutation("mode_off")
def _mode_off(name):
    import dataclasses

    from collage_compile import compiler

    orig = compiler._compile_graph

    def _compile_graph(gm, ex, config, record=True):
        return orig(gm, ex, dataclasses.replace(config, mode="off"), record)

    compiler._compile_graph = _compile_graph


@_mutation("replay_stale_lr")
def _replay_stale_lr(name):
    """A replay keeps the lr of the recorded step."""
    from collage_compile import replay

    replay._Plan.refresh = lambda self: None


@_mutation("replay_stale_grads")
def _replay_stale_grads(name):
    """A replay reads the recorded step's gradients."""
    from collage_compile import replay

    replay._Plan._copy_grads = lambda self, grads: None


@_mutation("replay_never_gives_way")
def _replay_never_gives_way(name):
    """A replay runs whatever changed (new gradients still copied where they fit)."""
    from collage_compile import replay

    def stale(self, copy_grads=False):
        grads = [p.grad for p in self.params]
        if copy_grads and [g is None for g in grads] == self.none:
            self._copy_grads(grads)

    replay._Plan.stale = stale


@_mutation("replay_writes_held_grads")
def _replay_writes_held_grads(name):
    """New gradients copied into the recorded ones."""
    import contextlib

    from collage_compile import replay

    def copy_into_recorded(self, grads):
        now = [grads[i] for i in self.grad_index]
        if not all(map(operator.is_, now, self.static_grads)):
            torch._foreach_copy_(self.static_locals, now)

    replay._Plan._copy_grads = copy_into_recorded
    replay._Plan._private_grads = lambda self: None
    replay._own_grads = lambda optimizer: contextlib.nullcontext()


@_mutation("grad_layout_unchecked")
def _grad_layout_unchecked(name):
    """A gradient's strides trusted, as Dynamo does."""
    from collage_compile import compiler

    compiler._LoInputs.expect_grad_layouts = lambda self, example_inputs: None


@_mutation("low_precision_tiles")
def _low_precision_tiles(name):
    """Inductor tiles bf16 as it comes."""
    import contextlib

    from collage_compile import _compat

    _compat.no_low_precision_tiles = contextlib.nullcontext


@_mutation("replay_misses_silently")
def _replay_misses_silently(name):
    """A replay that keeps giving way is not named."""
    from collage_compile import replay

    replay.WholeStep._missed = lambda self, why: None


@_mutation("replay_ignores_addresses")
def _replay_ignores_addresses(name):
    """Identity trusted: t.data = ... unseen."""
    from collage_compile import replay

    replay._Plan._where = lambda self: self.places


@_mutation("replay_ignores_global_state")
def _replay_ignores_global_state(name):
    """Autocast & co. unread by a replay."""
    from collage_compile import _compat

    _compat.global_state = lambda: lambda: True


@_mutation("replay_ignores_list_settings")
def _replay_ignores_list_settings(name):
    """A list changed in place passes."""
    from collage_compile import replay

    orig = replay._Settings.__init__

    def init(self, group, filled):
        orig(self, group, filled)
        self.lists = []

    replay._Settings.__init__ = init


@_mutation("grad_dtype_unchecked")
def _grad_dtype_unchecked(name):
    """A gradient's dtype trusted, as Dynamo does."""
    from collage_compile import compiler

    compiler._DTYPE = lambda g: None
    orig = compiler._LoInputs.expect_grad_layouts

    def expect(self, example_inputs):
        orig(self, example_inputs)
        self._grad_dtypes = [None] * len(self._grad_dtypes)

    compiler._LoInputs.expect_grad_layouts = expect


@_mutation("replay_ignores_outside_writes")
def _replay_ignores_outside_writes(name):
    """Only the per-graph check skipped."""
    from collage_compile import compiler

    compiler._LoInputs.replay_blocker = lambda self, tensors=None: None


@_mutation("keep_float_specializations")
def _keep_float_specializations(name):
    """Torch's tensorify mark outlives a graph."""
    from collage_compile import _compat

    _compat.forget_float_specializations = lambda: None


@_mutation("uncompiled_step_silent")
def _uncompiled_step_silent(name):
    """A compiled optimizer's eager step unnamed."""
    from collage_compile import watch

    watch._uncompiled_step = lambda optimizer, written, count: None


@_mutation("fp32_graph_specializes")
def _fp32_graph_specializes(name):
    """A graph with nothing to upgrade: no scalars pass."""
    from collage_compile import compiler, passes

    orig = compiler._compile_rewritten

    def _compile_rewritten(gm, example_inputs, config, record):
        if not any(
            getattr(n.meta.get("example_value"), "dtype", None) in (torch.bfloat16, torch.float16)
            for n in gm.graph.find_nodes(op="placeholder")
        ):
            finalize, passes.finalize = passes.finalize, lambda gm: {}
            try:
                return orig(gm, example_inputs, config, record)
            finally:
                passes.finalize = finalize
        return orig(gm, example_inputs, config, record)

    compiler._compile_rewritten = _compile_rewritten


@_mutation("speculation_kept")
def _speculation_kept(name):
    """A float restart replays the first trace's log."""
    from collage_compile import _compat

    _compat.before_float_restart = lambda error: None


@_mutation("replay_ignores_guards")
def _replay_ignores_guards(name):
    """The compile's guards on filled floats unread."""
    from collage_compile import _compat

    _compat.float_guards = lambda fake: []


@_mutation("scalars_inline")
def _scalars_inline(name):
    """C++ loops compute the step's scalars per vector."""
    from collage_compile import _compat

    _compat.scalar_prologue_patch = lambda: {}


@_mutation("fixed_unwatched")
def _fixed_unwatched(name):
    """Another parameter's new layout goes unchecked."""
    from collage_compile import compiler

    compiler._LoInputs.watch_layouts = lambda self, gm: None


@_mutation("restores_unnamed")
def _restores_unnamed(name):
    """A weight restored from a snapshot between updates is not counted, so not named."""
    from collage_compile import compiler

    compiler._LoInputs.watch_restores = lambda self, slots: None


@_mutation("plus_leaves_sums")
def _plus_leaves_sums(name):
    """``"plus"`` carries decays near 1 but not sums (b = 1): schedule-free's ``z`` plain."""
    from collage_compile import modes

    modes._sums = lambda acc, steps: False


@_mutation("lerp_keywords_specialize")
def _lerp_keywords_specialize(name):
    """A ``lerp`` whose operands are keywords keeps its float weight (it specializes)."""
    from collage_compile.passes import scalars

    orig = scalars._lerp_operands
    scalars._lerp_operands = lambda args, kwargs: [None] if kwargs else orig(args, kwargs)


@_mutation("foreach_lerp_keywords_specialize")
def _foreach_lerp_keywords_specialize(name):
    """A ``_foreach_lerp_`` given its weight by keyword (schedule-free's
    ``weight=ckp1``) keeps its float weight (it specializes), as before."""
    from collage_compile.passes import scalars

    orig = scalars._rewrite_foreach

    def rewrite(graph, node, op, tensors):
        return None if op == "lerp" and node.kwargs else orig(graph, node, op, tensors)

    scalars._rewrite_foreach = rewrite


@_mutation("foreach_sub_kept")
def _foreach_sub_kept(name):
    """``_foreach_sub`` keeps its ``alpha`` (torch 2.11's Inductor then drops it)."""
    from collage_compile.passes import foreach_sub

    foreach_sub.run = lambda gm: 0


@_mutation("float_max_and_int_pow_unmirrored")
def _float_max_and_int_pow_unmirrored(name):
    """A float's ``max()`` and a step count's power are not mirrored as tensor arithmetic
    (torch 2.11's tensorification then specializes the float; 2.13's does not)."""
    import operator

    import torch

    from collage_compile.passes import _common

    for op in (operator.pow, torch.sym_max, torch.sym_min):
        _common._FLOAT_ARITHMETIC.pop(op)
    _common._is_symbolic_int = lambda node: False


@_mutation("size_arithmetic_mirrored")
def _size_arithmetic_mirrored(name):
    """Float arithmetic on sizes alone is rebuilt as float64 tensors too."""
    from collage_compile.passes import _common

    _common._reads_a_float_input = lambda x: True


@_mutation("float_lists_specialize")
def _float_lists_specialize(name):
    """``torch.tensor([floats])`` keeps its floats (they specialize), as before."""
    from collage_compile.passes import scalars

    scalars._floats_list = lambda x: False


@_mutation("clamps_left")
def _clamps_left(name):
    """A clamp of a weight is not a bound the pair carries: lo restarts after it (named)."""
    from collage_compile.passes import copy_expr, maximum

    orig = maximum._bounds
    clamps = {"clamp_", "clip_", "clamp_min_", "clamp_max_", "clamp(out=)", "clip(out=)"}
    maximum._bounds = lambda info, write: None if write.op in clamps else orig(info, write)
    copy_expr._READINGS = tuple(r for r in copy_expr._READINGS if "clamp" not in r[0])


@_mutation("min_as_max")
def _min_as_max(name):
    """A minimum carried as a maximum (the upper bound of a clamp ignored)."""
    from collage_compile import mcf, rewrite

    rewrite._BOUNDS["min"] = mcf.pair_max


@_mutation("difference_by_alpha_plain")
def _difference_by_alpha_plain(name):
    """``x.add_(end - x, alpha=w)`` an addition of ``end - x`` computed from the heads."""
    from collage_compile.passes import lerp

    lerp._difference_by_alpha = lambda info, write, diff, alpha: None


@_mutation("weight_copies_left")
def _weight_copies_left(name):
    """A copy of weights (Lookahead's ``slow.copy_(p)``) left as written: the head alone."""
    from collage_compile import modes

    modes._copies_weights = lambda info, writes, sites: False


@_mutation("snapshots_hold_hi")
def _snapshots_hold_hi(name):
    """A clone of a weight returned by a collage graph holds the head alone (no lo)."""
    from collage_compile import rewrite

    rewrite.weight_clones = lambda info: []


@_mutation("fp32_restores_named")
def _fp32_restores_named(name):
    """A restore from an fp32 source counted as one that drops lo."""
    from collage_compile import compiler

    compiler._no_finer = lambda source, acc: True


@_mutation("sums_read_themselves")
def _sums_read_themselves(name):
    """An addition of something computed from the tensor itself counts as a sum."""
    from collage_compile import modes

    modes._addend_reads = lambda step, acc: False


@_mutation("scaled_weight_in_bf16")
def _scaled_weight_in_bf16(name):
    """``x.add_(y * c)`` of another weight adds the bf16 product of its head."""
    from collage_compile.passes import additive

    additive._scaled_tensor = lambda info, write, other, alpha: (other, alpha)


@_mutation("folds_changed_products")
def _folds_changed_products(name):
    """``add_(y * c)`` folded even where the product was changed in place before the add."""
    from collage_compile.passes import additive

    orig = additive._scaled_tensor

    def scaled(info, write, other, alpha):
        real = info.written_between
        info.written_between = lambda node, a, b: False if node is other else real(node, a, b)
        try:
            return orig(info, write, other, alpha)
        finally:
            info.written_between = real

    additive._scaled_tensor = scaled


@_mutation("outputs_left_shared")
def _outputs_left_shared(name):
    """New state Inductor returns on a gradient's or another output's memory kept there."""
    from collage_compile import outputs

    outputs.separated = lambda out, args, found: out


@_mutation("state_keys_are_tensors")
def _state_keys_are_tensors(name):
    """Every key of an optimizer's state taken for a parameter (MADGRAD's ``state["k"]``)."""
    from collage_compile import names

    def name_optimizer_state():
        for opt in (r() for r in names._optimizers):
            for p in opt.state if opt is not None else ():
                names._given.get(p)

    names._name_optimizer_state = name_optimizer_state


@_mutation("working_copies_left")
def _working_copies_left(name):
    """An fp32 working copy updated in place and copied back left as Dynamo wrote it."""
    from collage_compile import passes

    passes.NORMALIZATIONS = tuple(n for n in passes.NORMALIZATIONS if n[0] != "working_copy")


@_mutation("told_by_name")
def _told_by_name(name):
    """A tensor not upgraded is named once per name, whatever tensor bears it."""
    from collage_compile import report

    report._untold = lambda reason, entries: None


@_mutation("writes_after_grad_restore")
def _writes_after_grad_restore(name):
    """Exact mode's write-backs after the grad mode Dynamo restores at a step's end."""
    from collage_compile.passes import promote

    promote._grad_mode_at_end = lambda graph: False


@_mutation("attr_grads_unpromoted")
def _attr_grads_unpromoted(name):
    """Only torch.optim's ``GradSource`` gradients are gradients (not ``p.grad`` read by
    other code, ``AttrSource``): exact mode computes ops on them alone in bf16."""
    from torch._dynamo.source import GradSource

    from collage_compile import _compat

    _compat.is_gradient_input = lambda node: isinstance(
        getattr(node, "_dynamo_source", None), GradSource
    )


@_mutation("made_state_left_low")
def _made_state_left_low(name):
    """Exact mode leaves state the graph makes in bf16 as made, and returns a tensor
    written through an fp32 copy as it was made."""
    from collage_compile.passes import promote

    promote._made_as_state = lambda graph: set()
    orig = promote._Walk.output

    def output(self, node, tensors):
        self.env = {k: v for k, v in self.env.items() if k.op in ("placeholder", "get_attr")}
        return orig(self, node, tensors)

    promote._Walk.output = output


@_mutation("upcast_names_stale")
def _upcast_names_stale(name):
    """Exact mode: a tensor upcast where an op writes it is read as the copy only under
    the name written (``t.mul_(b).add_(x)`` writes ``mul_``), not its other names (``t``)."""
    from collage_compile.passes import promote

    orig = promote._Walk._upcast_operands

    def upcast(self, node):
        self.names, self.same = {}, {}
        return orig(self, node)

    promote._Walk._upcast_operands = upcast


@_mutation("no_state_made")
def _no_state_made(name):
    """Exact mode sends a graph that writes no input to plain Inductor even where it makes
    optimizer state (ADOPT's first step)."""
    from collage_compile import exact

    exact.makes_state = lambda gm, info: False


@_mutation("paired_reads_dropped")
def _paired_reads_dropped(name):
    """Exact mode reads state it does not write as bf16, without its remainder."""
    from collage_compile import exact

    exact._paired_reads = lambda info, chained, readers: []


@_mutation("replaced_state_unnamed")
def _replaced_state_unnamed(name):
    """State a step replaces (``state["v"] = b2 * v + ...``) is not named."""
    from collage_compile import report

    report._replaced_state = lambda info, mode: []


@_mutation("math_pow_specialized")
def _math_pow_specialized(name):
    """Dynamo keeps specializing a Python int read through ``math.pow``."""
    from collage_compile import _compat

    _compat.trace_math_pow_symbolically = lambda: None


@_mutation("paired_reads_everywhere")
def _paired_reads_everywhere(name):
    """Exact mode reads every paired bf16 input it does not upgrade with its remainder:
    weights a forward reads, memory the graph writes."""
    from collage_compile import exact

    exact._read_with_remainder = lambda info, a, written: True


@_mutation("written_grads_upcast")
def _written_grads_upcast(name):
    """Every ``.grad`` input is a gradient in exact mode, written ones too."""
    from collage_compile import _compat, exact

    exact._gradients = lambda info: [
        a for a in info.accumulators if _compat.is_gradient_input(a.node)
    ]


@_mutation("grad_readers_make_state")
def _grad_readers_make_state(name):
    """A graph that reads a gradient and returns a bf16 tensor makes state, even one whose
    outputs require grad (a training forward)."""
    from collage_compile import exact

    exact._is_training_forward = lambda outputs: False


@_mutation("temporaries_made_low")
def _temporaries_made_low(name):
    """Exact mode makes in fp32 only the factories the graph returns, not temporaries it
    writes in place (upcast where a write from fp32 values comes)."""
    from collage_compile.accumulators import written_nodes
    from collage_compile.passes import promote

    orig = promote._made_as_state

    def returned_only(graph):
        made = orig(graph)
        same = {}
        for node in graph.nodes:
            written = written_nodes(node) if node.op in ("call_function", "call_method") else []
            if written:
                same[node] = same.get(written[0], written[0])
        output = next(n for n in graph.nodes if n.op == "output")
        return made & {same.get(a, a) for a in output.all_input_nodes}

    promote._made_as_state = returned_only


@_mutation("scalar_views_uncopied")
def _scalar_views_uncopied(name):
    """A computed scalar that is a view is read through ``as_strided`` as it is."""
    from collage_compile import _compat

    _compat._is_view = lambda node: False


@_mutation("math_pow_of_tensors")
def _math_pow_of_tensors(name):
    """``math.pow`` of a tensor traced as ``float(x) ** y`` like a symbol's."""
    from collage_compile import _compat

    _compat._holds_a_tensor = lambda args: False


@_mutation("state_alone_always")
def _state_alone_always(name):
    """A compiled step's tick with no weight version moved passes for a step that wrote
    state alone."""
    from collage_compile import watch

    def made_state_alone(optimizer, low):
        versions = watch._versions_at_compile.get(optimizer)
        return versions is not None and all(versions.get(id(p)) == p._version for p in low)

    watch._made_state_alone = made_state_alone


@_mutation("made_state_unchecked")
def _made_state_unchecked(name):
    """A step let off for the state it made is never checked against the state stored."""
    from collage_compile import watch

    watch._check_made_state = lambda optimizer: None
