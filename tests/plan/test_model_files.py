"""Reading the model (registry cache, HF folder, config.json, GGUF header) and its weight bytes on disk."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvscope.plan import formulas as f
from kvscope.plan.model_files import read_model
from kvscope.plan.shape import ModelNotFoundError
from kvscope.plan.weights_on_disk import safetensors_summary


@pytest.fixture(scope="module")
def gguf_files(model_dir):
    """The SmolLM2 GGUF read once (GGUFReader parses the tokenizer arrays: seconds)."""
    return read_model(str(next(model_dir.parent.glob("*.gguf"))))


def test_registered_name_reads_the_cached_conversion(model_dir):
    files = read_model("smollm2-135m", root=model_dir.parent.parent.parent)
    assert files.shape.source == str(model_dir / "config.json")
    assert (
        files.shape.num_layers,
        files.shape.num_heads,
        files.shape.num_kv_heads,
        files.shape.head_dim,
        files.shape.hidden_size,
        files.shape.vocab_size,
        files.shape.tie_word_embeddings,
    ) == (30, 9, 3, 64, 576, 49152, True)
    assert files.safetensors == (model_dir / "model.safetensors",)
    assert files.gguf == model_dir.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_folder_and_config_json_give_the_same_shape(model_dir):
    by_folder = read_model(str(model_dir)).shape
    by_file = read_model(str(model_dir / "config.json")).shape
    assert by_folder == by_file


def test_gguf_header_gives_the_same_shape_as_config_json(model_dir, gguf_files):
    from_gguf = gguf_files.shape
    from_hf = read_model(str(model_dir)).shape
    assert replace(from_gguf, name="x", source="") == replace(from_hf, name="x", source="")
    assert from_gguf.max_position_embeddings == 8192


def test_fp32_weight_bytes_equal_the_safetensors_file_within_1_percent(model_dir):
    files = read_model(str(model_dir))
    planned = f.weight_bytes(files.shape, "float32")
    on_disk = safetensors_summary(files.safetensors)
    assert on_disk["file_bytes"] == (model_dir / "model.safetensors").stat().st_size == 538_090_408
    assert abs(planned - on_disk["file_bytes"]) / on_disk["file_bytes"] < 0.01
    assert on_disk["data_bytes"] == planned == 538_060_032  # the header is the only difference
    assert on_disk["params_by_dtype"] == {"F32": f.param_counts(files.shape).total}


def test_gguf_weight_bytes_from_tensor_types_equal_the_tensor_data_on_disk(gguf_files):
    gguf, weights, shape = gguf_files.gguf, gguf_files.gguf_weights, gguf_files.shape
    counts = f.param_counts(shape)
    # llama.cpp's Q4_1 file type: linear layers Q4_1 (20 B / 32), token embedding Q8_0 (34 B / 32), norms F32
    assert weights.params_by_type == {
        "Q4_1": counts.linear,
        "Q8_0": counts.embedding,
        "F32": counts.total - counts.linear - counts.embedding,
    }
    by_formula = counts.linear * 20 // 32 + counts.embedding * 34 // 32 + (weights.params_by_type["F32"]) * 4
    assert weights.tensor_bytes == by_formula == 96_576_768
    assert weights.file_bytes == gguf.stat().st_size == 98_362_432
    assert abs(weights.tensor_bytes - weights.data_section_bytes) / weights.data_section_bytes < 0.01
    # the whole file is 1.8 % larger: its header holds the tokenizer (49,152 tokens + merges)
    assert weights.file_bytes - weights.data_section_bytes == 1_785_664


def test_unknown_model_names_the_registered_ones(tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        read_model(str(tmp_path / "nope"))
    assert str(info.value) == (
        f"unknown model '{tmp_path / 'nope'}': not a registered name (known: smollm2-135m), "
        "a HF folder or config.json, or a .gguf file"
    )


def test_registered_model_missing_from_the_cache_says_pull(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"run `kvscope pull smollm2-135m` first"):
        read_model("smollm2-135m", root=tmp_path)


def test_config_json_without_a_field_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "hidden_size": 32}))
    with pytest.raises(ValueError, match="has no 'num_hidden_layers'"):
        read_model(str(tmp_path))
