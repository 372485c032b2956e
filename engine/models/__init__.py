"""Llama-family models over the paged KV cache, their loader and the GGUF converter."""

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
