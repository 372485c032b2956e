"""Incremental detokenization with stop strings (vLLM v1 ``FastIncrementalDetokenizer`` +
``check_stop_strings``).

Text comes from ``tokenizers.decoders.DecodeStream``, which only yields text once it is valid UTF-8: a
character split over several tokens is emitted whole with the token that completes it, never as U+FFFD.
The stream is primed with the last prompt tokens, so the first generated token decodes in context (a leading
space survives SentencePiece's ``Strip`` decoder). Priming steps the tail token by token: a prompt that ends
in the middle of a multi-byte character leaves those bytes pending, and the first delta is then that whole
character — never the prompt text before it (DecodeStream's ``ids=`` prefill would repeat it), including text
that shares the character's token (SmolLM2's ``ĠðŁ`` is a space and half of an emoji: the space is removed
from the first delta).

Stop strings are matched incrementally (:class:`StopMatcher`, Knuth–Morris–Pratt): each request keeps, per
stop string, the length of the longest prefix of it that the output ends with. A step reads only its new text
(comparisons per stop string ≤ 2 × new characters + the longest stop's length − 1, and ≤ 2 × the output over
the whole request), and that state is the hold-back too. Nothing rescans the output, so a step costs O(new
text × stop strings), never O(output × stop length). The prefix functions are built once per request
(:class:`StopStrings`) and shared by its ``n`` children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.text.tokenizer import Tokenizer

PRIME_TOKENS = 6
"""Prompt tokens the stream is primed with (vLLM primes with 4 to 24)."""
MAX_PRIME_EXTEND = 4
"""Further tokens the priming start may move back so that it does not begin inside a UTF-8 character."""
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    """Per-request text state: feed sampled ids with :meth:`update`, read deltas with
    :meth:`get_next_output_text`. Not thread-safe (one owner: the output processor)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        stops: StopStrings | None = None,
    ) -> None:
        """``stops``: ``params.stop`` compiled (:meth:`StopStrings.compile`), passed in so that a request's
        children share one; compiled here when None."""
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
        self.stop_matcher = StopMatcher(stops or StopStrings.compile(self.stop)) if self.stop else None
        """Incremental stop-string state (None without stop strings)."""
        self._sent = 0
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        pending = b""
        for token_id in _prime_ids(tokenizer, prompt_token_ids):
            pending = b"" if self._step(token_id) is not None else pending + tokenizer.token_bytes(token_id)
        self._prompt_pending = complete_characters(pending)
        """Prompt text the stream still holds with a partial character after it (" " of a last prompt token
        b" \\xf0\\x9f"): the first text it yields starts with it, and that part is the prompt's, not
        output."""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append newly sampled tokens; return the stop string they completed, or None.

        Stop strings are looked for only in the new text (the matcher carries what the text before it ends
        with), and a match counts only once more than ``min_tokens`` tokens were generated (as vLLM does). The
        earliest match wins (ties: the stop listed first). On a match ``output_text`` is cut right before the
        stop string (after it with ``include_stop_str_in_output``) and later updates are ignored.
        ``stop_terminated``: the last id is EOS/a stop token; its text is dropped unless
        ``include_stop_str_in_output``.
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
        if not added or self.stop_matcher is None:
            return None
        match = self.stop_matcher.feed(added, report=len(self.output_token_ids) > self.min_tokens)
        if match is None:
            return None
        stop_str, offset = match
        index = len(self.output_text) - len(added) + offset
        self.output_text = self.output_text[
            : index + len(stop_str) if self.include_stop_str_in_output else index
        ]
        self._sent = min(self._sent, len(self.output_text))
        self.stop_reason = stop_str
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text ready to send: the new part since the last call (``delta``) or all of it.

        While not ``finished``, the longest tail of ``output_text`` that is a proper prefix of some stop
        string is held back (it may still become a stop string); nothing else is. ``finished`` flushes
        everything. Text once returned is never taken back.
        """
        hold = 0 if finished or self.stop_reason is not None else self.held_back_length()
        end = max(self._sent, len(self.output_text) - hold)
        start = self._sent if delta else 0
        self._sent = end
        return self.output_text[start:end]

    def held_back_length(self) -> int:
        """Characters at the end of ``output_text`` that match a proper prefix of a stop string (0 with
        ``include_stop_str_in_output``: a stop string is sent anyway). O(stop strings): the matcher's
        state."""
        if self.include_stop_str_in_output or self.stop_matcher is None:
            return 0
        return self.stop_matcher.longest_partial()

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


@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's stop strings with their Knuth–Morris–Pratt prefix functions: built once per request
    (:meth:`compile`, O(total length)) and shared, read-only, by the matchers of its ``n`` children."""

    strings: tuple[str, ...]
    borders: tuple[tuple[int, ...], ...]
    """``borders[i][k]``: length of the longest proper prefix of ``strings[i][:k + 1]`` that is also its
    suffix."""

    @classmethod
    def compile(cls, stop: Sequence[str]) -> StopStrings:
        """Prefix functions of ``stop`` (non-empty strings; SamplingParams checks them)."""
        return cls(tuple(stop), tuple(_prefix_function(s) for s in stop))


