"""Size caps on per-request sampling lists (issue 35, serving case N1): logit_bias (300 entries, canonical
decimal keys), stop_token_ids (1024, de-duplicated), stop strings (16 of at most 256 characters). Each
over-cap or malformed value is a 400 naming the field before anything reaches the engine; the cap itself is
accepted."""

from __future__ import annotations

import pytest

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from tests.engine.server.conftest import chat_body

VOCAB = 256  # FakeTokenizer's


def completion(**fields) -> dict:
    return {"model": "fake-model", "prompt": "hi", "max_tokens": 2, **fields}


def test_the_caps_are_the_stated_values() -> None:
    assert (MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS) == (
        300,
        1024,
        16,
        256,
    )


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias",
     "logit_bias may hold at most 300 entries, got 301."),
    ({"logit_bias": {"1_0": 1.0}}, "logit_bias",
     "logit_bias keys must be token ids written in decimal digits (like \"50256\"), got '1_0'."),
    ({"logit_bias": {" 1": 1.0}}, "logit_bias",
     "logit_bias keys must be token ids written in decimal digits (like \"50256\"), got ' 1'."),
    ({"logit_bias": {"+1": 1.0}}, "logit_bias",
     "logit_bias keys must be token ids written in decimal digits (like \"50256\"), got '+1'."),
    ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids",
     "stop_token_ids may hold at most 1024 token ids, got 1025."),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop",
     "at most 16 stop strings are allowed."),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop",
     "stop strings may be at most 256 characters long, got one of 257."),
    ({"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop",
     "stop strings may be at most 256 characters long, got one of 257."),
])  # fmt: skip
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_over_cap_and_malformed_lists_are_a_400_naming_the_field(
    client, fake_engine, route, fields, param, message
) -> None:
    body = completion(**fields) if route == "/v1/completions" else chat_body(max_tokens=2, **fields)
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_value",
    }
    assert fake_engine.started == ["warmup"], "nothing may reach the engine"


@pytest.mark.parametrize("key", ["01", "-1", "1 ", "\u0661", "1e3", "0x1", "", "1" * 11, "9" * 5000])
def test_other_non_canonical_logit_bias_keys_are_refused(client, key) -> None:
    response = client.post("/v1/completions", json=completion(logit_bias={key: 1.0}))
    assert (response.status_code, response.json()["error"]["param"]) == (400, "logit_bias")


@pytest.mark.parametrize("fields", [
    {"logit_bias": {str(i): 0.5 for i in range(VOCAB)}},  # the fake's whole vocabulary (fewer than 300 ids)
    {"logit_bias": {"0": -100, "255": 100}},
    {"stop_token_ids": [5] * MAX_STOP_TOKEN_IDS},
    {"stop": [f"{i:02d}" + "x" * (MAX_STOP_STRING_CHARS - 2) for i in range(MAX_STOP_STRINGS)]},
])  # fmt: skip
def test_at_the_cap_is_accepted(client, fields) -> None:
    response = client.post("/v1/completions", json=completion(**fields))
    assert response.status_code == 200, response.text


def test_logit_bias_beyond_the_vocabulary_names_the_field(client) -> None:
    response = client.post("/v1/completions", json=completion(logit_bias={str(VOCAB): 1.0}))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "logit_bias token ids must be in [0, 255]."


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: "2"}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
])  # fmt: skip
def test_sampling_params_enforce_the_caps_for_every_client(kwargs, param) -> None:
    """The offline LLM and the engine core get the same caps as HTTP clients (SamplingParams checks them)."""
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == param


def test_sampling_params_accept_the_caps() -> None:
    params = SamplingParams(
        logit_bias={i: 0.5 for i in range(MAX_LOGIT_BIAS)},
        stop_token_ids=range(MAX_STOP_TOKEN_IDS),
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
    )
    assert (len(params.logit_bias), len(params.stop_token_ids), len(params.stop)) == (300, 1024, 16)


def test_stop_token_ids_are_deduplicated_in_first_order() -> None:
    params = SamplingParams(stop_token_ids=[7, 5, 7, 5, 9])
    assert (params.stop_token_ids, params.stop_token_id_set) == ((7, 5, 9), frozenset({5, 7, 9}))
