"""Engine logprobs (:class:`kvscope.engine.outputs.TokenLogprob`) in OpenAI's two formats.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` where ``bytes`` are the token's
raw bytes (``Tokenizer.token_bytes``) and ``token`` their UTF-8 text, or ``bytes:\\xNN…`` when the token is
only part of a character (OpenAI's convention). Completions (legacy): parallel lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (dicts holding the top-k and the sampled token, so up to k+1 entries, as
the OpenAI reference documents) and ``text_offset`` (character offset of each token in the choice's text).
``-inf`` (a masked token among the alternatives) is reported as ``-9999.0``: JSON has no infinity, and OpenAI
and vLLM use the same floor.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from kvscope.engine.outputs import CompletionOutput, TokenLogprob
from kvscope.engine.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from kvscope.engine.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0


def clamp_logprob(logprob: float) -> float:
    """``logprob`` with ``-inf``/NaN replaced by :data:`LOGPROB_FLOOR`."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """(display string, raw bytes) of one token."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def visible_entries(choice: CompletionOutput, include_stop_str: bool) -> list[TokenLogprob]:
    """The delta's logprob entries without the EOS / stop token that ended the choice: its text is not part of
    the content (OpenAI never lists it), so the entries' bytes concatenate to exactly the content."""
    entries = list(choice.logprobs or [])
    ended_by_token = choice.finish_reason == "stop" and not isinstance(choice.stop_reason, str)
    if entries and ended_by_token and not include_stop_str:
        entries.pop()
    return entries


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """OpenAI chat logprobs; ``top_logprobs`` holds exactly the k requested alternatives, best first."""
    content = []
    for entry in entries:
        text, raw = token_text(tokenizer, entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            alt_text, alt_raw = token_text(tokenizer, token_id)
            top.append(TopLogprob(token=alt_text, logprob=clamp_logprob(logprob), bytes=list(alt_raw)))
        content.append(
            ChatTokenLogprob(
                token=text, logprob=clamp_logprob(entry.logprob), bytes=list(raw), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


class LegacyLogprobs:
    """Builds completions logprobs for one choice, across stream chunks (text offsets carry over)."""

    def __init__(self, tokenizer: Tokenizer, start_offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = start_offset

    def build(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> CompletionLogprobs:
        """Logprobs of ``token_ids`` (entry None: no logprob, e.g. the first prompt token)."""
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries, strict=True):
            text, raw = token_text(self._tokenizer, token_id)
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            self._offset += len(self._decoder.decode(raw))
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {token_text(self._tokenizer, tid)[0]: clamp_logprob(lp) for tid, lp in entry.top}
            top.setdefault(text, clamp_logprob(entry.logprob))
            out.token_logprobs.append(clamp_logprob(entry.logprob))
            out.top_logprobs.append(top)
        return out


def merge_legacy(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    """Concatenate chunk logprobs (non-streaming responses)."""
    out = CompletionLogprobs()
    for part in parts:
        out.tokens += part.tokens
        out.token_logprobs += part.token_logprobs
        out.top_logprobs += part.top_logprobs
        out.text_offset += part.text_offset
    return out
