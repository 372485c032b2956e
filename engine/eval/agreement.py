"""Greedy token agreement of a format with float32: tokens identical until the first divergence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AGREEMENT_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three most important things to know about photosynthesis are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon",
    "A good way to learn a new language is to",
    "The main difference between a list and a tuple in Python is",
)
"""The 8 fixed prompts (plain text, no chat template), generated greedily for AGREEMENT_TOKENS tokens."""
AGREEMENT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Agreement:
    """Per prompt: how many leading generated tokens equal the reference's."""

    matched: tuple[int, ...]
    length: int
    """Tokens generated per prompt (the maximum of each entry of ``matched``)."""

    @property
    def total(self) -> int:
        return sum(self.matched)

    @property
    def possible(self) -> int:
        return self.length * len(self.matched)

    @property
    def identical_prompts(self) -> int:
        """Prompts whose whole continuation equals the reference's."""
        return sum(m == self.length for m in self.matched)

    def describe(self) -> str:
        """``6/8 prompts, 470/512 tokens``."""
        return f"{self.identical_prompts}/{len(self.matched)} prompts, {self.total}/{self.possible} tokens"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]], length: int) -> Agreement:
    """Agreement of ``other`` with ``reference`` (one token list per prompt, each ``length`` long, capped).
    Raises ValueError when the prompt counts differ."""
    if len(reference) != len(other):
        raise ValueError(f"{len(other)} continuations for {len(reference)} reference ones")
    return Agreement(
        matched=tuple(min(common_prefix(r, o), length) for r, o in zip(reference, other, strict=True)),
        length=length,
    )
