#!/usr/bin/env bash
# Issue 26's GPU measurements as device calls of at most 10 minutes (a session has 15
# minutes of device time; a machine start took 30 s on 2026-11-26 and the machine goes
# back after 30 s idle, so make the second call at once), logs under $OUT (else gpu_out/).
# Run on an H200 on 2026-11-27: llama_cg step_demo, then tests, then replay step_demo_cg.
# Next, what is still unmeasured, planned to fit one session (15 minutes of device time, a
# start included), the Done-when figures first, then the suite in what is left:
#   bash tools/gpu_check.sh llama_cg step_demo step_large  # call 1, about 8 min cold: the
#                                               # demo side by side (opt ms split host and
#                                               # device), light's synced ratio with the
#                                               # example's AdamW, 315M with the replay's
#                                               # gradient copy
#   bash tools/gpu_check.sh probe suite_quick   # call 2, at once: exact mode against the
#                                               # fp32 step since its Triton loops compute
#                                               # the scalars inline (33 s), then the whole
#                                               # suite, 16 workers, stopped at 270 s (pytest
#                                               # then still reports what ran and failed)
#   bash tools/gpu_check.sh step                # a later session: --size gpu
# Each part has its own time limit (SIGINT first: pytest then still reports its failures),
# so a part that runs long costs only its own figures; parts.txt says how each ended.
# Before it, here: bash ../shared/device-prep.sh (expecttest's wheel into .whl/, carried).
# Parts, with what they took (16 host cores; cold: a fresh machine, empty caches):
#   host       benchmarks.host at the demo's tensor count with a new lr every step: the
#              host time of the whole-step replay (light-cg, plus-cg: compile_optimizer(
#              cudagraphs=True)) beside plain Inductor's cudagraph trees and fused AdamW,
#              where it goes (cProfile of light-cg), and the code Inductor generated
#              (code/).  H100, 2026-11-27, warm: 104 s
#   tests      the GPU tests, 12 workers: the whole-step replay (test_replay.py first),
#              CUDA-graph capture, Triton against the C++ path, host cost, schedules.
#              H200, 2026-11-27, cold: 187 s, 90 of 91 (the one: the replay wrote a held
#              gradient, fixed in 6a579bb).
#              H100, 2026-11-27, cold: 188 s (10 failures, fixed since; a rerun of the
#              Triton, codegen and host-cost files with 8 workers did not end in 190 s:
#              the interpreter's comparisons, 60-100 s each, now left to the CPUs)
#   suite_quick  README's whole test suite, 16 workers, without the tile probe (not yet run)
#   suite      tools/probe_tiles.py (the host compiler's bf16 tile transposes; wrong here on
#              GCC 12.2, AVX-512; 60 s), then README's whole test suite on the GPU image, 14
#              workers (issue 26's "the suite on the GPU image"; not yet run there whole;
#              460 s: both within 9 minutes)
#   probe      tools/probe_exact.py: exact mode against the fp32 step, in fp32 ulps, with
#              and without Triton's FMA contraction (H200, 2026-11-27: 33 s)
#   llama_cg   examples/train_llama.py, light and plus captured as CUDA graphs, then every
#              strategy timed side by side, and a profile (H200, 2026-11-27, cold: 197 s)
#   llama      the same without capture (240 s)
#   step_large benchmarks.step at 315M parameters in 48 tensors, where memory dominates,
#              whole-step replays included (H200, 2026-11-27, cold: 110 s)
#   step_demo  benchmarks.step on the demo's 75 parameters (25.17M), new gradient tensors
#              every step as in training: the optimizer step against torch's fused AdamW
#              (fp32 and bf16), uncaptured and replayed, side by side with little noise
#              (issue 26's "printed by benchmarks.step"), with the synced column since
#              28f4524 (H200, 2026-11-27, cold: 158 s)
#   replay     tests/test_replay.py alone, 6 workers (its CUDA tests: the capture, exact
#              mode; H200, 2026-11-27, cold: 95 s, 18 of 18)
#   step_demo_cg  step_demo with the fused and captured variants only (H200, 2026-11-27:
#              81 s, but before 28f4524 'cudagraphs' built no collage row)
#   step       benchmarks.step at --size gpu (144 tensors; did not finish in 265 s: collage
#              compiles 60-70 s there, plain Inductor 30 s, one after another; now each
#              variant compiles cold in a process of its own, 8 at a time) (300 s)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
    export PYTHONPATH=$PWD/.site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >>"$out/gpu.txt" 2>&1

part() {  # part SECONDS LOG COMMAND...: one part, stopped at its limit
    local limit=$1 log=$2
    shift 2
    local start=$SECONDS
    timeout -s INT -k 20 "$limit" "$@" >"$out/$log" 2>&1
    echo "$log: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$out/parts.txt"
}

run() {
    case $1 in
    # the interpreter's long comparisons run on CPUs (CI, tools/torch211.sh); its two
    # leak tests stay, so that interpreted and CUDA tests share workers here
    tests) part 230 tests.log python3 -m pytest -n 12 -q -rfs --tb=short --durations=15 \
        -k "not (under_the_interpreter or equals_the_cpp_path_and_adds or \
            with_metrics_matches or adds_no_combo_kernels)" tests/test_replay.py \
        tests/test_cudagraphs.py \
        tests/test_triton.py tests/test_codegen.py tests/test_host_cost.py \
        tests/test_lifecycle.py tests/test_schedules.py tests/test_fuse.py ;;
    probe) part 120 probe.log python3 tools/probe_exact.py --code "$out/probe_code.txt" ;;
    # the host's C++ compiler first: does it transpose bf16 tiles right?
    suite) part 60 tiles.log python3 tools/probe_tiles.py
        part 460 suite.log python3 -m pytest -n 14 -q -rfs --tb=short --durations=15 ;;
    suite_quick) part 270 suite.log python3 -m pytest -n 16 -q -rfs --tb=short --durations=25 ;;
    replay) part 100 replay.log python3 -m pytest -n 6 -q -rfs --tb=short tests/test_replay.py ;;
    step_demo_cg) part 140 step_demo_cg.log python3 -m benchmarks.step --device cuda \
        --size demo --new-grads --variants fused cudagraphs --json "$out/step_demo_cg.json" ;;
    step_demo) part 240 step_demo.log python3 -m benchmarks.step --device cuda --size demo \
        --new-grads --variants fused light plus cudagraphs --json "$out/step_demo.json" ;;
    step) part 300 step.log python3 -m benchmarks.step --device cuda --size gpu \
        --variants fused light plus cudagraphs --json "$out/step.json" ;;
    host) part 230 host.log python3 -m benchmarks.host --device cuda --tensors 75 --schedule \
        --variants plain,fused32,fused16,plain-cg,light-cg,plus-cg --profile light-cg \
        --rounds 5 --steps 100 --code "$out/code" ;;
    llama) part 240 llama.log python3 examples/train_llama.py --device cuda --out "$out/llama" ;;
    llama_cg) part 230 llama_cg.log python3 examples/train_llama.py --device cuda --cudagraphs \
        --profile-steps 3 \
        --out "$out/llama_cg" ;;
    step_large) part 200 step_large.log python3 -m benchmarks.step --device cuda --size large \
        --variants fused light plus cudagraphs --json "$out/step_large.json" ;;
    *) echo "unknown part $1" >&2 ;;
    esac
}

for name in "${@:-llama_cg step_demo}"; do
    for one in $name; do run "$one"; done
done
