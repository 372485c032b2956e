"""The served weight format in /v1/models (the card's ``kvscope`` field, OpenAI fields unchanged) and as the
labels of ``kvscope_engine_weights_bytes``; process RSS from prometheus_client's process collector."""

from __future__ import annotations

import pytest

from kvscope.engine.memory import process_memory_bytes
from tests.engine.server.helpers import metric_samples, sample


def test_model_card_carries_the_format_and_keeps_the_openai_fields(client) -> None:
    card = client.get("/v1/models").json()["data"][0]
    assert sorted(card) == ["created", "id", "kvscope", "max_model_len", "object", "owned_by", "root"]
    assert (card["id"], card["object"], card["owned_by"], card["root"]) == (
        "fake-model",
        "model",
        "kvscope",
        "/models/fake",
    )
    instance_id = card["kvscope"].pop("instance_id")
    assert len(instance_id) == 32 and int(instance_id, 16) >= 0  # a uuid4, new at every start
    assert card["kvscope"] == {
        "block_size": 16,
        "num_gpu_blocks": 7,
        "dtype": "bfloat16",
        "quantization": "gguf",
        "weights_bytes": 2000,
        "kv_cache_bytes": 1000,
        "rss_bytes": 5000,
        "reason": "fake: fastest verified format",
        "cpu_kernels": "kvscope (fused decode up to 2 rows)",
    }


def test_weights_metric_is_labelled_with_the_format(client) -> None:
    s = metric_samples(client.get("/metrics").text)
    weights = {labels: value for (name, labels), value in s.items() if name == "kvscope_engine_weights_bytes"}
    assert weights == {(("dtype", "bfloat16"), ("model", "fake-model"), ("quantization", "gguf")): 2000.0}
    kernels = {
        labels: value for (name, labels), value in s.items() if name == "kvscope_engine_weights_kernel_info"
    }
    assert kernels == {
        (("first_row", "1"), ("kernel", "gemv"), ("last_row", "2"), ("model", "fake-model")): 1.0,
        (
            ("first_row", "3"),
            ("kernel", "dense_bfloat16"),
            ("last_row", "+Inf"),
            ("model", "fake-model"),
        ): 1.0,
    }
    assert sample(s, "process_resident_memory_bytes") == pytest.approx(process_memory_bytes()[0], rel=0.1)
