"""Test helpers: real processes (gateway, fake upstream, redis-server), an in-thread gateway for tests that
inspect its registry and spans, and parsers for SSE, Prometheus text and the JSONL request log."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvscope.gateway.logs.jsonl import read_records
from kvscope.testing.fake_upstream import FakeUpstream, Knobs
from kvscope.testing.ports import free_port
from kvscope.testing.sse import sse_events as sse_events  # re-exported: the tests import it from here
from kvscope.testing.wait import wait_until


def wait_http(
    url: str, timeout: float = 30.0, status: int = 200, proc: subprocess.Popen | None = None
) -> None:
    """Poll ``url`` until it answers ``status``; raises RuntimeError if ``proc`` exits first, TimeoutError
    (with the last error) when time runs out."""

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up")
        return httpx.get(url, timeout=1.0).status_code == status

    try:
        wait_until(answers, timeout, f"{url} answering {status}", 0.05, (httpx.HTTPError,))
    except AssertionError as exc:
        raise TimeoutError(str(exc)) from None


@dataclass
class Proc:
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(5)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(
    args: list[str], port: int, log: Path, pythonpath: str = "", env: dict[str, str] | None = None
) -> Proc:
    """Start ``args`` with stdout+stderr to ``log``; ``env`` adds to the inherited environment, ``pythonpath``
    (when given) is the child's PYTHONPATH. kvscope's modules, the stub upstream included, come from the
    installed package, so no source folder goes on the child's path."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with open(log, "wb") as out:  # the child keeps its own descriptor
        popen = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Proc(popen, port, log)


def spawn_fake(tmp: Path, name: str, models: str = "fake-model", **knobs: Any) -> Proc:
    port = free_port()
    args = [
        sys.executable,
        "-P",
        "-m",
        "kvscope.testing.fake_upstream",
        "--port",
        str(port),
        "--models",
        models,
    ]
    for key, value in knobs.items():
        args += ["--" + key.replace("_", "-"), str(int(value) if isinstance(value, bool) else value)]
    return spawn(args, port, tmp / f"{name}.log")


def spawn_gateway(
    tmp: Path, name: str, config: dict[str, Any], pythonpath: str = "", env: dict[str, str] | None = None
) -> Proc:
    """``python -m kvscope.gateway`` with ``config`` (a free port added); ``pythonpath`` is the child's
    PYTHONPATH, ``env`` added to the inherited environment."""
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**config, "port": port}))
    return spawn(
        [sys.executable, "-P", "-m", "kvscope.gateway", "--config", str(path), "--log-level", "warning"],
        port,
        tmp / f"{name}.out",
        pythonpath,
        env,
    )


def spawn_redis(tmp: Path) -> Proc:
    port = free_port()
    args = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp),
    ]
    return spawn(args, port, tmp / "redis.log")


def wait_port(port: int, timeout: float = 10.0) -> None:
    """Wait until 127.0.0.1:``port`` accepts a TCP connection; TimeoutError when time runs out."""

    def open_() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(open_, timeout, f"port {port} open", 0.05)
    except AssertionError as exc:
        raise TimeoutError(str(exc)) from None


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_http(port: int, data: bytes, timeout: float = 20.0, source: str | None = None) -> RawResponse:
    """Send ``data`` as is on a new connection to 127.0.0.1 (from ``source``, e.g. ``127.0.0.2``) for targets
    and heads no client library would send, and parse the one response with h11; waits until the server
    closes the connection or the response ends."""
    import h11

    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))  # lets h11 expect a response
    conn.send(h11.EndOfMessage())
    status, headers, body = 0, {}, b""
    with socket.create_connection(
        ("127.0.0.1", port), timeout=timeout, source_address=(source, 0) if source else None
    ) as sock:
        sock.sendall(data)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return RawResponse(status, headers, body)


# --- in-thread servers ------------------------------------------------------------------------------------
class LoopThread:
    """An asyncio loop in a daemon thread (for in-process fake upstreams)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def start_fake_thread(
    loop: LoopThread,
    models: tuple[str, ...] = ("fake-model",),
    max_model_len: int = 2048,
    card_kvscope: dict[str, Any] | None = None,
    slots: int = 0,
    **knobs: Any,
) -> FakeUpstream:
    """A stub upstream serving ``models`` on ``loop``; ``card_kvscope``: its cards' ``kvscope`` field;
    ``slots``: requests generating at once (0: no limit); ``knobs`` (``kind`` among them): :class:`Knobs`."""
    fake = FakeUpstream(models, max_model_len, Knobs(**knobs), card_kvscope=card_kvscope, slots=slots)
    return loop.run(fake.start())


class GatewayThread:
    """The gateway app under uvicorn in a thread: tests can read its registry, spans and state."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        from kvscope.gateway.server import uvicorn_config

        self.app = app
        config = uvicorn_config(app, "127.0.0.1", free_port(), "warning")
        self.server = uvicorn.Server(config)
        self.port = config.port
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Any:
        return self.app.state.gateway

    def __enter__(self) -> GatewayThread:
        self.thread.start()

        def started() -> bool:
            if not self.thread.is_alive():
                raise RuntimeError("gateway thread exited before it started")
            return self.server.started

        wait_until(started, 20, "the gateway thread started")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


# --- parsers ----------------------------------------------------------------------------------------------
def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def read_log(path: Path, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The records of a JSONL log once there are at least ``count``, waiting up to ``timeout`` seconds for
    the writer thread; what is there then otherwise (the caller's assertion says what is missing)."""

    def enough() -> tuple[list[dict[str, Any]]] | None:
        records = read_records(path)  # a line being written has no newline yet: left for the next read
        return (records,) if len(records) >= count else None  # a 1-tuple: truthy even with no records

    try:
        return wait_until(enough, timeout, f"{count} records in {path}")[0]
    except AssertionError:
        return read_records(path)


def records_by_id(path: Path, ids: Iterable[str], timeout: float = 30.0) -> dict[str, list[dict[str, Any]]]:
    """Log records grouped by ``http.request.id``, waiting up to ``timeout`` seconds until every id in
    ``ids`` has appeared; what is there then otherwise."""
    wanted = set(ids)

    def grouped() -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for r in read_records(path):
            out.setdefault(r["http"]["request"]["id"], []).append(r)
        return out

    def complete() -> tuple[dict[str, list[dict[str, Any]]]] | None:
        found = grouped()
        return (found,) if wanted <= found.keys() else None

    try:
        return wait_until(complete, timeout, f"request ids {sorted(wanted)[:5]} in {path}")[0]
    except AssertionError:
        return grouped()


# --- a tiny real tokenizer --------------------------------------------------------------------------------
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer_dir(tmp: Path) -> Path:
    """A word-level ``tokenizers`` model (one token per word or punctuation run, ``<s>`` prepended to plain
    prompts) with a ChatML template: exact, predictable token counts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = [
        "[UNK]",
        "<s>",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "system",
        "hello",
        "world",
        "hi",
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = tmp / "tok"
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>"})
    )
    return folder
