"""Prompt token counting at the edge with the model's own tokenizer (HF ``tokenizers``).

Per model, configure ``tokenizer:`` (a ``tokenizer.json`` or a model folder). Chat prompts are rendered with
the model's chat template by :mod:`kvscope.common.chat_template`, the module our engine uses too (the
environment of transformers' ``chat_template_utils``), the text tokenized without adding special tokens.
Completions prompts are tokenized with special tokens (BOS).

When a model has no tokenizer or when its template cannot render a request, the count is ``None``: the
gateway then does not check the context length and leaves it to the upstream (which answers 400 itself), and
estimates tokens for ``tokens_per_minute`` as characters / 4.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from kvscope.common.chat_template import (
    ChatRenderer,
    compile_chat_template,
    load_chat_template,
    normalize_messages,
    special_tokens,
)
from kvscope.gateway.settings import ModelConfig

_log = logging.getLogger("kvscope.gateway")
CHARS_PER_TOKEN = 4


def estimate_tokens(text_chars: int) -> int:
    """Rough token count for rate limiting when no tokenizer is configured: ``ceil(chars / 4)``."""
    return -(-text_chars // CHARS_PER_TOKEN)


class ModelTokenizer:
    """One model's tokenizer + chat template renderer."""

    def __init__(
        self, hf: tokenizers.Tokenizer, template: ChatRenderer | None, variables: Mapping[str, str]
    ) -> None:
        self.hf = hf
        self._template = template
        self._variables = dict(variables)

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        """From ``tokenizer.json`` or a folder with it (+ ``tokenizer_config.json``, ``chat_template.jinja``).

        Raises FileNotFoundError when no tokenizer.json is there.
        """
        path = Path(path)
        folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found")
        hf = tokenizers.Tokenizer.from_file(str(file))
        config = _read_json(folder / "tokenizer_config.json")
        source = load_chat_template(folder, config)
        return cls(hf, compile_chat_template(source) if source else None, special_tokens(config))

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (:meth:`encode_texts` of one)."""
        return self.encode_texts([text], add_special_tokens)[0]

    def encode_texts(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each of ``texts``, in one ``encode_batch`` call: unlike ``Tokenizer.encode``, which
        holds the GIL for the whole encode (a 1 MB prompt counted in a worker thread froze the gateway's
        event loop for ~1 s on a 2-vCPU AMD EPYC), it releases it, so a long prompt counted off the loop
        lets the other streams run; the ids are ``encode``'s."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def count_text(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.encode_text(text, add_special_tokens))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int] | None:
        """Token ids of the rendered chat prompt (with the generation prompt), as the engine sees them; None
        if it cannot render."""
        if self._template is None:
            return None
        try:
            text = self._template(normalize_messages(messages), True, self._variables)
        except (
            Exception
        ) as exc:  # ChatTemplateError, or whatever else a template raises: the upstream decides
            _log.debug("chat template did not render: %s", exc)
            return None
        return self.encode_text(text, add_special_tokens=False)

    def count_chat(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """Tokens of the rendered chat prompt (with the generation prompt), or None if it cannot render."""
        ids = self.encode_chat(messages)
        return None if ids is None else len(ids)


class PromptCounter:
    """Token counts per served model; models without a configured tokenizer count as ``None``."""

    def __init__(self, tokenizers_by_model: Mapping[str, ModelTokenizer]) -> None:
        self._by_model = dict(tokenizers_by_model)

    @classmethod
    def from_config(cls, models: Sequence[ModelConfig]) -> PromptCounter:
        """Load every configured tokenizer now (startup), so requests never wait on file I/O."""
        return cls({m.name: ModelTokenizer.load(m.tokenizer) for m in models if m.tokenizer})

    def has(self, model: str) -> bool:
        return model in self._by_model

    def chat_ids(self, model: str, messages: Sequence[Mapping[str, Any]]) -> list[int] | None:
        """The rendered chat prompt's token ids; None without a tokenizer or when the template fails."""
        tok = self._by_model.get(model)
        return tok.encode_chat(messages) if tok else None

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]]) -> int | None:
        ids = self.chat_ids(model, messages)
        return None if ids is None else len(ids)

    def completion_ids(self, model: str, prompt: str | list[Any]) -> list[list[int]] | None:
        """Token ids of each prompt (a string, strings, token ids or lists of token ids); None when a text
        prompt meets a model without a tokenizer."""
        tok = self._by_model.get(model)
        items = _split_prompts(prompt)
        texts = [item for item in items if not isinstance(item, list)]
        if texts and tok is None:
            return None
        encoded = iter(tok.encode_texts(texts) if tok is not None and texts else [])
        return [item if isinstance(item, list) else next(encoded) for item in items]

    def completion(self, model: str, prompt: str | list[Any]) -> list[int] | None:
        """Token count of each prompt (a string, strings, token ids or lists of token ids)."""
        ids = self.completion_ids(model, prompt)
        return None if ids is None else [len(i) for i in ids]


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
