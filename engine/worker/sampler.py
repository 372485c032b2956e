"""Sampling: per-request parameters as batch tensors (:class:`SamplingMetadata`) and the :class:`Sampler`.

Order of operations (vLLM v1 ``Sampler.forward``):

1. raw logprobs = ``log_softmax(logits)`` — what logprobs report (before any penalty or temperature);
2. ``logit_bias``; ``min_tokens`` (EOS and ``stop_token_ids`` banned while fewer than ``min_tokens`` tokens
   were generated); repetition penalty; frequency/presence penalties;
3. greedy rows (temperature < 1e-5): argmax of the processed logits;
4. random rows: temperature, ``min_p``, ``top_k``, ``top_p``, then the exponential race
   ``argmax(probs / q)`` with ``q ~ Exp(1)`` — a draw from ``probs`` (it is the Gumbel-max trick: ``argmax(log
   p - log q)`` with ``-log q`` Gumbel-distributed). A row with a seed draws its ``q`` from its own
   ``torch.Generator``, so its samples do not depend on the other rows of the batch.

Per-request work happens once: a request's ``logit_bias``, ``stop_token_ids`` (for ``min_tokens``) and
distinct prompt ids become a :class:`RequestSampling` when it is admitted, checked against the vocabulary
there; every step's :class:`SamplingMetadata` only concatenates those tensors (shared by a request's ``n``
children and its speculative verification rows) and reads the scalars and the output so far.

Fast path: when every row is greedy with no bias, bans or penalties and no row asked for logprobs
(``SamplingMetadata.is_plain_greedy``), only the argmax is taken (``SamplerOutput.logprobs``/``ranks`` are
None).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import torch

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured.bitmask import apply_token_bitmask
from kvscope.engine.worker.logits_processors import (
    PenaltyTensors,
    SparseLogits,
    apply_bans_,
    apply_logit_bias_,
    apply_min_p_,
    apply_penalties,
    apply_top_k_top_p,
)

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""

EosIds = int | Sequence[int] | None


@dataclass(frozen=True, slots=True)
class RequestSampling:
    """The constant, per-request part of sampling as tensors: built and checked once when the request is
    admitted (engine/input_processor.py), then reused on every step by every row of the request — its ``n``
    children and its speculative verification rows share this one object. Steps never re-check or rebuild it.
    Build with :meth:`build`."""

    bias_ids: torch.Tensor | None
    """int64 ``[k]``: ``logit_bias`` token ids (dict order); None without a bias."""
    bias_values: torch.Tensor | None
    """float32 ``[k]``: their biases."""
    min_tokens_ban_ids: torch.Tensor | None
    """int64 ``[m]``: ``stop_token_ids`` (de-duplicated), banned while fewer than ``min_tokens`` tokens were
    generated; None when ``min_tokens`` is 0 or there are none. EOS is added per step (the request's own)."""
    prompt_ids: torch.Tensor | None
    """int64 ``[u]``: the distinct prompt token ids (the repetition penalty's prompt mask); None without a
    repetition penalty."""

    @property
    def num_bias(self) -> int:
        """Entries of ``logit_bias``."""
        return 0 if self.bias_ids is None else self.bias_ids.numel()

    def to(self, device: torch.device | str) -> RequestSampling:
        """These tensors on ``device`` (``self`` when they are there already). The engine thread calls it once
        per request (EngineCore.add_engine_request): admission builds on the CPU, on the server's event loop,
        where a copy to a CUDA device would wait for the running step."""
        device = torch.device(device)
        tensors = (self.bias_ids, self.bias_values, self.min_tokens_ban_ids, self.prompt_ids)
        if all(t is None or t.device == device for t in tensors):
            return self
        return RequestSampling(*(None if t is None else t.to(device) for t in tensors))

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> RequestSampling:
        """Check the token ids in ``params`` (and the prompt's, when a repetition penalty needs them)
        against the vocabulary ``[0, vocab_size)`` and build the tensors. Raises InvalidParameterError
        naming ``vocab_size``, ``logit_bias`` or ``stop_token_ids`` ("… token ids must be in [0, last]."),
        or ``prompt_token_ids``."""
        if vocab_size < 1:
            raise InvalidParameterError("vocab_size", f"vocab_size must be at least 1, got {vocab_size}")
        bias = params.logit_bias or {}
        _check_ids(bias.keys(), vocab_size, "logit_bias")
        _check_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
        bias_ids = bias_values = bans = prompt_ids = None
        if bias:
            bias_ids = torch.tensor(list(bias.keys()), dtype=torch.int64, device=device)
            bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
        if params.min_tokens > 0 and params.stop_token_ids:
            bans = torch.tensor(params.stop_token_ids, dtype=torch.int64, device=device)
        if params.repetition_penalty != 1.0:
            if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
                raise InvalidParameterError(
                    "prompt_token_ids", f"prompt_token_ids holds token ids outside [0, {vocab_size})"
                )
            prompt_ids = torch.tensor(sorted(set(prompt_token_ids)), dtype=torch.int64, device=device)
        return cls(bias_ids, bias_values, bans, prompt_ids)


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """The sampling parameters of one batch as tensors (row i = request i). Built per step by
    :meth:`from_requests` from each row's :class:`RequestSampling` (or by :meth:`build` from bare params)."""

    vocab_size: int
    temperature: torch.Tensor
    """float32 ``[num_reqs]``; 1.0 on greedy rows (never used there)."""
    greedy_mask: torch.Tensor
    """bool ``[num_reqs]``: the row takes the argmax."""
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    """int64 ``[num_reqs]`` in [1, vocab] (vocab = off); None when no random row uses top-k."""
    top_p: torch.Tensor | None
    """float32 ``[num_reqs]`` in (0, 1] (1 = off); None when no random row uses top-p."""
    min_p: torch.Tensor | None
    """float32 ``[num_reqs]`` in [0, 1] (0 = off); None when no random row uses min-p."""
    penalties: PenaltyTensors | None
    """None when no row has a repetition/presence/frequency penalty."""
    logit_bias: SparseLogits | None
    banned: SparseLogits | None
    """(row, token) pairs banned by ``min_tokens``."""
    generators: tuple[torch.Generator | None, ...]
    max_num_logprobs: int
    """Columns of ``SamplerOutput.top_*``: the largest ``logprobs`` requested in the batch (0 if none)."""
    needs_logprobs: bool = True
    """Some row asked for logprobs (``logprobs`` not None, even 0)."""
    bitmask_rows: torch.Tensor | None = None
    """int64 ``[k]``: rows under a grammar constraint (engine/structured); None when no row is."""
    token_bitmask: torch.Tensor | None = None
    """int32 ``[k, ceil(vocab / 32)]``: allowed tokens of those rows (bit t % 32 of word t // 32)."""

    @property
    def is_plain_greedy(self) -> bool:
        """Every row takes the argmax of the unmodified logits and nobody wants logprobs (the fast path)."""
        return (
            self.all_greedy
            and not self.needs_logprobs
            and self.logit_bias is None
            and self.banned is None
            and self.penalties is None
        )

    @property
    def num_reqs(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[EosIds],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Batch the per-request parameters; all lists have one entry per request (row). Builds each row's
        :class:`RequestSampling` here (tests, one-off batches); the engine builds those once per request and
        calls :meth:`from_requests` on every step.

        ``eos_token_ids[i]`` is the request's EOS id (or ids, or None). Raises InvalidParameterError (a
        ValueError) naming the argument for mismatched lengths, ``vocab_size < 1``, token ids outside
        ``[0, vocab_size)`` (``prompt_token_ids``, ``output_token_ids``, ``eos_token_ids``, ``logit_bias``,
        ``stop_token_ids``).
        """
        _check_batch(params, prompt_token_ids=prompt_token_ids)
        if vocab_size < 1:
            raise InvalidParameterError("vocab_size", f"vocab_size must be at least 1, got {vocab_size}")
        prepared = [
            RequestSampling.build(p, prompt, vocab_size, device)
            for p, prompt in zip(params, prompt_token_ids, strict=True)
        ]
        return cls.from_requests(
            params, prepared, output_token_ids, generators, eos_token_ids, vocab_size, device
        )

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prepared: Sequence[RequestSampling],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[EosIds],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """One step's batch from rows whose constant part was built once (``prepared[i]``, possibly the same
        object on several rows). Per row and step only the scalars, the output so far (penalties, min_tokens)
        and EOS are read; bias and stop-id tensors are concatenated, never rebuilt or re-checked.

        Raises InvalidParameterError naming ``prepared``, ``output_token_ids``, ``generators``,
        ``eos_token_ids`` (mismatched lengths or ids outside the vocabulary) or ``vocab_size``.
        """
        _check_batch(
            params,
            prepared=prepared,
            output_token_ids=output_token_ids,
            generators=generators,
            eos_token_ids=eos_token_ids,
        )
        if vocab_size < 1:
            raise InvalidParameterError("vocab_size", f"vocab_size must be at least 1, got {vocab_size}")
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        random = [p for p, g in zip(params, greedy, strict=True) if not g]
        floats = _float_tensor(device)
        return cls(
            vocab_size=vocab_size,
            temperature=floats([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=_top_k(params, vocab_size, device)
            if any(0 < p.top_k < vocab_size for p in random)
            else None,
            top_p=floats([p.top_p for p in params]) if any(p.top_p < 1.0 for p in random) else None,
            min_p=floats([p.min_p for p in params]) if any(p.min_p > 0.0 for p in random) else None,
            penalties=_penalties(params, prepared, output_token_ids, vocab_size, device),
            logit_bias=_logit_bias(prepared, device),
            banned=_min_tokens_bans(params, prepared, output_token_ids, eos_token_ids, vocab_size, device),
            generators=tuple(generators),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=0),
            needs_logprobs=any(p.logprobs is not None for p in params),
        )


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One sampled token per request and its raw logprobs (natural log, from ``log_softmax(logits)``)."""

    sampled_token_ids: torch.Tensor
    """int64 ``[num_reqs]``."""
    logprobs: torch.Tensor | None
    """float32 ``[num_reqs]``: raw logprob of the sampled token; None on the plain-greedy fast path
    (``SamplingMetadata.is_plain_greedy``: no row asked for logprobs)."""
    top_token_ids: torch.Tensor
    """int64 ``[num_reqs, max_num_logprobs]``: most likely tokens, by raw logprob, descending."""
    top_logprobs: torch.Tensor
    """float32 ``[num_reqs, max_num_logprobs]``: their raw logprobs."""
    ranks: torch.Tensor | None
    """int64 ``[num_reqs]``: 1-based rank of the sampled token (tokens with logprob ≥ its logprob); None on
    the plain-greedy fast path."""


