"""What an open console costs the gateway (gateway/console/, docs/console.md; issue 40's bound: an open
console refreshing every second under 2 % of the gateway's CPU at 32 streams), two ways in the same run.

End to end: the gateway's CPU per relayed token at ``--concurrency`` streams from the stub upstream
(kvscope/testing/fake_upstream.py, the load of bench/gateway_cpu.py) in three variants: ``disabled``
(``console.enabled: false``: no sampler, no record ring; a second gateway process), ``closed`` (the console
on, no page open) and ``open`` (the overview open, refreshing every second: ``--client emulated`` makes the
page's requests, ``--client browser`` opens it in a real headless Chromium, kvscope/testing/browser.py).
``--rounds`` cycles of one short round per variant (``--batches`` batches of streams), the order rotated
cycle by cycle; each cycle's ratios of CPU per token (open/closed, open/disabled, closed/disabled) are one
paired sample, printed as a mean with its 95 % bootstrap interval. On a small shared machine one round's
CPU per token varies by several per cent, so this cannot resolve 2 % in a few minutes; it says so.

Decomposition: the console's own work, measured with nothing else moving, in each cycle after its rounds:

- sampler CPU per second: both gateways idle over the same ``--idle-seconds`` window, console on minus off
  (``--settle-seconds`` after the last round: the gateway that served it spends ~2.5 ms/s more for ~10 s
  after, which would count for the sampler or against it, by the rotation);
- CPU per poll: the gateway's CPU over ``--polls`` overview polls back to back (``GET
  /console/api/overview?since=…``, what static/console.js asks once a second, with a browser's headers;
  ``since`` alternately the newest point and the one before, as the page's polls between and across 2 s
  ticks), less its idle CPU over as long;

  cost = (polls per second x CPU per poll + sampler CPU per second) / the gateway's CPU per second at
  ``--concurrency`` streams (the same cycle's ``disabled`` round),

per cycle (so a machine that slows down or speeds up between cycles moves both sides), printed as a mean
with its 95 % bootstrap interval. The run's gateways are 1-8 minutes old; how the console's work grows to an
hour's history (full rings, the alert windows full) is measured in this process: the console of a gateway
app that is built, not served, fed a tick per 2 s of synthetic time until its rings are full, its replicas
given engine samples, with 1 and 4 replicas: the sampler's CPU per tick at an hour over that at 1-4
minutes, and a poll's columns at an hour less at a minute. The "at an hour's history" lines grow the
measured sampler CPU per second and CPU per poll by those (a tick in this loop is hot in the caches, one in
an idle gateway every 2 s is not: the ratio carries over, the absolute figure would not).

CPU is on-CPU time from the scheduler's nanosecond counters (/proc/PID/task/*/schedstat; /proc/PID/stat's
10 ms ticks where schedstat is missing). It prints how busy the rest of the machine was meanwhile (and the
hypervisor's steal): a benchmark, not a test; run it on a quiet machine.

    python bench/console_cost.py [--concurrency 32] [--tokens 128] [--token-delay 0.03] [--rounds 10]
                                 [--batches 2] [--polls 500] [--idle-seconds 5] [--settle-seconds 12]
                                 [--client browser|emulated]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.append(
    str(Path(__file__).resolve().parents[1])
)  # for the other bench scripts (bench.*); after site-packages, so the root kernels/ shadows nothing

from bench.gateway_cpu import add_load_arguments, cpu_seconds, load  # noqa: E402
from kvscope.testing.browser import find_browser, headless_chromium  # noqa: E402
from kvscope.testing.harness import Proc, spawn_fake, spawn_gateway, wait_http  # noqa: E402

VARIANTS = ("disabled", "closed", "open")
POLL_S = 1.0
"""The overview page's refresh period (static/console.js ``POLL_MS``)."""
BOUND = 0.02
"""Issue 40: an open console under 2 % of the gateway's CPU."""
BROWSER_HEADERS = {
    # what Chromium sends with the page's fetch() (the gateway parses every header of every poll)
    "accept": "*/*",
    "accept-encoding": "gzip, deflate, br, zstd",
    "accept-language": "en-US,en;q=0.9",
    "referer": "http://127.0.0.1/console",
    "sec-ch-ua": '"Chromium";v="131", "Not_A Brand";v="24"',
    "sec-ch-ua-mobile": "?0",
    "sec-ch-ua-platform": '"Linux"',
    "sec-fetch-dest": "empty",
    "sec-fetch-mode": "cors",
    "sec-fetch-site": "same-origin",
    "user-agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) "
    "HeadlessChrome/131.0.0.0 Safari/537.36",
}


