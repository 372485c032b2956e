"""How many request-log records a SIGKILLed gateway loses mid-outage, and how old the oldest of them was at
the kill: the loss window docs/logs.md ("Spool and fsync policy") states, measured. A benchmark, not a test
(tests/gateway/logs/test_gateway_kill_replay.py asserts the guarantee with events: nothing the sink had
reported spooled is lost; tests/gateway/logs/test_es_sink.py checks the hand-off schedule).

Each round: a stub upstream, the Elasticsearch double (down: connection refused) and the real gateway with the
production sink settings (1 s flush, 500-record batches, hand-off to the spool every ``SPOOLED_HANDOFF_S``
once the outage is noticed); ``--requests`` requests (every other one streamed, ``--concurrency`` at a time)
paced over ``--outage-s`` seconds, then a SIGKILL right after the last response. A record is lost when its
request id is not in the spool files at the kill; its age is the kill time less the client's response end
(the gateway emits the record as the response ends, so that is the record's age within a millisecond or so).

    python bench/spool_loss_window.py [--rounds 5] [--requests 200] [--outage-s 2] [--concurrency 8]

Prints one line per round and a JSON summary (lost per round; the oldest lost record's age, ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvscope.gateway.logs.elasticsearch import SPOOLED_HANDOFF_S
from kvscope.testing.es_double import EsDouble
from kvscope.testing.harness import LoopThread, spawn_fake, spawn_gateway, wait_http


async def send_paced(base: str, ids: list[str], over_s: float, concurrency: int) -> dict[str, float]:
    """One request per id (odd positions streamed), ``concurrency`` at a time, request ``i`` starting no
    earlier than ``i/len(ids)·over_s`` after the first. Returns id → ``time.monotonic()`` at its response
    end."""
    todo = list(enumerate(ids))
    done: dict[str, float] = {}
    start = time.monotonic()
    async with httpx.AsyncClient(
        base_url=base, timeout=20, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def worker() -> None:
            while todo:
                i, rid = todo.pop(0)
                await asyncio.sleep(max(0.0, start + i * over_s / len(ids) - time.monotonic()))
                body = {
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": f"hello {rid}"}],
                    "max_tokens": 4,
                    "stream": i % 2 == 1,
                }
                response = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
                response.raise_for_status()
                done[rid] = time.monotonic()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def spooled_ids(spool: Path) -> set[str]:
    """Request ids of the complete lines in the spool segments."""
    ids = set()
    for segment in sorted(spool.glob("seg-*.jsonl")):  # the segment names of gateway/logs/spool.py
        for line in segment.read_bytes().split(b"\n")[:-1]:
            ids.add(json.loads(line)["http"]["request"]["id"])
    return ids


def one_round(tmp: Path, es_url: str, args: argparse.Namespace, round_no: int) -> tuple[int, float | None]:
    """(records lost, age in seconds of the oldest lost one at the kill, None when none was lost)."""
    spool = tmp / f"spool-{round_no}"
    fake = spawn_fake(tmp, f"upstream-{round_no}")
    gateway = None
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        config = {
            "upstreams": [{"url": fake.url}],
            "routing": {"health_interval_s": 60},
            "logs": {"elasticsearch": {"hosts": [es_url], "spool_dir": str(spool)}},
        }
        gateway = spawn_gateway(tmp, f"gateway-{round_no}", config)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        ids = [f"r{round_no}-{i:05d}" for i in range(args.requests)]
        done = asyncio.run(send_paced(gateway.url, ids, args.outage_s, args.concurrency))
        killed_at = time.monotonic()
        gateway.popen.send_signal(signal.SIGKILL)
        gateway.popen.wait(5)
        lost = set(ids) - spooled_ids(spool)
    finally:
        for proc in (gateway, fake):
            if proc is not None:
                proc.stop()
    return len(lost), max((killed_at - done[rid] for rid in lost), default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description="Records a SIGKILLed gateway loses mid-outage")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--outage-s", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    loop = LoopThread()
    es = loop.run(EsDouble(major=9).__aenter__())
    loop.run(es.go_down())
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_no in range(args.rounds):
                lost, age = one_round(Path(tmp), es.url, args, round_no)
                results.append((lost, age))
                shown = "-" if age is None else f"{age * 1000:.0f} ms"
                print(
                    f"round {round_no + 1}: {lost} of {args.requests} lost, oldest lost {shown}", flush=True
                )
    finally:
        loop.stop()
    ages = [age for _, age in results if age is not None]
    summary = {
        "rounds": args.rounds,
        "requests": args.requests,
        "outage_s": args.outage_s,
        "spooled_handoff_s": SPOOLED_HANDOFF_S,
        "lost": [lost for lost, _ in results],
        "lost_median": statistics.median(lost for lost, _ in results),
        "oldest_lost_ms_max": round(max(ages) * 1000, 1) if ages else None,
    }
    print(json.dumps(summary), file=sys.stdout)


if __name__ == "__main__":
    main()
