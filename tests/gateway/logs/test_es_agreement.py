"""The two back ends of ``kvscope logs`` (report, search, why, the plot's data) and of ``kvscope plan
--from-log`` give the same answers on the same records: the JSONL file read by DuckDB, and the same records
shipped to Elasticsearch by the gateway's own shipper. Property tests (hypothesis) generate the records and
the questions. Elasticsearch is the double by default (it evaluates the queries with the documented semantics:
kvscope/testing/es_double_search.py); with ``ELASTICSEARCH_URL`` set, the ``_live`` variants ask a real
cluster the same questions (docs/logs.md, "Testing against a real cluster").

Where the answers may differ by rounding only, the tolerance is derived here:

- percentiles: both back ends compute linear interpolation between closest ranks (DuckDB ``quantile_cont``;
  Elasticsearch ≥ 8.9 sorts every value below 2,000 per aggregation: kvscope/testing/es_double_aggs.py),
  but DuckDB reads the percent as an exact decimal while Elasticsearch multiplies the double q = p / 100 by
  n − 1, and they round the interpolation differently: the rank differs by at most n ulp and each result by
  2 ulp, so |a − b| ≤ (n + 4) · 2⁻⁵² · max|x| < 4.5e-13 · max|x| for n < 2,000: :data:`REL` = 1e-12 of the
  field's largest magnitude. Generated sets stay under 2,000 values.
- the mean batch size: Elasticsearch sums with Kahan compensation, DuckDB in its own order; both sums are
  within (n − 1) · 2⁻⁵³ · Σ|x| of the exact one, < 1e-13 relative for the n ≤ 120 positive values here.
Every other number (counts, errors, token sums, the records listed and their order, the spans) must be
equal.

What the generator leaves out, because the back ends are documented to differ there: values that do not
fit the mapping (Elasticsearch keeps the record and ignores the field, ``ignore_malformed``; DuckDB skips
the line), keywords over 1,024 characters (``ignore_above``: not indexed), timestamps finer than a
millisecond (the ``date`` type keeps milliseconds) and text-field conditions (the two query languages
differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import string
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvscope.cli.plan_log import read_spans
from kvscope.gateway.analytics import commands
from kvscope.gateway.analytics.commands import LogSource, open_logs
from kvscope.gateway.analytics.report import LATENCY_FIELDS, PERCENTS, Report, parse_since, prune
from kvscope.gateway.logs.es_client import EsConnectionConfig, make_client
from kvscope.gateway.logs.es_setup import EsIndexConfig
from kvscope.plan.replay_es import read_spans_es
from kvscope.testing.es_double import EsDouble
from kvscope.testing.es_load import load_records, remove_setup
from kvscope.testing.records import KEYS, MODELS, T0, UPSTREAMS, engine_stats, iso, make_record

REL = 1e-12
URL = os.environ.get("ELASTICSEARCH_URL")
live = pytest.mark.skipif(not URL, reason="set ELASTICSEARCH_URL to run against a real Elasticsearch")
DOUBLE = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
LIVE = settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
STATUSES = (200, 200, 200, 400, 404, 429, 500, 503)
REASONS = ("stop", "length", "tool_calls")

# ---- records -----------------------------------------------------------------------------------------------
seconds = st.one_of(
    st.sampled_from([0.001, 0.05, 0.5, 1.0, 2.5]),  # ties
    st.floats(min_value=0.0, max_value=120.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def records(draw: st.DrawFn, max_size: int = 60) -> list[dict[str, Any]]:
    """Request-log records (kvscope.testing.records) with what makes the back ends' answers interesting: ties
    in latencies and request ids, missing fields, several or repeated finish reasons, error outcomes on a
    200, engine statistics or none, records without the gateway's ``event.id`` (an engine's line)."""
    n = draw(st.integers(min_value=0, max_value=max_size))
    times = st.integers(0, 600_000) | st.sampled_from([1_000, 1_001, 5_000])  # records in the same ms too
    offsets = draw(st.lists(times, min_size=n, max_size=n))
    out = []
    for i, offset in enumerate(offsets):
        engine = draw(
            st.none()
            | st.builds(
                engine_stats,
                seconds,
                seconds,
                seconds,
                batch_mean=st.floats(1.0, 64.0),
                batch_max=st.integers(1, 64),
                kv_usage=st.floats(0.0, 1.0),
                preemptions=st.integers(0, 3),
            )
        )
        status = draw(st.sampled_from(STATUSES))
        record = make_record(
            i,
            ts=T0 + timedelta(milliseconds=offset),
            model=draw(st.sampled_from(MODELS)),
            status=status,
            ttft_s=draw(st.none() | seconds),
            tpot_s=draw(st.none() | seconds),
            e2e_s=draw(seconds),
            user=draw(st.sampled_from(KEYS)),
            upstream=draw(st.sampled_from(UPSTREAMS)),
            finish=None,
            input_tokens=draw(st.integers(0, 100_000)),
            output_tokens=draw(st.integers(0, 10_000)),
            engine=engine,
        )
        for kind in ("input_tokens", "output_tokens"):
            if draw(st.integers(0, 7)) == 0:  # not a generation (a refused request, /v1/models)
                record["gen_ai"]["usage"][kind] = None
        record["gen_ai"]["response"]["finish_reasons"] = draw(st.lists(st.sampled_from(REASONS), max_size=3))
        if draw(st.integers(0, 9)) == 0:
            record["gen_ai"]["request"]["model"] = None
        if draw(st.integers(0, 9)) == 0:
            record["http"]["response"]["status_code"] = None
        if status == 200 and draw(st.integers(0, 9)) == 0:
            record["event"]["outcome"] = "failure"  # a stream that broke after its 200
        if draw(st.integers(0, 4)) == 0:
            # reused by a client, or a prefix of every other request id ("req" names one request exactly
            # and starts all the others: `why req` must list the exact one first however many others match)
            record["http"]["request"]["id"] = draw(
                st.sampled_from(["reused-id", "req-000001", "req", "req-0000"])
            )
        if draw(st.integers(0, 3)) == 0:
            record["gen_ai"]["response"]["id"] = f"chatcmpl-{i % 7:02x}{i:06x}"
        if draw(st.integers(0, 9)) == 0:
            del record["event"]["id"]  # the engine's line of a request: no gateway event id
        out.append(record)
    return out


def since_of(draw: st.DrawFn) -> str | None:
    return draw(st.none() | st.integers(0, 600_000).map(lambda ms: iso(T0 + timedelta(milliseconds=ms))))


# ---- the two sources ---------------------------------------------------------------------------------------
@dataclass
class Sources:
    files: LogSource
    es: LogSource
    connection: EsConnectionConfig
    index: str
    path: Path


@contextlib.asynccontextmanager
async def both(recs: list[dict[str, Any]], target: str) -> AsyncIterator[Sources]:
    """The records in a JSONL file and in Elasticsearch (the double, or the live cluster under a data stream
    of its own that is removed afterwards)."""
    index = EsIndexConfig(data_stream=f"kvscope-agree-{uuid.uuid4().hex[:10]}", dynamic="strict")
    with tempfile.TemporaryDirectory(prefix="kvscope-agree-") as tmp:
        path = Path(tmp) / "requests.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        async with contextlib.AsyncExitStack() as stack:
            if target == "double":
                es = await stack.enter_async_context(EsDouble(major=9))
                connection = EsConnectionConfig(hosts=(es.url,))
            else:
                assert URL is not None
                connection = EsConnectionConfig(
                    hosts=(URL,),
                    api_key=os.environ.get("ELASTICSEARCH_API_KEY"),
                    ca_certs=os.environ.get("ELASTICSEARCH_CA_CERTS"),
                    compat_major=int(os.environ.get("ELASTICSEARCH_COMPAT", "8")),
                )
            client = make_client(connection)
            try:
                await load_records(client, index, recs)
                yield Sources(
                    LogSource(str(path)),
                    LogSource(connection.hosts[0], index=index.data_stream, connection=connection),
                    connection,
                    index.data_stream,
                    path,
                )
            finally:
                if target != "double":
                    await remove_setup(client, index)
                await client.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _call(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


# ---- comparisons -------------------------------------------------------------------------------------------
def scale(recs: list[dict[str, Any]], path: str) -> float:
    """The largest magnitude of ``path`` over the records (the percentile tolerance's unit)."""
    values = []
    for r in recs:
        node: Any = r
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, (int, float)):
            values.append(abs(node))
    return max(values, default=0.0)


