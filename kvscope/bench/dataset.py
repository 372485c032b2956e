"""Benchmark prompts as text, so every server tokenizes the same string with its own tokenizer.

Random prompts follow vLLM's ``RandomDataset`` (vllm/benchmarks/datasets.py): input and output lengths are
drawn uniformly from ``[len·(1−r), len·(1+r)]``, token ids are sampled (here uniformly from the non-special
vocabulary), decoded to text and re-encoded; the sequence is truncated or extended and re-decoded until its
re-encoded length equals the target (``gen_prompt_decode_to_target_len``, 10 tries). ``prompt_len`` is the
final re-encoded length, without special tokens or chat template.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MAX_DECODE_RETRIES = 10


class TokenIds(Protocol):
    """What the benchmark reads of a ``tokenizers.Encoding``."""

    @property
    def ids(self) -> list[int]: ...


class TextTokenizer(Protocol):
    """The part of a ``tokenizers.Tokenizer`` the benchmark uses."""

    def encode(self, text: str, /, *, add_special_tokens: bool = ...) -> TokenIds: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def get_vocab_size(self, with_added_tokens: bool = ...) -> int: ...

    def get_added_tokens_decoder(self) -> dict: ...


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One benchmark request: the prompt text, its length in tokens (0 if unknown) and the output length."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    token_mismatch: int = 0  # re-encoded length − target after the retries (vLLM's ``token_mismatch``)


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a folder holding one.

    Raises FileNotFoundError if there is no tokenizer.json at ``path``.
    """
    from tokenizers import Tokenizer

    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive ``[floor(length·(1−r)), ceil(length·(1+r))]`` (vLLM), at least 1. Raises ValueError if r ∉
    [0, 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    return low, max(low, math.ceil(length * (1 + range_ratio)))


def random_dataset(
    tokenizer: TextTokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` random-text prompts of ``input_len`` tokens (± range) and output lengths,
    deterministic in ``seed``. Token ids are drawn from the vocabulary minus special/added tokens."""
    rng = random.Random(seed)
    allowed = _allowed_token_ids(tokenizer)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    samples = []
    for _ in range(num_prompts):
        target = rng.randint(in_low, in_high)
        out_len = rng.randint(out_low, out_high)
        ids = [rng.choice(allowed) for _ in range(target)]
        prompt, final_len = decode_to_target_len(tokenizer, ids, target, rng, allowed)
        samples.append(SampleRequest(prompt, final_len, out_len, final_len - target))
    return samples


def decode_to_target_len(
    tokenizer: TextTokenizer, ids: list[int], target: int, rng: random.Random, allowed: list[int]
) -> tuple[str, int]:
    """Decode ``ids`` and re-encode until the text is ``target`` tokens long (truncate if longer, append
    random allowed ids if shorter), at most ``MAX_DECODE_RETRIES`` adjustments. Returns (text, re-encoded
    length). Source: vLLM ``gen_prompt_decode_to_target_len``."""
    tries = MAX_DECODE_RETRIES
    while True:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
        if len(ids) == target or tries <= 0:
            return text, len(ids)
        if len(ids) < target:
            ids.extend(rng.choice(allowed) for _ in range(target - len(ids)))
        else:
            ids = ids[:target]
        tries -= 1


def jsonl_dataset(
    path: str | Path, num_prompts: int, output_len: int, tokenizer: TextTokenizer | None, seed: int = 0
) -> list[SampleRequest]:
    """Prompts from a JSON-lines file: ``{"prompt": str, "output_len"?: int}`` per line (``max_tokens`` is
    accepted for ``output_len``). Lines are shuffled with ``seed`` and cycled to reach ``num_prompts``;
    ``prompt_len`` is counted with ``tokenizer`` (0 without one: the server's usage is used instead).
    Raises ValueError on a line without a string ``prompt`` or on an empty file."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: each line needs a string 'prompt'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    random.Random(seed).shuffle(rows)
    samples = []
    for i in range(num_prompts):
        row = rows[i % len(rows)]
        out_len = int(row.get("output_len", row.get("max_tokens", output_len)))
        prompt_len = len(tokenizer.encode(row["prompt"], add_special_tokens=False).ids) if tokenizer else 0
        samples.append(SampleRequest(row["prompt"], prompt_len, out_len))
    return samples


def _allowed_token_ids(tokenizer: TextTokenizer) -> list[int]:
    special = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in special]
