"""Builders shared by the kvscope.engine.core tests: fake requests, a small scheduler, one engine step."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.config import CacheConfig, SchedulerConfig
from kvscope.engine.core.block_pool import BlockPool
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.scheduler_output import SchedulerOutput
from kvscope.engine.sampling_params import SamplingParams


@dataclass
class FakeClock:
    """A clock the test sets by hand (seconds)."""

    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 16,
    eos_token_id: int | None = 2,
    arrival_time: float = 0.0,
    parent_id: str | None = None,
    **params: object,
) -> Request:
    """A Request with SamplingParams(**params); ``max_tokens`` is the resolved budget; ``parent_id`` makes it
    a choice of an n > 1 request."""
    return Request(
        request_id,
        list(prompt_token_ids),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        max_tokens=max_tokens,
        parent_id=parent_id,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    long_prefill_token_threshold: int = 0,
    max_model_len: int = 256,
    enable_caching: bool = True,
    clock: FakeClock | None = None,
) -> Scheduler:
    pool = BlockPool(num_blocks, enable_caching=enable_caching)
    kv = KVCacheManager(pool, block_size, enable_caching=enable_caching)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_caching),
        kv,
        max_model_len,
        clock=clock or FakeClock(),
    )


def step(
    scheduler: Scheduler, tokens: dict[str, int] | None = None, default_token: int = 5
) -> tuple[SchedulerOutput, list[Request]]:
    """schedule() then update_from_output(), sampling ``tokens[id]`` (else ``default_token``) for every
    request whose chunk asks for a sample."""
    out = scheduler.schedule()
    tokens = tokens or {}
    sampled = {s.request_id: [tokens.get(s.request_id, default_token)] for s in out.scheduled if s.sample}
    return out, scheduler.update_from_output(out, sampled)


def prompt(start: int, length: int) -> list[int]:
    """Token ids start, start+1, … (length of them)."""
    return list(range(start, start + length))
