"""The console's rings and chart points (gateway/console/series.py) on ticks made by hand."""

from __future__ import annotations

import math

import pytest

from kvscope.gateway.console.series import (
    ConsoleSeries,
    Counters,
    Histograms,
    ReplicaState,
    Tick,
    hist_delta,
    hist_sum,
    histogram_quantile,
)

INF = math.inf
BOUNDS = (0.1, 0.5, 1.0, INF)


def test_histogram_quantile_is_prometheus_bucket_interpolation() -> None:
    # 10 observations: 4 ≤ 0.1, 8 ≤ 0.5, 9 ≤ 1, 10 in all
    hist = (BOUNDS, (4.0, 8.0, 9.0, 10.0))
    # rank 5 falls in (0.1, 0.5]: 0.1 + 0.4 x (5 - 4) / (8 - 4)
    assert histogram_quantile(0.5, hist) == 0.1 + 0.4 * (1.0 / 4.0)
    # rank 2 in the first bucket, from 0: 0.1 x 2 / 4
    assert histogram_quantile(0.2, hist) == 0.1 * (2.0 / 4.0)
    # rank 9.9 lands in +Inf: the highest finite bound
    assert histogram_quantile(0.99, hist) == 1.0
    assert histogram_quantile(0.5, (BOUNDS, (0.0, 0.0, 0.0, 0.0))) is None
    assert histogram_quantile(0.5, ((0.1, 0.5), (1.0, 2.0))) is None  # no +Inf bucket: NaN in Prometheus
    assert histogram_quantile(0.5, ((INF,), (3.0,))) is None  # fewer than two buckets


def test_histograms_add_and_subtract_bucket_by_bucket() -> None:
    a, b = (BOUNDS, (1.0, 2.0, 3.0, 4.0)), (BOUNDS, (0.0, 1.0, 1.0, 1.0))
    assert hist_sum([a, b]) == (BOUNDS, (1.0, 3.0, 4.0, 5.0))
    assert hist_sum([]) is None
    assert hist_delta(a, b) == (BOUNDS, (1.0, 1.0, 2.0, 3.0))
    assert hist_delta(a, None) == a and hist_delta(None, b) is None


def _tick(at: float, requests: float, output: float, ttft: tuple[float, ...], **kw) -> Tick:
    counters = Counters(
        requests=requests,
        by_status=kw.pop("by_status", {"200": requests}),
        output_tokens=output,
        input_tokens=kw.pop("input_tokens", 0.0),
        cached_tokens=kw.pop("cached_tokens", 0.0),
        stream_errors=kw.pop("stream_errors", {"aborted": 0.0}),
        rate_limited=kw.pop("rate_limited", {"requests": 0.0}),
        spec_draft_tokens=kw.pop("spec_draft_tokens", 0.0),
        spec_accepted_tokens=kw.pop("spec_accepted_tokens", 0.0),
    )
    replicas = kw.pop("replicas", ())
    return Tick(at, 1000.0 + at, counters, Histograms(ttft={"m": (BOUNDS, ttft)}), replicas)


def test_points_hold_rates_over_the_interval_and_quantiles_over_the_window() -> None:
    series = ConsoleSeries(history_s=20.0, interval_s=2.0, chart_window_s=4.0)
    r = ReplicaState("r1", "http://r1", "kvscope", True, False, 2, 3.0, 1.0, 0.25, 0.5)
    series.add(_tick(0.0, 0, 0, (0.0, 0.0, 0.0, 0.0), replicas=(r,)))
    series.add(_tick(2.0, 4, 40, (2.0, 4.0, 4.0, 4.0), input_tokens=100.0, cached_tokens=25.0))
    series.add(
        _tick(
            4.0,
            10,
            100,
            (2.0, 4.0, 8.0, 10.0),
            by_status={"200": 9.0, "404": 1.0},
            stream_errors={"aborted": 2.0},
        )
    )
    p = series.points[-1]
    assert p.dt == 2.0
    assert (p.values["requests_per_s"], p.values["output_tokens_per_s"]) == (3.0, 30.0)
    assert p.groups["errors_per_s"] == {"404": 0.5, "stream:aborted": 1.0}
    # the window (4 s) reaches the first tick: all 10 observations; rank 5 in (0.5, 1]
    assert p.values["ttft_p50_s"] == 0.5 + 0.5 * (1.0 / 4.0)
    assert p.values["ttft_p99_s"] == 1.0
    first = series.points[0]
    assert first.dt is None and first.values["requests_per_s"] is None
    assert first.groups["kv_usage"] == {"r1": 0.25} and first.groups["running"] == {"r1": 3.0}
    # a tick 6 s later: the window starts at the 4 s tick, where nothing happened since
    series.add(_tick(8.0, 10, 100, (2.0, 4.0, 8.0, 10.0)))
    assert series.points[-1].values["ttft_p50_s"] is None
    assert series.points[-1].values["prefix_cache_hit_ratio"] is None


