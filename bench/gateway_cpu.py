"""The gateway's CPU per relayed token: a stub upstream (kvscope/testing/fake_upstream.py) streams
``--tokens`` tokens to each of ``--concurrency`` streams through a gateway process (JSONL request log on); the
gateway's user + system CPU seconds (/proc/PID/stat) over a round, divided by the tokens the client received.
A benchmark, not a test (docs/gateway.md "CPU per relayed token"); optionally writes a py-spy profile of the
gateway (``--py-spy PATH``, py-spy on PATH or ``--py-spy-bin``).

    python bench/gateway_cpu.py [--concurrency 32] [--tokens 128] [--token-delay 0.03] [--rounds 3]
                                [--event-loop auto|uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from kvscope.testing.harness import spawn_fake, spawn_gateway, wait_http


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_once(client: httpx.AsyncClient, url: str, tokens: int) -> int:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen = 0
    async with client.stream("POST", url, json=body) as resp:
        async for piece in resp.aiter_raw():
            seen += piece.count(b'"content":"t')
    return seen


async def load(url: str, concurrency: int, tokens: int, headers: dict[str, str] | None = None) -> int:
    """``concurrency`` streams of ``tokens`` tokens at once (``headers`` on every request, e.g. an API key);
    returns the tokens received."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=120, headers=headers) as client:
        return sum(await asyncio.gather(*(stream_once(client, url, tokens) for _ in range(concurrency))))


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The load's flags (streams, tokens per stream, the stub's pace, rounds), shared with
    bench/relay_floor.py."""
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--token-delay", type=float, default=0.03, help="stub's seconds between tokens")
    parser.add_argument("--rounds", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_load_arguments(parser)
    parser.add_argument("--py-spy", type=Path, help="write a py-spy raw profile of the gateway here")
    parser.add_argument("--py-spy-bin", default="py-spy")
    parser.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="the gateway's event loop (kvscope/common/event_loop.py)",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-gateway-cpu-"))
    fake = spawn_fake(tmp, "stub", token_delay_s=args.token_delay)
    procs = [fake]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        gateway = spawn_gateway(
            tmp,
            "gateway",
            {"upstreams": [{"url": fake.url}], "logs": {"file": str(tmp / "requests.jsonl")}},
            env={"KVSCOPE_GATEWAY_EVENT_LOOP": args.event_loop},
        )
        procs.append(gateway)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        url = gateway.url + "/v1/chat/completions"
        asyncio.run(load(url, args.concurrency, args.tokens))  # warm connections and code paths
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(
                [
                    args.py_spy_bin,
                    "record",
                    "-p",
                    str(gateway.popen.pid),
                    "-o",
                    str(args.py_spy),
                    "-f",
                    "raw",
                    "-r",
                    "200",
                    "-n",
                ]
            )
            time.sleep(1)
        for _ in range(args.rounds):
            before, start = cpu_seconds(gateway.popen.pid), time.perf_counter()
            received = asyncio.run(load(url, args.concurrency, args.tokens))
            wall, used = time.perf_counter() - start, cpu_seconds(gateway.popen.pid) - before
            print(
                f"concurrency {args.concurrency}: {received} tokens in {wall:.2f} s, gateway CPU {used:.2f} "
                f"s, {used / max(1, received) * 1e6:.0f} us per token",
                flush=True,
            )
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
    finally:
        for proc in procs:
            proc.stop()


if __name__ == "__main__":
    main()
