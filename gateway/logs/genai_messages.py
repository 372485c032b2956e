"""Prompt and completion content in the OTel GenAI message schema (only logged with ``log_content``).

Source: OpenTelemetry semantic conventions 1.41, ``gen_ai.input.messages`` / ``gen_ai.output.messages``
(JSON schemas ``gen-ai-input-messages.json`` and ``gen-ai-output-messages.json``): a list of messages, each
``{"role", "parts": [...]}``; a part is ``{"type": "text", "content"}``, ``{"type": "uri", "modality",
"uri"}``, ``{"type": "tool_call", "id", "name", "arguments"}`` or ``{"type": "tool_call_response", "id",
"response"}``; output messages also carry ``finish_reason``. ECS 9.1 maps the same fields (``gen_ai.*``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _text(content: Any) -> dict[str, Any]:
    return {"type": "text", "content": content if isinstance(content, str) else json.dumps(content)}


def _content_parts(content: Any) -> list[dict[str, Any]]:
    """OpenAI ``content`` (a string or a list of content parts) as GenAI parts."""
    if content is None:
        return []
    if not isinstance(content, list):
        return [_text(content)]
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(_text(part.get("text", "")))
        elif kind == "image_url":
            url = part.get("image_url")
            parts.append(
                {"type": "uri", "modality": "image", "uri": url.get("url") if isinstance(url, dict) else url}
            )
        elif kind is not None:
            parts.append({"type": str(kind)})  # other modalities: the kind only, never raw payloads
        else:
            parts.append(_text(part))
    return parts


def _chat_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        return {"role": "user", "parts": [_text(message)]}
    role = str(message.get("role") or "user")
    if role == "tool":
        return {
            "role": "tool",
            "parts": [
                {
                    "type": "tool_call_response",
                    "id": message.get("tool_call_id"),
                    "response": message.get("content"),
                }
            ],
        }
    parts = _content_parts(message.get("content"))
    for call in message.get("tool_calls") or []:
        call = call if isinstance(call, dict) else {}
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        parts.append(
            {
                "type": "tool_call",
                "id": call.get("id"),
                "name": function.get("name"),
                "arguments": function.get("arguments"),
            }
        )
    return {"role": role, "parts": parts}


def input_messages(raw: Any) -> list[dict[str, Any]] | None:
    """``gen_ai.input.messages`` of a chat ``messages`` list, or of a completions ``prompt`` (a string or a
    list of strings, one user message each; token-id prompts are kept as their JSON text)."""
    if raw is None:
        return None
    if isinstance(raw, list) and all(isinstance(m, dict) and "role" in m for m in raw):
        return [_chat_message(m) for m in raw]
    prompts = raw if isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw) else [raw]
    return [{"role": "user", "parts": [_text(p)]} for p in prompts]


def output_messages(
    texts: Sequence[str | None] | None, finish_reasons: Sequence[str]
) -> list[dict[str, Any]] | None:
    """``gen_ai.output.messages``: one assistant message per choice, with its finish reason (``None`` while
    unknown, e.g. a stream cut short)."""
    if texts is None:
        return None
    return [
        {
            "role": "assistant",
            "parts": [] if text is None else [_text(text)],
            "finish_reason": finish_reasons[i] if i < len(finish_reasons) else None,
        }
        for i, text in enumerate(texts)
    ]
