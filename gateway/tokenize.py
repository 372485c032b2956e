"""Prompt token counting at the edge with the model's own tokenizer (HF ``tokenizers``).

Per model, configure ``tokenizer:`` (a ``tokenizer.json`` or a model folder). Chat prompts are rendered with
the model's chat template the way transformers (and our engine) do it: jinja2 sandbox, ``trim_blocks``,
``lstrip_blocks``, ``tojson``, ``raise_exception``, ``strftime_now``, special tokens as variables, the text
tokenized without adding special tokens. Completions prompts are tokenized with special tokens (BOS).

When a model has no tokenizer, when jinja2 is missing, or when its template cannot render a request, the
count is ``None``: the gateway then does not check the context length and leaves it to the upstream (which
answers 400 itself), and estimates tokens for ``tokens_per_minute`` as characters / 4.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

from gateway.settings import ModelConfig

_log = logging.getLogger("kvscope.gateway")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHARS_PER_TOKEN = 4


def estimate_tokens(text_chars: int) -> int:
    """Rough token count for rate limiting when no tokenizer is configured: ``ceil(chars / 4)``."""
    return -(-text_chars // CHARS_PER_TOKEN)


class ModelTokenizer:
    """One model's tokenizer + chat template renderer."""

    def __init__(self, hf: tokenizers.Tokenizer, template: Callable[..., str] | None,
                 variables: Mapping[str, str]) -> None:
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
        variables = {k: _content(config[k]) for k in _SPECIAL_KEYS if config.get(k)}
        source = _template_source(folder, config)
        return cls(hf, _compile(source) if source else None, variables)

    def count_text(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def count_chat(self, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """Tokens of the rendered chat prompt (with the generation prompt), or None if it cannot render."""
        if self._template is None:
            return None
        try:
            text = self._template(messages=_normalize(messages), add_generation_prompt=True, **self._variables)
        except Exception as exc:  # template errors, non-text parts: the upstream decides
            _log.debug("chat template did not render: %s", exc)
            return None
        return self.count_text(text, add_special_tokens=False)


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

    def chat(self, model: str, messages: Sequence[Mapping[str, Any]]) -> int | None:
        tok = self._by_model.get(model)
        return tok.count_chat(messages) if tok else None

    def completion(self, model: str, prompt: str | list[Any]) -> list[int] | None:
        """Token count of each prompt (a string, strings, token ids or lists of token ids)."""
        prompts = _split_prompts(prompt)
        tok = self._by_model.get(model)
        counts = []
        for item in prompts:
            if isinstance(item, list):
                counts.append(len(item))
            elif tok is None:
                return None
            else:
                counts.append(tok.count_text(item))
        return counts


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _normalize(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Drop None values; join list content's text parts with newlines (as vLLM and our engine do)."""
    out = []
    for message in messages:
        item = {k: v for k, v in message.items() if v is not None}
        if isinstance(item.get("content"), list):
            item["content"] = "\n".join(part["text"] for part in item["content"])
        out.append(item)
    return out


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(value: str | Mapping) -> str:
    return value["content"] if isinstance(value, Mapping) else value


def _template_source(folder: Path, config: Mapping) -> str | None:
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _compile(source: str) -> Callable[..., str] | None:
    """A HF chat template compiled like transformers; None (with a warning) when jinja2 is not installed."""
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        _log.warning("jinja2 is not installed: chat prompts are not counted at the gateway")
        return None

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        json.dumps(v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source).render
