"""The overload benchmark of issue 42: twice the sustainable request rate, interactive and batch traffic, with
admission off and on, in one run.

1. Capacity: the engine without admission under a closed loop of ``--max-num-seqs`` clients sending the mix
   for ``--capacity-s``: output tokens/s and requests/s the machine completes; the sustainable rate is that
   request rate.
2. Overload, once per mode (``off``: every request queued; ``on``: ``--ttft-slo``): Poisson arrivals at
   ``--overload`` x the sustainable rate for ``--duration`` s, ``--interactive-share`` of them interactive
   (tier ``priority``, tenant ``interactive``: short prompt, short answer), the rest batch (tier ``flex``,
   tenant ``batch``: long prompt, long answer), streamed with usage, each waited for.

Reported per mode: per tier the requests sent, answered, refused (and of those, how many carried a
Retry-After and the prediction, and how many were dropped from the queue after admission), TTFT p50/p99 of
the answered ones and the share within the tier's objective; goodput (output tokens/s of the requests
answered within their tier's objective) against the capacity; the engine predictor's median
|predicted - actual| / actual TTFT over the admitted requests. Issue 42's bar, with admission on: interactive
TTFT p99 within its objective, goodput >= 90 % of capacity, every refusal with a Retry-After and a
prediction, the predictor's median error <= 25 %.

The mix decides how far goodput can go: admission serves the interactive tier first and sheds batch work,
so goodput in output tokens approaches the capacity only when an interactive request costs the engine about
what a batch request does per output token. Interactive answers of 128 tokens (a chat's usual length) do;
with 32-token answers (``--interactive-tokens 32``), whose prompt's prefill is spread over a quarter of the
tokens, an interactive output token cost the engine about twice a batch one (measured, docs/benchmarks.md),
and at twice the sustainable rate the interactive half alone took ~70 % of the engine: no admission that
keeps interactive work first could then reach more than ~77 % of the 50/50 closed loop's output tokens/s.

Usage: python -P bench/admission.py [--model smollm2-135m] [--duration 300] [--capacity-s 60]
           [--overload 2] [--ttft-slo priority=2,flex=60] [--ttft-slo-quantile Q] [--interactive-share 0.5]
           [--interactive-words 48] [--interactive-tokens 128] [--batch-words 192] [--batch-tokens 128]
           [--max-num-seqs 8]
           [--port 8123] [--json admission.json]
A benchmark, not a test: it starts its own engine (``kvscope engine``) per phase and takes the machine for
~2 x duration + capacity-s; its numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvscope.bench.arrival import arrival_offsets, inter_arrival_times, paced

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")


@dataclass(frozen=True, slots=True)
class Kind:
    """One side of the traffic mix."""

    name: str
    """``interactive`` or ``batch``: the tenant (``x-kvscope-tenant``) too."""
    tier: str
    """The body's ``service_tier``."""
    prompt_words: int
    max_tokens: int


INTERACTIVE = Kind("interactive", "priority", 48, 128)
"""Chat: a short prompt, an answer of a chat's usual length (``--interactive-tokens``)."""
BATCH = Kind("batch", "flex", 192, 128)
"""Batch: a long prompt (``--batch-words``), a long answer (``--batch-tokens``)."""


@dataclass(frozen=True, slots=True)
class Mix:
    """The offered traffic: ``interactive_share`` of the requests ``interactive``, the rest ``batch``."""

    interactive: Kind = INTERACTIVE
    batch: Kind = BATCH
    interactive_share: float = 0.5


@dataclass(slots=True)
class Record:
    """One request as the client saw it, plus the engine's ``kvscope`` object."""

    kind: str
    tier: str
    status: int = 0
    ttft_s: float | None = None
    """Client-side: sent → first token event."""
    output_tokens: int = 0
    retry_after: str | None = None
    error: str = ""
    kvscope: dict[str, Any] = field(default_factory=dict)
    """The engine's ``kvscope`` object (the final usage chunk, or the refusal's body)."""

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.ttft_s is not None and not self.error

    @property
    def refused(self) -> bool:
        return self.status == 503


def prompt_text(kind: Kind, seed: int) -> str:
    """A prompt of ``kind.prompt_words`` words, different per ``seed`` from its first word (no prefix-cache
    hits between requests)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(kind.prompt_words))


def body(kind: Kind, seed: int) -> dict[str, Any]:
    """The completions body of one request of ``kind``: greedy, ``ignore_eos`` (a known length), streamed
    with usage, in the kind's tier."""
    return {
        "prompt": prompt_text(kind, seed),
        "max_tokens": kind.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "service_tier": kind.tier,
    }


