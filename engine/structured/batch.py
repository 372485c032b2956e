"""The worker's side of structured output: one matcher per constrained request, the step's bitmask, and
advancing the matchers by the sampled tokens. Unconstrained requests are never touched.

Nothing here compiles: a request's matcher comes from the grammar pinned to it at admission
(StructuredOutputManager.matcher_for). A matcher that reaches its error state (one of llguidance's limits hit
mid-answer) is reported by :meth:`MatcherTable.take_errors`; the engine fails that request instead of letting
the EOS-only mask end it as a ``stop`` with a truncated answer."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.structured.backend import StructuredOutputManager
from kvscope.engine.structured.bitmask import allocate_bitmask
from kvscope.engine.structured.matcher import RequestMatcher

ERROR_PREFIX = "structured output failed: "
"""Start of the reason a request fails with when its grammar matcher fails (RequestFailedError.reason): the
client's grammar hit one of llguidance's limits while generating (the server answers a 400 naming the
constraint's field, kvscope.engine.async_engine.GrammarLimitError), the rest of the reason being
llguidance's error."""
UNAVAILABLE_PREFIX = "structured output unavailable: "
"""Start of the reason a request fails with when it has no usable grammar (none pinned at admission): the
engine's fault, a 500."""


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
        self._errors: dict[str, str] = {}
        """request_id → why its matcher failed, since the last :meth:`take_errors`."""

    def bitmask_async(
        self, requests: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None
    ) -> Future | None:
        """:meth:`bitmask` on a helper thread, so the masks are computed while the model runs its forward pass
        (llguidance releases the GIL while it computes); None when no request is constrained. The caller
        must wait for the result before the next call, :meth:`advance` or :meth:`drop`."""
        if not any(r.sampling_params.structured_outputs is not None for r in requests):
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._executor.submit(self.bitmask, list(requests), drafts)

    def bitmask(
        self, requests: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None
    ) -> StepMasks | None:
        """The step's masks (:class:`StepMasks`: rows int64 ``[k]``, bitmask int32 ``[k, words]``, seconds
        per request id) of the constrained requests among ``requests`` (engine Requests), or None when none
        is constrained. Without ``drafts`` request i owns logits row i; with them (speculative decoding,
        one draft per request, possibly empty) it owns ``1 + len(drafts[i])`` consecutive rows, row j
        masked for the state after the output and ``drafts[i][:j]``. Each matcher is first synced to the
        request's kept output tokens (preemption, recompute, tokens dropped after a stop)."""
        counts = [1] * len(requests) if drafts is None else [1 + len(d) for d in drafts]
        starts = [sum(counts[:i]) for i in range(len(requests))]
        constrained = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs is not None]
        if not constrained:
            return None
        start = time.perf_counter()
        rows = [starts[i] + j for i in constrained for j in range(counts[i])]
        mask = allocate_bitmask(len(rows), self.manager.vocab_size)
        seconds: dict[str, float] = {}
        k = 0
        for i in constrained:
            began = time.perf_counter()
            request_id = requests[i].request_id
            matcher = self._matcher(requests[i])
            block = mask[k : k + counts[i]]
            k += counts[i]
            if matcher is None:  # no grammar pinned: fail the request, let the row allow anything meanwhile
                continue
            matcher.sync(requests[i].output_token_ids)
            matcher.fill_bitmasks(block, () if drafts is None else drafts[i])
            if matcher.is_error:
                self._fail(request_id, matcher.error)
            seconds[request_id] = time.perf_counter() - began
        if self.manager.mask_observer is not None:
            self.manager.mask_observer(time.perf_counter() - start)
        return StepMasks(torch.tensor(rows, dtype=torch.int64), mask, seconds)

    def advance(self, requests: Sequence[Any], token_ids: Sequence[Sequence[int]]) -> None:
        """Consume each constrained request's emitted tokens (one list per request, in order); a token the
        matcher fails on (a limit of llguidance hit while it advances) fails the request."""
        for request, tokens in zip(requests, token_ids, strict=True):
            matcher = self._matchers.get(request.request_id)
            if matcher is None or request.request_id in self._errors:
                continue
            for token_id in tokens:
                if not matcher.accept(token_id):
                    self._fail(request.request_id, matcher.error)
                    break

    def take_errors(self) -> dict[str, str]:
        """request_id → reason (``structured output failed: <llguidance's error in one line>``) of each
        request whose matcher failed since the last call; the engine fails these requests and drops this
        step's tokens of them (engine_core.EngineCore.step)."""
        errors, self._errors = self._errors, {}
        return errors

    def _fail(self, request_id: str, message: str) -> None:
        self._errors.setdefault(request_id, ERROR_PREFIX + (message or "the grammar matcher failed"))

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def _matcher(self, request: Any) -> RequestMatcher | None:
        """The request's matcher, made on its first step from the grammar pinned at admission; None (and the
        request failed) when it has none: compiling here would stall the whole step."""
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            try:
                matcher = self.manager.matcher_for(request.sampling_params.structured_outputs)
            except InvalidParameterError as exc:
                self._errors.setdefault(request.request_id, UNAVAILABLE_PREFIX + str(exc))
                return None
            if matcher is None:
                self._errors.setdefault(
                    request.request_id, UNAVAILABLE_PREFIX + "the grammar was not compiled at admission"
                )
                return None
            self._matchers[request.request_id] = matcher
        return matcher
