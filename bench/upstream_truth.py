"""The gateway in front of a real llama.cpp ``llama-server``: what the request log says about each request,
and what the gateway costs, side by side.

Starts the ``llama-server`` that bench/build_llama_server.sh builds on the default model's GGUF (with
``--metrics`` and ``--slots``, so the gateway can sample its state) and a gateway process in front of it
(``kind: auto``: the gateway finds it is llama.cpp by itself; JSONL request log), then sends ``--requests``
rounds of one non-streamed and one streamed chat completion, each to llama-server directly and through the
gateway, the order of the two rotated every round (interleaved: both see the same machine at the same
time). Every prompt shares one system prompt (llama.cpp's prompt cache then reuses it: ``cached_tokens``)
and ends with the round's own question.

Prints one line per gateway request from the request log (``kvscope.ttft_s``, ``kvscope.engine``: queue,
prefill, decode, cached tokens, batch size and KV usage; ``kvscope.upstream``: the kind, where each field
came from and the samples' ages) and whether every line holds what issue 38 asks for (:data:`ASKED`: TTFT,
prefill, decode, cached tokens, batch size and KV usage, both samples' ages), then the latency table: TTFT
(streams: request sent -> first content token) and e2e (request sent -> last byte), p50 and p99, direct vs
through the gateway, and the difference (what the gateway adds). ``--smoke`` runs 3 rounds of 4 tokens (a
check that it all works, not a measure).

``--baseline-src DIR`` measures an earlier gateway side by side in the same rounds: a second gateway process
runs from the source tree DIR (its ``src/`` first on the child's PYTHONPATH), the three targets' order rotated
every round (direct, gateway, baseline; then gateway, baseline, direct; …). The tree of the gateway before
issue 38, without touching the repository's checkout::

    mkdir -p /tmp/kvscope-c8d1191 && git archive c8d1191 | tar -x -C /tmp/kvscope-c8d1191
    python bench/upstream_truth.py --requests 100 --baseline-src /tmp/kvscope-c8d1191

    python bench/upstream_truth.py [--requests 30] [--max-tokens 32] [--parallel 1] [--baseline-src DIR]
                                   [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvscope.testing.harness import Proc, free_port, records_by_id, spawn_gateway, wait_http

MODEL = "smollm2-135m"
CACHE = Path(os.environ.get("KVSCOPE_CACHE", Path.home() / ".cache" / "kvscope"))
DEFAULT_GGUF = CACHE / "models" / MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVER = Path(os.environ.get("PEERS_DIR", "/work/peers-build")) / "llama.cpp-build/bin/llama-server"
SYSTEM = (
    "You are a concise assistant for a paint shop. Answer in one short sentence, name colours plainly, and "
    "never explain how light or pigments work unless asked."
)
QUESTIONS = (
    "What colour do blue and yellow make?",
    "Which colour is a ripe tomato?",
    "What colour is fresh snow?",
    "Name a colour between red and yellow.",
    "What colour is the clear sky at noon?",
)


ASKED: tuple[tuple[str, ...], ...] = (
    ("kvscope", "ttft_s"),
    ("kvscope", "engine", "prefill_s"),
    ("kvscope", "engine", "decode_s"),
    ("kvscope", "engine", "cached_tokens"),
    ("kvscope", "engine", "batch_size_mean"),
    ("kvscope", "engine", "kv_cache_usage"),
    ("kvscope", "upstream", "sampled", "arrival", "age_s"),
    ("kvscope", "upstream", "sampled", "finish", "age_s"),
)
"""The request-log fields issue 38's "Done when" asks of every line in front of a real llama-server."""
TARGETS = ("direct", "gateway", "baseline")
"""What each round sends its requests to: llama-server itself, the gateway, the ``--baseline-src`` one."""


def missing(record: dict[str, Any]) -> list[str]:
    """The dotted names of the :data:`ASKED` fields that ``record`` (one request-log line) lacks or holds
    null, in :data:`ASKED`'s order."""
    out = []
    for path in ASKED:
        value: Any = record
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            out.append(".".join(path))
    return out


def rotated(targets: tuple[str, ...], round_: int) -> tuple[str, ...]:
    """``targets`` rotated left by ``round_`` (A B C, B C A, C A B, …): each takes each position in turn."""
    k = round_ % len(targets)
    return targets[k:] + targets[:k]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def body(round_: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    question = QUESTIONS[round_ % len(QUESTIONS)]
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": round_,
        "stream": stream,
    }


