"""A stand-in for the ``llguidance`` module of engine/structured/backend.py that records every grammar
compile (``LLMatcher(tokenizer, grammar, ...)``: the thread it ran on) and can hold the compiles of
grammars containing a marker until the test opens its gate. Everything else is the real llguidance."""

from __future__ import annotations

import threading
from typing import Any

import llguidance

HOLD_MARKER = "held-compile"
"""The marker of the ``spy`` fixture (tests/engine/conftest.py): a grammar containing it compiles only once
the test opens the gate."""


class LLGuidanceSpy:
    """Install with ``monkeypatch.setattr(kvscope.engine.structured.backend, "llguidance", spy)``."""

    def __init__(self, hold_marker: str | None = None) -> None:
        self.hold_marker = hold_marker
        self.compile_threads: list[str] = []
        """threading.current_thread().name of each LLMatcher construction, in order."""
        self.entered = threading.Event()
        """Set when a held compile started (the compile thread is busy with it)."""
        self.opened = threading.Event()
        self.LLMatcher = _Matcher(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(llguidance, name)

    def open(self) -> None:
        self.opened.set()


class _Matcher:
    def __init__(self, spy: LLGuidanceSpy) -> None:
        self._spy = spy

    def __call__(self, tokenizer: Any, grammar: str, **kwargs: Any) -> llguidance.LLMatcher:
        spy = self._spy
        spy.compile_threads.append(threading.current_thread().name)
        if spy.hold_marker is not None and spy.hold_marker in grammar:
            spy.entered.set()
            assert spy.opened.wait(120), "the test never opened the gate"
        return llguidance.LLMatcher(tokenizer, grammar, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(llguidance.LLMatcher, name)
