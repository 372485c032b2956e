"""The routing policies, the prompt-prefix hashes and the per-replica prefix index, without a network."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvscope.gateway.routing.prefix import chat_text, completion_text, text_prefix, token_prefix
from kvscope.gateway.routing.prefix_index import PrefixIndex
from kvscope.gateway.routing.router import Router
from kvscope.gateway.settings import CacheAwareConfig, ModelConfig, RoutingConfig


@dataclass
class FakeReplica:
    name: str
    outstanding: int = 0
    prefix_index: PrefixIndex | None = None
    block_size: int | None = None
    capacity_tokens: int | None = None

    def kv_cache_capacity(self, model: str) -> tuple[int | None, int | None]:
        return self.block_size, self.capacity_tokens


def router(policy: str = "auto", **cache_aware: float) -> Router:
    config = RoutingConfig(policy=policy, cache_aware=CacheAwareConfig(**cache_aware))  # type: ignore[arg-type]
    return Router(config, {"pinned": ModelConfig(name="pinned", routing="round_robin")})


# --- prefix hashes ------------------------------------------------------------------------------------------
def test_token_prefix_hashes_full_blocks_in_a_chain() -> None:
    a = token_prefix("m", list(range(10)), 4)
    b = token_prefix("m", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], 4)
    assert (len(a.hashes), a.num_tokens, a.block_size, a.unit) == (2, 10, 4, "tokens")
    assert a.hashes[0] == b.hashes[0] and a.hashes[1] != b.hashes[1]  # diverged in block 1
    assert token_prefix("other", list(range(10)), 4).hashes[0] != a.hashes[0]  # models never share
    # the same block after a different prefix is a different hash (the chain)
    assert token_prefix("m", [9, 9, 9, 9, 0, 1, 2, 3], 4).hashes[1] != a.hashes[0]
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        token_prefix("m", [1], 0)


@pytest.mark.parametrize(
    ("num_tokens", "matched", "cacheable"),
    [(16, 4, 3), (17, 4, 4), (17, 9, 4), (5, 1, 1), (4, 1, 0), (1, 0, 0)],
)
def test_cacheable_blocks_never_include_the_last_prompt_token(num_tokens: int, matched: int, cacheable: int):
    assert token_prefix("m", list(range(num_tokens)), 4).cacheable_blocks(matched) == cacheable


def test_text_prefix_uses_four_characters_per_token() -> None:
    prefix = text_prefix("m", "x" * 70, 4)  # blocks of 16 characters
    assert (len(prefix.hashes), prefix.num_tokens, prefix.unit) == (4, 18, "text")


def test_chat_text_keeps_message_order_and_tools_first() -> None:
    first = chat_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    longer = chat_text(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
    )
    assert longer.startswith(first)
    assert chat_text([{"role": "user", "content": "hi"}], tools=[{"type": "function"}]).startswith(
        '[{"type": "function"}]'
    )
    assert completion_text(["a", "b"]) == "a" and completion_text([1, 2]) == "1 2"
    assert completion_text([[3, 4], [5]]) == "3 4" and completion_text([]) is None


# --- prefix index -------------------------------------------------------------------------------------------
def test_index_matches_leading_blocks_only() -> None:
    index = PrefixIndex(16)
    index.insert([1, 2, 3])
    assert (index.match([1, 2, 3, 4]), index.match([1, 2, 9]), index.match([9, 1]), index.match([])) == (
        3,
        2,
        0,
        0,
    )


def test_index_evicts_least_recently_used_prompt_tails_first() -> None:
    index = PrefixIndex(4)
    index.insert([1, 2, 3])
    index.insert([7, 8])  # 5 blocks > 4: the oldest, prompt 1's last block, goes
    assert (len(index), index.match([1, 2, 3]), index.match([7, 8])) == (4, 2, 2)
    index.insert([1, 2, 3])  # prompt 1 again: now the most recent; prompt 2's tail is the oldest
    assert (index.match([1, 2, 3]), index.match([7, 8])) == (3, 1)
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1"):
        PrefixIndex(0)


# --- policies -----------------------------------------------------------------------------------------------
def test_auto_is_cache_aware_above_one_replica_and_a_model_may_pin_its_own() -> None:
    r = router()
    assert (r.policy("m", 1), r.policy("m", 2), r.policy("pinned", 3)) == (
        "least_outstanding",
        "cache_aware",
        "round_robin",
    )
    assert router("least_outstanding").policy("m", 4) == "least_outstanding"


def test_round_robin_takes_turns_and_least_outstanding_takes_the_idlest() -> None:
    replicas = [FakeReplica("a", 2), FakeReplica("b", 0), FakeReplica("c", 1)]
    r = router()
    turns = [r.choose("round_robin", "m", replicas, None).replica.name for _ in range(4)]
    assert turns == ["a", "b", "c", "a"]
    decision = r.choose("least_outstanding", "m", replicas, None)
    assert (decision.replica.name, decision.reason, decision.predicted_cached_tokens) == ("b", "load", None)


def test_cache_aware_follows_the_prefix_and_predicts_the_cached_tokens() -> None:
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    r = router()
    turn1 = token_prefix("m", list(range(10)), 4)  # 2 full blocks
    first = r.choose("cache_aware", "m", replicas, turn1)
    assert (first.reason, first.predicted_cached_tokens, first.prefix_unit) == ("load", 0, "tokens")
    turn2 = token_prefix("m", [*range(10), 50, 51, 52, 53, 54, 55], 4)  # starts with turn 1's 8 hashed tokens
    for other in replicas:
        other.outstanding = 0
    second = r.choose("cache_aware", "m", replicas, turn2)
    assert (second.replica, second.reason, second.predicted_cached_tokens) == (
        first.replica,
        "prefix_match",
        8,
    )
    # a different prompt goes elsewhere when its first replica is busier
    first.replica.outstanding = 1
    other = r.choose("cache_aware", "m", replicas, token_prefix("m", [7] * 12, 4))
    assert other.replica is not first.replica and other.reason == "load"


def test_cache_aware_bounds_the_load_of_a_hot_prefix() -> None:
    """One prefix for every request, none finishing: a replica takes it only while in flight + 1 <=
    ceil(1.25 x (total + 1) / 4), so the first three go to idle replicas (ties in turn), then the prefix stays
    on the replicas that hold it, each within the bound; the fourth replica is not needed (4 <= ceil(1.25 x
    13 / 4) = 5). The factor alone (``load_slack`` 0)."""
    replicas = [FakeReplica(name) for name in "abcd"]
    r = router(load_slack=0)
    hot = token_prefix("m", list(range(64)), 4)
    picks = []
    for _ in range(12):
        total = sum(o.outstanding for o in replicas)
        decision = r.choose("cache_aware", "m", replicas, hot)
        decision.replica.outstanding += 1
        assert decision.replica.outstanding <= -(-5 * (total + 1) // 16)  # ceil(1.25 (total + 1) / 4)
        picks.append(decision.replica.name + ("*" if decision.reason == "prefix_match" else ""))
    assert picks == ["a", "c", "b", "a*", "b*", "c*", "c*", "a*", "b*", "b*", "a*", "c*"]
    assert [o.outstanding for o in replicas] == [4, 4, 4, 0]
    # 63 of 64 tokens are cacheable: 15 full blocks of 4 (the 16th holds the last prompt token)
    assert r.choose("cache_aware", "m", replicas, hot).predicted_cached_tokens == 60


def test_new_conversations_alternate_over_idle_replicas_whatever_comes_between() -> None:
    """Ties turn only when there is a tie: a new conversation (no prefix anywhere, both replicas idle) and
    then its next turn (its prefix on one replica: no tie) must not fall into step, which sent every new
    conversation to the same replica (break-it: 6 of 6)."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    r = router()
    firsts = []
    for n in range(6):
        first = token_prefix("m", [1000 * n + i for i in range(40)], 4)
        firsts.append(r.choose("cache_aware", "m", replicas, first).replica.name)
        follow = token_prefix("m", [1000 * n + i for i in range(48)], 4)
        assert r.choose("cache_aware", "m", replicas, follow).replica.name == firsts[-1]
    assert firsts == ["a", "b", "a", "b", "a", "b"]


