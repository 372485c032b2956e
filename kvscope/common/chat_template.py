"""The model's chat template, rendered the way Hugging Face transformers does it (torch-free; engine and
gateway).

transformers renders chat templates in ``transformers/utils/chat_template_utils.py``
(``_compile_jinja_template``,
https://github.com/huggingface/transformers/blob/main/src/transformers/utils/chat_template_utils.py): a jinja2
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the loop-controls extension, a
``{% generation %}`` block, a ``tojson`` filter without HTML escaping, and the globals ``raise_exception`` and
``strftime_now``; the special tokens (``bos_token``, …) are template variables and the rendered text is
tokenized without adding special tokens. This module is that environment, once, plus where a model folder
keeps its template. engine/text/tokenizer.py and gateway/tokenize.py both use it; neither keeps its own copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The ``tokenizer_config.json`` keys that become template variables (transformers'
``SPECIAL_TOKENS_ATTRIBUTES``)."""

ChatRenderer = Callable[[list[dict], bool, Mapping[str, Any]], str]
"""``render(messages, add_generation_prompt, variables) -> str``; raises :class:`ChatTemplateError`."""


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``, a jinja2 error) or a message cannot be
    given to it (not an object, a non-text content part). ``str(exc)`` is the reason."""


def compile_chat_template(source: str) -> ChatRenderer:
    """Compile a HF chat template (jinja2 source); returns ``render(messages, add_generation_prompt,
    variables)``.

    Raises jinja2.TemplateSyntaxError for a template that does not parse; rendering raises
    :class:`ChatTemplateError` (``"chat template error: …"``) for any jinja2 error, ``raise_exception``
    included.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    template = env.from_string(source)

    def render(messages: list[dict], add_generation_prompt: bool, variables: Mapping[str, Any]) -> str:
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc

    return render


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Copy messages for the template: drop keys whose value is None (as transformers does) and join list
    content's text parts with newlines (as vLLM does). Raises :class:`ChatTemplateError` for a message that
    is not an object or a content part that is not ``{"type": "text", "text": str}``."""
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"each message must be an object, got {message!r}")
        item = {k: v for k, v in message.items() if v is not None}
        if isinstance(item.get("content"), list):
            item["content"] = "\n".join(_text_part(part) for part in item["content"])
        normalized.append(item)
    return normalized


def load_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` in ``model_dir`` if present (it wins, as in transformers), else
    tokenizer_config's ``chat_template`` (a string or a list of ``{"name", "template"}``, of which
    ``default`` is used); None when the model has none."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The template variables ``bos_token``, ``eos_token``, … (token text) set in ``tokenizer_config.json``;
    each is a string or a serialized AddedToken ``{"content": ...}``."""
    return {k: _token_content(tokenizer_config[k]) for k in SPECIAL_TOKEN_KEYS if tokenizer_config.get(k)}


def _token_content(value: str | Mapping) -> str:
    return value["content"] if isinstance(value, Mapping) else value


def _text_part(part: Any) -> str:
    if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ChatTemplateError(f"content part of type {kind!r} is not supported (text only)")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body (transformers uses it for assistant
    masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()
