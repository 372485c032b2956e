"""OpenAI-shaped logprobs from token ids and raw logprobs (chat ``logprobs.content`` and legacy completions).

Token text is the token's own bytes as UTF-8. A token that holds only part of a character (byte-level BPE
splits CJK and emoji) is written ``bytes:\\xe4\\xbd`` as OpenAI does; its ``bytes`` field is exact either way,
so clients can join the bytes of consecutive tokens. ``-inf`` is reported as ``-9999.0`` (JSON has no
infinity; OpenAI and vLLM use the same floor).
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from typing import Any

from engine.outputs import TokenLogprob
from engine.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token, or ``bytes:\\xNN…`` when its bytes are not valid UTF-8 on their own."""
    data = tokenizer.token_bytes(token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def clamp_logprob(logprob: float) -> float:
    """``logprob`` with ``-inf``/NaN replaced by :data:`LOGPROB_FLOOR`."""
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def chat_logprobs_content(tokenizer: Tokenizer, entries: Sequence[TokenLogprob],
                          top_logprobs: int) -> list[dict[str, Any]]:
    """Chat completions ``choices[].logprobs.content``: one ``{"token", "logprob", "bytes", "top_logprobs"}``
    per generated token, with the ``top_logprobs`` most likely alternatives (same three keys) each."""
    return [{**_chat_item(tokenizer, e.token_id, e.logprob),
             "top_logprobs": [_chat_item(tokenizer, tid, lp) for tid, lp in e.top[:top_logprobs]]}
            for e in entries]


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                        num_logprobs: int, text_offset: int = 0) -> dict[str, list]:
    """Legacy completions ``choices[].logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a
    ``{token: logprob}`` dict of the ``num_logprobs`` most likely tokens plus the chosen one) and
    ``text_offset`` (see :func:`text_offsets`). An entry may be None (the
    first prompt token with ``echo``): its logprob and top_logprobs are None."""
    return {
        "tokens": [token_text(tokenizer, tid) for tid in token_ids],
        "token_logprobs": [None if e is None else clamp_logprob(e.logprob) for e in entries],
        "top_logprobs": [None if e is None else _top_dict(tokenizer, e, num_logprobs) for e in entries],
        "text_offset": text_offsets(tokenizer, token_ids, text_offset),
    }


def text_offsets(tokenizer: Tokenizer, token_ids: Sequence[int], start: int = 0) -> list[int]:
    """Character offset in the decoded text where each token starts: ``start`` + the characters completed by the
    bytes of the tokens before it (a token that continues a split character starts where that character does)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, position = [], start
    for tid in token_ids:
        offsets.append(position)
        position += len(decoder.decode(tokenizer.token_bytes(tid)))
    return offsets


def _chat_item(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token_id), "logprob": clamp_logprob(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}


def _top_dict(tokenizer: Tokenizer, entry: TokenLogprob, num_logprobs: int) -> dict[str, float]:
    top = {token_text(tokenizer, tid): clamp_logprob(lp) for tid, lp in entry.top[:num_logprobs]}
    top.setdefault(token_text(tokenizer, entry.token_id), clamp_logprob(entry.logprob))
    return top
