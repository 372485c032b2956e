"""The timing assertions left in the suite, each with why it holds on a machine of any speed (issue 43).

A faster CPU, a GPU or two loaded cores must not fail a test without a regression. So a test bounds a
duration by what it measured (a TTFT bound from the engine's decode step, a keep-alive count from the
measured wait) or asserts an ordering or a guarantee, not a number of seconds this CPU happens to take.

The scan below reads every check in tests/ (an ``assert``, or an ``if`` whose body calls ``pytest.fail`` or
raises AssertionError) and finds the comparisons (``<``, ``<=``, ``>``, ``>=``) and ``pytest.approx``
tolerances (``abs=`` of 1 ms or more) between a time-like expression and literal seconds. Time-like: a name
or key such as ``ttft_s``, ``elapsed``, ``decode_s``, ``latency``, a clock read (``time.monotonic()``,
``loop.time()``), or a name the function assigned a clock reading or arithmetic on one (``t0``, ``dt = t1 -
t0``). Literal seconds: a number, an UPPER_CASE constant, a name assigned only numbers (``limit = 1.0``), or
arithmetic of those (``3 * KEEPALIVE_S``). A sign check against 0 is not a timing bound and is left out.
Every comparison found must be listed in ``ALLOWED`` with the reason it is safe, and every entry of
``ALLOWED`` must still be found: the list is exactly what remains.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TIME_LIKE = re.compile(
    r"(^|_)(secs?|seconds|times?|gaps|elapsed|ttft|tpot|itl|latency|duration|wall|took|monotonic|perf_counter)"
    r"($|_)"
    r"|_m?s($|_)|elapsed|ttft|tpot|latency|throughput|monotonic|perf_counter|tok_s|tokens_per_s",
    re.IGNORECASE,
)
"""A name, attribute or string key that holds (or computes) a duration or a rate."""
CONSTANT_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
APPROX_ABS_FLOOR = 1e-3
"""``pytest.approx(abs=...)`` below this is float rounding, not a timing tolerance."""

ALLOWED: dict[str, str] = {
    "tests/engine/test_admission_engine.py: refusal.predicted_ttft_s >= 1.0": (
        "the step-time model is scripted (one second a step): the prediction is that second plus the real "
        "time since the request arrived, so one scripted second is a floor on any machine (a lower bound "
        "that only a slower machine moves further from)"
    ),
    "tests/engine/test_admission_engine.py: 0.99 <= refusal.waited_s <= refusal.predicted_ttft_s": (
        "the queue looks at a request only when its last moment comes (arrival + its 1 s objective - its "
        "own prefill, one scripted 1 ms step), and the holder it waits behind sleeps 20 ms a step for 120 "
        "steps (2.4 s at least): the wait reaches 0.999 s before the drop on a machine of any speed, and the "
        "prediction the drop reports includes the wait"
    ),
    "tests/engine/test_admission_engine.py: refusal.predicted_ttft_s > 1.0": (
        "the drop's own condition (wait + predicted remainder past the 1 s objective), not a duration this "
        "machine takes"
    ),
    "tests/gateway/engines/test_scraper.py: max(gaps) < 0.25": (
        "the parse is made to take 0.5 s (a sleep in the test); an event loop that ran it would show a gap "
        "of 0.5 s, one that hands it to a thread shows 10 ms ticks: half the injected delay separates the "
        "two on any machine"
    ),
    # bounds derived from what the test measured
    "tests/e2e/test_engine_api.py: g > step_s / 10": (
        "step_s is the engine's measured decode time per token: most gaps must be a tenth of a step, which "
        "scales with the machine (a burst from a buffering server has gaps near 0 on any machine)"
    ),
    "tests/e2e/test_gateway_engine_serving.py: g > step_s / 10": (
        "as in test_engine_api.py: a tenth of the engine's measured decode step"
    ),
    "tests/e2e/test_engine_api.py: ttft >= 3 * KEEPALIVE_S": (
        "the measured TTFT decides whether the wait spanned three keep-alive intervals, and only then is a "
        "comment required: a machine that answers sooner is held to nothing it cannot do"
    ),
    "tests/e2e/test_gateway_engine_serving.py: ttft >= 3 * GATEWAY_KEEPALIVE_S": (
        "as in test_engine_api.py: the measured TTFT decides whether a keep-alive comment was due"
    ),
    "tests/e2e/test_engine_lifecycle.py: "
    "admitted['kvscope']['queue_s'] < (900 - generated) * per_token_s / 2": (
        "per_token_s is measured in the test (the running stream's pace): the queued request must be "
        "admitted well before the running one would have finished"
    ),
    "tests/e2e/test_gateway_engine_lifecycle.py: "
    "admitted['kvscope']['queue_s'] < (900 - generated) * per_token_s / 2": (
        "as in test_engine_lifecycle.py: a bound in units of the measured per-token time"
    ),
    # lower bounds set by a delay the test schedules: no machine can be faster than the schedule
    "tests/e2e/test_gateway_engine_serving.py: t >= GATEWAY_KEEPALIVE_S * k - 0.001": (
        "the gateway sends the k-th keep-alive k intervals after the request (1 ms: timer rounding); load "
        "only delays it"
    ),
    "tests/e2e/test_gateway_engine_serving.py: "
    "GATEWAY_KEEPALIVE_S * before_token - 0.001 <= ttft < result.data_times()[-1]": (
        "below: the comments counted before the token each took an interval; above: the client's measured "
        "last event"
    ),
    "tests/gateway/test_app_stream.py: "
    "2.0 - 0.001 <= records['t2'][0]['kvscope']['e2e_s'] <= t2_logged - t2_sent": (
        "the fake upstream holds the answer 2 s (scheduled); above: what the client measured"
    ),
    "tests/gateway/test_latency_phases.py: p['retry_s'] >= REFUSE_DELAY_S": (
        "the failing replica waits REFUSE_DELAY_S before its 503 (scheduled)"
    ),
    "tests/gateway/test_latency_phases.py: p['upstream_connect_s'] >= ANSWER_DELAY_S": (
        "the answering replica waits ANSWER_DELAY_S before its headers (scheduled)"
    ),
    "tests/gateway/test_latency_phases.py: REFUSE_DELAY_S <= failed_attempt_s <= p['retry_s'] + 1e-09": (
        "scheduled delay below, the logged retry phase above (1 ns: float rounding)"
    ),
    "tests/gateway/test_latency_phases.py: "
    "p['upstream_response_s'] >= ANSWER_DELAY_S - HEADERS_SEEN_LATE_S": (
        "scheduled delay, less how late the gateway's thread may read the headers (HEADERS_SEEN_LATE_S's "
        "docstring): a margin for load, in the direction a fast machine never needs"
    ),
    "tests/gateway/test_otel_metrics.py: TOKEN_DELAY_S <= tpoc.sum <= stream_s": (
        "the fake upstream waits TOKEN_DELAY_S per chunk (scheduled); above: the stream time the test "
        "measured"
    ),
    "tests/gateway/test_processes.py: FIRST_TOKEN_DELAY_S <= k['ttft_s'] < m['token1'] - m['start']": (
        "the fake upstream holds its first token FIRST_TOKEN_DELAY_S (scheduled); above: the client's "
        "measured first token"
    ),
    # not measurements: unit conversions, float rounding, configuration
    "tests/engine/server/test_tracing.py: named['queue'].end_time <= named['prefill'].start_time + 1": (
        "span times in integer nanoseconds: an ordering, 1 ns of rounding between the two stamps"
    ),
    "tests/engine/server/test_tracing.py: named['prefill'].end_time <= named['decode'].start_time + 1": (
        "as above: an ordering of span stamps, 1 ns of rounding"
    ),
    "tests/gateway/test_semconv_spans.py: 0 < ttfc < (span.end_time - span.start_time) / 1000000000.0": (
        "an ordering: the first chunk comes within the span (1e9: nanoseconds to seconds)"
    ),
    "tests/gateway/test_latency_phases.py: ctx.upstream.total_s - phases.upstream_connect_s - "
    "phases.upstream_response_s == 0.25 <= phases.retry_s": (
        "arithmetic on times the test passes in (101.0, 101.25, ...): no clock is read"
    ),
    "tests/engine/test_metrics.py: b.ttft_s[0] < 0.01": "a default histogram bound (configuration)",
    "tests/engine/test_metrics.py: b.token_latency_s[0] < 0.01": "a default histogram bound, not a time",
    "tests/gateway/test_metrics_truth.py: settings.metrics.duration_buckets[-1] >= 1800.0": (
        "the last default bucket against the 1800 s total timeout: configuration"
    ),
    "tests/gateway/test_metrics_truth.py: settings.metrics.ttft_buckets[-1] >= 1800.0": (
        "the last default bucket against the 1800 s total timeout: configuration"
    ),
    "tests/gateway/test_app_stream.py: end_delay_s < DRAIN_BEFORE_END_S / 2": (
        "the test's own parameter against the gateway's drain constant: configuration"
    ),
    "tests/bench/test_arrival.py: ks_statistic_exponential(gaps, RATE) < KS_CRITICAL_5PCT": (
        "a statistic of inter-arrival gaps drawn by a seeded sampler (no clock is read) against its 5 % "
        "critical value"
    ),
    "tests/gateway/logs/test_es_sink.py: seconds <= SPOOLED_HANDOFF_S": (
        "the wait the sink asks for (its schedule, recorded), not a time measured"
    ),
    "tests/test_gpu_check.py: 20 + sum((s.timeout_s for s in gpu_check.STEPS)) + 3 * 5 < 480": (
        "the script's configured step timeouts against the device's 8-minute budget: configuration"
    ),
    "tests/test_gpu_check.py: 1 <= seconds < 30": (
        "a step with a 1 s timeout whose child sleeps 60 s: killed after its timeout (below), long before "
        "the sleep would end (above); a fast machine cannot fail either bound (H8's file)"
    ),
    # upper bounds a slow machine could exceed, never a fast one
    "tests/e2e/test_console_browser.py: time.monotonic() - started < 55": (
        "the requests must all fall in the console's one-minute quantile window for the chart check to mean "
        "anything: a precondition a slow machine could miss, never a fast one (H11's file)"
    ),
    "tests/e2e/test_serve.py: time.monotonic() - started < 20": (
        "SIGTERM to exit within the 20 s the line above already waits (proc.wait(20)): a liveness bound"
    ),
    "tests/testing/test_fake_upstream_kinds.py: 0.09 <= compute_time < 0.2": (
        "0.09 s is the fake's scheduled delay (load only adds); 0.2 s is a margin a loaded machine, never a "
        "fast one, could exceed (H7's file: left to its owner, see issue 43's report)"
    ),
}
"""``"<path>: <comparison as ast.unparse writes it>"`` → why it holds on any machine."""


CLOCKS = frozenset({"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"})
"""Clock reads: ``time.<name>()``, ``loop.time()`` and the bare ``monotonic()`` / ``perf_counter()`` of
``from time import ...``."""


class Scope(NamedTuple):
    """What the names of one function (and its module) hold: ``clocks`` were assigned a clock reading or
    arithmetic on one (``t0 = time.monotonic()``, ``dt = t1 - t0``), ``numbers`` only number literals
    (``limit = 1.0``: a literal by another name)."""

    clocks: frozenset[str] = frozenset()
    numbers: frozenset[str] = frozenset()


NO_NAMES = Scope()


def _words(node: ast.AST) -> list[str]:
    """The names, attributes and string keys in ``node``, those under a ``len(...)`` (a count) left out."""
    out = []
    for sub in _walk_outside_len(node):
        if isinstance(sub, ast.Name):
            out.append(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.append(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.append(sub.value)
    return out


def _walk_outside_len(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
        return []
    return [node, *(sub for child in ast.iter_child_nodes(node) for sub in _walk_outside_len(child))]


def _is_seconds_literal(node: ast.AST, scope: Scope = NO_NAMES) -> bool:
    """A number, or arithmetic of numbers, UPPER_CASE constants and names that hold only numbers (at least
    one of them)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.Name):
        return bool(CONSTANT_NAME.match(node.id)) or node.id in scope.numbers
    if isinstance(node, ast.UnaryOp):
        return _is_seconds_literal(node.operand, scope)
    if isinstance(node, ast.BinOp):
        return _is_seconds_literal(node.left, scope) and _is_seconds_literal(node.right, scope)
    return False


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _reads_clock(node: ast.AST, clocks: frozenset[str] = frozenset()) -> bool:
    """Whether ``node``'s value is a clock reading: a call of a clock (:data:`CLOCKS`), a name that holds one,
    or arithmetic, ``abs``/``min``/``max``/``sum``/``round``/``float`` or a comprehension over those (a
    comparison is a truth value, not a time: ``sum(t <= first for t in times)`` counts)."""
    if isinstance(node, ast.Name):
        return node.id in clocks
    if isinstance(node, ast.BinOp):
        return _reads_clock(node.left, clocks) or _reads_clock(node.right, clocks)
    if isinstance(node, ast.UnaryOp):
        return _reads_clock(node.operand, clocks)
    if isinstance(node, ast.GeneratorExp | ast.ListComp):
        return _reads_clock(node.elt, clocks)
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name) and func.id in ("abs", "min", "max", "sum", "round", "float"):
        return any(_reads_clock(arg, clocks) for arg in node.args)
    if isinstance(func, ast.Name):
        return func.id in CLOCKS - {"time"}
    return (
        isinstance(func, ast.Attribute)
        and func.attr in CLOCKS
        and isinstance(func.value, ast.Name)
        and (func.value.id == "time" or (func.attr == "time" and func.value.id == "loop"))
    )


