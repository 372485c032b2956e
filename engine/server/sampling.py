"""OpenAI request fields → :class:`kvscope.engine.sampling_params.SamplingParams`.

Defaults follow the OpenAI API: temperature 1, top_p 1, completions ``max_tokens`` 16, chat without a limit
(the rest of the context). Range errors raised by SamplingParams come back as 400 naming the request's field,
including its size caps (``logit_bias`` 300 entries, ``stop_token_ids`` 1024, ``stop`` 16 strings of at most
256 characters: engine/sampling_params.py).
"""

from __future__ import annotations

import re

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from kvscope.engine.server.errors import bad_request, from_engine
from kvscope.engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvscope.engine.server.structured import structured_params
from kvscope.engine.structured.params import StructuredOutputsParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")
"""A token id as a ``logit_bias`` key: ASCII decimal digits, no sign, spaces, underscores or leading zeros,
at most 10 digits (larger than any vocabulary; ``int()`` refuses strings of over 4,300 digits with a
ValueError)."""


def chat_sampling_params(
    req: ChatCompletionRequest, constraint: StructuredOutputsParams | None = None
) -> SamplingParams:
    """SamplingParams of a chat request. ``top_logprobs`` needs ``logprobs: true`` (400 ``top_logprobs``).
    ``constraint`` (a tool_choice's) is the request's grammar; asking for another one as well (vLLM's
    ``structured_outputs``/``guided_*``) is a 400 naming that field, never a silently dropped constraint."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    renames = {
        "logprobs": "top_logprobs",
        "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
    }
    own = structured_params(req)
    if constraint is not None and own is not None:
        raise bad_request(
            f"tool_choice required or a named function cannot be combined with {own.param}.", param=own.param
        )
    return _build(
        req,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=None,
        renames=renames,
        constraint=constraint or own,
    )


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    """SamplingParams of a completions request; ``echo`` with ``logprobs`` also asks for prompt logprobs."""
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request(
            "best_of is not supported: ask for n completions and choose among them.", param="best_of"
        )
    if req.suffix:
        raise bad_request("suffix is not supported.", param="suffix")
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    return _build(
        req,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
        renames={},
        constraint=structured_params(req),
    )


def _build(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    renames: dict[str, str],
    constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n or 1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens is not False,
            structured_outputs=constraint,
            extra={"user": req.user} if req.user else {},
        )
    except InvalidParameterError as exc:
        raise from_engine(exc, renames=renames) from exc


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings). At most MAX_LOGIT_BIAS entries (OpenAI's
    limit, checked before any key is read); each key is a token id in canonical decimal — ``int()`` would
    also read "1_0" as 10, " 1" and "+1" as 1 and other scripts' digits, so those are refused rather than
    guessed. Raises OpenAIError 400 ``param: logit_bias``; values are range-checked by the protocol and
    SamplingParams."""
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}.", param="logit_bias"
        )
    odd = next((key for key in bias if not _TOKEN_ID.fullmatch(key)), None)
    if odd is not None:
        raise bad_request(
            f'logit_bias keys must be token ids written in decimal digits (like "50256"), got {odd!r}.',
            param="logit_bias",
        )
    return {int(key): value for key, value in bias.items()}
