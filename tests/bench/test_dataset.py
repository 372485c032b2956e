"""Prompts as text: exact re-encoded lengths, length ranges, no special tokens, seeds; JSONL prompts."""

from __future__ import annotations

import json
import random

import pytest

from kvscope.bench.dataset import (
    decode_to_target_len,
    jsonl_dataset,
    length_range,
    load_tokenizer,
    random_dataset,
)
from tests.bench.fakes import write_word_tokenizer


@pytest.fixture
def tokenizer(tmp_path):
    return load_tokenizer(write_word_tokenizer(tmp_path / "tokenizer.json"))


def test_random_prompts_have_the_target_length_and_no_special_tokens(tokenizer):
    samples = random_dataset(tokenizer, 20, input_len=12, output_len=5, seed=3)
    assert [s.prompt_len for s in samples] == [12] * 20
    assert [s.expected_output_len for s in samples] == [5] * 20
    for s in samples:
        ids = tokenizer.encode(s.prompt, add_special_tokens=False).ids
        assert len(ids) == 12 and s.token_mismatch == 0
        assert not {0, 1} & set(ids)  # <s>, <unk>
    assert random_dataset(tokenizer, 20, 12, 5, seed=3) == samples
    assert random_dataset(tokenizer, 20, 12, 5, seed=4) != samples


def test_range_ratio_bounds_lengths(tokenizer):
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(10, 0.0) == (10, 10)
    assert length_range(1, 0.9) == (1, 2)
    samples = random_dataset(tokenizer, 200, input_len=20, output_len=8, range_ratio=0.5, seed=0)
    assert {s.prompt_len for s in samples} == set(range(10, 31))
    assert {s.expected_output_len for s in samples} == set(range(4, 13))
    with pytest.raises(ValueError):
        length_range(10, 1.0)


class MergingTokenizer:
    """Characters 'a' (id 0), 'b' (1) and 'ab' (2); encoding merges "ab" greedily, so lengths change."""

    pieces = ["a", "b", "ab"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(2)
                i += 2
            else:
                ids.append(self.pieces.index(text[i]))
                i += 1
        return type("Encoding", (), {"ids": ids})()


def test_decode_to_target_len_extends_and_truncates():
    rng = random.Random(0)
    # a b a b → "abab" → [ab, ab]: 2 < 4, append two 'a' → "ababaa" → 4 tokens
    assert decode_to_target_len(MergingTokenizer(), [0, 1, 0, 1], 4, rng, allowed=[0]) == ("ababaa", 4)
    # a a a → 3 > 2 → truncate to a a
    assert decode_to_target_len(MergingTokenizer(), [0, 0, 0], 2, rng, allowed=[0]) == ("aa", 2)


def test_jsonl_prompts_cycle_and_carry_output_lengths(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"prompt": "alpha beta", "output_len": 7})
        + "\n\n"
        + json.dumps({"prompt": "gamma", "max_tokens": 2})
        + "\n"
    )
    samples = jsonl_dataset(path, 5, output_len=3, tokenizer=tokenizer, seed=0)
    assert len(samples) == 5
    by_prompt = {s.prompt: (s.prompt_len, s.expected_output_len) for s in samples}
    assert by_prompt == {"alpha beta": (2, 7), "gamma": (1, 2)}
    assert [s.prompt for s in samples[:2]] == [s.prompt for s in samples[2:4]]
    assert jsonl_dataset(path, 1, 3, tokenizer=None)[0].prompt_len == 0
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_dataset(path, 1, 3, None)