def _time_like(node: ast.AST, aliases: dict[str, ast.AST] | None = None, scope: Scope = NO_NAMES) -> bool:
    """Whether ``node`` names a duration or reads a clock; ``aliases``: comprehension variables → what they
    iterate over (``g`` of ``for g in gaps`` is a gap)."""
    words = _words(node)
    bound = [aliases[word] for word in words if aliases and word in aliases]
    return (
        any(TIME_LIKE.search(word) for word in words)
        or _reads_clock(node, scope.clocks)
        or any(_time_like(b, scope=scope) for b in bound)
    )


def _comprehension_aliases(node: ast.AST) -> dict[str, ast.AST]:
    """The names bound by the comprehensions in ``node``, each with the iterable it runs over."""
    return {
        target.id: generator.iter
        for sub in ast.walk(node)
        if isinstance(sub, ast.comprehension)
        for generator in [sub]
        for target in ast.walk(sub.target)
        if isinstance(target, ast.Name)
    }


def _literal_parts(node: ast.AST) -> list[ast.AST]:
    """``node`` and, for ``a - b`` / ``a + b`` / ``k * a``, the terms that are literal seconds."""
    if isinstance(node, ast.BinOp):
        return [node, *_literal_parts(node.left), *_literal_parts(node.right)]
    return [node]


