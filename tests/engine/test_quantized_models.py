"""``--quantization`` end to end: a tiny Q4_0/Q4_1 GGUF written here (q/k permuted as llama.cpp does) and the
real SmolLM2 Q4_1 GGUF, loaded as int4/int8/gguf. The CPU kernel probe is replaced by a fixed choice so the
compact/dense switch (and so every number) is the same on every machine."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import kvscope.engine.platform.loader as loader
from kvscope.engine.config import ModelConfig
from kvscope.engine.models.layers import Linear
from kvscope.engine.platform.compact import model_weight_bytes, source_names
from kvscope.engine.platform.kernel_probe import KernelChoice
from kvscope.engine.platform.loader import load_model
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.weights.files import gguf_conversion_dir
from kvscope.engine.weights.gguf import INT4_CACHE_FILE, cached_gguf_int4_blocks, convert_gguf_to_hf
from kvscope.engine.weights.quant import CompactLinearKernel, Int4Blocks, Int4Weight
from kvscope.kernels.cpu_decode import PairBlocks
from tests.engine.test_models_gguf import write_gguf
from tests.engine.test_models_tiny import Pair, make_pair, new_caches, paged_step, prompt

FIXED = KernelChoice(dense_dtype=torch.bfloat16, max_rows={"int4": 4, "int8": 2})
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(autouse=True)
def fixed_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "probe_cpu_kernels", lambda: FIXED)


def q4_type(name: str, w: np.ndarray) -> gguf.GGMLQuantizationType | None:
    """The layers' projections Q4_1 (down_proj Q4_0), the rest float32, as in a llama.cpp Q4 file."""
    if ".layers." in name and w.ndim == 2:
        return gguf.GGMLQuantizationType.Q4_0 if "down_proj" in name else gguf.GGMLQuantizationType.Q4_1
    return None


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pair, Path, Path]:
    pair = make_pair("llama")
    root = tmp_path_factory.mktemp("q4")
    write_gguf(pair, "llama", root / "tiny.gguf", q4_type)
    convert_gguf_to_hf(
        root / "tiny.gguf", gguf_conversion_dir(root / "tiny.gguf", root / "cache"), tokenizer=False
    )
    return pair, root / "tiny.gguf", root / "cache"


def test_int4_layers_hold_exactly_the_gguf_blocks(tiny_q4: tuple[Pair, Path, Path]) -> None:
    pair, path, root = tiny_q4
    model, _, model_dir, model_report = load_model(
        ModelConfig(model=str(path), quantization="int4", cpu_kernels="torch"), "cpu", root=root
    )
    report = model_report.quantization
    assert (report.from_gguf, report.quantized, report.dense) == (
        8,
        0,
        1,
    )  # 2 layers x 4; lm_head stays dense
    assert model_report.gguf_path == path and model_report.cpu_kernels is None
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.cpu_kernel.compact, Int4Weight)
    assert model.model.layers[0].self_attn.qkv_proj.weight is None and model.lm_head.weight is not None
    converted = load_file(str(model_dir / "model.safetensors"))  # gguf.quants.dequantize of every tensor
    blocks = cached_gguf_int4_blocks(path, model_dir)  # now read back from the cache the load wrote
    assert (model_dir / INT4_CACHE_FILE).is_file() and len(blocks) == 14  # 7 projections x 2 layers
    for name, b in blocks.items():  # un-permuted q/k rows included: the same numbers, no re-quantization
        assert torch.equal(b.dequantize(), converted[name]), name


@pytest.mark.cpu_kernels
def test_int4_with_kvscope_cpu_kernels_holds_the_same_blocks_and_a_q8_lm_head(
    tiny_q4: tuple[Pair, Path, Path],
) -> None:
    _, path, root = tiny_q4
    torch_model, _, _, _ = load_model(
        ModelConfig(model=str(path), quantization="int4", cpu_kernels="torch"), "cpu", root=root
    )
    model, _, _, model_report = load_model(
        ModelConfig(model=str(path), quantization="int4"), "cpu", root=root
    )
    assert model_report.cpu_kernels.ok, model_report.cpu_kernels.detail  # this CPU: AVX-512 VNNI
    report = model_report.quantization
    assert (report.from_gguf, report.quantized, report.dense) == (8, 0, 1)  # the lm_head stays dense
    blocks = cached_gguf_int4_blocks(path, model_report.gguf_path.parent)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name != "lm_head":  # the GGUF's blocks in the kernels' own layout
            mine = module.cpu_kernel.compact
            if module.in_features % 64:  # rows the pair layout cannot hold (this tiny MLP's 96): torch's int4
                assert isinstance(mine, Int4Weight), name
                continue
            assert isinstance(mine, PairBlocks) and mine.bits == 4, name
            gguf_weights = Int4Blocks.cat([blocks[s] for s in source_names(name)]).dequantize()
            assert torch.allclose(
                mine.dequantize(), gguf_weights, rtol=0, atol=1e-6 * gguf_weights.abs().max()
            ), name
            assert isinstance(dict(torch_model.named_modules())[name].cpu_kernel.compact, Int4Weight)
    head = model.decode_head  # the fused decode step's Q8 copy (compute_logits: one-row logits only)
    assert isinstance(head, PairBlocks) and head.bits == 8 and model.lm_head.weight is not None
    dense = torch_model.lm_head.weight.float()
    assert (head.dequantize() - dense).abs().max() <= dense.abs().amax(dim=1, keepdim=True).max() / 254 + 1e-6