async def send(client: httpx.AsyncClient, base_url: str, kind: Kind, seed: int) -> Record:
    """One streamed request; never raises for a failed one (``error`` says why)."""
    record = Record(kind.name, kind.tier)
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST",
            base_url + "/v1/completions",
            json=body(kind, seed),
            headers={"x-kvscope-tenant": kind.name},
        ) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.retry_after = response.headers.get("retry-after")
                payload = json.loads(await response.aread())
                record.error = payload.get("error", {}).get("message", "")
                record.kvscope = payload.get("kvscope") or {}
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = event["error"].get("message", "stream error")
                    return record
                if record.ttft_s is None and any(c.get("text") for c in event.get("choices", ())):
                    record.ttft_s = time.perf_counter() - start
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
                    record.kvscope = event.get("kvscope") or {}
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def pick(rng: random.Random, mix: Mix) -> Kind:
    return mix.interactive if rng.random() < mix.interactive_share else mix.batch


async def closed_loop(base_url: str, clients: int, seconds: float, mix: Mix) -> list[Record]:
    """``clients`` clients, each sending its next request when its last one ends, for ``seconds``."""
    deadline = time.perf_counter() + seconds
    records: list[Record] = []

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(index)
        n = 0
        while time.perf_counter() < deadline:
            records.append(await send(client, base_url, pick(rng, mix), index * 1_000_000 + n))
            n += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0)) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
    return records


