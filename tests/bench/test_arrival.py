"""The arrival process: Poisson gaps have mean 1/R, CV 1 and pass a Kolmogorov–Smirnov test against Exp(R);
gamma burstiness keeps the mean and sets CV = 1/√b; pacing sleeps to absolute deadlines."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from kvscope.bench.arrival import arrival_offsets, inter_arrival_times, paced

N = 20_000
RATE = 4.0
KS_CRITICAL_5PCT = 1.358 / math.sqrt(N)  # asymptotic Kolmogorov critical value, α = 0.05


def ks_statistic_exponential(samples: list[float], rate: float) -> float:
    """sup |F_n(x) − (1 − e^{−rate·x})| over the sample points."""
    ordered = sorted(samples)
    n = len(ordered)
    return max(
        max((i + 1) / n - cdf, cdf - i / n) for i, cdf in enumerate(1 - math.exp(-rate * x) for x in ordered)
    )


def test_poisson_gaps_have_the_expected_rate_and_shape():
    gaps = inter_arrival_times(N, RATE, seed=1234)
    mean = statistics.fmean(gaps)
    assert len(gaps) == N
    assert mean == pytest.approx(1 / RATE, rel=0.02)  # standard error 1/√N = 0.7 %
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.03)
    assert ks_statistic_exponential(gaps, RATE) < KS_CRITICAL_5PCT
    assert arrival_offsets(gaps)[-1] == pytest.approx(N / RATE, rel=0.02)


def test_ks_check_rejects_non_exponential_gaps_with_the_same_mean():
    rng = random.Random(1234)
    uniform = [rng.uniform(0, 2 / RATE) for _ in range(N)]
    assert statistics.fmean(uniform) == pytest.approx(1 / RATE, rel=0.02)
    assert ks_statistic_exponential(uniform, RATE) > KS_CRITICAL_5PCT


def test_gamma_burstiness_keeps_the_mean_and_sets_the_cv():
    gaps = inter_arrival_times(N, RATE, burstiness=4.0, seed=7)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / RATE, rel=0.02)
    assert statistics.pstdev(gaps) / mean == pytest.approx(0.5, abs=0.02)


def test_seeded_infinite_rate_and_invalid_arguments():
    assert inter_arrival_times(5, 2.0, seed=3) == inter_arrival_times(5, 2.0, seed=3)
    assert inter_arrival_times(5, 2.0, seed=3) != inter_arrival_times(5, 2.0, seed=4)
    assert inter_arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        inter_arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        inter_arrival_times(3, 1.0, burstiness=0.0)
    assert arrival_offsets([0.5, 0.25, 1.0]) == [0.5, 0.75, 1.75]


async def test_paced_sleeps_to_absolute_deadlines():
    now = [10.0]
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds + 0.125  # every sleep overshoots by 125 ms

    got = [
        item async for item in paced(["a", "b", "c", "d"], [0.0, 0.5, 1.0, 1.125], lambda: now[0], fake_sleep)
    ]
    assert got == ["a", "b", "c", "d"]
    # deadlines 10.5, 11.0, 11.125: the overshoot of one sleep shortens the next; a reached deadline does not
    # sleep
    assert slept == pytest.approx([0.5, 0.375])
