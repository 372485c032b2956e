"""Turn each step's sampled tokens into RequestOutputs: detokenize, match stop strings, attach logprobs/stats.

Requests with ``n > 1`` run as sibling (child) requests ``{parent}-{i}`` (vLLM v1 parallel sampling); this
module maps children back to their parent and choice index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer


@dataclass(slots=True)
class _ChildState:
    parent_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


@dataclass(slots=True)
class _ParentState:
    prompt_token_ids: list[int]
    unfinished: set[str]


class OutputProcessor:
    """Holds per-request detokenizers; one instance per engine (not thread-safe: step-loop thread only)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, _ChildState] = {}
        self._parents: dict[str, _ParentState] = {}

    def add_request(self, parent_id: str, children: list[Request]) -> None:
        """Register a parent request and its child requests (index i = position in ``children``)."""
        self._parents[parent_id] = _ParentState(children[0].prompt_token_ids, {c.request_id for c in children})
        for index, child in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, child.sampling_params)
            self._children[child.request_id] = _ChildState(parent_id, index, child, detok)

    def request_ids(self) -> list[str]:
        """Parent request ids still in flight."""
        return list(self._parents)

    def child_ids(self, parent_id: str) -> list[str]:
        """Request ids of the parent's children that are still tracked."""
        return [cid for cid, st in self._children.items() if st.parent_id == parent_id]

    def process(self, runner_output: ModelRunnerOutput, scheduler: Scheduler) -> list[RequestOutput]:
        """Build outputs for every request that produced a token this step; finish those that hit a stop string."""
        for request_id, entries in runner_output.prompt_logprobs.items():
            state = self._children.get(request_id)
            if state is not None:
                state.prompt_logprobs.update(entries)
        outputs: list[RequestOutput] = []
        for request_id, token_id in runner_output.sampled_token_ids.items():
            state = self._children.get(request_id)
            if state is None:
                continue
            completion = self._advance(state, token_id, runner_output.logprobs.get(request_id), scheduler)
            outputs.append(self._request_output(state, completion))
        return outputs

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[RequestOutput]:
        """Final outputs (``finish_reason`` = reason) for children finished outside a step (abort, error)."""
        outputs = []
        for request_id in request_ids:
            state = self._children.get(request_id)
            if state is None:
                continue
            text = state.detokenizer.get_next_output_text(finished=True, delta=True)
            completion = CompletionOutput(index=state.index, text=text, finish_reason=reason,
                                          num_output_tokens=state.request.num_output_tokens)
            self._finish(state, completion)
            outputs.append(self._request_output(state, completion))
        return outputs

    def _advance(self, state: _ChildState, token_id: int, logprob: TokenLogprob | None,
                 scheduler: Scheduler) -> CompletionOutput:
        request = state.request
        params = request.sampling_params
        stop_token = request.is_finished and isinstance(request.stop_reason, int) or (
            request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None)
        stop_str = None
        if not stop_token or params.include_stop_str_in_output:
            stop_str = state.detokenizer.update([token_id])
        if stop_str is not None:
            request.stop_reason = stop_str
            if not request.is_finished:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        finished = request.is_finished
        completion = CompletionOutput(
            index=state.index,
            text=state.detokenizer.get_next_output_text(finished=finished, delta=True),
            token_ids=[token_id],
            logprobs=[logprob] if logprob is not None else None,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        if finished:
            reason = "stop" if stop_str is not None else request.status.finish_reason
            completion.finish_reason = reason
            completion.stop_reason = request.stop_reason
            self._finish(state, completion)
        return completion

    def _finish(self, state: _ChildState, completion: CompletionOutput) -> None:
        request = state.request
        completion.stats = request.stats.to_dict(request.num_output_tokens) if request.stats else None
        completion.num_cached_tokens = max(request.num_cached_tokens, 0)
        self._children.pop(request.request_id, None)
        parent = self._parents.get(state.parent_id)
        if parent is not None:
            parent.unfinished.discard(request.request_id)

    def _request_output(self, state: _ChildState, completion: CompletionOutput) -> RequestOutput:
        parent = self._parents[state.parent_id]
        finished = not parent.unfinished
        if finished:
            self._parents.pop(state.parent_id, None)
        output = RequestOutput(request_id=state.parent_id, prompt_token_ids=parent.prompt_token_ids,
                               outputs=[completion], finished=finished,
                               num_cached_tokens=completion.num_cached_tokens)
        if state.request.sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            n = len(state.request.prompt_token_ids)
            output.prompt_logprobs = [None] + [state.prompt_logprobs.get(p) for p in range(1, n)]
            state.prompt_logprobs_sent = True
        return output