def _own_nodes(node: ast.AST) -> list[ast.AST]:
    """``node``'s body without the functions and classes defined inside it (their own scopes)."""
    out = []
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            out += [child, *_own_nodes(child)]
    return out


def _scope(node: ast.AST, outer: Scope) -> Scope:
    """``outer`` with what the assignments of ``node``'s own body bind (:class:`Scope`)."""
    values: dict[str, list[ast.AST | None]] = {}
    for sub in _own_nodes(node):
        if isinstance(sub, ast.Assign):
            pairs = [(t, sub.value) for t in sub.targets]
        elif isinstance(sub, ast.AnnAssign | ast.AugAssign | ast.NamedExpr):
            pairs = [(sub.target, sub.value)]
        elif isinstance(sub, ast.For | ast.AsyncFor | ast.With | ast.AsyncWith):
            targets = (
                [sub.target]
                if isinstance(sub, ast.For | ast.AsyncFor)
                else [w.optional_vars for w in sub.items]
            )
            pairs = [(t, None) for t in targets if t is not None]
        else:
            continue
        for target, value in pairs:
            names = [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
            single = isinstance(target, ast.Name)
            for name in names:
                values.setdefault(name, []).append(value if single else None)
    numbers = {n for n, vs in values.items() if all(v is not None and _is_seconds_literal(v) for v in vs)}
    clocks = set(outer.clocks) - values.keys()
    while True:  # t0 = time.monotonic(); dt = t1 - t0: follow the readings to a fixed point
        more = {
            n
            for n, vs in values.items()
            if n not in clocks and any(v is not None and _reads_clock(v, frozenset(clocks)) for v in vs)
        }
        if not more:
            break
        clocks |= more
    return Scope(frozenset(clocks), frozenset((outer.numbers - values.keys()) | numbers))


def _fails(statement: ast.stmt) -> bool:
    """``raise AssertionError(...)`` or ``pytest.fail(...)``."""
    if isinstance(statement, ast.Raise) and statement.exc is not None:
        exc = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
        return isinstance(exc, ast.Name) and exc.id == "AssertionError"
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        func = statement.value.func
        return (isinstance(func, ast.Attribute) and func.attr == "fail") or (
            isinstance(func, ast.Name) and func.id == "fail"
        )
    return False


def _checks(node: ast.AST, scope: Scope) -> list[tuple[ast.AST, Scope]]:
    """The conditions a test asserts in ``node`` (``assert c``, ``if c: pytest.fail(...)`` or ``raise
    AssertionError``), each with the scope of the function it is in."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found += _checks(child, _scope(child, scope))
            continue
        if isinstance(child, ast.Assert):
            found.append((child.test, scope))
        elif isinstance(child, ast.If) and any(_fails(s) for s in child.body):
            found.append((child.test, scope))
        found += _checks(child, scope)
    return found


def timing_comparisons(path: Path, root: Path = ROOT) -> list[str]:
    """``"<path relative to root>: <comparison>"`` for each timing comparison or approx tolerance in
    ``path``'s checks (asserts, and ``if`` blocks that fail the test)."""
    rel = path.relative_to(root).as_posix()
    module = ast.parse(path.read_text())
    found = []
    for test, scope in _checks(module, _scope(module, NO_NAMES)):
        aliases = _comprehension_aliases(test)
        for node in ast.walk(test):
            if isinstance(node, ast.Compare) and any(
                isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in node.ops
            ):
                operands = [node.left, *node.comparators]
                literals = [o for o in operands if _is_seconds_literal(o, scope) and not _is_zero(o)]
                measured = [
                    o for o in operands if not _is_seconds_literal(o, scope) and _time_like(o, aliases, scope)
                ]
                # a bound may hide in arithmetic: `x - 1e-3 <= t` compares t with a constant offset
                offsets = [
                    part
                    for o in measured
                    for part in _literal_parts(o)
                    if isinstance(part, ast.BinOp)
                    and _is_seconds_literal(part.right, scope)
                    and _time_like(part, scope=scope)
                ]
                if (
                    measured
                    and (literals or offsets)
                    or (literals and any(_time_like(o, scope=scope) for o in literals))
                ):
                    found.append(f"{rel}: {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "approx"
            ):
                for keyword in node.keywords:
                    if (
                        keyword.arg == "abs"
                        and isinstance(keyword.value, ast.Constant)
                        and isinstance(keyword.value.value, int | float)
                        and keyword.value.value >= APPROX_ABS_FLOOR
                        and _time_like(node, scope=scope)
                    ):
                        found.append(f"{rel}: {ast.unparse(node)}")
    return found


def all_timing_comparisons() -> list[str]:
    """Every timing comparison in tests/ (this file's own examples aside), in file order."""
    return [
        hit
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve()
        for hit in timing_comparisons(path)
    ]


def test_every_remaining_timing_assertion_is_listed_with_why_it_is_safe() -> None:
    found = all_timing_comparisons()
    assert sorted(set(found) - set(ALLOWED)) == [], "a new timing bound: derive it from a measurement"
    assert sorted(set(ALLOWED) - set(found)) == [], "an allowed bound is gone: drop it from ALLOWED"


def test_the_scan_finds_a_bound_tied_to_this_cpus_speed(tmp_path: Path) -> None:
    """The scan's own check: the assertions issue 43 named are found, sign checks and counts are not."""
    sample = tmp_path / "tests" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "def test_x(line, times, tokens, k, result):\n"
        '    assert line["kvscope"]["ttft_s"] > 1.0\n'
        "    assert times[-1] - times[0] > 1.0\n"
        "    assert elapsed_s < 2 * TIMEOUT_S\n"
        "    assert k.tpot_s == pytest.approx(k.e2e_s / 3, abs=0.02)\n"
        "    assert 0 < line['ttft_s'] < result.second\n"
        "    assert sum(g > 0.005 for g in gaps) > len(gaps) // 2\n"
        "    assert tokens > 40\n"
        "    assert k.tpot_s == pytest.approx(k.decode_s / 3, abs=1e-9)\n"
    )
    hits = [hit.split(": ", 1)[1] for hit in timing_comparisons(sample, tmp_path)]
    assert hits == [
        "line['kvscope']['ttft_s'] > 1.0",
        "times[-1] - times[0] > 1.0",
        "elapsed_s < 2 * TIMEOUT_S",
        "pytest.approx(k.e2e_s / 3, abs=0.02)",
        "g > 0.005",
    ]


