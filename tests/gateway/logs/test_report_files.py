"""``kvscope logs report|search|plot`` over JSONL files (DuckDB), checked against values computed here."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
import random
import statistics
import struct
from datetime import timedelta

import pytest

from kvscope.gateway.analytics import commands as analytics
from kvscope.gateway.analytics.cli import logs_main
from kvscope.gateway.analytics.commands import LogSource
from kvscope.gateway.analytics.plot import auto_bucket_s, parse_bucket
from kvscope.gateway.analytics.report import parse_since
from kvscope.testing.records import KEYS, MODELS, T0, UPSTREAMS, engine_stats, make_record

N_OLD, N_NEW = 150, 250


def type7(values: list[float], p: float) -> float:
    """Percentile by linear interpolation between closest ranks (Hyndman & Fan type 7)."""
    xs = sorted(values)
    h = (len(xs) - 1) * p
    lo = math.floor(h)
    return xs[lo] if lo + 1 >= len(xs) else xs[lo] + (h - lo) * (xs[lo + 1] - xs[lo])


def known_records() -> list[dict]:
    rng = random.Random(1234)
    records = []
    for i in range(N_OLD + N_NEW):
        status = rng.choice([200] * 17 + [429, 500, 503])
        ok = status < 400
        e2e = round(rng.lognormvariate(0, 0.8), 6)
        engine = (
            engine_stats(
                rng.random() / 10,
                rng.random() / 5,
                e2e / 2,
                batch_mean=rng.uniform(1, 16),
                kv_usage=rng.random(),
                preemptions=rng.choice([0, 0, 0, 1, 2]),
            )
            if ok and i % 3
            else None
        )
        finish = rng.choice(["stop", "length", None]) if ok else None
        record = make_record(
            i,
            ts=T0 + timedelta(seconds=i),
            model=MODELS[i % 2] if i % 5 else "llama-3-8b",
            status=status,
            ttft_s=round(rng.uniform(0.01, 2.0), 6) if ok else None,
            tpot_s=round(rng.uniform(0.005, 0.1), 6) if ok else None,
            e2e_s=e2e,
            user=KEYS[i % 3],
            upstream=UPSTREAMS[i % 2],
            finish=finish,
            input_tokens=rng.randint(1, 500),
            output_tokens=rng.randint(0, 300) if ok else 0,
            engine=engine,
        )
        if i % 50 == 7 and ok:
            record["gen_ai"]["response"]["finish_reasons"] = ["stop", "length"]  # n=2 choices
        if i % 50 == 11 and ok:  # a stream that broke after its 200: an error too
            record["event"]["outcome"], record["kvscope"]["stream_error"] = "failure", "upstream_error"
        records.append(record)
    return records


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    """requests.jsonl.1 (older) + requests.jsonl (current, ends with a torn line) + files to ignore."""
    folder = tmp_path_factory.mktemp("logs")
    recs = known_records()
    lines = [json.dumps(r) for r in recs]
    (folder / "requests.jsonl.1").write_text("\n".join(lines[:N_OLD] + ["not json at all"]) + "\n")
    (folder / "requests.jsonl").write_text("\n".join(lines[N_OLD:]) + '\n{"@timestamp": "2025-01-01T13:0')
    (folder / "requests.jsonl.lock").write_text(lines[0] + "\n")
    (folder / "other.jsonl").write_text(lines[1] + "\n")
    return folder


def col(records: list[dict], path: str) -> list:
    out = []
    for r in records:
        node = r
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out.append(node)
    return out


def expected_row(records: list[dict]) -> dict:
    row = {
        "requests": len(records),
        "errors": sum(
            s >= 400 or o == "failure"
            for s, o in zip(
                col(records, "http.response.status_code"), col(records, "event.outcome"), strict=True
            )
        ),
    }
    row["error_rate"] = row["errors"] / row["requests"]
    for name, path in (("ttft", "kvscope.ttft_s"), ("tpot", "kvscope.tpot_s"), ("e2e", "kvscope.e2e_s")):
        values = [v for v in col(records, path) if v is not None]
        for p in (50, 95, 99):
            row[f"{name}_p{p}_s"] = type7(values, p / 100) if values else None
    row["tokens_in"] = sum(col(records, "gen_ai.usage.input_tokens"))
    row["tokens_out"] = sum(col(records, "gen_ai.usage.output_tokens"))
    batch = [v for v in col(records, "kvscope.engine.batch_size_mean") if v is not None]
    row["batch_size_mean"] = sum(batch) / len(batch) if batch else None
    kv = [v for v in col(records, "kvscope.engine.kv_cache_usage") if v is not None]
    row["kv_usage_p95"] = type7(kv, 0.95) if kv else None
    row["preemptions"] = sum(v or 0 for v in col(records, "kvscope.engine.num_preemptions"))
    return row


def assert_row(actual: dict, expected: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, float):
            assert actual[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        else:
            assert actual[key] == value, key


def report(log_dir, **kwargs):
    return asyncio.run(analytics.report(LogSource(str(log_dir / "requests.jsonl")), **kwargs))


def test_a_request_that_waited_for_its_grammar_has_compile_as_its_slowest_phase(tmp_path):
    """``structured_compile_s`` (the wait for a structured-output grammar before the engine's queue) is a
    phase of the slowest-requests table: a request that spent most of its time there says ``compile``
    (break-it found it listed as ``decode`` while its cause column said grammar compile); a record without
    the field (older, or unconstrained) is unchanged."""
    compiled = make_record(
        1, e2e_s=7.0, engine={**engine_stats(0.01, 0.05, 0.2), "structured_compile_s": 6.5}
    )
    plain = make_record(2, e2e_s=1.0, engine=engine_stats(0.01, 0.05, 0.5))
    # dropped at its deadline while its grammar compiled: the wait is the only engine figure it has
    only = make_record(3, e2e_s=0.3, status=504, engine={"structured_compile_s": 0.3})
    lines = [json.dumps(r) for r in (compiled, plain, only)]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    slowest = asyncio.run(analytics.report(LogSource(str(tmp_path / "requests.jsonl")), top=3)).slowest
    assert [(s.request_id, s.slowest_phase, s.structured_compile_s) for s in slowest] == [
        ("req-000001", "compile", 6.5),
        ("req-000002", "decode", None),
        ("req-000003", "compile", 0.3),
    ]


def test_reference_percentile_is_type_7():
    xs = [0.3, 1.0, 2.5, 4.0, 10.0, 11.5, 30.0]
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    assert [type7(xs, p / 100) for p in (50, 95, 99)] == pytest.approx(
        [cuts[49], cuts[94], cuts[98]], rel=1e-12
    )


def test_totals_equal_independent_computation_over_rotated_files(log_dir):
    rep = report(log_dir)
    recs = known_records()
    assert (
        sum(r["event"]["outcome"] == "failure" and r["http"]["response"]["status_code"] < 400 for r in recs)
        == 6
    )
    assert_row(rep.total.flat(), expected_row(recs))
    assert (
        rep.extra["unparsed_lines"] == 1
    )  # "not json at all"; the torn last line is a record still in flight
    assert rep.total.requests == 400 and rep.total.flat()["group"] == "all"


def test_by_model_rows_ordered_by_count_then_name(log_dir):
    recs = known_records()
    rep = report(log_dir, by="model")
    groups = {}
    for r in recs:
        groups.setdefault(r["gen_ai"]["request"]["model"], []).append(r)
    order = sorted(groups, key=lambda m: (-len(groups[m]), m))
    assert [g.group for g in rep.groups] == order == ["qwen3-0.6b", "smollm2-135m", "llama-3-8b"]
    for row in rep.groups:
        assert_row(row.flat(), expected_row(groups[row.group]))


def test_by_finish_reason_counts_each_reason_and_missing(log_dir):
    recs = known_records()
    rep = report(log_dir, by="finish_reason")
    expected: dict[str, list] = {}
    for r in recs:
        for reason in r["gen_ai"]["response"]["finish_reasons"] or ["(none)"]:
            expected.setdefault(reason, []).append(r)
    assert {g.group: g.requests for g in rep.groups} == {k: len(v) for k, v in expected.items()}
    for row in rep.groups:
        assert_row(row.flat(), expected_row(expected[row.group]))


def test_by_tier_groups_by_the_engines_service_tier(tmp_path):
    """``--by tier``: the tier in ``kvscope.engine`` (the one that served or refused the request), ``(none)``
    where no engine of ours answered."""
    recs = known_records()
    served = [r for r in recs if r["kvscope"].get("engine") is not None]
    for i, r in enumerate(served):
        r["kvscope"]["engine"]["service_tier"] = ("priority", "default", "flex")[i % 3]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = report(tmp_path, by="tier")
    expected: dict[str, list] = {}
    for r in recs:
        expected.setdefault((r["kvscope"].get("engine") or {}).get("service_tier", "(none)"), []).append(r)
    assert set(expected) == {"priority", "default", "flex", "(none)"}
    assert {g.group: g.requests for g in rep.groups} == {k: len(v) for k, v in expected.items()}
    for row in rep.groups:
        assert_row(row.flat(), expected_row(expected[row.group]))


def test_by_status_and_since_window(log_dir):
    recs = [r for r in known_records() if r["@timestamp"] >= "2025-01-01T12:05:00.000Z"]
    now = T0 + timedelta(minutes=15)
    rep = report(log_dir, by="status", since="10m", now=now)
    assert parse_since("10m", now) == T0 + timedelta(minutes=5)
    assert rep.total.requests == len(recs) == 100
    assert_row(rep.total.flat(), expected_row(recs))
    statuses = {}
    for r in recs:
        statuses.setdefault(str(r["http"]["response"]["status_code"]), []).append(r)
    assert {g.group: g.requests for g in rep.groups} == {k: len(v) for k, v in statuses.items()}


def test_slowest_requests_with_trace_ids_and_phase(log_dir):
    recs = sorted(known_records(), key=lambda r: (-r["kvscope"]["e2e_s"], r["http"]["request"]["id"]))[:5]
    rep = report(log_dir, top=5)
    assert [s.request_id for s in rep.slowest] == [r["http"]["request"]["id"] for r in recs]
    assert [s.trace_id for s in rep.slowest] == [r["trace"]["id"] for r in recs]
    assert [s.e2e_s for s in rep.slowest] == [r["kvscope"]["e2e_s"] for r in recs]
    for slow, r in zip(rep.slowest, recs, strict=True):
        engine = r["kvscope"]["engine"]
        if engine is None:
            assert slow.slowest_phase == "?"
        elif engine["num_preemptions"]:
            assert slow.slowest_phase == "preempted"
        else:
            assert slow.slowest_phase == "decode"  # decode_s = e2e/2 dominates in this data


def test_cli_report_json_and_csv(log_dir, capsys):
    source = str(log_dir / "requests.jsonl")
    assert logs_main(["report", "--source", source, "--by", "upstream", "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert_row(body["total"], expected_row(known_records()))
    assert [g["group"] for g in body["groups"]] == list(UPSTREAMS) and len(body["slowest"]) == 10
    assert logs_main(["report", "--source", source, "--by", "key", "--format", "csv"]) == 0
    rows_text, slow_text = capsys.readouterr().out.split("\n\n")
    rows = list(csv.DictReader(io.StringIO(rows_text)))
    assert [r["group"] for r in rows] == ["all", *KEYS] and rows[0]["requests"] == "400"
    assert len(list(csv.DictReader(io.StringIO(slow_text)))) == 10


def test_cli_report_table_names_the_slowest_trace(log_dir, capsys):
    slowest = max(known_records(), key=lambda r: r["kvscope"]["e2e_s"])
    assert logs_main(["report", "--source", str(log_dir), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "slowest requests" in out and slowest["trace"]["id"] in out and "linear interpolation" in out


def test_search_sql_condition_newest_first(log_dir, capsys):
    cond = "http.response.status_code >= 500 AND gen_ai.request.model = 'qwen3-0.6b'"
    want = [
        r["http"]["request"]["id"]
        for r in reversed(known_records())
        if r["http"]["response"]["status_code"] >= 500 and r["gen_ai"]["request"]["model"] == "qwen3-0.6b"
    ][:4]
    assert (
        logs_main(
            ["search", cond, "--source", str(log_dir / "requests.jsonl"), "--limit", "4", "--format", "json"]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["http"]["request"]["id"] for r in lines] == want and len(want) == 4
    assert lines[0]["@timestamp"].endswith("Z") and "ttft_s" not in lines[0]["kvscope"]  # nulls dropped


def test_search_bad_condition_is_a_one_line_error(log_dir, capsys):
    assert logs_main(["search", "no_such_column > 1", "--source", str(log_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith('kvscope logs search: Binder Error: Referenced column "no_such_column" not found')
    assert len(err.splitlines()) == 1 and "an id or id prefix alone lists that request" in err


def test_missing_source_and_bad_arguments(tmp_path, capsys):
    assert logs_main(["report", "--source", str(tmp_path / "nope.jsonl")], env={}) == 1
    assert "no request log files" in capsys.readouterr().err
    assert logs_main(["report"], env={"KVSCOPE_CACHE": str(tmp_path)}) == 1
    assert "no --source" in capsys.readouterr().err
    assert logs_main(["report", "--by", "colour"], env={}) == 2
    assert logs_main(["report", "--since", "yesterday", "--source", str(tmp_path)], env={}) == 1


@pytest.mark.parametrize(
    "argv",
    [["report", "--top", "-1"], ["search", "true", "--limit", "-1"]],
    ids=["top", "limit"],
)
def test_a_negative_count_is_a_usage_error(log_dir, capsys, argv):
    """``LIMIT -1`` reached DuckDB (a BinderException with the SQL); argparse refuses it now (exit 2)."""
    assert logs_main([*argv, "--source", str(log_dir)]) == 2
    assert f"argument {argv[-2]}: must be a whole number >= 0, got '-1'" in capsys.readouterr().err


def test_a_since_too_far_back_says_so(log_dir, capsys):
    """``99999999999d`` overflowed timedelta: a Python OverflowError, not the --since message."""
    assert logs_main(["report", "--since", "99999999999d", "--source", str(log_dir)]) == 1
    assert capsys.readouterr().err == (
        "kvscope logs report: --since '99999999999d': use 15m, 1h, 2d or an ISO-8601 time\n"
    )
    with pytest.raises(ValueError, match="--since '99999999999d'"):
        parse_since("99999999999d", T0)


def test_report_defaults_to_the_serve_log(tmp_path, capsys):
    """Without --source, `kvscope logs report` reads the log `kvscope serve` writes under $KVSCOPE_CACHE."""
    serve_log = tmp_path / "logs" / "requests.jsonl"
    serve_log.parent.mkdir()
    serve_log.write_text("".join(json.dumps(r) + "\n" for r in known_records()))
    capsys.readouterr()
    assert logs_main(["report", "--format", "json"], env={"KVSCOPE_CACHE": str(tmp_path)}) == 0
    default = json.loads(capsys.readouterr().out)
    assert logs_main(["report", "--format", "json", "--source", str(serve_log)], env={}) == 0
    assert default == json.loads(capsys.readouterr().out)
    assert default["total"]["requests"] == len(known_records())


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_two_pngs(log_dir, tmp_path, capsys):
    assert logs_main(["plot", "--source", str(log_dir), "--out", str(tmp_path), "--bucket", "1m"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {tmp_path}/latency_percentiles.png",
        f"wrote {tmp_path}/ttft_histogram.png",
    ]
    assert png_size(tmp_path / "latency_percentiles.png") == (1100, 700)
    assert png_size(tmp_path / "ttft_histogram.png") == (1100, 500)


def test_plot_writes_beside_the_log_by_default(log_dir, tmp_path, capsys, monkeypatch):
    """Without --out the charts go to plots/ beside the charted log (for kvscope serve's log: the kvscope
    cache), not into the current directory; an Elasticsearch source's go to $KVSCOPE_CACHE/plots."""
    from kvscope.gateway.analytics.cli import default_plot_dir

    monkeypatch.chdir(tmp_path)
    assert logs_main(["plot", "--source", str(log_dir / "requests.jsonl"), "--bucket", "1m"], env={}) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {log_dir}/plots/latency_percentiles.png",
        f"wrote {log_dir}/plots/ttft_histogram.png",
    ]
    assert list(tmp_path.iterdir()) == []
    assert default_plot_dir(str(log_dir), tmp_path) == log_dir / "plots"
    assert default_plot_dir("http://es:9200", tmp_path / "cache") == tmp_path / "cache" / "plots"


def test_plot_data_buckets_and_histogram(log_dir):
    from kvscope.gateway.analytics.duckdb_logs import DuckDBLogs

    logs = DuckDBLogs(log_dir / "requests.jsonl")
    series = logs.timeseries(60)
    assert [row["requests"] for row in series] == [60] * 6 + [40]  # one record a second for 400 s
    first = [r["kvscope"]["ttft_s"] for r in known_records()[:60] if r["kvscope"]["ttft_s"] is not None]
    assert series[0]["ttft"] == pytest.approx([type7(first, p) for p in (0.5, 0.95, 0.99)], rel=1e-12)
    edges, counts = logs.ttft_histogram(bins=10)
    ttft = [v for v in col(known_records(), "kvscope.ttft_s") if v is not None]
    assert len(edges) == 11 and edges[0] == min(ttft) and sum(counts) == len(ttft)
    assert auto_bucket_s(T0, T0 + timedelta(seconds=400)) == 10 and auto_bucket_s(None, None) == 60
    assert parse_bucket("5m") == 300
    with pytest.raises(ValueError):
        parse_bucket("5 minutes")
