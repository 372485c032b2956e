"""Convert a llama.cpp GGUF file into a HF folder (config.json, model.safetensors, tokenizer, generation
config).

Every tensor is dequantized once to float32 with ``gguf.quants.dequantize``; the result is cached as
safetensors so later starts skip the slow dequantization. Tensor names follow llama.cpp's
``gguf-py/gguf/tensor_mapping.py``; the q/k row permutation that llama.cpp's ``convert_hf_to_gguf.py``
(``LlamaModel.permute``) applies for the ``llama`` architecture is undone exactly as transformers'
``modeling_gguf_pytorch_utils.LlamaTensorProcessor`` does. Qwen2/Qwen3 GGUFs are not permuted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from kvscope.common.gguf_fields import gguf_field, gguf_scalar
from kvscope.engine.weights.quant import GGUF_INT4_TYPES, Int4Blocks, int4_blocks_from_gguf

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
"""GGUF ``general.architecture`` → (HF architecture, model_type)."""

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``. Raises ValueError if unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    elif base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows ([n_head·head_dim, …]) for interleaved→half-split RoPE."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """HF config dict (LlamaConfig-style fields) from GGUF metadata. Raises ValueError for other archs."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(gguf_field(reader, "general.name", "")).lower():
        hf_arch, model_type = GGUF_ARCHITECTURES["mistral"]
    heads = int(gguf_scalar(reader, f"{arch}.attention.head_count"))
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    head_dim = (
        gguf_field(reader, f"{arch}.attention.key_length", None)
        or gguf_field(reader, f"{arch}.rope.dimension_count", None)
        or hidden // heads
    )
    tensor_names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(
            gguf_field(reader, f"{arch}.vocab_size", None) or len(reader.fields["tokenizer.ggml.tokens"].data)
        ),
        "hidden_size": hidden,
        "intermediate_size": int(gguf_scalar(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(gguf_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_scalar(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf_field(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    config.update(_rope_scaling(reader, arch, tensor_names))
    config.update(_special_tokens(reader))
    return config


def _rope_scaling(reader: GGUFReader, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """Linear RoPE scaling carries over; llama3 (``rope_freqs``) and yarn raise ValueError."""
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with rope_freqs (llama3 rope scaling) is not supported; load the HF folder")
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
    return {
        "rope_scaling": {
            "rope_type": "linear",
            "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor")),
        }
    }


def _special_tokens(reader: GGUFReader) -> dict[str, int]:
    names = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    found = {key: gguf_field(reader, f"tokenizer.ggml.{name}_token_id", None) for key, name in names.items()}
    return {key: int(value) for key, value in found.items() if value is not None}


def gguf_state_dict(reader: GGUFReader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 [out, in] under its HF name (q/k un-permuted for ``llama``)."""
    arch = gguf_field(reader, "general.architecture")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = weights.reshape([int(d) for d in reversed(tensor.shape)])
        if arch == "llama" and ".self_attn.q_proj." in name:
            weights = reverse_permute(weights, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            weights = reverse_permute(weights, kv_heads)
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))
    return tensors


def convert_gguf_to_hf(gguf_path: Path | str, out_dir: Path | str, *, tokenizer: bool = True) -> Path:
    """Write ``out_dir`` = config.json, model.safetensors (float32), generation_config.json and, when
    ``tokenizer``, tokenizer.json + tokenizer_config.json (with ``chat_template``) + chat_template.jinja.

    Built in a sibling temp folder and renamed into place, so ``out_dir`` is complete or absent. An
    existing ``out_dir`` is replaced. Returns ``out_dir``. Raises ValueError for unsupported GGUFs.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        reader = GGUFReader(gguf_path)
        config = gguf_hf_config(reader)
        save_file(gguf_state_dict(reader, config), tmp / "model.safetensors", metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates it 0600; match the other files
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(config))
        if tokenizer:
            _write_tokenizer(gguf_path, tmp, gguf_field(reader, "tokenizer.chat_template", None))
        del reader
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s into %s", gguf_path, out_dir)
    return out_dir


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {"_from_model_config": True, **{k: config[k] for k in keys if k in config}}


def _write_tokenizer(gguf_path: Path, out: Path, chat_template: str | None) -> None:
    """Tokenizer via transformers' GGUF tokenizer converter; the chat template also goes into
    tokenizer_config.json so that readers of either file find it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))
    if chat_template:
        path = out / "tokenizer_config.json"
        data = json.loads(path.read_text())
        data["chat_template"] = chat_template
        _write_json(path, data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and then deleted."""
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def gguf_int4_blocks(gguf_path: Path | str) -> dict[str, Int4Blocks]:
    """The Q4_0/Q4_1 tensors of a GGUF as unpacked int4 blocks under their HF names, rows un-permuted for
    ``llama`` q/k exactly as :func:`gguf_state_dict` does (no dequantization, no re-quantization). Tensors of
    other types are not included."""
    reader = GGUFReader(gguf_path)
    config = gguf_hf_config(reader)
    arch = gguf_field(reader, "general.architecture")
    heads = {
        ".self_attn.q_proj.": config["num_attention_heads"],
        ".self_attn.k_proj.": config["num_key_value_heads"],
    }
    out: dict[str, Int4Blocks] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in GGUF_INT4_TYPES:
            continue
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        blocks = int4_blocks_from_gguf(np.asarray(tensor.data), tensor.tensor_type, shape)
        permuted = (
            next((n for fragment, n in heads.items() if fragment in name), None) if arch == "llama" else None
        )
        if permuted is not None:
            blocks = blocks.map_rows(lambda a, n=permuted: reverse_permute(a, n))
        out[name] = blocks
    return out


def gguf_tensor_types(gguf_path: Path | str) -> dict[str, str]:
    """HF tensor name → GGML type name (``Q4_1``, ``Q8_0``, ``F32``…) of every tensor of a GGUF."""
    return {hf_tensor_name(t.name): t.tensor_type.name for t in GGUFReader(gguf_path).tensors}


INT4_CACHE_FILE = "int4_blocks.st"
"""Cache of :func:`gguf_int4_blocks` beside the converted folder's weights: GGUFReader parses every metadata
field (the 49k-token vocabulary too) in Python, tens of seconds on a loaded machine; the cache loads in a
fraction of that (docs/benchmarks.md "Engine start-up"). A safetensors file, named so that the weights loader
(``*.safetensors``) does not pick it up."""


def cached_gguf_int4_blocks(gguf_path: Path | str, cache_dir: Path | str) -> dict[str, Int4Blocks]:
    """:func:`gguf_int4_blocks`, read from ``cache_dir / INT4_CACHE_FILE`` when present, else computed and
    written there (atomically). Codes are stored two per byte (low nibble = even column), scale and zero as
    float32: the cache holds exactly what the GGUF does."""
    from safetensors.torch import load_file

    path = Path(cache_dir) / INT4_CACHE_FILE
    if path.is_file():
        flat = load_file(str(path))
        names = sorted({key.rpartition(".")[0] for key in flat})
        return {
            name: Int4Blocks(
                codes=_unpack_nibbles(flat[f"{name}.codes"]),
                scale=flat[f"{name}.scale"],
                zero=flat[f"{name}.zero"],
            )
            for name in names
        }
    blocks = gguf_int4_blocks(gguf_path)
    flat = {}
    for name, b in blocks.items():
        flat |= {
            f"{name}.codes": b.codes[:, 0::2] | (b.codes[:, 1::2] << 4),
            f"{name}.scale": b.scale,
            f"{name}.zero": b.zero,
        }
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        save_file({k: v.contiguous() for k, v in flat.items()}, str(tmp), metadata={"source": str(gguf_path)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only model folder: work without the cache
        logger.warning(
            "could not write the int4 cache %s (%s); the next start reads the GGUF again", path, exc
        )
        tmp.unlink(missing_ok=True)
    return blocks


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` (low nibble = column 2j, high = 2j+1) → uint8 ``[N, K]``."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
