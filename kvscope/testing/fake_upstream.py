"""A fake OpenAI-compatible upstream for gateway tests: raw asyncio HTTP/1.1 (keep-alive, chunked SSE), run
in-process (:class:`FakeUpstream`) or as a subprocess (``python -m kvscope.testing.fake_upstream --port P``).

Output is deterministic: completion token ``i`` of choice ``c`` is ``"t{i} "`` (choice 0) / ``"c{c}t{i} "``;
``max_tokens`` tokens (default 8; with ``ignore_eos``, up to the context: ``max_model_len`` − prompt words)
then finish_reason ``length`` (``stop`` when max_tokens is absent). ``prompt_tokens`` = whitespace-separated
words of the prompt / message contents.

Knobs (server defaults via :class:`Knobs`/CLI flags, per request via a ``"fake": {...}`` body field, which the
gateway forwards untouched): ``token_delay_s``, ``first_token_delay_s``, ``status`` (answer every request with
this status and an OpenAI error; ``error_code`` its code, ``error_headers`` its extra headers as
``"Name: value, Name: value"``), ``die_after_tokens`` (abort the TCP connection mid-stream),
``error_after_tokens`` (in-band error event), ``omit_finish`` (end without finish_reason/[DONE]),
``rechunk_seed`` (split the SSE bytes into random HTTP chunks), ``crlf`` (CRLF line endings),
``kvscope_stats`` (add the engine's ``kvscope`` stats object), ``headers_delay_s``, ``finish_reason``,
``end_delay_s`` (a stream's body ends this long after its ``[DONE]``),
``hold`` (a gate name: token ``i`` is written only once the test released ``"{hold}/{i}"``, and a
non-streaming answer waits for ``"{hold}/0"``; a test proves ordering with it instead of with a clock).

Gates: :meth:`FakeUpstream.release` (thread-safe, for in-process fakes) or ``POST /_fake/release`` with
``{"name": ...}``; a gate may be released before anyone waits on it. A wait ends early if the client left.

Records every request (headers incl. traceparent/x-request-id, body, arrival, the SSE bytes sent, and the
monotonic time the client disconnected, if it did): ``GET /_fake/requests``; ``POST /_fake/reset``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import msgspec


@dataclass(frozen=True)
class Knobs:
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    headers_delay_s: float = 0.0
    status: int = 200
    error_code: str = ""
    """``error.code`` of the ``status`` answer (empty: null)."""
    error_headers: str = ""
    """Extra headers of the ``status`` answer, ``"Retry-After: 1, x-ratelimit-remaining-requests: 0"``."""
    die_after_tokens: int = -1
    error_after_tokens: int = -1
    omit_finish: bool = False
    rechunk_seed: int = -1
    crlf: bool = False
    kvscope_stats: bool = False
    finish_reason: str = ""
    """Override the finish_reason (e.g. ``abort``)."""
    cached_tokens: int = 0
    """``usage.prompt_tokens_details.cached_tokens`` to report (a prefix-cache hit)."""
    end_delay_s: float = 0.0
    """Seconds between a stream's ``[DONE]`` and the end of its chunked body (the zero chunk)."""
    hold: str = ""
    """Gate prefix: token ``i`` waits for ``"{hold}/{i}"`` to be released (empty: no gates)."""

    def merged(self, overrides: dict[str, Any] | None) -> Knobs:
        names = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in (overrides or {}).items() if k in names})


ENGINE_STATS = {
    "queue_s": 0.001,
    "ttft_s": 0.002,
    "prefill_s": 0.001,
    "decode_s": 0.01,
    "tpot_s": 0.001,
    "batch_size_mean": 1.0,
    "batch_size_max": 1,
    "kv_blocks": 2,
    "kv_cache_usage": 0.01,
    "num_preemptions": 0,
    "spec_drafts": 4,
    "spec_draft_tokens": 12,
    "spec_accepted_tokens": 6,
    "spec_mean_accepted_length": 2.5,
}


