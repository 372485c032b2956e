"""Engine test fixtures. The tokenizer folder is the converted default model (tests/conftest.py
``model_dir``): the same files the engine serves, pulled into the model cache by the suite itself, never a
fixed path."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(model_dir: Path) -> Path:
    """A HF tokenizer folder of SmolLM2 (tokenizer.json, tokenizer_config.json, chat template)."""
    assert (model_dir / "tokenizer.json").is_file(), (
        f"the converted model at {model_dir} has no tokenizer.json"
    )
    return model_dir


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    """kvscope.engine.text.tokenizer.Tokenizer of the test model, loaded once per session."""
    from kvscope.engine.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch):
    """kvscope.engine.structured.backend's llguidance replaced by an LLGuidanceSpy that records every
    compile and holds those of grammars containing ``HOLD_MARKER``
    (tests/engine/structured/llguidance_spy.py) until the test opens the gate; opened again at teardown so
    no compile thread stays blocked."""
    import kvscope.engine.structured.backend as backend
    from tests.engine.structured.llguidance_spy import HOLD_MARKER, LLGuidanceSpy

    spy = LLGuidanceSpy(hold_marker=HOLD_MARKER)
    monkeypatch.setattr(backend, "llguidance", spy)
    yield spy
    spy.open()
