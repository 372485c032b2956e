"""Kernel tests: on a machine without CUDA they run under the Triton interpreter.

``@triton.jit`` picks the interpreter at decoration time, so ``TRITON_INTERPRET=1`` must be in the environment
before any ``kernels`` module is imported; pytest imports this file before the test modules of this folder.
Setting it changes nothing for torch-only tests (torch's CPU backends never read it; inductor generates C++
on CPU). On a CUDA machine the caller decides: ``scripts/gpu_check.sh`` sets ``TRITON_INTERPRET=0`` and the
same tests run the compiled kernels on the device.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