def test_int4_tiny_model_stays_within_bfloat16_of_its_dequantized_weights(
    tiny_q4: tuple[Pair, Path, Path],
) -> None:
    pair, path, root = tiny_q4
    dense, _, _, _ = load_model(ModelConfig(model=str(path)), "cpu", root=root)
    compact, _, _, _ = load_model(ModelConfig(model=str(path), quantization="int4"), "cpu", root=root)
    tokens = prompt(3, 10)
    with torch.inference_mode():
        pairs = [Pair(pair.hf, m, pair.num_kv_heads, pair.head_dim) for m in (dense, compact)]
        (ref,), (out,) = (paged_step(p, new_caches(p), [(tokens[:3], 0, [0])]) for p in pairs)
    assert ref.argmax().item() == out.argmax().item()
    assert (out - ref).abs().max().item() < 0.02 * ref.abs().max().item()


def test_gguf_needs_a_gguf_and_quantization_needs_a_cpu(tiny_q4: tuple[Pair, Path, Path]) -> None:
    _, path, root = tiny_q4
    model, _, model_dir, model_report = load_model(
        ModelConfig(model=str(path), quantization="gguf", cpu_kernels="torch"), "cpu", root=root
    )
    assert (model_report.quantization.from_gguf, model_report.quantization.dense) == (8, 1)
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF model"):
        load_model(ModelConfig(model=str(model_dir), quantization="gguf"), "cpu")
    with pytest.raises(ValueError, match="runs on CPU only"):
        load_model(ModelConfig(model=str(path), quantization="int4"), "cuda", root=root)
    with pytest.raises(ValueError, match="quantization must be auto, none, int8, int4 or gguf"):
        ModelConfig(quantization="awq")


def test_int4_from_a_float_folder_and_int8_quantize_every_projection(
    tiny_q4: tuple[Pair, Path, Path],
) -> None:
    _, path, root = tiny_q4
    _, _, model_dir, _ = load_model(ModelConfig(model=str(path)), "cpu", root=root)
    int4, _, _, int4_report = load_model(
        ModelConfig(model=str(model_dir), quantization="int4", cpu_kernels="torch"), "cpu"
    )
    assert (int4_report.quantization.from_gguf, int4_report.quantization.quantized) == (0, 8)
    int8, _, _, int8_report = load_model(ModelConfig(model=str(model_dir), quantization="int8"), "cpu")
    assert (int8_report.quantization.quantized, int8_report.quantization.dense) == (
        9,
        0,
    )  # + lm_head
    assert int8.lm_head.cpu_kernel.fmt == "int8"


def greedy(llm) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def int4_llm():
    from kvscope.engine.llm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "probe_cpu_kernels", lambda: FIXED)
        return LLM("smollm2-135m", quantization="int4", kv_cache_memory=64 << 20)


def test_smollm2_int4_is_the_gguf_q4_1_and_deterministic(int4_llm, llm) -> None:
    report = int4_llm.engine.load_report
    assert (report.quantization.from_gguf, report.quantization.dense, report.dtype) == (120, 0, torch.float32)
    first, second = greedy(int4_llm), greedy(int4_llm)
    assert first == second and [len(t) for t in first] == [16] * len(PROMPTS)
    # the reference: the fp32 engine on gguf.quants-dequantized weights (the converted model) — what llama.cpp
    # computes, up to its own rounding. Measured on a Xeon (AMX): 7 of 8 prompts identical over 16 tokens.
    reference = greedy(llm)
    assert sum(a == b for a, b in zip(first, reference, strict=True)) >= len(PROMPTS) - 1
    info = int4_llm.engine.info
    assert info.weights_bytes == model_weight_bytes(int4_llm.engine.model)
    assert info.weights_bytes < llm.engine.info.weights_bytes


def test_smollm2_bfloat16_int8_is_deterministic() -> None:
    from kvscope.engine.llm import LLM

    int8 = LLM("smollm2-135m", dtype="bfloat16", quantization="int8", kv_cache_memory=64 << 20)
    model, model_report = int8.engine.model, int8.engine.load_report
    assert model_report.quantization.quantized == 121  # 4 x 30 (fused) projections + the LM head
    assert isinstance(model.logits_kernel, CompactLinearKernel) and model.logits_kernel.fmt == "int8"
    assert (model_report.dtype, model.model.embed_tokens.weight.dtype) == (
        torch.bfloat16,
        torch.bfloat16,
    )
    info = int8.engine.info  # bfloat16 KV cache: 30 layers x (K, V) x 16 tokens x 3 heads x 64 dims x 2 bytes
    assert info.kv_cache_bytes == info.num_blocks * 30 * 2 * 16 * 3 * 64 * 2
    first = greedy(int8)
    assert first == greedy(int8) and [len(t) for t in first] == [16] * len(PROMPTS)


def test_engine_flags_reach_the_model_config() -> None:
    from kvscope.engine.llm import build_engine_config
    from kvscope.engine.server.cli import build_parser, engine_config_kwargs

    args = build_parser().parse_args(["--dtype", "auto", "--quantization", "int4"])
    config = build_engine_config(args.model, **engine_config_kwargs(args))
    assert (config.model.dtype, config.model.quantization) == ("auto", "int4")
    assert build_engine_config("smollm2-135m").model.quantization == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "awq"])


def test_dtype_auto_is_the_probed_dense_dtype_on_cpu_and_bfloat16_elsewhere() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loader.resolve_dtype("auto", cpu, FIXED) == torch.bfloat16
    assert loader.resolve_dtype("auto", cpu, KernelChoice(torch.float32, {})) == torch.float32
    assert loader.resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert loader.resolve_dtype("float32", cpu, FIXED) == torch.float32
