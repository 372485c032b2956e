"""``--compare``: the same workload against several endpoints in alternation (A B, B A, A B … or A B C, B C A,
C A B, …).

Round r sends the same prompts (dataset seed + r) to every endpoint, one endpoint after the other, so slow
drifts of a shared, noisy machine hit all endpoints alike; the order rotates by one endpoint each round
(counterbalanced), so no endpoint always runs first, or always right after the same other one. Why: on the
2-vCPU VMs of docs/benchmarks.md the same engine's single-stream tok/s moved 131 -> 192 -> 184 between
consecutive rounds, and an endpoint that always ran right after llama.cpp (or first in every round) carried
that position's drift in every pair. Each figure is reported per endpoint as the median over rounds, and as a
ratio to endpoint A: the median over rounds of (X_r / A_r), the paired comparison.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvscope.bench.client import EndpointConfig
from kvscope.bench.dataset import SampleRequest
from kvscope.bench.runner import LoadConfig, RunResult, run_benchmark

# figure → True when higher is better
FIGURES: dict[str, bool] = {
    "request_throughput": True,
    "output_throughput": True,
    "total_token_throughput": True,
    "median_ttft_ms": False,
    "p99_ttft_ms": False,
    "median_tpot_ms": False,
    "p99_tpot_ms": False,
    "median_itl_ms": False,
    "p99_itl_ms": False,
    "median_e2el_ms": False,
    "p99_e2el_ms": False,
}


@dataclass(frozen=True, slots=True)
class Comparison:
    """``runs[r][e]`` is round r on endpoint e; ``labels[e]`` names endpoint e (A, B, …)."""

    labels: list[str]
    endpoints: list[EndpointConfig]
    runs: list[list[RunResult]]

    def figures(self, names: Sequence[str] = tuple(FIGURES)) -> dict[str, list[float]]:
        """Per figure: the median over rounds for each endpoint. Missing figures read as 0.0."""
        return {
            name: [statistics.median(self._values(name, e)) for e in range(len(self.endpoints))]
            for name in names
        }

    def ratios(self, names: Sequence[str] = tuple(FIGURES)) -> dict[str, list[float]]:
        """Per figure: for each endpoint after A, the median over rounds of its value / A's (nan if A's is
        0)."""
        out = {}
        for name in names:
            base = self._values(name, 0)
            out[name] = [
                statistics.median(_ratio(v, b) for v, b in zip(self._values(name, e), base, strict=True))
                for e in range(1, len(self.endpoints))
            ]
        return out

    def _values(self, name: str, endpoint: int) -> list[float]:
        return [_number(run[endpoint].metrics.as_dict().get(name, 0.0), name) for run in self.runs]


def _number(value: float | int | dict[str, int], name: str) -> float:
    """``value`` as a float. Raises TypeError for a figure that is not a number (a per-status count)."""
    if isinstance(value, dict):
        raise TypeError(f"{name} is not a number")
    return float(value)


async def run_comparison(
    endpoints: Sequence[EndpointConfig],
    make_samples: Callable[[int], list[SampleRequest]],
    load: LoadConfig,
    rounds: int,
    *,
    progress: bool = True,
    on_run: Callable[[int, str, RunResult], None] | None = None,
) -> Comparison:
    """Run ``rounds`` rounds; ``make_samples(r)`` gives round r's prompts (shared by every endpoint in it).
    Round r (from 0) runs the endpoints in the order r, r + 1, … (mod their number): A B C, B C A, C A B, ….
    ``on_run(round, label, result)`` is called after each run, in the order they ran. Raises ValueError if
    rounds < 1 or fewer than two endpoints."""
    if rounds < 1 or len(endpoints) < 2:
        raise ValueError("a comparison needs at least 1 round and 2 endpoints")
    labels = [chr(ord("A") + i) for i in range(len(endpoints))]
    runs = []
    for r in range(rounds):
        samples = make_samples(r)
        row: dict[int, RunResult] = {}
        for i in range(len(endpoints)):
            e = (r + i) % len(endpoints)
            row[e] = await run_benchmark(
                endpoints[e], samples, load, progress=progress, label=f"round {r + 1}/{rounds} {labels[e]}"
            )
            if on_run:
                on_run(r, labels[e], row[e])
        runs.append([row[e] for e in range(len(endpoints))])
    return Comparison(labels, list(endpoints), runs)


def _ratio(value: float, base: float) -> float:
    return value / base if base else float("nan")
