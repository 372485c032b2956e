"""A fake OpenAI-compatible upstream for gateway tests: raw asyncio HTTP/1.1 (keep-alive, chunked SSE), run
in-process (:class:`FakeUpstream`) or as a subprocess (``python -m kvscope.testing.fake_upstream --port P``).

Output is deterministic: completion token ``i`` of choice ``c`` is ``"t{i} "`` (choice 0) / ``"c{c}t{i} "``;
``max_tokens`` tokens (default 8; with ``ignore_eos``, up to the context: ``max_model_len`` − prompt words)
then finish_reason ``length`` (``stop`` when max_tokens is absent). ``prompt_tokens`` = whitespace-separated
words of the prompt / message contents.

Knobs (server defaults via :class:`Knobs`/CLI flags, per request via a ``"fake": {...}`` body field, which the
gateway forwards untouched): ``token_delay_s``, ``first_token_delay_s``, ``status`` (answer every request with
this status and an OpenAI error; ``error_code`` its code, ``error_headers`` its extra headers as
``"Name: value, Name: value"``; ``error_message`` its message, ``error_kvscope`` the JSON of a ``kvscope``
object beside it), ``die_after_tokens`` (abort the TCP connection mid-stream),
``error_after_tokens`` (in-band error event), ``omit_finish`` (end without finish_reason/[DONE]),
``rechunk_seed`` (split the SSE bytes into random HTTP chunks), ``crlf`` (CRLF line endings),
``kvscope_stats`` (add the engine's ``kvscope`` stats object), ``headers_delay_s``, ``finish_reason``,
``end_delay_s`` (a stream's body ends this long after its ``[DONE]``),
``hold`` (a gate name: token ``i`` is written only once the test released ``"{hold}/{i}"``, and a
non-streaming answer waits for ``"{hold}/0"``; a test proves ordering with it instead of with a clock),
``kind`` (which server it impersonates, below).

Kinds (``--kind``, default ``kvscope``; kvscope/testing/upstream_kinds.py holds the shapes, their sources
are cited in tests/fixtures/upstreams/README.md): ``kvscope`` (our engine: ``owned_by`` "kvscope", the
``kvscope`` stats object with ``kvscope_stats``, ``kvscope_engine_*`` gauges), ``vllm`` (``/version``,
``vllm:*`` metrics, ``usage.prompt_tokens_details.cached_tokens``), ``sglang`` (``sglang:*`` metrics, cached
tokens as vLLM), ``llamacpp`` (llama-server as recorded: ``timings`` in the non-streamed body and the final
stream chunk, ``/props``, ``/slots``, ``llamacpp:*`` metrics, its own 400 body for a prompt of more than
``max_model_len`` words), ``tgi`` (``/info``, ``tgi_*`` metrics, the
``x-queue-time``/``x-inference-time``/... headers on non-streamed answers only, as TGI's router) and
``openai`` (nothing beyond the OpenAI API: ``/metrics``, ``/info``, ``/props`` answer 404). A path another
kind owns (``/version``, ``/info``, ``/props``, ``/slots``) answers 404.

Engine state (what ``/metrics``, ``/slots`` and the timings report): with ``slots`` > 0 (CLI ``--slots``) at
most that many requests generate at once and the others wait, first come first served; a request's phases
are queue (measured: arrival to its slot), prefill = ``first_token_delay_s`` and decode = ``token_delay_s``
x (tokens - 1) (the delays it sleeps: a non-streamed answer comes when the stream's last token would), and
it holds ceil((prompt + output tokens) / 16) of ``kv_blocks`` KV blocks while it runs.

Gates: :meth:`FakeUpstream.release` (thread-safe, for in-process fakes) or ``POST /_fake/release`` with
``{"name": ...}``; a gate may be released before anyone waits on it. A wait ends early if the client left.

Records every request (headers incl. traceparent/x-request-id, body, arrival, the SSE bytes sent, and the
monotonic time the client disconnected, if it did): ``GET /_fake/requests``; ``POST /_fake/reset``. Requests
for what a gateway samples in the background (:data:`SCRAPE_PATHS`: ``/metrics``, ``/slots``, ``/props``,
``/info``, ``/version``; gateway/engines/scraper.py) are only counted, by path (:attr:`FakeUpstream.scrapes`,
``GET /_fake/scrapes``): they come on the scraper's clock, so a test that counts the requests a client caused
never sees them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import msgspec

from kvscope.testing import upstream_kinds as kinds
from kvscope.testing.upstream_kinds import EngineState, Finished


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
    error_message: str = ""
    """``error.message`` of the ``status`` answer (empty: ``fake {status}``)."""
    error_kvscope: str = ""
    """JSON of a ``kvscope`` object beside ``error`` in the ``status`` answer (our engine's admission
    refusal); empty: none."""
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
    kind: str = "kvscope"
    """The server impersonated: one of :data:`kvscope.testing.upstream_kinds.KINDS`."""

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
    """Every request but the ``/_fake/`` ones and the scrapes (:data:`SCRAPE_PATHS`), in arrival order."""
    scrapes: Counter[str] = field(default_factory=Counter)
    """Requests for :data:`SCRAPE_PATHS`, by path."""
    port: int = 0
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    connections: int = 0
    """TCP connections accepted so far (keep-alive reuse shows as fewer connections than requests)."""
    card_kvscope: dict[str, Any] | None = None
    """The ``kvscope`` field of its /v1/models cards (``block_size``, ``num_gpu_blocks``, ``instance_id`` as
    our engine reports them); None: none, as other servers."""
    slots: int = 0
    """Requests generating at once; more wait (``requests_waiting``). 0: no limit."""
    kv_blocks: int = 64
    """KV blocks of 16 tokens (``kv_cache_usage``: blocks held by running requests / this)."""
    engine: EngineState = field(default_factory=EngineState)
    """Live state: running and waiting requests, finished ones (the /metrics values)."""
    generations: dict[int, Generation] = field(default_factory=dict)
    """Requests holding a slot, by key (llama.cpp's /slots shows their tasks)."""
    slot_last: dict[int, tuple[Generation, int]] = field(default_factory=dict)
    """Slot id → the last request that ran there and the tokens it left in the slot's cache (llama.cpp's
    /slots shows an idle slot's last task, whose cache cells it keeps)."""
    tasks: int = 0
    """Requests admitted so far (llama.cpp's ``id_task``)."""
    _waiters: deque[tuple[asyncio.Future[None], int, int]] = field(default_factory=deque)
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeUpstream:
        if self.knobs.kind not in kinds.KINDS:
            raise ValueError(f"unknown kind {self.knobs.kind!r} (one of {', '.join(kinds.KINDS)})")
        self.engine.slots, self.engine.kv_blocks, self.engine.started = (
            self.slots,
            self.kv_blocks,
            time.time(),
        )
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

    @property
    def kind(self) -> str:
        return self.knobs.kind

    # --- slots ----------------------------------------------------------------------------------------------
    async def acquire(self, key: int, prompt_tokens: int, gone: asyncio.Event) -> bool:
        """Take a slot for request ``key`` (waiting, first come first served, while all ``slots`` are busy);
        False if the client left while it waited."""
        state = self.engine
        if not state.slots or (len(state.running) < state.slots and not self._waiters):
            state.running[key] = [prompt_tokens, 0]
            return True
        handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((handed, key, prompt_tokens))
        state.waiting += 1
        left = asyncio.ensure_future(gone.wait())
        await asyncio.wait({handed, left}, return_when=asyncio.FIRST_COMPLETED)
        left.cancel()
        if handed.done():
            return True
        handed.cancel()  # still queued: release() skips it
        self._waiters = deque(w for w in self._waiters if w[0] is not handed)
        state.waiting -= 1
        return False

    def release_slot(self, key: int) -> None:
        """Request ``key`` is done: free its slot and hand it to the longest waiting request."""
        state = self.engine
        state.running.pop(key, None)
        while self._waiters and len(state.running) < max(1, state.slots):
            handed, next_key, prompt_tokens = self._waiters.popleft()
            if handed.done():
                continue
            state.waiting -= 1
            state.running[next_key] = [prompt_tokens, 0]
            handed.set_result(None)

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
        if record.path in SCRAPE_PATHS:
            self.scrapes[record.path] += 1
        elif not record.path.startswith("/_fake/"):
            self.records.append(record)
        await self._route(record, reader, writer)
        return True

    async def _route(self, rec: Record, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if rec.path == "/_fake/requests":
            return await _json(writer, 200, [asdict(r) for r in self.records])
        if rec.path == "/_fake/scrapes":
            return await _json(writer, 200, dict(self.scrapes))
        if rec.path == "/_fake/reset":
            self.records.clear()
            self.scrapes.clear()
            return await _json(writer, 200, {"ok": True})
        if rec.path == "/_fake/release" and isinstance(rec.body, dict):
            self.gate(str(rec.body["name"])).set()
            return await _json(writer, 200, {"ok": True})
        if rec.path in KIND_PATHS and self.kind not in KIND_PATHS[rec.path]:
            return await _not_found(writer, rec.path)
        if rec.path == "/health":
            return await self._health(writer)
        if rec.path == "/v1/models":
            created = int(self.engine.started)
            cards = [
                kinds.model_card(self.kind, m, self.max_model_len, created, self.card_kvscope)
                for m in self.models
            ]
            if self.kind == "llamacpp":
                body = kinds.models_list(self.kind, cards)
                return await _json(writer, 200, body, kinds.LLAMACPP_HEADERS, kinds.LLAMACPP_JSON_TYPE)
            return await _json(writer, 200, kinds.models_list(self.kind, cards))
        if rec.path == "/metrics":
            return await self._metrics(writer)
        if rec.path == "/version":
            return await _json(writer, 200, {"version": kinds.VLLM_VERSION})
        if rec.path == "/info":
            return await _json(writer, 200, kinds.tgi_info(self.models[0], self.max_model_len, self.slots))
        if rec.path == "/props":
            return await _json(
                writer, 200, kinds.llamacpp_props(self), kinds.LLAMACPP_HEADERS, kinds.LLAMACPP_JSON_TYPE
            )
        if rec.path == "/slots":
            return await _json(
                writer, 200, kinds.llamacpp_slots(self), kinds.LLAMACPP_HEADERS, kinds.LLAMACPP_JSON_TYPE
            )
        if rec.path in ("/v1/chat/completions", "/v1/completions") and isinstance(rec.body, dict):
            knobs = self.knobs.merged(rec.body.get("fake"))
            if knobs.headers_delay_s:
                await asyncio.sleep(knobs.headers_delay_s)
            if knobs.status != 200:
                self.engine.http[(rec.path, rec.method, knobs.status)] += 1
                extra = [
                    tuple(h.strip() for h in item.split(":", 1))
                    for item in knobs.error_headers.split(",")
                    if item.strip()
                ]
                error_body: dict[str, Any] = {
                    "error": {
                        "message": knobs.error_message or f"fake {knobs.status}",
                        "type": "server_error",
                        "param": None,
                        "code": knobs.error_code or None,
                    }
                }
                if knobs.error_kvscope:
                    error_body["kvscope"] = msgspec.json.decode(knobs.error_kvscope)
                return await _json(writer, knobs.status, error_body, headers=extra)
            if self.kind == "llamacpp" and (words := prompt_words(rec.body)) > self.max_model_len:
                self.engine.http[(rec.path, rec.method, 400)] += 1
                return await _json(
                    writer,
                    400,
                    kinds.llamacpp_context_error(words, self.max_model_len),
                    kinds.LLAMACPP_HEADERS,
                    kinds.LLAMACPP_JSON_TYPE,
                )
            gone = asyncio.Event()  # set when the client disconnects: ends a gate wait
            gen = Generation(
                rec,
                knobs,
                chat=rec.path.endswith("chat/completions"),
                gate=self.gate,
                gone=gone,
                max_model_len=self.max_model_len,
                upstream=self,
            )
            self.engine.http[(rec.path, rec.method, 200)] += 1
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

    async def _health(self, writer: asyncio.StreamWriter) -> None:
        """``/health``: llama.cpp ``{"status": "ok"}``; vLLM, SGLang and TGI an empty 200; ours ``{}``."""
        if self.kind == "llamacpp":
            return await _json(
                writer, 200, {"status": "ok"}, kinds.LLAMACPP_HEADERS, kinds.LLAMACPP_JSON_TYPE
            )
        if self.kind in ("vllm", "sglang", "tgi"):
            return await _raw(writer, 200, b"", "")
        return await _json(writer, 200, {})

    async def _metrics(self, writer: asyncio.StreamWriter) -> None:
        """``/metrics`` in the kind's names, from :attr:`engine` (404 for ``openai``)."""
        model, state = self.models[0], self.engine
        if self.kind == "vllm":
            text = kinds.vllm_metrics(state, model, self.max_model_len)
        elif self.kind == "sglang":
            text = kinds.sglang_metrics(state, model)
        elif self.kind == "tgi":
            text = kinds.tgi_metrics(state, self.max_model_len - 1, self.max_model_len)
            return await _raw(writer, 200, text.encode(), "text/plain; charset=utf-8")
        elif self.kind == "llamacpp":
            text = kinds.llamacpp_metrics(self)
            headers = [*kinds.LLAMACPP_HEADERS, ("process-start-time-unix", str(int(state.started)))]
            return await _raw(writer, 200, text.encode(), kinds.LLAMACPP_METRICS_TYPE, headers)
        else:
            text = kinds.kvscope_metrics(state, model)
        return await _raw(writer, 200, text.encode(), PROMETHEUS_TYPE)


KIND_PATHS = {
    "/metrics": frozenset(kinds.KINDS) - {"openai"},
    "/version": frozenset({"vllm"}),
    "/info": frozenset({"tgi"}),
    "/props": frozenset({"llamacpp"}),
    "/slots": frozenset({"llamacpp"}),
}
"""Paths only some kinds answer: the others 404 (a plain OpenAI server has no ``/metrics``)."""
SCRAPE_PATHS = frozenset(KIND_PATHS)
"""What a gateway's engine scraper asks (its ``/metrics``, llama.cpp's ``/slots``, the kind probes): counted
in :attr:`FakeUpstream.scrapes`, never in :attr:`FakeUpstream.records`."""
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def _not_found(writer: asyncio.StreamWriter, path: str) -> None:
    error = {
        "message": f"Unknown path {path}.",
        "type": "not_found_error",
        "param": None,
        "code": "not_found",
    }
    await _json(writer, 404, {"error": error})


async def _raw(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str,
    headers: list[tuple[str, str]] | tuple[tuple[str, str], ...] = (),
) -> None:
    ctype = f"content-type: {content_type}\r\n" if content_type else ""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    writer.write(f"HTTP/1.1 {status} X\r\n{ctype}content-length: {len(body)}\r\n{extra}\r\n".encode() + body)
    await writer.drain()


async def _watch_eof(reader: asyncio.StreamReader, rec: Record, gone: asyncio.Event) -> None:
    """The client never sends more while a response is pending: EOF here means it disconnected."""
    with contextlib.suppress(Exception):
        data = await reader.read(1)
        if not data:
            rec.disconnected_at = time.monotonic()
            gone.set()


async def _json(
    writer: asyncio.StreamWriter,
    status: int,
    obj: Any,
    headers: list[tuple[str, ...]] | tuple[tuple[str, str], ...] | None = None,
    content_type: str = "application/json",
) -> None:
    await _raw(writer, status, msgspec.json.encode(obj), content_type, [(h[0], h[1]) for h in headers or ()])


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
    """One completion request's deterministic output, shaped as ``knobs.kind`` answers."""

    def __init__(
        self,
        rec: Record,
        knobs: Knobs,
        chat: bool,
        gate: Callable[[str], asyncio.Event] | None = None,
        gone: asyncio.Event | None = None,
        max_model_len: int = 2048,
        upstream: FakeUpstream | None = None,
    ) -> None:
        self.rec, self.knobs, self.chat, self.body = rec, knobs, chat, rec.body
        self._gate, self._gone = gate, gone or asyncio.Event()
        self.kind, self.upstream = knobs.kind, upstream
        self.n = self.body.get("n") or 1
        self.max_tokens = self.body.get("max_tokens") or self.body.get("max_completion_tokens")
        self.prompt_tokens = prompt_words(self.body)
        # ignore_eos without max_tokens runs to the end of the context, as an engine does
        unbounded = max(1, max_model_len - self.prompt_tokens) if self.body.get("ignore_eos") else 8
        self.num_tokens = self.max_tokens or unbounded
        self.finish = knobs.finish_reason or ("length" if self.max_tokens else "stop")
        self.id = ("chatcmpl-" if chat else "cmpl-") + str(len(rec.path) + int(rec.arrived * 1e6))
        self.model = self.body.get("model")
        self.queue_s = 0.0
        """Arrival to a free slot (measured)."""
        self.task_id = 0
        self.slot_id = 0
        """The slot it runs in (the lowest free one, as llama.cpp's /slots shows)."""
        self._finished = False

    @property
    def prefill_s(self) -> float:
        """Slot to first token: ``first_token_delay_s``."""
        return self.knobs.first_token_delay_s

    @property
    def decode_s(self) -> float:
        """First to last token: ``token_delay_s`` x (tokens - 1)."""
        return self.knobs.token_delay_s * max(0, self.num_tokens - 1)

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    def token(self, choice: int, i: int) -> str:
        return f"t{i} " if choice == 0 else f"c{choice}t{i} "

    def usage(self) -> dict[str, Any]:
        """OpenAI usage; TGI's has no ``prompt_tokens_details`` (``router/src/lib.rs`` ``struct Usage``)."""
        completion = self.num_tokens * self.n
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        if self.kind != "tgi":
            usage["prompt_tokens_details"] = {"cached_tokens": self.knobs.cached_tokens}
        return usage

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

    # --- engine state ---------------------------------------------------------------------------------------
    async def _admit(self) -> bool:
        """Wait for a slot (measuring :attr:`queue_s`); False if the client left first."""
        if self.upstream is None:
            return True
        start = time.monotonic()
        admitted = await self.upstream.acquire(id(self), self.prompt_tokens, self._gone)
        self.queue_s = time.monotonic() - start
        if admitted:
            self.task_id, self.upstream.tasks = self.upstream.tasks, self.upstream.tasks + 1
            taken = {g.slot_id for g in self.upstream.generations.values()}
            self.slot_id = next(i for i in range(len(taken) + 1) if i not in taken)
            self.upstream.generations[id(self)] = self
        return admitted

    def llamacpp_cache_split(self) -> tuple[int, int]:
        """(cache_n, prompt_n) as llama.cpp counts the ``cached_tokens`` knob."""
        return kinds.llamacpp_split(self.prompt_tokens, self.knobs.cached_tokens)

    def _emitted(self, tokens: int) -> None:
        """``tokens`` of each choice are out: they hold KV blocks."""
        if self.upstream is not None and id(self) in self.upstream.engine.running:
            self.upstream.engine.running[id(self)][1] = tokens * self.n

    def _finish(self, completed: bool) -> None:
        """Free the slot (once); a completed request joins the finished ones (the metrics' histograms)."""
        if self._finished or self.upstream is None:
            return
        self._finished = True
        if completed:
            self.upstream.engine.finished.append(
                Finished(
                    queue_s=self.queue_s,
                    prefill_s=self.prefill_s,
                    decode_s=self.decode_s,
                    prompt_tokens=self.prompt_tokens,
                    cached_tokens=self.knobs.cached_tokens,
                    output_tokens=self.num_tokens,
                    token_gap_s=self.knobs.token_delay_s,
                    n=self.n,
                    max_tokens=self.max_tokens,
                    finish_reason=self.finish,
                )
            )
        if self.upstream.generations.pop(id(self), None) is not None:
            decoded = self.upstream.engine.running.get(id(self), [0, 0])[1]
            # the last sampled token never goes into the cache (nothing decodes it)
            self.upstream.slot_last[self.slot_id] = (self, self.prompt_tokens + max(0, decoded - 1))
        self.upstream.release_slot(id(self))

    # --- answers --------------------------------------------------------------------------------------------
    async def respond(self, writer: asyncio.StreamWriter) -> None:
        if not await self._admit():
            return
        try:
            await asyncio.sleep(self.prefill_s + self.decode_s)
            await self._held(0)
            if not self._alive():
                return
            self._emitted(self.num_tokens)
            self._finish(True)  # the engine is done before its answer leaves
            texts = ["".join(self.token(c, i) for i in range(self.num_tokens)) for c in range(self.n)]
            if self.kind == "llamacpp":
                body = kinds.llamacpp_completion(self, texts)
                return await _json(writer, 200, body, kinds.LLAMACPP_HEADERS, kinds.LLAMACPP_JSON_TYPE)
            await _json(writer, 200, self.completion(texts), headers=self.headers())
        finally:
            self._finish(False)

    def completion(self, texts: list[str]) -> dict[str, Any]:
        """The non-streamed body (every kind but llamacpp)."""
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
        return obj

    def characters(self) -> int:
        """Characters of the prompt (TGI's ``x-compute-characters``; the fake's template adds none)."""
        if "messages" in self.body:
            return sum(len(str(m.get("content") or "")) for m in self.body["messages"])
        return len(str(self.body.get("prompt", "")))

    def headers(self) -> list[tuple[str, str]]:
        """Extra headers of a non-streamed answer: TGI's timings."""
        if self.kind != "tgi":
            return []
        return kinds.tgi_timing_headers(
            chat=self.chat,
            queue_s=self.queue_s,
            inference_s=self.prefill_s + self.decode_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.num_tokens,
            characters=self.characters(),
        )

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        if self.kind == "llamacpp":
            return kinds.llamacpp_chunk(self, choices, **extra)
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": 1,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage:
            obj.setdefault("usage", None)  # as OpenAI, vLLM and our engine: null on every chunk but the last
        return obj

    def choice(self, c: int, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "llamacpp":
            return kinds.llamacpp_choice(self, c, text, finish, role)
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": ""}
                if role
                else ({"content": text} if text is not None else {})
            )
            return {"index": c, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": c, "text": text or "", "logprobs": None, "finish_reason": finish}

    async def stream(self, writer: asyncio.StreamWriter) -> None:
        extra_headers = kinds.tgi_stream_headers(self.characters()) if self.kind == "tgi" else []
        if self.kind == "llamacpp":
            extra_headers = [*kinds.LLAMACPP_HEADERS, ("x-accel-buffering", "no")]
        out = SSEWriter(writer, self.rec, self.knobs, extra_headers)
        await out.start()
        if self.chat and self.kind != "llamacpp":  # llama.cpp sends the role with the first token
            await out.event(self.chunk([self.choice(c, None, None, role=True) for c in range(self.n)]))
        if not await self._admit():
            return
        try:
            await self._stream_tokens(writer, out)
        finally:
            self._finish(False)

    async def _stream_tokens(self, writer: asyncio.StreamWriter, out: SSEWriter) -> None:
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
            self._emitted(i + 1)
            if i == 0 and self.chat and self.kind == "llamacpp":
                await out.event(self.chunk([self.choice(c, None, None, role=True) for c in range(self.n)]))
            await out.event(self.chunk([self.choice(c, self.token(c, i), None) for c in range(self.n)]))
        if self.knobs.omit_finish:
            return await out.end()
        self._finish(True)
        for event in self.final_events():
            await out.event(event)
        await out.event("[DONE]")
        await asyncio.sleep(self.knobs.end_delay_s)
        await out.end()

    def final_events(self) -> list[dict[str, Any]]:
        """The events after the last token: the finish chunk, then the usage chunk when asked for."""
        if self.kind == "llamacpp":
            return kinds.llamacpp_final_chunks(self)
        events = [self.chunk([self.choice(c, None if self.chat else "", self.finish) for c in range(self.n)])]
        if self.include_usage:
            extra = {"kvscope": ENGINE_STATS} if self.knobs.kvscope_stats else {}
            events.append(self.chunk([], usage=self.usage(), **extra))
        return events


class SSEWriter:
    """Chunked-encoding SSE writer; with ``rechunk_seed`` the byte stream is cut at random places."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        rec: Record,
        knobs: Knobs,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.writer, self.rec, self.knobs = writer, rec, knobs
        self.headers = headers or []
        self.rng = random.Random(knobs.rechunk_seed) if knobs.rechunk_seed >= 0 else None
        self.pending = b""

    async def start(self) -> None:
        extra = "".join(f"{name}: {value}\r\n" for name, value in self.headers).encode()
        self.writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n" + extra + b"\r\n"
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
    parser.add_argument("--slots", type=int, default=0, help="requests generating at once (0: no limit)")
    parser.add_argument("--kv-blocks", type=int, default=64, help="KV blocks of 16 tokens")
    for f in fields(Knobs):
        if f.name == "kind":
            parser.add_argument(
                "--kind", choices=kinds.KINDS, default=f.default, help="server to impersonate"
            )
            continue
        kind = int if isinstance(f.default, bool) else type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = parser.parse_args()
    values: dict[str, Any] = {
        f.name: (bool(getattr(args, f.name)) if isinstance(f.default, bool) else getattr(args, f.name))
        for f in fields(Knobs)
    }
    knobs = Knobs(**values)

    async def serve() -> None:
        fake = FakeUpstream(
            tuple(args.models.split(",")),
            args.max_model_len,
            knobs,
            slots=args.slots,
            kv_blocks=args.kv_blocks,
        )
        await fake.start(host=args.host, port=args.port)
        print(f"READY {fake.port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
