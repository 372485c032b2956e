"""Serving case N4, "Budgets hold" (../shared/cases/serving-cases.md): a key's tokens-per-minute budget
bounds what its requests may generate when they name no ``max_tokens``, and the pass-through routes
(``/v1/*`` the gateway does not interpret) are held to the key's model restriction and rate limits like
generation requests. Through the in-process gateway; tests/gateway/test_redis_shared.py runs the budget
against shared Redis limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvscope.gateway.admission import tpm_output_cap
from kvscope.gateway.auth import hash_key
from kvscope.testing.harness import (
    GatewayThread,
    LoopThread,
    make_tokenizer_dir,
    records_by_id,
    start_fake_thread,
)
from tests.gateway.conftest import Stack

KEYS = {
    "tpm": "sk-tpm-1000",
    "only-a": "sk-only-a",
    "only-ab": "sk-only-ab",
    "only-tok": "sk-only-tok",
    "rpm": "sk-rpm-2",
    "all": "sk-all",
}
TPM = 1000
CONTEXT = 2048
"""The fake upstream's context: a request without max_tokens and with ignore_eos runs to its end."""
HI = [{"role": "user", "content": "hi"}]


def generated_tokens(record) -> int:
    """Completion tokens a fake upstream wrote into one stream (its token events: ``"content":"t{i} "``)."""
    return record.sse.count('"content":"t')


