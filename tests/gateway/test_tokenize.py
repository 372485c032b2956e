"""Prompt token counts at the edge with a real ``tokenizers`` model and its chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.gateway.settings import ModelConfig
from kvscope.gateway.tokenize import ModelTokenizer, PromptCounter, estimate_tokens
from kvscope.testing.harness import make_tokenizer_dir


@pytest.fixture(scope="module")
def counter(tmp_path_factory: pytest.TempPathFactory) -> PromptCounter:
    folder = make_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    return PromptCounter.from_config([ModelConfig(name="m", tokenizer=str(folder)), ModelConfig(name="bare")])


def test_chat_prompt_is_rendered_with_the_template_then_counted(counter: PromptCounter) -> None:
    # <|im_start|> user hello world <|im_end|> <|im_start|> assistant
    assert counter.chat("m", [{"role": "user", "content": "hello world"}]) == 7
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world hi"}]
    assert (
        counter.chat(
            "m", [{"role": "system", "content": "hi", "name": None}, {"role": "user", "content": parts}]
        )
        == 4 + 6 + 2
    )


def test_completion_prompts_add_bos_and_token_ids_count_as_given(counter: PromptCounter) -> None:
    assert counter.completion("m", "hello world hello") == [4]
    assert counter.completion("m", ["hi", "hello world"]) == [2, 3]
    assert counter.completion("m", [5, 6, 7]) == [3]
    assert counter.completion("m", [[5, 6], [7]]) == [2, 1]


def test_models_without_tokenizer_or_unrenderable_input_are_left_to_the_upstream(
    counter: PromptCounter,
) -> None:
    assert counter.chat("bare", [{"role": "user", "content": "hi"}]) is None
    assert counter.completion("bare", "hello") is None
    assert counter.completion("bare", [1, 2]) == [2]  # token ids need no tokenizer
    assert counter.chat("m", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]) is None
    assert not counter.has("bare") and counter.has("m")


def test_tokenizer_json_path_without_template_and_missing_file(tmp_path: Path) -> None:
    folder = make_tokenizer_dir(tmp_path)
    (folder / "tokenizer_config.json").unlink()
    tok = ModelTokenizer.load(folder / "tokenizer.json")
    assert tok.count_text("hello") == 2 and tok.count_chat([{"role": "user", "content": "hi"}]) is None
    with pytest.raises(FileNotFoundError):
        ModelTokenizer.load(tmp_path / "nope")
    assert estimate_tokens(0) == 0 and estimate_tokens(9) == 3


def test_every_count_goes_through_encode_batch_which_releases_the_gil(tmp_path: Path) -> None:
    """``Tokenizer.encode`` holds the GIL for the whole encode (a 1 MB prompt counted in a worker thread froze
    the gateway's loop for ~1 s), ``encode_batch`` releases it: every count goes through it, with encode's
    ids, mixed completion prompts in their order, several text prompts in one call."""
    real = ModelTokenizer.load(make_tokenizer_dir(tmp_path))
    calls: list[str] = []

    class Recording:
        def encode(self, *args, **kwargs):
            calls.append("encode")
            return real.hf.encode(*args, **kwargs)

        def encode_batch(self, texts, **kwargs):
            calls.append(f"encode_batch:{len(texts)}")
            return real.hf.encode_batch(texts, **kwargs)

    tok = ModelTokenizer(Recording(), real._template, real._variables)  # type: ignore[arg-type]
    counter = PromptCounter({"m": tok})
    assert tok.encode_text("hello world hi") == real.hf.encode("hello world hi").ids
    assert counter.chat_ids("m", [{"role": "user", "content": "hello world"}]) == real.encode_chat(
        [{"role": "user", "content": "hello world"}]
    )
    assert counter.completion_ids("m", ["hi", [5, 6], "hello world"]) == [
        real.hf.encode("hi").ids,
        [5, 6],
        real.hf.encode("hello world").ids,
    ]
    assert counter.completion_ids("m", [[1], [2, 3]]) == [[1], [2, 3]]  # token ids: nothing to encode
    assert calls == ["encode_batch:1", "encode_batch:1", "encode_batch:2"]
