"""Benchmark (not a test): request latency through the real gateway with its Elasticsearch log sink shipping
(cluster up) vs spooling to disk (cluster down), next to a gateway without the sink.

Starts the stub upstream (kvscope/testing/fake_upstream.py, no delays, 16 tokens), the Elasticsearch double
(kvscope/testing/es_double.py) in its own process, taken down (connection refused) and brought back through
its stdin, and two gateway processes in front of the stub: one with the production sink settings
(``logs.elasticsearch``: 1 s flush, 500-record batches, spool fsync every second) and one without any
request-log sink. One client process measures, at ``--concurrency``: non-streaming latency (request → full
body) and streaming TTFT (request → first token event), in ``--rounds`` interleaved rounds of ``--requests /
--rounds`` per cell. Cells: ``no sink`` (the second gateway), ``ES up`` (measured once the spool left by the
previous outage is replayed), ``ES down`` (measured once the sink has noticed the outage and spools). Failed
requests are counted, not timed. Also reported per cell: the mean of the gateway's own
``kvscope_gateway_overhead_seconds`` (e2e at the gateway minus time waiting on the stub), and at the end,
after a last replay, the sink's ``kvscope_gateway_log_records_total{sink="elasticsearch"}``, checked against
the requests it served (every record shipped, none failed or dropped).

The double parses every bulk in Python on the same machine, so "ES up" also pays for the cluster's CPU;
on a shared 2-core machine the spread between rounds is larger than the differences measured.

    python bench/es_gateway_latency.py [--requests 500] [--concurrency 8] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.append(
    str(REPO)
)  # for the other bench scripts (bench.*); after site-packages, so the root kernels/ shadows nothing

from bench.gateway_overhead import one, overhead, percentile  # noqa: E402
from kvscope.testing.harness import (  # noqa: E402
    Proc,
    free_port,
    metric_samples,
    sample,
    spawn_fake,
    spawn_gateway,
    wait_http,
)

STATES = ("no sink", "ES up", "ES down")
MODES = ("non-streaming", "TTFT")
OUTCOMES = ("shipped", "failed", "dropped")
"""Final outcomes of kvscope_gateway_log_records_total; ``spooled`` has its own counter."""


# ---- the Elasticsearch double, in its own process, controlled through stdin ------------------------------
async def serve_double(port: int) -> None:
    """``--es-double PORT``: serve the double; stdin lines ``down``/``up`` stop/restart listening (same
    port, state kept), each answered ``ok`` on stdout."""
    from kvscope.testing.es_double import EsDouble

    double = EsDouble()
    double.port = port
    await double.come_up()
    print("ok", flush=True)
    while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
        await (double.go_down() if line == "down" else double.come_up())
        print("ok", flush=True)


class DoubleProcess:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--es-double", str(port)],
            cwd=REPO,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._ack()

    def _ack(self) -> None:
        line = self.popen.stdout.readline()  # type: ignore[union-attr]
        if line.strip() != "ok":
            raise RuntimeError(f"Elasticsearch double did not answer (got {line!r})")

    def command(self, cmd: str) -> None:
        self.popen.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.popen.stdin.flush()  # type: ignore[union-attr]
        self._ack()

    def stop(self) -> None:
        self.popen.terminate()
        self.popen.wait(5)


# ---- measurement -----------------------------------------------------------------------------------------
async def measure(base: str, stream: bool, concurrency: int, total: int) -> list[float | None]:
    """``total`` requests, ``concurrency`` at a time, after one warm-up request per connection (not timed)."""
    url = base + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        await asyncio.gather(*(one(client, url, stream) for _ in range(concurrency)))
        left = [total]
        out: list[float | None] = []

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                out.append(await one(client, url, stream))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def sink_counts(gateway: Proc) -> dict[str, float]:
    samples = metric_samples(httpx.get(gateway.url + "/metrics", timeout=5).text)
    counts = {
        o: sample(samples, "kvscope_gateway_log_records_total", sink="elasticsearch", outcome=o)
        for o in OUTCOMES
    }
    counts["spooled"] = sample(samples, "kvscope_gateway_log_records_spooled_total", sink="elasticsearch")
    counts["spool_bytes"] = sample(samples, "kvscope_gateway_log_spool_bytes")
    return counts


def wait_until(check: Any, timeout_s: float, what: str) -> float:
    """Poll ``check()`` every 20 ms until true; returns the seconds waited. Raises TimeoutError."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(what)
        time.sleep(0.02)
    return time.monotonic() - start


