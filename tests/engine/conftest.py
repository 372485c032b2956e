"""Engine test fixtures. The tokenizer folder is named in ONE place: ``KVSCOPE_TEST_TOKENIZER_DIR``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_DEFAULT_TOKENIZER_DIR = "/tmp/smollm2-tok"


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A HF tokenizer folder of SmolLM2 (tokenizer.json, tokenizer_config.json, chat template)."""
    path = Path(os.environ.get("KVSCOPE_TEST_TOKENIZER_DIR", _DEFAULT_TOKENIZER_DIR))
    if not (path / "tokenizer.json").is_file():
        message = f"no tokenizer.json in {path} (set KVSCOPE_TEST_TOKENIZER_DIR)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    """engine.tokenizer.Tokenizer of the test model, loaded once per session."""
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(tokenizer_dir)