class StopMatcher:
    """One request's incremental stop-string matching (KMP over the stream of output characters).

    ``matched[i]``: length of the longest proper prefix of stop string i that the text fed so far ends with
    (the invariant of the KMP automaton). :meth:`feed` reads each new character once per stop string, plus one
    comparison per fallback; fallbacks never exceed the characters read, so a feed of ``c`` characters makes
    at most ``2c + len(stop) - 1`` comparisons per stop string and a whole request at most ``2 ×`` its output.
    ``comparisons`` counts them (tests bound the per-step work with it; it is not a timing).
    """

    __slots__ = ("stops", "matched", "comparisons")

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.matched = [0] * len(stops.strings)
        self.comparisons = 0

    def feed(self, text: str, report: bool = True) -> tuple[str, int] | None:
        """Advance over ``text``, the characters appended to the output. With ``report``: the earliest stop
        string occurrence that ends inside ``text`` as ``(stop_string, start)``, ``start`` relative to the
        first character of ``text`` (negative when the occurrence began in earlier text); ties go to the
        stop listed first; None when none ends here. Without ``report`` (``min_tokens`` not reached yet)
        occurrences are passed over and None is returned. After a reported match the state is no longer
        meaningful (the request ends there)."""
        best: tuple[int, int] | None = None
        comparisons = 0
        for i, (stop, border) in enumerate(zip(self.stops.strings, self.stops.borders, strict=True)):
            k = self.matched[i]
            last = len(stop) - 1
            for pos, char in enumerate(text):
                comparisons += 1
                while k and stop[k] != char:
                    k = border[k - 1]
                    comparisons += 1
                if stop[k] != char:
                    continue
                if k < last:
                    k += 1
                    continue
                if report:
                    start = pos - last
                    if best is None or start < best[0]:
                        best = (start, i)
                    break
                k = border[last]  # a full occurrence passed over: continue from its longest border
            self.matched[i] = k
        self.comparisons += comparisons
        return None if best is None else (self.stops.strings[best[1]], best[0])

    def longest_partial(self) -> int:
        """Characters at the end of the text fed so far that are a proper prefix of some stop string."""
        return max(self.matched, default=0)


def _prefix_function(stop: str) -> tuple[int, ...]:
    border = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        if stop[i] == stop[k]:
            k += 1
        border[i] = k
    return tuple(border)


def find_stop_string(text: str, new_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """Earliest occurrence of a stop string that ends inside the last ``new_chars`` characters of ``text``.

    The reference definition :class:`StopMatcher` keeps (tests compare them): searches from ``len(text) -
    new_chars - len(s) + 1`` for each stop string ``s`` (a match ending earlier was already looked for).
    Returns ``(stop_string, start_index)``; ties go to the stop listed first.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        index = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if index != -1 and (best is None or index < best[1]):
            best = (s, index)
    return best


def longest_prefix_suffix(text: str, stop: str) -> int:
    """Length of the longest proper prefix of ``stop`` that ``text`` ends with (0 if none): the definition
    of one stop string's hold-back, O(len(stop)^2); :class:`StopMatcher` keeps the same number
    incrementally (tests hold it against this reference, as against :func:`find_stop_string`)."""
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
    """The last ``PRIME_TOKENS`` prompt ids, moved back (up to ``MAX_PRIME_EXTEND``) while the first one
    starts with a UTF-8 continuation byte (0b10xxxxxx), so the primed text starts on a character boundary."""
    start = max(0, len(prompt_token_ids) - PRIME_TOKENS)
    limit = max(0, start - MAX_PRIME_EXTEND)
    while start > limit and _starts_mid_character(tokenizer, prompt_token_ids[start]):
        start -= 1
    return prompt_token_ids[start:]


def _starts_mid_character(tokenizer: Tokenizer, token_id: int) -> bool:
    data = tokenizer.token_bytes(token_id)
    return bool(data) and 0x80 <= data[0] < 0xC0