def cpu_s(pid: int) -> float:
    """On-CPU seconds of process ``pid``: the sum of its live threads' scheduler run time
    (/proc/PID/task/TID/schedstat, first field, nanoseconds); utime + stime of /proc/PID/stat (clock ticks,
    10 ms) where schedstat is missing. Threads that have exited are not in the sum (the gateway's worker
    threads are long-lived and take a few ms in all: its CPU is its event loop's)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
    except (FileNotFoundError, ValueError, IndexError):
        return cpu_seconds(pid)


def mean_interval(samples: Sequence[float], resamples: int = 10_000) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``samples`` and its 95 % percentile-bootstrap interval (``resamples``
    resamples with replacement, a fixed seed: the same samples give the same interval)."""
    rng = random.Random(0)
    n = len(samples)
    means = sorted(statistics.fmean(rng.choices(samples, k=n)) for _ in range(resamples))
    return statistics.fmean(samples), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


# --- the console's own costs --------------------------------------------------------------------------------
def idle_window(on: Proc, off: Proc, seconds: float) -> tuple[float, float]:
    """(CPU seconds per second of the idle gateway with the console, of the one without), both read over the
    same ``seconds``: the difference is the console's sampler (nothing else differs while both are idle)."""
    a, b, start = cpu_s(on.popen.pid), cpu_s(off.popen.pid), time.perf_counter()
    time.sleep(seconds)
    wall = time.perf_counter() - start
    return (cpu_s(on.popen.pid) - a) / wall, (cpu_s(off.popen.pid) - b) / wall


def poll_cost(gateway: Proc, polls: int, idle_per_s: float) -> float:
    """Gateway CPU seconds per overview poll: ``polls`` polls back to back on one keep-alive connection, less
    ``idle_per_s`` (the same gateway's idle CPU per second) over their wall time."""
    with httpx.Client(base_url=gateway.url, headers=BROWSER_HEADERS, timeout=10) as client:
        t = client.get("/console/api/overview").json()["t"]
        before, start = cpu_s(gateway.popen.pid), time.perf_counter()
        for i in range(polls):
            since = t[-1] if i % 2 == 0 or len(t) < 2 else t[-2]
            client.get("/console/api/overview", params={"since": since}).raise_for_status()
        wall, used = time.perf_counter() - start, cpu_s(gateway.popen.pid) - before
    return (used - idle_per_s * wall) / polls


def machine_cpu_s() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, all cores: user, nice, system, irq, softirq; seconds stolen by
    the hypervisor) from /proc/stat's ``cpu`` line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


@dataclass(frozen=True)
class HistoryCosts:
    """CPU seconds, in this process, at a full history and at a minute or two of it."""

    tick_full: float
    """The sampler's tick at a full history."""
    tick_short: float
    """The same over ticks 31-130 (one to four minutes)."""
    columns_full: float
    """A poll's columns (``ConsoleSeries.columns(since)`` + JSON) at a full history."""
    columns_short: float
    """The same at 30 ticks."""
    kept: int
    """Ticks kept when full."""


