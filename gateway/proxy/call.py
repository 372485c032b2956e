"""The upstream exchange of one admitted generation request, as an ASGI app the route handler returns.

:class:`ProxyCall` owns the client connection from here on: it watches for the client's disconnect (and then
cancels everything, closing the upstream connection at once, so the engine aborts), picks replicas
(least outstanding), retries on another replica while nothing has reached the client yet, enforces the
timeouts, and relays the answer: JSON as the upstream's exact bytes, streams through
:class:`kvscope.gateway.proxy.relay.StreamRelay`. What the relay returns (a
:class:`~kvscope.gateway.proxy.relay.RelayOutcome`) is applied to the request context here, before the
client's response ends. Errors before the response started are JSON with their status; after it started they
go in-band (``data: {"error": …}``, no ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from litestar.types import Receive, Scope, Send
from opentelemetry.trace import Span, Status, StatusCode

from kvscope.common.deadline_header import TIMEOUT_HEADER
from kvscope.common.openai_errors import CLIENT_CLOSED_REQUEST
from kvscope.gateway.auth import SERVICE_TIER_HEADER, TENANT_HEADER
from kvscope.gateway.engines.kinds import parse_kind
from kvscope.gateway.engines.reports import upstream_report
from kvscope.gateway.engines.section import stamp
from kvscope.gateway.errors import (
    GatewayError,
    RetryableFailure,
    UpstreamAnswer,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnavailable,
    error_json,
    upstream_error_code,
    upstream_error_object,
    upstream_gateway_error,
)
from kvscope.gateway.genai_attrs import base_attributes, end_attributes
from kvscope.gateway.proxy.client import BODY_CHUNK_EXTENSION, ClientResponse
from kvscope.gateway.proxy.plan import ProxyPlan
from kvscope.gateway.proxy.relay import (
    DRAIN_AFTER_DONE_S,
    DRAIN_BEFORE_END_S,
    RelayOutcome,
    StreamRelay,
    StreamTerms,
    completion_outcome,
)
from kvscope.gateway.proxy.upstreams import Replica
from kvscope.gateway.sse import data_event
from kvscope.gateway.tracing import upstream_phases

if TYPE_CHECKING:
    from kvscope.gateway.context import RequestContext, RoutingRecord
    from kvscope.gateway.state import GatewayState

_log = logging.getLogger("kvscope.gateway")
_STREAM_REASONS = {
    "upstream_timeout": "timeout",
    "stream_incomplete": "incomplete",
    "stream_aborted": "aborted",
    "upstream_disconnected": "upstream_disconnected",
}
FORWARDED_HEADERS = frozenset({b"x-kvscope-fault"})
"""Client headers passed on to the upstream as they are: our engine's fault-injection hook (honoured only by
an engine started with ``--enable-fault-injection``; docs/engine-server.md), so tests can fail a request
mid-stream through the gateway."""
SHED_CODE = "ttft_slo_exceeded"
"""The ``code`` of our engine's admission refusal (a 503 with ``Retry-After``, engine/server/scheduling.py):
the replica answered on purpose, so it is no failure of the replica (never towards its ejection) and costs
none of ``routing.max_attempts``: every other healthy replica of the model is asked, and when every one
refuses, the refusal with the shortest ``Retry-After`` goes to the client unchanged."""
RELAYED_ANSWER_HEADERS = frozenset({b"retry-after"})
RELAYED_ANSWER_PREFIXES = (b"x-ratelimit-",)
"""Headers of an upstream's non-200 answer the client gets with its body: the back-off hint of a 429/503
(``Retry-After``, e.g. the engine's ``grammar_compile_busy``) and the upstream's ``x-ratelimit-*``. The
gateway's own ``x-ratelimit-*`` (a key with limits) replace the upstream's
(gateway/ratelimit_middleware.py)."""


def relayed_answer_headers(raw: list[tuple[bytes, bytes]]) -> tuple[tuple[bytes, bytes], ...]:
    """The headers among an upstream answer's ``raw`` (name, value) pairs that the client gets too
    (:data:`RELAYED_ANSWER_HEADERS`, :data:`RELAYED_ANSWER_PREFIXES`), names lower-cased."""
    return tuple(
        (name.lower(), value)
        for name, value in raw
        if name.lower() in RELAYED_ANSWER_HEADERS or name.lower().startswith(RELAYED_ANSWER_PREFIXES)
    )


class ProxyCall:
    """ASGI app running one request against the upstream pool; see the module docstring."""

    def __init__(self, gw: GatewayState, ctx: RequestContext, plan: ProxyPlan) -> None:
        self.gw, self.ctx, self.plan = gw, ctx, plan
        self.client = ClientResponse(_never_sent)
        self.disconnected = False
        self.completed = False
        """The answer reached its end (a stream's ``[DONE]`` or terminal error event, relayed with its outcome
        applied): a client that leaves from here on is not a disconnect (:meth:`_watch_disconnect`)."""
        self.attempt_start = 0.0
        self.upstream_end: float | None = None
        self.last_token_at: float | None = None
        self.token_times: list[float] = []
        """When each token event reached the client (perf_counter s), from the relay
        (RelayOutcome.token_times)."""
        self.client_span: Span | None = None
        self.call_start = 0.0
        self.base_attrs: dict[str, Any] = {}
        self._forwarded: dict[str, str] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._forwarded = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k.lower() in FORWARDED_HEADERS
        }
        # Any: the value of our extension is a function, not the dict the ASGI types declare for one
        extensions: dict[str, Any] = scope.get("extensions") or {}
        await self._serve(receive, send, extensions.get(BODY_CHUNK_EXTENSION))

    def _count_body(self, size: int) -> None:
        self.ctx.outcome.response_bytes += size

    async def _serve(
        self, receive: Receive, send: Send, body_chunk: Callable[[bytes], bool] | None = None
    ) -> None:
        self.client = ClientResponse(send, body_chunk, self._count_body)
        task = asyncio.current_task()
        assert task is not None  # _serve runs in the request's task
        watcher = asyncio.create_task(self._watch_disconnect(receive, task))
        self.call_start = time.perf_counter()
        self.base_attrs = base_attributes(self.ctx, self.gw.settings.tracing.gen_ai_provider, self.plan.model)
        self.client_span = self.gw.tracer.start_client_span(
            self.ctx.trace.span,
            self.plan.operation,
            self.plan.model,
            {**self.base_attrs, "gen_ai.request.stream": self.plan.stream},
        )
        try:
            await self._run()
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
            task.uncancel()
            if self.completed:  # the client left inside the drain window, after the stream's end
                return
            self.ctx.outcome.mark_disconnected(self.phase())
            if not self.client.committed:
                self.ctx.outcome.status = CLIENT_CLOSED_REQUEST
        except Exception as exc:  # a bug must still end the response properly (and be logged)
            _log.exception("proxy error on request %s", self.ctx.request_id)
            if not self.client.finished:
                await self.fail(GatewayError(f"internal gateway error ({type(exc).__name__})"))
        finally:
            self.client.finished = True
            watcher.cancel()
            self._end_client_span()

    @property
    def client_caused_failure(self) -> bool:
        """The client asked the upstream to fail (``x-kvscope-fault``): its 5xx must not eject the replica."""
        return "x-kvscope-fault" in self._forwarded

    def phase(self) -> str:
        """Where the request was when the client left: ``response`` (waiting for a JSON answer),
        ``first_token`` (stream, no token yet: queued or in prefill) or ``decode``."""
        if not self.plan.stream:
            return "response"
        return "first_token" if self.ctx.answer.first_token_at is None else "decode"

    async def _watch_disconnect(self, receive: Receive, task: asyncio.Task | None) -> None:
        """Cancel the call when the client leaves before its answer ended. A client that closes once it has
        the stream's end (``data: [DONE]``) while the gateway still drains the upstream's end of body
        (DRAIN_BEFORE_END_S) has not left early: the call finishes, logged as completed."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.client.finished and not self.completed and task is not None:
                    self.disconnected = True
                    task.cancel()
                return

    # --- attempts -----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        total_s = self.gw.settings.timeouts.total_s
        deadline = self.ctx.start + (
            total_s if self.plan.timeout_s is None else min(total_s, self.plan.timeout_s)
        )
        tried: list[Replica] = []
        failure: RetryableFailure | None = None
        refusal: RetryableFailure | None = None  # the admission refusal with the shortest Retry-After
        refused_by: tuple[str, RoutingRecord | None] = ("", None)
        attempts = 0
        while attempts < self.gw.settings.routing.max_attempts:
            retry = failure is not None or refusal is not None
            decision = self.gw.pool.route(self.plan.model, self.plan.prefix, exclude=tried, retry=retry)
            if decision is None:
                break
            replica = decision.replica
            self.ctx.upstream.routing = decision.record()
            try:
                await self._attempt(replica, deadline)
                return
            except RetryableFailure as exc:
                if not exc.same_replica_ok:
                    tried.append(replica)
                if exc.shed:  # admission refused: ask every other replica before refusing the client
                    if refusal is None or exc.retry_after_s() < refusal.retry_after_s():
                        refusal, refused_by = exc, (replica.url, self.ctx.upstream.routing)
                    continue
                failure = exc
                attempts += 1
            except GatewayError as err:
                await self.fail(err)
                return
        if refusal is not None and refusal.answer is not None:
            # every replica asked refused: the refusal with the soonest retry, logged as that replica's
            self.ctx.upstream.address, self.ctx.upstream.routing = refused_by
            await self._relay_answer(refusal.answer)
            return
        if failure is not None and failure.answer is not None:
            await self._relay_answer(failure.answer)
            return
        error = (
            failure.error
            if failure
            else UpstreamUnavailable(f"No healthy upstream serves model '{self.plan.model}' right now.")
        )
        if error.status == 503:
            error.headers.setdefault("retry-after", self.gw.pool.retry_after())
        await self.fail(error)

    async def _attempt(self, replica: Replica, deadline: float) -> None:
        self.ctx.upstream.started(replica.url)
        self._stamp_arrival(replica)
        self.gw.pool.acquire(replica)
        self.attempt_start, self.upstream_end = time.perf_counter(), None
        response: httpx.Response | None = None
        headers_at: float | None = None
        try:
            response = await self._open(replica, deadline)
            headers_at = time.perf_counter()
            if response.status_code != 200:
                await self._relay_status(replica, response, deadline)
            elif self.plan.stream:
                await self._relay_stream(replica, response, deadline)
            else:
                await self._relay_json(replica, response, deadline)
        finally:
            self.gw.pool.release(replica)
            self.ctx.upstream.finish_sample = stamp(replica.engine_sample, time.monotonic())
            end = self.upstream_end or time.perf_counter()
            self.ctx.attempt_ended(self.attempt_start, headers_at, end)
            if response is not None:
                await response.aclose()

    def _stamp_arrival(self, replica: Replica) -> None:
        """The attempt's replica's kind and its latest engine sample (gateway/engines/), as the attempt
        starts (the request log's ``kvscope.upstream``)."""
        attempts = self.ctx.upstream
        attempts.kind, attempts.kind_source = replica.kind.value, replica.kind_source
        attempts.arrival_sample = stamp(replica.engine_sample, time.monotonic())
        attempts.finish_sample = None

    def _headers(self, replica: Replica, limit: float) -> dict[str, str]:
        """The upstream request's headers; ``limit`` (``time.perf_counter()`` s) is this attempt's deadline,
        sent as the seconds left in ``x-kvscope-timeout``."""
        headers = {
            **self._forwarded,
            "content-type": "application/json",
            "x-request-id": self.ctx.request_id,
            **replica.auth_headers(),
        }
        if (
            self.ctx.edge.key_id is not None
        ):  # the engine's fairness tenant (a client's own is not in _forwarded)
            headers[TENANT_HEADER] = self.ctx.edge.key_id
        if self.ctx.edge.service_tier is not None:
            headers[SERVICE_TIER_HEADER] = self.ctx.edge.service_tier
        headers[TIMEOUT_HEADER] = f"{max(limit - time.perf_counter(), 0.001):.3f}"
        if self.plan.stream:
            headers["accept"] = "text/event-stream"
        if self.client_span is not None:
            self.gw.tracer.inject(self.client_span, headers)
        return headers

    async def _open(self, replica: Replica, deadline: float) -> httpx.Response:
        """Send the request and wait for the upstream's status line (first-token/total deadline)."""
        t = self.gw.settings.timeouts
        limit = min(deadline, self.attempt_start + t.first_token_s) if self.plan.stream else deadline
        request = self.gw.http.build_request(
            "POST",
            replica.url + self.plan.path,
            content=self.plan.body,
            headers=self._headers(replica, limit),
        )
        pool = self.gw.pool
        try:
            async with asyncio.timeout(max(0.0, limit - time.perf_counter())):
                return await self.gw.http.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            pool.report_failure(replica, "connect", eject=True)
            raise RetryableFailure(
                UpstreamUnavailable(f"upstream {replica.label} is unreachable: {exc}")
            ) from None
        except TimeoutError:
            pool.report_failure(replica, "timeout", passive=False)
            raise UpstreamTimeout(f"upstream {replica.label} did not answer in time") from None
        except httpx.HTTPError as exc:  # e.g. a pooled keep-alive connection the server had closed
            pool.report_failure(replica, "disconnect")
            raise RetryableFailure(
                UpstreamFailed(f"upstream {replica.label} closed the connection: {exc!r}"),
                same_replica_ok=True,
            ) from None

    async def read_body(self, replica: Replica, response: httpx.Response, deadline: float) -> bytes:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.perf_counter())):
                body = await response.aread()
        except TimeoutError:
            self.gw.pool.report_failure(replica, "timeout", passive=False)
            raise UpstreamTimeout(f"upstream {replica.label} did not finish in time") from None
        except httpx.HTTPError as exc:
            self.gw.pool.report_failure(replica, "disconnect", eject=True)
            raise RetryableFailure(
                UpstreamFailed(f"upstream {replica.label} failed mid-response: {exc!r}")
            ) from None
        self.upstream_end = time.perf_counter()
        return body

    async def _relay_status(self, replica: Replica, response: httpx.Response, deadline: float) -> None:
        body = await self.read_body(replica, response, deadline)
        answer = UpstreamAnswer(
            response.status_code,
            response.headers.get("content-type", ""),
            body,
            relayed_answer_headers(response.headers.raw),
        )
        if response.status_code == 503 and _is_shed(answer.body):
            self.gw.pool.report_success(replica)  # it answered on purpose: overloaded, not broken
            raise RetryableFailure(
                UpstreamFailed(f"upstream {replica.label} refused: overloaded"), answer, shed=True
            )
        if response.status_code >= 500:
            # a 5xx the client asked for (our engine's fault-injection header) says nothing about the
            # replica: counted, but never towards the consecutive-5xx ejection
            self.gw.pool.report_failure(replica, "status_5xx", passive=not self.client_caused_failure)
            raise RetryableFailure(
                UpstreamFailed(f"upstream {replica.label} answered {response.status_code}"), answer
            )
        self.gw.pool.report_success(replica)
        await self._relay_answer(answer)

    async def _relay_json(self, replica: Replica, response: httpx.Response, deadline: float) -> None:
        body = await self.read_body(replica, response, deadline)
        last_byte = self.upstream_end
        self.gw.pool.report_success(replica)
        if (outcome := completion_outcome(body, self.gw.settings.logs.log_content)) is not None:
            self._take(outcome, response.headers)
        self.ctx.answer.upstream_end = last_byte
        content_type = response.headers.get("content-type", "application/json")
        await self.client.start(
            200, [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
        )
        await self.client.body(body, final=True)

    async def _relay_stream(self, replica: Replica, response: httpx.Response, deadline: float) -> None:
        """Relay the SSE stream, apply its outcome, then end the client's response (or raise the failure)."""
        t = self.gw.settings
        relay = StreamRelay(
            self.client,
            response,
            replica,
            self.gw.pool,
            StreamTerms(
                timeouts=t.timeouts,
                deadline=deadline,
                attempt_start=self.attempt_start,
                request_start=self.ctx.start,
                first_token_at=self.ctx.answer.first_token_at,
                expected_choices=self.plan.expected_choices,
                include_usage=self.plan.include_usage,
                keep_text=t.logs.log_content,
                client_fault=self.client_caused_failure,
            ),
        )
        try:
            outcome = await relay.run()
        except BaseException:  # cancelled (the client left) or a bug: log what was relayed so far
            self._take(relay.outcome(), response.headers)
            await relay.aclose()
            raise
        try:
            # the request's numbers are final before the client sees the end
            self._take(outcome, response.headers)
            if outcome.failure is not None:
                raise outcome.failure
            self.completed = (
                True  # [DONE] (or the upstream's in-band error) went out: whatever the client does now
            )
            drained = not outcome.drain or await relay.drain(DRAIN_BEFORE_END_S)
            await self.client.body(b"", final=True)
            if not drained:
                await relay.drain(DRAIN_AFTER_DONE_S)
        finally:
            await relay.aclose()

    def _take(self, outcome: RelayOutcome, headers: httpx.Headers) -> None:
        """Apply a relay's outcome to the request context (the log record, spans and metrics read it), with
        what the upstream reported about the request in its answer and ``headers``
        (gateway/engines/reports.py)."""
        ctx, answer = self.ctx, self.ctx.answer
        answer.usage, answer.engine = outcome.usage, outcome.engine
        answer.report = upstream_report(
            parse_kind(ctx.upstream.kind),
            {"usage": outcome.usage, "kvscope": outcome.engine, "timings": outcome.timings},
            headers,
        )
        answer.upstream_end = outcome.upstream_end
        answer.response_model, answer.response_id = outcome.response_model, outcome.response_id
        answer.finish_reasons = list(outcome.finish_reasons)
        answer.output_events = outcome.token_events
        answer.output_content = outcome.output_content
        if outcome.first_token_at is not None:
            answer.first_token_at = outcome.first_token_at
        self.last_token_at = outcome.last_token_at or self.last_token_at
        self.token_times = outcome.token_times or self.token_times
        self.upstream_end = outcome.upstream_end
        if (error := outcome.upstream_error) is not None:
            ctx.outcome.stream_failed(
                "upstream_error",
                upstream_error_code(error) or "upstream_error",
                str(error.get("message", "")),
            )

    async def _relay_answer(self, answer: UpstreamAnswer) -> None:
        """An upstream's non-200 answer with its status and its back-off headers
        (:data:`RELAYED_ANSWER_HEADERS`); non-JSON bodies are wrapped in an OpenAI error."""
        error, native = upstream_error_object(answer.status, answer.body)
        body = answer.body if native else msgspec.json.encode({"error": error})
        self.ctx.outcome.set_error(upstream_gateway_error(error))
        if native and (engine := _kvscope_object(answer.body)) is not None:
            self.ctx.answer.engine = engine  # an admission refusal's prediction: the log's kvscope.engine
        await self.client.start(
            answer.status,
            [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *answer.headers,
            ],
        )
        await self.client.body(body, final=True)

    # --- ending ------------------------------------------------------------------------------------------
    async def fail(self, err: GatewayError) -> None:
        """End with ``err``: a JSON error response, or in-band (SSE error event) once the stream started."""
        self.ctx.outcome.set_error(err)
        if not self.client.committed:
            body = error_json(err)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *((k.encode(), v.encode()) for k, v in err.headers.items()),
            ]
            await self.client.start(err.status, headers)
            await self.client.body(body, final=True)
            return
        self.ctx.outcome.stream_failed(_STREAM_REASONS.get(err.code or "", "upstream_error"))
        await self.client.body(data_event(err.body()))
        await self.client.body(b"", final=True)

    def _output_chunk_gaps(self) -> list[float]:
        """The stream's gaps between consecutive token chunks after the first (s): one per chunk after the
        first, as ``gen_ai.client.operation.time_per_output_chunk`` records them; empty for a non-streamed
        answer or a stream with fewer than 2 token chunks. Computed once, at the end of the call."""
        times = self.token_times
        if not self.ctx.request.stream or len(times) < 2:
            return []
        return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]

    def _end_client_span(self) -> None:
        span, ctx = self.client_span, self.ctx
        if span is None:
            return
        attrs: dict[str, Any] = {
            **end_attributes(ctx, self.call_start),
            "kvscope.attempts": ctx.upstream.attempts,
        }
        span.set_attributes(attrs)
        usage = ctx.answer.usage or {}
        self.gw.genai.record(
            {**self.base_attrs, **attrs},
            time.perf_counter() - self.call_start,
            usage.get("prompt_tokens"),
            ctx.output_tokens,
            attrs.get("gen_ai.response.time_to_first_chunk"),
            self._output_chunk_gaps() if self.gw.genai.read else (),
        )
        if "error.type" in attrs:
            span.set_status(Status(StatusCode.ERROR, ctx.outcome.error_message or ""))
        if ctx.answer.engine is None:  # our engine sends its own queue/prefill/decode spans
            first = ctx.answer.first_token_at
            phases = upstream_phases(
                self.attempt_start,
                first,
                None if first is None else (self.last_token_at or first),
                ctx.answer.upstream_end,
                ctx.answer.report,
            )
            self.gw.tracer.record_phases(span, phases, ctx.epoch_ns)
        span.end()


async def _never_sent(message: object) -> None:
    raise RuntimeError("ProxyCall: the response was written before the call was started")


def _is_shed(body: bytes) -> bool:
    """Whether a 503's body is our engine's admission refusal (``error.code`` :data:`SHED_CODE`)."""
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == SHED_CODE


def _kvscope_object(body: bytes) -> dict[str, Any] | None:
    """The ``kvscope`` object beside ``error`` in our engine's error body (its refusal's prediction), else
    None."""
    try:
        found = msgspec.json.decode(body).get("kvscope")
    except (msgspec.DecodeError, AttributeError):
        return None
    return found if isinstance(found, dict) else None
