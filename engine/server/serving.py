"""Shared request flow of chat and completions: admit → validate → run → answer (JSON or SSE).

Everything that can be rejected is rejected before the engine sees the request and before any stream starts
(400 / 404 / 429 / 503 JSON): every prompt goes through the engine's one validation
(``EngineClient.process_inputs``) before any of them is queued. A non-streaming answer races the generation
against the client's ``http.disconnect``; a streaming answer aborts when its generator is cancelled or closed.
Either way the engine request is aborted before its next step, and exactly one outcome is recorded (metrics,
spans, log).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgspec
from litestar import Request, Response

from kvscope.common.openai_errors import CLIENT_CLOSED_REQUEST
from kvscope.engine.async_engine import DeadlineExceededError, GrammarLimitError, RequestFailedError
from kvscope.engine.errors import AdmissionRefusedError, EngineDeadError, InvalidParameterError
from kvscope.engine.input_processor import EngineRequest
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.errors import OpenAIError, bad_request, from_engine, model_not_found
from kvscope.engine.server.generation import (
    DONE,
    FAULT_REASON,
    KEEPALIVE,
    ClientDisconnected,
    GenerationRun,
    Signal,
    wait_for_disconnect,
)
from kvscope.engine.server.metrics import STREAM_ERROR_REASONS
from kvscope.engine.server.request_state import Outcome, RequestState
from kvscope.engine.server.scheduling import Schedule, refusal_error, refusal_stats
from kvscope.engine.server.sse import DONE_EVENT, KEEPALIVE_EVENT, SSEResponse, data_event, error_event
from kvscope.engine.server.state import ServerState

logger = logging.getLogger(__name__)
FAULT_HEADER = "x-kvscope-fault"
TENANT_HEADER = "x-kvscope-tenant"
"""The tenant of a request (engine/core/fairness.py): the gateway sets it to the caller's API key name and
drops a client's own (gateway/auth.py TENANT_HEADER). Without it the request is its own tenant."""
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
"""A tenant name: what the gateway's key names are (1-64 of letters, digits, ``.``, ``_``, ``@``, ``-``)."""


class Formatter(Protocol):
    def add(self, k: int, output: RequestOutput) -> list[Any]: ...
    def response(self) -> Any: ...
    def usage_chunk(self) -> Any: ...


@dataclass(slots=True)
class Job:
    state: ServerState
    request: Request
    rs: RequestState
    run: GenerationRun


def server_state(request: Request) -> ServerState:
    return request.app.state.server


def check_model(state: ServerState, name: str | None) -> None:
    """404 ``model_not_found`` unless ``name`` is the served model (None: the served model)."""
    if name is not None and name != state.model_name:
        raise model_not_found(name)


def admit(state: ServerState) -> None:
    """503 while starting/stopping or after the engine died; 429 above ``max_concurrent_requests``."""
    if state.draining or not state.engine.is_running:
        raise OpenAIError(
            503,
            "The engine is not running (starting up, shutting down or failed).",
            code="engine_unavailable",
            headers={"Retry-After": "1"},
        )
    limit = state.settings.max_concurrent_requests
    if limit and state.in_flight >= limit:
        raise OpenAIError(
            429,
            f"Too many requests in flight (limit {limit}); retry later.",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )


def check_fan_out(state: ServerState, num_prompts: int, n: int, prompt_param: str = "prompt") -> None:
    """400 when one request asks for more sequences (``num_prompts`` x ``n``) than
    ``--max-sequences-per-request`` (ServerSettings.max_sequences_per_request), before anything is
    tokenized further or queued: ``param`` is ``prompt_param`` when the prompts alone exceed the limit,
    else ``n``. Raises OpenAIError."""
    limit = state.settings.max_sequences_per_request
    total = num_prompts * n
    if total <= limit:
        return
    raise bad_request(
        f"This request asks for {total} sequences ({num_prompts} prompt(s) x n={n}); the limit is "
        f"{limit} sequences per request (--max-sequences-per-request). Send fewer prompts or a "
        "smaller n, or split the request.",
        param=prompt_param if num_prompts > limit else "n",
    )


def process_prompts(
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    prompt_param: str,
    compile_wait_s: float | None = None,
) -> list[EngineRequest]:
    """Every prompt through the engine's validation (empty prompt, token ids, context length), or the 400
    of the first one that fails, naming the request's own fields; first the fan-out limit
    (:func:`check_fan_out`). ``compile_wait_s``: the seconds the request waited for its grammar
    (:func:`~kvscope.engine.server.structured.prepare_constraint`), each prompt's ``structured_compile_s``
    (the engine's own check finds the grammar pinned and would say 0)."""
    check_fan_out(state, len(prompts), params.n, prompt_param)
    try:
        requests = [state.engine.process_inputs(prompt, params) for prompt in prompts]
    except InvalidParameterError as exc:
        raise from_engine(exc, prompt_param=prompt_param, renames={"prompt": prompt_param}) from exc
    if compile_wait_s is None:
        return requests
    return [replace(r, structured_compile_s=compile_wait_s) for r in requests]


