"""Point-in-time scheduler and KV cache statistics (the source of the ``kvscope_engine_*`` gauges)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Snapshot taken by :meth:`engine.core.scheduler.Scheduler.get_stats`.

    The three block counts partition the pool: ``num_used_blocks + num_cached_blocks + num_free_blocks``
    equals the number of blocks (``kvscope_engine_kv_cache_blocks{state=used|cached|free}``).
    """

    num_running: int
    """Requests in the running list."""
    num_waiting: int
    """Requests waiting for admission (new or preempted)."""
    kv_cache_usage: float
    """Blocks in use / total blocks, in [0, 1] (vLLM ``kv_cache_usage``)."""
    num_used_blocks: int
    """Blocks held by at least one request."""
    num_cached_blocks: int
    """Free blocks that still hold a cached prefix (evictable, reusable on a hit)."""
    num_free_blocks: int
    """Free blocks holding nothing."""
    num_preemptions_total: int
    """Preemptions since start (counter)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache, counted once per request at first scheduling (counter)."""
    prefix_cache_hits: int
    """Of those, tokens served from the prefix cache (counter)."""
