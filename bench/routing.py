"""Cache-aware routing over engine replicas on one machine (issue 37's first "Done when" bullet).

Starts ``--replicas`` (4) kvscope engines on this machine (``--num-threads`` 1 each, ``--kv-cache-memory``
1 GiB each: room for every prefix of the workload, so no policy loses hits to eviction; prefix caching on, the
default) and, per routing policy, one gateway in front of them (``kvscope gateway --routing POLICY
--tokenizer smollm2-135m=<hf folder>``: token-level prefixes in the engines' own block size). Before every
policy run the engines are restarted, so each policy starts on empty prefix caches (the engine has no
cache-reset endpoint); the first start picks the weight format (``--dtype/--quantization auto``) and every
later start is pinned to it, so the start-up probe cannot hand one policy a different format. Policies run
side by side in one invocation, the order rotated each round (``--rounds``).

Three closed-loop workloads per policy run, all seeded and deterministic in their requests' sizes, each over
its own 8 system prompts (their first words name 24 distinct organizations):

- ``shared``: ``--users`` users (24) at once, each one multi-turn conversation of ``--turns`` turns over one
  of 8 system prompts of ~500 tokens (distinct generated text; the lengths are checked with the model's
  tokenizer and printed), user messages of 20-60 tokens, answers of ``max_tokens`` 16-32 (temperature 0,
  ``ignore_eos`` so every answer has exactly its seeded length; the real answer joins the history). Users
  start over the first ``--ramp`` seconds; between two turns a user "reads and types" for a seeded think time,
  uniform in [0.5, 1.5] x ``--think`` seconds (0: no pause). Without one, a closed loop gives load-only
  routing an affinity no real user load has: the replica a user's request just left is the least loaded one
  when that user's next turn arrives.
- ``hot``: the same shape over 8 other system prompts, half the users on the first one ("one prefix takes half
  the traffic"); the gateway's ``kvscope_gateway_upstream_outstanding_requests{upstream}`` is sampled every
  ``--sample-interval`` s (0.1).
- ``paced``: the ``shared`` shape over its own 8 system prompts at a person's pace: ``--paced-think`` (10 s,
  uniform in [5, 15] s) between turns to read a 16-32-token answer and type a 20-60-token message, the users
  starting over the same 10 s. This is the workload for TTFT. At ``--think`` 1 s every policy saturates the
  replicas, and a closed loop then offers each policy the load it can serve: cache_aware, which answers
  faster, gets its users back sooner and faces ~1.4x the request rate of the others, so TTFT compares
  different loads (its ratio moved 0.46-1.2x between single runs of this size, docs/benchmarks.md). With
  think time far above the answer time every policy faces about the same request rate, the comparison a
  fixed request rate makes (vLLM's ``benchmark_serving --request-rate``). Output tok/s, a capacity, stays
  ``shared``'s (saturated).

Client side (httpx, streaming with ``stream_options.include_usage``): TTFT = request sent → first content
delta; output tok/s = completion tokens / wall time of the workload; failed requests (must be 0). From usage:
prefix-cache hit rate = sum(cached_tokens) / sum(prompt_tokens). The oracle hit rate replays each workload's
prompts (token ids from the gateway's own chat-template tokenizer, checked against the engine's
prompt_tokens) in send order through one PrefixIndex with unbounded capacity: full blocks of the engine's
block size, never the last prompt token (gateway/routing/prefix.py ``token_prefix``, ``cacheable_blocks``) -
every request on the replica that holds its prefix. Greedy answers can differ between policies (batch
composition changes float sums), so each run's oracle is computed from that run's own prompts. The engine
caches generated tokens' full blocks too, which the prompt-only oracle does not count, so hit rate / oracle
can pass 100 %.

Per policy the script prints a markdown table (hit rate, oracle, hit/oracle, TTFT p50/p99, output tok/s,
failed, engine CPU seconds, requests per replica, in-flight balance), where the time goes (prompt tokens the
engines computed per request, TTFT p50 of first and later turns, the engines' TTFT causes) and issue 37's
ratios (cache_aware hit rate >= 90 % of the oracle and output tok/s >= 1.2x the better of least_outstanding
and round_robin on ``shared``; TTFT p50 <= 0.5x the better of the two on ``paced``, or on ``shared`` when
``paced`` is not run; hot prefix: no replica above 1.5x the mean in-flight), and writes
``summary.json`` (every run, every request, the engines' own counters per replica: prompt tokens,
prefix-cache hits, CPU seconds, TTFT causes) plus the gateway and engine logs to ``--out``. In-flight
balance: max over replicas of the time-averaged in-flight count / the mean over replicas; "peak": the largest
max/mean of one sample among samples with at least half the users in flight.

The machine statement printed first: lscpu's model name and CPU count, the AVX-512/AMX flags of
/proc/cpuinfo, memory, load average, and how many pytest processes were running (a shared machine).

    python bench/routing.py                       # full size: 24 users x 5 turns, 1 round (~13 min, 2 vCPUs)
    python bench/routing.py --quick               # 8 users x 2 turns (a smoke run)
    python bench/routing.py --users 24 --turns 4 --rounds 2 --policies cache_aware round_robin

A benchmark, not a test (numbers go to docs/benchmarks.md "Cache-aware routing over 4 replicas (issue 37)").
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvscope.common.models.cache import hf_dir
from kvscope.gateway.routing.prefix import token_prefix
from kvscope.gateway.routing.prefix_index import PrefixIndex
from kvscope.gateway.tokenize import ModelTokenizer
from kvscope.testing.harness import free_port, metric_samples

MODEL = "smollm2-135m"
POLICIES = ("least_outstanding", "round_robin", "cache_aware")
WORKLOADS = ("shared", "hot", "paced")
NUM_SYSTEM_PROMPTS = 8
ORACLE_CAPACITY_BLOCKS = 1 << 40
""""Unbounded": the oracle's one replica never evicts."""
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
OUTSTANDING = re.compile(
    r'^kvscope_gateway_upstream_outstanding_requests\{(?:[^}]*,)?upstream="([^"]+)"[^}]*\} (\S+)$', re.M
)