@dataclass
class Timing:
    ttft_s: float | None
    e2e_s: float


def send(client: httpx.Client, url: str, payload: dict[str, Any], request_id: str) -> Timing:
    """One request; TTFT = the first SSE event with content (streams only), e2e = the last byte. A pooled
    connection that the server closed as the request went out (llama-server's cpp-httplib closes idle
    keep-alive connections after 5 s) is tried once more on a fresh one, as the gateway does towards its
    upstreams, so neither side of the comparison pays for that race; the timing starts again."""
    try:
        return _send(client, url, payload, request_id)
    except httpx.RemoteProtocolError:
        return _send(client, url, payload, request_id)


def _send(client: httpx.Client, url: str, payload: dict[str, Any], request_id: str) -> Timing:
    headers = {"x-request-id": request_id}
    start = time.perf_counter()
    if not payload["stream"]:
        resp = client.post(url, json=payload, headers=headers)
        resp.raise_for_status()
        return Timing(None, time.perf_counter() - start)
    ttft = None
    with client.stream("POST", url, json=payload, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: {") and '"content":"' in line:
                if '"content":""' not in line:
                    ttft = time.perf_counter() - start
    return Timing(ttft, time.perf_counter() - start)


@dataclass
class Results:
    timings: dict[tuple[str, bool], list[Timing]] = field(default_factory=dict)

    def add(self, target: str, stream: bool, timing: Timing) -> None:
        self.timings.setdefault((target, stream), []).append(timing)

    def row(self, stream: bool, metric: str, targets: tuple[str, ...]) -> dict[str, float]:
        """p50/p99 (ms) and count of ``metric`` per target, and what each target but ``direct`` adds to
        direct's (``{target}_added_p50_ms``, ``_p99_ms``)."""
        out: dict[str, float] = {}
        for target in targets:
            values = [
                getattr(t, metric)
                for t in self.timings.get((target, stream), [])
                if getattr(t, metric) is not None
            ]
            out[f"{target}_p50_ms"] = percentile(values, 50) * 1e3
            out[f"{target}_p99_ms"] = percentile(values, 99) * 1e3
            out[f"{target}_n"] = len(values)
        for target in targets[1:]:
            for q in ("p50", "p99"):
                out[f"{target}_added_{q}_ms"] = out[f"{target}_{q}_ms"] - out[f"direct_{q}_ms"]
        return out


def start_llama_server(
    server: Path, gguf: Path, port: int, threads: int, parallel: int, log: Path
) -> subprocess.Popen[bytes]:
    """llama-server as bench/peers.sh starts it (``parallel`` slots sharing a 1,024-token context, split
    among them: requests here go one at a time), with the Prometheus endpoint and /slots on for the
    gateway's engine sampler."""
    command = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL]
    command += ["-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", "1024", "--no-webui"]
    command += ["--metrics", "--slots"]
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def log_line(record: dict[str, Any]) -> str:
    """The request-log fields this bench is about, on one line."""
    kv = record.get("kvscope", {})
    usage = (record.get("gen_ai") or {}).get("usage") or {}
    picked = {
        "id": record["http"]["request"]["id"],
        "status": record["http"]["response"]["status_code"],
        "ttft_s": kv.get("ttft_s"),
        "tpot_s": kv.get("tpot_s"),
        "e2e_s": kv.get("e2e_s"),
        "overhead_s": kv.get("gateway_overhead_s"),
        "usage": usage,
        "engine": kv.get("engine"),
        "upstream": kv.get("upstream"),
    }
    return json.dumps(picked, separators=(",", ":"), default=str)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start llama-server, the gateway (and the ``--baseline-src`` one), send the rounds; returns the
    results (module docstring) as one JSON-able dict."""
    tmp = Path(tempfile.mkdtemp(prefix="kvscope-truth-"))
    port = free_port()
    llama = start_llama_server(
        args.server, args.gguf, port, args.threads, args.parallel, tmp / "llama-server.log"
    )
    direct = f"http://127.0.0.1:{port}"
    gateways: dict[str, Proc] = {}
    try:
        wait_http(direct + "/health", timeout=180, proc=llama)
        sources = {"gateway": ""}
        if args.baseline_src is not None:
            sources["baseline"] = str(args.baseline_src.resolve() / "src")
        for name, pythonpath in sources.items():
            config = {
                "upstreams": [{"url": direct, "models": [MODEL]}],
                "logs": {"file": str(tmp / f"{name}.jsonl")},
            }
            gateways[name] = spawn_gateway(tmp, name, config, pythonpath)
        for proc in gateways.values():
            wait_http(proc.url + "/readyz", timeout=60, proc=proc.popen)
        bases = {"direct": direct, **{name: proc.url for name, proc in gateways.items()}}
        targets = tuple(t for t in TARGETS if t in bases)
        results, ids = Results(), []
        with httpx.Client(timeout=300) as client:
            for stream in (False, True):  # warm every path (connections, the system prompt in the cache)
                for base in bases.values():
                    payload = body(0, args.max_tokens, stream)
                    send(client, base + "/v1/chat/completions", payload, f"warm-{stream}")
            for round_ in range(args.requests):
                for stream in (False, True):
                    request_id = f"truth-{round_}-{'stream' if stream else 'json'}"
                    payload = body(round_, args.max_tokens, stream)
                    for target in rotated(targets, round_):
                        url = bases[target] + "/v1/chat/completions"
                        results.add(target, stream, send(client, url, payload, request_id))
                    ids.append(request_id)
        records = records_by_id(tmp / "gateway.jsonl", ids)
        lines = [records[i][-1] for i in ids if i in records]
        table = {
            "ttft_stream": results.row(True, "ttft_s", targets),
            "e2e_stream": results.row(True, "e2e_s", targets),
            "e2e_non_stream": results.row(False, "e2e_s", targets),
        }
        version = subprocess.run([str(args.server), "--version"], capture_output=True, text=True, check=False)
        return {
            "llama_server": (version.stdout + version.stderr).strip().splitlines()[-2:],
            "parallel": args.parallel,
            "baseline_src": None if args.baseline_src is None else str(args.baseline_src),
            "targets": list(targets),
            "requests_per_cell": args.requests,
            "max_tokens": args.max_tokens,
            "log_lines": [log_line(r) for r in lines],
            "missing_log_lines": [i for i in ids if i not in records],
            "missing_fields": {r["http"]["request"]["id"]: gaps for r in lines if (gaps := missing(r))},
            "latency": table,
        }
    finally:
        for proc in gateways.values():
            proc.stop()
        llama.terminate()
        try:
            llama.wait(10)
        except subprocess.TimeoutExpired:
            llama.kill()


def main() -> None:
    """Parse the flags, run, print the log lines, the fields check and the latency table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--server", type=Path, default=DEFAULT_SERVER)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--requests", type=int, default=30, help="rounds (each: 2 modes x each target)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb")
    parser.add_argument("--parallel", type=int, default=1, help="llama-server -np (slots)")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="source tree of an earlier kvscope whose gateway is measured side by side (module docstring)",
    )
    parser.add_argument("--smoke", action="store_true", help="3 rounds of 4 tokens: does it all work")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.baseline_src is not None and not (args.baseline_src / "src" / "kvscope").is_dir():
        parser.error(f"--baseline-src: no src/kvscope in {args.baseline_src}")
    if args.smoke:
        args.requests, args.max_tokens = 3, 4
    result = run(args)
    print("llama-server:", " | ".join(result["llama_server"]), f"(-np {result['parallel']})")
    print(f"request log ({len(result['log_lines'])} gateway requests):")
    for line in result["log_lines"]:
        print(" ", line)
    if result["missing_log_lines"]:
        print("no log line for:", ", ".join(result["missing_log_lines"]))
    if result["missing_fields"]:
        for request_id, gaps in result["missing_fields"].items():
            print(f"{request_id} lacks: {', '.join(gaps)}")
    else:
        print(f"every line has: {', '.join('.'.join(path[1:]) for path in ASKED)}")
    targets = result["targets"]
    header = f"{'metric':<16}" + "".join(f"{t + ' p50/p99 ms':>22}" for t in targets)
    print("\n" + header + "".join(f"{t + ' adds p50/p99':>24}" for t in targets[1:]) + "   n")
    for name, row in result["latency"].items():
        cells = "".join(f"{row[f'{t}_p50_ms']:>10.1f} / {row[f'{t}_p99_ms']:<9.1f}" for t in targets)
        added = "".join(
            f"{row[f'{t}_added_p50_ms']:>12.1f} / {row[f'{t}_added_p99_ms']:<9.1f}" for t in targets[1:]
        )
        print(f"{name:<16}{cells}{added}{row['gateway_n']:>4}")
    print("interleaved: each round sends the same request to every target, their order rotated")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
