"""Helpers for the e2e engine tests (tests/e2e/test_engine_*.py): timed SSE reading, log lines (with a
sentinel request instead of a sleep), metric deltas. The OTLP receiver is tests/otlp_receiver.py's."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvscope.testing.wait import wait_until
from tests.engine.server.helpers import EngineProcess, parse_sse, sample

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class TimedStream:
    status: int
    headers: httpx.Headers
    text: str
    events: list[tuple[float, str]] = field(default_factory=list)
    """(seconds since the request was sent, raw event text) per event."""

    @property
    def parsed(self):
        return parse_sse(self.text)

    def data_times(self) -> list[float]:
        return [t for t, event in self.events if event.startswith("data: ")]


def stream(
    client: httpx.Client,
    path: str,
    body: dict,
    headers: dict | None = None,
    stop_after_data: int | None = None,
    until: Callable[[str], bool] | None = None,
) -> TimedStream:
    """POST with ``stream: true`` and read events with arrival times; close (a client disconnect) after
    ``stop_after_data`` data events, or as soon as ``until(event)`` is true, when given."""
    start = time.monotonic()
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as response:
        result = TimedStream(response.status_code, response.headers, "")
        if response.status_code != 200:
            result.text = response.read().decode()
            return result
        buffer, count = "", 0
        for text in response.iter_text():
            buffer += text
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                result.events.append((time.monotonic() - start, event))
                result.text += event + "\n\n"
                count += event.startswith("data: ")
                if stop_after_data is not None and count >= stop_after_data:
                    return result
                if until is not None and until(event):
                    return result
    return result


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.05) -> Any:
    """``wait_until`` (kvscope/testing/wait.py) for the e2e tests' conditions: returns the predicate's truthy
    value or raises AssertionError after the timeout."""
    return wait_until(predicate, timeout_s, "the e2e condition", interval_s)


def line_by_http_id(engine: EngineProcess, http_id: str, timeout_s: float = 30.0) -> dict:
    """The single log line whose ``http.request.id`` is ``http_id``: waits until it is written, then for a
    sentinel request's line (so a duplicate written after the first would be in the file) and fails if there
    are several."""

    def find() -> list[dict]:
        return [r for r in engine.log_records() if r["http"]["request"]["id"] == http_id]

    wait_until(find, timeout_s, f"the engine's log line of x-request-id {http_id}")
    engine.await_log_sentinel(timeout_s)
    records = find()
    assert len(records) == 1, records
    return records[0]


def log_line(engine: EngineProcess, response_id: str, timeout_s: float = 30.0) -> dict:
    """The single log line of ``response_id``: waits until it is written, then for a sentinel request's line,
    and fails if there are several."""
    wait_until(lambda: engine.records_for(response_id), timeout_s, f"the engine's log line of {response_id}")
    engine.await_log_sentinel(timeout_s)
    records = engine.records_for(response_id)
    assert len(records) == 1, records
    return records[0]


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return sample(after, name, **labels) - sample(before, name, **labels)


def chat(content: str, **extra: Any) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}], **extra}


def completion(prompt: Any, **extra: Any) -> dict:
    return {"model": "smollm2-135m", "prompt": prompt, **extra}


class BackgroundStream:
    """A streaming request read by a thread until :meth:`close` (a client disconnect) or its end."""

    def __init__(self, base_url: str, path: str, body: dict, http_id: str) -> None:
        self.http_id = http_id
        """Sent as ``x-request-id``: the log line's ``http.request.id`` (the response id is unknown while
        the request is queued)."""
        self.data_events = 0
        self.last_data: str | None = None
        self.first_chunk: dict | None = None
        self.finish_times: list[float] = []
        """``time.monotonic()`` when each choice's final chunk (a non-null ``finish_reason``) arrived."""
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url, path, body), daemon=True)
        self.lines = 0
        self._thread.start()

    def _run(self, base_url: str, path: str, body: dict) -> None:
        with (
            httpx.Client(base_url=base_url, timeout=300) as client,
            client.stream(
                "POST", path, json={**body, "stream": True}, headers={"x-request-id": self.http_id}
            ) as response,
        ):
            for line in response.iter_lines():
                self.lines += 1
                if line.startswith("data: {") and self.first_chunk is None:
                    self.first_chunk = json.loads(line[len("data: ") :])
                if line.startswith("data: "):
                    self.data_events += 1
                    self.last_data = line
                    if '"finish_reason":"' in line:
                        self.finish_times.append(time.monotonic())
                if self._closing.is_set():
                    return
        self._closing.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    @property
    def request_id(self) -> str | None:
        return self.first_chunk["id"] if self.first_chunk else None

    def close(self) -> None:
        """Disconnect (takes effect at the next line the server sends: a token or a keep-alive comment)."""
        self._closing.set()
        self._thread.join(30)
