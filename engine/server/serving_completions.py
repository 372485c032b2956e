"""``POST /v1/completions``: prompt(s) → engine → ``text_completion`` bodies / chunks (legacy logprobs)."""

from __future__ import annotations

import asyncio
import time

from litestar import Request, Response
from msgspec import UNSET

from kvscope.common.openai_errors import CLIENT_CLOSED_REQUEST
from kvscope.engine.async_engine import RequestFailedError
from kvscope.engine.outputs import RequestOutput, TokenLogprob
from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.logprobs import LegacyLogprobs, merge_legacy
from kvscope.engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from kvscope.engine.server.request_state import RequestState
from kvscope.engine.server.sampling import completion_sampling_params
from kvscope.engine.server.scheduling import schedule_of
from kvscope.engine.server.serving import (
    admit,
    admit_job,
    check_fan_out,
    check_model,
    first_output,
    holds_headers,
    process_prompts,
    respond_json,
    respond_stream,
    start_job,
)
from kvscope.engine.server.sse import SSEResponse
from kvscope.engine.server.state import ServerState
from kvscope.engine.server.structured import prepare_constraint
from kvscope.engine.text.tokenizer import Tokenizer


def completion_prompts(tokenizer: Tokenizer, prompt: str | list) -> list[list[int]]:
    """Token ids per prompt: a string, a list of strings, token ids, or a list of token-id lists.
    Raises 400 (``param: prompt``) for an empty list or a mix of kinds."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise bad_request("prompt must not be an empty list.", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    if all(isinstance(x, str) for x in prompt):
        return [tokenizer.encode(x) for x in prompt]
    if all(isinstance(x, list) for x in prompt):
        return [list(x) for x in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id "
        "lists (not a mix).",
        param="prompt",
    )


def num_prompts(prompt: str | list) -> int:
    """How many prompts :func:`completion_prompts` will find in ``prompt``, without tokenizing."""
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


async def create_completion(
    state: ServerState, request: Request, req: CompletionRequest
) -> Response | SSEResponse:
    admit(state)
    check_model(state, req.model)
    params = completion_sampling_params(req)
    check_fan_out(state, num_prompts(req.prompt), params.n)  # before tokenizing a long list
    schedule = schedule_of(request, req)
    compile_wait_s = await prepare_constraint(state, params, schedule)
    prompts = await asyncio.to_thread(completion_prompts, state.tokenizer, req.prompt)  # off the event loop
    requests = process_prompts(state, prompts, params, "prompt", compile_wait_s)
    echo_texts = _echo_texts(state.tokenizer, req.prompt, prompts) if req.echo else None
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    job = start_job(state, request, "text_completion", requests, bool(req.stream), schedule)
    await admit_job(job)
    formatter = CompletionFormatter(
        job.rs, state.tokenizer, int(time.time()), echo_texts, req.logprobs is not None, include_usage
    )
    if req.stream:
        first = await first_output(job) if holds_headers(job) else None
        if job.rs.finished:  # the client left while its 200 waited
            return Response(content=b"", status_code=CLIENT_CLOSED_REQUEST)
        return respond_stream(job, formatter, include_usage, first)
    return await respond_json(job, formatter)


def _echo_texts(tokenizer: Tokenizer, prompt: str | list, prompts: list[list[int]]) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


class CompletionFormatter:
    """Delta outputs → ``text_completion`` chunks, accumulated for the non-streaming body. With ``echo`` the
    prompt text (and, with logprobs, the prompt's logprobs) leads each choice's first chunk."""

    def __init__(
        self,
        rs: RequestState,
        tokenizer: Tokenizer,
        created: int,
        echo_texts: list[str] | None,
        logprobs: bool,
        include_usage: bool,
    ) -> None:
        self.rs = rs
        self.created = created
        self.echo_texts = echo_texts
        self.logprobs = logprobs
        self.include_usage = include_usage
        self._builders = [LegacyLogprobs(tokenizer) for _ in rs.choices]
        self._text: list[list[str]] = [[] for _ in rs.choices]
        self._lp_parts: list[list[CompletionLogprobs]] = [[] for _ in rs.choices]
        self._started = [False] * len(rs.choices)

    def add(self, k: int, output: RequestOutput) -> list[CompletionResponse]:
        """Raises RequestFailedError when the engine ended a choice with abort/error."""
        chunks = []
        for choice, delta, entries in self.rs.on_output(k, output):
            if delta.finish_reason in ("abort", "error"):
                raise RequestFailedError(
                    self.rs.request_id, f"choice {choice.index} ended: {delta.finish_reason}"
                )
            i = choice.index
            text, ids, lp_entries = delta.text, list(delta.token_ids[: len(entries)]), list(entries)
            if not self._started[i]:
                self._started[i] = True
                if self.echo_texts is not None:
                    text = self.echo_texts[k] + text
                    prompt_ids = self.rs.prompts[k]
                    ids = prompt_ids + ids
                    lp_entries = _prompt_entries(output, len(prompt_ids)) + lp_entries
            logprobs = self._builders[i].build(ids, lp_entries) if self.logprobs and ids else None
            self._text[i].append(text)
            if logprobs is not None:
                self._lp_parts[i].append(logprobs)
            if text or logprobs is not None or delta.finish_reason:
                chunks.append(
                    self._chunk(
                        CompletionChoice(
                            index=i,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            stop_reason=delta.stop_reason if delta.finish_reason else None,
                        )
                    )
                )
        return chunks

    def _chunk(self, choice: CompletionChoice) -> CompletionResponse:
        return CompletionResponse(
            id=self.rs.request_id,
            created=self.created,
            model=self.rs.model,
            choices=[choice],
            usage=None if self.include_usage else UNSET,
        )

    def usage_chunk(self) -> CompletionResponse:
        return CompletionResponse(
            id=self.rs.request_id,
            created=self.created,
            model=self.rs.model,
            choices=[],
            usage=self.rs.usage(),
            kvscope=self.rs.kvscope(),
        )

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=c.index,
                text="".join(self._text[c.index]),
                logprobs=merge_legacy(self._lp_parts[c.index]) if self.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in self.rs.choices
        ]
        return CompletionResponse(
            id=self.rs.request_id,
            created=self.created,
            model=self.rs.model,
            choices=choices,
            usage=self.rs.usage(),
            kvscope=self.rs.kvscope(),
        )


def _prompt_entries(output: RequestOutput, num_prompt_tokens: int) -> list[TokenLogprob | None]:
    """The prompt's logprob entries (None for the first token, or all None when the engine sent none)."""
    entries = list(output.prompt_logprobs or [])
    return entries + [None] * (num_prompt_tokens - len(entries))