def test_the_scan_follows_clock_readings_and_numbers_by_name(tmp_path: Path) -> None:
    """Durations held by names that say nothing (``t1 - t0``, ``dt``), a bound by a lower-case name, and a
    check written as ``if ...: pytest.fail(...)`` are found; a count of events before a clock reading, a
    deadline loop's clock against clock and a name reassigned to something else are not."""
    sample = tmp_path / "tests" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import time\n"
        "from time import perf_counter\n"
        "LIMIT = 2\n"
        "def helper():\n"
        "    t0 = 5\n"
        "    assert t0 < 9\n"
        "def test_x(client, loop, finish_times, before):\n"
        "    t0 = time.monotonic()\n"
        "    client.get('/')\n"
        "    t1 = time.monotonic()\n"
        "    assert t1 - t0 < 1.0\n"
        "    dt = perf_counter() - t0\n"
        "    assert abs(dt) < 0.5\n"
        "    limit = 0.25\n"
        "    assert loop.time() - t1 <= limit\n"
        "    if max(t - t0 for t in finish_times) > LIMIT:\n"
        "        pytest.fail('slow')\n"
        "    first = t0 + 0.5\n"
        "    finished = sum(t <= first for t in finish_times)\n"
        "    assert finished - before <= 4\n"
        "    deadline = time.monotonic() + 10\n"
        "    if time.monotonic() > deadline:\n"
        "        raise AssertionError('not in time')\n"
        "    n = 3\n"
        "    n = len(finish_times)\n"
        "    assert time.monotonic() - t0 > n\n"
    )
    hits = [hit.split(": ", 1)[1] for hit in timing_comparisons(sample, tmp_path)]
    assert hits == [
        "t1 - t0 < 1.0",
        "abs(dt) < 0.5",
        "loop.time() - t1 <= limit",
        "max((t - t0 for t in finish_times)) > LIMIT",
    ]
