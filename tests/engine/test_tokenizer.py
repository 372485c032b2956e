"""kvscope.engine.text.tokenizer against the real SmolLM2 tokenizer and transformers' apply_chat_template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.text.tokenizer import Tokenizer, bytes_to_unicode

MIXED = "你好，世界！🌶️🎉 ďábelské"
TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnewlines",
    MIXED,
    "👨‍👩‍👧 family",
    "<|im_start|>user",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in 中文 🎉"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _hf_chat(hf_tokenizer, messages, **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_special_ids_and_sizes(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_id == 2
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152
    assert tokenizer.all_special_ids == tuple(range(17))
    assert tokenizer.id_to_token(2) == "<|im_end|>"
    assert tokenizer.token_to_id("<|im_start|>") == 1


def test_encode_matches_transformers_and_round_trips(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.encode("A B C") == [49, 389, 340]
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user"), skip_special_tokens=True) == "user"


def test_chat_template_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    for messages in (CHAT, CHAT[1:], CHAT[:3]):
        for add_generation_prompt in (True, False):
            expected = _hf_chat(hf_tokenizer, messages, add_generation_prompt=add_generation_prompt)
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert text == expected
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert ids == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert tokenizer.apply_chat_template(CHAT[1:2], tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_text_parts_are_joined_with_newlines(tokenizer: Tokenizer, hf_tokenizer) -> None:
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Line one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "ok", "name": None},
    ]
    joined = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Line one\ntwo"},
        {"role": "assistant", "content": "ok"},
    ]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == _hf_chat(
        hf_tokenizer, joined, add_generation_prompt=True
    )
    with pytest.raises(InvalidParameterError) as info:
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert info.value.param == "messages"


TOOLY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}\n"
    "  {% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}"
    "{% endif %}\n"
    "  {%- if loop.index0 > 5 %}{% break %}{% endif %}\n"
    "[{{ m['role'] | upper }}] {{ m['content'] | trim }} {{ m | tojson }}\n"
    "{% generation %}{{ eos_token }}{% endgeneration %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def test_template_environment_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    custom = Tokenizer(
        tokenizer.hf,
        TOOLY_TEMPLATE,
        tokenizer.special_tokens,
        tokenizer.eos_token_ids,
        tokenizer.bos_token_id,
    )
    messages = [{"role": "user", "content": '  <b>é</b> "q"  '}, {"role": "assistant", "content": "中"}]
    for add_generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            messages,
            chat_template=TOOLY_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        assert custom.apply_chat_template(messages, add_generation_prompt, tokenize=False) == expected
    assert custom.apply_chat_template(messages[:1], tokenize=False) == (
        '<|im_start|>[USER] <b>é</b> "q" {"role": "user", "content": "  <b>é</b> \\"q\\"  "}\n'
        "<|im_end|>[ASSISTANT]"
    )
    with pytest.raises(InvalidParameterError, match="bad role tool") as info:
        custom.apply_chat_template([{"role": "tool", "content": "x"}])
    assert info.value.param == "messages"


def test_token_bytes_concatenate_to_utf8(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(MIXED)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == tokenizer.decode(ids).encode("utf-8") == MIXED.encode("utf-8")
    assert ids[:2] == [18645, 250] and pieces[:2] == [b"\xe4\xbd", b"\xa0"]  # 你 split over two tokens
    assert tokenizer.token_bytes(2) == b"<|im_end|>"
    assert tokenizer.token_bytes(tokenizer.encode(" L")[0]) == b" L"
    with pytest.raises(ValueError):
        tokenizer.token_bytes(10**7)


def test_bytes_to_unicode_is_gpt2_table() -> None:
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"


def test_sentencepiece_byte_fallback_bytes() -> None:
    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "<0xA0>": 3, "▁Hi": 4, "!": 5}
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok = Tokenizer(hf, None, {})
    assert [tok.token_bytes(i) for i in range(1, 6)] == [b"\xe4", b"\xbd", b"\xa0", b" Hi", b"!"]
    assert tok.decode([4, 1, 2, 3]) == "Hi你"
    with pytest.raises(InvalidParameterError) as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"


def test_from_dir_reads_generation_config_and_template_key(tokenizer_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{{ messages[0]['content'] }}|"},
        {"name": "tool_use", "template": "tools"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (0, 2, 5) and tok.eos_token_id == 0
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False) == "hey|"
    (tmp_path / "chat_template.jinja").write_text("jinja wins")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([], tokenize=False) == "jinja wins"
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path)


def test_encode_goes_through_encode_batch_which_releases_the_gil(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tokenizers.Tokenizer.encode`` holds the GIL for the whole encode (a 1 MB prompt tokenized in the
    server's worker thread held the scheduler's step loop ~1 s); ``encode_batch`` releases it and gives the
    same ids, so every encode goes through it."""
    real = tokenizer.hf
    calls: list[str] = []

    class Recording:
        def __getattr__(self, name: str):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(tokenizer, "hf", Recording())
    for text in TEXTS:
        assert tokenizer.encode(text) == real.encode(text).ids
        assert (
            tokenizer.encode(text, add_special_tokens=False)
            == real.encode(text, add_special_tokens=False).ids
        )
    assert set(calls) == {"encode_batch"}