# --- text generation ---------------------------------------------------------------------------------------
ORGS = (
    "Northwind Freight",
    "Bluebell Clinic",
    "Quarry Lane Bank",
    "Orbit Games Studio",
    "Harbor City Library",
    "Vantage Solar Works",
    "Pinecrest Insurance",
    "Mosaic Travel Agency",
    "Copperleaf Bakery Group",
    "Atlas Robotics Lab",
    "Riverside Law Partners",
    "Summit Outdoor Supply",
    "Lumen Telecom",
    "Greenway Transit Authority",
    "Redwood University Admissions",
    "Helix Pharmacy Network",
    "Beacon Home Energy",
    "Cedar Ridge Dental",
    "Fjord Shipping Lines",
    "Ironbridge Credit Union",
    "Juniper Event Rentals",
    "Kestrel Airways",
    "Marigold Pet Hospital",
    "Tidewater Water Utility",
)
ROLES = (
    "customer support assistant",
    "onboarding guide",
    "billing specialist",
    "technical help desk agent",
    "scheduling assistant",
    "policy advisor",
    "claims assistant",
    "product expert",
)
NOUNS = (
    "account invoice shipment order ticket refund warranty schedule appointment password device router "
    "contract policy deadline report payment balance statement delivery package booking seat reservation "
    "prescription transcript application form receipt subscription plan upgrade license manual battery panel "
    "sensor update firmware backup record address profile request complaint review quote estimate"
).split()
ADJECTIVES = (
    "pending urgent delayed recurring annual monthly secure verified damaged missing expired premium basic "
    "shared primary backup internal external regional international digital printed partial full"
).split()
VERBS = (
    "confirm verify explain review update cancel renew check summarize escalate schedule track document "
    "compare calculate describe approve reject forward archive restore"
).split()
QUESTION_STARTS = (
    "Can you help me",
    "I need to",
    "How do I",
    "Is it possible to",
    "What happens if I",
    "Please tell me how to",
    "Could you explain how to",
    "Why can't I",
)


def _sentence(rng: random.Random) -> str:
    """One instruction sentence of a system prompt."""
    n, a, v = rng.choice(NOUNS), rng.choice(ADJECTIVES), rng.choice(VERBS)
    n2, v2 = rng.choice(NOUNS), rng.choice(VERBS)
    return rng.choice(
        (
            f"Always {v} the {a} {n} before you {v2} any {n2}.",
            f"When a customer asks about a {a} {n}, {v} it and then {v2} the related {n2}.",
            f"Never {v} a {n} without asking for the {n2} number first.",
            f"If the {n} is {a}, explain how to {v2} the {n2} in plain words.",
            f"Keep answers about the {n} short and {v} the {a} {n2} when needed.",
            f"For every {a} {n}, offer to {v} the {n2} by email.",
        )
    )


def system_prompt(index: int, rng: random.Random, tok: ModelTokenizer, target: int) -> str:
    """A distinct system prompt of ``target`` tokens or just above (counted without special tokens); its
    first words name its organization, so no two prompts share a first block."""
    org = ORGS[index % len(ORGS)]
    text = f"{org}: you are the {rng.choice(ROLES)} of {org}. Follow these rules."
    while tok.count_text(text, add_special_tokens=False) < target:
        text += " " + _sentence(rng)
    return text