@dataclass
class Record:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    arrived: float
    disconnected_at: float | None = None
    completed: bool = False
    sse: str = ""
    """The SSE bytes written (latin-1 decoded), for byte-exact comparisons."""


@dataclass
class FakeUpstream:
    models: tuple[str, ...] = ("fake-model",)
    max_model_len: int = 2048
    knobs: Knobs = Knobs()
    records: list[Record] = field(default_factory=list)
    port: int = 0
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    connections: int = 0
    """TCP connections accepted so far (keep-alive reuse shows as fewer connections than requests)."""
    card_kvscope: dict[str, Any] | None = None
    """The ``kvscope`` field of its /v1/models cards (``block_size``, ``num_gpu_blocks``, ``instance_id`` as
    our engine reports them); None: none, as other servers."""
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeUpstream:
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._connection, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    async def kill(self) -> None:
        """Go away as a dead process does: stop listening and drop every open connection (keep-alive ones
        too), so the next request on one fails."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gate(self, name: str) -> asyncio.Event:
        """The gate ``name`` (created closed); call on the fake's loop."""
        return self.gates.setdefault(name, asyncio.Event())

    def release(self, *names: str) -> None:
        """Open the gates ``names``; safe to call from any thread."""
        assert self._loop is not None, "not started"
        for name in names:
            self._loop.call_soon_threadsafe(lambda n=name: self.gate(n).set())

    # --- HTTP ---------------------------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        raw = await reader.readexactly(int(headers.get("content-length", "0") or 0))
        body = msgspec.json.decode(raw) if raw and "json" in headers.get("content-type", "") else None
        record = Record(method, path.split("?")[0], headers, body, time.monotonic())
        if not record.path.startswith("/_fake/"):
            self.records.append(record)
        await self._route(record, reader, writer)
        return True

    async def _route(self, rec: Record, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if rec.path == "/_fake/requests":
            return await _json(writer, 200, [asdict(r) for r in self.records])
        if rec.path == "/_fake/reset":
            self.records.clear()
            return await _json(writer, 200, {"ok": True})
        if rec.path == "/_fake/release" and isinstance(rec.body, dict):
            self.gate(str(rec.body["name"])).set()
            return await _json(writer, 200, {"ok": True})
        if rec.path in ("/health", "/v1/models"):
            data = [
                {
                    "id": m,
                    "object": "model",
                    "created": 0,
                    "owned_by": "fake",
                    "max_model_len": self.max_model_len,
                    **({"kvscope": self.card_kvscope} if self.card_kvscope is not None else {}),
                }
                for m in self.models
            ]
            return await _json(
                writer, 200, {"object": "list", "data": data} if rec.path == "/v1/models" else {}
            )
        if rec.path in ("/v1/chat/completions", "/v1/completions") and isinstance(rec.body, dict):
            knobs = self.knobs.merged(rec.body.get("fake"))
            if knobs.headers_delay_s:
                await asyncio.sleep(knobs.headers_delay_s)
            if knobs.status != 200:
                extra = [
                    tuple(h.strip() for h in item.split(":", 1))
                    for item in knobs.error_headers.split(",")
                    if item.strip()
                ]
                return await _json(
                    writer,
                    knobs.status,
                    {
                        "error": {
                            "message": f"fake {knobs.status}",
                            "type": "server_error",
                            "param": None,
                            "code": knobs.error_code or None,
                        }
                    },
                    headers=extra,
                )
            gone = asyncio.Event()  # set when the client disconnects: ends a gate wait
            gen = Generation(
                rec,
                knobs,
                chat=rec.path.endswith("chat/completions"),
                gate=self.gate,
                gone=gone,
                max_model_len=self.max_model_len,
            )
            watcher = asyncio.create_task(_watch_eof(reader, rec, gone))
            try:
                if rec.body.get("stream"):
                    await gen.stream(writer)
                else:
                    await gen.respond(writer)
                rec.completed = rec.disconnected_at is None
            finally:
                watcher.cancel()
                await asyncio.wait({watcher})
            return None
        if rec.path == "/v1/missing":  # an upstream's own OpenAI-shaped 404 for a passed-through path
            return await _json(
                writer,
                404,
                {
                    "error": {
                        "message": "Unknown path /v1/missing.",
                        "type": "not_found_error",
                        "param": None,
                        "code": "not_found",
                    }
                },
            )
        return await _json(writer, 200, {"echo": rec.path, "method": rec.method, "body": rec.body})


async def _watch_eof(reader: asyncio.StreamReader, rec: Record, gone: asyncio.Event) -> None:
    """The client never sends more while a response is pending: EOF here means it disconnected."""
    with contextlib.suppress(Exception):
        data = await reader.read(1)
        if not data:
            rec.disconnected_at = time.monotonic()
            gone.set()


async def _json(
    writer: asyncio.StreamWriter, status: int, obj: Any, headers: list[tuple[str, ...]] | None = None
) -> None:
    body = msgspec.json.encode(obj)
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers or ())
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{extra}\r\n".encode()
        + body
    )
    await writer.drain()


def prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content") or "").split()) for m in body["messages"])
    prompt = body.get("prompt", "")
    return (
        len(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
        else len(str(prompt).split())
    )


class Generation:
    """One completion request's deterministic output."""

    def __init__(
        self,
        rec: Record,
        knobs: Knobs,
        chat: bool,
        gate: Callable[[str], asyncio.Event] | None = None,
        gone: asyncio.Event | None = None,
        max_model_len: int = 2048,
    ) -> None:
        self.rec, self.knobs, self.chat, self.body = rec, knobs, chat, rec.body
        self._gate, self._gone = gate, gone or asyncio.Event()
        self.n = self.body.get("n") or 1
        self.max_tokens = self.body.get("max_tokens") or self.body.get("max_completion_tokens")
        # ignore_eos without max_tokens runs to the end of the context, as an engine does
        unbounded = max(1, max_model_len - prompt_words(self.body)) if self.body.get("ignore_eos") else 8
        self.num_tokens = self.max_tokens or unbounded
        self.finish = knobs.finish_reason or ("length" if self.max_tokens else "stop")
        self.id = ("chatcmpl-" if chat else "cmpl-") + str(len(rec.path) + int(rec.arrived * 1e6))
        self.model = self.body.get("model")

    def token(self, choice: int, i: int) -> str:
        return f"t{i} " if choice == 0 else f"c{choice}t{i} "

    def usage(self) -> dict[str, Any]:
        prompt = prompt_words(self.body)
        completion = self.num_tokens * self.n
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.knobs.cached_tokens},
        }

    def _alive(self) -> bool:
        return self.rec.disconnected_at is None

    async def _held(self, i: int) -> None:
        """With the ``hold`` knob: wait until gate ``"{hold}/{i}"`` is released or the client left."""
        if not self.knobs.hold or self._gate is None:
            return
        opened = asyncio.ensure_future(self._gate(f"{self.knobs.hold}/{i}").wait())
        gone = asyncio.ensure_future(self._gone.wait())
        await asyncio.wait({opened, gone}, return_when=asyncio.FIRST_COMPLETED)
        for task in (opened, gone):
            task.cancel()

    async def respond(self, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(self.knobs.first_token_delay_s + self.knobs.token_delay_s * self.num_tokens)
        await self._held(0)
        if not self._alive():
            return
        texts = ["".join(self.token(c, i) for i in range(self.num_tokens)) for c in range(self.n)]
        choices = [
            {
                "index": c,
                "finish_reason": self.finish,
                "logprobs": None,
                **({"message": {"role": "assistant", "content": t}} if self.chat else {"text": t}),
            }
            for c, t in enumerate(texts)
        ]
        obj = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": 1,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.knobs.kvscope_stats:
            obj["kvscope"] = ENGINE_STATS
        await _json(writer, 200, obj)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": 1,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if (self.body.get("stream_options") or {}).get("include_usage"):
            obj.setdefault("usage", None)  # as OpenAI, vLLM and our engine: null on every chunk but the last
        return obj

    def choice(self, c: int, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": text} if text is not None else {})
            )
            return {"index": c, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": c, "text": text or "", "logprobs": None, "finish_reason": finish}

    async def stream(self, writer: asyncio.StreamWriter) -> None:
        out = SSEWriter(writer, self.rec, self.knobs)
        await out.start()
        if self.chat:
            await out.event(self.chunk([self.choice(c, None, None, role=True) for c in range(self.n)]))
        await asyncio.sleep(self.knobs.first_token_delay_s)
        for i in range(self.num_tokens):
            if not self._alive():
                return
            if i == self.knobs.die_after_tokens:
                writer.transport.abort()
                return
            if i == self.knobs.error_after_tokens:
                await out.event(
                    {
                        "error": {
                            "message": "fake engine failure",
                            "type": "server_error",
                            "param": None,
                            "code": "engine_error",
                        }
                    }
                )
                await out.event("[DONE]")
                return await out.end()
            if i:
                await asyncio.sleep(self.knobs.token_delay_s)
            await self._held(i)
            if not self._alive():
                return
            await out.event(self.chunk([self.choice(c, self.token(c, i), None) for c in range(self.n)]))
        if self.knobs.omit_finish:
            return await out.end()
        await out.event(
            self.chunk([self.choice(c, None if self.chat else "", self.finish) for c in range(self.n)])
        )
        if (self.body.get("stream_options") or {}).get("include_usage"):
            extra = {"kvscope": ENGINE_STATS} if self.knobs.kvscope_stats else {}
            await out.event(self.chunk([], usage=self.usage(), **extra))
        await out.event("[DONE]")
        await asyncio.sleep(self.knobs.end_delay_s)
        await out.end()


class SSEWriter:
    """Chunked-encoding SSE writer; with ``rechunk_seed`` the byte stream is cut at random places."""

    def __init__(self, writer: asyncio.StreamWriter, rec: Record, knobs: Knobs) -> None:
        self.writer, self.rec, self.knobs = writer, rec, knobs
        self.rng = random.Random(knobs.rechunk_seed) if knobs.rechunk_seed >= 0 else None
        self.pending = b""

    async def start(self) -> None:
        self.writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        await self.writer.drain()

    async def event(self, obj: Any) -> None:
        nl = "\r\n" if self.knobs.crlf else "\n"
        data = obj if isinstance(obj, str) else msgspec.json.encode(obj).decode()
        raw = f"data: {data}{nl}{nl}".encode()
        self.rec.sse += raw.decode("latin-1")
        if self.rng is None:
            return await self._chunk(raw)
        self.pending += raw
        while self.pending and self.rng.random() < 0.7:
            cut = self.rng.randint(1, len(self.pending))
            await self._chunk(self.pending[:cut])
            self.pending = self.pending[cut:]

    async def _chunk(self, data: bytes) -> None:
        if not data:
            return
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()
        if self.rng is not None:
            await asyncio.sleep(0.001)

    async def end(self) -> None:
        await self._chunk(self.pending)
        self.pending = b""
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


def main() -> None:
    parser = argparse.ArgumentParser(description="fake OpenAI-compatible upstream for gateway tests")
    parser.add_argument(
        "--host", default="127.0.0.1", help="listen address (any 127.x.y.z: many fakes on one port)"
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--models", default="fake-model")
    parser.add_argument("--max-model-len", type=int, default=2048)
    for f in fields(Knobs):
        kind = int if isinstance(f.default, bool) else type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = parser.parse_args()
    values: dict[str, Any] = {
        f.name: (bool(getattr(args, f.name)) if isinstance(f.default, bool) else getattr(args, f.name))
        for f in fields(Knobs)
    }
    knobs = Knobs(**values)

    async def serve() -> None:
        fake = await FakeUpstream(tuple(args.models.split(",")), args.max_model_len, knobs).start(
            host=args.host, port=args.port
        )
        print(f"READY {fake.port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
