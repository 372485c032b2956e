"""Llama-family model architectures over the paged KV cache (llama.py, layers.py) and the architecture
registry (registry.py). Weight formats and model files: kvscope.engine.weights; the CPU platform:
kvscope.engine.platform."""

from kvscope.engine.models.llama import (
    ArchConfig,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from kvscope.engine.models.registry import ARCHITECTURES, get_model_class

__all__ = [
    "ARCHITECTURES",
    "ArchConfig",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
]
