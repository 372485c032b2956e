"""The routes' guards run in their declared order: the method (405) before the key (401), the pass-through's
path (404) before the key, and a generation request refused for its key is logged with its operation."""

from __future__ import annotations

import httpx
import pytest

from kvscope.testing.harness import records_by_id
from tests.gateway.conftest import Stack


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "operation"),
    [
        ("GET", "/v1/chat/completions", 405, "method_not_allowed", None),
        ("POST", "/v1/chat/completions", 401, "invalid_api_key", "chat"),
        ("POST", "/v1/completions", 401, "invalid_api_key", "text_completion"),
        ("POST", "/v1/models", 405, "method_not_allowed", None),
        ("GET", "/v1/models", 401, "invalid_api_key", None),
        ("GET", "/v1/models/fake-model", 401, "invalid_api_key", None),
        ("POST", "/v1/Chat/Completions", 404, "not_found", None),
        ("POST", "/v1/embeddings", 401, "invalid_api_key", None),
    ],
)
def test_guard_order_without_a_key(
    stack: Stack, method: str, path: str, status: int, code: str, operation: str | None
) -> None:
    rid = f"guard-{method}-{path.replace('/', '_')}"
    resp = httpx.request(
        method,
        stack.url + path,
        json={"model": "fake-model", "prompt": "hi"},
        headers={"x-request-id": rid},
        timeout=10,
    )
    assert (resp.status_code, resp.json()["error"]["code"]) == (status, code)
    record = records_by_id(stack.log, [rid])[rid][0]
    assert record["gen_ai"]["operation"]["name"] == operation


async def test_in_order_runs_the_guards_in_turn_and_stops_at_the_first_refusal() -> None:
    """gateway/guards.py in_order: the guards see the same handler, in order; a refusal ends the run. Every
    route lists one such guard, so Litestar copies its handler once a request, not once a guard."""
    from kvscope.gateway import routes
    from kvscope.gateway.guards import in_order

    seen: list[tuple[str, object]] = []

    def guard(name: str, refuse: bool = False):
        async def run(connection, handler) -> None:
            seen.append((name, handler))
            if refuse:
                raise PermissionError(name)

        return run

    handler = object()
    await in_order(guard("a"), guard("b"))(None, handler)
    with pytest.raises(PermissionError, match="c"):
        await in_order(guard("c", refuse=True), guard("d"))(None, handler)
    assert seen == [("a", handler), ("b", handler), ("c", handler)]
    handlers = [
        routes.chat_completions,
        routes.completions,
        routes.list_models,
        routes.retrieve_model,
        routes.other_v1,
    ]
    assert [len(h.guards or ()) for h in handlers] == [1] * len(handlers)
