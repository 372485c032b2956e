"""Cache-aware routing through the real gateway over stub upstreams: a conversation's turns stay on one
replica, distinct prefixes spread, a replica that goes away or restarts loses its prefixes, and the request
log and metrics say what the router decided and predicted."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.gateway.app import create_app
from kvscope.gateway.settings import load_settings
from kvscope.gateway.tokenize import ModelTokenizer
from kvscope.testing.fake_upstream import FakeUpstream, Knobs
from kvscope.testing.harness import (
    GatewayThread,
    LoopThread,
    make_tokenizer_dir,
    metric_samples,
    records_by_id,
    sample,
)
from kvscope.testing.wait import wait_until

BLOCK = 4
MODEL = "tok-model"


def card(instance: str) -> dict[str, Any]:
    return {"block_size": BLOCK, "num_gpu_blocks": 64, "instance_id": instance}


class Cluster:
    def __init__(self, loop: LoopThread, tmp: Path) -> None:
        self.loop, self.tmp = loop, tmp
        self.fakes = [self._start(port=0) for _ in range(3)]
        self.text_fakes = [loop.run(FakeUpstream(("text-model",)).start()) for _ in range(2)]
        folder = make_tokenizer_dir(tmp)
        self.tokenizer = ModelTokenizer.load(folder)
        settings = load_settings(
            None,
            {
                "upstreams": [{"url": f.url} for f in self.fakes + self.text_fakes],
                "models": [{"name": MODEL, "tokenizer": str(folder)}],
                "routing": {"health_interval_s": 0.2},
                "logs": {"file": str(tmp / "requests.jsonl")},
            },
            env={},
        )
        self.gateway = GatewayThread(create_app(settings))

    def _start(self, port: int) -> FakeUpstream:
        fake = FakeUpstream((MODEL,), card_kvscope=card(uuid.uuid4().hex), knobs=Knobs(cached_tokens=3))
        return self.loop.run(fake.start(port=port))

    def restart(self, i: int) -> None:
        """Stop fake ``i`` and start a new instance on its port (its cache is empty)."""
        port = self.fakes[i].port
        self.loop.run(self.fakes[i].kill())
        self.fakes[i] = self._start(port)

    def label(self, fake: FakeUpstream) -> str:
        return f"127.0.0.1:{fake.port}"

    def replicas(self) -> Any:
        return {r.label: r for r in self.gateway.state.pool.replicas}

    def wait(self, predicate: Any, what: str) -> None:
        wait_until(predicate, 10, what, interval_s=0.05)

    def chat(self, messages: list[dict[str, str]], request_id: str, model: str = MODEL) -> dict[str, Any]:
        """Send one chat request; its log record's ``kvscope.routing``."""
        resp = httpx.post(
            self.gateway.url + "/v1/chat/completions",
            json={"model": model, "messages": messages, "max_tokens": 2},
            headers={"x-request-id": request_id},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        record = records_by_id(self.tmp / "requests.jsonl", [request_id])[request_id][0]
        return record["kvscope"]["routing"]

    def close(self) -> None:
        for fake in self.fakes + self.text_fakes:
            self.loop.run(fake.close())


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    loop = LoopThread()
    c = Cluster(loop, tmp_path)
    with c.gateway:
        c.wait(lambda: all(r.healthy for r in c.gateway.state.pool.replicas), "healthy replicas")
        yield c
    c.close()
    loop.stop()


def conversation(system: str, turns: int) -> list[list[dict[str, str]]]:
    """The message lists of a conversation's first ``turns`` turns (each repeats the history)."""
    history = [{"role": "system", "content": system}]
    out = []
    for i in range(turns):
        history = [*history, {"role": "user", "content": "hi " * (i + 1)}]
        out.append(history)
        history = [*history, {"role": "assistant", "content": "hello world"}]
    return out


SYSTEMS = ("hello " * 12, "world " * 12, "hello world " * 6)


def test_turns_stay_on_one_replica_and_distinct_prefixes_spread(cluster: Cluster) -> None:
    chats = [conversation(system, 3) for system in SYSTEMS]
    routed: dict[int, list[dict[str, Any]]] = {c: [] for c in range(3)}
    for turn in range(3):
        for c, chat in enumerate(chats):
            routed[c].append(cluster.chat(chat[turn], f"spread-{c}-{turn}"))
    homes = [{r["replica"] for r in routed[c]} for c in range(3)]
    assert all(len(h) == 1 for h in homes) and len(set.union(*homes)) == 3  # one each, all different
    assert [[r["reason"] for r in routed[c]] for c in range(3)] == [
        ["load", "prefix_match", "prefix_match"]
    ] * 3


def test_the_log_line_says_the_decision_and_the_prediction_next_to_the_report(cluster: Cluster) -> None:
    turns = conversation(SYSTEMS[0], 2)
    first = cluster.chat(turns[0], "exact-0")
    second = cluster.chat(turns[1], "exact-1")
    ids1, ids2 = (cluster.tokenizer.encode_chat(t) for t in turns)
    assert ids1 is not None and ids2 is not None and ids2[: len(ids1)] == ids1
    predicted = min(len(ids1) // BLOCK, (len(ids2) - 1) // BLOCK) * BLOCK  # turn 1's full blocks
    assert first == {
        "policy": "cache_aware",
        "reason": "load",
        "replica": first["replica"],
        "predicted_cached_tokens": 0,
        "cached_tokens": 3,
        "prefix_unit": "tokens",
    }
    assert second == {
        "policy": "cache_aware",
        "reason": "prefix_match",
        "replica": first["replica"],
        "predicted_cached_tokens": predicted,
        "cached_tokens": 3,
        "prefix_unit": "tokens",
    }
    assert (len(ids1), predicted) == (21, 20)  # ChatML: 9 template + 12 system + 1 user tokens: 5 full blocks
    s = metric_samples(httpx.get(cluster.gateway.url + "/metrics").text)
    decisions = "kvscope_gateway_routing_decisions_total"
    assert sample(s, decisions, model=MODEL, policy="cache_aware", reason="load") == 1
    assert sample(s, decisions, model=MODEL, policy="cache_aware", reason="prefix_match") == 1
    tokens = "kvscope_gateway_routing_cached_tokens_total"
    assert sample(s, tokens, model=MODEL, source="predicted") == predicted
    assert sample(s, tokens, model=MODEL, source="reported") == 6
    outcomes = "kvscope_gateway_routing_predictions_total"
    assert (
        sample(s, outcomes, model=MODEL, outcome="over"),
        sample(s, outcomes, model=MODEL, outcome="under"),
    ) == (
        1,
        1,
    )


def test_a_model_without_tokenizer_routes_by_its_text(cluster: Cluster) -> None:
    turns = conversation("hello " * 40, 3)
    routed = [cluster.chat(t, f"text-{i}", model="text-model") for i, t in enumerate(turns)]
    assert {r["replica"] for r in routed} <= {cluster.label(f) for f in cluster.text_fakes}
    assert len({r["replica"] for r in routed}) == 1
    assert [(r["reason"], r["prefix_unit"]) for r in routed] == [
        ("load", "text"),
        ("prefix_match", "text"),
        ("prefix_match", "text"),
    ]
    assert routed[1]["predicted_cached_tokens"] > 0


def test_a_prompt_longer_than_the_context_is_routed_by_load_and_leaves_the_index_alone(
    cluster: Cluster,
) -> None:
    """text-model's card says max_model_len 2048: 40,000 characters (~10,000 tokens) will be refused, so its
    blocks are not recorded anywhere."""
    turns = conversation("world " * 40, 2)
    first = cluster.chat(turns[0], "long-0", model="text-model")
    huge = cluster.chat([{"role": "user", "content": "hello " * 6667}], "long-1", model="text-model")
    assert (huge["policy"], huge["reason"], huge["predicted_cached_tokens"]) == ("cache_aware", "load", None)
    second = cluster.chat(turns[1], "long-2", model="text-model")
    assert (second["replica"], second["reason"]) == (first["replica"], "prefix_match")


def test_a_replica_that_goes_away_loses_its_prefixes_for_good(cluster: Cluster) -> None:
    chat = conversation(SYSTEMS[1], 4)
    home = cluster.chat(chat[0], "move-0")["replica"]
    i = next(i for i, f in enumerate(cluster.fakes) if cluster.label(f) == home)
    port = cluster.fakes[i].port
    cluster.loop.run(cluster.fakes[i].kill())
    second = cluster.chat(chat[1], "move-1")  # ejected by a failed connect or by its health check
    assert second["replica"] != home and second["reason"] in ("fallback", "load")
    third = cluster.chat(chat[2], "move-2")
    assert (third["replica"], third["reason"]) == (second["replica"], "prefix_match")
    # it returns (a new server on its port) with an empty cache: the conversation stays where it moved
    cluster.fakes[i] = cluster.loop.run(
        FakeUpstream((MODEL,), card_kvscope=card("back"), knobs=Knobs(cached_tokens=3)).start(port=port)
    )
    cluster.wait(lambda: cluster.replicas()[home].healthy, "the replica back")
    assert cluster.replicas()[home].prefix_index is None
    fourth = cluster.chat(chat[3], "move-3")
    assert (fourth["replica"], fourth["reason"]) == (second["replica"], "prefix_match")


def test_a_restarted_replica_is_not_credited_with_its_old_prefixes(cluster: Cluster) -> None:
    """A restart between two health checks (a new ``instance_id`` on the card, never seen down)."""
    chat = conversation(SYSTEMS[2], 2)
    home = cluster.chat(chat[0], "restart-0")["replica"]
    j = next(j for j, f in enumerate(cluster.fakes) if cluster.label(f) == home)
    before = cluster.replicas()[home].instance_id
    cluster.restart(j)
    cluster.wait(lambda: cluster.replicas()[home].instance_id not in (before, None), "the new instance seen")
    again = cluster.chat(chat[1], "restart-1")
    assert (again["reason"], again["predicted_cached_tokens"]) == ("load", 0)


def test_pass_through_requests_log_their_routing_and_a_retry_is_a_fallback(cluster: Cluster) -> None:
    resp = httpx.post(
        cluster.gateway.url + "/v1/embeddings",
        json={"model": MODEL, "input": "hello"},
        headers={"x-request-id": "pass-0"},
        timeout=10,
    )
    assert resp.status_code in (200, 404)  # whatever the stub answers: it was routed
    record = records_by_id(cluster.tmp / "requests.jsonl", ["pass-0"])["pass-0"][0]
    routing = record["kvscope"]["routing"]
    assert (routing["policy"], routing["reason"], routing["predicted_cached_tokens"]) == (
        "cache_aware",
        "load",
        None,
    )
    assert routing["replica"] in {cluster.label(f) for f in cluster.fakes}
    decision = cluster.gateway.state.pool.route(MODEL, None, retry=True)  # same replica again after a failure
    assert decision is not None and decision.reason == "fallback"