def enter_state(state: str, es: DoubleProcess, gateway: Proc, current: str) -> str:
    """Bring Elasticsearch to ``state`` and wait for the sink to be steady in it: replayed (up) or
    spooling (down)."""
    if state == "ES up" and current != "ES up":
        es.command("up")
        wait_until(lambda: sink_counts(gateway)["spool_bytes"] == 0, 120, "spool replay")
        return "ES up"
    if state == "ES down" and current != "ES down":
        es.command("down")
        spooled = sink_counts(gateway)["spooled"]
        asyncio.run(measure(gateway.url, False, 1, 4))  # records for the sink to fail on
        wait_until(lambda: sink_counts(gateway)["spooled"] > spooled, 30, "outage noticed")
        return "ES down"
    return current


def run(requests: int, concurrency: int, rounds: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-es-"))
    es = DoubleProcess(free_port())
    fake = spawn_fake(tmp, "stub")
    procs = [fake]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        base = {"upstreams": [{"url": fake.url}], "routing": {"health_interval_s": 60}}
        with_sink = spawn_gateway(
            tmp,
            "gateway-es",
            {**base, "logs": {"elasticsearch": {"hosts": [es.url], "spool_dir": str(tmp / "spool")}}},
        )
        without = spawn_gateway(tmp, "gateway-plain", base)
        procs += [with_sink, without]
        for gateway in (with_sink, without):
            wait_http(gateway.url + "/readyz", proc=gateway.popen)
        cells = {(s, m): Cell() for s in STATES for m in MODES}
        current, per_round = "ES up", requests // rounds
        for r in range(rounds):
            for state in STATES if r % 2 == 0 else STATES[::-1]:
                current = enter_state(state, es, with_sink, current)
                target = without if state == "no sink" else with_sink
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    cells[(state, mode)].add(target, mode == "TTFT", concurrency, per_round)
        enter_state("ES up", es, with_sink, current)
        served = overhead(with_sink.url)[1]
        try:
            wait_until(lambda: sink_counts(with_sink)["shipped"] >= served, 30, "every record shipped")
        except TimeoutError:
            pass  # reported as a mismatch below
        return {
            "rows": [cells[(s, m)].row(s, m) for s in STATES for m in MODES],
            "sink_outcomes": sink_counts(with_sink),
            "sink_gateway_requests": served,
            "requests_per_cell": per_round * rounds,
            "concurrency": concurrency,
            "rounds": rounds,
        }
    finally:
        for proc in procs:
            proc.stop()
        es.stop()


class Cell:
    """One (state, metric) cell: client-side samples and the gateway's self-time over its requests."""

    def __init__(self) -> None:
        self.values: list[float | None] = []
        self.self_s = self.self_n = 0.0

    def add(self, gateway: Proc, stream: bool, concurrency: int, total: int) -> None:
        before = overhead(gateway.url)
        self.values += asyncio.run(measure(gateway.url, stream, concurrency, total))
        after = overhead(gateway.url)
        self.self_s += after[0] - before[0]
        self.self_n += after[1] - before[1]

    def row(self, state: str, mode: str) -> dict[str, Any]:
        ok = [v for v in self.values if v is not None]
        return {
            "state": state,
            "mode": mode,
            "n": len(ok),
            "errors": len(self.values) - len(ok),
            "p50_ms": percentile(ok, 50) * 1e3 if ok else float("nan"),
            "p99_ms": percentile(ok, 99) * 1e3 if ok else float("nan"),
            "self_mean_ms": self.self_s / max(1.0, self.self_n) * 1e3,
        }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{result['requests_per_cell']} requests per cell, concurrency {result['concurrency']}, "
        f"{result['rounds']} interleaved rounds"
    )
    print(f"{'state':<10}{'metric':<15}{'p50 ms':>9}{'p99 ms':>9}{'self ms':>9}{'n':>6}{'errors':>8}")
    for row in result["rows"]:
        print(
            f"{row['state']:<10}{row['mode']:<15}{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}"
            f"{row['self_mean_ms']:>9.3f}{row['n']:>6}{row['errors']:>8}"
        )
    counts = result["sink_outcomes"]
    print(
        f"sink gateway served {int(result['sink_gateway_requests'])} chat requests (incl. warm-up); "
        "Elasticsearch sink records: "
        + ", ".join(f"{o} {int(counts[o])}" for o in (*OUTCOMES, "spooled"))
        + f"; spool bytes {int(counts['spool_bytes'])}"
    )
    complete = (
        counts["shipped"] == result["sink_gateway_requests"]
        and counts["spool_bytes"] == 0
        and counts["failed"] == counts["dropped"] == 0
    )
    print("every record shipped exactly once" if complete else "MISMATCH: records missing or failed")
    print(
        "self: mean kvscope_gateway_overhead_seconds of the cell's requests (gateway time not spent waiting "
        "on the upstream)"
    )


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--es-double":
        asyncio.run(serve_double(int(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per cell (state × metric)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds the requests are split into"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    result = run(args.requests, args.concurrency, args.rounds)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
