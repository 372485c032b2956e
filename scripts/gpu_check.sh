#!/usr/bin/env bash
# CUDA checks of the Triton attention path (docs/kernels.md), on a machine with an NVIDIA GPU:
#   1. tests/kernels on the device (compiled kernels, TRITON_INTERPRET=0), incl. the @gpu-marked cases;
#   2. whole-engine greedy equality, Triton vs torch backend, SmolLM2-135M (tests/kernels/test_engine_triton_gpu.py);
#   3. the kernel benchmark, `python -m kvscope.kernels.bench --quick`, under a time bound.
# Usage: scripts/gpu_check.sh [--full-bench]. Env: PYTHON (default .venv/bin/python), BENCH_TIMEOUT (s, 300),
# TEST_TIMEOUT (s, 900). Exit status: 0 all passed, 2 no CUDA device, else the first failing step's status.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
BENCH_ARGS=(--quick)
[ "${1:-}" = "--full-bench" ] && BENCH_ARGS=()

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device; nothing to check here (CPU CI runs tests/kernels interpreted)" >&2
  exit 2
fi
export TRITON_INTERPRET=0
"$PYTHON" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, torch {torch.__version__}")'

echo "== 1/3 kernel tests on the device"
timeout "${TEST_TIMEOUT:-900}" "$PYTHON" -m pytest tests/kernels -q -p no:cacheprovider \
  --ignore tests/kernels/test_engine_triton_gpu.py

echo "== 2/3 engine greedy equality: triton vs torch backend (SmolLM2-135M, fp32)"
timeout "${TEST_TIMEOUT:-900}" "$PYTHON" -m pytest tests/kernels/test_engine_triton_gpu.py -q -p no:cacheprovider -rs

echo "== 3/3 kernel benchmark (${BENCH_ARGS[*]:-full grid})"
timeout "${BENCH_TIMEOUT:-300}" "$PYTHON" -P -m kvscope.kernels.bench "${BENCH_ARGS[@]}"
echo "gpu_check: all steps passed"
