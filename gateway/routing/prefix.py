"""A prompt cut into chained block hashes, the way a paged KV cache with prefix caching sees it.

vLLM's and kvscope's prefix caches key each *full* block of ``block_size`` tokens by a hash of that block's
tokens and the hash of the block before it (``hash_block_tokens`` in vLLM and in
engine/core/kv_cache_manager.py), so a block's hash stands for the whole prefix up to it. The gateway hashes
the prompt the same way (the token ids as the engine will see them: chat template applied,
gateway/tokenize.py), in the engine's own block size, and a replica that cached block ``i`` most likely holds
blocks ``0..i`` too. The gateway's hashes are its own (it never compares them with the engine's): only
equality between requests matters.

Where the model has no tokenizer configured, the prompt's text stands in: blocks of ``block_size x 4``
characters (gateway/tokenize.py CHARS_PER_TOKEN), each counted as ``block_size`` tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvscope.gateway.tokenize import CHARS_PER_TOKEN, estimate_tokens


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """The prompt's full blocks as chained hashes, and what they stand for."""

    hashes: tuple[int, ...]
    """One per full block, in prompt order; ``hashes[i]`` depends on blocks ``0..i``."""
    block_size: int
    """Tokens per block (for ``text``: the tokens a block of ``block_size x 4`` characters stands for)."""
    num_tokens: int
    """Prompt tokens: exact for ``tokens``, ``ceil(characters / 4)`` for ``text``."""
    unit: Literal["tokens", "text"]
    """What was hashed: the token ids the engine will see, or the prompt's text (no tokenizer)."""

    def cacheable_blocks(self, matched_blocks: int) -> int:
        """Of ``matched_blocks`` leading blocks a replica holds, those the engine can reuse: never the block
        holding the prompt's last token, which must be computed for the first logits (engine/core/
        kv_cache_manager.py ``get_computed_blocks``; vLLM's ``max_cache_hit_length``)."""
        return max(0, min(matched_blocks, (self.num_tokens - 1) // self.block_size))


def _chain(seed: str, blocks: Sequence[Any]) -> tuple[int, ...]:
    hashes, parent = [], hash(seed)
    for block in blocks:
        parent = hash((parent, block))
        hashes.append(parent)
    return tuple(hashes)


def token_prefix(model: str, ids: Sequence[int], block_size: int) -> PromptPrefix:
    """The full ``block_size``-token blocks of ``ids`` (a prompt's token ids) hashed in a chain seeded by
    ``model`` (two models never share a prefix). Raises ValueError for ``block_size < 1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    full = len(ids) - len(ids) % block_size
    blocks = [tuple(ids[i : i + block_size]) for i in range(0, full, block_size)]
    return PromptPrefix(_chain(model, blocks), block_size, len(ids), "tokens")


def text_prefix(model: str, text: str, block_size: int) -> PromptPrefix:
    """The full blocks of ``block_size x 4`` characters of ``text`` hashed in a chain seeded by ``model``.
    Raises ValueError for ``block_size < 1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    chars = block_size * CHARS_PER_TOKEN
    full = len(text) - len(text) % chars
    blocks = [text[i : i + chars] for i in range(0, full, chars)]
    return PromptPrefix(_chain(model, blocks), block_size, estimate_tokens(len(text)), "text")


def chat_text(messages: Sequence[Any], tools: Any = None) -> str:
    """A chat request's prompt as text for :func:`text_prefix`, in the order a chat template writes it: the
    tools (templates put their signatures at the top), then each message's role and content. Only equality
    and prefix order matter, not the exact template."""
    parts = [json.dumps(tools, sort_keys=True, ensure_ascii=False)] if tools else []
    for message in messages:
        if not isinstance(message, Mapping):
            parts.append(json.dumps(message, sort_keys=True, ensure_ascii=False))
            continue
        content = message.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, sort_keys=True, ensure_ascii=False)
        extra = {k: v for k, v in message.items() if k not in ("role", "content")}
        parts.append(f"<|{message.get('role')}|>{content}")
        if extra:
            parts.append(json.dumps(extra, sort_keys=True, ensure_ascii=False))
    return "\n".join(parts)


def completion_text(prompt: Any) -> str | None:
    """The first prompt of a completions request as text (a string, or token ids written out), None when
    it has none. Batched prompts route by their first one."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return " ".join(map(str, prompt))
        if isinstance(first, list):
            return " ".join(map(str, first))
    return None
