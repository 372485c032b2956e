"""Upstream kinds (gateway/engines/kinds.py): each signal on the servers' own answers, and the decision
order."""

from __future__ import annotations

import pytest

from kvscope.gateway.engines.kinds import (
    KIND_SOURCES,
    UpstreamKind,
    decide_kind,
    kind_from_card,
    kind_from_cards,
    kind_from_info,
    kind_from_metric_names,
    parse_kind,
    probe_source,
)
from tests.gateway.engines.payloads import (
    LLAMACPP_CARD,
    LLAMACPP_PROPS,
    OPENAI_CARD,
    SGLANG_CARD,
    TGI_CARD,
    TGI_INFO,
    VLLM_CARD,
)

K = UpstreamKind


def test_the_card_owned_by_names_four_servers_and_nothing_else() -> None:
    kvscope_card = {"id": "smollm2-135m", "object": "model", "owned_by": "kvscope"}
    got = [
        kind_from_card(c)
        for c in (kvscope_card, VLLM_CARD, SGLANG_CARD, LLAMACPP_CARD, TGI_CARD, OPENAI_CARD)
    ]
    assert got == [K.KVSCOPE, K.VLLM, K.SGLANG, K.LLAMACPP, None, None]
    assert kind_from_card({"id": "m"}) is None
    assert kind_from_card({"owned_by": 3}) is None
    assert kind_from_cards([TGI_CARD, SGLANG_CARD]) is K.SGLANG
    assert kind_from_cards([]) is None


def test_metric_names_name_the_kind_most_of_them_carry() -> None:
    vllm = ["vllm:num_requests_running", "vllm:num_requests_waiting", "python_gc_objects_collected_total"]
    assert kind_from_metric_names(vllm) is K.VLLM
    assert kind_from_metric_names(["sglang:num_running_reqs", "sglang:token_usage"]) is K.SGLANG
    assert kind_from_metric_names(["llamacpp:requests_processing", "process_cpu_seconds_total"]) is K.LLAMACPP
    assert kind_from_metric_names(["tgi_batch_current_size", "tgi_queue_size"]) is K.TGI
    assert kind_from_metric_names(["kvscope_engine_requests_running"]) is K.KVSCOPE
    # a gateway's own series name no engine; a tie goes to the earlier prefix
    assert kind_from_metric_names(["kvscope_gateway_requests_total", "process_cpu_seconds_total"]) is None
    assert kind_from_metric_names(["tgi_queue_size", "vllm:num_requests_running"]) is K.VLLM
    assert kind_from_metric_names(["tgi_a", "tgi_b", "vllm:c"]) is K.TGI
    assert kind_from_metric_names([]) is None


def test_tgi_info_and_llamacpp_props() -> None:
    assert kind_from_info("/info", TGI_INFO) is K.TGI
    assert kind_from_info("/props", LLAMACPP_PROPS) is K.LLAMACPP
    assert kind_from_info("/props", TGI_INFO) is None
    assert kind_from_info("/info", LLAMACPP_PROPS) is None
    assert kind_from_info("/info", {**TGI_INFO, "router": "something-else"}) is None
    assert kind_from_info("/info", {"error": "not found"}) is None
    assert kind_from_info("/info", ["model_id"]) is None
    assert kind_from_info("/props", {"default_generation_settings": {}}) is None  # no total_slots
    assert (probe_source("/info"), probe_source("/props")) == ("info", "props")
    with pytest.raises(ValueError, match="not a kind probe path"):
        probe_source("/version")


def test_decision_order_config_models_metrics_probe_default() -> None:
    assert decide_kind(K.TGI, models=K.VLLM, metrics=K.SGLANG, probe=(K.LLAMACPP, "props")) == (
        K.TGI,
        "config",
    )
    assert decide_kind(None, models=K.VLLM, metrics=K.SGLANG, probe=(K.LLAMACPP, "props")) == (
        K.VLLM,
        "models",
    )
    assert decide_kind(None, metrics=K.SGLANG, probe=(K.LLAMACPP, "props")) == (K.SGLANG, "metrics")
    assert decide_kind(None, probe=(K.TGI, "info")) == (K.TGI, "info")
    assert decide_kind(None) == (K.OPENAI, "default")
    assert KIND_SOURCES == ("config", "models", "metrics", "info", "props", "default")


def test_parse_kind() -> None:
    assert [parse_kind(v) for v in ("llamacpp", K.TGI, "auto", None, 3)] == [
        K.LLAMACPP,
        K.TGI,
        None,
        None,
        None,
    ]
