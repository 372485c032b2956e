"""Which of kvscope's shipped alert conditions hold now, evaluated in the gateway from the console's series
(gateway/console/series.py), with the thresholds, windows and ``for`` durations read from the shipped rules
file itself: alerts/kvscope.rules.yaml, in the package as gateway/console/kvscope.rules.yaml (a symlink in
the repository, a copy in a built wheel). One source: change a number in the rules and Prometheus and the
console both follow (the dashboards read the same file, dashboards/alert_thresholds.py).

What is read from each rule: the numbers its expression compares with (:attr:`AlertRule.comparisons`, in
order), its windows (``[5m]`` and recording rules' ``:rate1h``/``:increase1h`` suffixes, in order), the
quantile of ``histogram_quantile``, the ``le`` bound of an SLO ratio, ``for``, severity, summary and runbook.
The expression's structure is this module's (one evaluator per alert name, :data:`EVALUATORS`), so a rule
whose shape changes (another number of comparisons or windows) is shown as not evaluated, saying why, and
tests/gateway/console/test_alerts.py fails.

Differences from Prometheus, on purpose: counters are read exactly at ticks (no ``increase()`` extrapolation),
a window longer than the gateway has run reads what there is, and a window longer than the console's history
(one hour: the 6 h, 1 d and 3 d burn rates) is not evaluated. Alerts over series the gateway does not have
(the engine's own request counters, GPU telemetry, Prometheus' scrape health) are listed as not evaluated
here, with the reason. Preemptions come from the request-log records (our engine's ``num_preemptions`` of each
finished request), not from the engine's counter.
"""

from __future__ import annotations

import importlib.resources
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from kvscope.gateway.console.series import ConsoleSeries, Counters, Tick, histogram_quantile

RULES_RESOURCE = "kvscope.rules.yaml"
"""The rules file in this package (alerts/kvscope.rules.yaml)."""