def start_job(
    state: ServerState,
    request: Request,
    operation: str,
    requests: list[EngineRequest],
    stream: bool,
    schedule: Schedule | None = None,
) -> Job:
    """Queue the engine requests of one HTTP request (all validated by :func:`process_prompts`), as one
    fairness group of the scheduler (EngineRequest.fairness_group = the response id;
    engine/core/fairness.py) of the tenant :func:`tenant_of` names, in the tier, priority and deadline of
    ``schedule`` (engine/server/scheduling.py; None: the defaults). Raises OpenAIError (400) for a
    malformed tenant header, before queueing. With admission on, await :func:`admit_job` before
    answering."""
    schedule = schedule or Schedule()
    tenant = tenant_of(request)
    prefix = "chatcmpl" if operation == "chat" else "cmpl"
    prompts = [r.prompt_token_ids for r in requests]
    rs = RequestState(
        f"{prefix}-{uuid.uuid4().hex}",
        operation,
        state.model_name,
        requests[0].params,
        prompts,
        stream,
        state.metrics,
        service_tier=schedule.service_tier,
        shown_service_tier=schedule.service_tier if schedule.named else None,
        structured_compile_s=requests[0].structured_compile_s,
    )
    requests = [
        replace(
            r,
            fairness_group=rs.request_id,
            fairness_tenant=tenant,
            service_tier=schedule.service_tier,
            priority=schedule.priority,
            deadline=schedule.deadline,
        )
        for r in requests
    ]
    rs.timeline.parent = state.tracing.extract(request.headers)
    run = GenerationRun(
        state.engine,
        rs.request_id,
        requests,
        rs.arrival,
        rs.timeline,
        fault_after_tokens=_fault_after(state, request),
        wait_queued=state.engine.admission.enabled,
    )
    run.start()
    state.in_flight += 1
    return Job(state, request, rs, run)


async def admit_job(job: Job) -> None:
    """With admission on (``--ttft-slo``), wait until the engine queued the job's requests: when it refused
    one (its predicted TTFT over its tier's objective), record the outcome (log fields with the prediction,
    ``kvscope_engine_requests_shed_total{reason="ttft_slo"}``), abort the others and raise the 503
    (engine/server/scheduling.py ``refusal_error``) before any response starts. No-op with admission off."""
    try:
        await job.run.queued()
    except AdmissionRefusedError as exc:
        error = refusal_error(exc.refusal)
        _count_shed(job, exc)
        finish_job(job, Outcome("error", error.status, error.type, error.message, phase="queued"))
        job.run.close()
        raise error from None


HOLD_GRACE_S = 1.0
"""How long past its tier's objective a stream's 200 still waits for the first output (:func:`first_output`):
the engine drops an overdue request at the start of the first step after its last moment, which comes no later
than the objective, so a step of up to this long still ends in the 503."""


def holds_headers(job: Job) -> bool:
    """Whether a stream's 200 waits for its first output (:func:`first_output`): with admission on, for a
    tier with an objective, which admission may still drop from the queue with a 503 (engine/core/
    admission.py); the wait is bounded by that objective (plus :data:`HOLD_GRACE_S`)."""
    admission = job.state.engine.admission
    return admission.enabled and job.rs.service_tier in admission.ttft_slo_s


async def first_output(job: Job) -> tuple[int, RequestOutput] | Signal | None:
    """Wait for the job's first output before a stream's 200 (:func:`holds_headers`), so that a request
    admission drops from the queue gets its 503 with Retry-After, as a refusal at admission does, and not an
    error event inside a 200. Returns the output (or DONE) for :func:`respond_stream` to send first, or
    KEEPALIVE once the tier's objective and :data:`HOLD_GRACE_S` have passed since the request's arrival
    without one (a request admission no longer drops, such as one preempted after its first chunk: the 200
    goes out with a keep-alive, and the stream goes on as any other); None when the client left meanwhile
    (the job is finished and closed). Raises the OpenAIError of a failure (:func:`failure_error`), the job
    finished and closed."""
    watcher = asyncio.ensure_future(wait_for_disconnect(job.request.receive))
    objective = job.state.engine.admission.ttft_slo_s[job.rs.service_tier]
    hold_s = max(job.rs.arrival + objective + HOLD_GRACE_S - time.monotonic(), 0.0)
    try:
        return await job.run.next(hold_s, watcher)
    except ClientDisconnected:
        finish_job(job, Outcome("client_disconnected", CLIENT_CLOSED_REQUEST, phase=job.run.phase()))
        job.run.close()
        return None
    except Exception as exc:  # noqa: BLE001 - answered as OpenAI error JSON
        error = failure_error(exc, job.rs.params)
        _count_shed(job, exc)
        finish_job(job, Outcome("error", error.status, error.type, error.message, phase=job.run.phase()))
        job.run.close()
        raise error from exc
    except asyncio.CancelledError:
        finish_job(job, Outcome("client_disconnected", CLIENT_CLOSED_REQUEST, phase=job.run.phase()))
        job.run.close()
        raise
    finally:
        watcher.cancel()


