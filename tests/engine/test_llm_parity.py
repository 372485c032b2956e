"""Greedy generation is token-identical to transformers generate(do_sample=False) on the same SmolLM2 weights,
one request at a time and all prompts batched together (continuous batching must not change a single token).

The batched tests run on cold engines of their own (prefix caching off, so every prompt token is computed in
the batch), once with the default step budget and once with ``max_num_batched_tokens=64`` so the long prompt
is prefilled in chunks beside the other requests' decodes."""

from __future__ import annotations

import gc

import pytest
import torch

from kvscope.engine.llm import LLM, merge_output
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(
    f"Paragraph {i}: The history of computing spans mechanical calculators, vacuum tubes, transistors and "
    f"integrated circuits, each step making machines smaller, faster and cheaper than the one before."
    for i in range(14)
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "请用一句话介绍一下长城。"}],
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three fruits."},
    ],
    [{"role": "user", "content": "Translate to German: The weather is nice today."}],
    [{"role": "user", "content": f"Summarize in one sentence: {LONG_TEXT}"}],
]
RAW_PROMPTS = ["def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    chat = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in CONVERSATIONS]
    return chat + [llm.tokenizer.encode(p) for p in RAW_PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model, prompts, llm) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone (stops at EOS like the engine)."""
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                repetition_penalty=1.0,
                eos_token_id=llm.tokenizer.eos_token_id,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def test_prompt_set_is_varied(prompts):
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) > 400  # the long one


def test_greedy_one_at_a_time_matches_transformers(llm, prompts, reference):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    for ids, expected in zip(prompts, reference, strict=True):
        [out] = llm.generate([ids], params)
        assert out.outputs[0].token_ids == expected


def run_batch(engine: LLM, prompts: list[list[int]]) -> tuple[list[RequestOutput], list]:
    """All prompts added at once, then stepped to the end: (outputs in prompt order, every StepResult)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ids = [f"cold-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.engine.add_request(request_id, prompt, params)
    merged: dict[str, RequestOutput] = {}
    steps = []
    while engine.engine.has_unfinished_requests():
        steps.append(engine.engine.step())
        for output in steps[-1].outputs:
            merge_output(merged, output)
    return [merged[r] for r in ids], steps


@pytest.fixture(scope="module", params=[2048, 64], ids=["one-step-prefill", "chunked-64"])
def cold_batch(request, prompts) -> tuple[int, list[RequestOutput], list]:
    """A fresh engine, prefix caching off, step budget ``request.param`` tokens; the batch run on it."""
    engine = LLM(
        "smollm2-135m",
        kv_cache_memory=256 << 20,
        enable_prefix_caching=False,
        max_num_batched_tokens=request.param,
    )
    outputs, steps = run_batch(engine, prompts)
    del engine
    gc.collect()
    return request.param, outputs, steps


def test_greedy_batched_on_a_cold_engine_matches_transformers(cold_batch, prompts, reference):
    budget, outputs, steps = cold_batch
    assert [o.num_cached_tokens for o in outputs] == [0] * len(prompts)  # every prompt token computed here
    assert [o.outputs[0].token_ids for o in outputs] == reference
    for out, expected in zip(outputs, reference, strict=True):
        assert out.outputs[0].finish_reason == ("stop" if len(expected) < NEW_TOKENS else "length")
    assert sum(s.num_prefill_tokens for s in steps) == sum(len(p) for p in prompts)
    assert max(s.num_scheduled_tokens for s in steps) <= budget
    if budget == 64:  # the long prompt was chunked, and its chunks shared steps with running decodes
        assert max(len(p) for p in prompts) > 4 * budget
        mixed = [s for s in steps if s.num_prefill_tokens > 0 and s.num_decode_tokens > 0]
        assert len(mixed) >= max(len(p) for p in prompts) // budget - 1