@pytest.fixture(scope="module")
def budgets(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Upstream ``a`` serves tok-model and model-a, ``b`` serves model-b, ``ab`` serves both model-a and
    model-b; keys: a TPM-1000 key, keys restricted to some models, an RPM-2 key, a key for every model."""
    from kvscope.gateway.app import create_app
    from kvscope.gateway.settings import load_settings

    tmp = tmp_path_factory.mktemp("budgets")
    fakes = {
        "a": start_fake_thread(loop, ("tok-model", "model-a"), max_model_len=CONTEXT),
        "b": start_fake_thread(loop, ("model-b",)),
        "ab": start_fake_thread(loop, ("model-a", "model-b")),
    }
    config = {
        "upstreams": [
            {"url": fakes["a"].url, "models": ["tok-model", "model-a"]},
            {"url": fakes["b"].url, "models": ["model-b"]},
            {"url": fakes["ab"].url, "models": ["model-a", "model-b"]},
        ],
        "models": [{"name": "tok-model", "tokenizer": str(make_tokenizer_dir(tmp))}],
        "api_keys": [
            {"name": "tpm", "sha256": hash_key(KEYS["tpm"]), "limits": {"tokens_per_minute": TPM}},
            {"name": "only-a", "sha256": hash_key(KEYS["only-a"]), "models": ["tok-model", "model-a"]},
            {"name": "only-ab", "sha256": hash_key(KEYS["only-ab"]), "models": ["model-a", "model-b"]},
            {"name": "only-tok", "sha256": hash_key(KEYS["only-tok"]), "models": ["tok-model"]},
            {"name": "rpm", "sha256": hash_key(KEYS["rpm"]), "limits": {"requests_per_minute": 2}},
            {"name": "all", "sha256": hash_key(KEYS["all"])},
        ],
        "routing": {"health_interval_s": 60},
        "logs": {"file": str(tmp / "requests.jsonl")},
    }
    gateway = GatewayThread(create_app(load_settings(None, config, env={})))
    with gateway:
        yield Stack(gateway, fakes, None, tmp / "requests.jsonl")  # type: ignore[arg-type]
    for fake in fakes.values():
        loop.run(fake.close())


def _client(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.url, headers={"authorization": f"Bearer {KEYS[key]}"}, timeout=60)


# --- tokens per minute -----------------------------------------------------------------------------------
def test_n4_a_tpm_key_without_max_tokens_generates_at_most_its_budget(budgets: Stack) -> None:
    """Serving case N4: a key with ``tokens_per_minute: 1000`` sends 10 concurrent streams without
    ``max_tokens`` (``ignore_eos``: each would run to the 2,048-token context). One is admitted with the
    budget's worth injected as max_tokens (1,000 − its prompt), the other nine get 429 (the bucket is empty
    for the next minute), so the upstream generates 1,000 − prompt tokens in all. Before, every stream was
    charged its prompt alone: all ten ran to the end of the context (10 × 2,042 tokens)."""
    fake = budgets.fakes["a"]
    before = len(fake.records)
    body = {"model": "tok-model", "messages": HI, "stream": True, "ignore_eos": True}

    async def one(i: int) -> int:
        async with httpx.AsyncClient(
            base_url=budgets.url, timeout=120, headers={"authorization": f"Bearer {KEYS['tpm']}"}
        ) as c:
            resp = await c.post("/v1/chat/completions", json=body, headers={"x-request-id": f"n4-tpm-{i}"})
            return resp.status_code

    async def run() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(10)))

    statuses = asyncio.run(run())
    assert sorted(statuses) == [200] + [429] * 9
    admitted = f"n4-tpm-{statuses.index(200)}"
    record = records_by_id(budgets.log, [admitted])[admitted][0]
    prompt = record["kvscope"]["prompt_tokens_counted"]
    upstream = [r for r in fake.records[before:] if r.path == "/v1/chat/completions"]
    assert [r.body["max_tokens"] for r in upstream] == [TPM - prompt]
    assert sum(generated_tokens(r) for r in upstream) == TPM - prompt
    assert record["gen_ai"]["request"]["max_tokens"] == TPM - prompt


@pytest.mark.parametrize(
    ("tpm", "prompt", "choices", "expected"),
    [
        (None, 10, 1, None),  # no TPM limit: no cap
        (1000, 10, 1, 990),
        (1000, 10, 3, 330),  # every choice generates: the budget is shared
        (1000, 1000, 1, 1),  # the prompt fills the budget: the limiter refuses the request as too large
        (1000, 5000, 2, 1),
    ],
)
def test_tpm_output_cap(tpm, prompt, choices, expected) -> None:
    assert tpm_output_cap(tpm, prompt, choices) == expected


# --- the pass-through ------------------------------------------------------------------------------------
def test_n4_a_model_restricted_key_never_reaches_another_models_upstream(budgets: Stack) -> None:
    """Serving case N4: a key restricted to model-a sends ``POST /v1/embeddings {"input": "x"}`` (no model
    named) six times to a gateway that also fronts model-b: all six reach the replica serving only its models,
    none the replica of model-b or the one serving both (whose default model may be model-b). Before, a body
    naming no model went to any healthy replica (3 of 6 reached model-b's upstream in the probe)."""
    counts = {name: len(fake.records) for name, fake in budgets.fakes.items()}
    with _client(budgets, "only-a") as c:
        answers = [c.post("/v1/embeddings", json={"input": "x"}) for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 6
    reached = {name: [r.path for r in fake.records[counts[name] :]] for name, fake in budgets.fakes.items()}
    assert reached == {"a": ["/v1/embeddings"] * 6, "b": [], "ab": []}


def test_a_restricted_key_reaches_only_replicas_serving_its_models_else_403(budgets: Stack) -> None:
    """A key for model-a and model-b: the replicas serving nothing else (``b``, ``ab``) share its requests,
    not ``a`` (it serves tok-model too). A key whose models no replica serves alone (tok-model: ``a``
    serves model-a beside it) is refused with 403 before any upstream call."""
    counts = {name: len(fake.records) for name, fake in budgets.fakes.items()}
    with _client(budgets, "only-ab") as c:
        answers = [c.post("/v1/embeddings", json={"input": "x"}).status_code for _ in range(4)]
    with _client(budgets, "only-tok") as c:
        refused = c.post("/v1/embeddings", json={"input": "x"})
        named = c.post("/v1/embeddings", json={"model": "tok-model", "input": "x"})
    assert answers == [200] * 4
    assert (refused.status_code, refused.json()["error"]["code"]) == (403, "model_not_allowed")
    assert refused.json()["error"]["param"] == "model"
    assert named.status_code == 200  # naming its model routes to a replica serving it
    assert {name: len(fake.records) - counts[name] for name, fake in budgets.fakes.items()} == {
        "a": 1,
        "b": 2,
        "ab": 2,
    }
    with _client(budgets, "only-a") as c:  # naming a model it may not use: as admission answers it
        other = c.post("/v1/embeddings", json={"model": "model-b", "input": "x"})
        chat = c.post("/v1/chat/completions", json={"model": "model-b", "messages": HI})
    assert (other.status_code, other.json()["error"]["code"]) == (403, "model_not_allowed")
    assert (chat.status_code, chat.json()["error"]["code"]) == (403, "model_not_allowed")


def test_n4_pass_through_requests_are_charged_to_the_keys_rpm(budgets: Stack) -> None:
    """Serving case N4: after a key's requests per minute are spent, pass-through requests are refused too
    (429 with Retry-After and the ``x-ratelimit-*`` headers), and each admitted one counts against the RPM.
    Before, 30 of 30 pass-through requests were forwarded after the RPM was spent."""
    before = sum(len(fake.records) for fake in budgets.fakes.values())
    with _client(budgets, "rpm") as c:
        answers = [c.post("/v1/embeddings", json={"model": "model-a", "input": "x"}) for _ in range(2)]
        answers += [c.get("/v1/files") for _ in range(3)]
        answers.append(c.post("/v1/chat/completions", json={"model": "model-a", "messages": HI}))
    assert [a.status_code for a in answers] == [200, 200, 429, 429, 429, 429]
    assert [a.headers.get("x-ratelimit-remaining-requests") for a in answers] == [
        "1",
        "0",
        "0",
        "0",
        "0",
        "0",
    ]
    refused = answers[2]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-limit-requests"] == "2"
    assert sum(len(fake.records) for fake in budgets.fakes.values()) - before == 2


# --- what the probes show --------------------------------------------------------------------------------
def test_metrics_need_a_key_that_may_see_every_model(budgets: Stack) -> None:
    """With API keys configured /metrics (its series name every model and upstream) answers 401 without a key
    and 403 to a key restricted to some models; a key for all models reads it. Before, anyone could."""
    anonymous = httpx.get(budgets.url + "/metrics")
    with _client(budgets, "only-a") as c:
        restricted = c.get("/metrics")
    with _client(budgets, "all") as c:
        full = c.get("/metrics")
    assert (anonymous.status_code, anonymous.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (restricted.status_code, restricted.json()["error"]["code"]) == (403, "permission_denied")
    assert "model-b" not in anonymous.text + restricted.text
    assert full.status_code == 200 and "kvscope_gateway_requests_total" in full.text


def test_readyz_names_models_only_to_key_holders(budgets: Stack) -> None:
    """/readyz stays open (readiness probes carry no key) but names no model to a caller without a valid key;
    a key sees the models it may use, as in /v1/models."""
    anonymous = httpx.get(budgets.url + "/readyz")
    wrong = httpx.get(budgets.url + "/readyz", headers={"authorization": "Bearer sk-nope"})
    with _client(budgets, "only-a") as c:
        restricted = c.get("/readyz")
    with _client(budgets, "all") as c:
        full = c.get("/readyz")
    assert anonymous.status_code == wrong.status_code == 200
    assert anonymous.json() == wrong.json() == {"status": "ready"}
    assert restricted.json() == {"status": "ready", "models": {"tok-model": True, "model-a": True}}
    assert full.json()["models"] == {"tok-model": True, "model-a": True, "model-b": True}


def test_metrics_public_opens_metrics_to_scrapers(loop: LoopThread, tmp_path: Path) -> None:
    """``metrics_public: true``: a Prometheus without a key scrapes /metrics while keys guard the API."""
    from kvscope.gateway.app import create_app
    from kvscope.gateway.settings import load_settings

    fake = start_fake_thread(loop, ("fake-model",))
    config = {
        "upstreams": [{"url": fake.url}],
        "metrics_public": True,
        "routing": {"health_interval_s": 60},
        "api_keys": [{"name": "all", "sha256": hash_key(KEYS["all"])}],
    }
    try:
        with GatewayThread(create_app(load_settings(None, config, env={}))) as gateway:
            scraped = httpx.get(gateway.url + "/metrics")
            api = httpx.get(gateway.url + "/v1/models")
    finally:
        loop.run(fake.close())
    assert scraped.status_code == 200 and "kvscope_gateway_upstream_up" in scraped.text
    assert api.status_code == 401
    assert json.loads(api.text)["error"]["code"] == "invalid_api_key"
