"""Preemption by recompute is invisible: with KV room for about two requests, eight concurrent greedy
requests produce exactly the outputs they have when all eight run together without preemption (float32
greedy text does not depend on the batch: tests/engine/test_llm_parity.py holds it to transformers alone
and batched), the engine preempts, and every block is free afterwards (case K2 at the engine level)."""

from __future__ import annotations

import pytest

from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 64  # as tests/e2e/test_engine_preemption.py
BLOCK_SIZE = 16


@pytest.mark.timeout(600)  # ~40 s on a slow 2-vCPU host: above the 300 s default's margin
def test_preemption_is_invisible(llm):
    prompts = [llm.tokenizer.encode(f"Request {i}: list the numbers from 1 upward:") for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    unpreempted = llm.generate(prompts, params)  # 256 MiB of KV: all eight fit at once
    assert [o.outputs[0].stats["num_preemptions"] for o in unpreempted] == [0] * 8
    reference = [o.outputs[0].token_ids for o in unpreempted]

    blocks_per_request = -(-(max(len(p) for p in prompts) + NEW_TOKENS) // BLOCK_SIZE)
    small = LLM("smollm2-135m", num_blocks=2 * blocks_per_request + 2, block_size=BLOCK_SIZE)
    outputs = small.generate(prompts, params)

    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    preemptions = [o.outputs[0].stats["num_preemptions"] for o in outputs]
    assert sum(preemptions) > 0
    stats = small.engine.scheduler.get_stats()
    assert stats.num_preemptions_total == sum(preemptions)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
    assert small.engine.kv_cache_manager.block_pool.get_num_free_blocks() == 2 * blocks_per_request + 2