@pytest.mark.parametrize(("slack", "stays_at"), [(2, [0, 1, 2]), (1, [0, 1]), (0, [0])])
def test_a_conversation_stays_on_its_replica_within_the_load_slack(slack: int, stays_at: list[int]) -> None:
    """Replica ``a`` holds a conversation's history, b-d are idle. With ``k`` requests in flight on ``a`` the
    factor's bound is ceil(1.25 x (k + 1) / 4) = 1 for k <= 2, so the factor alone sends the next turn away at
    k = 1; the slack keeps it on ``a`` while k <= slack (k + 1 <= 0 + slack + 1), and past it the turn goes to
    an idle replica, which holds none of it."""
    replicas = [FakeReplica(name) for name in "abcd"]
    r = router(load_slack=slack)
    history = token_prefix("m", list(range(40)), 4)
    assert r.choose("cache_aware", "m", replicas[:1], history).replica.name == "a"  # a holds the history
    next_turn = token_prefix("m", [*range(40), *range(100, 112)], 4)
    stayed = []
    for k in range(4):
        replicas[0].outstanding = k
        decision = r.choose("cache_aware", "m", replicas, next_turn)
        if decision.replica.name == "a":
            # the history's 10 blocks; from the second stay on, the turn's own 12 cacheable blocks (recorded
            # at a by the first)
            assert (decision.reason, decision.predicted_cached_tokens) == (
                "prefix_match",
                40 if k == 0 else 48,
            )
            stayed.append(k)
        else:
            assert (decision.reason, decision.predicted_cached_tokens) == ("load", 0)
            decision.replica.prefix_index = None  # forget the turn it took: a stays the only holder
    assert stayed == stays_at


