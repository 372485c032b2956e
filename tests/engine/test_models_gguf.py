"""GGUF → HF conversion on tiny GGUF files written here with gguf.GGUFWriter (llama.cpp names and q/k
permutation), loaded through our loader and compared with the HF model they were made from."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvscope.engine.config import ModelConfig
from kvscope.engine.platform.loader import load_model
from kvscope.engine.weights.gguf import convert_gguf_to_hf, hf_tensor_name, reverse_permute
from tests.engine.test_models_tiny import ATOL, Pair, hf_logits, make_pair, new_caches, paged_step, prompt

# Written independently of engine/weights/gguf.py: llama.cpp's names (gguf-py tensor_mapping.py).
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, suffix = hf_name.rsplit(".", 1)
    if base in globals_:
        return f"{globals_[base]}.{suffix}"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[part]}.{suffix}"


def write_gguf(
    pair: Pair,
    arch: str,
    path: Path,
    qtype: Callable[[str, np.ndarray], gguf.GGMLQuantizationType | None] = lambda name, w: None,
) -> None:
    """The tiny model as a llama.cpp GGUF (llama's q/k rows permuted as llama.cpp does); ``qtype(name, w)``
    picks a quantization per tensor (None: float32)."""
    cfg = pair.hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_key_length(pair.head_dim)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in pair.hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        quant = qtype(name, w)
        if quant is None:
            writer.add_tensor(gguf_name(name), w)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("case", "arch"), [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_converted_gguf_matches_source_model(case: str, arch: str, tmp_path: Path) -> None:
    pair = make_pair(case)
    write_gguf(pair, arch, tmp_path / "tiny.gguf")
    out = convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", tokenizer=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(pair.hf).__name__]
    assert (config["head_dim"], config["num_key_value_heads"], config["eos_token_id"]) == (
        pair.head_dim,
        2,
        2,
    )
    assert config["tie_word_embeddings"] == pair.hf.config.tie_word_embeddings
    model, _, model_dir, model_report = load_model(ModelConfig(model=str(out)), "cpu")
    assert model_dir == out and model_report.converted is False
    loaded = Pair(pair.hf, model, pair.num_kv_heads, pair.head_dim)
    tokens = prompt(5, 10)
    (logits,) = paged_step(loaded, new_caches(loaded), [(tokens, 0, [3, 1, 0])])
    torch.testing.assert_close(logits, hf_logits(pair, tokens), atol=ATOL, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp dirs left behind


def test_reconversion_replaces_output(tmp_path: Path) -> None:
    pair = make_pair("qwen2")
    write_gguf(pair, "qwen2", tmp_path / "tiny.gguf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stale.txt").write_text("old")
    convert_gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", tokenizer=False)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_reverse_permute_inverts_llama_cpp_permute() -> None:
    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    back = reverse_permute(llama_cpp_permute(w, 3), 3)
    np.testing.assert_array_equal(back, w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_tensor_names() -> None:
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.12.ffn_norm.weight") == "model.layers.12.post_attention_layernorm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="unsupported GGUF tensor 'rope_freqs.weight'"):
        hf_tensor_name("rope_freqs.weight")
