"""The planner's formulas against hand-computed values (MHA, GQA, MQA tiny configs and SmolLM2's real one)."""

from __future__ import annotations

import pytest

from kvscope.plan import formulas as f
from kvscope.plan.shape import ModelShape, shape_from_hf_config


def tiny(
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    hidden: int = 32,
    inter: int = 64,
    vocab: int = 100,
    tied: bool = False,
    model_type: str = "llama",
) -> dict:
    return {
        "architectures": [],
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    }


MHA = tiny(2, 4, 4, 8)
GQA = tiny(3, 8, 2, 16, hidden=128)
MQA = tiny(5, 8, 1, 32, hidden=256)


@pytest.mark.parametrize(
    ("config", "kind", "dtype", "per_token"),
    [
        (MHA, "MHA", "float32", 2 * 2 * 4 * 8 * 4),  # 512 B
        (GQA, "GQA", "bfloat16", 2 * 3 * 2 * 16 * 2),  # 384 B
        (MQA, "MQA", "float16", 2 * 5 * 1 * 32 * 2),  # 640 B
        (MQA, "MQA", "fp8", 2 * 5 * 1 * 32 * 1),  # 320 B
    ],
)
def test_kv_bytes_per_token_by_attention_kind(config, kind, dtype, per_token):
    shape = shape_from_hf_config(config)
    assert shape.attention_kind == kind
    assert f.kv_bytes_per_token(shape, dtype) == per_token


def test_smollm2_real_config_46080_bytes_per_token_fp32(model_dir):
    import json

    shape = shape_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (30, 3, 64)
    assert f.kv_bytes_per_token(shape, "float32") == 30 * 3 * 64 * 2 * 4 == 46_080
    assert f.kv_bytes_per_token(shape, "bfloat16") == 23_040
    # one sequence of 8192 tokens in 16-token blocks: 512 blocks of 737,280 B = 360 MiB
    assert f.kv_bytes_per_sequence(shape, "float32", 8192, 16) == 512 * 737_280 == 360 << 20
    assert f.kv_bytes_per_sequence(shape, "float32", 8193, 16) == 513 * 737_280
    assert f.num_kv_blocks(1 << 30, shape, "float32", 16) == (1 << 30) // 737_280 == 1456
    assert f.max_concurrent_sequences(1456, 1024, 16) == 1456 // 64 == 22


def test_kv_bytes_agree_with_the_engines_allocator():
    import torch

    from kvscope.engine.worker.kv_cache import kv_cache_bytes_per_block

    for config in (MHA, GQA, MQA):
        shape = shape_from_hf_config(config)
        for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            engine = kv_cache_bytes_per_block(
                shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, torch_dtype
            )
            assert f.kv_bytes_per_token(shape, dtype) * 16 == engine


def test_parameter_count_by_hand_for_the_mha_config():
    counts = f.param_counts(shape_from_hf_config(MHA))
    # per layer: q,k,v 32×(32+32+32) + o 32×32 = 4096; MLP 3×32×64 = 6144; 2 norms × 32 = 64
    assert counts.per_layer == 4096 + 6144 + 64 == 10_304
    assert (counts.embedding, counts.lm_head, counts.final_norm) == (3200, 3200, 32)
    assert counts.total == 2 * 10_304 + 3200 + 3200 + 32 == 27_040
    assert f.weight_bytes(shape_from_hf_config(MHA), "float32") == 27_040 * 4
    assert f.weight_bytes(shape_from_hf_config(MHA), "bfloat16", "int8") == 2 * (4096 + 6144) + 2 * (
        27_040 - 20_480
    )


@pytest.mark.parametrize(
    "config",
    [
        MHA,
        GQA,
        MQA,
        tiny(2, 4, 2, 8, tied=True),
        tiny(2, 4, 2, 8, model_type="qwen2"),
        tiny(2, 4, 2, 8, model_type="qwen3"),
    ],
)
def test_parameter_count_equals_the_engines_model(config):
    import torch

    from kvscope.engine.models.registry import get_model_class

    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert f.param_counts(shape_from_hf_config(config)).total == sum(p.numel() for p in model.parameters())


def test_smollm2_parameters_and_flops(model_dir):
    import json

    shape = shape_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    counts = f.param_counts(shape)
    # embedding 49152×576; per layer q 576² + k,v 2×576×192 + o 576² + MLP 3×576×1536 + 2×576; final norm 576
    assert (
        counts.total
        == 28_311_552 + 30 * (331_776 + 221_184 + 331_776 + 2_654_208 + 1152) + 576
        == 134_515_008
    )
    assert f.weight_bytes(shape, "float32") == 4 * 134_515_008
    # decode: 2 × (linear + lm_head) FLOPs per token + attention 4 × layers × heads × head_dim × context
    assert f.matmul_params(shape) == 106_168_320 + 28_311_552
    assert f.decode_flops(shape, 2, 100) == 2 * (2 * 134_479_872 + 4 * 30 * 9 * 64 * 100)


def test_roofline_takes_the_slower_of_memory_and_compute():
    shape = shape_from_hf_config(MHA)
    bound = f.decode_step(
        shape, batch=4, context=10, streamed_bytes=1000, kv_dtype="float32", bandwidth=1000.0, peak_flops=1e12
    )
    assert bound.bytes == 1000 + 4 * 10 * 512
    assert (bound.memory_s, bound.bound) == (21.48, "memory")
    fast_memory = f.decode_step(shape, 4, 10, 1000, "float32", bandwidth=1e15, peak_flops=1.0)
    assert fast_memory.bound == "compute"
    assert fast_memory.seconds == f.decode_flops(shape, 4, 10)


def test_ggml_block_sizes_match_the_gguf_package():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name in ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"):
        elements, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]]
        assert f.QUANT_BYTES[name] == nbytes / elements


def test_shape_refuses_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="num_heads 6 is not a multiple of num_kv_heads 4"):
        ModelShape("x", 1, 8, 6, 4, 8, 16, 10, False, 16)