@pytest.mark.parametrize("slack", [-1, 1.5, "2"])
def test_load_slack_must_be_a_whole_number_of_requests(slack: object) -> None:
    from kvscope.gateway.settings import load_settings

    with pytest.raises(ValueError, match="load_slack"):
        load_settings(
            None,
            {"upstreams": [{"url": "http://a:1"}], "routing": {"cache_aware": {"load_slack": slack}}},
            env={},
        )
    with pytest.raises(ValueError, match="load_slack"):
        CacheAwareConfig(load_slack=-1)
    settings = load_settings(
        None, {"upstreams": [{"url": "http://a:1"}], "routing": {"cache_aware": {"load_slack": 0}}}, env={}
    )
    assert settings.routing.cache_aware.load_slack == 0


def test_a_hot_prefix_stays_within_the_factor_or_the_slack() -> None:
    """The hot-prefix case with the default slack (2): every pick within max(ceil(1.25 (total + 1) / 4),
    least + 3); the slack lets the first replica take three at first (1 + 1 <= 0 + 3, 2 + 1 <= 0 + 3), so the
    fan-out starts later, and the replicas end even as with the factor alone."""
    replicas = [FakeReplica(name) for name in "abcd"]
    r = router()
    hot = token_prefix("m", list(range(64)), 4)
    picks = []
    for _ in range(12):
        total, least = sum(o.outstanding for o in replicas), min(o.outstanding for o in replicas)
        decision = r.choose("cache_aware", "m", replicas, hot)
        decision.replica.outstanding += 1
        assert decision.replica.outstanding <= max(-(-5 * (total + 1) // 16), least + 3)
        picks.append(decision.replica.name + ("*" if decision.reason == "prefix_match" else ""))
    assert picks[:3] == ["a", "a*", "a*"]
    assert sorted(o.outstanding for o in replicas) == [0, 4, 4, 4]


def test_a_retry_is_a_fallback_and_the_index_is_sized_from_the_card() -> None:
    replicas = [FakeReplica("a", block_size=8, capacity_tokens=64), FakeReplica("b")]
    r = router(capacity_tokens=40)
    assert r.block_size("m", replicas) == 8 and r.block_size("m", replicas[1:]) == 16
    prefix = token_prefix("m", list(range(40)), 8)
    decision = r.choose("cache_aware", "m", replicas, prefix, retry=True)
    assert decision.reason == "fallback"
    sizes = {rep.name: rep.prefix_index.capacity_blocks if rep.prefix_index else None for rep in replicas}
    assert sizes[decision.replica.name] == (8 if decision.replica.name == "a" else 5)  # 64/8, else 40/8
    with pytest.raises(ValueError, match="no candidate replica"):
        r.choose("cache_aware", "m", [], prefix)


def test_a_replica_with_another_block_size_is_credited_with_no_prefix() -> None:
    """Replicas of one model with different KV block sizes (a rolling restart that changed --block-size): the
    prompt is hashed in the first one's size (8); ``b`` (4) is never credited with it nor records it, so its
    prediction is 0, never more than its cache holds (break-it: predicted 112 where 96 were cached)."""
    a, b = FakeReplica("a", block_size=8), FakeReplica("b", block_size=4)
    r = router(load_slack=0)
    assert r.block_size("m", [a, b]) == 8
    prefix = token_prefix("m", list(range(40)), 8)
    b.outstanding = 1  # a is the least busy: it takes the prompt
    assert r.choose("cache_aware", "m", [a, b], prefix).replica is a
    # b is now the least busy, and a is within the bound (1 + 1 <= ceil(1.25 x 2 / 2))
    a.outstanding, b.outstanding = 1, 0
    decision = r.choose("cache_aware", "m", [a, b], prefix)
    assert (decision.replica, decision.reason, decision.predicted_cached_tokens) == (a, "prefix_match", 32)
    a.outstanding = 3  # over the bound ceil(1.25 x 4 / 2) = 3: b takes it, credited with nothing
    decision = r.choose("cache_aware", "m", [a, b], prefix)
    assert (decision.replica, decision.reason, decision.predicted_cached_tokens) == (b, "load", 0)
    assert b.prefix_index is None  # nothing recorded in a size b does not use
    decision = r.choose("cache_aware", "m", [b], prefix)
    assert (decision.reason, decision.predicted_cached_tokens) == ("load", 0)


def test_a_new_instance_id_on_a_healthy_replica_resets_its_index() -> None:
    """A restart between two health checks: never seen down, but its card names a new server instance."""
    import asyncio

    import httpx
    from prometheus_client import CollectorRegistry

    from kvscope.gateway.metrics import GatewayMetrics
    from kvscope.gateway.proxy.upstreams import UpstreamPool
    from kvscope.gateway.settings import UpstreamConfig

    instance = {"id": "one"}

    def answer(request: httpx.Request) -> httpx.Response:
        card = {"id": "m", "kvscope": {"block_size": 4, "num_gpu_blocks": 8, "instance_id": instance["id"]}}
        return httpx.Response(200, json={"data": [card]})

    pool = UpstreamPool(
        [UpstreamConfig(url="http://a:1")], [], RoutingConfig(), GatewayMetrics(CollectorRegistry())
    )
    replica = pool.replicas[0]

    async def probe() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await pool.check(replica, client)

    asyncio.run(probe())
    assert replica.kv_cache_capacity("m") == (4, 32)
    replica.prefix_index = PrefixIndex(8)
    asyncio.run(probe())  # same instance: kept
    assert replica.prefix_index is not None
    instance["id"] = "two"
    asyncio.run(probe())
    assert (replica.prefix_index, replica.instance_id) == (None, "two")


def test_one_huge_prompt_never_evicts_every_other_prefix() -> None:
    """A prompt's blocks take at most half a replica's index (here 8 blocks: 128 tokens of KV)."""
    replica = FakeReplica("a", block_size=16, capacity_tokens=128)
    r = router()
    small = token_prefix("m", list(range(40)), 16)  # 2 full blocks
    r.choose("cache_aware", "m", [replica], small)
    r.choose("cache_aware", "m", [replica], token_prefix("m", [7] * 1600, 16))  # 100 blocks
    assert replica.prefix_index is not None and len(replica.prefix_index) == 6  # 2 + the first 4 of 100
    again = r.choose("cache_aware", "m", [replica], small)
    assert (again.reason, again.predicted_cached_tokens) == ("prefix_match", 32)


@pytest.mark.parametrize(
    "routing",
    [
        {"cache_aware": {"load_factor": float("nan")}},
        {"cache_aware": {"load_factor": float("inf")}},
        {"health_interval_s": float("nan")},
        {"health_timeout_s": float("inf")},
    ],
)
def test_routing_numbers_must_be_finite(routing: dict) -> None:
    from kvscope.gateway.settings import load_settings

    with pytest.raises(ValueError, match="finite|load_factor"):
        load_settings(None, {"upstreams": [{"url": "http://a:1"}], "routing": routing}, env={})


def test_two_upstreams_may_not_share_a_name() -> None:
    from kvscope.gateway.settings import load_settings

    same = [{"url": "http://a:1", "name": "e"}, {"url": "http://b:1", "name": "e"}]
    with pytest.raises(ValueError, match="share the name e"):
        load_settings(None, {"upstreams": same}, env={})
    twice = [{"url": "http://a:1", "name": "e"}, {"url": "http://a:1/", "name": "e"}]  # one replica, merged
    assert len(load_settings(None, {"upstreams": twice}, env={}).upstreams) == 2
