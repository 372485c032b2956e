"""Turn each step's sampled tokens into RequestOutputs: detokenize, match stop strings, attach logprobs/stats.

Two calls per step, with the scheduler in between (EngineCore.step orchestrates; this module never calls the
scheduler): :meth:`OutputProcessor.detokenize` advances the detokenizers and reports which requests matched a
stop string; the engine finishes those in the scheduler; :meth:`OutputProcessor.make_outputs` then builds the
RequestOutputs, with final stats for every request the step finished. vLLM v1's OutputProcessor likewise
returns ``reqs_to_abort`` to the engine core instead of aborting them itself.

Requests with ``n > 1`` run as sibling (child) requests ``{parent}-{i}`` (vLLM v1 parallel sampling); this
module maps children back to their parent and choice index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.engine.core.request import Request, RequestStatus
from kvscope.engine.core.scheduler_output import ModelRunnerOutput
from kvscope.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvscope.engine.text.detokenizer import IncrementalDetokenizer, StopStrings
from kvscope.engine.text.tokenizer import Tokenizer


@dataclass(slots=True)
class _ChildState:
    parent_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


@dataclass(slots=True)
class _Advanced:
    """One step's emitted tokens of a request after detokenization, waiting for
    :meth:`OutputProcessor.make_outputs` (cut after the token that completed a stop string)."""

    state: _ChildState
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    stop_str: str | None


@dataclass(slots=True)
class DetokenizedStep:
    """What :meth:`OutputProcessor.detokenize` found in one step."""

    advanced: list[_Advanced] = field(default_factory=list)
    stopped_request_ids: list[str] = field(default_factory=list)
    """Still-unfinished (child) requests whose output matched a stop string: the engine finishes them with
    FINISHED_STOPPED before :meth:`OutputProcessor.make_outputs`."""
    num_output_tokens: dict[str, int] = field(default_factory=dict)
    """For each of those, the output tokens it keeps (the stop string may end inside a run of accepted draft
    tokens: the tokens after it are dropped, here and in the scheduler)."""


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
        self._parents[parent_id] = _ParentState(
            children[0].prompt_token_ids, {c.request_id for c in children}
        )
        stops = StopStrings.compile(
            children[0].sampling_params.stop
        )  # once per request: the children share it
        for index, child in enumerate(children):
            detok = IncrementalDetokenizer(
                self.tokenizer, child.prompt_token_ids, child.sampling_params, stops
            )
            self._children[child.request_id] = _ChildState(parent_id, index, child, detok)

    def request_ids(self) -> list[str]:
        """Parent request ids still in flight."""
        return list(self._parents)

    def child_ids(self, parent_id: str) -> list[str]:
        """Request ids of the parent's children that are still tracked."""
        return [cid for cid, st in self._children.items() if st.parent_id == parent_id]

    def detokenize(self, runner_output: ModelRunnerOutput) -> DetokenizedStep:
        """Advance the detokenizer of every request that produced a token this step (call it after the
        scheduler's ``update_from_output``, so a stop-token finish is known) and collect stop-string
        matches."""
        for request_id, entries in runner_output.prompt_logprobs.items():
            state = self._children.get(request_id)
            if state is not None:
                state.prompt_logprobs.update(entries)
        step = DetokenizedStep()
        for request_id, token_ids in runner_output.sampled_token_ids.items():
            state = self._children.get(request_id)
            if state is None or not token_ids:
                continue
            stop_str = None
            for kept, token_id in enumerate(token_ids, start=1):
                stop_str = self._detokenize(state, token_id, last=kept == len(token_ids))
                if stop_str is not None:
                    break
            logprobs = runner_output.logprobs.get(request_id)
            step.advanced.append(
                _Advanced(state, token_ids[:kept], None if logprobs is None else logprobs[:kept], stop_str)
            )
            if stop_str is not None and kept < len(token_ids):
                step.num_output_tokens[request_id] = state.request.num_output_tokens - (len(token_ids) - kept)
                if (
                    state.request.is_finished
                ):  # by a later stop in the same run: the scheduler is done with it
                    state.request.truncate_output(step.num_output_tokens[request_id])
            if stop_str is not None and not state.request.is_finished:
                step.stopped_request_ids.append(request_id)
        return step

    def make_outputs(self, step: DetokenizedStep) -> list[RequestOutput]:
        """The RequestOutputs of a detokenized step, once the engine has finished its stop-string matches."""
        outputs = []
        for item in step.advanced:
            completion = self._completion(item)
            outputs.append(self._request_output(item.state, completion))
        return outputs

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[RequestOutput]:
        """Final outputs (``finish_reason`` = reason) for children finished outside a step (abort, error)."""
        outputs = []
        for request_id in request_ids:
            state = self._children.get(request_id)
            if state is None:
                continue
            text = state.detokenizer.get_next_output_text(finished=True, delta=True)
            completion = CompletionOutput(
                index=state.index,
                text=text,
                finish_reason=reason,
                num_output_tokens=state.request.num_output_tokens,
            )
            self._finish(state, completion)
            outputs.append(self._request_output(state, completion))
        return outputs

    def _detokenize(self, state: _ChildState, token_id: int, last: bool = True) -> str | None:
        """Feed ``token_id`` to the request's detokenizer unless it is the stop token that ended the request
        (only the ``last`` token of a step can be; its text is not output, unless include_stop_str_in_output);
        returns the stop string it completed."""
        request = state.request
        stop_token = last and (
            request.is_finished
            and isinstance(request.stop_reason, int)
            or (request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None)
        )
        stop_str = None
        if not stop_token or request.sampling_params.include_stop_str_in_output:
            stop_str = state.detokenizer.update([token_id])
        if stop_str is not None:
            request.stop_reason = stop_str
        return stop_str

    def _completion(self, item: _Advanced) -> CompletionOutput:
        state, request = item.state, item.state.request
        finished = request.is_finished
        completion = CompletionOutput(
            index=state.index,
            text=state.detokenizer.get_next_output_text(finished=finished, delta=True),
            token_ids=list(item.token_ids),
            logprobs=item.logprobs,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        if finished:
            reason = "stop" if item.stop_str is not None else request.status.finish_reason
            completion.finish_reason = reason
            completion.stop_reason = request.stop_reason
            self._finish(state, completion)
        return completion

    def _finish(self, state: _ChildState, completion: CompletionOutput) -> None:
        request = state.request
        completion.stats = request.stats.summary(request.num_output_tokens) if request.stats else None
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
        output = RequestOutput(
            request_id=state.parent_id,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=completion.num_cached_tokens,
        )
        if state.request.sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            n = len(state.request.prompt_token_ids)
            output.prompt_logprobs = [None] + [state.prompt_logprobs.get(p) for p in range(1, n)]
            state.prompt_logprobs_sent = True
        return output
