"""Chat answers when tools are in play: ``message.tool_calls`` and ``finish_reason: "tool_calls"``.

Streaming follows OpenAI: the role delta carries ``content: null`` (not ``""``: a client accumulating the
deltas ends with null beside the calls, as the non-streamed body has), then for each call a first delta
with ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``), then ``function.arguments``
fragments as the model writes them. A named tool_choice's
output is the arguments object, so every content delta is a fragment. ``required`` and ``auto`` go through
kvscope.engine.server.tool_stream's incremental scanner: a call's header goes out once its ``name`` string is
complete, then the raw text of its ``arguments`` object as it grows; in ``auto`` the text outside
``<tool_call>`` blocks streams as content (only a possible prefix of the tag is held back), and an answer
with no call is all content. The non-streamed answer is parsed by the same scanner, so a stream's fragments
concatenate to exactly the JSON body's ``arguments``. ``finish_reason`` is ``tool_calls`` on the last chunk
when the finished answer holds a valid call; a ``required`` answer cut by ``max_tokens`` ends ``length``
after the partial call it streamed (the JSON body then answers the text as content).
"""

from __future__ import annotations

from msgspec import UNSET

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvscope.engine.server.tool_stream import Arguments, CallStart, Content, ToolCallScanner
from kvscope.engine.server.tools import ParsedCall, ToolMode, new_call_id, parse_tool_calls

TOOL_CALLS = "tool_calls"


class ToolChatFormatter:
    """Wraps a chat formatter (kvscope.engine.server.serving_chat.ChatFormatter: its chunks, accumulated
    text and request state) and turns the answer of a tool-using request into tool calls."""

    def __init__(self, inner, mode: ToolMode) -> None:
        self.inner = inner
        self.mode = mode
        self.rs = inner.rs
        self._content = inner._content
        self._entries = inner._entries
        self._chunk = inner._chunk
        self.usage_chunk = inner.usage_chunk
        self._ids: dict[tuple[int, int], str] = {}
        self._scanners: dict[int, ToolCallScanner] = {}

    def add(self, k: int, output: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        for chunk in self.inner.add(k, output):
            choice = chunk.choices[0]
            delta = choice.delta
            if delta.role is not UNSET:
                # content null, not "": OpenAI's first delta of a tool-call answer, and what a client that
                # accumulates deltas (the SDK's .stream()) must end with when the answer is only calls
                chunks.append(self._chunk(choice.index, DeltaMessage(role="assistant", content=None)))
                if self.mode.kind == "named":
                    chunks.append(
                        self._tool_chunk(
                            choice.index, self._header(choice.index, 0, self.mode.named_function)
                        )
                    )
                continue
            if self.mode.kind == "named":
                if isinstance(delta.content, str) and delta.content:
                    chunks.append(
                        self._tool_chunk(
                            choice.index, DeltaToolCall(0, DeltaFunctionCall(arguments=delta.content))
                        )
                    )
                if choice.finish_reason:
                    chunks.append(self._chunk(choice.index, DeltaMessage(), None, self._finish(choice.index)))
                continue
            chunks += self._scanned(
                choice.index,
                delta.content if isinstance(delta.content, str) else "",
                bool(choice.finish_reason),
            )
        return chunks

    def _scanned(self, index: int, text: str, last: bool) -> list[ChatCompletionChunk]:
        """required / auto: the scanner's events for one more delta (and the end of the answer) as chunks."""
        scanner = self._scanners.setdefault(index, ToolCallScanner(self.mode.kind))
        events = scanner.feed(text) + (scanner.finish() if last else [])
        chunks = []
        for event in events:
            if isinstance(event, Content):
                chunks.append(self._chunk(index, DeltaMessage(content=event.text)))
            elif isinstance(event, CallStart):
                chunks.append(self._tool_chunk(index, self._header(index, event.index, event.name)))
            elif isinstance(event, Arguments):
                chunks.append(
                    self._tool_chunk(
                        index, DeltaToolCall(event.index, DeltaFunctionCall(arguments=event.text))
                    )
                )
        if last:
            chunks.append(self._chunk(index, DeltaMessage(), None, self._finish(index)))
        return chunks

    def _header(self, index: int, j: int, name: str) -> DeltaToolCall:
        return DeltaToolCall(
            j, DeltaFunctionCall(name=name, arguments=""), id=self._call_id(index, j), type="function"
        )

    def _tool_chunk(self, index: int, call: DeltaToolCall) -> ChatCompletionChunk:
        return self._chunk(index, DeltaMessage(tool_calls=[call]))

    def _call_id(self, index: int, j: int) -> str:
        return self._ids.setdefault((index, j), new_call_id())

    def _parsed(self, index: int) -> tuple[list[ParsedCall], str | None] | None:
        if self.rs.choices[index].finish_reason != "stop":
            return None
        return parse_tool_calls(self.mode, "".join(self._content[index]))

    def _finish(self, index: int) -> str | None:
        reason = self.rs.choices[index].finish_reason
        return TOOL_CALLS if self._parsed(index) is not None else reason

    def response(self) -> ChatCompletionResponse:
        choices = []
        for c in self.rs.choices:
            parsed = self._parsed(c.index)
            if parsed is None:
                message = AssistantMessage(content="".join(self._content[c.index]))
            else:
                calls, rest = parsed
                message = AssistantMessage(
                    content=rest,
                    tool_calls=[
                        ToolCall(self._call_id(c.index, j), FunctionCall(call.name, call.arguments))
                        for j, call in enumerate(calls)
                    ],
                )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=ChatLogprobs(self._entries[c.index]) if self.inner.logprobs else None,
                    finish_reason=self._finish(c.index),
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.rs.request_id,
            created=self.inner.created,
            model=self.rs.model,
            choices=choices,
            usage=self.rs.usage(),
            service_tier=self.rs.shown_service_tier or UNSET,
            kvscope=self.rs.kvscope(),
        )
