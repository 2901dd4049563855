#!/usr/bin/env bash
# The suite on torch 2.11, the GPU image's torch (with its Triton 3.6), on this CPU:
#   bash tools/torch211.sh [pytest arguments]
# PyPI's torch 2.11 is its CUDA build (about 4.6 GB in the venv); it runs without a GPU, and
# the CUDA tests skip.  Not part of CI (it would double the suite's time); run it when a
# change touches what Dynamo or Inductor hand the backend.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-2.11
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
sed -e 's/^torch==.*/torch==2.11.0/' -e 's/^triton==.*/triton==3.6.0/' constraints.txt \
    > "$venv/constraints.txt"
"$venv/bin/pip" install -q -c "$venv/constraints.txt" -e ".[test]"
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor-2.11}" \
    "$venv/bin/python" -m pytest "$@"
