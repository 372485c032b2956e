"""Tokenizer wrapper: HF ``tokenizers`` (tokenizer.json) + the model's jinja2 chat template.

The runtime path never imports transformers: encoding/decoding is the Rust ``tokenizers`` library, the chat
template is rendered by :mod:`kvscope.common.chat_template` (shared with the gateway) the way
``transformers.utils.chat_template_utils`` does, and the rendered text is tokenized without special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import tokenizers

from kvscope.common.chat_template import (
    ChatTemplateError,
    compile_chat_template,
    load_chat_template,
    normalize_messages,
    special_tokens,
)
from kvscope.engine.errors import InvalidParameterError


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table used by byte-level BPE.

    Source: openai/gpt-2 ``encoder.py`` (also ``tokenizers`` ``ByteLevel``): printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100 onwards in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Encode/decode, chat template, special ids and per-token bytes of one model.

    Build it with :meth:`from_dir`. ``hf`` is the underlying ``tokenizers.Tokenizer``.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.hf = hf
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        """Template variables ``bos_token``, ``eos_token``, … (token text)."""
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        """Every id that ends generation (generation_config list + tokenizer eos), primary first."""
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.bos_token_id = bos_token_id
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.all_special_ids: tuple[int, ...] = tuple(sorted(i for i, t in added.items() if t.special))
        self._added_text = {i: t.content for i, t in added.items()}
        self._token_kind = _token_kind(json.loads(hf.decoder.__getstate__()) if hf.decoder else {})
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self._template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``,
        ``generation_config.json``, ``config.json`` when present) from ``model_dir``.

        EOS ids, in order: ``generation_config.json`` ``eos_token_id`` (int or list), the tokenizer_config
        ``eos_token``, ``config.json`` ``eos_token_id``. The chat template file wins over the
        tokenizer_config key, as in transformers. Raises FileNotFoundError without tokenizer.json.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the model folder needs a HF fast tokenizer")
        hf = tokenizers.Tokenizer.from_file(str(path))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special = special_tokens(tok_config)
        gen_config = _read_json(model_dir / "generation_config.json")
        config = _read_json(model_dir / "config.json")
        eos_ids = [
            *_as_ids(gen_config.get("eos_token_id")),
            *_as_ids(_token_id(hf, special.get("eos_token"))),
            *_as_ids(config.get("eos_token_id")),
        ]
        bos_id = _token_id(hf, special.get("bos_token"))
        if bos_id is None:
            bos_id = next(iter(_as_ids(gen_config.get("bos_token_id") or config.get("bos_token_id"))), None)
        return cls(hf, load_chat_template(model_dir, tok_config), special, eos_ids, bos_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (e.g. a BOS). Through
        ``encode_batch``, which releases the GIL while it encodes (``Tokenizer.encode`` holds it: a 1 MB
        prompt, tokenized in a worker thread so as not to stall the server, still held every other thread,
        the scheduler's step loop included, for ~1 s on a 2-vCPU AMD EPYC); the ids are ``encode``'s."""
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 sequences become U+FFFD)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level encoded for BPE models), None if unknown."""
        return self.hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes to the text.

        Added/special tokens: their UTF-8 text. Byte-level BPE: vocabulary characters mapped back through
        :func:`bytes_to_unicode`. SentencePiece-style vocabularies: ``<0xNN>`` byte-fallback tokens are the
        byte NN, other tokens their UTF-8 text with ``▁`` as a space. Raises ValueError for an unknown id.
        """
        if token_id in self._added_text:
            return self._added_text[token_id].encode()
        token = self.hf.id_to_token(token_id)
        if token is None:
            raise InvalidParameterError("token_id", f"token id {token_id} is not in the vocabulary")
        if self._token_kind == "byte_level":
            return bytes(self._byte_decoder[c] for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("▁", " ").encode()

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template rendered to text. Message ``content`` may be a string or a list of
        ``{"type": "text", "text": ...}`` parts (joined with ``"\\n"``, as vLLM does).

        Raises InvalidParameterError("messages") for a model without a template, a non-text content part or
        a template's ``raise_exception``.
        """
        if self._template is None:
            raise InvalidParameterError("messages", "this model has no chat template; use /v1/completions")
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return self._template(normalize_messages(messages), add_generation_prompt, variables)
        except ChatTemplateError as exc:
            raise InvalidParameterError("messages", str(exc)) from exc

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: Literal[True] = True,
        **template_kwargs: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: Literal[False],
        **template_kwargs: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Token ids (``tokenize=True``) or text of the rendered chat; see :meth:`render_chat`.

        The text is tokenized without special tokens (the template writes them), as transformers does.
        """
        text = self.render_chat(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(hf: tokenizers.Tokenizer, token: str | None) -> int | None:
    return hf.token_to_id(token) if token else None


def _as_ids(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _token_kind(decoder: Mapping) -> str:
    """``byte_level`` when the decoder (or one of a Sequence's decoders) is ByteLevel, else
    ``sentencepiece``."""
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return "byte_level" if any(d.get("type") == "ByteLevel" for d in decoders) else "sentencepiece"