class Sampler:
    """``Sampler()(logits, metadata) -> SamplerOutput``; stateless (randomness lives in the generators)."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (``[num_reqs, vocab]``, any float dtype; not modified).

        Raises ValueError("logits") when the shape does not match the metadata.
        """
        if logits.dim() != 2 or tuple(logits.shape) != (metadata.num_reqs, metadata.vocab_size):
            raise InvalidParameterError(
                "logits",
                f"logits must be [{metadata.num_reqs}, {metadata.vocab_size}], got {tuple(logits.shape)}",
            )
        logits = logits.to(torch.float32)
        if metadata.token_bitmask is not None:  # structured output: forbidden tokens -> -inf, as vLLM does
            logits = apply_token_bitmask(logits, metadata.bitmask_rows, metadata.token_bitmask)
        if metadata.is_plain_greedy:  # argmax only: no log_softmax, copy, ranks
            sampled = first_argmax(logits)
            empty = logits[:, :0]
            return SamplerOutput(sampled, None, sampled.new_empty(len(sampled), 0), empty, None)
        raw_logprobs = logits.log_softmax(dim=-1)
        edits_in_place = metadata.logit_bias is not None or metadata.banned is not None
        processed = _process(logits.clone() if edits_in_place else logits, metadata)
        sampled = _sample(processed, metadata)
        lps, top_ids, top_lps, ranks = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, lps, top_ids, top_lps, ranks)


