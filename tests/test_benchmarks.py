"""``python -m benchmarks.step`` runs end to end and counts what it claims to count.

No timing is held to a target: timings never are.  What is asserted is what must hold on
any machine: every variant ran, the persistent bytes per parameter it reports (measured
from the tensors each variant keeps) are the ones its algorithm keeps, the compiled
variants' kernels were read from Inductor's code, and each number means what its column
says (the time columns agree with each other, bandwidth is the floor bytes over a copy's,
a compile time spans far more than one step, the peak includes the persistent state); no
variant's time is compared with another's.
optimi and torchao are installed by the test extra, so their rows are checked here too;
that they are skipped cleanly when absent is checked without them.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import operator
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# AdamW's state per parameter: fp32 master 4 + bf16 copy 2 + fp32 m, v 8; bf16 p, m, v 6;
# light adds the weight's lo, plus also v's lo; exact an int16 remainder of p, m and v;
# optimi's Kahan buffer is a bf16 lo of its own; torchao keeps bf16 p, m, v (stochastic
# rounding needs no buffer); torch's fused AdamW keeps what its foreach form keeps
STATE_BYTES = {
    "fp32 master (16,32)": 14,
    "plain bf16": 6,
    "fp32 fused (16,32)": 14,
    "bf16 fused": 6,
    "collage light": 8,
    "collage plus": 10,
    "collage exact": 12,
    "eager Collage (ref)": 8,
    "optimi Kahan": 8,
    "torchao bf16 SR": 6,
}

# the rows whose step is torch.compile'd (the others run as their authors ship them)
COMPILED = {"fp32 master (16,32)", "plain bf16", "collage light", "collage plus", "collage exact"}

# the rows that need a package of their own
OPTIONAL = {"optimi Kahan": "optimi", "torchao bf16 SR": "torchao"}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_step_benchmark_reports_every_variant_with_its_state_bytes(tmp_path):
    out = tmp_path / "step.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cmd = [sys.executable, "-m", "benchmarks.step", "--size", "tiny", "--device", "cpu"]
    cmd += ["--rounds", "2", "--steps", "1", "--threads", "1", "--clock", "cpu"]
    # each compiled variant cold in a process of its own, two at a time (CUDA's default, so
    # that --size gpu finishes), then here from their cache
    cmd += ["--jobs", "2", "--json", str(out), "--plot", str(tmp_path / "step.png")]
    cmd += ["--new-grads"]  # as a training loop makes them (the demo's optimizer step)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    rows = {r["variant"]: r for r in res["rows"]}

    assert list(rows) == [n for n in STATE_BYTES if _installed(OPTIONAL.get(n, "torch"))]
    assert "collage light" in proc.stdout and "ms/step" in proc.stdout  # the table
    assert "synced ms" in proc.stdout
    assert res["new_grads"] and "new gradient tensors every step" in proc.stdout
    assert (tmp_path / "step.png").stat().st_size > 0
    n = res["params"]
    plain, fp32 = rows["plain bf16"]["ms_per_step"], rows["fp32 master (16,32)"]["ms_per_step"]
    fused = rows["fp32 fused (16,32)"]["ms_per_step"]
    fused16 = rows["bf16 fused"]["ms_per_step"]
    synced32, synced16 = (rows[k]["synced_ms"] for k in ("fp32 fused (16,32)", "bf16 fused"))
    for name, row in rows.items():
        # (+ AdamW's 0-d step counters: 4 bytes a tensor, 0.004 B/param at this size)
        assert row["persistent_bytes_per_param"] == pytest.approx(STATE_BYTES[name], abs=0.01), name
        # the time columns are one step's time: per parameter, and over the references'
        ms = row["ms_per_step"]
        assert row["ns_per_param"] * n / 1e6 == pytest.approx(ms, rel=1e-9), name
        assert row["vs_plain_bf16"] == pytest.approx(ms / plain, rel=1e-9), name
        assert row["vs_fp32_master"] == pytest.approx(ms / fp32, rel=1e-9), name
        assert row["vs_fused_fp32"] == pytest.approx(ms / fused, rel=1e-9), name
        assert row["vs_fused_bf16"] == pytest.approx(ms / fused16, rel=1e-9), name
        # and one step alone between two synchronizations, as train_llama times it
        alone = row["synced_ms"]
        assert alone > 0, name
        assert row["synced_vs_fused_fp32"] == pytest.approx(alone / synced32, rel=1e-9), name
        assert row["synced_vs_fused_bf16"] == pytest.approx(alone / synced16, rel=1e-9), name
        # the bytes the step must move per second, as a share of a plain copy's; no step
        # moves its bytes much faster than a copy (measured 1 % to 10 % at this size)
        floor_gbs = row["floor_bytes_per_param"] * n / (ms / 1e3) / 1e9
        assert row["of_copy_bandwidth"] == pytest.approx(floor_gbs / res["copy_GBps"]), name
        assert 0 < row["of_copy_bandwidth"] < 1.5, name
        # the peak includes everything the step keeps (on CPU it measured exactly that)
        assert row["peak_MB"] * 1e6 >= row["persistent_bytes_per_param"] * n - 0.5, name
        if name in COMPILED:  # the first call compiles: far longer than a step (~10^4 x)
            assert row["compile_s"] > 100 * ms / 1e3, name
            assert row["compile_here_s"] is not None, name  # and compiled again here
        else:
            assert row["compile_s"] is None and row["kernels"] is None, name
    assert res["jobs"] == 2
    assert res["compile"] == "cold, each variant in a process of its own, 2 at a time"
    # the compiled steps' kernels come from Inductor's generated code; on this small list
    # plain Inductor and both collage modes fuse the step into one kernel
    # (the fp32 step has a second graph: the copy into the bf16 model)
    assert rows["fp32 master (16,32)"]["kernels"] == 2
    for name in ("plain bf16", "collage light", "collage plus", "collage exact"):
        assert rows[name]["kernels"] == 1, name
    assert res["params"] == sum(torch.Size(s).numel() for s in _tiny_shapes())


def test_new_grads_gives_each_step_new_gradient_tensors_of_the_same_values():
    """``--new-grads``: each call sees other gradient tensors than the call before it, as
    after ``zero_grad()`` and ``backward()``, and the same values (the steps stay alike);
    never the tensors the step had before."""
    from benchmarks import step

    ps = step.make_params(_tiny_shapes()[:3], "cpu", torch.bfloat16)
    first = [p.grad for p in ps]
    seen = []
    stepped = step._with_new_grads(lambda: seen.append([p.grad for p in ps]), ps)
    for _ in range(3):
        stepped()
    for a, b in itertools.pairwise(seen):
        assert all(x is not y and torch.equal(x, y) for x, y in zip(a, b))
    assert all(map(torch.equal, seen[0], first))
    assert not any(g is f for grads in seen for g, f in zip(grads, first))


def test_the_demo_size_is_the_llama_demos_parameters():
    """``--size demo`` times the optimizer step on the parameters of
    ``examples/train_llama.py`` at its defaults: 75 tensors, 25.17M parameters (the counts
    README and docs/speed.md give for it)."""
    from collage_compile import demo_llama

    shapes = demo_llama.parameter_shapes()
    assert len(shapes) == 75
    assert sum(torch.Size(s).numel() for s in shapes) == 25_174_528
    assert shapes[0] == shapes[-1] == (256, 512)  # the embedding and the untied head
    assert demo_llama.parameter_shapes(["--n-layer", "2"]) == shapes[:19] + shapes[-2:]


def test_the_demo_size_runs_the_llama_demos_adamw():
    """``--size demo`` times the example's AdamW too: its betas (plus pairs the second
    moment only at beta2 >= 0.99, so at the example's 0.95 it moves light's bytes) and its
    weight decay on the matrices alone, in two param groups, in every variant."""
    import argparse

    from benchmarks import step
    from collage_compile import demo, demo_llama

    s = demo_llama.settings(demo_llama.parse_args([]))
    hyper = step._hyper(argparse.Namespace(size="demo", shapes=None))
    assert hyper == step.DEMO
    assert (hyper.lr, hyper.betas, hyper.weight_decay) == (s.lr, (s.beta1, s.beta2), s.weight_decay)
    shapes = demo_llama.parameter_shapes(["--n-layer", "1", "--n-embd", "16", "--n-head", "2"])
    ps = [torch.zeros(x) for x in shapes]
    want = demo.param_groups(dict(enumerate(ps)), s.weight_decay)
    opt = hyper.adamw(ps, foreach=True)
    for got, group in zip(opt.param_groups, want, strict=True):
        assert len(got["params"]) == len(group["params"])
        assert all(map(operator.is_, got["params"], group["params"]))
        assert got["weight_decay"] == group["weight_decay"] and got["betas"] == hyper.betas
    assert step.floor_bytes("plus", hyper) == step.floor_bytes("light", hyper) == 18
    assert step.floor_bytes("plus", step.DEFAULT) == 22
    assert step._hyper(argparse.Namespace(size="tiny", shapes=None)) == step.DEFAULT


def test_cudagraphs_rows_are_plain_light_and_plus_captured_as_the_help_says():
    """``--variants fused cudagraphs`` times plain Inductor, light and plus captured (the
    help's words), not plain alone: a GPU run asked for that to spare the uncaptured
    compiles and got no collage row.  The rows are named without building them (no GPU)."""
    from benchmarks import step

    names = list(step._factories(_tiny_shapes(), "cuda", True, ("fused", "cudagraphs")))
    captured = [f"{k} cudagraphs" for k in ("plain bf16", "collage light", "collage plus")]
    assert names == [step.MASTER, "plain bf16", step.FUSED32, step.FUSED16, *captured]
    both = list(step._factories(_tiny_shapes(), "cuda", True, ("light", "cudagraphs")))
    assert both == [step.MASTER, "plain bf16", "collage light", *captured]


def _tiny_shapes() -> list[tuple[int, ...]]:
    from benchmarks.metrics_overhead import SIZES, layer_shapes

    return layer_shapes(*SIZES["tiny"])


def test_step_benchmark_skips_absent_alternatives_with_a_message(monkeypatch, capsys):
    from benchmarks import step

    # a None entry in sys.modules makes ``import`` raise ImportError, as when not installed
    for name in ("optimi", "torchao", "torchao.optim"):
        monkeypatch.setitem(sys.modules, name, None)
    assert step._third_party(_tiny_shapes(), "cpu", foreach=True) == []
    err = capsys.readouterr().err
    assert "skipped: optimi Kahan AdamW" in err
    assert "skipped: torchao bf16 SR AdamW" in err


def test_host_benchmark_times_each_variant_under_a_schedule_without_recompiling(tmp_path):
    """``python -m benchmarks.host`` with a new lr every step: a row per variant, the
    profile of one, and no recompile for the lr (plain Inductor gets a tensor lr, collage
    compiles its float lr as an input from the first step); collage's ``-cg`` row is the
    whole-step replay (on a CPU its graphs called directly), and it replays."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env["TORCH_LOGS"] = "recompiles"
    cmd = [sys.executable, "-m", "benchmarks.host", "--tensors", "3", "--rounds", "1"]
    cmd += ["--steps", "3", "--schedule", "--variants", "plain,light,light-cg,fused32"]
    cmd += ["--profile", "light"]
    cmd += ["--code", str(tmp_path / "code")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    timing, _, code = proc.stdout.partition("generated code")
    rows = [line.split() for line in timing.splitlines() if line.startswith("      3 ")]
    assert [r[1] for r in rows] == ["plain", "light", "light-cg", "fused32"], proc.stdout
    assert "not replayed" not in proc.stderr, proc.stderr[-4000:]
    # the code of each compiled variant (fused32 runs eagerly): no partition and no host
    # read of a CPU scalar on a CPU (a captured CUDA step is what may have them)
    files = [line.split() for line in code.splitlines() if line.startswith("      3 ")]
    assert [f[1] for f in files] == ["plain", "light", "light-cg", "fused32"], code
    assert [f[3:] for f in files] == [["0", "0", "0"]] * 4, code
    assert all(int(f[2]) >= 1 for f in files[:3]) and files[3][2] == "0", code
    assert "def call(" in (tmp_path / "code" / "light-3-0.py").read_text()
    assert all(float(r[2]) > 0 for r in rows) and float(rows[0][3]) == 1.0
    assert "a new lr every step" in proc.stdout and "cProfile" in proc.stdout
    # (each variant's own optimizer compiles the same code once more; none for a new lr:
    # plain Inductor with a float lr would recompile at each of the 8 values, and collage
    # once, at the first change, without compile_optimizer's dynamic lr)
    assert "['lr']" not in proc.stderr, proc.stderr[-4000:]


def test_triton_compile_benchmark_compiles_each_kernel_for_an_h100():
    """``python -m benchmarks.triton_compile``: the step's Triton kernels, generated under
    the interpreter, compiled for sm_90 by Triton on this CPU; a row per variant, and no
    collage kernel wider than Inductor's 250-buffer limit (the backend keeps it)."""
    import triton_interp

    if reason := triton_interp.available():
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "benchmarks.triton_compile", "--layers", "1"]
    cmd += ["--variants", "plain", "light"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {
        r[0]: r[1:]
        for r in (line.split() for line in proc.stdout.splitlines())
        if r and r[0] in ("plain", "light")
    }
    assert set(rows) == {"plain", "light"}, proc.stdout
    for kernels, launches, pointers, total, longest in rows.values():
        assert int(kernels) >= 1 and int(launches) >= int(kernels)
        assert 0 < int(pointers) <= 250
        assert 0 <= float(longest) <= float(total)
