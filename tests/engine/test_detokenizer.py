"""kvscope.engine.text.detokenizer with the real SmolLM2 tokenizer: UTF-8 safe streaming, stop strings,
hold-back."""

from __future__ import annotations

import pytest

from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.text.detokenizer import (
    IncrementalDetokenizer,
    _prime_ids,
    complete_characters,
    find_stop_string,
    longest_prefix_suffix,
)
from kvscope.engine.text.tokenizer import Tokenizer

STREAM_TEXTS = [
    " The quick brown fox jumps over the lazy dog.\n\nNew paragraph!",
    "你好，世界！今天天气很好。",
    "👨\u200d👩\u200d👧\u200d👦 🇫🇷 🌶️🎉 ❤️\u200d🔥",
    "Žluťoučký kůň úpěl ďábelské ódy, e\u0301",
]


def stream(
    tokenizer: Tokenizer, prompt: str | list[int], output_ids: list[int], **params
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ``output_ids`` one by one; return the detokenizer, the deltas (last one with finished=True) and
    the stop string that ended it (if any)."""
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    deltas, stop = [], None
    for i, token_id in enumerate(output_ids):
        stop = detok.update([token_id])
        finished = stop is not None or i == len(output_ids) - 1
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return detok, deltas, stop


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_deltas_join_to_decode_without_replacement_chars(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok, deltas, stop = stream(tokenizer, "Say something:", ids)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text and detok.output_token_ids == ids
    assert not any("\ufffd" in d for d in deltas)
    assert ("" in deltas) == (not text.isascii())  # a token holding part of a character yields ""


def test_exact_deltas_for_split_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("你好!")
    assert ids == [18645, 250, 48392, 138, 17]
    assert stream(tokenizer, "Hi", ids)[1] == ["", "你", "", "好", "!"]


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab你好x")
    assert ids == [369, 18645, 250, 48392, 138, 104]
    _, deltas, _ = stream(tokenizer, ids[:2], ids[2:])  # the prompt ends with b"\xe4\xbd", half of 你
    assert deltas == ["你", "", "好", "x"]  # the character it completes, never the prompt's "ab"


def test_prompt_text_sharing_the_split_characters_token_is_not_repeated(tokenizer: Tokenizer) -> None:
    """serving case T1: SmolLM2's token "ĠðŁ" is a space and the first half of 🌶; a prompt ending with it
    must not make the first delta start with that space (found by a break-it run: ' 🌶' came back)."""
    ids = tokenizer.encode("The dish is 🌶️!")
    assert ids[:4] == [504, 8626, 314, 15107] and tokenizer.token_bytes(15107) == b" \xf0\x9f"
    _, deltas, _ = stream(tokenizer, ids[:4], ids[4:])
    assert "".join(deltas) == "🌶️!" and deltas[0] == ""  # 🌶 whole, from the token that completes it
    assert tokenizer.decode(ids[:4]).rstrip("\ufffd") + "".join(deltas) == "The dish is 🌶️!"


def test_complete_characters() -> None:
    assert [
        complete_characters(b) for b in (b" \xf0\x9f", b"a\xe4", b"\xe4\xbd", "你".encode(), b"ab", b"")
    ] == [" ", "a", "", "你", "ab", ""]


def test_prime_starts_on_a_character_boundary(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("I said 你好，世界")
    assert ids == [57, 1137, 216, 18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230]
    assert _prime_ids(tokenizer, ids) == ids[7:]  # ids[7] = b"\xef\xbc\x8c" starts a character
    assert _prime_ids(tokenizer, ids[:12]) == ids[5:12]  # ids[6] = b"\xbd" continues ids[5] = b"\xe5\xa5"
    assert _prime_ids(tokenizer, ids[:4]) == ids[:4] and _prime_ids(tokenizer, []) == []
    _, deltas, _ = stream(tokenizer, [], ids)
    assert "".join(deltas) == "I said 你好，世界"


def test_leading_space_of_first_token_kept(tokenizer: Tokenizer) -> None:
    _, deltas, _ = stream(tokenizer, "The capital of France is", tokenizer.encode(" Paris."))
    assert deltas == [" Paris", "."]


def test_stop_string_spanning_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" L M N O P Q R")
    assert [tokenizer.decode([i]) for i in ids] == [" L", " M", " N", " O", " P", " Q", " R"]
    detok, deltas, stop = stream(tokenizer, "A B C D E F G H I J K", ids, stop=["O P Q"])
    assert stop == "O P Q" and detok.stop_reason == "O P Q"
    # " O" → hold "O"; " P" → hold "O P"; " Q" completes the stop: output ends before it.
    assert deltas == [" L", " M", " N", " ", "", ""]
    assert detok.output_text == " L M N " and "".join(deltas) == detok.output_text
    assert detok.update([ids[-1]]) is None and detok.output_text == " L M N "


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" L M N O P Q R")
    detok, deltas, stop = stream(tokenizer, "A B C", ids, stop=["O P Q"], include_stop_str_in_output=True)
    assert stop == "O P Q"
    assert deltas == [" L", " M", " N", " O", " P", " Q"]
    assert detok.output_text == " L M N O P Q"


def test_stop_string_strict_prefix_of_a_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" Paris is nice")
    assert tokenizer.decode(ids[:1]) == " Paris"
    detok, deltas, stop = stream(tokenizer, "The capital of France is", ids, stop=["Pari"])
    assert (stop, deltas, detok.output_text) == ("Pari", [" "], " ")
    detok, deltas, stop = stream(
        tokenizer, "The capital of France is", ids, stop=["Pari"], include_stop_str_in_output=True
    )
    assert (stop, deltas, detok.output_text) == ("Pari", [" Pari"], " Pari")


def test_earliest_stop_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" L M N O P")
    detok, deltas, stop = stream(tokenizer, "K", ids, stop=["N O", "M"])
    assert (stop, detok.output_text, "".join(deltas)) == ("M", " L ", " L ")
    assert find_stop_string("xx abc ab", 4, ["ab", "c a"]) == ("c a", 5)
    assert find_stop_string("ab xx", 2, ["ab"]) is None  # "ab" ended before the new text


def test_unmatched_stop_is_flushed_at_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" L M N O P Q R")
    detok, deltas, stop = stream(tokenizer, "K", ids, stop=["XYZ", "Q R S"])
    assert stop is None
    assert deltas == [
        " L",
        " M",
        " N",
        " O",
        " P",
        " ",
        "Q R",
    ]  # "Q" held (it starts "Q R S"); the end flushes
    assert "".join(deltas) == detok.output_text == " L M N O P Q R"


def test_hold_back_only_genuine_prefixes(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(
        tokenizer, tokenizer.encode("Say"), SamplingParams(stop=["world peace", "lo x"])
    )
    detok.update(tokenizer.encode(" Hello"))
    assert detok.held_back_length() == 2 and detok.get_next_output_text(False, True) == " Hel"
    detok.update(tokenizer.encode(" world"))
    assert detok.held_back_length() == 5  # "world" starts "world peace"; "lo x" does not match "lo w"
    assert detok.get_next_output_text(False, True) == "lo "
    assert detok.get_next_output_text(False, delta=False) == " Hello "
    detok.update(tokenizer.encode("!"))
    assert detok.held_back_length() == 0 and detok.get_next_output_text(False, True) == "world!"
    assert [longest_prefix_suffix(t, "abc") for t in ("xxab", "xxa", "xxb", "xxc", "abc", "")] == [
        2,
        1,
        0,
        0,
        0,
        0,
    ]
    assert longest_prefix_suffix("xaab", "aab c") == 3 and longest_prefix_suffix("aa", "aab") == 2


def test_stop_ignored_during_min_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" L M L")
    detok, deltas, stop = stream(tokenizer, "K", ids, stop=["L"], min_tokens=1)
    assert stop == "L" and detok.output_text == " L M " and detok.output_token_ids == ids


def test_special_tokens_and_stop_terminated(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode(" Hi"), tokenizer.eos_token_id]
    assert stream(tokenizer, "x", ids)[0].output_text == " Hi"
    assert stream(tokenizer, "x", ids, skip_special_tokens=False)[0].output_text == " Hi<|im_end|>"
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(skip_special_tokens=False))
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.output_text == " Hi" and detok.output_token_ids == ids
