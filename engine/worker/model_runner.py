"""ModelRunner: owns the paged KV caches, the grammar matchers and per-request RNGs; runs one step on the
device."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Protocol

import torch

from kvscope.engine.attention.backend import AttentionBackend, AttentionMetadata
from kvscope.engine.attention.forward_context import set_forward_context
from kvscope.engine.core.request import Request
from kvscope.engine.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvscope.engine.models.llama import LlamaForCausalLM
from kvscope.engine.outputs import TokenLogprob
from kvscope.engine.spec_decode.rejection_sampler import greedy_verify, rejection_sample
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.structured.batch import MatcherTable, StepMasks
from kvscope.engine.worker.input_batch import ModelInputs, build_model_inputs
from kvscope.engine.worker.kv_cache import KVCacheSpec
from kvscope.engine.worker.sampler import (
    RequestSampling,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    distributions,
    gather_logprobs,
)

PROMPT_LOGPROBS_SLICE = 256
"""Prompt positions whose full-vocabulary logits are materialised at once (bounds memory for echo)."""


class DecodeStep(Protocol):
    """A whole decode step in one call, in place of the eager model for the steps it :meth:`applies` to
    (the CPU platform's ``FusedDecoder``, kvscope.engine.platform.fused_decode: built by EngineCore and
    handed to the runner, which never imports the platform)."""

    @property
    def max_rows(self) -> int:
        """Most requests one such step takes."""
        ...

    def applies(self, metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        """Whether this step (``metadata``, over ``kv_caches``) can run in one call."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids, positions int64 ``[n]`` (one token per request) → float32 logits ``[n, vocab]``; writes
        the new tokens' K/V into ``kv_caches`` at ``metadata.slot_mapping``."""
        ...


