"""The floor under the gateway's CPU per relayed token: the kvscope gateway and a minimal asyncio relay side
by side, on the same stub upstream (kvscope/testing/fake_upstream.py) and the same load as
bench/gateway_cpu.py (``--concurrency`` streams × ``--tokens`` tokens), alternating rounds; each process's
user + system CPU seconds (/proc/PID/stat) over a round divided by the tokens the client received. A
benchmark, not a test (docs/gateway.md "CPU per relayed token").

The minimal relay (:class:`_ClientSide` / :class:`_UpstreamSide`, run by ``--serve``) is what any Python
proxy must do per token and nothing more: one ``recv`` from the upstream, HTTP/1.1 chunked framing parsed,
SSE events split at the blank line, each event framed as one chunk and written to the client (one ``send``),
all in asyncio protocol callbacks. No auth, limits, timeouts, JSON, logs, metrics or traces: a floor to
measure against, never a server to run.

With ``--litellm BIN`` (the ``litellm`` command of LiteLLM's proxy installed in its own venv: ``python -m venv
/tmp/litellm-venv && /tmp/litellm-venv/bin/pip install 'litellm[proxy]'``) LiteLLM's proxy runs in the same
rounds, one worker, on the same stub (a config mapping the stub's model to ``openai/<model>`` at the stub's
URL, a master key as its client's API key); its CPU is that of its whole process tree. With ``--baseline SRC``
the gateway of another checkout (``SRC``: its ``src/``, e.g. ``git worktree add /tmp/base <commit>`` then
``/tmp/base/src``) runs in the same rounds too, for an A/B of a change.

    python bench/relay_floor.py [--concurrency 32] [--tokens 128] [--token-delay 0.03] [--rounds 3]
                                [--litellm /tmp/litellm-venv/bin/litellm] [--baseline /tmp/base/src]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(
    str(Path(__file__).resolve().parents[1])
)  # for the other bench scripts (bench.*); after site-packages, so the root kernels/ shadows nothing

from bench.gateway_cpu import add_load_arguments, cpu_seconds, load  # noqa: E402
from kvscope.testing.harness import free_port, spawn_fake, spawn_gateway, wait_http, wait_port  # noqa: E402


class _UpstreamSide(asyncio.Protocol):
    """The upstream connection of one client connection: its answers re-framed event by event to the
    client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.events = b""
        self.in_body = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.in_body:  # the status line and headers go through as they are
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.client.write(self.buffer[: end + 4])
            self.buffer, self.in_body = self.buffer[end + 4 :], True
        while (line_end := self.buffer.find(b"\r\n")) >= 0:  # chunked framing (RFC 9112 §7.1)
            size = int(self.buffer[:line_end].split(b";", 1)[0], 16)
            if len(self.buffer) < line_end + 4 + size:
                return
            payload = self.buffer[line_end + 2 : line_end + 2 + size]
            self.buffer = self.buffer[line_end + 4 + size :]
            if size == 0:
                self.client.write(b"0\r\n\r\n")
                self.in_body = False
                return
            self.events += payload
            while (split := self.events.find(b"\n\n")) >= 0:  # one SSE event, one chunk, one write
                event, self.events = self.events[: split + 2], self.events[split + 2 :]
                self.client.write(b"%x\r\n%s\r\n" % (len(event), event))


