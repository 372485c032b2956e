#!/usr/bin/env bash
# The CUDA check of kvscope's compiled Triton kernels and engine, for a GPU machine with no network that gets a
# copy of the working tree of at most 64 MiB (docs/kernels.md "GPU check"; the steps: scripts/gpu_check.py).
#
#   scripts/gpu_check.sh --dry-run   any machine (CI runs it): fills .gpu_check/ (wheels, tokenizer), lists what
#                                    travels with sizes and what runs with its timeouts, collects every step's
#                                    tests here; exit 0 when it all fits (64 MiB, 8 minutes) and exists
#   scripts/gpu_check.sh --prepare   only fills .gpu_check/ (run it here before sending the tree)
#   scripts/gpu_check.sh             on the GPU machine, with .gpu_check/ carried: a CUDA probe, then every step
#                                    (setup, kernels, engine, bench) under its own timeout, each whatever the
#                                    others did, each writing <step>.log and <step>.junit.xml to $OUT
#                                    (default test-artifacts/gpu-check). Exit 0 all passed, 1 a step failed,
#                                    2 no CUDA device.
#
# Env: PYTHON runs this script (default .venv/bin/python where it exists, else python3: the device's);
# GPU_CHECK_PYTHON runs the steps (default: the same interpreter).
cd "$(dirname "$0")/.." || exit 1
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -P scripts/gpu_check.py "$@"
