"""Literal answers of the servers whose upstream kinds the gateway reads (gateway/engines/), shaped as each
server's source writes them (the field order too); the values are this test's own.

- llama.cpp: ``tools/server/server-task.cpp`` ``server_task_result_cmpl_final::to_json_oaicompat_chat``
  (non-streamed), ``to_json_oaicompat_chat_stream`` (the last chunk: the usage chunk, ``timings`` appended),
  ``result_timings::to_json``; ``/props``: ``tools/server/server-context.cpp`` ``get_props``.
- TGI: ``router/src/server.rs`` ``generate_internal`` (the headers of a non-streamed chat answer),
  ``get_model_info`` / ``router/src/lib.rs`` ``struct Info`` (``/info``), ``openai_get_model_info``
  (``/v1/models``).
- vLLM: ``vllm/entrypoints/openai/engine/protocol.py`` ``UsageInfo``, ``PromptTokenUsageInfo``, ``ModelCard``.
- SGLang: ``python/sglang/srt/entrypoints/openai/protocol.py`` ``UsageInfo``, ``ModelCard``.
"""

from __future__ import annotations

from typing import Any

LLAMACPP_TIMINGS: dict[str, Any] = {
    "cache_n": 9,
    "prompt_n": 16,
    "prompt_ms": 52.125,
    "prompt_per_token_ms": 3.2578125,
    "prompt_per_second": 306.9544364508393,
    "predicted_n": 4,
    "predicted_ms": 30.75,
    "predicted_per_token_ms": 7.6875,
    "predicted_per_second": 130.08130081300813,
}
LLAMACPP_USAGE: dict[str, Any] = {
    "completion_tokens": 4,
    "prompt_tokens": 25,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 9},
}
LLAMACPP_CHAT: dict[str, Any] = {
    "choices": [
        {
            "finish_reason": "length",
            "index": 0,
            "message": {"role": "assistant", "content": "Hello! How can"},
        }
    ],
    "created": 1765000000,
    "model": "smollm2-135m",
    "system_fingerprint": "b6190-ae532eac",
    "object": "chat.completion",
    "usage": LLAMACPP_USAGE,
    "id": "chatcmpl-3pQ3ADIgQ1WcNqWQNjsaDOVvxc2S2y9M",
    "timings": LLAMACPP_TIMINGS,
}
LLAMACPP_LAST_CHUNK: dict[str, Any] = {
    "choices": [],
    "created": 1765000000,
    "id": "chatcmpl-3pQ3ADIgQ1WcNqWQNjsaDOVvxc2S2y9M",
    "model": "smollm2-135m",
    "system_fingerprint": "b6190-ae532eac",
    "object": "chat.completion.chunk",
    "usage": LLAMACPP_USAGE,
    "timings": LLAMACPP_TIMINGS,
}
LLAMACPP_FINISH_CHUNK: dict[str, Any] = {
    "choices": [{"finish_reason": "length", "index": 0, "delta": {}}],
    "created": 1765000000,
    "id": "chatcmpl-3pQ3ADIgQ1WcNqWQNjsaDOVvxc2S2y9M",
    "model": "smollm2-135m",
    "system_fingerprint": "b6190-ae532eac",
    "object": "chat.completion.chunk",
}
LLAMACPP_PROPS: dict[str, Any] = {
    "default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8}, "n_ctx": 4096},
    "total_slots": 4,
    "model_alias": "smollm2-135m",
    "model_path": "/models/SmolLM2-135M-Instruct-Q8_0.gguf",
    "modalities": {"vision": False, "audio": False},
    "endpoint_slots": True,
    "endpoint_props": False,
    "endpoint_metrics": True,
    "chat_template": "{{ bos_token }}…",
    "build_info": "b6190-ae532eac",
}
LLAMACPP_CARD: dict[str, Any] = {
    "id": "smollm2-135m",
    "object": "model",
    "created": 1765000000,
    "owned_by": "llamacpp",
    "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx_train": 8192, "n_embd": 576},
}

TGI_HEADERS: dict[str, str] = {
    "x-compute-type": "gpu+optimized",
    "x-compute-time": "1.52",
    "x-compute-characters": "54",
    "x-total-time": "1520",
    "x-validation-time": "2",
    "x-queue-time": "310",
    "x-inference-time": "1208",
    "x-time-per-token": "30",
    "x-prompt-tokens": "18",
    "x-generated-tokens": "40",
}
TGI_USAGE: dict[str, Any] = {"prompt_tokens": 18, "completion_tokens": 40, "total_tokens": 58}
TGI_INFO: dict[str, Any] = {
    "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "model_sha": None,
    "model_pipeline_tag": "text-generation",
    "max_concurrent_requests": 128,
    "max_best_of": 2,
    "max_stop_sequences": 4,
    "max_input_tokens": 4095,
    "max_total_tokens": 4096,
    "validation_workers": 2,
    "max_client_batch_size": 4,
    "router": "text-generation-router",
    "version": "3.3.6-dev0",
    "sha": None,
    "docker_label": None,
}
TGI_CARD: dict[str, Any] = {
    "id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "object": "model",
    "created": 0,
    "owned_by": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

VLLM_USAGE: dict[str, Any] = {
    "prompt_tokens": 1024,
    "total_tokens": 1100,
    "completion_tokens": 76,
    "prompt_tokens_details": {"cached_tokens": 512},
}
VLLM_USAGE_NO_DETAILS: dict[str, Any] = {
    "prompt_tokens": 1024,
    "total_tokens": 1100,
    "completion_tokens": 76,
    "prompt_tokens_details": None,
}
VLLM_CARD: dict[str, Any] = {
    "id": "Qwen/Qwen3-0.6B",
    "object": "model",
    "created": 1765000000,
    "owned_by": "vllm",
    "root": "Qwen/Qwen3-0.6B",
    "parent": None,
    "max_model_len": 40960,
    "permission": [],
}
SGLANG_USAGE: dict[str, Any] = {
    "prompt_tokens": 37,
    "total_tokens": 45,
    "completion_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 32},
    "reasoning_tokens": 0,
}
SGLANG_CARD: dict[str, Any] = {
    "id": "Qwen/Qwen3-0.6B",
    "object": "model",
    "created": 1765000000,
    "owned_by": "sglang",
    "root": "Qwen/Qwen3-0.6B",
    "max_model_len": 40960,
}
OPENAI_CARD: dict[str, Any] = {
    "id": "gpt-4o-mini",
    "object": "model",
    "created": 1721172741,
    "owned_by": "system",
}