def user_message(rng: random.Random, tok: ModelTokenizer, target: int) -> str:
    """A user question of about ``target`` tokens (grown a few words at a time, then cut at a word)."""
    words = f"{rng.choice(QUESTION_STARTS)} {rng.choice(VERBS)} my {rng.choice(NOUNS)}?".split()
    while tok.count_text(" ".join(words), add_special_tokens=False) < target:
        words += rng.choice(
            (
                f"It is a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}.",
                f"The {rng.choice(NOUNS)} was {rng.choice(ADJECTIVES)} last week.",
                f"I tried to {rng.choice(VERBS)} the {rng.choice(NOUNS)} twice.",
                f"My {rng.choice(NOUNS)} number is {rng.randrange(10000, 99999)}.",
            )
        ).split()
    while len(words) > 4 and tok.count_text(" ".join(words[:-1]), add_special_tokens=False) >= target:
        words.pop()
    return " ".join(words)


@dataclass(frozen=True)
class UserPlan:
    """One user's conversation: its system prompt and, per turn, the message, max_tokens and the think time
    (seconds) before the turn (0 before the first)."""

    user: int
    system: int
    messages: tuple[str, ...]
    max_tokens: tuple[int, ...]
    think_s: tuple[float, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    systems: tuple[str, ...]
    users: tuple[UserPlan, ...]
    think_s: float
    """Mean think time between a user's turns."""
    ramp_s: float
    """Seconds over which the users start."""


def build_workload(
    name: str,
    seed: int,
    users: int,
    turns: int,
    tok: ModelTokenizer,
    system_tokens: int,
    hot: bool,
    think_s: float,
    ramp_s: float,
) -> Workload:
    """Seeded: the same arguments give the same texts. ``hot``: half the users on system prompt 0, the rest
    spread over the other 7; else users spread evenly over all 8 (in a seeded order)."""
    rng = random.Random(f"{seed}/{name}")
    first = WORKLOADS.index(name) * NUM_SYSTEM_PROMPTS  # each workload its own organizations (ORGS)
    systems = tuple(system_prompt(first + i, rng, tok, system_tokens) for i in range(NUM_SYSTEM_PROMPTS))
    if hot:
        half = users // 2
        assignment = [0] * half + [1 + i % (NUM_SYSTEM_PROMPTS - 1) for i in range(users - half)]
    else:
        assignment = [i % NUM_SYSTEM_PROMPTS for i in range(users)]
    rng.shuffle(assignment)
    plans = []
    for u in range(users):
        urng = random.Random(f"{seed}/{name}/user{u}")
        plans.append(
            UserPlan(
                u,
                assignment[u],
                tuple(user_message(urng, tok, urng.randint(20, 60)) for _ in range(turns)),
                tuple(urng.randint(16, 32) for _ in range(turns)),
                tuple(0.0 if t == 0 else think_s * urng.uniform(0.5, 1.5) for t in range(turns)),
            )
        )
    return Workload(name, systems, tuple(plans), think_s, ramp_s)


# --- processes ---------------------------------------------------------------------------------------------
@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; only this child."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def _die_with_parent() -> None:
    """Child side: SIGTERM when this script dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG), so no
    engine outlives a killed benchmark."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _on_sigterm(_signum: int, _frame: Any) -> None:
    raise SystemExit(143)  # unwinds through main's finally: the children are stopped


def spawn(name: str, args: list[str], port: int, log: Path) -> Child:
    with open(log, "ab") as out:  # the child keeps its own descriptor
        out.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(args[3:])}\n".encode())
        out.flush()
        popen = subprocess.Popen(  # noqa: PLW1509 - pdeathsig only
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_die_with_parent,
        )
    return Child(name, popen, port, log)


def wait_ready(children: list[Child], path: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.popen.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.popen.returncode}; see {child.log}")
            try:
                if httpx.get(child.url + path, timeout=2.0).status_code == 200:
                    pending.remove(child)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[c.name for c in pending]} not ready after {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.25)


def start_engines(
    args: argparse.Namespace, ports: list[int], out: Path, fmt: list[str], children: list[Child]
) -> list[Child]:
    """One engine per port, each added to ``children`` as soon as it is spawned (stopped by main's cleanup
    even when this is interrupted); returns them once all answer /health."""
    engines = []
    for i, port in enumerate(ports):
        cmd = [
            sys.executable,
            "-P",
            "-m",
            "kvscope.cli",
            "engine",
            "--model",
            MODEL,
            "--port",
            str(port),
            "--num-threads",
            str(args.num_threads),
            "--kv-cache-memory",
            args.kv_cache_memory,
            *fmt,
            *args.engine_arg,
        ]
        engines.append(spawn(f"engine{i}", cmd, port, out / f"engine{i}.log"))
        children.append(engines[-1])
    wait_ready(engines, "/health")
    return engines


def start_gateway(
    policy: str, engines: list[Child], out: Path, tokenizer: Path, tag: str, children: list[Child]
) -> Child:
    port = free_port()
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "kvscope.cli",
        "gateway",
        "--port",
        str(port),
        "--routing",
        policy,
        "--tokenizer",
        f"{MODEL}={tokenizer}",
        "--log-file",
        str(out / f"gateway-{tag}.jsonl"),
        "--log-level",
        "warning",
    ]
    for engine in engines:
        cmd += ["--upstream", engine.url]
    gateway = spawn("gateway", cmd, port, out / f"gateway-{tag}.log")
    children.append(gateway)
    wait_ready([gateway], "/readyz")
    deadline = time.monotonic() + 30
    while True:  # every replica healthy before the first request
        up = re.findall(r"^kvscope_gateway_upstream_up\{[^}]*\} 1\.0$", scrape(gateway.url), re.M)
        if len(up) == len(engines):
            return gateway
        if time.monotonic() > deadline:
            raise TimeoutError(f"gateway sees {len(up)} of {len(engines)} replicas healthy")
        time.sleep(0.25)


def scrape(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


# --- the client --------------------------------------------------------------------------------------------
@dataclass
class Result:
    user: int
    turn: int
    messages: list[dict[str, str]]
    sent_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class WorkloadRun:
    results: list[Result] = field(default_factory=list)
    """In send order."""
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    started_at: float = 0.0
    wall_s: float = 0.0


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], result: Result
) -> str | None:
    """Stream one chat completion; fills ``result``; returns the answer text (None on failure)."""
    start = time.perf_counter()
    parts: list[str] = []
    usage = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return None
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if result.ttft_s is None:
                            result.ttft_s = time.perf_counter() - start
                        parts.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return None
    result.e2e_s = time.perf_counter() - start
    if usage is None or result.ttft_s is None:
        result.error = "no usage" if usage is None else "no content"
        return None
    result.prompt_tokens = usage["prompt_tokens"]
    result.completion_tokens = usage["completion_tokens"]
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return "".join(parts)


async def run_workload(
    gateway_url: str, workload: Workload, ramp_s: float, ignore_eos: bool, interval_s: float
) -> WorkloadRun:
    run = WorkloadRun()
    url = gateway_url + "/v1/chat/completions"
    users = len(workload.users)
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4)
    headers = {"user-agent": f"kvscope-bench-routing/{workload.name}"}
    async with httpx.AsyncClient(limits=limits, timeout=900, headers=headers) as client:

        async def user(plan: UserPlan) -> None:
            await asyncio.sleep(ramp_s * plan.user / users)
            history = [{"role": "system", "content": workload.systems[plan.system]}]
            for turn, (text, max_tokens, think) in enumerate(
                zip(plan.messages, plan.max_tokens, plan.think_s, strict=True)
            ):
                if think:
                    await asyncio.sleep(think)
                history.append({"role": "user", "content": text})
                result = Result(plan.user, turn, list(history), time.perf_counter())
                run.results.append(result)
                body = {
                    "model": MODEL,
                    "messages": history,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "ignore_eos": ignore_eos,
                }
                answer = await one_request(client, url, body, result)
                if answer is None:
                    return  # a failed turn ends the conversation (counted as failed)
                history.append({"role": "assistant", "content": answer})

        async def sampler(stop: asyncio.Event) -> None:
            async with httpx.AsyncClient(timeout=5) as probe:
                while not stop.is_set():
                    t = time.perf_counter()
                    try:
                        text = (await probe.get(gateway_url + "/metrics")).text
                        run.samples.append((t, {k: float(v) for k, v in OUTSTANDING.findall(text)}))
                    except httpx.HTTPError:
                        pass
                    try:
                        await asyncio.wait_for(stop.wait(), max(0.0, interval_s - (time.perf_counter() - t)))
                    except TimeoutError:
                        pass

        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler(stop))
        start = run.started_at = time.perf_counter()
        await asyncio.gather(*(user(p) for p in workload.users))
        run.wall_s = time.perf_counter() - start
        stop.set()
        await sampling
    return run


# --- analysis ----------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def oracle(results: list[Result], tok: ModelTokenizer, block_size: int) -> dict[str, int]:
    """Prompt tokens and cached tokens of one replica with an unbounded prefix cache fed the prompts in send
    order; ``mismatches``: prompts whose token count differs from the engine's prompt_tokens."""
    index = PrefixIndex(ORACLE_CAPACITY_BLOCKS)
    prompt = cached = mismatches = 0
    for r in results:
        ids = tok.encode_chat(r.messages)
        if ids is None:
            raise RuntimeError("the chat template could not render a prompt")
        if r.prompt_tokens is not None and r.prompt_tokens != len(ids):
            mismatches += 1
        prefix = token_prefix(MODEL, ids, block_size)
        cached += prefix.cacheable_blocks(index.match(prefix.hashes)) * block_size
        index.insert(prefix.hashes)
        prompt += len(ids)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "mismatches": mismatches}