def same_number(a: Any, b: Any, tolerance: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= tolerance


def assert_reports_agree(duck: Report, es: Report, recs: list[dict[str, Any]]) -> None:
    rows = [("all", duck.total, es.total)]
    assert [g.group for g in duck.groups] == [g.group for g in es.groups]
    rows += [(str(d.group), d, e) for d, e in zip(duck.groups, es.groups, strict=True)]
    for name, d, e in rows:
        fd, fe = d.flat(), e.flat()
        approximate = {f"{m}_p{p}_s" for m in LATENCY_FIELDS for p in PERCENTS} | {
            "kv_usage_p95",
            "batch_size_mean",
        }
        assert {k: v for k, v in fd.items() if k not in approximate} == {
            k: v for k, v in fe.items() if k not in approximate
        }, name
        for metric, path in LATENCY_FIELDS.items():
            for p in PERCENTS:
                key = f"{metric}_p{p}_s"
                assert same_number(fd[key], fe[key], REL * scale(recs, path)), (name, key, fd[key], fe[key])
        assert same_number(
            fd["kv_usage_p95"], fe["kv_usage_p95"], REL * scale(recs, "kvscope.engine.kv_cache_usage")
        ), name
        assert same_number(
            fd["batch_size_mean"], fe["batch_size_mean"], REL * scale(recs, "kvscope.engine.batch_size_mean")
        ), name
    assert [s.flat() for s in duck.slowest] == [s.flat() for s in es.slowest]
    assert duck.cause_breakdown() == es.cause_breakdown()


def keys_of(found: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (
            r.get("@timestamp"),
            (r.get("event") or {}).get("id"),
            ((r.get("http") or {}).get("request") or {}).get("id"),
        )
        for r in found
    ]


# ---- report ------------------------------------------------------------------------------------------------
@st.composite
def report_cases(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    params = {
        "by": draw(st.sampled_from([None, "model", "key", "upstream", "status", "finish_reason"])),
        "top": draw(st.integers(1, 15)),
        "since": since_of(draw),
    }
    return draw(records()), params


async def check_report(case: tuple[list[dict[str, Any]], dict[str, Any]], target: str) -> None:
    recs, params = case
    async with both(recs, target) as src:
        duck = await commands.report(src.files, **params)
        es = await commands.report(src.es, **params)
    assert_reports_agree(duck, es, recs)


@given(case=report_cases())
@DOUBLE
def test_report_agrees(case):
    run(check_report(case, "double"))


@live
@given(case=report_cases())
@LIVE
def test_report_agrees_live(case):
    run(check_report(case, "live"))


# ---- search ------------------------------------------------------------------------------------------------
KEYWORD_ATOMS = {
    "gen_ai.request.model": [*MODELS, "none-such"],
    "user.id": list(KEYS),
    "server.address": list(UPSTREAMS),
    "event.outcome": ["success", "failure"],
    "http.request.id": ["reused-id", "req-000001", "req-000003", "req"],
}
NUMERIC_ATOMS = {
    "kvscope.e2e_s": st.sampled_from([0.05, 0.5, 1.0, 2.5]) | st.floats(0.0, 120.0),
    "kvscope.ttft_s": st.sampled_from([0.05, 0.5]) | st.floats(0.0, 120.0),
    "http.response.status_code": st.sampled_from([200, 400, 404, 429, 500]),
    "gen_ai.usage.input_tokens": st.integers(0, 100_000),
}


def sql_col(path: str) -> str:
    return ".".join(f'"{p}"' for p in path.split("."))


@st.composite
def condition(draw: st.DrawFn, depth: int = 0) -> tuple[str, str]:
    """(a Lucene query string, the DuckDB SQL condition that means the same). SQL's NULL is made false
    in every atom, as a query string treats a missing field: ``NOT a`` matches the records without ``a``."""
    kind = draw(
        st.sampled_from(
            ["kw", "num", "range", "exists", "prefix"] + (["and", "or", "not"] if depth < 2 else [])
        )
    )
    if kind in ("and", "or"):
        parts = draw(st.lists(condition(depth + 1), min_size=2, max_size=3))
        op = " AND " if kind == "and" else " OR "
        return "(" + op.join(p[0] for p in parts) + ")", "(" + op.join(p[1] for p in parts) + ")"
    if kind == "not":
        lucene, sql = draw(condition(depth + 1))
        return f"(NOT {lucene})", f"(NOT {sql})"
    if kind == "kw":
        field = draw(st.sampled_from(sorted(KEYWORD_ATOMS)))
        value = draw(st.sampled_from(KEYWORD_ATOMS[field]))
        return f'{field}:"{value}"', f"coalesce({sql_col(field)} = '{value}', false)"
    if kind == "prefix":
        field = draw(st.sampled_from(sorted(KEYWORD_ATOMS)))
        value = draw(st.sampled_from(KEYWORD_ATOMS[field]))
        prefix = value[: draw(st.integers(1, len(value)))]
        escaped = "".join("\\" + c if c in "-+/:" else c for c in prefix)
        return f"{field}:{escaped}*", f"coalesce(starts_with({sql_col(field)}, '{prefix}'), false)"
    if kind == "exists":
        field = draw(st.sampled_from(sorted(NUMERIC_ATOMS) + ["gen_ai.request.model", "gen_ai.response.id"]))
        return f"_exists_:{field}", f"({sql_col(field)} IS NOT NULL)"
    field = draw(st.sampled_from(sorted(NUMERIC_ATOMS)))
    value = draw(NUMERIC_ATOMS[field])
    if kind == "num":
        op = draw(st.sampled_from([">", ">=", "<", "<=", ""]))
        sql_op = op or "="
        return f"{field}:{op}{value!r}", f"coalesce({sql_col(field)} {sql_op} {value!r}, false)"
    high = draw(NUMERIC_ATOMS[field])
    lo_in, hi_in = draw(st.booleans()), draw(st.booleans())
    lucene = f"{field}:{'[' if lo_in else '{'}{value!r} TO {high!r}{']' if hi_in else '}'}"
    col = sql_col(field)
    low, up = (">=" if lo_in else ">"), ("<=" if hi_in else "<")
    sql = f"coalesce({col} {low} {value!r} AND {col} {up} {high!r}, false)"
    return lucene, sql


@st.composite
def search_cases(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lucene, sql = draw(condition())
    params = {"lucene": lucene, "sql": sql, "limit": draw(st.integers(1, 30)), "since": since_of(draw)}
    return draw(records()), params


async def check_search(case: tuple[list[dict[str, Any]], dict[str, Any]], target: str) -> None:
    recs, p = case
    async with both(recs, target) as src:
        duck = await commands.search(src.files, p["sql"], since=p["since"], limit=p["limit"])
        es = await commands.search(src.es, p["lucene"], since=p["since"], limit=p["limit"])
    assert keys_of(duck) == keys_of(es), (p["lucene"], p["sql"])
    assert duck == es  # pruned, the same records read the same (kvscope.gateway.analytics.report.prune)


@given(case=search_cases())
@DOUBLE
def test_search_agrees(case):
    run(check_search(case, "double"))


@live
@given(case=search_cases())
@LIVE
def test_search_agrees_live(case):
    run(check_search(case, "live"))


# ---- why ---------------------------------------------------------------------------------------------------
@st.composite
def why_cases(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    recs = draw(records(max_size=70))  # above ID_MATCHES (50) matches of one prefix
    ids = sorted(
        {
            v
            for r in recs
            for v in (
                (r.get("event") or {}).get("id"),
                r["http"]["request"]["id"],
                r["trace"]["id"],
                r["gen_ai"]["response"].get("id"),
            )
            if v
        }
    )
    if ids and draw(st.booleans()):
        wanted = draw(st.sampled_from(ids))
        wanted = wanted[: draw(st.integers(1, len(wanted)))]
    else:
        wanted = draw(st.text(string.ascii_lowercase + string.digits + "-", min_size=1, max_size=8))
    return recs, {"wanted": wanted, "since": since_of(draw)}


async def outcome(source: LogSource, wanted: str, since: str | None) -> Any:
    try:
        return prune((await commands.why(source, wanted, since=since)).to_dict())
    except (LookupError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def check_why(case: tuple[list[dict[str, Any]], dict[str, Any]], target: str) -> None:
    recs, p = case
    async with both(recs, target) as src:
        duck = await outcome(src.files, p["wanted"], p["since"])
        es = await outcome(src.es, p["wanted"], p["since"])
    assert duck == es


def prefix_flood() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The oldest of 60 requests has the x-request-id ``req``, which starts all 59 newer ones' too: more
    prefix matches than ``why`` reads (ID_MATCHES = 50); the exact one must come first all the same."""
    recs = [make_record(i) for i in range(60)]
    recs[0]["http"]["request"]["id"] = "req"
    return recs, {"wanted": "req", "since": None}


@given(case=why_cases())
@example(case=prefix_flood())
@DOUBLE
def test_why_agrees(case):
    run(check_why(case, "double"))


@live
@given(case=why_cases())
@LIVE
def test_why_agrees_live(case):
    run(check_why(case, "live"))


# ---- plot data ---------------------------------------------------------------------------------------------
@st.composite
def plot_cases(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    params = {"bucket_s": draw(st.sampled_from([1, 7, 60, 3600])), "since": since_of(draw)}
    return draw(records()), params


async def plot_data(source: LogSource, since: str | None, bucket_s: int) -> tuple[Any, Any, Any]:
    async with open_logs(source, parse_since(since)) as logs:
        return (
            await _call(logs.time_range()),
            await _call(logs.timeseries(bucket_s)),
            await _call(logs.ttft_histogram()),
        )


async def check_plot(case: tuple[list[dict[str, Any]], dict[str, Any]], target: str) -> None:
    recs, p = case
    async with both(recs, target) as src:
        duck = await plot_data(src.files, p["since"], p["bucket_s"])
        es = await plot_data(src.es, p["since"], p["bucket_s"])
    assert duck[0] == es[0]
    tolerance = {m: REL * scale(recs, LATENCY_FIELDS[m]) for m in ("ttft", "e2e")}
    assert [(b["t"], b["requests"]) for b in duck[1]] == [(b["t"], b["requests"]) for b in es[1]]
    for d, e in zip(duck[1], es[1], strict=True):
        for m in ("ttft", "e2e"):
            assert all(same_number(x, y, tolerance[m]) for x, y in zip(d[m] or [None] * 3, e[m], strict=True))
    (d_edges, d_counts), (e_edges, e_counts) = duck[2], es[2]
    assert len(d_edges) == len(e_edges) and sum(d_counts) == sum(e_counts)
    assert all(same_number(x, y, tolerance["ttft"]) for x, y in zip(d_edges, e_edges, strict=True))


@given(case=plot_cases())
@DOUBLE
def test_plot_data_agrees(case):
    run(check_plot(case, "double"))


# ---- plan --from-log ---------------------------------------------------------------------------------------
@st.composite
def plan_cases(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return draw(records()), {"page_size": draw(st.integers(1, 25))}


async def check_plan(case: tuple[list[dict[str, Any]], dict[str, Any]], target: str) -> None:
    recs, p = case
    async with both(recs, target) as src:
        client = make_client(src.connection)
        try:
            es = await read_spans_es(client, src.index, page_size=p["page_size"])
        finally:
            await client.close()
        duck = read_spans(src.path)
    assert duck == es


@given(case=plan_cases())
@DOUBLE
def test_plan_spans_agree(case):
    run(check_plan(case, "double"))


@live
@given(case=plan_cases())
@LIVE
def test_plan_spans_agree_live(case):
    run(check_plan(case, "live"))
