"""The routing policies: which healthy replica serves a request.

- ``least_outstanding``: the fewest requests in flight from this gateway; ties round-robin.
- ``round_robin``: each replica in turn.
- ``cache_aware`` (the default whenever a model has more than one replica): the replica that most likely holds
  the longest prefix of the prompt in its KV cache (gateway/routing/prefix_index.py), among the replicas under
  a load bound; the fewest in flight when no replica holds any of it. The bound is bounded-load consistent
  hashing's (Mirrokni, Thorup, Zadimoghaddam, SODA 2018; HAProxy's ``hash-balance-factor``, Vimeo's and
  Google's balancers): a replica is eligible while ``in_flight + 1 <= ceil(c x (total_in_flight + 1) / n)``,
  ``c = routing.cache_aware.load_factor``, or while it has at most ``s = routing.cache_aware.load_slack``
  requests in flight more than the least busy candidate. Chosen over power-of-two-choices because it keeps a
  prefix on the replica that has it until that replica is really busier than the rest (two random choices
  would send a hot prefix's requests elsewhere half the time and lose the cache), and over SGLang's switch
  (once the load spread passes both an absolute and a relative threshold, every request goes to the least
  loaded worker, cache or not) because the bound is per replica: only a replica over it is passed over, and
  every other request keeps its prefix. With one prefix taking half the traffic no replica exceeds
  ``max(c x mean, least + s)`` in flight (+1). The slack is for small counts: the factor is made for many
  requests per replica, and at the handful a CPU replica holds it turns the replica holding a conversation
  away at one request above the mean (ceil(1.25 x 5 / 4) = 2), where the conversation's whole history is then
  computed again (measured: 10 of 96 later turns recomputed 600-840 tokens without the slack, 0-2 with it;
  docs/benchmarks.md "Cache-aware routing over 4 replicas"). The replica with the fewest in flight is always
  eligible, so a request is never refused for load.

A retry after a failed attempt (``exclude`` not empty) is a ``fallback``: the same choice among the replicas
not yet tried. Every cache_aware decision records the prompt's blocks at the chosen replica at once, so the
next request with that prefix follows it even before this one finishes: at most half the replica's index,
so that one huge prompt cannot evict every other prefix (admission leaves prompts longer than the context
unhashed: they are refused, never cached).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from kvscope.gateway.context import RoutingRecord
from kvscope.gateway.routing.prefix import PromptPrefix
from kvscope.gateway.routing.prefix_index import PrefixIndex
from kvscope.gateway.settings import CacheAwareConfig, ModelConfig, RoutingConfig, RoutingPolicy

Policy = Literal["cache_aware", "least_outstanding", "round_robin"]
Reason = Literal["prefix_match", "load", "round_robin", "fallback"]
"""Why the replica was chosen: it holds a prefix of the prompt (``prefix_match``), it had the fewest requests
in flight or none held the prefix within the load bound (``load``), its turn (``round_robin``), or the
request's earlier attempt failed (``fallback``)."""


class RoutedReplica(Protocol):
    """What the router reads and keeps on a replica (gateway/proxy/upstreams.py Replica)."""

    outstanding: int
    prefix_index: PrefixIndex | None

    @property
    def label(self) -> str:
        """The replica's name in metrics and the request log."""
        ...

    def kv_cache_capacity(self, model: str) -> tuple[int | None, int | None]:
        """(tokens per KV block, KV capacity in tokens) as the replica reports them for ``model``; None
        where it does not."""
        ...


ReplicaT = TypeVar("ReplicaT", bound=RoutedReplica)


@dataclass(frozen=True, slots=True)
class RouteDecision(Generic[ReplicaT]):
    """A routing decision, logged with the request (``kvscope.routing``) and counted in metrics."""

    replica: ReplicaT
    policy: Policy
    reason: Reason
    predicted_cached_tokens: int | None = None
    """cache_aware: prompt tokens the chosen replica most likely serves from its prefix cache (full blocks,
    never the last prompt token); None under the other policies."""
    prefix_unit: Literal["tokens", "text"] | None = None
    """What the prediction hashed: the prompt's token ids, or its text (no tokenizer configured)."""

    def record(self) -> RoutingRecord:
        """The decision as the request context keeps it for the log line and metrics."""
        return RoutingRecord(
            self.policy, self.reason, self.replica.label, self.predicted_cached_tokens, self.prefix_unit
        )