def balance(samples: list[tuple[float, dict[str, float]]], users: int) -> dict[str, Any]:
    """In-flight balance over replicas from the gateway's samples (module docstring)."""
    labels = sorted({k for _, s in samples for k in s})
    if not samples or not labels:
        return {"samples": 0}
    avg = {k: statistics.fmean(s.get(k, 0.0) for _, s in samples) for k in labels}
    mean = statistics.fmean(avg.values())
    busy = [s for _, s in samples if sum(s.values()) >= users / 2]
    peaks = [max(s.get(k, 0.0) for k in labels) / (sum(s.values()) / len(labels)) for s in busy]
    return {
        "samples": len(samples),
        "busy_samples": len(busy),
        "time_avg_in_flight": avg,
        "max_over_mean": max(avg.values()) / mean if mean else None,
        "peak_max_over_mean": max(peaks) if peaks else None,
        "max_in_flight": max(max(s.get(k, 0.0) for k in labels) for _, s in samples),
    }


def engine_counters(text: str) -> dict[str, float]:
    """The engine counters that say where a run's time went."""
    samples = metric_samples(text)
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        short = {
            "process_cpu_seconds_total": "cpu_s",
            "kvscope_engine_prompt_tokens_total": "prompt_tokens",
            "kvscope_engine_prefix_cache_hits_total": "prefix_cache_hits",
            "kvscope_engine_generation_tokens_total": "generation_tokens",
            "kvscope_engine_preemptions_total": "preemptions",
            "kvscope_engine_prefill_time_seconds_sum": "prefill_s",
            "kvscope_engine_decode_time_seconds_sum": "decode_s",
            "kvscope_engine_e2e_request_latency_seconds_count": "requests",
        }.get(name)
        if short:
            out[short] = value
        elif name == "kvscope_engine_latency_cause_seconds_total":
            d = dict(labels)
            out[f"{d['phase']}_{d['cause']}_s"] = value
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}