async def open_loop(base_url: str, rate: float, seconds: float, mix: Mix) -> tuple[list[Record], float]:
    """Poisson arrivals at ``rate`` requests/s for ``seconds``; every request waited for. Returns the records
    and the seconds from the first arrival to the last answer's end."""
    num = max(1, round(rate * seconds))
    offsets = arrival_offsets(inter_arrival_times(num, rate, seed=42))
    rng = random.Random(7)
    kinds = [pick(rng, mix) for _ in range(num)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        tasks = []
        async for i in paced(list(range(num)), offsets, time.perf_counter):
            tasks.append(asyncio.ensure_future(send(client, base_url, kinds[i], 10_000_000 + i)))
        records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - start


def quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(
    records: Sequence[Record], slos: dict[str, float], capacity_tok_s: float, seconds: float
) -> dict[str, Any]:
    """One mode's numbers (see the module docstring). ``slos``: tier → TTFT objective (s; a tier without
    one: every answered request counts as within); ``capacity_tok_s``: the closed loop's output tokens/s;
    ``seconds``: from the first arrival to the last answer (goodput's denominator)."""
    tiers: dict[str, Any] = {}
    good_tokens = 0
    for tier in sorted({r.tier for r in records}):
        mine = [r for r in records if r.tier == tier]
        answered = [r for r in mine if r.answered]
        ttfts = [r.ttft_s for r in answered if r.ttft_s is not None]
        slo = slos.get(tier)
        within = [r for r in answered if slo is None or (r.ttft_s is not None and r.ttft_s <= slo)]
        good_tokens += sum(r.output_tokens for r in within)
        refused = [r for r in mine if r.refused]
        tiers[tier] = {
            "sent": len(mine),
            "answered": len(answered),
            "refused": len(refused),
            "refused_with_retry_after_and_prediction": sum(
                1 for r in refused if r.retry_after and r.kvscope.get("predicted_ttft_s") is not None
            ),
            "refused_from_queue": sum(1 for r in refused if r.error.startswith("waited ")),
            "failed": len(mine) - len(answered) - len(refused),
            "ttft_p50_s": quantile(ttfts, 0.5),
            "ttft_p99_s": quantile(ttfts, 0.99),
            "within_slo": len(within) / len(answered) if answered else None,
            "slo_s": slo,
        }
    errors = [
        abs(r.kvscope["predicted_ttft_s"] - r.kvscope["ttft_s"]) / r.kvscope["ttft_s"]
        for r in records
        if r.answered and r.kvscope.get("predicted_ttft_s") is not None and r.kvscope.get("ttft_s")
    ]
    goodput = good_tokens / seconds
    return {
        "tiers": tiers,
        "goodput_tok_s": goodput,
        "goodput_of_capacity": goodput / capacity_tok_s if capacity_tok_s else None,
        "prediction_error_median": statistics.median(errors) if errors else None,
        "predicted_requests": len(errors),
    }


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """One line per mode and tier, then one per mode for goodput and the predictor."""
    lines = ["mode tier      sent answered refused(+RA&pred, from queue) TTFT p50 / p99 s  within SLO"]
    for mode, result in results.items():
        for tier, t in result["tiers"].items():
            p50, p99 = (f"{v:.2f}" if v is not None else "-" for v in (t["ttft_p50_s"], t["ttft_p99_s"]))
            within = f"{t['within_slo']:.1%}" if t["within_slo"] is not None else "-"
            lines.append(
                f"{mode:<4} {tier:<9} {t['sent']:>4} {t['answered']:>8} "
                f"{t['refused']:>7}({t['refused_with_retry_after_and_prediction']}, "
                f"{t['refused_from_queue']}) "
                f"{p50:>8} / {p99:<7} {within}"
            )
    for mode, result in results.items():
        share = result["goodput_of_capacity"]
        error = result["prediction_error_median"]
        lines.append(
            f"{mode}: goodput {result['goodput_tok_s']:.1f} tok/s"
            + (f" ({share:.1%} of capacity)" if share is not None else "")
            + (f"; predictor median |error| {error:.1%} over {result['predicted_requests']}" if error else "")
        )
    return lines


def start_engine(args: argparse.Namespace, ttft_slo: str | None) -> subprocess.Popen:
    """``kvscope engine`` on ``args.port`` (with ``--ttft-slo`` when given); returns once /health answers.
    Raises RuntimeError when it exits or is not up within 900 s."""
    command = [sys.executable, "-P", "-m", "kvscope.engine.server", "--model", args.model]
    command += ["--port", str(args.port), "--max-num-seqs", str(args.max_num_seqs)]
    if ttft_slo:
        command += ["--ttft-slo", ttft_slo]
        if args.ttft_slo_quantile is not None:
            command += ["--ttft-slo-quantile", str(args.ttft_slo_quantile)]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited with {process.returncode}: {' '.join(command)}")
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.terminate()
    raise RuntimeError("the engine did not become healthy within 900 s")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


def parse_slos(text: str) -> dict[str, float]:
    """``priority=2,flex=60`` → {"priority": 2.0, "flex": 60.0} (the engine's ``--ttft-slo`` form)."""
    return {tier.strip(): float(value) for tier, _, value in (p.partition("=") for p in text.split(","))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per mode")
    parser.add_argument("--capacity-s", type=float, default=60.0)
    parser.add_argument("--overload", type=float, default=2.0, help="x the sustainable request rate")
    parser.add_argument("--ttft-slo", default="priority=2,flex=60")
    parser.add_argument(
        "--ttft-slo-quantile", type=float, default=None, help="the engine's (default: the engine's default)"
    )
    parser.add_argument("--interactive-share", type=float, default=0.5)
    parser.add_argument("--interactive-words", type=int, default=INTERACTIVE.prompt_words)
    parser.add_argument("--interactive-tokens", type=int, default=INTERACTIVE.max_tokens)
    parser.add_argument("--batch-words", type=int, default=BATCH.prompt_words)
    parser.add_argument("--batch-tokens", type=int, default=BATCH.max_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    base_url = f"http://127.0.0.1:{args.port}"
    slos = parse_slos(args.ttft_slo)
    mix = Mix(
        Kind(INTERACTIVE.name, INTERACTIVE.tier, args.interactive_words, args.interactive_tokens),
        Kind(BATCH.name, BATCH.tier, args.batch_words, args.batch_tokens),
        args.interactive_share,
    )

    engine = start_engine(args, None)
    try:
        start = time.perf_counter()
        capacity = asyncio.run(closed_loop(base_url, args.max_num_seqs, args.capacity_s, mix))
        elapsed = time.perf_counter() - start
    finally:
        stop(engine)
    done = [r for r in capacity if r.answered]
    capacity_tok_s = sum(r.output_tokens for r in done) / elapsed
    rate = args.overload * len(done) / elapsed
    print(f"capacity: {capacity_tok_s:.1f} tok/s, {len(done) / elapsed:.2f} req/s; offering {rate:.2f} req/s")

    results: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[dict[str, Any]]] = {}
    for mode, ttft_slo in (("off", None), ("on", args.ttft_slo)):
        engine = start_engine(args, ttft_slo)
        try:
            records, seconds = asyncio.run(open_loop(base_url, rate, args.duration, mix))
        finally:
            stop(engine)
        results[mode] = summarize(records, slos, capacity_tok_s, seconds)
        raw[mode] = [asdict(r) for r in records]
    print("\n".join(table(results)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "capacity_tok_s": capacity_tok_s, "rate": rate, "results": results,
                       "records": raw}, out, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
