"""Gateway overhead benchmark: latency added by the gateway in front of a fast stub upstream.

Starts the stub upstream (kvscope/testing/fake_upstream.py, no delays) and a gateway process in front of it
(JSONL request log on, tracing on without an exporter, in-memory limits), then measures from one client
process, in the same run and interleaved: non-streaming latency (request → full body) and streaming TTFT
(request → first token event), at concurrency 1 and 64, directly against the stub and through the gateway.
Reports p50/p99 of each and the difference (the gateway's added latency), plus the mean of the gateway's
own ``kvscope_gateway_overhead_seconds`` over each gateway phase. Failed requests are counted, not timed.

    python bench/gateway_overhead.py [--requests 400] [--concurrency 1 64] [--json out.json]
                                     [--gateway-pythonpath DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from kvscope.testing.harness import metric_samples, sample, spawn_fake, spawn_gateway, wait_http

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


async def one(client: httpx.AsyncClient, url: str, stream: bool) -> float | None:
    """Latency (non-streaming) or TTFT (streaming) of one request; None if it failed."""
    try:
        return await _one(client, url, stream)
    except (httpx.HTTPError, AssertionError):
        return None


async def _one(client: httpx.AsyncClient, url: str, stream: bool) -> float:
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


async def measure(base: str, stream: bool, concurrency: int, total: int) -> list[float | None]:
    url = base + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        await asyncio.gather(*(one(client, url, stream) for _ in range(concurrency)))  # warm connections
        per_worker = max(1, total // concurrency)

        async def worker() -> list[float | None]:
            return [await one(client, url, stream) for _ in range(per_worker)]

        results = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [x for r in results for x in r]


def overhead(gateway_url: str) -> tuple[float, float]:
    """(sum, count) of the gateway's own ``kvscope_gateway_overhead_seconds`` for chat completions."""
    samples = metric_samples(httpx.get(gateway_url + "/metrics").text)
    route = {"route": "/v1/chat/completions"}
    return (
        sample(samples, "kvscope_gateway_overhead_seconds_sum", **route),
        sample(samples, "kvscope_gateway_overhead_seconds_count", **route),
    )


def run(requests: int, concurrencies: list[int], pythonpath: str = "") -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    fake = spawn_fake(tmp, "stub")
    procs = [fake]
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        gateway = spawn_gateway(
            tmp,
            "gateway",
            {"upstreams": [{"url": fake.url}], "logs": {"file": str(tmp / "requests.jsonl")}},
            pythonpath,
        )
        procs.append(gateway)
        wait_http(gateway.url + "/readyz", proc=gateway.popen)
        rows = []
        for stream in (False, True):
            for c in concurrencies:
                row: dict = {"mode": "ttft" if stream else "non-streaming", "concurrency": c}
                for name, base in (("direct", fake.url), ("gateway", gateway.url), ("direct2", fake.url)):
                    before = overhead(gateway.url)
                    values = asyncio.run(measure(base, stream, c, requests))
                    ok = [v for v in values if v is not None]
                    row[name] = {
                        "p50_ms": percentile(ok, 50) * 1e3,
                        "p99_ms": percentile(ok, 99) * 1e3,
                        "n": len(ok),
                        "errors": len(values) - len(ok),
                    }
                    if name == "gateway":
                        after = overhead(gateway.url)
                        row["self_overhead_mean_ms"] = (
                            (after[0] - before[0]) / max(1, after[1] - before[1]) * 1e3
                        )
                row["direct_best"] = {
                    k: min(row["direct"][k], row["direct2"][k]) for k in ("p50_ms", "p99_ms")
                }
                row["added_p50_ms"] = row["gateway"]["p50_ms"] - row["direct_best"]["p50_ms"]
                row["added_p99_ms"] = row["gateway"]["p99_ms"] - row["direct_best"]["p99_ms"]
                rows.append(row)
        return {"rows": rows}
    finally:
        for proc in procs:
            proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--gateway-pythonpath",
        default="",
        help="extra import path for the gateway process, e.g. a folder holding uvloop and httptools "
        "(`pip install --target DIR uvloop httptools`): uvicorn then uses them",
    )
    args = parser.parse_args()
    result = run(args.requests, args.concurrency, args.gateway_pythonpath)
    print(
        f"{'metric':<14}{'conc':>5}  {'direct p50/p99 ms':>19}  {'gateway p50/p99 ms':>19}  "
        f"{'added p50/p99 ms':>17}  {'self ms':>7}  errors"
    )
    for r in result["rows"]:
        d, g = r["direct_best"], r["gateway"]
        errors = sum(r[k]["errors"] for k in ("direct", "gateway", "direct2"))
        print(
            f"{r['mode']:<14}{r['concurrency']:>5}  {d['p50_ms']:>8.2f} / {d['p99_ms']:<8.2f}  "
            f"{g['p50_ms']:>8.2f} / {g['p99_ms']:<8.2f}  {r['added_p50_ms']:>7.2f} / "
            f"{r['added_p99_ms']:<7.2f}  {r['self_overhead_mean_ms']:>7.3f}  {errors}"
        )
    print(
        "direct: best of two runs bracketing the gateway run; self: mean kvscope_gateway_overhead_seconds "
        "(e2e at the gateway minus time waiting on the upstream)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