@dataclass(frozen=True, slots=True)
class TargetDistributions:
    """Per-row target of speculative verification (:meth:`Sampler.distributions`)."""

    greedy_token_ids: torch.Tensor
    """int64 ``[n]``: argmax of the processed logits (what a greedy row samples)."""
    probs: torch.Tensor | None
    """float32 ``[n, vocab]``: the final sampling distribution of each row (:func:`final_probs`); None when
    every row is greedy."""
    raw_logprobs: torch.Tensor | None
    """float32 ``[n, vocab]``: ``log_softmax`` of the logits before any processing (what logprobs report);
    None when no row asked for logprobs."""


def distributions(logits: torch.Tensor, metadata: SamplingMetadata) -> TargetDistributions:
    """What :class:`Sampler` would sample from, row by row, without drawing: the greedy token and the final
    probabilities (grammar mask, logit_bias, min_tokens bans, penalties, temperature, min_p, top_k, top_p; the
    order of the module docstring). ``logits`` ``[n, vocab]`` is not modified. Raises InvalidParameterError
    ("logits") when the shape does not match the metadata."""
    if logits.dim() != 2 or tuple(logits.shape) != (metadata.num_reqs, metadata.vocab_size):
        raise InvalidParameterError(
            "logits",
            f"logits must be [{metadata.num_reqs}, {metadata.vocab_size}], got {tuple(logits.shape)}",
        )
    logits = logits.to(torch.float32)
    if metadata.token_bitmask is not None:
        logits = apply_token_bitmask(logits, metadata.bitmask_rows, metadata.token_bitmask)
    if metadata.is_plain_greedy:
        return TargetDistributions(first_argmax(logits), None, None)
    raw_logprobs = logits.log_softmax(dim=-1) if metadata.needs_logprobs else None
    edits_in_place = metadata.logit_bias is not None or metadata.banned is not None
    processed = _process(logits.clone() if edits_in_place else logits, metadata)
    probs = None if metadata.all_greedy else final_probs(processed, metadata)
    return TargetDistributions(first_argmax(processed), probs, raw_logprobs)


