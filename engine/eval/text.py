"""The fixed English text perplexity is measured on (engine/eval/data/README.md: provenance and licence).

It ships inside the package and is hashed at every load, so a number in docs/benchmarks.md always refers to
the same tokens; ``--text FILE`` scores another file (its hash is reported, not checked).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).with_name("data")
DEFAULT_TEXT = DATA_DIR / "python-3.11.7-reference-prose.txt"
DEFAULT_TEXT_SHA256 = "35140e28d4e9738538e68da1a1f53ce0475601b3796d4996cec3dba3cf797ef4"
"""sha256 (hex) of :data:`DEFAULT_TEXT`'s bytes."""
DEFAULT_TEXT_TOKENS = 13613
"""Its length in SmolLM2 tokens (``Tokenizer.encode``, no special tokens added)."""


class EvalTextError(ValueError):
    """The text file is missing, not UTF-8, empty, or (the shipped one) not the bytes it should be."""


@dataclass(frozen=True, slots=True)
class EvalText:
    """A text to score: its path, content and sha256 (hex) of the bytes."""

    path: Path
    text: str
    sha256: str

    @property
    def name(self) -> str:
        return self.path.name


def load_text(path: Path | None = None) -> EvalText:
    """The shipped text (``path`` None), its sha256 checked against :data:`DEFAULT_TEXT_SHA256`, or the UTF-8
    file at ``path`` (not checked). Raises EvalTextError naming the file and, for a changed shipped text, both
    hashes."""
    target = DEFAULT_TEXT if path is None else Path(path)
    try:
        data = target.read_bytes()
    except OSError as exc:
        raise EvalTextError(f"cannot read the evaluation text {target}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if path is None and digest != DEFAULT_TEXT_SHA256:
        raise EvalTextError(
            f"the shipped evaluation text {target} changed: sha256 {digest}, expected "
            f"{DEFAULT_TEXT_SHA256} (restore it from git; perplexities are only comparable on "
            "the same tokens)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EvalTextError(
            f"the evaluation text {target} is not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    if not text.strip():
        raise EvalTextError(f"the evaluation text {target} is empty")
    return EvalText(path=target, text=text, sha256=digest)
