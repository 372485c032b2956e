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


@pytest.fixture(scope="session")
def model_dir():
    """The default model converted to an HF folder (pulled and converted on first use)."""
    from engine.models.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m")


@pytest.fixture(scope="session")
def llm():
    """One shared offline engine on SmolLM2 (fp32, prefix caching on, 256 MiB of KV cache)."""
    from engine.llm import LLM

    return LLM("smollm2-135m", kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own load of the SmolLM2 GGUF (fp32): the reference for token-level parity."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.models.loader import resolve_model_dir

    gguf = next(resolve_model_dir("smollm2-135m").parent.glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()