def test_the_prefix_cache_hit_rate_is_cached_over_prompt_tokens_in_the_window() -> None:
    series = ConsoleSeries(history_s=20.0, interval_s=2.0, chart_window_s=60.0)
    series.add(_tick(0.0, 0, 0, (0.0,) * 4))
    series.add(_tick(2.0, 1, 1, (0.0,) * 4, input_tokens=100.0, cached_tokens=25.0))
    series.add(_tick(4.0, 2, 2, (0.0,) * 4, input_tokens=300.0, cached_tokens=125.0))
    assert [p.values["prefix_cache_hit_ratio"] for p in series.points] == [None, 0.25, 125.0 / 300.0]


def test_the_speculative_acceptance_is_accepted_over_draft_tokens_in_the_window() -> None:
    series = ConsoleSeries(history_s=20.0, interval_s=2.0, chart_window_s=4.0)
    series.add(_tick(0.0, 0, 0, (0.0,) * 4))
    series.add(_tick(2.0, 1, 1, (0.0,) * 4, spec_draft_tokens=8.0, spec_accepted_tokens=6.0))
    series.add(_tick(4.0, 2, 2, (0.0,) * 4, spec_draft_tokens=20.0, spec_accepted_tokens=9.0))
    # the 6 s tick's window (4 s) starts at the 2 s tick: 9 - 6 = 3 accepted of 20 - 8 = 12 drafted
    series.add(_tick(6.0, 3, 3, (0.0,) * 4, spec_draft_tokens=20.0, spec_accepted_tokens=9.0))
    series.add(_tick(8.0, 3, 3, (0.0,) * 4, spec_draft_tokens=20.0, spec_accepted_tokens=9.0))
    ratios = [p.values["spec_acceptance_ratio"] for p in series.points]
    assert ratios == [None, 6.0 / 8.0, 9.0 / 20.0, 3.0 / 12.0, None]  # the last window drafted nothing
    assert series.columns()["series"]["spec_acceptance_ratio"] == ratios


def test_the_rings_are_bounded_and_columns_start_after_since() -> None:
    series = ConsoleSeries(history_s=10.0, interval_s=2.0, chart_window_s=4.0)
    for i in range(20):
        series.add(_tick(2.0 * i, i, 0, (0.0, 0.0, 0.0, float(i))))
    assert len(series.ticks) == len(series.points) == 6  # 10 s / 2 s + 1
    assert series.ticks[0].at == 28.0
    assert len(series._hists) == 4  # the 4 s window + 2
    columns = series.columns(since_wall=1000.0 + 34.0)
    assert columns["t"] == [1036.0, 1038.0]
    assert columns["series"]["requests_per_s"] == [0.5, 0.5]
    # zero series of a rate are no member; a member appears once it is not 0
    assert columns["series"]["errors_per_s"] == {} and columns["series"]["rate_limited_per_s"] == {}
    assert series.tick_before(0.0) is series.ticks[0]  # older than kept: the oldest
    assert series.tick_before(33.0) is series.ticks[2]
    assert [t.at for t in series.ticks_since(33.0)] == [34.0, 36.0, 38.0]
    assert [t.at for t in series.ticks_since(34.0)] == [34.0, 36.0, 38.0]  # at or after
    assert [t.at for t in series.ticks_since(0.0)] == [28.0, 30.0, 32.0, 34.0, 36.0, 38.0]
    assert series.ticks_since(39.0) == []


def test_columns_are_the_newest_points_back_to_since_even_after_the_clock_was_set_back() -> None:
    series = ConsoleSeries(history_s=20.0, interval_s=2.0, chart_window_s=4.0)
    for at, wall in ((0.0, 1000.0), (2.0, 1002.0), (4.0, 1004.0), (6.0, 1001.0), (8.0, 1003.0)):
        tick = _tick(at, at, 0, (0.0,) * 4)
        series.add(Tick(tick.at, wall, tick.counters, tick.histograms))
    assert series.columns(1003.0)["t"] == []  # the newest point: nothing new
    assert series.columns(1002.0)["t"] == [1003.0]  # not the 1004 point a second time
    assert series.columns(999.0)["t"] == [1000.0, 1002.0, 1004.0, 1001.0, 1003.0]
    assert series.columns(None)["t"] == [1000.0, 1002.0, 1004.0, 1001.0, 1003.0]


@pytest.mark.parametrize("since", [None, 0.0])
def test_a_member_seen_later_reads_0_before_for_rates(since: float | None) -> None:
    series = ConsoleSeries(history_s=20.0, interval_s=2.0, chart_window_s=4.0)
    series.add(_tick(0.0, 0, 0, (0.0,) * 4))
    series.add(_tick(2.0, 1, 0, (0.0,) * 4))
    series.add(_tick(4.0, 2, 0, (0.0,) * 4, rate_limited={"requests": 2.0}))
    assert series.columns(since)["series"]["rate_limited_per_s"] == {"requests": [None, 0.0, 1.0]}
