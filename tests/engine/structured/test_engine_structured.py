"""Structured output through the engine: matchers survive preemption by recompute (outputs equal the solo
ones and match the grammar), n > 1 children and stop strings keep their constraint, a matcher error fails its
request (never a ``stop``), and no engine step compiles a grammar (serving case N2)."""

from __future__ import annotations

import re

import pytest

import kvscope.engine.structured.backend as backend
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.params import StructuredOutputsParams
from tests.engine.structured.llguidance_spy import LLGuidanceSpy

pytestmark = pytest.mark.slow
DIGITS = 40
BLOCK_SIZE = 16


@pytest.mark.timeout(600)
def test_constrained_requests_survive_preemption(llm):
    regex = StructuredOutputsParams("regex", f"[0-9]{{{DIGITS}}}")
    prompts = [llm.tokenizer.encode(f"Request {i}: a long number:") for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=DIGITS + 8, structured_outputs=regex)
    solo = [llm.generate([p], params)[0].outputs[0] for p in prompts]

    blocks_per_request = -(-(max(len(p) for p in prompts) + DIGITS + 1) // BLOCK_SIZE)  # digits + EOS
    small = LLM("smollm2-135m", num_blocks=2 * blocks_per_request, block_size=BLOCK_SIZE)  # room for two
    outputs = [o.outputs[0] for o in small.generate(prompts, params)]

    assert [o.token_ids for o in outputs] == [o.token_ids for o in solo]
    assert all(re.fullmatch(f"[0-9]{{{DIGITS}}}", o.text) and o.finish_reason == "stop" for o in outputs)
    assert sum(o.stats["num_preemptions"] for o in outputs) > 0
    assert all(rid not in small.engine.runner.matchers for rid in ("offline-0", "offline-1"))


def test_n_children_and_stop_strings_keep_the_constraint(llm):
    params = SamplingParams(
        n=6,
        temperature=1.0,
        seed=4,
        max_tokens=20,
        stop=["7"],
        structured_outputs=StructuredOutputsParams("regex", "[1-9]{2}-[a-c]{3}"),
    )
    choices = llm.generate("Code:", params)[0].outputs
    assert len(choices) == 6
    for choice in choices:
        if choice.finish_reason == "stop" and choice.stop_reason == "7":
            assert re.fullmatch("[1-9]{0,2}(-[a-c]{0,3})?", choice.text) and "7" not in choice.text
        else:
            assert re.fullmatch("[1-9]{2}-[a-c]{3}", choice.text) and choice.finish_reason == "stop"


def test_constrained_requests_carry_their_grammar_mask_seconds(llm):
    """Latency attribution (issue 18) for structured output: the mask seconds a constrained request is
    charged are the per-request shares of the step totals the mask histogram observed; unconstrained ones
    carry None."""
    steps: list[float] = []
    manager = llm.engine.runner.matchers.manager
    previous, manager.mask_observer = manager.mask_observer, steps.append
    try:
        constrained = SamplingParams(
            temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams("regex", "[0-9]{6}")
        )
        free = SamplingParams(temperature=0.0, max_tokens=8)
        prompt = llm.tokenizer.encode("A number:")
        with_grammar, without = (r.outputs[0] for r in llm.generate([prompt, prompt], [constrained, free]))
    finally:
        manager.mask_observer = previous
    assert re.fullmatch("[0-9]{6}", with_grammar.text)
    assert len(steps) == len(with_grammar.token_ids)  # one mask per sampled token, the EOS included
    assert 0 < with_grammar.stats["structured_mask_s"] <= sum(steps)
    assert 0 <= with_grammar.stats["structured_wait_s"]
    assert (without.stats["structured_mask_s"], without.stats["structured_wait_s"]) == (None, None)


def test_constrained_requests_carry_the_wait_for_their_grammar(llm):
    """``structured_compile_s`` is the wait for the compiled grammar before the request reached the engine
    (the ``grammar compile`` cause of ``kvscope logs why``): at least the compile itself for a new grammar,
    0.0 for a grammar found cached or already pinned (the same SamplingParams used again: break-it found the
    first call's wait reported again), None without a constraint; it is not part of ``queue_s``."""
    fresh = StructuredOutputsParams("regex", "[a-f]{5}-compile-wait")
    first = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=fresh)
    again = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams("regex", fresh.spec)
    )
    prompt = llm.tokenizer.encode("Letters:")
    (new,) = (r.outputs[0] for r in llm.generate([prompt], [first]))
    cached, reused, free = (
        r.outputs[0]
        for r in llm.generate([prompt, prompt, prompt], [again, first, SamplingParams(max_tokens=2)])
    )
    assert new.stats["structured_compile_s"] >= fresh.pin.grammar.seconds > 0  # type: ignore[union-attr]
    assert [o.stats["structured_compile_s"] for o in (cached, reused, free)] == [0.0, 0.0, None]


def test_a_matcher_error_mid_answer_fails_the_request_instead_of_stopping(llm):
    """An integer or an object whose required ``a`` is the same object again: admission passes (the first
    token is a choice), the answer ``{"`` (forced by logit_bias) breaks llguidance's item limit at the next
    token. Before, the error state's EOS-only mask ended the answer ``{"`` with finish_reason ``stop``."""
    schema = {
        "anyOf": [
            {"type": "integer"},
            {"type": "object", "properties": {"a": {"$ref": "#/anyOf/1"}}, "required": ["a"]},
        ]
    }
    brace = llm.tokenizer.encode('{"', add_special_tokens=False)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        logit_bias={brace[0]: 100.0},
        structured_outputs=StructuredOutputsParams.json_schema(schema, "response_format"),
    )
    free_blocks = llm.engine.kv_cache_manager.num_free_blocks
    choice = llm.generate(["A JSON value:"], params)[0].outputs[0]
    assert (choice.text, choice.token_ids) == ('{"', brace)  # the token the matcher failed on is dropped
    assert choice.finish_reason == (
        "structured output failed: parser error: Too many items (limit 50000; "
        "ff_tokens); try avoiding single-byte/short lexemes"
    )
    assert llm.engine.kv_cache_manager.num_free_blocks == free_blocks
    assert not llm.engine.has_unfinished_requests()


def test_no_engine_step_compiles_a_grammar(llm, monkeypatch):
    """The grammar is pinned to its request at admission: evicted from the cache while the request queued, it
    is not compiled again inside a step (before: on the mask thread, the whole batch waiting for it)."""
    spy = LLGuidanceSpy()
    monkeypatch.setattr(backend, "llguidance", spy)
    constraint = StructuredOutputsParams("regex", "[0-9]{3}-evicted")
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=constraint)
    request = llm.engine.input_processor.process(llm.tokenizer.encode("Code:"), params)
    admitted = list(spy.compile_threads)
    assert len(admitted) == 1  # compiled once, at admission
    llm.engine.structured._cache.clear()  # evicted from the LRU while the request waited
    llm.engine.add_engine_request("evicted", request)
    text = ""
    while llm.engine.has_unfinished_requests():
        text += "".join(c.text for output in llm.engine.step().outputs for c in output.outputs)
    assert re.fullmatch("[0-9]{3}-evicted", text)
    assert spy.compile_threads == admitted  # no compile since admission (before: one on grammar-mask_0)
