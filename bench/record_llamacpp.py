"""Record what llama.cpp's ``llama-server`` answers, as fixtures for the fake upstream's ``llamacpp`` kind
(tests/fixtures/upstreams/llamacpp/, kvscope/testing/upstream_kinds.py).

Starts the ``llama-server`` that bench/build_llama_server.sh builds on the default model's GGUF (as
bench/peers.sh does, with ``--metrics`` and ``--slots``), then records, byte for byte:
``GET /health``, ``/v1/models``, ``/props``, ``/slots`` (idle, and while a stream runs), ``/metrics``
(idle, while a stream runs, and after the requests); a non-streamed chat completion (body and headers) and
the same request again (a prompt-cache hit: ``timings.cache_n`` > 0); a streamed chat completion (the raw
SSE text: the final chunk carries ``timings``), with and without ``stream_options.include_usage``; a
non-streamed and a streamed ``/v1/completions``. Each ``*.json`` answer is written as received (indented),
its headers beside it as ``*.headers.json`` (``date`` dropped: it changes every run); ``server.txt`` has
the server's ``--version`` and the command line.

    python bench/record_llamacpp.py [--server PATH] [--gguf PATH] [--out tests/fixtures/upstreams/llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
CACHE = Path(os.environ.get("KVSCOPE_CACHE", Path.home() / ".cache" / "kvscope"))
DEFAULT_GGUF = CACHE / "models" / MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVER = Path(os.environ.get("PEERS_DIR", "/work/peers-build")) / "llama.cpp-build/bin/llama-server"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "seed": 0}
PROMPT = {
    "model": MODEL,
    "prompt": "The three primary colours are",
    "max_tokens": 8,
    "temperature": 0,
    "seed": 0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server: Path, gguf: Path, port: int, threads: int) -> list[str]:
    """llama-server as bench/peers.sh starts it (two slots of 512 tokens), plus /metrics and /slots."""
    return [
        str(server),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--alias", MODEL,
        "-t", str(threads),
        "-tb", str(threads),
        "-np", "2",
        "-c", "1024",
        "--no-webui",
        "--metrics",
        "--slots",
    ]  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server not ready")


def headers_of(resp: httpx.Response) -> list[list[str]]:
    """Response headers in order, ``date`` dropped."""
    return [[k, v] for k, v in resp.headers.multi_items() if k.lower() != "date"]


class Recorder:
    def __init__(self, base: str, out: Path) -> None:
        self.base, self.out = base, out
        self.client = httpx.Client(base_url=base, timeout=120)

    def save_json(self, name: str, resp: httpx.Response) -> Any:
        resp.raise_for_status()
        body = resp.json()
        (self.out / f"{name}.json").write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n")
        (self.out / f"{name}.headers.json").write_text(json.dumps(headers_of(resp), indent=2) + "\n")
        return body

    def save_text(self, name: str, resp: httpx.Response) -> str:
        resp.raise_for_status()
        (self.out / name).write_text(resp.text)
        (self.out / f"{name}.headers.json").write_text(json.dumps(headers_of(resp), indent=2) + "\n")
        return resp.text

    def get_json(self, name: str, path: str) -> Any:
        return self.save_json(name, self.client.get(path))

    def post_json(self, name: str, path: str, body: dict[str, Any]) -> Any:
        return self.save_json(name, self.client.post(path, json=body))

    def post_stream(self, name: str, path: str, body: dict[str, Any]) -> str:
        with self.client.stream("POST", path, json={**body, "stream": True}) as resp:
            resp.raise_for_status()
            raw = b"".join(resp.iter_raw()).decode()
            (self.out / f"{name}.sse").write_text(raw)
            (self.out / f"{name}.sse.headers.json").write_text(json.dumps(headers_of(resp), indent=2) + "\n")
        return raw

    def during_stream(self) -> None:
        """/slots and /metrics while a long stream runs (a busy slot's shape)."""
        started = threading.Event()

        def long_stream() -> None:
            body = {**CHAT, "max_tokens": 200, "stream": True, "cache_prompt": False}
            with httpx.Client(base_url=self.base, timeout=120) as other:
                with other.stream("POST", "/v1/chat/completions", json=body) as resp:
                    for _ in resp.iter_raw():
                        started.set()

        thread = threading.Thread(target=long_stream)
        thread.start()
        started.wait(60)
        time.sleep(0.2)
        self.get_json("slots_busy", "/slots")
        self.save_text("metrics_busy.txt", self.client.get("/metrics"))
        thread.join()


def record(server: Path, gguf: Path, out: Path, threads: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = server_command(server, gguf, port, threads)
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True, check=False)
    log = open(Path(tempfile.gettempdir()) / "record_llamacpp.log", "wb")  # noqa: SIM115 (the server's)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, proc)
        rec = Recorder(base, out)
        rec.get_json("health", "/health")
        rec.get_json("models", "/v1/models")
        rec.get_json("props", "/props")
        rec.get_json("slots", "/slots")
        rec.save_text("metrics_idle.txt", rec.client.get("/metrics"))
        rec.post_json("chat", "/v1/chat/completions", {**CHAT, "cache_prompt": False})
        rec.post_json("chat_cached", "/v1/chat/completions", CHAT)
        rec.post_json("chat_cached_again", "/v1/chat/completions", CHAT)
        rec.post_stream("chat_stream", "/v1/chat/completions", {**CHAT, "cache_prompt": False})
        rec.post_stream(
            "chat_stream_usage",
            "/v1/chat/completions",
            {**CHAT, "cache_prompt": False, "stream_options": {"include_usage": True}},
        )
        rec.post_json("completions", "/v1/completions", {**PROMPT, "cache_prompt": False})
        rec.post_stream("completions_stream", "/v1/completions", {**PROMPT, "cache_prompt": False})
        rec.during_stream()
        rec.save_text("metrics.txt", rec.client.get("/metrics"))
        display = " ".join(
            [Path(command[0]).name, *(a if not a.startswith("/") else Path(a).name for a in command[1:])]
        )
        (out / "server.txt").write_text(
            f"version: {(version.stdout + version.stderr).strip()}\ncommand: {display}\n"
        )
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--server", type=Path, default=DEFAULT_SERVER)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures/upstreams/llamacpp")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    record(args.server, args.gguf, args.out, args.threads)
    print(f"recorded into {args.out}")


if __name__ == "__main__":
    main()