class ModelRunner:
    """Executes SchedulerOutputs: packs inputs, runs the model under a forward context, samples.

    Owns the paged KV caches (allocated here from ``kv_cache_spec`` and ``num_blocks``), the grammar matchers
    of constrained requests (a :class:`MatcherTable` over ``structured``; None without it) and the per-request
    generators. The model comes ready to run (CPU packing: kvscope.engine.platform.cpu); the runner never
    changes it. ``fused``: a one-call decode step for the decode-only steps it applies to (None: every step
    runs the eager model).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_cache_spec: KVCacheSpec,
        num_blocks: int,
        vocab_size: int,
        device: torch.device,
        structured: StructuredOutputManager | None = None,
        fused: DecodeStep | None = None,
    ) -> None:
        self.model = model
        self.fused = fused
        """The one-call decode step for decode-only steps (on CPU, the platform's C++ decode step where the
        model's weights and the CPU allow it); None: the eager model runs every step."""
        self.kv_caches = kv_cache_spec.allocate(num_blocks, device)
        """One tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        self.backend = backend
        self.block_size = kv_cache_spec.block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.matchers = MatcherTable(structured) if structured is not None else None
        """Grammar matchers of constrained requests (None: structured output unavailable)."""

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Returns sampled tokens (+ logprobs) of the requests whose chunk reached the end."""
        for request_id in scheduler_output.finished_req_ids:
            self._generators.pop(request_id, None)
            if self.matchers is not None:
                self.matchers.drop(request_id)
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        inputs = build_model_inputs(scheduler_output, self.block_size, self.device)
        masks = self._start_grammar_masks(scheduler_output, inputs)  # computed during the forward pass
        output = ModelRunnerOutput()
        if self._fused_applies(scheduler_output, inputs):
            logits = self.fused(inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_caches)
            self.backend.skip_step()  # its per-step state (resident decode K/V) did not see this step
            if inputs.sampled_rows:
                self._sample(scheduler_output, inputs, logits[inputs.logits_indices], output, masks)
            return output
        with set_forward_context(inputs.attn_metadata, self.kv_caches, self.backend):
            hidden = self.model(inputs.input_ids, inputs.positions)
        self._prompt_logprobs(scheduler_output, inputs, hidden, output)
        if inputs.sampled_rows:
            self._sample(
                scheduler_output,
                inputs,
                self.model.compute_logits(hidden[inputs.logits_indices]),
                output,
                masks,
            )
        return output

    def _fused_applies(self, scheduler_output: SchedulerOutput, inputs: ModelInputs) -> bool:
        # a verification step (each request its new token and its drafts, no prefill chunk) runs fused too
        return (
            self.fused is not None
            and all(
                item.num_scheduled_tokens == 1 + len(item.spec_token_ids)
                for item in scheduler_output.scheduled
            )
            and self.fused.applies(inputs.attn_metadata, self.kv_caches, verification=inputs.has_drafts)
            and all(
                item.request.sampling_params.prompt_logprobs is None for item in scheduler_output.scheduled
            )
        )

    def _start_grammar_masks(self, scheduler_output: SchedulerOutput, inputs: ModelInputs) -> Future | None:
        if self.matchers is None or not inputs.sampled_rows:
            return None
        items = [scheduler_output.scheduled[row] for row in inputs.sampled_rows]
        drafts = [item.spec_token_ids for item in items] if inputs.has_drafts else None
        return self.matchers.bitmask_async([item.request for item in items], drafts)

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        inputs: ModelInputs,
        logits: torch.Tensor,
        output: ModelRunnerOutput,
        masks: Future | None = None,
    ) -> None:
        """Sample (or verify drafts) from ``logits`` float32 ``[len(logits_indices), vocab]``."""
        items = [scheduler_output.scheduled[row] for row in inputs.sampled_rows]
        if inputs.has_drafts:
            self._verify(items, logits, output, self._wait_masks(masks, output))
            return
        requests = [item.request for item in items]
        masked = self._wait_masks(masks, output)
        metadata = self._metadata(
            [(r, []) for r in requests],
            [self._generator(r.request_id, r.sampling_params.seed) for r in requests],
            masked,
        )
        result: SamplerOutput = self.sampler(logits, metadata)
        token_ids = result.sampled_token_ids.tolist()
        if masked is not None:
            self.matchers.advance(requests, [[token_id] for token_id in token_ids])
        for i, request in enumerate(requests):
            output.sampled_token_ids[request.request_id] = [token_ids[i]]
            if request.sampling_params.logprobs is not None:
                output.logprobs[request.request_id] = [
                    _logprob_entry(result, i, token_ids[i], request.sampling_params.logprobs)
                ]

    def _verify(
        self,
        items: list[ScheduledRequest],
        logits: torch.Tensor,
        output: ModelRunnerOutput,
        masked: StepMasks | None,
    ) -> None:
        """Speculative verification: ``logits`` has 1 + len(spec_token_ids) rows per request (row j: after the
        output so far and the draft's first j tokens); each request emits its accepted draft prefix and one
        target token (engine/spec_decode/rejection_sampler.py). Requests without a draft take one row."""
        requests = [item.request for item in items]
        drafts = [item.spec_token_ids for item in items]
        rows = [(r, d[:j]) for r, d in zip(requests, drafts, strict=True) for j in range(len(d) + 1)]
        metadata = self._metadata(rows, [None] * len(rows), masked)
        target = distributions(logits, metadata)
        greedy_ids = target.greedy_token_ids.tolist()
        greedy_rows = metadata.greedy_mask.tolist()
        emitted_lists = []
        offset = 0
        for request, draft in zip(requests, drafts, strict=True):
            count = len(draft) + 1
            if greedy_rows[offset]:
                emitted = greedy_verify(greedy_ids[offset : offset + count], draft)
            else:
                generator = self._generator(request.request_id, request.sampling_params.seed)
                emitted = rejection_sample(target.probs[offset : offset + count], draft, generator)
            emitted_lists.append(emitted)
            output.sampled_token_ids[request.request_id] = emitted
            if draft:
                output.num_accepted_tokens[request.request_id] = len(emitted) - 1
            k = request.sampling_params.logprobs
            if k is not None:
                output.logprobs[request.request_id] = _logprob_entries(
                    target.raw_logprobs[offset : offset + len(emitted)], emitted, k
                )
            offset += count
        if masked is not None:
            self.matchers.advance(requests, emitted_lists)

    def _metadata(
        self,
        rows: list[tuple[Request, list[int]]],
        generators: list[torch.Generator | None],
        masked: StepMasks | None,
    ) -> SamplingMetadata:
        """Sampling metadata of one row per (request, tokens appended after its output so far), with the
        step's grammar masks when there are any. Each row reuses its request's :class:`RequestSampling`
        (built once at admission, shared by siblings and verification rows): nothing per-request is checked
        or rebuilt here."""
        metadata = SamplingMetadata.from_requests(
            params=[r.sampling_params for r, _ in rows],
            prepared=[self._prepared(r) for r, _ in rows],
            output_token_ids=[
                r.output_token_ids + prefix if prefix else r.output_token_ids for r, prefix in rows
            ],
            generators=generators,
            eos_token_ids=[r.eos_token_id for r, _ in rows],
            vocab_size=self.vocab_size,
            device=self.device,
        )
        if masked is not None:
            metadata = replace(
                metadata, bitmask_rows=masked.rows.to(self.device), token_bitmask=masked.bitmask
            )
        return metadata

    def _prepared(self, request: Request) -> RequestSampling:
        """The request's sampling tensors: the ones its admission built (engine/input_processor.py), or, for a
        Request made without one (tests, tools), built now and kept on the request, so still once."""
        prepared = request.prepared_sampling
        if prepared is None:
            prepared = RequestSampling.build(
                request.sampling_params, request.prompt_token_ids, self.vocab_size, self.device
            )
            request.prepared_sampling = prepared
        return prepared

    def _wait_masks(self, masks: Future | None, output: ModelRunnerOutput) -> StepMasks | None:
        if masks is None:
            return None
        waited = time.perf_counter()
        masked = masks.result()
        if masked is not None:
            output.structured_wait_s = time.perf_counter() - waited
            output.structured_mask_s.update(masked.seconds)
        return masked

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    def _prompt_logprobs(
        self,
        scheduler_output: SchedulerOutput,
        inputs: ModelInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        if all(item.request.sampling_params.prompt_logprobs is None for item in scheduler_output.scheduled):
            return
        query_start = inputs.attn_metadata.query_start_loc.tolist()
        for row, item in enumerate(scheduler_output.scheduled):
            k = item.request.sampling_params.prompt_logprobs
            if k is None:
                continue
            entries = _chunk_prompt_logprobs(
                self.model, item, hidden[query_start[row] : query_start[row + 1]], k
            )
            if entries:
                output.prompt_logprobs[item.request_id] = entries


def _chunk_prompt_logprobs(
    model: torch.nn.Module, item: ScheduledRequest, hidden: torch.Tensor, k: int
) -> dict[int, TokenLogprob]:
    """Logprobs of prompt tokens predicted inside this chunk: hidden at position p scores prompt[p + 1]."""
    prompt = item.request.prompt_token_ids
    start = item.num_computed_tokens
    last = min(start + item.num_scheduled_tokens, len(prompt) - 1)  # positions p < last predict prompt[p+1]
    entries: dict[int, TokenLogprob] = {}
    for lo in range(start, last, PROMPT_LOGPROBS_SLICE):
        hi = min(lo + PROMPT_LOGPROBS_SLICE, last)
        logits = model.compute_logits(hidden[lo - start : hi - start])
        targets = torch.tensor(prompt[lo + 1 : hi + 1], dtype=torch.int64, device=logits.device)
        lps, top_ids, top_lps, ranks = compute_prompt_logprobs(logits, targets, k)
        for j, (lp, rank) in enumerate(zip(lps.tolist(), ranks.tolist(), strict=True)):
            top = list(zip(top_ids[j].tolist(), top_lps[j].tolist(), strict=True))
            entries[lo + 1 + j] = TokenLogprob(token_id=prompt[lo + 1 + j], logprob=lp, rank=rank, top=top)
    return entries


def _logprob_entries(raw_logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """One entry per emitted token: ``raw_logprobs`` ``[len(token_ids), vocab]`` (row j scores token j)."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=raw_logprobs.device)
    lps, top_ids, top_lps, ranks = gather_logprobs(raw_logprobs, ids, k)
    return [
        TokenLogprob(
            token_id=token_id,
            logprob=float(lps[j]),
            rank=int(ranks[j]),
            top=list(zip(top_ids[j].tolist(), top_lps[j].tolist(), strict=True)),
        )
        for j, token_id in enumerate(token_ids)
    ]


def _logprob_entry(result: SamplerOutput, row: int, token_id: int, k: int) -> TokenLogprob:
    top = list(
        zip(result.top_token_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist(), strict=True)
    )
    return TokenLogprob(
        token_id=token_id, logprob=float(result.logprobs[row]), rank=int(result.ranks[row]), top=top
    )