class _ClientSide(asyncio.Protocol):
    """One client connection: each request (Content-Length bodies only) forwarded on one upstream
    connection."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream_address = upstream
        self.transport: asyncio.Transport | None = None
        self.upstream: _UpstreamSide | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].lower()
        length = (
            int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            if b"content-length:" in head
            else 0
        )
        if len(self.buffer) < end + 4 + length:
            return
        request, self.buffer = self.buffer[: end + 4 + length], self.buffer[end + 4 + length :]
        asyncio.get_running_loop().create_task(self._forward(request))

    async def _forward(self, request: bytes) -> None:
        if self.upstream is None:
            assert self.transport is not None
            client = self.transport
            _, self.upstream = await asyncio.get_running_loop().create_connection(
                lambda: _UpstreamSide(client), *self.upstream_address
            )
        assert self.upstream.transport is not None
        self.upstream.transport.write(request)


async def _serve(port: int, upstream: tuple[str, int]) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _ClientSide(upstream), "127.0.0.1", port)
    await server.serve_forever()


LITELLM_KEY = "sk-kvscope-bench-0123456789"
"""The master key the LiteLLM proxy is started with (it refuses to start without one) and its client sends."""


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` and of its living descendants (/proc/PID/task/*/children), in
    seconds: a proxy that serves from child processes (uvicorn workers) is counted whole."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def spawn_litellm(
    binary: str, tmp: Path, stub_url: str, model: str = "fake-model"
) -> tuple[subprocess.Popen, str]:
    """LiteLLM's proxy (one worker) in front of the stub; returns the process and its URL once it answers."""
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {stub_url}/v1\n"
        "      api_key: none\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--config", str(config), "--port", str(port), "--num_workers", "1"],
        env={**os.environ, "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOG": "ERROR"},
        stdout=(tmp / "litellm.log").open("wb"),
        stderr=subprocess.STDOUT,
        cwd=tmp,
        start_new_session=True,  # its own process group, killed whole
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health/liveliness", proc=proc, timeout=120)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser)
    parser.add_argument(
        "--serve", nargs=3, metavar=("PORT", "UPSTREAM_HOST", "UPSTREAM_PORT"), help=argparse.SUPPRESS
    )  # the minimal relay's own process
    parser.add_argument("--litellm", help="the litellm command of LiteLLM's proxy (its own venv): run it too")
    parser.add_argument(
        "--baseline",
        metavar="SRC",
        help="also run the gateway of another checkout (its src/ as PYTHONPATH, e.g. a git worktree's): A/B",
    )
    args = parser.parse_args()
    if args.serve:
        port, host, upstream_port = args.serve
        asyncio.run(_serve(int(port), (host, int(upstream_port))))
        return
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-relay-floor-"))
    fake = spawn_fake(tmp, "stub", token_delay_s=args.token_delay)
    gateway = relay = litellm = baseline = None
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        gateway = spawn_gateway(
            tmp, "gateway", {"upstreams": [{"url": fake.url}], "logs": {"file": str(tmp / "requests.jsonl")}}
        )
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        host, upstream_port = fake.url.removeprefix("http://").rsplit(":", 1)
        port = free_port()
        relay = subprocess.Popen([sys.executable, __file__, "--serve", str(port), host, upstream_port])
        wait_port(port)
        targets: dict[str, tuple[int, str, dict[str, str] | None]] = {
            "kvscope gateway": (gateway.popen.pid, gateway.url, None),
            "minimal relay": (relay.pid, f"http://127.0.0.1:{port}", None),
        }
        if args.baseline:
            baseline = spawn_gateway(
                tmp,
                "baseline",
                {"upstreams": [{"url": fake.url}], "logs": {"file": str(tmp / "baseline.jsonl")}},
                pythonpath=args.baseline,
            )
            wait_http(baseline.url + "/readyz", proc=baseline.popen)
            targets["baseline gateway"] = (baseline.popen.pid, baseline.url, None)
        if args.litellm:
            litellm, litellm_url = spawn_litellm(args.litellm, tmp, fake.url)
            targets["LiteLLM proxy"] = (litellm.pid, litellm_url, {"Authorization": f"Bearer {LITELLM_KEY}"})
        for _, url, headers in targets.values():  # warm connections and code paths
            asyncio.run(load(url + "/v1/chat/completions", args.concurrency, args.tokens, headers))
        for round_ in range(1, args.rounds + 1):
            for name, (pid, url, headers) in targets.items():
                before = tree_cpu_seconds(pid)
                received = asyncio.run(
                    load(url + "/v1/chat/completions", args.concurrency, args.tokens, headers)
                )
                used = tree_cpu_seconds(pid) - before
                print(
                    f"round {round_} {name:16s} concurrency {args.concurrency}: {received} tokens, CPU "
                    f"{used:.2f} s, {used / max(1, received) * 1e6:.0f} us per token",
                    flush=True,
                )
    finally:
        if relay is not None:
            relay.kill()
            relay.wait()
        if litellm is not None:
            os.killpg(litellm.pid, signal.SIGKILL)
            litellm.wait()
        for proc in (gateway, baseline, fake):
            if proc is not None:
                proc.stop()


if __name__ == "__main__":
    main()
