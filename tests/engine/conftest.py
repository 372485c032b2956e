"""Engine test fixtures. The tokenizer folder is the converted default model (tests/conftest.py ``model_dir``):
the same files the engine serves, pulled into the model cache by the suite itself, never a fixed path."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(model_dir: Path) -> Path:
    """A HF tokenizer folder of SmolLM2 (tokenizer.json, tokenizer_config.json, chat template)."""
    assert (model_dir / "tokenizer.json").is_file(), f"the converted model at {model_dir} has no tokenizer.json"
    return model_dir


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    """kvscope.engine.text.tokenizer.Tokenizer of the test model, loaded once per session."""
    from kvscope.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(tokenizer_dir)
