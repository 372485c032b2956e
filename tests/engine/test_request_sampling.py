"""Per-request sampling tensors are built once per request, never per step (issue 35):
kvscope.engine.worker.sampler's RequestSampling is built at admission (InputProcessor), shared by a
request's n children and its speculative verification rows, and every step's SamplingMetadata only reuses
it."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.core.request import Request
from kvscope.engine.llm import LLM
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.sampler import RequestSampling, SamplingMetadata


class Spy:
    """Counts RequestSampling.build calls and records the ``prepared`` rows of every step's metadata."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.built: list[RequestSampling] = []
        self.steps: list[list[RequestSampling]] = []
        build, from_requests = RequestSampling.build.__func__, SamplingMetadata.from_requests.__func__

        def counting_build(cls, *args, **kwargs):
            self.built.append(build(cls, *args, **kwargs))
            return self.built[-1]

        def recording(cls, params, prepared, *args, **kwargs):
            self.steps.append(list(prepared))
            return from_requests(cls, params, prepared, *args, **kwargs)

        monkeypatch.setattr(RequestSampling, "build", classmethod(counting_build))
        monkeypatch.setattr(SamplingMetadata, "from_requests", classmethod(recording))


@pytest.mark.slow
def test_built_once_and_shared_by_n_children_on_every_step(llm: LLM, monkeypatch) -> None:
    """n 4, 6 tokens each, with logit_bias, min_tokens bans over stop ids and a repetition penalty: one build
    for the request, and all 24 sampled rows over the steps read that one object (old code rebuilt and
    re-checked the bias and stop ids for every row of every step). The bias (+100 on one token) shows in every
    token, so the cached tensors are the ones applied."""
    spy = Spy(monkeypatch)
    token = llm.tokenizer.encode(" blue")[-1]
    params = SamplingParams(
        n=4,
        temperature=0.8,
        seed=3,
        max_tokens=6,
        min_tokens=6,
        logit_bias={token: 100.0},
        stop_token_ids=[token + 1, 0, token + 1],
        repetition_penalty=1.1,
    )
    children = llm.engine.add_request("once", llm.tokenizer.encode("The sky is"), params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs.extend(llm.engine.step().outputs)
    assert len(spy.built) == 1
    assert [child.prepared_sampling for child in children] == [spy.built[0]] * 4
    assert sum(len(rows) for rows in spy.steps) == 4 * 6 and len(spy.steps) >= 6
    assert all(prepared is spy.built[0] for rows in spy.steps for prepared in rows)
    tokens = {}
    for output in outputs:
        for completion in output.outputs:
            tokens.setdefault(completion.index, []).extend(completion.token_ids)
    assert tokens == {i: [token] * 6 for i in range(4)}


@pytest.mark.slow
def test_verification_rows_share_their_requests_tensors(llm: LLM, monkeypatch) -> None:
    """A request with a 2-token draft is verified on 3 rows: the batch's bias and bans repeat the request's
    one prepared tensors on each row, and nothing is built or checked at the step."""
    params = SamplingParams(
        temperature=0.0, logit_bias={7: 2.0, 3: -1.0}, min_tokens=4, stop_token_ids=[9, 11]
    )
    admitted = llm.engine.input_processor.process([1, 2, 3], params)
    request = Request("verify", [1, 2, 3], params, 2, prepared_sampling=admitted.sampling)
    spy = Spy(monkeypatch)
    metadata = llm.engine.runner._metadata(
        [(request, []), (request, [5]), (request, [5, 6])], [None] * 3, None
    )
    assert spy.built == [] and spy.steps == [[admitted.sampling] * 3]
    bias = metadata.logit_bias
    assert (bias.rows.tolist(), bias.cols.tolist(), bias.values.tolist()) == (
        [0, 0, 1, 1, 2, 2],
        [7, 3, 7, 3, 7, 3],
        [2.0, -1.0, 2.0, -1.0, 2.0, -1.0],
    )
    banned = sorted(zip(metadata.banned.rows.tolist(), metadata.banned.cols.tolist(), strict=True))
    assert banned == [(row, token) for row in range(3) for token in (2, 9, 11)]


def test_request_sampling_holds_what_steps_need() -> None:
    state = RequestSampling.build(
        SamplingParams(logit_bias={5: 1.5}, min_tokens=2, stop_token_ids=[4, 4, 1], repetition_penalty=1.2),
        [3, 1, 3, 2],
        vocab_size=10,
    )
    assert state.bias_ids.tolist() == [5] and state.bias_values.tolist() == [1.5] and state.num_bias == 1
    assert state.min_tokens_ban_ids.tolist() == [4, 1] and state.prompt_ids.tolist() == [1, 2, 3]
    plain = RequestSampling.build(SamplingParams(stop_token_ids=[4]), [3], vocab_size=10)
    assert (plain.bias_ids, plain.min_tokens_ban_ids, plain.prompt_ids, plain.num_bias) == (
        None,
        None,
        None,
        0,
    )


def test_from_requests_equals_build() -> None:
    """The per-step path over prepared rows gives the same processed logits as building from bare params."""
    params = [
        SamplingParams(
            logit_bias={1: 3.0},
            min_tokens=3,
            stop_token_ids=[2],
            repetition_penalty=1.3,
            temperature=0.0,
            logprobs=0,
        ),
        SamplingParams(frequency_penalty=0.5, temperature=0.0, logprobs=0),
    ]
    prompts, outputs, eos = [[0, 3], [4]], [[1], [4, 4]], [5, None]
    built = SamplingMetadata.build(params, prompts, outputs, [None, None], eos, vocab_size=6)
    prepared = [RequestSampling.build(p, prompt, 6) for p, prompt in zip(params, prompts, strict=True)]
    reused = SamplingMetadata.from_requests(params, prepared, outputs, [None, None], eos, vocab_size=6)
    for a, b in ((built.logit_bias, reused.logit_bias), (built.banned, reused.banned)):
        assert (a.rows.tolist(), a.cols.tolist()) == (b.rows.tolist(), b.cols.tolist())
    assert torch.equal(built.penalties.prompt_mask, reused.penalties.prompt_mask)
    assert reused.banned.rows.tolist() == [0, 0] and sorted(reused.banned.cols.tolist()) == [2, 5]