def summarize(
    run: WorkloadRun,
    tok: ModelTokenizer,
    block_size: int,
    users: int,
    log: list[dict[str, Any]],
    replicas: list[str],
) -> dict[str, Any]:
    """One workload run's figures (module docstring); ``log``: its gateway request-log records,
    ``replicas``: the gateway's upstream labels (``host:port``)."""
    ok = [r for r in run.results if r.error is None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    completion = sum(r.completion_tokens or 0 for r in ok)
    orc = oracle(ok, tok, block_size)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_replica = dict.fromkeys(replicas, 0)
    predicted = logged_cached = 0
    reasons: dict[str, int] = {}
    for record in log:
        routing = (record.get("kvscope") or {}).get("routing") or {}
        per_replica[routing.get("replica", "?")] = per_replica.get(routing.get("replica", "?"), 0) + 1
        reasons[routing.get("reason", "?")] = reasons.get(routing.get("reason", "?"), 0) + 1
        predicted += routing.get("predicted_cached_tokens") or 0
        logged_cached += routing.get("cached_tokens") or 0
    return {
        "requests": len(run.results),
        "failed": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if r.error})[:5],
        "wall_s": run.wall_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "hit_rate": cached / prompt if prompt else None,
        "oracle_prompt_tokens": orc["prompt_tokens"],
        "oracle_cached_tokens": orc["cached_tokens"],
        "oracle_hit_rate": orc["cached_tokens"] / orc["prompt_tokens"] if orc["prompt_tokens"] else None,
        "prompt_token_mismatches": orc["mismatches"],
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile([r.e2e_s for r in ok if r.e2e_s is not None], 50),
        "output_tok_s": completion / run.wall_s if run.wall_s else None,
        "per_replica_requests": per_replica,
        "reasons": reasons,
        "predicted_cached_tokens": predicted,
        "logged_cached_tokens": logged_cached,
        "balance": balance(run.samples, users),
        "ttft_p50_first_turn_s": percentile(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.turn == 0], 50
        ),
        "ttft_p50_later_turns_s": percentile(
            [r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0], 50
        ),
        "detail": {
            "columns": [
                "user",
                "turn",
                "sent_s",
                "ttft_s",
                "e2e_s",
                "prompt",
                "cached",
                "completion",
                "error",
            ],
            "rows": [
                [
                    r.user,
                    r.turn,
                    round(r.sent_at - run.started_at, 3),
                    r.ttft_s,
                    r.e2e_s,
                    r.prompt_tokens,
                    r.cached_tokens,
                    r.completion_tokens,
                    r.error,
                ]
                for r in run.results
            ],
        },
    }


def read_log(path: Path, agent: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if ((r.get("user_agent") or {}).get("original") or "") == agent]