def tenant_of(request: Request) -> str | None:
    """The request's tenant for the scheduler's fairness: the ``x-kvscope-tenant`` header (the gateway's
    API key name), None without one. The body's ``user`` field is never used: the client picks it. The
    engine trusts the header from whoever reaches it, so only the gateway should (the engine's
    ``--api-key``). Raises OpenAIError (400, ``param`` the header) when it is not 1-64 of letters, digits,
    ``.``, ``_``, ``@``, ``-``."""
    value = request.headers.get(TENANT_HEADER)
    if value is None:
        return None
    if not TENANT_NAME.fullmatch(value):
        raise bad_request(
            f"{TENANT_HEADER} must be 1-64 of letters, digits, '.', '_', '@', '-' (starting with a "
            "letter or digit), as the gateway's API key names.",
            param=TENANT_HEADER,
        )
    return value


def _fault_after(state: ServerState, request: Request) -> int | None:
    """``x-kvscope-fault: after_tokens=N`` (only with --enable-fault-injection): fail the request after N
    output tokens as if the engine had failed it (AsyncEngine.abort(reason="injected fault"))."""
    value = request.headers.get(FAULT_HEADER)
    if not state.settings.enable_fault_injection or not value:
        return None
    key, _, number = value.partition("=")
    if key.strip() != "after_tokens" or not number.strip().isdigit():
        raise OpenAIError(400, f"{FAULT_HEADER} must be 'after_tokens=N', got {value!r}.", param=FAULT_HEADER)
    return int(number)


def finish_job(job: Job, outcome: Outcome) -> None:
    """Record the outcome once (metrics, spans, log fields); take live engine stats for unfinished choices."""
    if job.rs.finished:
        return
    snapshots = job.run.snapshots() if outcome.kind != "success" else None
    access = job.request.scope.get("kvscope.access")
    if outcome.error_type is not None and access is not None:
        access.set_error(outcome.error_type, outcome.error_message or "")
    job.rs.finish(outcome, job.state.tracing, access, snapshots)
    job.state.in_flight -= 1


def failure_error(exc: BaseException, params: SamplingParams | None = None) -> OpenAIError:
    """What a request the engine failed answers: 400 naming the constraint's field when its grammar
    exceeded the matcher's limits while generating (``params`` is the request's SamplingParams: the
    client's grammar, not an engine fault, so never a 5xx that would eject a healthy replica), 503 for
    shutdown / dead engine, else 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, GrammarLimitError):
        constraint = params.structured_outputs if params is not None else None
        kind, param = (constraint.kind, constraint.param) if constraint is not None else ("structured", None)
        return bad_request(
            f"The {kind} constraint exceeded the grammar matcher's limits while generating: {exc.detail}",
            param=param,
        )
    if isinstance(exc, AdmissionRefusedError):
        return refusal_error(exc.refusal)
    if isinstance(exc, DeadlineExceededError):
        return OpenAIError(
            504,
            "The request's deadline (x-kvscope-timeout) passed while it waited for its first admission; it "
            "was dropped before its prefill.",
            code="deadline_exceeded",
        )
    if isinstance(exc, RequestFailedError):
        status = 503 if "shutting down" in exc.reason else 500
        return OpenAIError(
            status,
            f"The engine failed the request: {exc.reason}",
            code="engine_shutdown" if status == 503 else "request_failed",
        )
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), code="engine_unavailable")
    logger.exception("request failed", exc_info=exc)
    return OpenAIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error")


def _count_shed(job: Job, exc: BaseException) -> None:
    """A request refused by admission, or dropped from the engine's queue by admission or by its deadline,
    counts as shed (``kvscope_engine_requests_shed_total``, reason ``ttft_slo``, ``ttft_slo_queued`` or
    ``deadline``); a refusal's figures become the request's ``kvscope`` object."""
    if isinstance(exc, AdmissionRefusedError):
        job.rs.refused = refusal_stats(exc.refusal)
        job.state.metrics.on_shed(exc.refusal.tier, exc.refusal.reason)
    elif isinstance(exc, DeadlineExceededError):
        job.state.metrics.on_shed(job.rs.service_tier, "deadline")


def stream_error_reason(exc: BaseException, error: OpenAIError) -> str | None:
    """The ``reason`` label (kvscope.engine.server.metrics.STREAM_ERROR_REASONS) of a stream that ``exc``
    broke after its 200, ``error`` being :func:`failure_error` of it: None for the client's own error (a
    4xx such as ``invalid_request_error``: not the engine's failure), ``injected_fault`` for
    ``x-kvscope-fault``, else the error's code when it is a known reason, else ``internal_error``."""
    if error.status < 500 or isinstance(exc, (DeadlineExceededError, AdmissionRefusedError)):  # a shed
        return None
    if isinstance(exc, RequestFailedError) and exc.reason == FAULT_REASON:
        return "injected_fault"
    return error.code if error.code in STREAM_ERROR_REASONS else "internal_error"


