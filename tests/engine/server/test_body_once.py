"""Each request body is decoded once: StrictBody (engine/server/routes.py) decodes the bytes straight into the
request Struct; Litestar's own JSON decoding never runs."""

from __future__ import annotations

import msgspec
from litestar import Request

from kvscope.engine.server import routes
from tests.engine.server.conftest import chat_body


def test_each_body_is_decoded_once(client, monkeypatch) -> None:
    decoded: list[str] = []
    decode_body = routes.decode_body

    def counting(body: bytes, request_type: type) -> object:
        decoded.append(request_type.__name__)
        return decode_body(body, request_type)

    async def litestar_json(self) -> None:
        raise AssertionError("the body was decoded a second time")

    monkeypatch.setattr(routes, "decode_body", counting)
    monkeypatch.setattr(Request, "json", litestar_json)
    completion = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200
    assert client.post("/v1/completions", json=completion).status_code == 200
    assert client.post("/tokenize", json={"prompt": "hi"}).json()["count"] == 2
    assert client.post("/detokenize", content=msgspec.json.encode({"tokens": [104]})).json() == {
        "prompt": "h"
    }
    assert decoded == ["ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest"]


def test_an_empty_body_is_invalid_json(client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        response = client.post(path, content=b"")
        assert (response.status_code, response.json()["error"]) == (
            400,
            {
                "message": "The request body is not valid JSON: Input data was truncated",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_json",
            },
        )