ARGMAX_BLOCK_MAX = 2048
"""Largest vocabulary block :func:`first_argmax` reduces at once."""
ARGMAX_BLOCK_MIN = 64
"""Below this block size (a vocabulary with no fitting divisor) :func:`first_argmax` uses ``torch.argmax``."""


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D ``[n, vocab]`` tensor (int64 ``[n]``), the same index on every input
    (the first maximum; the first NaN when a row holds one), computed in two passes: the vectorized ``amax``
    over vocabulary blocks, then ``argmax`` over the block maxima and inside the winning block only.

    torch's CPU ``argmax`` over the last dimension is not vectorized, several times slower than this over a
    49,152-token vocabulary (docs/benchmarks.md "Per-step cost of the eager decoder").
    """
    rows, vocab = logits.shape[0], logits.shape[-1]
    block = _argmax_block(vocab)
    if block is None or logits.dim() != 2:
        return logits.argmax(dim=-1)
    blocks = logits.unflatten(-1, (vocab // block, block))  # a view of a row-contiguous tensor
    best = blocks.amax(dim=-1).argmax(dim=-1)  # the first block holding the maximum (or a NaN)
    inside = blocks[torch.arange(rows, device=logits.device), best].argmax(dim=-1)
    return best * block + inside


@functools.cache
def _argmax_block(vocab: int) -> int | None:
    """Largest divisor of ``vocab`` in [ARGMAX_BLOCK_MIN, ARGMAX_BLOCK_MAX], or None."""
    for block in range(min(ARGMAX_BLOCK_MAX, vocab), ARGMAX_BLOCK_MIN - 1, -1):
        if vocab % block == 0:
            return block
    return None


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ``logprobs`` ``[n, vocab]`` and chosen ``token_ids`` ``[n]``: (chosen logprobs ``[n]``, top-k ids
    ``[n, k]`` and logprobs ``[n, k]`` sorted descending, 1-based ranks ``[n]``). Rank counts the tokens whose
    logprob is ≥ the chosen one's, as vLLM v1 does (so a tie ranks behind)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)
    top_lps, top_ids = (
        logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], token_ids.new_empty(len(token_ids), 0))
    )
    return chosen, top_ids, top_lps, ranks


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt logprobs (completions ``echo``): ``logits[i]`` (``[n, vocab]``) scores ``target_ids[i]``
    (``[n]`` int64, the next prompt token). Returns (logprobs ``[n]``, top ids ``[n, k]``, top logprobs
    ``[n, k]``, ranks ``[n]``) of ``log_softmax(logits)``. Raises ValueError naming ``target_ids`` or
    ``k``."""
    if target_ids.shape != logits.shape[:1]:
        raise InvalidParameterError(
            "target_ids", f"need {logits.shape[0]} target ids, got {tuple(target_ids.shape)}"
        )
    if not 0 <= k <= logits.shape[-1]:
        raise InvalidParameterError("k", f"k must be in [0, {logits.shape[-1]}], got {k}")
    return gather_logprobs(logits.to(torch.float32).log_softmax(dim=-1), target_ids, k)


