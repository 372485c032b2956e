"""Chat answers when tools are in play: ``message.tool_calls`` and ``finish_reason: "tool_calls"``.

Streaming follows OpenAI: for each call a first delta with ``index``, ``id``, ``type`` and ``function.name``
(``arguments: ""``), then ``function.arguments`` fragments. A named tool_choice streams the arguments as the
model writes them (its output is the arguments object); ``required`` and ``auto`` hold the text back until the
choice finishes (the call boundaries are known only then) and send each call's arguments in one fragment, or
the held text as content when it holds no call. Either way the streamed calls concatenate to the JSON body's.
"""

from __future__ import annotations

from msgspec import UNSET

from engine.outputs import RequestOutput
from engine.server.protocol import (
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
from engine.server.tools import ParsedCall, ToolMode, new_call_id, parse_tool_calls

TOOL_CALLS = "tool_calls"


class ToolChatFormatter:
    """Wraps a chat formatter (engine.server.serving_chat.ChatFormatter: its chunks, accumulated text and
    request state) and turns the answer of a tool-using request into tool calls."""

    def __init__(self, inner, mode: ToolMode) -> None:
        self.inner = inner
        self.mode = mode
        self.rs = inner.rs
        self._content = inner._content
        self._entries = inner._entries
        self._chunk = inner._chunk
        self.usage_chunk = inner.usage_chunk
        self._ids: dict[tuple[int, int], str] = {}
        self._named_header_sent: set[int] = set()

    def add(self, k: int, output: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        for chunk in self.inner.add(k, output):
            choice = chunk.choices[0]
            delta = choice.delta
            if delta.role is not UNSET:
                chunks.append(chunk)
                if self.mode.kind == "named":
                    chunks.append(self._tool_chunk(choice.index, self._header(choice.index, 0, self.mode.function)))
                continue
            if self.mode.kind == "named":
                if isinstance(delta.content, str) and delta.content:
                    chunks.append(self._tool_chunk(choice.index, DeltaToolCall(
                        0, DeltaFunctionCall(arguments=delta.content))))
                if choice.finish_reason:
                    chunks.append(self._chunk(choice.index, DeltaMessage(), None, self._finish(choice.index)))
                continue
            if choice.finish_reason:  # required / auto: everything was held back until now
                chunks += self._final_chunks(choice.index)
        return chunks

    def _final_chunks(self, index: int) -> list[ChatCompletionChunk]:
        parsed = self._parsed(index)
        if parsed is None:
            text = "".join(self._content[index])
            chunks = [self._chunk(index, DeltaMessage(content=text))] if text else []
            return chunks + [self._chunk(index, DeltaMessage(), None, self._finish(index))]
        calls, rest = parsed
        chunks = [self._chunk(index, DeltaMessage(content=rest))] if rest else []
        for j, call in enumerate(calls):
            chunks.append(self._tool_chunk(index, self._header(index, j, call.name)))
            chunks.append(self._tool_chunk(index, DeltaToolCall(j, DeltaFunctionCall(arguments=call.arguments))))
        return chunks + [self._chunk(index, DeltaMessage(), None, self._finish(index))]

    def _header(self, index: int, j: int, name: str | None) -> DeltaToolCall:
        return DeltaToolCall(j, DeltaFunctionCall(name=name, arguments=""), id=self._call_id(index, j),
                             type="function")

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
                message = AssistantMessage(content=rest, tool_calls=[
                    ToolCall(self._call_id(c.index, j), FunctionCall(call.name, call.arguments))
                    for j, call in enumerate(calls)])
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=ChatLogprobs(self._entries[c.index]) if self.inner.logprobs else None,
                                      finish_reason=self._finish(c.index), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.rs.request_id, created=self.inner.created, model=self.rs.model,
                                      choices=choices, usage=self.rs.usage(), kvscope=self.rs.kvscope())
