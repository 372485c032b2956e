"""Our top-level package ``kernels`` and Hugging Face's PyPI package ``kernels`` share an import name. transformers
5.25 requires the latter and, when its distribution is installed, imports names from whichever ``kernels`` comes
first on sys.path — ours — so ``import transformers``' model code fails (pyproject.toml pins transformers < 5.25).
This test names that cause directly instead of an ImportError deep inside transformers."""

from __future__ import annotations

import importlib.metadata

import pytest


def test_hugging_faces_kernels_distribution_is_not_installed() -> None:
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    pytest.fail(f"Hugging Face's `kernels` {version} is installed and collides with kvscope's `kernels/` "
                "(a transformers release that requires it?): see pyproject.toml's transformers pin")


def test_transformers_model_code_imports_beside_our_kernels() -> None:
    """What broke in a fresh install with transformers 5.25: LlamaConfig's module imports transformers'
    activations, which import ``kernels`` when its distribution is present."""
    from transformers import LlamaConfig

    assert LlamaConfig().model_type == "llama"
