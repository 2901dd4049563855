#!/usr/bin/env bash
# Issue 26's GPU measurements as one device call of at most 10 minutes (a session has 15
# minutes of device time, a machine start included), logs under $OUT (else gpu_out/):
#   bash tools/gpu_check.sh                # tests llama_cg step_large, at most 9 minutes
#   bash tools/gpu_check.sh step llama     # the rest, in a later call or session
# Each part has its own time limit, so a part that runs long costs only its own figures;
# parts.txt says how each ended.  Before it, here: bash ../shared/device-prep.sh (expecttest's
# wheel into .whl/, carried).  Parts:
#   tests      the GPU tests, 8 workers: CUDA-graph capture, Triton against the C++ path,
#              host cost, schedules (120 s)
#   step       benchmarks.step at --size gpu: fused AdamW fp32 and bf16, light, plus, and
#              the captured variants (300 s)
#   llama      examples/train_llama.py at its default size, the four strategies (240 s)
#   llama_cg   the same, light and plus captured as CUDA graphs (230 s)
#   step_large benchmarks.step at 315M parameters in 48 tensors, where memory dominates,
#              captured variants included (200 s)
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
    timeout "$limit" "$@" >"$out/$log" 2>&1
    echo "$log: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$out/parts.txt"
}

run() {
    case $1 in
    tests) part 110 tests.log python3 -m pytest -n 8 -q -rs tests/test_cudagraphs.py \
        tests/test_triton.py tests/test_codegen.py tests/test_host_cost.py \
        tests/test_lifecycle.py tests/test_schedules.py tests/test_fuse.py ;;
    step) part 300 step.log python3 -m benchmarks.step --device cuda --size gpu \
        --variants fused light plus cudagraphs --json "$out/step.json" ;;
    llama) part 240 llama.log python3 examples/train_llama.py --device cuda --out "$out/llama" ;;
    llama_cg) part 230 llama_cg.log python3 examples/train_llama.py --device cuda --cudagraphs \
        --out "$out/llama_cg" ;;
    step_large) part 200 step_large.log python3 -m benchmarks.step --device cuda --size large \
        --variants fused light plus cudagraphs --json "$out/step_large.json" ;;
    *) echo "unknown part $1" >&2 ;;
    esac
}

for name in "${@:-tests llama_cg step_large}"; do
    for one in $name; do run "$one"; done
done
