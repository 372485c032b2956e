"""Request fields → one :class:`StructuredOutputsParams` (or None): OpenAI ``response_format``, vLLM's
``structured_outputs`` and legacy ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``.

At most one constraint per request (400 naming the second field otherwise). Whether the schema/grammar is
supported is decided by the engine's grammar compiler (engine/structured/backend.py): an unsupported
JSON-schema keyword is a 400 naming the keyword, never a silently unconstrained answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from kvscope.engine.errors import InvalidParameterError
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.errors import OpenAIError, bad_request, from_engine
from kvscope.engine.server.protocol import StructuredFields
from kvscope.engine.server.scheduling import Schedule
from kvscope.engine.server.state import ServerState
from kvscope.engine.structured.backend import CompileBusyError
from kvscope.engine.structured.params import StructuredOutputsParams


async def prepare_constraint(state: ServerState, params: SamplingParams, schedule: Schedule) -> float | None:
    """Compile the request's constraint on the grammar compiler's own thread (a cached grammar answers at
    once; the first compile also builds the grammar tokenizer, about a second), pin it to the request, count
    it by kind and observe its compile time. Nothing of it runs on asyncio's default executor, so requests
    without a constraint never wait for a compile. Returns the seconds the request waited for its grammar
    (0.0: pinned or cached; its ``structured_compile_s``), None without a constraint. The ``schedule``'s
    deadline (``x-kvscope-timeout``; None: none) bounds the wait: past it the request is
    answered 504 ``deadline_exceeded`` at once (counted as shed in its tier for ``deadline``), never queued,
    and the compile goes on for the other requests of the same grammar.

    Raises OpenAIError 400 naming the field (``response_format``, ``tools``, ``structured_outputs``,
    ``guided_*``) for an unsupported schema keyword, an invalid regex/grammar, a grammar above the size
    limit or one the matcher cannot serve; 429 (``Retry-After: 1``) when the compile queue is full: the
    server is busy, the schema is not wrong, and a 5xx would count against a healthy replica in the
    gateway."""
    constraint = params.structured_outputs
    if constraint is None:
        return None
    left = None if schedule.deadline is None else max(schedule.deadline - time.monotonic(), 0.0)
    try:
        got = await asyncio.wait_for(state.engine.structured.acquire_async(constraint), left)
    except TimeoutError:
        state.metrics.on_shed(schedule.service_tier, "deadline")
        raise OpenAIError(
            504,
            "The request's deadline (x-kvscope-timeout) passed while it waited for its grammar to compile; "
            "it was not queued.",
            code="deadline_exceeded",
        ) from None
    except InvalidParameterError as exc:
        raise from_engine(exc) from exc
    except CompileBusyError as exc:
        raise OpenAIError(
            429,
            f"Too many new grammars are compiling: {exc}",
            code="grammar_compile_busy",
            headers={"Retry-After": "1"},
        ) from exc
    metrics, model = state.metrics.engine, state.metrics.model
    metrics.structured_output_requests.labels(model=model, kind=constraint.kind).inc()
    if got.compile_s > 0:
        metrics.structured_output_compile_time.labels(model=model).observe(got.compile_s)
    return got.wait_s


def structured_params(req: StructuredFields) -> StructuredOutputsParams | None:
    """The single constraint a request asks for. Raises OpenAIError 400 for two constraints at once, a
    ``json_schema`` response_format without a schema, or a non-object/ill-formed JSON schema string."""
    found = [c for c in (_response_format(req), *_vllm_fields(req)) if c is not None]
    if len(found) > 1:
        raise bad_request(
            f"Only one structured-output constraint per request; got {found[0].param} and {found[1].param}.",
            param=found[1].param,
        )
    return found[0] if found else None


def _response_format(req: StructuredFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams("json_object", "", "response_format")
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema.", param="response_format"
        )
    return StructuredOutputsParams.json_schema(fmt.json_schema.schema, "response_format")


def _vllm_fields(req: StructuredFields) -> list[StructuredOutputsParams | None]:
    so = req.structured_outputs
    found = []
    if so is not None:
        found += [
            _json(so.json, "structured_outputs"),
            _text("regex", so.regex, "structured_outputs"),
            _choice(so.choice, "structured_outputs"),
            _text("grammar", so.grammar, "structured_outputs"),
            StructuredOutputsParams("json_object", "", "structured_outputs") if so.json_object else None,
        ]
    found += [
        _json(req.guided_json, "guided_json"),
        _text("regex", req.guided_regex, "guided_regex"),
        _choice(req.guided_choice, "guided_choice"),
        _text("grammar", req.guided_grammar, "guided_grammar"),
    ]
    return found


def _json(schema: dict[str, Any] | str | None, param: str) -> StructuredOutputsParams | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param=param) from exc
        if not isinstance(schema, dict | bool):
            raise bad_request(f"{param} must be a JSON schema object.", param=param)
    return StructuredOutputsParams.json_schema(schema, param)


def _text(kind: Literal["regex", "grammar"], value: str | None, param: str) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not value:
        raise bad_request(f"{param}: the {kind} is empty.", param=param)
    return StructuredOutputsParams(kind, value, param)


def _choice(options: list[str] | None, param: str) -> StructuredOutputsParams | None:
    if options is None:
        return None
    if not options or not all(options):
        raise bad_request(f"{param} needs at least one non-empty choice.", param=param)
    return StructuredOutputsParams.choice(options, param)
