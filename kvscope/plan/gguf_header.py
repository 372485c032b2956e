"""Shape and exact weight bytes from a GGUF header (``gguf`` package's ``GGUFReader``; no torch).

Metadata keys are llama.cpp's (``{arch}.block_count``, ``{arch}.attention.head_count_kv`` …, see
``gguf-py/gguf/constants.py``). Bytes per tensor come from ``gguf.constants.GGML_QUANT_SIZES`` (elements per
quant block, bytes per block), the table llama.cpp's ``ggml.c`` ``type_traits`` define.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.common.gguf_fields import gguf_scalar
from kvscope.plan.shape import ModelShape


@dataclass(frozen=True, slots=True)
class GgufWeights:
    tensor_bytes: int
    """Σ over tensors of ``elements / block_elements × block_bytes`` (GGML_QUANT_SIZES)."""
    data_section_bytes: int
    """File size minus the offset of the first tensor: what the tensors take on disk (with alignment)."""
    file_bytes: int
    """The whole file: header (metadata, tokenizer vocabulary) + tensor data."""
    params_by_type: dict[str, int]
    """GGML type name (Q4_1, Q8_0, F32 …) → parameters stored in it."""


def _reader(path: Path) -> Any:
    """The gguf package's reader. Raises ValueError for a file it cannot parse (a damaged or truncated header
    raises IndexError, struct.error, ValueError … inside the library)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure inside the parser means "not a readable GGUF"
        raise ValueError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def read_gguf(path: Path, name: str = "") -> tuple[ModelShape, GgufWeights]:
    """Shape and weight bytes of a ``.gguf`` file, from one parse of its header (GGUFReader takes seconds on
    a file with a large tokenizer vocabulary). Raises ValueError for missing metadata."""
    reader = _reader(path)
    return _shape(reader, path, name), _weights(reader, path)


def _shape(reader: Any, path: Path, name: str) -> ModelShape:
    arch = gguf_scalar(reader, "general.architecture")
    heads = int(gguf_scalar(reader, f"{arch}.attention.head_count"))
    hidden = int(gguf_scalar(reader, f"{arch}.embedding_length"))
    tensors = {t.name for t in reader.tensors}
    vocab = gguf_scalar(reader, f"{arch}.vocab_size", None) or len(
        reader.fields["tokenizer.ggml.tokens"].data
    )
    head_dim = gguf_scalar(reader, f"{arch}.attention.key_length", None) or hidden // heads
    return ModelShape(
        name=name or path.stem,
        num_layers=int(gguf_scalar(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(gguf_scalar(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        intermediate_size=int(gguf_scalar(reader, f"{arch}.feed_forward_length")),
        vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=int(gguf_scalar(reader, f"{arch}.context_length")),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        source=str(path),
    )


def _weights(reader: Any, path: Path) -> GgufWeights:
    """Weight bytes computed from each tensor's element count and type."""
    from gguf.constants import GGML_QUANT_SIZES

    total, by_type = 0, {}
    for tensor in reader.tensors:
        block_elements, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        total += int(tensor.n_elements) // block_elements * block_bytes
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_elements)
    size = path.stat().st_size
    first = min((int(t.data_offset) for t in reader.tensors), default=size)
    return GgufWeights(total, size - first, size, by_type)