async def respond_json(job: Job, formatter: Formatter) -> Response:
    """Collect the whole generation; abort it if the client disconnects first."""
    watcher = asyncio.ensure_future(wait_for_disconnect(job.request.receive))
    try:
        while (item := await job.run.next(None, watcher)) is not DONE:
            formatter.add(*item)
        check_complete(job)
    except ClientDisconnected:
        finish_job(job, Outcome("client_disconnected", CLIENT_CLOSED_REQUEST, phase=job.run.phase()))
        access = job.request.scope.get("kvscope.access")
        if access is not None:
            access.status_override = CLIENT_CLOSED_REQUEST
        return Response(content=b"", status_code=CLIENT_CLOSED_REQUEST)
    except Exception as exc:  # noqa: BLE001 - answered as OpenAI error JSON
        error = failure_error(exc, job.rs.params)
        _count_shed(job, exc)
        finish_job(job, Outcome("error", error.status, error.type, error.message, phase=job.run.phase()))
        raise error from exc
    except asyncio.CancelledError:
        finish_job(job, Outcome("client_disconnected", CLIENT_CLOSED_REQUEST, phase=job.run.phase()))
        raise
    finally:
        watcher.cancel()
        job.run.close()
    body = formatter.response()
    finish_job(job, Outcome("success"))
    return Response(content=msgspec.json.encode(body), status_code=200, media_type="application/json")


def respond_stream(
    job: Job,
    formatter: Formatter,
    include_usage: bool,
    first: tuple[int, RequestOutput] | Signal | None = None,
) -> SSEResponse:
    """The SSE response of a stream; ``first``: its first output, already taken (:func:`first_output`)."""
    return SSEResponse(_events(job, formatter, include_usage, first), on_close=lambda: _abandon(job))


def _abandon(job: Job) -> None:
    """After the response: a job still open was never streamed (the client left first)."""
    finish_job(job, Outcome("client_disconnected", phase=job.run.phase()))
    job.run.close()


def check_complete(job: Job) -> None:
    """Every choice must have ended with stop/length; anything else is a failure, never a success."""
    for choice in job.rs.choices:
        if choice.finish_reason not in ("stop", "length"):
            raise RequestFailedError(
                job.rs.request_id,
                f"choice {choice.index} ended without a terminal chunk ({choice.finish_reason})",
            )


async def _events(
    job: Job, formatter: Formatter, include_usage: bool, first: tuple[int, RequestOutput] | Signal | None
):
    keepalive_s = job.state.settings.sse_keepalive_s
    outcome: Outcome | None = None
    try:
        while (item := first or await job.run.next(keepalive_s)) is not DONE:
            first = None
            if item is KEEPALIVE:
                yield KEEPALIVE_EVENT
                continue
            for chunk in formatter.add(*item):
                yield data_event(chunk)
        check_complete(job)
        if include_usage:
            yield data_event(formatter.usage_chunk())
        outcome = Outcome("success")
        yield DONE_EVENT
    except (asyncio.CancelledError, GeneratorExit):
        outcome = outcome or Outcome("client_disconnected", phase=job.run.phase())
        raise
    except Exception as exc:  # noqa: BLE001 - after the 200 errors go in-band
        error = failure_error(exc, job.rs.params)
        _count_shed(job, exc)
        outcome = Outcome("error", 200, error.type, error.message, phase=job.run.phase())
        if (reason := stream_error_reason(exc, error)) is not None:  # the availability SLO counts it
            job.state.metrics.on_stream_error(reason)
        yield error_event(error.message, error.type, str(error.code) if error.code else None, error.param)
    finally:
        finish_job(job, outcome or Outcome("client_disconnected", phase=job.run.phase()))
        job.run.close()