# --- the whole run -----------------------------------------------------------------------------------------
def machine_statement() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?"
    )
    cpuinfo = Path("/proc/cpuinfo").read_text()
    wanted = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    flags = sorted({f for f in wanted if re.search(rf"\b{f}\b", cpuinfo)})
    pytest = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"pytest" in cmdline and proc.name != str(os.getpid()):
                pytest += 1
    mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu": model,
        "cpus": os.cpu_count(),
        "cpu_flags": flags,
        "memory": mem.split(":", 1)[1].strip(),
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
        "pytest_processes": pytest,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    p.add_argument(
        "--users", type=int, default=24, help="concurrent users (closed loop), each one conversation"
    )
    p.add_argument("--turns", type=int, default=5, help="turns per conversation")
    p.add_argument(
        "--rounds", type=int, default=1, help="full sets of policies, the order rotated each round"
    )
    p.add_argument("--quick", action="store_true", help="8 users x 2 turns, 1 round (a smoke run)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), help="which workloads to run"
    )
    p.add_argument(
        "--replicas", type=int, default=4, help="engine replicas started on this machine (default 4)"
    )
    p.add_argument("--num-threads", type=int, default=1, help="engine --num-threads of each replica")
    p.add_argument("--kv-cache-memory", default="1G", help="engine --kv-cache-memory of each replica")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more engine argument for every replica and policy (repeatable, e.g. "
        "--engine-arg=--long-prefill-token-threshold --engine-arg=128)",
    )
    p.add_argument("--system-tokens", type=int, default=500, help="tokens of each system prompt")
    p.add_argument("--ramp", type=float, default=2.0, help="seconds over which the users start")
    p.add_argument(
        "--think", type=float, default=1.0, help="mean think time between a user's turns (s; 0: none)"
    )
    p.add_argument(
        "--paced-think",
        type=float,
        default=10.0,
        help="mean think time of the paced workload, which is also its ramp (s)",
    )
    p.add_argument("--sample-interval", type=float, default=0.1, help="gateway in-flight sample period (s)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let answers end at EOS")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--out", type=Path, help="results folder (default /tmp/kvscope-routing-<time>)")
    args = p.parse_args(argv)
    if args.quick:
        args.users, args.turns, args.rounds = 8, 2, 1
    args.out = args.out or Path(f"/tmp/kvscope-routing-{time.strftime('%Y%m%dT%H%M%S')}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_statement()
    print(f"results -> {args.out}")
    print(
        f"machine: {machine['cpu']}, {machine['cpus']} CPUs, "
        f"flags {' '.join(machine['cpu_flags']) or 'none'}, "
        f"{machine['memory']}, load {' '.join(machine['load_average'])}, "
        f"{machine['pytest_processes']} pytest processes running",
        flush=True,
    )
    ports = [free_port() for _ in range(args.replicas)]
    children: list[Child] = []
    """Every process started here, stopped (if still running) on the way out."""
    engines: list[Child] = []
    fmt: list[str] = []
    runs: list[dict[str, Any]] = []
    block_size = num_blocks = 0
    try:
        # the first start converts the model if needed and picks the weight format; later starts are pinned
        t0 = time.perf_counter()
        engines = start_engines(args, ports, args.out, fmt, children)
        card = httpx.get(engines[0].url + "/v1/models", timeout=10).json()["data"][0]
        info = card["kvscope"]
        fmt = ["--dtype", info["dtype"], "--quantization", info["quantization"]]
        block_size, num_blocks = info["block_size"], info["num_gpu_blocks"]
        print(
            f"engines: {args.replicas} x --num-threads {args.num_threads} {' '.join(args.engine_arg)}, "
            f"{info['dtype']}/{info['quantization']}, "
            f"block_size {block_size}, {num_blocks} blocks ({num_blocks * block_size} tokens of KV each); "
            f"first start {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        tokenizer_path = hf_dir(MODEL)
        tok = ModelTokenizer.load(tokenizer_path)
        workloads = {
            name: build_workload(
                name,
                args.seed,
                args.users,
                args.turns,
                tok,
                args.system_tokens,
                hot=name == "hot",
                think_s=args.paced_think if name == "paced" else args.think,
                ramp_s=args.paced_think if name == "paced" else args.ramp,
            )
            for name in args.workloads
        }
        for w in workloads.values():
            lengths = [tok.count_text(s, add_special_tokens=False) for s in w.systems]
            msg = [tok.count_text(m, add_special_tokens=False) for p in w.users for m in p.messages]
            share = max(sum(1 for p in w.users if p.system == i) for i in range(NUM_SYSTEM_PROMPTS))
            print(
                f"workload {w.name}: {len(w.users)} users x {args.turns} turns, think {w.think_s:g} s, "
                f"ramp {w.ramp_s:g} s; "
                f"system prompts "
                f"{min(lengths)}-{max(lengths)} tokens; user messages {min(msg)}-{max(msg)} tokens; "
                f"largest prefix share {share}/{len(w.users)} users",
                flush=True,
            )
        first = True
        for rnd in range(args.rounds):
            k = rnd % len(args.policies)
            for policy in args.policies[k:] + args.policies[:k]:
                if not first:
                    t0 = time.perf_counter()
                    for e in engines:
                        e.stop()
                    engines = start_engines(args, ports, args.out, fmt, children)
                    print(f"engines restarted (empty prefix caches) in {time.perf_counter() - t0:.1f} s")
                first = False
                tag = f"r{rnd}-{policy}"
                gateway = start_gateway(policy, engines, args.out, tokenizer_path, tag, children)
                before = [engine_counters(scrape(e.url)) for e in engines]
                for name, w in workloads.items():
                    t0 = time.perf_counter()
                    run = asyncio.run(
                        run_workload(gateway.url, w, w.ramp_s, args.ignore_eos, args.sample_interval)
                    )
                    after = [engine_counters(scrape(e.url)) for e in engines]
                    runs.append(
                        {
                            "round": rnd,
                            "policy": policy,
                            "workload": name,
                            "engines": [diff(a, b) for a, b in zip(after, before, strict=True)],
                            "_run": run,
                        }
                    )
                    before = after
                    ok = sum(1 for r in run.results if r.error is None)
                    print(
                        f"round {rnd} {policy:<17} {name:<6}: {ok}/{len(run.results)} ok in "
                        f"{time.perf_counter() - t0:.1f} s",
                        flush=True,
                    )
                gateway.stop()
                for entry in runs:
                    if entry["round"] == rnd and entry["policy"] == policy:
                        log = read_log(
                            args.out / f"gateway-{tag}.jsonl", f"kvscope-bench-routing/{entry['workload']}"
                        )
                        labels = [e.url.split("://", 1)[1] for e in engines]
                        entry.update(summarize(entry.pop("_run"), tok, block_size, args.users, log, labels))
    finally:
        for child in reversed(children):  # the gateway before the engines behind it
            child.stop()
    summary = {
        "machine": machine,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine": {"format": fmt, "block_size": block_size, "num_gpu_blocks": num_blocks},
        "runs": runs,
    }
    summary["table"] = report(summary, args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    print(f"\nsummary: {args.out / 'summary.json'}")
    return 0


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(type(obj))


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's runs of one workload over all rounds: sums for rates, the median of per-round figures."""

    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    prompt = sum(r["prompt_tokens"] for r in runs)
    oracle_prompt = sum(r["oracle_prompt_tokens"] for r in runs)
    hit = sum(r["cached_tokens"] for r in runs) / prompt if prompt else None
    orc = sum(r["oracle_cached_tokens"] for r in runs) / oracle_prompt if oracle_prompt else None
    bal = [r["balance"].get("max_over_mean") for r in runs if r["balance"].get("max_over_mean")]
    peak = [r["balance"].get("peak_max_over_mean") for r in runs if r["balance"].get("peak_max_over_mean")]
    return {
        "rounds": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "hit_rate": hit,
        "oracle_hit_rate": orc,
        "hit_over_oracle": hit / orc if hit is not None and orc else None,
        "ttft_p50_s": med("ttft_p50_s"),
        "ttft_p99_s": med("ttft_p99_s"),
        "output_tok_s": med("output_tok_s"),
        "wall_s": med("wall_s"),
        "in_flight_max_over_mean": max(bal) if bal else None,
        "in_flight_peak_max_over_mean": max(peak) if peak else None,
        "per_replica_requests": runs[-1]["per_replica_requests"],
        "engine_cpu_s": statistics.median(sum(e.get("cpu_s", 0.0) for e in r["engines"]) for r in runs),
    }


def profile(run: dict[str, Any]) -> dict[str, float]:
    """One run's engine counters summed over replicas, per request where it says so."""
    total: dict[str, float] = {}
    for engine in run["engines"]:
        for k, v in engine.items():
            total[k] = total.get(k, 0.0) + v
    n = max(1.0, total.get("requests", 0.0))
    return {
        "cpu_s": total.get("cpu_s", 0.0),
        "computed_per_request": (total.get("prompt_tokens", 0.0) - total.get("prefix_cache_hits", 0.0)) / n,
        "queue_s": total.get("ttft_queue_s", 0.0) / n,
        "own_s": total.get("ttft_own_s", 0.0) / n,
        "other_prefills_s": total.get("ttft_other_prefills_s", 0.0) / n,
    }


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Print the markdown table and issue 37's ratios; return them for the JSON summary."""
    out: dict[str, Any] = {}
    for workload in args.workloads:
        rows = {
            p: pooled([r for r in summary["runs"] if r["policy"] == p and r["workload"] == workload])
            for p in args.policies
        }
        out[workload] = rows
        think = args.paced_think if workload == "paced" else args.think
        print(
            f"\n### {workload}: {args.users} users x {args.turns} turns, think {think:g} s, "
            f"{args.rounds} round(s)\n"
        )
        print(
            "| policy | requests | failed | hit rate | oracle | hit/oracle | TTFT p50 s | TTFT p99 s | "
            "output tok/s | engine CPU s | in-flight max/mean (peak) | requests per replica |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p, row in rows.items():
            print(
                f"| {p} | {row['requests']} | {row['failed']} | {_f(row['hit_rate'], '.1%')} | "
                f"{_f(row['oracle_hit_rate'], '.1%')} | {_f(row['hit_over_oracle'], '.1%')} | "
                f"{_f(row['ttft_p50_s'], '.2f')} | {_f(row['ttft_p99_s'], '.2f')} | "
                f"{_f(row['output_tok_s'], '.1f')} | {_f(row['engine_cpu_s'], '.0f')} | "
                f"{_f(row['in_flight_max_over_mean'], '.2f')} "
                f"({_f(row['in_flight_peak_max_over_mean'], '.2f')}) | "
                f"{' / '.join(str(v) for v in row['per_replica_requests'].values())} |"
            )
    print(
        "\n### where the time goes (engine counters summed over replicas, per request; median over rounds)\n"
    )
    print(
        "| workload | policy | prompt tokens computed | engine CPU s | TTFT p50 first / later turns s | "
        "engine TTFT mean: queue / own prefill / other prefills s | e2e p50 s |"
    )
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        for p in args.policies:
            runs = [r for r in summary["runs"] if r["policy"] == p and r["workload"] == workload]
            prof = [profile(r) for r in runs]

            def med(key: str, prof: list[dict[str, float]] = prof) -> float:
                return statistics.median(x[key] for x in prof)

            out[workload][p]["profile"] = {k: med(k) for k in prof[0]} if prof else {}
            print(
                f"| {workload} | {p} | {med('computed_per_request'):.0f} | {med('cpu_s'):.0f} | "
                f"{_f(statistics.median(r['ttft_p50_first_turn_s'] or 0 for r in runs), '.2f')} / "
                f"{_f(statistics.median(r['ttft_p50_later_turns_s'] or 0 for r in runs), '.2f')} | "
                f"{med('queue_s'):.2f} / {med('own_s'):.2f} / {med('other_prefills_s'):.2f} | "
                f"{_f(statistics.median(r['e2e_p50_s'] or 0 for r in runs), '.2f')} |"
            )
    targets: dict[str, Any] = {}
    shared, hot = out.get("shared", {}), out.get("hot", {})
    ttft_from = "paced" if "paced" in out else "shared"
    ttft_rows = out.get(ttft_from, {})
    baselines = ("least_outstanding", "round_robin")
    ca = shared.get("cache_aware")
    others = [shared[p] for p in baselines if p in shared]
    if ca and others:
        best_tps = max(o["output_tok_s"] for o in others)
        targets["hit_over_oracle"] = {"value": ca["hit_over_oracle"], "target": ">= 0.90"}
        targets["output_tok_s_vs_best"] = {"value": ca["output_tok_s"] / best_tps, "target": ">= 1.20"}
    if "cache_aware" in ttft_rows and any(p in ttft_rows for p in baselines):
        best_ttft = min(ttft_rows[p]["ttft_p50_s"] for p in baselines if p in ttft_rows)
        targets["ttft_p50_vs_best"] = {
            "value": ttft_rows["cache_aware"]["ttft_p50_s"] / best_ttft,
            "target": "<= 0.50",
            "workload": ttft_from,
        }
    if "cache_aware" in hot:
        targets["hot_in_flight_max_over_mean"] = {
            "value": hot["cache_aware"]["in_flight_max_over_mean"],
            "peak": hot["cache_aware"]["in_flight_peak_max_over_mean"],
            "target": "<= 1.50",
        }
    targets["failed"] = {
        "value": sum(r["failed"] for rows in out.values() for r in rows.values()),
        "target": "0",
    }
    met = {
        "hit_over_oracle": lambda v: v >= 0.90,
        "ttft_p50_vs_best": lambda v: v <= 0.50,
        "output_tok_s_vs_best": lambda v: v >= 1.20,
        "hot_in_flight_max_over_mean": lambda v: v <= 1.50,
        "failed": lambda v: v == 0,
    }
    print("\n### issue 37 targets (cache_aware vs the better of least_outstanding and round_robin)\n")
    for name, t in targets.items():
        v = t["value"]
        t["met"] = v is not None and met[name](v)
        extra = f" (peak sample {_f(t.get('peak'), '.2f')})" if "peak" in t else ""
        extra += f" ({t['workload']})" if "workload" in t else ""
        print(
            f"- {name}: {_f(v, '.3f') if name != 'failed' else v}{extra}, target {t['target']}: "
            f"{'met' if t['met'] else 'MISSED'}"
        )
    out["targets"] = targets
    return out


if __name__ == "__main__":
    sys.exit(main())
