"""Benchmark (not a test) of the Elasticsearch log sink: request-path cost with the cluster up vs down, and
throughput.

Run from the repository root: ``python bench/es_sink.py [--rate 2000] [--seconds 3] [--records 50000]``.

- **request path**: records are emitted at ``--rate`` per second for ``--seconds``, once with the
  Elasticsearch double up (in its own process, ``python -m kvscope.testing.es_double``) and once with
  nothing listening (connection refused, so everything goes to the spool). Reported: the time inside
  ``emit()`` (p50/p99/max) and the event-loop lag seen by a 1 ms ticker (p50/p99/max): a request handler
  on the same loop is delayed by exactly that lag, so "request latency p99 unchanged" means the lag p99
  does not grow when the cluster is down.
- **throughput**: ``--records`` emitted as fast as possible; time until all are in Elasticsearch (double
  up) and until all are on disk (double down). The double parses and validates every document (strict
  mapping) in Python, so the shipped rate is a lower bound for a real cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvscope.gateway.logs.elasticsearch import ElasticsearchSink, ElasticsearchSinkConfig
from kvscope.gateway.logs.es_client import EsConnectionConfig
from kvscope.gateway.logs.es_shipper import ShipperConfig
from kvscope.gateway.logs.spool import SpoolConfig
from kvscope.testing.ports import free_port
from kvscope.testing.records import make_record

REPO = Path(__file__).resolve().parents[1]


def default_config(url: str, queue_size: int = 10_000) -> ElasticsearchSinkConfig:
    """The production defaults (1 s flush, 500-record batches, 0.5→30 s backoff, fsync every second)."""
    return ElasticsearchSinkConfig(
        spool=SpoolConfig(Path(tempfile.mkdtemp())),
        connection=EsConnectionConfig(hosts=(url,)),
        shipper=ShipperConfig(queue_size=queue_size),
    )


def pct(values: list[float], p: float) -> float:
    return (
        statistics.quantiles(values, n=1000, method="inclusive")[int(p * 10) - 1]
        if len(values) > 1
        else values[0]
    )


async def ticker(lags: list[float], stop: asyncio.Event, period_s: float = 0.001) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - start - period_s)


class _NoSink:
    """Baseline: the same pacing loop and ticker with ``emit`` doing nothing (machine noise floor)."""

    class stats:  # noqa: N801 - mimics SinkStats
        shipped = spooled = 0

    async def start(self) -> None: ...

    def emit(self, record: dict) -> None: ...

    async def aclose(self) -> None: ...


async def request_path(url: str | None, rate: int, seconds: float) -> dict[str, float]:
    sink = ElasticsearchSink(default_config(url)) if url else _NoSink()
    await sink.start()
    emit_s: list[float] = []
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(lags, stop))
    records = [make_record(i) for i in range(int(rate * seconds))]
    started = time.perf_counter()
    for i, record in enumerate(records):
        due = started + i / rate
        if due > time.perf_counter():
            await asyncio.sleep(due - time.perf_counter())
        t0 = time.perf_counter()
        sink.emit(record)
        emit_s.append(time.perf_counter() - t0)
    stop.set()
    await tick
    await sink.aclose()
    return {
        "emit_p50_us": pct(emit_s, 50) * 1e6,
        "emit_p99_us": pct(emit_s, 99) * 1e6,
        "emit_max_us": max(emit_s) * 1e6,
        "lag_p50_ms": pct(lags, 50) * 1e3,
        "lag_p99_ms": pct(lags, 99) * 1e3,
        "lag_max_ms": max(lags) * 1e3,
        "shipped": sink.stats.shipped,
        "spooled": sink.stats.spooled,
    }


async def throughput(url: str, n: int, up: bool) -> float:
    sink = ElasticsearchSink(default_config(url, queue_size=20_000))
    await sink.start()
    records = [make_record(i) for i in range(n)]
    started = time.perf_counter()
    for first in range(0, n, 1000):
        for record in records[first : first + 1000]:
            sink.emit(record)
        await asyncio.sleep(0)
    if up:
        assert await sink.wait_idle(600), sink.stats
    else:
        while sink.stats.spooled + sink.stats.dropped < n:
            await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    await sink.aclose()
    return n / elapsed


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.ERROR)
    port, down_url = free_port(), f"http://127.0.0.1:{free_port()}"
    double = subprocess.Popen(
        [sys.executable, "-P", "-m", "kvscope.testing.es_double", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    url = double.stdout.readline().strip()  # type: ignore[union-attr]
    try:
        results = {
            "request_path_no_sink": await request_path(None, args.rate, args.seconds),
            "request_path_es_up": await request_path(url, args.rate, args.seconds),
            "request_path_es_down": await request_path(down_url, args.rate, args.seconds),
            "throughput_shipped_records_per_s": await throughput(url, args.records, up=True),
            "throughput_spooled_records_per_s": await throughput(down_url, args.records, up=False),
        }
    finally:
        double.terminate()
        double.wait()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=2000, help="records per second for the latency runs")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--records", type=int, default=50_000, help="records for the throughput runs")
    asyncio.run(main(parser.parse_args()))
