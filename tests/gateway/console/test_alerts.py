"""The console's in-process alert evaluation (gateway/console/alerts.py): the shipped rules file is the one
source of its thresholds, windows and ``for`` (the same numbers Prometheus and the dashboards read), and each
evaluator says ok, pending, firing, no data or not evaluated as the rule would."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvscope.dashboards.alert_thresholds import alert_threshold
from kvscope.gateway.console.alerts import (
    EVALUATORS,
    AlertBoard,
    condition_text,
    format_duration,
    load_rules,
    parse_duration,
    rules_text,
)
from kvscope.gateway.console.series import ConsoleSeries, Counters, Histograms, ReplicaState, Tick

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "alerts" / "kvscope.rules.yaml"
TTFT_BOUNDS = (0.5, 1.0, 2.5, math.inf)


def test_the_console_reads_the_shipped_rules_file_itself() -> None:
    assert rules_text() == RULES.read_text(encoding="utf-8")
    rules, routes = load_rules()
    assert routes == ("/v1/chat/completions", "/v1/completions")
    assert sorted({r.alert for r in rules}) == sorted(EVALUATORS)


def test_every_number_is_the_rules_number() -> None:
    """The first comparison of each rule is the number dashboards/alert_thresholds.py reads from the same file
    (one source for Prometheus, the dashboards and the console)."""
    rules, _ = load_rules()
    for rule in rules:
        labels = {k: v for k, v in rule.labels.items() if k in ("severity", "long_window")}
        if rule.alert in ("KvscopeTargetMissing", "Watchdog"):
            assert rule.comparisons == ()
            continue
        if rule.comparisons[0][0] == "==":  # the dashboards read only ordering comparisons
            assert rule.comparisons == (("==", 0.0),), rule.alert
            continue
        assert rule.comparisons[0][1] == alert_threshold(rule.alert, **labels), rule.alert
    by_name = {(r.alert, r.labels.get("long_window")): r for r in rules}
    page = by_name[("KvscopeHighErrorRate", "1h")]
    assert (page.comparisons, page.windows_s, page.for_s) == (
        ((">", 0.072), (">", 0.072), (">=", 100.0)),
        (3600.0, 300.0, 3600.0),
        120.0,
    )
    ttft = by_name[("KvscopeTTFTSLOBreach", None)]
    assert (ttft.le, ttft.comparisons, ttft.windows_s) == (1.0, (("<", 0.95),), (600.0, 600.0))
    assert by_name[("KvscopeHighP99Latency", None)].quantile == 0.99
    assert condition_text(page) == "errors > 7.2% of requests over 1h and 5m, ≥ 100 requests"
    assert condition_text(ttft) == "< 95% of TTFTs ≤ 1 s over 10m"


def test_durations() -> None:
    assert [parse_duration(t) for t in ("5m", "1h", "3d", "1h30m", "90s")] == [300, 3600, 259200, 5400, 90]
    with pytest.raises(ValueError):
        parse_duration("5 minutes")
    assert [format_duration(s) for s in (300, 3600, 86400, 90)] == ["5m", "1h", "1d", "90s"]


def _replica(healthy: bool = True, waiting: float | None = 0.0) -> ReplicaState:
    return ReplicaState("r1", "http://r1", "kvscope", healthy, False, 0, 1.0, waiting, 0.5, 0.1)


def _run(
    board: AlertBoard,
    seconds: float,
    *,
    slow_per_tick: float = 0.0,
    requests_per_tick: float = 0.0,
    errors_per_tick: float = 0.0,
    replica: ReplicaState | None = None,
) -> ConsoleSeries:
    """Ticks every 2 s for ``seconds``, each adding ``slow_per_tick`` TTFTs in (1, 2.5] s and generation
    requests of model ``m`` (``errors_per_tick`` of them 5xx); the board evaluated at each."""
    series = ConsoleSeries(interval_s=2.0, histogram_window_s=600.0)
    for i in range(int(seconds / 2) + 1):
        slow, requests, errors = i * slow_per_tick, i * requests_per_tick, i * errors_per_tick
        counters = Counters(generation={"m": requests}, generation_5xx={"m": errors}, requests=requests)
        ttft = {"m": (TTFT_BOUNDS, (0.0, 0.0, slow, slow))}
        series.add(Tick(2.0 * i, 2.0 * i, counters, Histograms(ttft=ttft), (replica or _replica(),)))
        board.evaluate(series)
    return series


def _status(board: AlertBoard, alert: str, long_window: str | None = None):
    (status,) = [
        s for s in board.statuses if s.rule.alert == alert and s.rule.labels.get("long_window") == long_window
    ]
    return status


def test_a_slow_p99_is_pending_until_its_for_then_firing() -> None:
    board = AlertBoard(load_rules()[0])
    _run(board, 310, slow_per_tick=1.0)
    p99 = _status(board, "KvscopeHighP99Latency")
    # all in (1, 2.5]: rank 0.99 x n interpolated from 1 s
    assert (p99.state, p99.subject, p99.holding_s) == ("pending", "m", 308.0)
    assert p99.value == 1.0 + 1.5 * 0.99
    slo = _status(board, "KvscopeTTFTSLOBreach")  # none within 1 s: 0 % < 95 %, for 5 minutes
    assert (slo.state, slo.value) == ("firing", 0.0)
    _run(board, 700, slow_per_tick=1.0)  # a new series: held for 600 s (10 min) at its end
    assert _status(board, "KvscopeHighP99Latency").state == "firing"


def test_the_rules_threshold_decides() -> None:
    """One source: raising the p99 threshold in the rules text (5 s) leaves the same latencies ok."""
    text = RULES.read_text(encoding="utf-8")
    old = "rate(kvscope_gateway_time_to_first_token_seconds_bucket[5m])))\n          > 1\n"
    assert text.count(old) == 1
    board = AlertBoard(load_rules(text.replace(old, old.replace("> 1", "> 5")))[0])
    _run(board, 60, slow_per_tick=1.0)
    assert _status(board, "KvscopeHighP99Latency").state == "ok"
    changed = text.replace(old, old.replace("> 1", "> 1 and on() vector(1) > 0"))
    board = AlertBoard(load_rules(changed)[0])
    _run(board, 10, slow_per_tick=1.0)
    broken = _status(board, "KvscopeHighP99Latency")
    assert (broken.state, broken.detail) == (
        "not_evaluated",
        "the rule's shape changed (2 comparisons, 1 windows; the console evaluates 1 and 1)",
    )


def test_the_error_budget_alert_needs_its_ratio_in_both_windows_and_enough_requests() -> None:
    board = AlertBoard(load_rules()[0])
    _run(board, 300, requests_per_tick=2.0, errors_per_tick=0.2)  # 10 % > 7.2 %; 100 requests from 100 s
    page = _status(board, "KvscopeHighErrorRate", "1h")
    assert (page.state, page.subject, page.holding_s) == ("firing", "m", 200.0)
    assert page.value == pytest.approx(0.1)
    assert page.detail == "10.00% over 1h (over the 300 s the console has), 10.00% over 5m, 300 requests"
    board = AlertBoard(load_rules()[0])
    _run(board, 60, requests_per_tick=2.0, errors_per_tick=0.2)  # 60 requests: under the 100 minimum
    assert _status(board, "KvscopeHighErrorRate", "1h").state == "ok"
    six_hours = _status(board, "KvscopeHighErrorRate", "6h")
    assert (six_hours.state, six_hours.detail) == (
        "not_evaluated",
        "needs 6h of history; the console keeps 1h",
    )


def test_replica_conditions() -> None:
    board = AlertBoard(load_rules()[0])
    _run(board, 30, replica=_replica(healthy=False, waiting=3.0))
    down = _status(board, "KvscopeUpstreamDown")
    assert (down.state, down.subject, down.value, down.holding_s) == ("pending", "r1", 0.0, 30.0)
    assert _status(board, "KvscopeNoHealthyUpstream").state == "pending"
    queue = _status(board, "KvscopeQueueBuildup")
    assert (queue.state, queue.value) == ("pending", 3.0)
    board = AlertBoard(load_rules()[0])
    _run(board, 10, replica=_replica(waiting=None))
    assert _status(board, "KvscopeQueueBuildup").state == "no_data"
    assert _status(board, "KvscopeUpstreamDown").state == "ok"


def test_kv_cache_pressure_is_a_full_cache_and_a_growing_queue_per_replica() -> None:
    board = AlertBoard(load_rules()[0])
    series = ConsoleSeries(interval_s=2.0, histogram_window_s=600.0)
    for i in range(601):  # 20 minutes; 15/16 full: a mean exact in binary
        replicas = (
            # full, the queue growing by one request a tick
            ReplicaState("full-growing", "http://a", "kvscope", True, False, 0, 8.0, float(i), 0.9375, 0.1),
            # full, the queue flat
            ReplicaState("full-flat", "http://b", "kvscope", True, False, 0, 8.0, 2.0, 0.9375, 0.1),
            # half full, the queue growing
            ReplicaState("half-growing", "http://c", "kvscope", True, False, 0, 8.0, float(i), 0.5, 0.1),
        )
        series.add(Tick(2.0 * i, 2.0 * i, Counters(), Histograms(), replicas))
        board.evaluate(series)
    states = {
        s.subject: (s.state, s.value, s.detail, s.holding_s)
        for s in board.statuses
        if s.rule.alert == "KvscopeKVCachePressure"
    }
    growing = "mean KV usage 94% over 5m; 0 preemptions over 10m; queue growing"
    assert states == {
        # holding since the second tick (a slope needs two points): 1198 s, past the rule's 10m
        "full-growing": ("firing", 0.9375, growing, 1198.0),
        "full-flat": (
            "ok",
            0.9375,
            "mean KV usage 94% over 5m; 0 preemptions over 10m; queue not growing",
            None,
        ),
        "half-growing": ("ok", 0.5, "mean KV usage 50% over 5m; 0 preemptions over 10m; queue growing", None),
    }


def test_alerts_over_series_the_gateway_lacks_say_why() -> None:
    board = AlertBoard(load_rules()[0])
    _run(board, 4)
    reasons = {
        s.rule.alert: s.detail
        for s in board.statuses
        if s.state == "not_evaluated" and "of history" not in s.detail
    }
    assert sorted(reasons) == [
        "KvscopeEngineHighErrorRate",
        "KvscopeGPUAllocatorFailures",
        "KvscopeGPUMemoryOverBudget",
        "KvscopeGPUThrottled",
        "KvscopeLoadShedding",
        "KvscopeTargetDown",
        "KvscopeTargetMissing",
        "Watchdog",
    ]
    assert reasons["KvscopeGPUThrottled"].startswith("needs the engine's GPU series")
