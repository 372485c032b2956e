"""The worker's side of structured output: one matcher per constrained request, the step's bitmask, and
advancing the matchers by the sampled tokens. Unconstrained requests are never touched."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from engine.structured.backend import StructuredOutputManager
from engine.structured.bitmask import allocate_bitmask
from engine.structured.matcher import RequestMatcher


class StepMasks(NamedTuple):
    """One step's grammar masks: logits rows, their bitmask and the seconds each request's mask took."""

    rows: torch.Tensor
    """int64 ``[k]``: the constrained rows of the step's logits."""
    bitmask: torch.Tensor
    """int32 ``[k, ceil(vocab / 32)]`` (engine/structured/bitmask.py layout)."""
    seconds: dict[str, float]
    """request_id → seconds syncing its matcher and filling its row."""


class MatcherTable:
    """request_id → :class:`RequestMatcher`, created on a request's first sampled step (``n > 1`` children
    have their own ids, so each child gets its own matcher) and dropped when the request finishes/aborts."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self._matchers: dict[str, RequestMatcher] = {}
        self._executor: ThreadPoolExecutor | None = None

    def bitmask_async(self, requests: Sequence[Any]) -> Future | None:
        """:meth:`bitmask` on a helper thread, so the masks are computed while the model runs its forward pass
        (llguidance releases the GIL while it computes); None when no request is constrained. The caller
        must wait for the result before the next call, :meth:`advance` or :meth:`drop`."""
        if not any(r.sampling_params.structured_outputs is not None for r in requests):
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._executor.submit(self.bitmask, list(requests))

    def bitmask(self, requests: Sequence[Any]) -> StepMasks | None:
        """The step's masks (:class:`StepMasks`: rows int64 ``[k]``, bitmask int32 ``[k, words]``, seconds per
        request id) of the constrained requests among ``requests`` (engine Requests, one per logits row), or
        None when none is constrained. Each matcher is first synced to the request's kept output tokens
        (preemption, recompute)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        start = time.perf_counter()
        mask = allocate_bitmask(len(rows), self.manager.vocab_size)
        seconds: dict[str, float] = {}
        for k, row in enumerate(rows):
            began = time.perf_counter()
            matcher = self._matcher(requests[row])
            matcher.sync(requests[row].output_token_ids)
            matcher.fill_bitmask(mask[k])
            seconds[requests[row].request_id] = time.perf_counter() - began
        if self.manager.mask_observer is not None:
            self.manager.mask_observer(time.perf_counter() - start)
        return StepMasks(torch.tensor(rows, dtype=torch.int64), mask, seconds)

    def advance(self, requests: Sequence[Any], token_ids: Sequence[int]) -> None:
        """Consume each constrained request's sampled token."""
        for request, token_id in zip(requests, token_ids, strict=True):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None:
                matcher.accept(token_id)

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def _matcher(self, request: Any) -> RequestMatcher:
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            matcher = self.manager.new_matcher(request.sampling_params.structured_outputs)
            self._matchers[request.request_id] = matcher
        return matcher