def full_history_costs(replicas: int, ticks: int = 300) -> HistoryCosts:
    """In this process: a gateway app's console (built, not served) with ``replicas`` upstreams, each with an
    engine sample, and two models' series, fed a tick per 2 s of synthetic time; means over ``ticks`` ticks
    (100 at the short history) and as many polls."""
    from kvscope.gateway.app import create_app
    from kvscope.gateway.engines.samples import EngineSample
    from kvscope.gateway.settings import load_settings

    urls = [{"url": f"http://127.0.0.1:{9 + i}"} for i in range(replicas)]  # never contacted
    app = create_app(load_settings(None, {"upstreams": urls}, env={}))
    console = app.state.console
    metrics, pool, sampler, series = (
        console.gateway.metrics,
        console.gateway.pool,
        console.sampler,
        console.series,
    )
    t0, wall0 = 1000.0, time.time() - 2 * (series.ticks.maxlen or 0)
    step = [0]

    def feed() -> None:
        k = step[0]
        for r in pool.replicas:
            r.engine_sample = EngineSample(
                at=time.monotonic(), requests_running=8.0, requests_waiting=float(k % 5), kv_cache_usage=0.5
            )
        for model in ("model-a", "model-b"):
            metrics.ttft.labels(model).observe(0.05 + 0.01 * (k % 9))
            metrics.tpot.labels(model).observe(0.02 + 0.001 * (k % 11))
            metrics.requests.labels(model, "/v1/chat/completions", "200").inc(3)
            metrics.tokens.labels(model, "output").inc(300)
            metrics.tokens.labels(model, "input").inc(100)

    def tick() -> float:
        feed()
        start = time.process_time()
        sampler.tick(now=t0 + 2 * step[0], wall=wall0 + 2 * step[0])
        step[0] += 1
        return time.process_time() - start

    polls = [0]

    def poll() -> float:
        polls[0] += 1
        since = series.points[-1 - polls[0] % 2].wall  # the newest point, or the one before
        start = time.process_time()
        msgspec.json.encode(series.columns(since))
        return time.process_time() - start

    def timed(fn: Callable[[], float], n: int) -> float:
        return sum(fn() for _ in range(n)) / n

    while len(series.ticks) < 30:
        tick()
    short_poll = timed(poll, ticks)
    short_tick = timed(tick, 100)  # ticks 31-130: one to four minutes of history
    while len(series.ticks) < (series.ticks.maxlen or 0):
        tick()
    return HistoryCosts(timed(tick, ticks), short_tick, timed(poll, ticks), short_poll, len(series.ticks))


# --- end to end ---------------------------------------------------------------------------------------------
async def emulated_console(base: str, stop: asyncio.Event) -> int:
    """What an open overview page asks: the whole history once, then the new points once a second. Returns the
    number of requests made."""
    since: float | None = None
    made = 0
    async with httpx.AsyncClient(base_url=base, headers=BROWSER_HEADERS, timeout=10) as client:
        while not stop.is_set():
            body = (
                await client.get("/console/api/overview", params={} if since is None else {"since": since})
            ).json()
            made += 1
            if body["t"]:
                since = body["t"][-1]
            try:
                await asyncio.wait_for(stop.wait(), POLL_S)
            except TimeoutError:
                pass
    return made


async def round_of_load(url: str, args: argparse.Namespace, console_base: str | None) -> tuple[int, int]:
    """``args.batches`` batches of ``--concurrency`` streams; with ``console_base`` the emulated console polls
    meanwhile. Returns (tokens received, console requests)."""
    stop = asyncio.Event()
    console = asyncio.create_task(emulated_console(console_base, stop)) if console_base else None
    tokens = 0
    for _ in range(args.batches):
        tokens += await load(url, args.concurrency, args.tokens)
    stop.set()
    return tokens, await console if console else 0


def measure(gateway: Proc, args: argparse.Namespace, variant: str, browser: Any) -> tuple[float, float, int]:
    """One round of ``variant`` on ``gateway``: (gateway CPU seconds, wall seconds, tokens)."""
    emulated = variant == "open" and browser is None
    if variant == "open" and browser is not None:
        browser.get(gateway.url + "/console")  # the page polls by itself from now on
        time.sleep(1.0)  # its first load (the whole history) is not a refresh
    before, start = cpu_s(gateway.popen.pid), time.perf_counter()
    tokens, polls = asyncio.run(
        round_of_load(gateway.url + "/v1/chat/completions", args, gateway.url if emulated else None)
    )
    wall, used = time.perf_counter() - start, cpu_s(gateway.popen.pid) - before
    if variant == "open" and browser is not None:
        browser.get("about:blank")
    extra = f", {polls} console requests" if emulated else ""
    print(
        f"  {variant:>8}: {tokens} tokens in {wall:.1f} s, gateway CPU {used:.3f} s = {used / wall:.2%} of a "
        f"core, {used / max(1, tokens) * 1e6:.2f} us per token{extra}",
        flush=True,
    )
    return used, wall, tokens


