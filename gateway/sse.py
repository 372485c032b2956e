"""Server-sent events: split an upstream byte stream into events (bytes kept exactly) and read what the
OpenAI chunks say (tokens, finish reasons, usage, the ``kvscope`` engine stats, llama.cpp's ``timings``,
in-band errors).

Event framing follows the WHATWG HTML spec (§9.2.6): lines end in CRLF, LF or CR; a blank line ends an event;
``data:`` lines (one optional space after the colon) join with ``\\n``; lines starting with ``:`` are
comments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec

KEEPALIVE = b": keep-alive\n\n"
DONE_DATA = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
VALID_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSESplitter:
    """Incremental splitter: :meth:`feed` returns each complete event's raw bytes, terminator included."""

    def __init__(self) -> None:
        self._buf = b""
        self._line_start = 0
        """Offset in ``_buf`` of the line being scanned (everything before it is in complete lines)."""

    def feed(self, data: bytes) -> list[bytes]:
        if (
            not self._buf
            and data[-2:] == b"\n\n"
            and data.find(b"\n\n") == len(data) - 2
            and data[:1] != b"\n"
            and b"\r" not in data
        ):
            return [data]  # one whole LF-framed event, as servers send each token: what the scan below finds
        buf = self._buf + data
        events: list[bytes] = []
        start, line_start = 0, self._line_start
        while (m := _LINE_END.search(buf, line_start)) is not None:
            if m.end() == len(buf) and m.group() == b"\r":
                break  # a CR at the end may be the first half of CRLF: wait for the next byte
            if m.start() == line_start:
                events.append(buf[start : m.end()])
                start = m.end()
            line_start = m.end()
        self._buf, self._line_start = buf[start:], line_start - start
        return events

    def tail(self) -> bytes:
        """Bytes of an unfinished event (at end of stream)."""
        return self._buf


def event_data(raw: bytes) -> bytes | None:
    """The event's data (``data`` lines joined with ``\\n``), or None for comment-only/empty events."""
    if (
        raw[:6] == b"data: "
        and raw[-2:] == b"\n\n"
        and raw.find(b"\n", 6) == len(raw) - 2
        and b"\r" not in raw
    ):
        return raw[6:-2]  # one ``data: `` line, LF-framed: what the loop below returns for it
    parts = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            parts.append(b"")
    return b"\n".join(parts) if parts else None


def data_event(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class Action(Enum):
    FORWARD = "forward"
    DROP = "drop"
    """The usage chunk the client did not ask for."""
    REWRITE = "rewrite"
    """A chunk with choices that also carries usage the client did not ask for: forward without it."""
    ERROR = "error"
    """An in-band error from the upstream: forward it, then end the stream without [DONE]."""
    BAD_FINISH = "bad_finish"
    """A finish_reason outside stop|length|tool_calls|content_filter (e.g. ``abort``): end as an error."""


@dataclass(slots=True)
class StreamState:
    """What an OpenAI chat/completions stream has said so far."""

    expected_choices: int = 1
    keep_text: bool = False
    """Accumulate generated text (for ``log_content``)."""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    token_events: int = 0
    """Chunks that carried output (text, tool calls, reasoning); a token count when usage is missing."""
    usage: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    """llama.cpp's ``timings`` object, read from the chunk that carries the usage (llama.cpp puts both on its
    last chunk; gateway/engines/reports.py): no lookup per token."""
    model: str | None = None
    response_id: str | None = None
    error: dict[str, Any] | None = None
    bad_finish_reason: str | None = None
    text: dict[int, list[str]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every expected choice ended with a valid finish_reason."""
        return len(self.finish_reasons) >= self.expected_choices

    def observe(self, obj: Any, client_wants_usage: bool) -> tuple[Action, bool]:
        """Record one chunk; returns what to do with it and whether it carried output."""
        if not isinstance(obj, dict):
            return Action.FORWARD, False
        if "error" in obj and not obj.get("choices"):
            self.error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            return Action.ERROR, False
        get = obj.get  # once per token: each lookup saved counts (docs/gateway.md "CPU per relayed token")
        if model := get("model"):
            self.model = model
        if self.response_id is None and isinstance(response_id := get("id"), str):
            self.response_id = response_id
        if usage := get("usage"):
            self.usage = usage
            if isinstance(timings := get("timings"), dict):
                self.timings = timings
        if isinstance(engine := get("kvscope"), dict):
            self.engine = engine
        choices = get("choices") or []
        if type(choices) is list and len(choices) == 1 and isinstance(choices[0], dict):
            has_token = self._observe_choice(choices[0])
        else:
            has_token = any([self._observe_choice(c) for c in choices if isinstance(c, dict)])
        self.token_events += has_token
        if self.bad_finish_reason is not None:
            return Action.BAD_FINISH, has_token
        if "usage" in obj and not client_wants_usage:
            # the usage chunk, and the "usage": null every other chunk carries once usage was asked for
            # (OpenAI stream_options.include_usage): neither is shown to a client that did not ask
            return (Action.REWRITE if choices else Action.DROP), has_token
        return Action.FORWARD, has_token

    def _observe_choice(self, choice: dict[str, Any]) -> bool:
        index = choice.get("index", 0)
        reason = choice.get("finish_reason")
        if reason is not None:
            if reason not in VALID_FINISH_REASONS:
                self.bad_finish_reason = str(reason)
            else:
                self.finish_reasons[index] = reason
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("reasoning_content")
            has_token = bool(text or delta.get("tool_calls"))
        else:
            text = choice.get("text")
            has_token = bool(text)
        if has_token and self.keep_text and isinstance(text, str):
            self.text.setdefault(index, []).append(text)
        return has_token

    def output_text(self) -> list[str]:
        return ["".join(self.text.get(i, [])) for i in range(self.expected_choices)]


def without_usage(obj: dict[str, Any]) -> bytes:
    """The chunk re-encoded without ``usage``/``kvscope`` (see :attr:`Action.REWRITE`)."""
    return data_event({k: v for k, v in obj.items() if k not in ("usage", "kvscope")})
