"""Speculative decoding on the real SmolLM2 (fp32): greedy output is token-identical to speculation off
(repetitive and not, one at a time and batched, preemption, stop string / stop token inside an accepted
run, max_tokens, n = 2, logprobs, json_schema), with fewer forward steps on the repetitive prompts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.slow

CODE = (
    "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n"
    "    return 2 * (width + height)\n"
)
REPETITIVE = [
    f"Copy the code exactly.\n{CODE}\nCopy:\n",
    "Repeat the list: apples, pears, plums, figs, dates, limes.\nRepeated: apples, pears,",
    "Text: the quick brown fox jumps over the lazy dog. Again: the quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4,",
    f"Rename height to h in:\n{CODE}\nRenamed:\ndef area(width, h):\n",
    "<li>red</li><li>green</li><li>blue</li>\nSame list:\n<li>red</li>",
    "SELECT id, name FROM users WHERE id = 1;\nSELECT id, name FROM users WHERE id = 2;\nSELECT",
    "Monday, Tuesday, Wednesday, Thursday. Monday, Tuesday,",
]
OTHER = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "Photosynthesis is the process by which",
    "My favourite recipe for soup:",
    "The three laws of motion are",
    "Dear hiring manager,",
    "A haiku about winter:",
    "In 1969, astronauts",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
SHORT = SamplingParams(temperature=0.0, max_tokens=14)
SPEC = {"speculative": "ngram", "num_speculative_tokens": 4}


def make_llm(spec: bool, **kwargs) -> LLM:
    if "num_blocks" not in kwargs:
        kwargs["kv_cache_memory"] = 96 << 20
    llm = LLM("smollm2-135m", **(SPEC if spec else {}), **kwargs)
    if spec:  # count steps exactly: no measured on/off decisions
        llm.engine.drafter.config = replace(llm.engine.drafter.config, measure_batch_cost=False)
    return llm


class StepCounter:
    """Counts engine steps that ran the model and collects their SpecDecodingStats."""

    def __init__(self, llm: LLM) -> None:
        self.steps = 0
        self.spec = []
        step = llm.engine.step

        def counted(*args, **kwargs):
            result = step(*args, **kwargs)
            self.steps += result.batch_size > 0
            if result.spec_decoding is not None:
                self.spec.append(result.spec_decoding)
            return result

        llm.engine.step = counted


@pytest.fixture(scope="module")
def pair():
    off, on = make_llm(False), make_llm(True)
    return off, on, StepCounter(off), StepCounter(on)


def _tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_one_at_a_time_is_identical_with_fewer_steps_on_repetitive_prompts(pair):
    off, on, off_steps, on_steps = pair
    counts = {}
    for name, prompts in (("repetitive", REPETITIVE[:5]), ("other", OTHER[:3])):
        off_steps.steps = on_steps.steps = 0
        ref = [off.generate(p, SHORT)[0] for p in prompts]
        got = [on.generate(p, SHORT)[0] for p in prompts]
        assert _tokens(got) == _tokens(ref)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in ref]
        counts[name] = (off_steps.steps, on_steps.steps)
    off_n, on_n = counts["repetitive"]
    assert on_n < 0.75 * off_n, counts  # several tokens per forward pass when the output copies the prompt
    assert counts["other"][1] <= counts["other"][0]
    assert sum(s.num_accepted_tokens for s in on_steps.spec) > 0


def test_greedy_batched_is_identical(pair):
    off, on, _, on_steps = pair
    prompts = REPETITIVE + OTHER
    on_steps.spec.clear()
    assert _tokens(on.generate(prompts, GREEDY)) == _tokens(off.generate(prompts, GREEDY))
    assert max(s.num_drafts for s in on_steps.spec) >= 4  # several drafts verified in one forward pass


def test_preemption_by_a_small_kv_budget_keeps_greedy_identical(pair):
    off = pair[0]
    prompts = REPETITIVE[1:7]  # 18-53 prompt tokens + 20: 22 blocks of 16 for all, 8 in the cache
    small = make_llm(True, num_blocks=8, block_size=16, max_model_len=128)
    outputs = small.generate(prompts, GREEDY)
    assert _tokens(outputs) == _tokens(off.generate(prompts, GREEDY))
    assert small.engine.scheduler.get_stats().num_preemptions_total > 0
    assert small.engine.kv_cache_manager.num_free_blocks == 8


def _groups(llm: LLM, prompt: str, params: SamplingParams) -> list[list[int]]:
    """The token groups emitted per step for one request (speculation on)."""
    rid = llm.engine.add_request("probe", llm.tokenizer.encode(prompt), params)[0].request_id
    groups = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step().outputs:
            assert out.request_id == rid
            groups.append(out.outputs[0].token_ids)
    return groups


def test_stop_string_and_stop_token_inside_an_accepted_run(pair):
    off, on, _, _ = pair
    prompt = REPETITIVE[1]  # the model copies the list: runs of 5 accepted tokens
    params = SamplingParams(temperature=0.0, max_tokens=30)
    groups = _groups(on, prompt, params)
    tokens = [t for g in groups for t in g]
    # a token inside a run of >= 3 (not its last) whose text and id first appear there
    offset, found = 0, None
    for group in groups:
        for j in range(1, len(group) - 1):
            pos = offset + j
            before = on.tokenizer.decode(tokens[:pos])
            piece = on.tokenizer.decode(tokens[: pos + 1])[len(before) :].strip()
            if found is None and len(piece) >= 2 and piece not in before and tokens[pos] not in tokens[:pos]:
                found = (pos, piece, tokens[pos])
        offset += len(group)
    assert found is not None, groups
    pos, piece, token = found
    for stop in (
        SamplingParams(temperature=0.0, max_tokens=30, stop=[piece]),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[token]),
    ):
        ref = off.generate(prompt, stop)[0].outputs[0]
        got = on.generate(prompt, stop)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, "stop")
        assert len(got.token_ids) == pos + 1  # ended at that token of the run; the rest dropped
        assert got.num_output_tokens == pos + 1
    # max_tokens inside that run: drafts are cut so the step ends exactly at max_tokens
    capped = SamplingParams(temperature=0.0, max_tokens=pos + 1)
    got = on.generate(prompt, capped)[0].outputs[0]
    assert got.token_ids == tokens[: pos + 1] and got.finish_reason == "length"


def test_n2_logprobs_and_json_schema_are_identical(pair):
    off, on, _, on_steps = pair
    n2 = SamplingParams(temperature=0.0, max_tokens=16, n=2)
    assert _tokens(on.generate(REPETITIVE[1], n2)) == _tokens(off.generate(REPETITIVE[1], n2))

    lp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    ref, got = off.generate(REPETITIVE[2], lp)[0].outputs[0], on.generate(REPETITIVE[2], lp)[0].outputs[0]
    assert got.token_ids == ref.token_ids and len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert abs(a.logprob - b.logprob) < 1e-3

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "colors": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "colors"],
    }
    example = '{"name": "flag", "colors": ["red", "green", "red", "green", "red", "green"]}'
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams("json", json.dumps(schema))
    )
    prompt = f"Copy this JSON exactly: {example}\nCopy: "
    on_steps.spec.clear()
    ref, got = off.generate(prompt, params)[0].outputs[0], on.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert sum(s.num_accepted_tokens for s in on_steps.spec) > 0


def test_seeded_sampling_with_speculation_gives_the_same_text_twice(pair):
    on = pair[1]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24)
    first = on.generate(REPETITIVE[0], params)[0].outputs[0]
    assert on.generate(REPETITIVE[0], params)[0].outputs[0].token_ids == first.token_ids
    other = on.generate(REPETITIVE[0], SamplingParams(temperature=0.8, top_p=0.95, seed=12, max_tokens=24))
    assert other[0].outputs[0].token_ids != first.token_ids