def paired(results: dict[str, list[tuple[float, float, int]]], a: str, b: str) -> list[float]:
    """Per cycle: ``a``'s CPU per token over ``b``'s, minus 1."""
    return [
        (ua / max(1, na)) / (ub / max(1, nb)) - 1
        for (ua, _, na), (ub, _, nb) in zip(results[a], results[b], strict=True)
    ]


def verdict(n: int, low: float, high: float) -> str:
    """What a paired interval of ``n`` cycles says about the bound."""
    if n < 5:
        return f"{n} cycles: too few for an interval"
    if high < BOUND:
        return "under the 2 % bound"
    if low >= BOUND:
        return "NOT under the 2 % bound"
    return "the interval straddles 2 %: this run does not resolve the bound"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_load_arguments(parser)
    parser.set_defaults(rounds=10)
    parser.add_argument("--batches", type=int, default=2, help="batches of streams per end-to-end round")
    parser.add_argument("--polls", type=int, default=500, help="overview polls per cycle (CPU per poll)")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="idle window per cycle (sampler)")
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=12.0,
        help="wait after a cycle's rounds before its idle window",
    )
    parser.add_argument(
        "--client",
        choices=["browser", "emulated"],
        default="browser" if find_browser() else "emulated",
        help="what keeps the console open end to end: headless chromium, or a client making the page's "
        "requests",
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-console-cost-"))
    fake = spawn_fake(tmp, "stub", token_delay_s=args.token_delay)
    procs = [fake]
    browser = None
    try:
        wait_http(fake.url + "/health", proc=fake.popen)
        base = {"upstreams": [{"url": fake.url}]}
        on = spawn_gateway(tmp, "gateway", {**base, "logs": {"file": str(tmp / "on.jsonl")}})
        off = spawn_gateway(
            tmp,
            "gateway-off",
            {**base, "logs": {"file": str(tmp / "off.jsonl")}, "console": {"enabled": False}},
        )
        procs += [on, off]
        for gw in (on, off):
            wait_http(gw.url + "/readyz", proc=gw.popen)
            asyncio.run(load(gw.url + "/v1/chat/completions", args.concurrency, args.tokens))  # warm up
        print("in this process, the console of a gateway app at an hour's history:", flush=True)
        full: dict[int, HistoryCosts] = {}
        for n in (1, 4):
            full[n] = h = full_history_costs(n)
            print(
                f"  {h.kept} ticks kept, {n} replica(s): sampler {h.tick_full * 1e3:.3f} ms per tick "
                f"({h.tick_short * 1e3:.3f} ms at 1-4 minutes); a poll's columns "
                f"{h.columns_full * 1e6:.0f} us ({h.columns_short * 1e6:.0f} us at 1 minute)",
                flush=True,
            )
        if args.client == "browser":
            browser = headless_chromium()
        print(
            f"\n{args.rounds} cycles; each: a round per variant ({args.batches} batches of "
            f"{args.concurrency} streams x {args.tokens} tokens, {args.token_delay} s between tokens), the "
            f"variants' order rotated; then both gateways idle {args.idle_seconds:g} s (the sampler) and "
            f"{args.polls} overview polls (CPU per poll); console client: {args.client}",
            flush=True,
        )
        ours = [on, off, fake]
        machine0, self0 = machine_cpu_s(), os.times()
        procs0, wall0 = sum(cpu_s(p.popen.pid) for p in ours), time.perf_counter()
        results: dict[str, list[tuple[float, float, int]]] = {v: [] for v in VARIANTS}
        polls: list[float] = []
        samplers: list[float] = []
        for cycle in range(args.rounds):
            print(f"cycle {cycle + 1}:", flush=True)
            order = VARIANTS[cycle % 3 :] + VARIANTS[: cycle % 3]
            for variant in order:
                results[variant].append(measure(off if variant == "disabled" else on, args, variant, browser))
            time.sleep(args.settle_seconds)  # the last round's connections close, its records flush
            idle_on, idle_off = idle_window(on, off, args.idle_seconds)
            samplers.append(idle_on - idle_off)
            polls.append(poll_cost(on, args.polls, idle_on))
            print(
                f"  idle: console on {idle_on * 1e3:.3f} ms/s, off {idle_off * 1e3:.3f} ms/s (sampler "
                f"{samplers[-1] * 1e3:+.3f} ms/s); CPU per poll {polls[-1] * 1e6:.0f} us",
                flush=True,
            )
        machine1, self1 = machine_cpu_s(), os.times()
        procs1, wall = sum(cpu_s(p.popen.pid) for p in ours), time.perf_counter() - wall0
        mine = procs1 - procs0 + (self1.user + self1.system) - (self0.user + self0.system)
        other = machine1[0] - machine0[0] - mine
        print(
            f"the machine meanwhile, outside these processes{' (chromium among them)' if browser else ''}: "
            f"{other / wall:.1%} of a core busy; stolen by the hypervisor: "
            f"{(machine1[1] - machine0[1]) / wall:.1%}"
        )

        per_token = {v: statistics.median(u / max(1, n) for u, _, n in rs) for v, rs in results.items()}
        per_second = {v: statistics.median(u / w for u, w, _ in rs) for v, rs in results.items()}
        print("\nend to end, median over cycles:")
        for v in VARIANTS:
            print(f"  {v:>8}: {per_second[v]:.2%} of a core, {per_token[v] * 1e6:.2f} us per token")
        print("end to end, paired per cycle (CPU per token), mean [95 % bootstrap interval]:")
        for a, b, what in (
            ("open", "closed", "an open page (open vs closed)"),
            ("open", "disabled", "the whole console, open (open vs disabled)"),
            ("closed", "disabled", "the console closed: sampler and record ring (closed vs disabled)"),
        ):
            m, lo, hi = mean_interval(paired(results, a, b))
            print(f"  {what}: {m:+.2%} [{lo:+.2%}, {hi:+.2%}]: {verdict(args.rounds, lo, hi)}")

        # each cycle's parts over the same cycle's gateway CPU per second at full load (its disabled round)
        loads = [u / w for u, w, _ in results["disabled"]]
        page = [(p / POLL_S) / g for p, g in zip(polls, loads, strict=True)]
        whole = [(p / POLL_S + s) / g for p, s, g in zip(polls, samplers, loads, strict=True)]
        per_poll, sampler_s, gateway_s = (statistics.median(x) for x in (polls, samplers, loads))
        print(
            f"\ndecomposition, the console's own costs over the gateway's CPU at {args.concurrency} streams "
            f"(medians: {per_poll * 1e6:.0f} us per poll, sampler {sampler_s * 1e3:.3f} ms/s, gateway "
            f"{gateway_s * 1e3:.1f} ms/s); per cycle, mean [95 % bootstrap interval]:"
        )
        for what, values in (
            (f"an open page: {1 / POLL_S:g} poll/s x CPU per poll", page),
            (f"the whole console, open: {1 / POLL_S:g} poll/s x CPU per poll + sampler", whole),
        ):
            m, lo, hi = mean_interval(values)
            print(f"  {what}: {m:.2%} [{lo:.2%}, {hi:.2%}]: {verdict(args.rounds, lo, hi)}")
        # at an hour: the measured parts, grown as much as they grow in this process from 1-4 minutes of
        # history to an hour's (the run's gateways are 1-8 minutes old: about what that growth starts from)
        for n, h in full.items():
            poll_h = per_poll + max(0.0, h.columns_full - h.columns_short)
            sampler_h = sampler_s * max(1.0, h.tick_full / h.tick_short)
            at_hour = (poll_h / POLL_S + sampler_h) / gateway_s
            print(
                f"  at an hour's history, {n} replica(s): ({1 / POLL_S:g} x {poll_h * 1e6:.0f} us + sampler "
                f"{sampler_h * 1e3:.3f} ms/s) / {gateway_s * 1e3:.1f} ms/s = {at_hour:.2%}"
            )
    finally:
        if browser is not None:
            browser.quit()
        for proc in procs:
            proc.stop()


if __name__ == "__main__":
    main()