class Router:
    """Chooses among candidate replicas by each model's policy; keeps the round-robin turn."""

    def __init__(self, routing: RoutingConfig, models: Mapping[str, ModelConfig]) -> None:
        self._routing = routing
        self._policies: dict[str, RoutingPolicy] = {
            name: m.routing for name, m in models.items() if m.routing is not None
        }
        self._turn = itertools.count()
        self._tie = itertools.count()
        """Turns among equally loaded replicas: advanced only by a decision that has a tie to break, so that
        decisions without one (a prefix on one replica) cannot fall into step with a request pattern (a new
        conversation then its next turn) and send every new conversation to the same replica."""

    @property
    def cache_aware_config(self) -> CacheAwareConfig:
        return self._routing.cache_aware

    def policy(self, model: str | None, replicas: int) -> Policy:
        """The policy for ``model`` served by ``replicas`` replicas (healthy or not): the model's own, else
        ``routing.policy``; ``auto`` is cache_aware above one replica, else least_outstanding."""
        chosen = self._policies.get(model or "", self._routing.policy)
        if chosen == "auto":
            return "cache_aware" if replicas > 1 else "least_outstanding"
        return chosen

    def block_size(self, model: str, replicas: Sequence[RoutedReplica]) -> int:
        """Tokens per hashed block for ``model``: the first replica's own KV block size that reports one,
        else ``routing.cache_aware.block_size``."""
        for replica in replicas:
            size, _ = replica.kv_cache_capacity(model)
            if size:
                return size
        return self._routing.cache_aware.block_size

    def choose(
        self,
        policy: Policy,
        model: str | None,
        candidates: Sequence[ReplicaT],
        prefix: PromptPrefix | None,
        retry: bool = False,
    ) -> RouteDecision[ReplicaT]:
        """The replica for one attempt among ``candidates`` (healthy, serving the model, not yet tried; at
        least one) under ``policy``. ``prefix``: the prompt's blocks (cache_aware without one routes by
        load). Raises ValueError for no candidates."""
        if not candidates:
            raise ValueError("no candidate replica")
        if policy == "round_robin":
            replica = candidates[next(self._turn) % len(candidates)]
            return RouteDecision(replica, policy, "fallback" if retry else "round_robin")
        if policy == "least_outstanding" or prefix is None or model is None:
            return RouteDecision(self._least_loaded(candidates), policy, "fallback" if retry else "load")
        return self._cache_aware(model, candidates, prefix, retry)

    def _cache_aware(
        self, model: str, candidates: Sequence[ReplicaT], prefix: PromptPrefix, retry: bool
    ) -> RouteDecision[ReplicaT]:
        knobs = self._routing.cache_aware
        bound = math.ceil(knobs.load_factor * (sum(r.outstanding for r in candidates) + 1) / len(candidates))
        bound = max(bound, min(r.outstanding for r in candidates) + knobs.load_slack + 1)
        eligible = [r for r in candidates if r.outstanding + 1 <= bound]
        indexes = [self._index(r, model, prefix) for r in eligible]
        matches = [index.match(prefix.hashes) if index is not None else 0 for index in indexes]
        best = max(matches)
        if best == 0:
            replica, matched = self._least_loaded(eligible), 0
        else:
            replica = self._least_loaded([r for r, m in zip(eligible, matches, strict=True) if m == best])
            matched = best
        index = self._index(replica, model, prefix)
        if index is not None:
            index.insert(
                prefix.hashes[: max(1, index.capacity_blocks // 2)]
            )  # one prompt never evicts it all
        reason: Reason = "fallback" if retry else ("prefix_match" if matched else "load")
        predicted = prefix.cacheable_blocks(matched) * prefix.block_size
        return RouteDecision(replica, "cache_aware", reason, predicted, prefix.unit)

    def _least_loaded(self, replicas: Sequence[ReplicaT]) -> ReplicaT:
        fewest = min(r.outstanding for r in replicas)
        tied = [r for r in replicas if r.outstanding == fewest]
        return tied[0] if len(tied) == 1 else tied[next(self._tie) % len(tied)]

    def _index(self, replica: RoutedReplica, model: str, prefix: PromptPrefix) -> PrefixIndex | None:
        """The replica's prefix index, made on first use with its capacity in ``prefix``'s blocks; None where
        the replica reports a KV block size other than the one ``prefix`` was hashed in (a rolling restart
        that changed ``--block-size``: the prompt is hashed in the first reporting replica's size,
        :meth:`block_size`): such a replica is credited with no prefix and records none, so that no
        prediction exceeds what its cache can serve."""
        size, capacity = replica.kv_cache_capacity(model)
        if size and size != prefix.block_size:
            return None
        if replica.prefix_index is None:
            tokens = capacity or self._routing.cache_aware.capacity_tokens
            replica.prefix_index = PrefixIndex(max(1, tokens // prefix.block_size))
        return replica.prefix_index