def _process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens bans (in place: the caller passes a private copy when either applies), then
    penalties (out of place)."""
    if meta.logit_bias is not None:
        apply_logit_bias_(logits, meta.logit_bias)
    if meta.banned is not None:
        apply_bans_(logits, meta.banned)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    greedy = None if meta.all_random else first_argmax(logits)
    if meta.all_greedy:
        return greedy
    random = _sample_random(logits, meta)
    return random if greedy is None else torch.where(meta.greedy_mask, greedy, random)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    probs = final_probs(logits, meta)
    return first_argmax(probs.div_(_exponential_noise(probs, meta.generators)))


def final_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The sampling distribution (float32 ``[n, vocab]``) of processed logits: temperature, min_p, top_k,
    top_p."""
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        apply_min_p_(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def _exponential_noise(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``q ~ Exp(1)`` shaped like ``probs``: seeded rows from their generator (``vocab`` draws per step, so
    the stream depends only on the request), the rest from torch's default generator. Clamped away from 0
    so that a masked token (p = 0) never gives 0/0."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    return q.clamp_(min=torch.finfo(q.dtype).tiny)


def _check_batch(params: Sequence[SamplingParams], **lists: Sequence) -> None:
    for name, values in lists.items():
        if len(values) != len(params):
            raise InvalidParameterError(name, f"{name} has {len(values)} entries for {len(params)} requests")


def _check_id(token_id: int, vocab_size: int, param: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise InvalidParameterError(param, f"token id {token_id} is outside the vocabulary [0, {vocab_size})")


def _check_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    if any(not 0 <= token_id < vocab_size for token_id in token_ids):
        raise InvalidParameterError(param, f"{param} token ids must be in [0, {vocab_size - 1}].")


def _float_tensor(device: torch.device | str):
    return lambda values: torch.tensor(values, dtype=torch.float32, device=device)


def _top_k(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(
        [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
        dtype=torch.int64,
        device=device,
    )


def _token_matrix(
    token_lists: Sequence[Sequence[int]], vocab_size: int, param: str, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, ids) int64 ``[total]`` of every token of every row, ids checked against the vocabulary."""
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidParameterError(param, f"{param} holds token ids outside [0, {vocab_size})")
    return rows, ids


def _rows_of(
    prepared: Sequence[RequestSampling],
    pick: Callable[[RequestSampling], torch.Tensor | None],
    device: torch.device | str,
) -> tuple[torch.Tensor, list[int]] | None:
    """(row index per entry int64 ``[total]``, the rows used) of the rows whose ``pick(prepared[row])`` is a
    tensor; None when no row has one."""
    rows = [row for row, state in enumerate(prepared) if pick(state) is not None]
    if not rows:
        return None
    lengths = torch.tensor([pick(prepared[row]).numel() for row in rows], dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64, device=device), lengths), rows


def _penalties(
    params: Sequence[SamplingParams],
    prepared: Sequence[RequestSampling],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> PenaltyTensors | None:
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    if not use_rep and not any(p.presence_penalty or p.frequency_penalty for p in params):
        return None
    rows, ids = _token_matrix(output_token_ids, vocab_size, "output_token_ids", device)
    counts = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    prompt_mask = None
    if use_rep:
        prompt_mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
        found = _rows_of(prepared, attrgetter("prompt_ids"), device)
        if found is not None:
            rows, used = found
            prompt_mask[rows, torch.cat([prepared[row].prompt_ids for row in used])] = True
    floats = _float_tensor(device)
    return PenaltyTensors(
        repetition=floats([p.repetition_penalty for p in params]),
        presence=floats([p.presence_penalty for p in params]),
        frequency=floats([p.frequency_penalty for p in params]),
        output_counts=counts,
        prompt_mask=prompt_mask,
    )


def _logit_bias(prepared: Sequence[RequestSampling], device: torch.device | str) -> SparseLogits | None:
    found = _rows_of(prepared, attrgetter("bias_ids"), device)
    if found is None:
        return None
    rows, used = found
    return SparseLogits(
        rows,
        torch.cat([prepared[row].bias_ids for row in used]),
        torch.cat([prepared[row].bias_values for row in used]),
    )


def _min_tokens_bans(
    params: Sequence[SamplingParams],
    prepared: Sequence[RequestSampling],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[EosIds],
    vocab_size: int,
    device: torch.device | str,
) -> SparseLogits | None:
    """While ``len(output) < min_tokens``: ban ``stop_token_ids`` and EOS (unless ``ignore_eos``, where EOS
    does not stop generation anyway), like vLLM's MinTokensLogitsProcessor. A (row, token) pair may repeat
    (EOS also a stop id): setting -inf twice is the same ban."""
    eos_rows: list[int] = []
    eos_cols: list[int] = []
    ban_rows: list[int] = []
    for row, (p, output, eos) in enumerate(zip(params, output_token_ids, eos_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        eos_ids = () if p.ignore_eos or eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        for token_id in eos_ids:
            _check_id(token_id, vocab_size, "eos_token_ids")
            eos_rows.append(row)
            eos_cols.append(token_id)
        if prepared[row].min_tokens_ban_ids is not None:
            ban_rows.append(row)
    if not eos_rows and not ban_rows:
        return None
    rows = [torch.tensor(eos_rows, dtype=torch.int64, device=device)]
    cols = [torch.tensor(eos_cols, dtype=torch.int64, device=device)]
    if ban_rows:
        lengths = torch.tensor(
            [prepared[row].min_tokens_ban_ids.numel() for row in ban_rows], dtype=torch.int64, device=device
        )
        rows.append(
            torch.repeat_interleave(torch.tensor(ban_rows, dtype=torch.int64, device=device), lengths)
        )
        cols.extend(prepared[row].min_tokens_ban_ids for row in ban_rows)
    return SparseLogits(torch.cat(rows), torch.cat(cols))
