"""Gateway overhead benchmark: latency added by the gateway in front of a fast stub upstream.

Starts the stub upstream (tests/gateway/fake_upstream.py, no delays) and a gateway process in front of it
(JSONL request log on, tracing on without an exporter, in-memory limits), then measures from one client
process, in the same run and interleaved: non-streaming latency (request → full body) and streaming TTFT
(request → first token event), at concurrency 1 and 64, directly against the stub and through the gateway.
Reports p50/p99 of each and the difference (the gateway's added latency), plus the gateway's own
``kvscope_gateway_overhead_seconds`` mean.

    python bench/gateway_overhead.py [--requests 400] [--concurrency 1 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gateway.harness import metric_samples, sample, spawn_fake, spawn_gateway, wait_http  # noqa: E402

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


async def one(client: httpx.AsyncClient, url: str, stream: bool) -> float:
    start = time.perf_counter()
    if not stream:
        resp = await client.post(url, json=BODY)
        resp.raise_for_status()
        return time.perf_counter() - start
    ttft = None
    async with client.stream("POST", url, json={**BODY, "stream": True}) as resp:
        async for piece in resp.aiter_raw():
            if ttft is None and b'"content":"t' in piece:
                ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


async def measure(base: str, stream: bool, concurrency: int, total: int) -> list[float]:
    url = base + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        await asyncio.gather(*(one(client, url, stream) for _ in range(concurrency)))  # warm connections
        per_worker = max(1, total // concurrency)

        async def worker() -> list[float]:
            return [await one(client, url, stream) for _ in range(per_worker)]

        results = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [x for r in results for x in r]


def run(requests: int, concurrencies: list[int]) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    fake = spawn_fake(tmp, "stub")
    procs = [fake]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        gateway = spawn_gateway(tmp, "gateway", {"upstreams": [{"url": fake.url}],
                                                 "logs": {"file": str(tmp / "requests.jsonl")}})
        procs.append(gateway)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        rows = []
        for stream in (False, True):
            for c in concurrencies:
                row = {"mode": "ttft" if stream else "non-streaming", "concurrency": c}
                for name, base in (("direct", fake.url), ("gateway", gateway.url), ("direct2", fake.url)):
                    values = asyncio.run(measure(base, stream, c, requests))
                    row[name] = {"p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3,
                                 "n": len(values)}
                direct = {k: min(row["direct"][k], row["direct2"][k]) for k in ("p50_ms", "p99_ms")}
                row["added_p50_ms"] = row["gateway"]["p50_ms"] - direct["p50_ms"]
                row["added_p99_ms"] = row["gateway"]["p99_ms"] - direct["p99_ms"]
                rows.append(row)
        samples = metric_samples(httpx.get(gateway.url + "/metrics").text)
        total = sample(samples, "kvscope_gateway_overhead_seconds_sum", route="/v1/chat/completions")
        count = sample(samples, "kvscope_gateway_overhead_seconds_count", route="/v1/chat/completions")
        return {"rows": rows, "gateway_overhead_mean_ms": total / count * 1e3 if count else None}
    finally:
        for proc in procs:
            proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    result = run(args.requests, args.concurrency)
    print(f"{'metric':<14}{'conc':>5}  {'direct p50/p99 ms':>19}  {'gateway p50/p99 ms':>19}  {'added p50/p99 ms':>17}")
    for r in result["rows"]:
        d = {k: min(r["direct"][k], r["direct2"][k]) for k in ("p50_ms", "p99_ms")}
        print(f"{r['mode']:<14}{r['concurrency']:>5}  {d['p50_ms']:>8.2f} / {d['p99_ms']:<8.2f}  "
              f"{r['gateway']['p50_ms']:>8.2f} / {r['gateway']['p99_ms']:<8.2f}  "
              f"{r['added_p50_ms']:>7.2f} / {r['added_p99_ms']:<7.2f}")
    print(f"gateway-measured overhead (kvscope_gateway_overhead_seconds mean): "
          f"{result['gateway_overhead_mean_ms']:.3f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
