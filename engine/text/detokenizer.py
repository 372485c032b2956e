"""Incremental detokenization with stop strings (vLLM v1 ``FastIncrementalDetokenizer`` + ``check_stop_strings``).

Text comes from ``tokenizers.decoders.DecodeStream``, which only yields text once it is valid UTF-8: a
character split over several tokens is emitted whole with the token that completes it, never as U+FFFD.
The stream is primed with the last prompt tokens, so the first generated token decodes in context (a leading
space survives SentencePiece's ``Strip`` decoder). Priming steps the tail token by token: a prompt that ends
in the middle of a multi-byte character leaves those bytes pending, and the first delta is then that whole
character — never the prompt text before it (DecodeStream's ``ids=`` prefill would repeat it), including text
that shares the character's token (SmolLM2's ``ĠðŁ`` is a space and half of an emoji: the space is removed
from the first delta).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams
from engine.text.tokenizer import Tokenizer

PRIME_TOKENS = 6
"""Prompt tokens the stream is primed with (vLLM primes with 4 to 24)."""
MAX_PRIME_EXTEND = 4
"""Further tokens the priming start may move back so that it does not begin inside a UTF-8 character."""
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    """Per-request text state: feed sampled ids with :meth:`update`, read deltas with
    :meth:`get_next_output_text`. Not thread-safe (one owner: the output processor)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: tuple[str, ...] = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.output_token_ids: list[int] = []
        self.output_text = ""
        """All text so far; after a stop-string match it ends right before (or after, with
        ``include_stop_str_in_output``) the stop string."""
        self.stop_reason: str | None = None
        """The stop string matched, once one was."""
        self._sent = 0
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        pending = b""
        for token_id in _prime_ids(tokenizer, prompt_token_ids):
            pending = b"" if self._step(token_id) is not None else pending + tokenizer.token_bytes(token_id)
        self._prompt_pending = complete_characters(pending)
        """Prompt text the stream still holds with a partial character after it (" " of a last prompt token
        b" \\xf0\\x9f"): the first text it yields starts with it, and that part is the prompt's, not output."""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append newly sampled tokens; return the stop string they completed, or None.

        Stop strings are searched only in the new text plus ``len(stop) - 1`` characters before it, and only
        once more than ``min_tokens`` tokens were generated (as vLLM does). The earliest match wins. On a
        match ``output_text`` is cut right before the stop string (after it with
        ``include_stop_str_in_output``) and later updates are ignored. ``stop_terminated``: the last id is
        EOS/a stop token; its text is dropped unless ``include_stop_str_in_output``.
        """
        if self.stop_reason is not None:
            return None
        self.output_token_ids.extend(new_token_ids)
        ids = new_token_ids[:-1] if stop_terminated and not self.include_stop_str_in_output else new_token_ids
        added = "".join(filter(None, map(self._step, ids)))
        if added and self._prompt_pending:
            added = added.removeprefix(self._prompt_pending)
            self._prompt_pending = ""
        self.output_text += added
        if not added or not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        match = find_stop_string(self.output_text, len(added), self.stop)
        if match is None:
            return None
        stop_str, index = match
        self.output_text = self.output_text[:index + len(stop_str) if self.include_stop_str_in_output else index]
        self._sent = min(self._sent, len(self.output_text))
        self.stop_reason = stop_str
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text ready to send: the new part since the last call (``delta``) or all of it.

        While not ``finished``, the longest tail of ``output_text`` that is a proper prefix of some stop string is
        held back (it may still become a stop string); nothing else is. ``finished`` flushes everything.
        Text once returned is never taken back.
        """
        hold = 0 if finished or self.stop_reason is not None else self.held_back_length()
        end = max(self._sent, len(self.output_text) - hold)
        start = self._sent if delta else 0
        self._sent = end
        return self.output_text[start:end]

    def held_back_length(self) -> int:
        """Characters at the end of ``output_text`` that match a proper prefix of a stop string (0 with
        ``include_stop_str_in_output``: a stop string is sent anyway)."""
        if self.include_stop_str_in_output:
            return 0
        return max((longest_prefix_suffix(self.output_text, s) for s in self.stop), default=0)

    def _step(self, token_id: int) -> str | None:
        """One DecodeStream step. DecodeStream can raise "Invalid prefix" when a decoder's output is not
        monotonic (vllm-project/vllm#17448); then restart the stream at this token, as vLLM does."""
        try:
            return self._stream.step(self.tokenizer.hf, token_id)
        except Exception as exc:
            if _INVALID_PREFIX not in str(exc):
                raise
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self.tokenizer.hf, token_id)


def find_stop_string(text: str, new_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """Earliest occurrence of a stop string that ends inside the last ``new_chars`` characters of ``text``.

    Searches from ``len(text) - new_chars - len(s) + 1`` for each stop string ``s`` (a match ending earlier was
    already looked for). Returns ``(stop_string, start_index)``; ties go to the stop listed first.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        index = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if index != -1 and (best is None or index < best[1]):
            best = (s, index)
    return best


def longest_prefix_suffix(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with (0 if none)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def complete_characters(data: bytes) -> str:
    """The text of ``data`` up to the incomplete UTF-8 character it ends with (all of it when it ends on a
    character boundary): ``b" \\xf0\\x9f"`` → ``" "``. Invalid bytes before that decode as U+FFFD."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[-back]
        if lead < 0x80:
            break
        if lead >= 0xC0:  # a lead byte: 2, 3 or 4 bytes long
            length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            if back < length:
                data = data[:-back]
            break
    return data.decode("utf-8", errors="replace")


def _prime_ids(tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> Sequence[int]:
    """The last ``PRIME_TOKENS`` prompt ids, moved back (up to ``MAX_PRIME_EXTEND``) while the first one starts
    with a UTF-8 continuation byte (0b10xxxxxx), so the primed text starts on a character boundary."""
    start = max(0, len(prompt_token_ids) - PRIME_TOKENS)
    limit = max(0, start - MAX_PRIME_EXTEND)
    while start > limit and _starts_mid_character(tokenizer, prompt_token_ids[start]):
        start -= 1
    return prompt_token_ids[start:]


def _starts_mid_character(tokenizer: Tokenizer, token_id: int) -> bool:
    data = tokenizer.token_bytes(token_id)
    return bool(data) and 0x80 <= data[0] < 0xC0
