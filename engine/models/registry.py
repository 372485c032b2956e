"""Architecture registry: HF ``architectures`` / ``model_type`` → model class."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvscope.engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

ARCHITECTURES: Mapping[str, type[LlamaForCausalLM]] = MappingProxyType(
    {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
    }
)
MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
)


def get_model_class(hf_config: Mapping[str, Any]) -> type[LlamaForCausalLM]:
    """Class for a HF config dict (first known entry of ``architectures``, else ``model_type``).

    Raises ValueError naming the supported architectures.
    """
    for name in hf_config.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = hf_config.get("model_type")
    if model_type in MODEL_TYPES:
        return ARCHITECTURES[MODEL_TYPES[model_type]]
    raise ValueError(
        f"unsupported architecture {hf_config.get('architectures')} (model_type={model_type!r}); "
        f"supported: {', '.join(ARCHITECTURES)}"
    )
