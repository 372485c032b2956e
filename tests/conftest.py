"""Shared pytest wiring: GPU tests skip without CUDA; tests needing a system tool skip on a laptop but fail
under CI=true (see require_tool)."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    """Return the path of executable ``name``; skip the test on a laptop, fail it when CI=true."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install it, or run .ci/run)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
