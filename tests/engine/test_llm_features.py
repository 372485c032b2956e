"""Engine-level behaviour on the real SmolLM2: prefix caching, chunked prefill, seeds, n > 1, stats,
and serving cases T1/T2 (shared/cases/serving-cases.md) without the HTTP layer."""

from __future__ import annotations

import pytest

from kvscope.engine.llm import LLM
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams

ATTRIBUTION_KEYS = (
    "prompt_tokens",
    "cached_tokens",
    "queue_ahead",
    "running_on_arrival",
    "queue_limit",
    "queue_blocked_steps",
    "attributed_queue_s",
    "recomputed_tokens",
    "structured_mask_s",
    "structured_wait_s",
    "structured_compile_s",
    *(
        f"{phase}_{name}"
        for phase in ("prefill", "decode")
        for name in (
            "steps",
            "tokens",
            "other_prefill_tokens",
            "other_decode_tokens",
            "other_requests_max",
            "step_s_mean",
            "step_s_max",
            "own_s",
            "interference_s",
            "interference_prefill_s",
            "preempted_s",
            "other_s",
        )
    ),
)
"""The latency-attribution keys of the kvscope object (issue 18; docs/logs.md)."""
SPEC_KEYS = ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_mean_accepted_length")
"""The speculative-decoding keys (issue 16; null without speculation)."""

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def stream(llm: LLM, request_id: str, prompt_ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Run one request through EngineCore.step() and return its delta outputs in order."""
    llm.engine.add_request(request_id, prompt_ids, params)
    deltas = []
    while llm.engine.has_unfinished_requests():
        deltas.extend(o for o in llm.engine.step().outputs if o.request_id == request_id)
    return deltas


def test_prefix_cache_hit_reports_cached_tokens_and_same_output(llm):
    prompt = llm.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Explain what a KV cache is in two sentences, please, for a new engineer.",
            }
        ]
    )
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    expected_cached = (len(prompt) - 1) // 16 * 16
    assert second.num_cached_tokens == expected_cached > 0
    assert second.outputs[0].stats["kv_blocks"] == -(-(len(prompt) + 23) // 16)


def test_prompt_logprobs_are_computed_past_the_prefix_cache(llm):
    """A request asking for prompt logprobs reads no cached prefix (vLLM v1's rule): every prompt position
    but the first is scored, the same values as the first time, while a request without them still hits the
    cache."""
    prompt = llm.tokenizer.encode(
        "A paged KV cache stores keys and values in fixed-size blocks of tokens, " * 3
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    before = llm.engine.scheduler.get_stats()
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    after = llm.engine.scheduler.get_stats()
    assert second.num_cached_tokens == 0
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (
        before.prefix_cache_queries,
        before.prefix_cache_hits,
    )  # no lookup made
    assert first.prompt_logprobs[0] is None and second.prompt_logprobs[0] is None
    assert all(entry is not None for entry in second.prompt_logprobs[1:])
    assert len(second.prompt_logprobs) == len(prompt)
    assert [e.logprob for e in second.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in first.prompt_logprobs[1:]], abs=1e-4
    )
    plain = llm.generate([prompt], GREEDY)[0]
    assert plain.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0


def test_prefix_caching_off_gives_identical_outputs(llm):
    no_cache = LLM("smollm2-135m", kv_cache_memory=64 << 20, enable_prefix_caching=False)
    prompts = [
        llm.tokenizer.encode("The three primary colors are"),
        llm.tokenizer.encode("The three primary colors"),
    ]
    on = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts, GREEDY)]
    off_outputs = no_cache.generate(prompts + prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in off_outputs] == on
    assert all(o.num_cached_tokens == 0 for o in off_outputs)


def test_chunked_prefill_equals_unchunked(llm):
    words = " ".join(f"item{i}" for i in range(700))
    prompt = llm.tokenizer.encode(f"Here is a list: {words}. The last item was")[:1500]
    assert len(prompt) == 1500
    chunked = LLM(
        "smollm2-135m", kv_cache_memory=128 << 20, max_num_batched_tokens=256, enable_prefix_caching=False
    )
    unchunked = LLM(
        "smollm2-135m", kv_cache_memory=128 << 20, max_num_batched_tokens=2048, enable_prefix_caching=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3)
    a = chunked.generate([prompt], params)[0].outputs[0]
    b = unchunked.generate([prompt], params)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-3)


def test_same_seed_same_text_alone_and_batched(llm):
    prompt = llm.tokenizer.encode("Write a short poem about the sea:")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=32)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=40),
        SamplingParams(temperature=0.7, seed=7, max_tokens=8),
    ]
    batch = llm.generate([prompt, prompt, llm.tokenizer.encode("Hello")], [others[0], seeded, others[1]])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=32))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_greater_than_one_returns_indexed_choices(llm):
    prompt = llm.tokenizer.encode("My favourite animal is")
    out = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    again = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_finished_request_carries_stats(llm):
    out = llm.generate(
        [llm.tokenizer.encode("One two three")],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )[0].outputs[0]
    stats = out.stats
    assert set(stats) == {
        "queue_s",
        "ttft_s",
        "prefill_s",
        "decode_s",
        "tpot_s",
        "batch_size_mean",
        "batch_size_max",
        "kv_blocks",
        "kv_cache_usage",
        "num_preemptions",
        "predicted_ttft_s",
        "service_tier",
        *ATTRIBUTION_KEYS,
        *SPEC_KEYS,
    }
    assert stats["service_tier"] == "default"
    assert stats["ttft_s"] == pytest.approx(stats["queue_s"] + stats["prefill_s"], abs=1e-9)
    assert stats["tpot_s"] == pytest.approx(stats["decode_s"] / 7)
    assert stats["batch_size_max"] == 1 and stats["batch_size_mean"] == 1.0
    assert stats["num_preemptions"] == 0 and stats["kv_blocks"] == 1


# --- case T1: no broken characters -------------------------------------------------------------------------

T1_PROMPT = "Repeat exactly: 你好，世界！🌶️🎉 ďábelské"


def test_t1_no_replacement_characters_and_deltas_match(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": T1_PROMPT}])
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)
    deltas = stream(llm, "t1", prompt, params)
    texts = [c.text for d in deltas for c in d.outputs]
    assert all("\ufffd" not in t for t in texts)
    full = llm.generate([prompt], params)[0].outputs[0]
    assert "".join(texts) == full.text
    content_ids = [t for t in full.token_ids if t not in llm.tokenizer.all_special_ids]
    assert b"".join(llm.tokenizer.token_bytes(t) for t in content_ids).decode("utf-8") == full.text
    assert [lp.token_id for lp in full.logprobs] == full.token_ids


def test_t1_prompt_ending_mid_character_does_not_repeat_prompt(llm):
    ids = llm.tokenizer.encode("Say: 🌶️🎉")
    cut = next(i for i in range(len(ids), 0, -1) if "\ufffd" in llm.tokenizer.decode(ids[:i]))
    prompt = ids[:cut]  # ends inside a multi-byte character
    deltas = stream(llm, "t1-cut", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    text = "".join(c.text for d in deltas for c in d.outputs)
    assert "Say" not in text and "\ufffd" not in text


# --- case T2: stop strings ---------------------------------------------------------------------------------

ABC = "A B C D E F G H I J K"


ABC_GREEDY = " L P Q R S T U\n\nThe answer is"
"""SmolLM2-135M (Q4_1) skips " M N O" after this prompt (transformers agrees), so case T2's "O P Q" never
occurs; "R S T" plays its part below, and "O P Q" is checked to end by length with the exact text."""


def test_t2_case_stop_string_does_not_occur_with_this_model(llm):
    prompt = llm.tokenizer.encode(ABC)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop=["O P Q"]))[0].outputs[0]
    assert (out.text, out.finish_reason) == (ABC_GREEDY, "length")


@pytest.mark.parametrize("stop", [["R S T"], "R S T"])
def test_t2_stop_string_list_and_plain(llm, stop):
    prompt = llm.tokenizer.encode(ABC)
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=stop)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "R S T"
    assert out.text == " L P Q "
    deltas = stream(llm, f"t2-{type(stop).__name__}", prompt, params)
    texts = [c.text for d in deltas for c in d.outputs]
    assert "".join(texts) == out.text
    assert not any(part in t for t in texts for part in ("R", "S", "T"))


def test_t2_stop_string_strict_prefix_of_a_token(llm):
    prompt = llm.tokenizer.encode("The capital of France is")
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert free.text.startswith(" Paris")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, stop=["Pari"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == " "
    with_stop = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=10, stop=["Pari"], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert with_stop.text == " Pari"


def test_t2_stop_never_occurs_flushes_tail(llm):
    prompt = llm.tokenizer.encode(ABC)
    params = SamplingParams(temperature=0.0, max_tokens=10, stop=["L P Q R S T U V W X Y Z!"])
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    deltas = stream(llm, "t2-never", prompt, params)
    assert "".join(c.text for d in deltas for c in d.outputs) == out.text
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_min_tokens_beyond_the_context_is_rejected_before_any_work(llm):
    from kvscope.engine.errors import InvalidParameterError

    prompt = llm.tokenizer.encode("Hello")
    left = llm.engine.max_model_len - len(prompt)
    with pytest.raises(InvalidParameterError) as err:
        llm.engine.check_request(prompt, SamplingParams(min_tokens=left + 1, max_tokens=None))
    assert err.value.param == "min_tokens" and str(left) in str(err.value)
    assert llm.engine.check_request(prompt, SamplingParams(min_tokens=left, max_tokens=None)) == left