_COMPARISON = re.compile(r"(>=|<=|==|!=|>|<)\s*(-?[0-9][0-9.eE+-]*)")
_WINDOW = re.compile(r"\[([0-9smhdw]+)\]|:(?:rate|increase)([0-9]+[smhdw])\b")
_QUANTILE = re.compile(r"histogram_quantile\(\s*([0-9.]+)")
_LE = re.compile(r'le=~?"([0-9.]+)')
_ROUTES = re.compile(r'route=~"([^"]+)"')
_DURATION = re.compile(r"([0-9]+)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}

State = Literal["firing", "pending", "ok", "no_data", "not_evaluated"]


def parse_duration(text: str) -> float:
    """A Prometheus duration (``5m``, ``1h30m``, ``3d``) in seconds. Raises ValueError."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return float(sum(int(n) * _UNITS[u] for n, u in parts))


def format_duration(seconds: float) -> str:
    """``3600`` → ``1h``, ``300`` → ``5m``, ``90`` → ``90s`` (the largest unit that divides it)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One ``alert:`` rule of the rules file, with the numbers the console evaluates it by."""

    alert: str
    group: str
    expr: str
    for_s: float
    labels: Mapping[str, str]
    summary: str
    runbook_url: str | None
    comparisons: tuple[tuple[str, float], ...]
    """(operator, number) of each comparison with a number, in the expression's order."""
    windows_s: tuple[float, ...]
    """Each range window (``[5m]``) and recording-rule window (``:rate1h``), in order, in seconds."""
    quantile: float | None
    le: float | None
    """The bucket bound of an SLO ratio (``le=~"1|1.0"`` → 1.0)."""

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")

    @property
    def threshold_text(self) -> str:
        return ", ".join(f"{op} {n:g}" for op, n in self.comparisons)


def rules_text() -> str:
    """The shipped rules file's text."""
    return (importlib.resources.files("kvscope.gateway.console") / RULES_RESOURCE).read_text(encoding="utf-8")


def load_rules(text: str | None = None) -> tuple[tuple[AlertRule, ...], tuple[str, ...]]:
    """(every alert rule of a rules file, in order; the generation routes of its SLO recording rules).
    ``text``: the file's text (default: the shipped file). Raises ValueError for a rule whose ``for`` or
    window is not a duration."""
    doc = yaml.safe_load(text if text is not None else rules_text())
    rules: list[AlertRule] = []
    routes: tuple[str, ...] = ()
    for group in doc["groups"]:
        for r in group["rules"]:
            expr = str(r["expr"])
            if "record" in r:
                match = _ROUTES.search(expr)
                if not routes and match and str(r["record"]).startswith("kvscope:gateway_slo"):
                    routes = tuple(match.group(1).split("|"))
                continue
            quantile, le = _QUANTILE.search(expr), _LE.search(expr)
            annotations = r.get("annotations") or {}
            rules.append(
                AlertRule(
                    alert=str(r["alert"]),
                    group=str(group["name"]),
                    expr=expr,
                    for_s=parse_duration(str(r["for"])) if "for" in r else 0.0,
                    labels={str(k): str(v) for k, v in (r.get("labels") or {}).items()},
                    summary=str(annotations.get("summary", "")),
                    runbook_url=annotations.get("runbook_url"),
                    comparisons=tuple((op, float(n)) for op, n in _COMPARISON.findall(_no_labels(expr))),
                    windows_s=tuple(parse_duration(a or b) for a, b in _WINDOW.findall(expr)),
                    quantile=float(quantile.group(1)) if quantile else None,
                    le=float(le.group(1)) if le else None,
                )
            )
    return tuple(rules), routes


def _no_labels(expr: str) -> str:
    """``expr`` without its label matchers' values (``status=~"5.."`` holds no comparison)."""
    return re.sub(r'"[^"]*"', '""', expr)


def compare(value: float, op: str, threshold: float) -> bool:
    """PromQL's comparison ``value op threshold`` (NaN compares false)."""
    if math.isnan(value):
        return False
    return {
        ">": value > threshold,
        ">=": value >= threshold,
        "<": value < threshold,
        "<=": value <= threshold,
        "==": value == threshold,
        "!=": value != threshold,
    }[op]


@dataclass(frozen=True, slots=True)
class Finding:
    """One subject's (a model, a replica, a sink, the gateway) evaluation of a rule."""

    subject: str
    holds: bool | None
    """None: no data (the expression has no value: Prometheus would have no series, so no alert)."""
    value: float | None = None
    unit: str = ""
    """``ratio``, ``s``, ``count``, ``per_s``, ``bytes``, ``up``: how to show the value."""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class NotEvaluated:
    reason: str


Evaluation = list[Finding] | NotEvaluated


@dataclass(frozen=True, slots=True)
class AlertStatus:
    """A rule's state for one subject now."""

    rule: AlertRule
    subject: str
    state: State
    value: float | None = None
    unit: str = ""
    detail: str = ""
    holding_s: float | None = None
    """Seconds the condition has held (None: it does not)."""

    def to_dict(self) -> dict[str, Any]:
        r = self.rule
        return {
            "alert": r.alert,
            "group": r.group,
            "severity": r.severity,
            "labels": dict(r.labels),
            "summary": r.summary,
            "runbook_url": r.runbook_url,
            "threshold": r.threshold_text,
            "condition": condition_text(r),
            "for_s": r.for_s,
            "subject": self.subject,
            "state": self.state,
            "value": self.value,
            "unit": self.unit,
            "detail": self.detail,
            "holding_s": self.holding_s,
        }


# --- the evaluators: one per alert name -------------------------------------------------------------------
def _shape(rule: AlertRule, comparisons: int, windows: int) -> NotEvaluated | None:
    if len(rule.comparisons) != comparisons or len(rule.windows_s) != windows:
        return NotEvaluated(
            f"the rule's shape changed ({len(rule.comparisons)} comparisons, {len(rule.windows_s)} windows; "
            f"the console evaluates {comparisons} and {windows})"
        )
    return None


def _span(series: ConsoleSeries, window_s: float) -> tuple[Tick, Tick, str] | NotEvaluated:
    """(the tick at the window's start, the latest, a note when the gateway has run for less than the
    window)."""
    latest = series.latest
    if latest is None:
        return NotEvaluated("no tick yet")
    if window_s > series.history_s:
        return NotEvaluated(
            f"needs {format_duration(window_s)} of history; "
            f"the console keeps {format_duration(series.history_s)}"
        )
    base = series.tick_before(latest.at - window_s)
    assert base is not None
    short = latest.at - base.at < window_s - series.interval_s
    note = f" (over the {latest.at - base.at:.0f} s the console has)" if short else ""
    return base, latest, note


def _delta(now: Mapping[str, float], then: Mapping[str, float], key: str) -> float:
    return now.get(key, 0.0) - then.get(key, 0.0)


def _error_budget(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeHighErrorRate: the error ratio (5xx + broken streams) / generation requests over a long and a
    short window both above the burn threshold, with at least N requests in the long window; per model."""
    bad = _shape(rule, 3, 3)
    if bad:
        return bad
    (op1, t1), (op2, t2), (op3, n) = rule.comparisons
    long_w, short_w, count_w = rule.windows_s
    spans: list[tuple[Tick, Tick, str]] = []
    for w in (long_w, short_w, count_w):
        span = _span(series, w)
        if isinstance(span, NotEvaluated):
            return span
        spans.append(span)
    (lb, latest, note), (sb, _, _), (cb, _, _) = spans
    c: Counters = latest.counters

    def ratio(base: Tick, model: str) -> float | None:
        b = base.counters
        requests = _delta(c.generation, b.generation, model)
        failed = _delta(c.generation_5xx, b.generation_5xx, model) + _delta(
            c.stream_errors_by_model, b.stream_errors_by_model, model
        )
        return failed / requests if requests > 0 else None

    findings = []
    for model in sorted(c.generation):
        long_r, short_r = ratio(lb, model), ratio(sb, model)
        count = _delta(c.generation, cb.counters.generation, model)
        if long_r is None or short_r is None:
            findings.append(Finding(model, None, detail="no generation requests in the window"))
            continue
        holds = compare(long_r, op1, t1) and compare(short_r, op2, t2) and compare(count, op3, n)
        detail = (
            f"{long_r:.2%} over {format_duration(long_w)}{note}, {short_r:.2%} over "
            f"{format_duration(short_w)}, {count:.0f} requests"
        )
        findings.append(Finding(model, holds, long_r, "ratio", detail))
    return findings


def _kind(rule: AlertRule) -> str:
    return "ttft" if "time_to_first_token" in rule.expr else "tpot"


def _models(series: ConsoleSeries, kind: str) -> list[str]:
    latest = series.latest
    return sorted(getattr(latest.histograms, kind)) if latest else []


def _p99(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeHighP99Latency, KvscopeHighP99TimePerOutputToken: the quantile over the window above the
    threshold; per model."""
    bad = _shape(rule, 1, 1)
    if bad:
        return bad
    if rule.quantile is None:
        return NotEvaluated("the rule has no histogram_quantile")
    (op, t), (w,) = rule.comparisons[0], rule.windows_s
    kind, findings = _kind(rule), []
    for model in _models(series, kind):
        value = histogram_quantile(rule.quantile, series.window_histogram(kind, w, model) or ((), ()))
        if value is None:
            findings.append(
                Finding(model, None, detail=f"no {kind.upper()} in the last {format_duration(w)}")
            )
        else:
            findings.append(
                Finding(
                    model,
                    compare(value, op, t),
                    value,
                    "s",
                    f"p{rule.quantile * 100:g} over {format_duration(w)}",
                )
            )
    return findings


def _slo(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeTTFTSLOBreach, KvscopeTPOTSLOBreach: the share of observations at or under the ``le`` bound
    over the window below the objective; per model."""
    bad = _shape(rule, 1, 2)
    if bad:
        return bad
    if rule.le is None:
        return NotEvaluated("the rule names no le bound")
    (op, t), w = rule.comparisons[0], rule.windows_s[0]
    kind, findings = _kind(rule), []
    for model in _models(series, kind):
        hist = series.window_histogram(kind, w, model)
        if hist is None or not hist[1] or hist[1][-1] <= 0:
            findings.append(
                Finding(model, None, detail=f"no {kind.upper()} in the last {format_duration(w)}")
            )
            continue
        bounds, counts = hist
        if rule.le not in bounds:
            return NotEvaluated(f"the histogram has no {rule.le:g} s bucket")
        share = counts[bounds.index(rule.le)] / counts[-1]
        findings.append(
            Finding(
                model,
                compare(share, op, t),
                share,
                "ratio",
                f"{share:.1%} of {counts[-1]:.0f} at ≤ {rule.le:g} s over {format_duration(w)}",
            )
        )
    return findings


def _replica_values(series: ConsoleSeries, window_s: float, attr: str) -> dict[str, list[float | None]]:
    latest = series.latest
    if latest is None:
        return {}
    values: dict[str, list[float | None]] = {r.label: [] for r in latest.replicas}
    for tick in series.ticks_since(latest.at - window_s):
        for r in tick.replicas:
            if r.label in values:
                values[r.label].append(getattr(r, attr))
    return values


def _deriv(points: Sequence[tuple[float, float]]) -> float | None:
    """PromQL ``deriv``: the least-squares slope (per second) of (time, value) points; None for fewer than
    two."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var > 0 else None


def _queue_buildup(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeQueueBuildup: the fewest requests waiting over the window above the threshold; per replica."""
    bad = _shape(rule, 1, 1)
    if bad:
        return bad
    (op, t), (w,) = rule.comparisons[0], rule.windows_s
    findings = []
    for label, values in _replica_values(series, w, "waiting").items():
        known = [v for v in values if v is not None]
        if not known:
            findings.append(Finding(label, None, detail="no queue-depth sample"))
            continue
        low = min(known)
        findings.append(
            Finding(label, compare(low, op, t), low, "count", f"fewest waiting over {format_duration(w)}")
        )
    return findings


def _preempted(series: ConsoleSeries, window_s: float, label: str) -> tuple[float, float] | None:
    span = _span(series, window_s)
    if isinstance(span, NotEvaluated):
        return None
    base, latest, _ = span
    return _delta(latest.counters.preemptions, base.counters.preemptions, label), latest.at - base.at


def _kv_pressure(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeKVCachePressure: the mean KV-cache usage over the window above the threshold, and requests
    preempted or the queue growing (``deriv`` of requests waiting); per replica."""
    bad = _shape(rule, 3, 3)
    if bad:
        return bad
    (op1, t1), (op2, t2), (op3, t3) = rule.comparisons
    avg_w, preempt_w, deriv_w = rule.windows_s
    latest = series.latest
    usage = _replica_values(series, avg_w, "kv_usage")
    waiting_by_replica: dict[str, list[tuple[float, float]]] = {label: [] for label in usage}
    if latest is not None:
        for tick in series.ticks_since(latest.at - deriv_w):
            for r in tick.replicas:
                if r.label in waiting_by_replica and r.waiting is not None:
                    waiting_by_replica[r.label].append((tick.at, r.waiting))
    findings = []
    for label, values in usage.items():
        known = [v for v in values if v is not None]
        if not known or latest is None:
            findings.append(Finding(label, None, detail="no KV-usage sample"))
            continue
        mean = sum(known) / len(known)
        preempted = _preempted(series, preempt_w, label)
        slope = _deriv(waiting_by_replica[label])
        pressure = (preempted is not None and compare(preempted[0], op2, t2)) or (
            slope is not None and compare(slope, op3, t3)
        )
        detail = (
            f"mean KV usage {mean:.0%} over {format_duration(avg_w)}; "
            f"{preempted[0] if preempted else 0:.0f} preemptions over {format_duration(preempt_w)}; "
            f"queue {'growing' if slope and slope > 0 else 'not growing'}"
        )
        findings.append(Finding(label, compare(mean, op1, t1) and pressure, mean, "ratio", detail))
    return findings


def _preemption_storm(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopePreemptionStorm: preemptions per second over the window above the threshold; per replica."""
    bad = _shape(rule, 1, 1)
    if bad:
        return bad
    (op, t), (w,) = rule.comparisons[0], rule.windows_s
    latest = series.latest
    findings = []
    for r in latest.replicas if latest else ():
        preempted = _preempted(series, w, r.label)
        if preempted is None or preempted[1] <= 0:
            findings.append(Finding(r.label, None, detail="not enough history"))
            continue
        rate = preempted[0] / preempted[1]
        findings.append(
            Finding(
                r.label, compare(rate, op, t), rate, "per_s", f"{preempted[0]:.0f} preemptions in the window"
            )
        )
    return findings


def _upstream_down(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeUpstreamDown: a replica's ``upstream_up`` equals the threshold (0)."""
    bad = _shape(rule, 1, 0)
    if bad:
        return bad
    op, t = rule.comparisons[0]
    latest = series.latest
    return [
        Finding(r.label, compare(float(r.healthy), op, t), float(r.healthy), "up", r.url)
        for r in (latest.replicas if latest else ())
    ]


def _no_healthy(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeNoHealthyUpstream: the largest ``upstream_up`` equals the threshold (0)."""
    bad = _shape(rule, 1, 0)
    if bad:
        return bad
    op, t = rule.comparisons[0]
    latest = series.latest
    if latest is None or not latest.replicas:
        return [Finding("gateway", None, detail="no replica")]
    up = max(float(r.healthy) for r in latest.replicas)
    healthy = sum(r.healthy for r in latest.replicas)
    return [Finding("gateway", compare(up, op, t), up, "up", f"{healthy} of {len(latest.replicas)} healthy")]


def _log_shipping(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeLogShippingFailing: request-log records failed or dropped per second over the window; per
    sink."""
    bad = _shape(rule, 1, 1)
    if bad:
        return bad
    (op, t), (w,) = rule.comparisons[0], rule.windows_s
    span = _span(series, w)
    if isinstance(span, NotEvaluated):
        return span
    base, latest, note = span
    dt = latest.at - base.at
    findings = []
    for sink in sorted(latest.counters.log_failed):
        lost = _delta(latest.counters.log_failed, base.counters.log_failed, sink)
        rate = lost / dt if dt > 0 else 0.0
        findings.append(Finding(sink, compare(rate, op, t), rate, "per_s", f"{lost:.0f} records lost{note}"))
    return findings or [Finding("gateway", None, detail="no request-log sink")]


def _log_spooling(rule: AlertRule, series: ConsoleSeries) -> Evaluation:
    """KvscopeLogSpooling: bytes in the on-disk spool above the threshold."""
    bad = _shape(rule, 1, 0)
    if bad:
        return bad
    op, t = rule.comparisons[0]
    latest = series.latest
    if latest is None:
        return NotEvaluated("no tick yet")
    spooled = latest.counters.spool_bytes
    return [Finding("gateway", compare(spooled, op, t), spooled, "bytes", "request-log spool")]


def _not_here(reason: str) -> Callable[[AlertRule, ConsoleSeries], Evaluation]:
    return lambda _rule, _series: NotEvaluated(reason)


ENGINE_COUNTERS = (
    "needs the engine's own request counters, which the gateway does not sample: Prometheus evaluates it"
)
GPU_SERIES = "needs the engine's GPU series, which the gateway does not sample: Prometheus evaluates it"
SCRAPES = "about Prometheus' own scrapes of the processes: only Prometheus can tell"
EVALUATORS: Mapping[str, Callable[[AlertRule, ConsoleSeries], Evaluation]] = {
    "KvscopeHighErrorRate": _error_budget,
    "KvscopeHighP99Latency": _p99,
    "KvscopeHighP99TimePerOutputToken": _p99,
    "KvscopeTTFTSLOBreach": _slo,
    "KvscopeTPOTSLOBreach": _slo,
    "KvscopeEngineHighErrorRate": _not_here(ENGINE_COUNTERS),
    "KvscopeQueueBuildup": _queue_buildup,
    "KvscopeKVCachePressure": _kv_pressure,
    "KvscopePreemptionStorm": _preemption_storm,
    "KvscopeLoadShedding": _not_here(ENGINE_COUNTERS),
    "KvscopeGPUMemoryOverBudget": _not_here(GPU_SERIES),
    "KvscopeGPUAllocatorFailures": _not_here(GPU_SERIES),
    "KvscopeGPUThrottled": _not_here(GPU_SERIES),
    "KvscopeUpstreamDown": _upstream_down,
    "KvscopeNoHealthyUpstream": _no_healthy,
    "KvscopeLogShippingFailing": _log_shipping,
    "KvscopeLogSpooling": _log_spooling,
    "KvscopeTargetDown": _not_here(SCRAPES),
    "KvscopeTargetMissing": _not_here(SCRAPES),
    "Watchdog": _not_here("always fires in Prometheus: it tests the alerting pipeline, not the stack"),
}
"""Alert name → its evaluator (an alert the table does not name is shown as not evaluated)."""


@dataclass
class AlertBoard:
    """The rules and, per (rule, subject), since when its condition has held (to tell pending from firing by
    the rule's ``for``). Evaluated once per tick by the console's sampler."""

    rules: tuple[AlertRule, ...]
    statuses: list[AlertStatus] = field(default_factory=list)
    _since: dict[tuple[int, str], float] = field(default_factory=dict)

    def evaluate(self, series: ConsoleSeries) -> list[AlertStatus]:
        """Evaluate every rule against ``series`` now (its latest tick's time); keeps and returns the
        statuses, rules in file order."""
        latest = series.latest
        now = latest.at if latest else 0.0
        out: list[AlertStatus] = []
        held: set[tuple[int, str]] = set()
        for i, rule in enumerate(self.rules):
            evaluator = EVALUATORS.get(rule.alert)
            result = evaluator(rule, series) if evaluator else NotEvaluated("no in-process evaluator")
            if isinstance(result, NotEvaluated):
                out.append(AlertStatus(rule, "-", "not_evaluated", detail=result.reason))
                continue
            if not result:
                out.append(AlertStatus(rule, "-", "no_data", detail="nothing to evaluate yet"))
            for f in result:
                key = (i, f.subject)
                if not f.holds:
                    state: State = "no_data" if f.holds is None else "ok"
                    out.append(AlertStatus(rule, f.subject, state, f.value, f.unit, f.detail))
                    continue
                held.add(key)
                since = self._since.setdefault(key, now)
                holding = now - since
                state = "firing" if holding >= rule.for_s else "pending"
                out.append(AlertStatus(rule, f.subject, state, f.value, f.unit, f.detail, holding))
        self._since = {k: v for k, v in self._since.items() if k in held}
        self.statuses = out
        return out


HISTOGRAM_EVALUATORS = (_p99, _slo)


def _seconds_text(seconds: float) -> str:
    return f"{seconds * 1000:g} ms" if seconds < 1 else f"{seconds:g} s"


CONDITIONS: Mapping[str, Callable[[AlertRule], str]] = {
    "KvscopeHighErrorRate": lambda r: (
        f"errors > {r.comparisons[0][1]:.1%} of requests over {format_duration(r.windows_s[0])} and "
        f"{format_duration(r.windows_s[1])}, ≥ {r.comparisons[2][1]:g} requests"
    ),
    "KvscopeHighP99Latency": lambda r: (
        f"p{r.quantile * 100 if r.quantile else 0:g} TTFT {r.comparisons[0][0]} "
        f"{_seconds_text(r.comparisons[0][1])} over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeHighP99TimePerOutputToken": lambda r: (
        f"p{r.quantile * 100 if r.quantile else 0:g} TPOT {r.comparisons[0][0]} "
        f"{_seconds_text(r.comparisons[0][1])} over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeTTFTSLOBreach": lambda r: (
        f"< {r.comparisons[0][1]:.0%} of TTFTs ≤ {_seconds_text(r.le or 0)} "
        f"over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeTPOTSLOBreach": lambda r: (
        f"< {r.comparisons[0][1]:.0%} of TPOTs ≤ {_seconds_text(r.le or 0)} "
        f"over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeQueueBuildup": lambda r: (
        f"fewest waiting > {r.comparisons[0][1]:g} over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeKVCachePressure": lambda r: (
        f"mean KV usage > {r.comparisons[0][1]:.0%} over {format_duration(r.windows_s[0])}, and preemptions "
        "or a growing queue"
    ),
    "KvscopePreemptionStorm": lambda r: (
        f"> {r.comparisons[0][1]:g} preemptions/s over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeUpstreamDown": lambda r: "its health checks fail",
    "KvscopeNoHealthyUpstream": lambda r: "no replica passes its health checks",
    "KvscopeLogShippingFailing": lambda r: (
        f"> {r.comparisons[0][1]:g} records/s lost over {format_duration(r.windows_s[0])}"
    ),
    "KvscopeLogSpooling": lambda r: f"> {r.comparisons[0][1]:g} bytes in the spool",
}
"""Alert name → its condition in words, from the rule's numbers (the table's "holds when")."""


def condition_text(rule: AlertRule) -> str:
    """The rule's condition in words (:data:`CONDITIONS`), its bare comparisons where the shape is not the
    expected one."""
    describe = CONDITIONS.get(rule.alert)
    try:
        return describe(rule) if describe else rule.threshold_text
    except (IndexError, TypeError):
        return rule.threshold_text


def histogram_window_s(rules: Sequence[AlertRule], floor: float) -> float:
    """The longest window an evaluated histogram rule reads (10 minutes for the shipped rules), at least
    ``floor``: how long the console keeps TTFT/TPOT histograms."""
    windows = [w for r in rules if EVALUATORS.get(r.alert) in HISTOGRAM_EVALUATORS for w in r.windows_s]
    return max([floor, *windows])
