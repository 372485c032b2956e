"""Where the kernel tests run: CUDA with compiled kernels, else CPU under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels._checks import is_interpreted
from kvscope.kernels.paged_attention import _paged_attention_kernel

INTERPRETED = is_interpreted(_paged_attention_kernel)
if not INTERPRETED and not torch.cuda.is_available():
    pytest.fail(
        "kernels were imported without TRITON_INTERPRET=1 on a machine without CUDA; "
        "run tests/kernels on its own or set TRITON_INTERPRET=1",
        pytrace=False,
    )
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
