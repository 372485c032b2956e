"""kvscope.engine.text.detokenizer's incremental stop-string matcher (issue 35): the same matches and
hold-back as the reference definitions, a per-step work bound counted in comparisons (not time), and one
compiled table per request shared by its n children."""

from __future__ import annotations

import random

import pytest

from kvscope.engine.core.request import Request
from kvscope.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from kvscope.engine.text.detokenizer import (
    IncrementalDetokenizer,
    StopMatcher,
    StopStrings,
    find_stop_string,
    longest_prefix_suffix,
)
from kvscope.engine.text.output_processor import OutputProcessor
from kvscope.engine.text.tokenizer import Tokenizer


@pytest.mark.parametrize("seed", range(40))
def test_matcher_equals_the_reference_search_and_hold_back(seed: int) -> None:
    """Random texts over a 3-letter alphabet (many overlaps and borders), random stops and chunkings: each
    feed reports exactly find_stop_string's match and leaves exactly longest_prefix_suffix's hold-back."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("aab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice("abc") for _ in range(200))
    matcher = StopMatcher(StopStrings.compile(stops))
    done = 0
    report_from = rng.randint(0, 60)  # before it, matches are passed over (min_tokens)
    while done < len(text):
        chunk = text[done : done + rng.randint(1, 5)]
        done += len(chunk)
        report = done > report_from
        found = matcher.feed(chunk, report=report)
        expected = find_stop_string(text[:done], len(chunk), stops) if report else None
        assert found == (None if expected is None else (expected[0], expected[1] - (done - len(chunk))))
        if found is not None:
            break
        assert matcher.longest_partial() == max(longest_prefix_suffix(text[:done], s) for s in stops)


def test_stop_examples_match_the_reference() -> None:
    matcher = StopMatcher(StopStrings.compile(["ab", "c a"]))
    assert matcher.feed("xx abc", report=True) == ("ab", 3)
    matcher = StopMatcher(StopStrings.compile(["ab", "c a"]))
    matcher.feed("xx ", report=False)
    assert matcher.feed("abc ab", report=True) == ("ab", 0)
    matcher = StopMatcher(StopStrings.compile(["aab"]))
    matcher.feed("aaa", report=True)
    assert matcher.longest_partial() == 2
    assert matcher.feed("b", report=True) == ("aab", -2)  # began two characters before this feed


def test_per_step_work_is_bounded_by_the_new_text_not_the_output() -> None:
    """16 stop strings of 256 characters built to make KMP fall back the most ("a" * 255 + "b", fed runs of
    "a" broken by "c"): each one-character step costs at most 2 + 255 comparisons per stop string, and the
    whole output at most 2 per character per stop string: O(new text x stops), flat as the output grows.
    The old hold-back compared O(min(output, stop length)^2) characters per step (test fails there: no
    matcher)."""
    stop = "a" * (MAX_STOP_STRING_CHARS - 1) + "b"
    stops = [stop[: MAX_STOP_STRING_CHARS - i] + "b" * i for i in range(MAX_STOP_STRINGS)]
    assert all(len(s) == MAX_STOP_STRING_CHARS for s in stops)
    matcher = StopMatcher(StopStrings.compile(stops))
    period = 301
    text = ("a" * (period - 1) + "c") * 20
    per_step = []
    for char in text:
        before = matcher.comparisons
        assert matcher.feed(char) is None
        per_step.append(matcher.comparisons - before)
    assert max(per_step) <= MAX_STOP_STRINGS * (2 + MAX_STOP_STRING_CHARS - 1)
    assert matcher.comparisons <= MAX_STOP_STRINGS * 2 * len(text)
    early, late = per_step[2 * period : 5 * period], per_step[15 * period : 18 * period]
    assert early == late  # the 17th run of the pattern costs exactly what the 3rd did


def test_detokenizer_steps_read_only_new_text(tokenizer: Tokenizer) -> None:
    """A detokenizer with 16 long stop strings over a 600-token output: every update's comparisons are bounded
    by its new characters and the stop length, never by the output so far."""
    stops = [f"{i:02d}" + "never seen " * 20 for i in range(MAX_STOP_STRINGS)]
    ids = tokenizer.encode(" never seen" * 600)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say"), SamplingParams(stop=stops))
    longest = max(map(len, stops))
    for token_id in ids:
        before, text_before = detok.stop_matcher.comparisons, len(detok.output_text)
        assert detok.update([token_id]) is None
        new = len(detok.output_text) - text_before
        assert detok.stop_matcher.comparisons - before <= MAX_STOP_STRINGS * (2 * new + longest - 1)
    assert len(detok.output_text) == len(" never seen") * 600
    assert detok.held_back_length() == 0  # " never seen" is no prefix of "NNnever seen…"


def test_children_share_one_compiled_table(tokenizer: Tokenizer) -> None:
    params = SamplingParams(stop=["xyz", "END"], n=1)
    children = [Request(f"r-{i}", [1, 2], params, None) for i in range(3)]
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", children)
    matchers = [processor._children[c.request_id].detokenizer.stop_matcher for c in children]
    assert len({id(m) for m in matchers}) == 3  # each child keeps its own state…
    assert len({id(m.stops) for m in matchers}) == 1  # …over one table compiled once
