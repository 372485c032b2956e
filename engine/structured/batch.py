"""The worker's side of structured output: one matcher per constrained request, the step's bitmask, and
advancing the matchers by the sampled tokens. Unconstrained requests are never touched."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from engine.structured.backend import StructuredOutputManager
from engine.structured.bitmask import allocate_bitmask
from engine.structured.matcher import RequestMatcher


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

    def bitmask(self, requests: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows int64 ``[k]``, bitmask int32 ``[k, words]``) of the constrained requests among ``requests``
        (engine Requests, one per logits row), or None when none is constrained. Each matcher is first
        synced to the request's kept output tokens (preemption, recompute)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        start = time.perf_counter()
        mask = allocate_bitmask(len(rows), self.manager.vocab_size)
        for k, row in enumerate(rows):
            matcher = self._matcher(requests[row])
            matcher.sync(requests[row].output_token_ids)
            matcher.fill_bitmask(mask[k])
        if self.manager.mask_observer is not None:
            self.manager.mask_observer(time.perf_counter() - start)
        return torch.tensor(rows, dtype=torch.int64), mask

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
