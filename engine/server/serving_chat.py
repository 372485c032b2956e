"""``POST /v1/chat/completions``: messages → chat template → engine → ``chat.completion`` / chunks."""

from __future__ import annotations

import asyncio
import time

from litestar import Request, Response
from msgspec import UNSET

from kvscope.common.openai_errors import CLIENT_CLOSED_REQUEST
from kvscope.engine.async_engine import RequestFailedError
from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server.errors import from_engine
from kvscope.engine.server.logprobs import chat_logprobs
from kvscope.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
)
from kvscope.engine.server.request_state import RequestState
from kvscope.engine.server.sampling import chat_sampling_params
from kvscope.engine.server.scheduling import schedule_of
from kvscope.engine.server.serving import (
    admit,
    admit_job,
    check_model,
    first_output,
    holds_headers,
    process_prompts,
    respond_json,
    respond_stream,
    start_job,
)
from kvscope.engine.server.serving_tools import ToolChatFormatter
from kvscope.engine.server.sse import SSEResponse
from kvscope.engine.server.state import ServerState
from kvscope.engine.server.structured import prepare_constraint
from kvscope.engine.server.tools import ToolMode, conversation, tool_constraint, tool_mode
from kvscope.engine.text.tokenizer import Tokenizer


def chat_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest, mode: ToolMode | None = None) -> list[int]:
    """Token ids of the rendered chat template (text parts of a message joined with newlines); tools, tool
    calls and tool results rendered as engine/server/tools.py documents."""
    messages, variables = conversation(
        req, mode or ToolMode("none"), getattr(tokenizer, "chat_template", None)
    )
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt is not False, **variables
        )
    except InvalidParameterError as exc:
        raise from_engine(exc) from exc


async def create_chat_completion(
    state: ServerState, request: Request, req: ChatCompletionRequest
) -> Response | SSEResponse:
    admit(state)
    check_model(state, req.model)
    mode = tool_mode(req)
    params = chat_sampling_params(req, tool_constraint(req, mode))
    schedule = schedule_of(request, req)
    compile_wait_s = await prepare_constraint(state, params, schedule)
    prompt = await asyncio.to_thread(chat_prompt, state.tokenizer, req, mode)  # a huge prompt must not stall
    requests = process_prompts(state, [prompt], params, "messages", compile_wait_s)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    job = start_job(state, request, "chat", requests, bool(req.stream), schedule)
    await admit_job(job)
    args = (job.rs, state.tokenizer, int(time.time()), bool(req.logprobs), include_usage)
    formatter = ChatFormatter(*args)
    formatter = ToolChatFormatter(formatter, mode) if mode.active else formatter
    if req.stream:
        first = await first_output(job) if holds_headers(job) else None
        if job.rs.finished:  # the client left while its 200 waited
            return Response(content=b"", status_code=CLIENT_CLOSED_REQUEST)
        return respond_stream(job, formatter, include_usage, first)
    return await respond_json(job, formatter)


class ChatFormatter:
    """Turns delta outputs into chunks and accumulates the same deltas for the non-streaming body, so the
    concatenated stream equals the JSON answer byte for byte."""

    def __init__(
        self, rs: RequestState, tokenizer: Tokenizer, created: int, logprobs: bool, include_usage: bool
    ) -> None:
        self.rs = rs
        self.tokenizer = tokenizer
        self.created = created
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._content: list[list[str]] = [[] for _ in rs.choices]
        self._entries: list[list[ChatTokenLogprob]] = [[] for _ in rs.choices]
        self._started = [False] * len(rs.choices)

    def add(self, k: int, output: RequestOutput) -> list[ChatCompletionChunk]:
        """Chunks for one delta: the role chunk when a choice gets its first token, then its text/logprobs/
        finish_reason. Raises RequestFailedError when the engine ended a choice with abort/error."""
        chunks = []
        for choice, delta, entries in self.rs.on_output(k, output):
            if delta.finish_reason in ("abort", "error"):
                raise RequestFailedError(
                    self.rs.request_id, f"choice {choice.index} ended: {delta.finish_reason}"
                )
            i = choice.index
            if not self._started[i]:
                self._started[i] = True
                chunks.append(self._chunk(i, DeltaMessage(role="assistant", content="")))
            logprobs = chat_logprobs(self.tokenizer, entries) if self.logprobs and entries else None
            self._content[i].append(delta.text)
            if logprobs is not None:
                self._entries[i] += logprobs.content
            if delta.text or entries or delta.finish_reason:
                message = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
                chunks.append(self._chunk(i, message, logprobs, delta.finish_reason))
        return chunks

    def _chunk(
        self,
        index: int,
        delta: DeltaMessage,
        logprobs: ChatLogprobs | None = None,
        finish_reason: str | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rs.request_id,
            created=self.created,
            model=self.rs.model,
            choices=[
                ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            ],
            service_tier=self.rs.shown_service_tier or UNSET,
            usage=None if self.include_usage else UNSET,
        )

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.rs.request_id,
            created=self.created,
            model=self.rs.model,
            choices=[],
            service_tier=self.rs.shown_service_tier or UNSET,
            usage=self.rs.usage(),
            kvscope=self.rs.kvscope(),
        )

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content="".join(self._content[c.index])),
                logprobs=ChatLogprobs(self._entries[c.index]) if self.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in self.rs.choices
        ]
        return ChatCompletionResponse(
            id=self.rs.request_id,
            created=self.created,
            model=self.rs.model,
            choices=choices,
            usage=self.rs.usage(),
            service_tier=self.rs.shown_service_tier or UNSET,
            kvscope=self.rs.kvscope(),
        )
