"""Dashboards: generated from the catalog and fresh, only defined metrics (and every metric shown), sound
layout and variables, and every query accepted by a real Prometheus (started once, no targets)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvscope.dashboards import generate, overview
from kvscope.dashboards.catalog import discover
from kvscope.dashboards.coverage import PROMETHEUS_BUILTINS, metric_names, not_shown, panel_queries, undefined
from kvscope.dashboards.engine_names import LABEL_NAMES, VARIANT_KINDS, variant_uid
from kvscope.dashboards.engine_variants import exported_series
from kvscope.dashboards.grafana import DATASOURCE_UID, GRID_WIDTH, layout, row, timeseries
from kvscope.dashboards.promql import PromQL, le_regex
from kvscope.dashboards.query import PromQLError, Variables, legend
from tests.conftest import require_tool
from tests.e2e.prom import PrometheusServer

REPO = Path(__file__).resolve().parent.parent
JSON_DIR = REPO / "dashboards" / "json"
PROVISIONING = REPO / "dashboards" / "provisioning"
CATALOG = discover()
COMPONENTS = ["engine", "gateway"]
DASHBOARDS = {p.name: json.loads(p.read_text()) for p in sorted(JSON_DIR.glob("*.json"))}
VARIANTS = {f"{variant_uid(kind)}.json": kind for kind in VARIANT_KINDS}
"""The engine dashboard's variants in vLLM's and SGLang's metric names (file name → kind)."""
OURS = {name: d for name, d in DASHBOARDS.items() if name not in VARIANTS}
"""The dashboards over our own series."""


def all_exprs(dashboards: dict[str, dict] = DASHBOARDS) -> list[str]:
    return [expr for d in dashboards.values() for _, expr in panel_queries(d)]


def test_every_dashboard_is_committed() -> None:
    assert (
        sorted(DASHBOARDS)
        == sorted([*generate.BUILDERS, *VARIANTS])
        == [
            "kvscope-engine-sglang.json",
            "kvscope-engine-vllm.json",
            "kvscope-engine.json",
            "kvscope-overview.json",
        ]
    )


def test_committed_files_match_the_generator() -> None:
    stale = generate.stale_files(generate.expected_files(CATALOG))
    assert stale == [], "run: python -m kvscope.dashboards.generate"


def test_check_mode_fails_on_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate, "JSON_DIR", tmp_path / "json")
    monkeypatch.setattr(generate, "METRICS_DOC", tmp_path / "metrics.md")
    assert generate.main(["--check"]) == 1  # nothing written yet
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0
    overview_json = tmp_path / "json" / "kvscope-overview.json"
    overview_json.write_text(overview_json.read_text().replace("Requests / s", "Requests per second"))
    assert generate.main(["--check"]) == 1


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'sum by (le) (rate(kvscope_engine_queue_time_seconds_bucket{job=~"$job", x="kvscope_fake"}[1m]))'
        ' / on (job) group_left up{job="a"}'
    )
    assert metric_names(expr) == {"kvscope_engine_queue_time_seconds_bucket", "up"}


def test_an_undefined_metric_is_reported() -> None:
    exprs = [
        "rate(kvscope_engine_prompt_tokens_total[1m])",
        "rate(kvscope_engine_promt_tokens_total[1m])",
        "up == 0",
        'vllm:num_requests_running{model="m"}',
    ]
    assert undefined(exprs, CATALOG) == {
        "kvscope_engine_promt_tokens_total": {"rate(kvscope_engine_promt_tokens_total[1m])"},
        "vllm:num_requests_running": {'vllm:num_requests_running{model="m"}'},
    }


@pytest.mark.parametrize("component", COMPONENTS)
def test_dashboards_name_only_defined_metrics(component: str) -> None:
    missing = undefined(all_exprs(OURS), CATALOG)
    assert {n for n in missing if n.startswith(f"kvscope_{component}_")} == set()
    assert {n for n in missing if not n.startswith(("kvscope_engine_", "kvscope_gateway_"))} == set()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_engine_variants_name_only_the_equivalents_of_our_engine_series(name: str) -> None:
    kind = VARIANTS[name]
    named = {n for expr in all_exprs({name: DASHBOARDS[name]}) for n in metric_names(expr)}
    assert named - PROMETHEUS_BUILTINS <= exported_series(kind, CATALOG)
    assert {n for n in named if n.startswith("kvscope_")} == set()


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_defined_metric_is_on_a_panel(component: str) -> None:
    # The reverse report (also printed by `python -m kvscope.dashboards.generate` and in docs/metrics.md).
    unshown = not_shown(DASHBOARDS.values(), CATALOG)
    assert [n for n in unshown if n.startswith(f"kvscope_{component}_")] == []


def test_builder_rejects_what_the_catalog_lacks() -> None:
    q = PromQL(CATALOG)
    with pytest.raises(KeyError, match="kvscope_engine_requests_runing"):
        q.sel("kvscope_engine_requests_runing")
    with pytest.raises(ValueError, match="no label"):
        q.sel("kvscope_engine_requests_running", 'status="200"')
    with pytest.raises(ValueError, match="not a bucket bound"):
        q.le_matcher("kvscope_engine_time_to_first_token_seconds", 0.3)
    with pytest.raises(ValueError, match="not a histogram"):
        q.mean("kvscope_engine_requests_running")


def test_selectors_carry_the_variables_the_metric_supports() -> None:
    q = PromQL(CATALOG)
    assert q.sel("kvscope_engine_requests_running") == (
        'kvscope_engine_requests_running{job=~"$job", instance=~"$instance", model=~"$model"}'
    )
    assert q.sel("kvscope_engine_device_memory_used_bytes", 'device="cpu"') == (
        'kvscope_engine_device_memory_used_bytes{job=~"$job", instance=~"$instance", device="cpu"}'
    )
    assert q.mean("kvscope_engine_batch_size") == (
        'sum(rate(kvscope_engine_batch_size_sum{job=~"$job", instance=~"$instance", model=~"$model"}'
        '[$__rate_interval])) / (sum(rate(kvscope_engine_batch_size_count{job=~"$job", '
        'instance=~"$instance", model=~"$model"}[$__rate_interval])) > 0)'
    )
    assert (le_regex(1.0), le_regex(0.1), le_regex(600)) == ("1|1.0", "0.1", "600|600.0")


def test_every_mean_guards_the_division() -> None:
    means = [e for e in all_exprs() if "_sum{" in e]
    # overview: 6 latency pairs + overhead, queue, batch; engine internals: 12; the vLLM variant: 13 (no
    # batch size, acceptance length or grammar times); the SGLang variant: 7 (TTFT, ITL, e2e, queue,
    # request length x2, grammar compile time)
    assert len(means) == 21 + 13 + 7
    for expr in means:
        assert re.fullmatch(
            r"sum(?: by \([\w, ]+\))?\(rate\([\w:]+_sum\{.*\}\[\$__rate_interval\]\)\) / "
            r"\(sum(?: by \([\w, ]+\))?\(rate\([\w:]+_count\{.*\}\[\$__rate_interval\]\)\) > 0\)",
            expr,
        ), expr


def test_slo_thresholds_are_bucket_bounds_of_both_histograms() -> None:
    for component in ("engine", "gateway"):
        ttft = CATALOG.family(f"kvscope_{component}_time_to_first_token_seconds")
        tpot = CATALOG.family(f"kvscope_{component}_time_per_output_token_seconds")
        assert overview.TTFT_SLO_S in ttft.buckets and overview.TPOT_SLO_S in tpot.buckets


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panels_tile_the_grid_without_overlap(name: str) -> None:
    panels = DASHBOARDS[name]["panels"]
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= GRID_WIDTH, p["title"]
        new = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & new, f"{p['title']} overlaps another panel"
        cells |= new
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))


def test_layout_wraps_rows_and_panels() -> None:
    panels = layout([row("a"), *[timeseries(f"p{i}", "", [], "s", w=10) for i in range(3)], row("b")])
    assert [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels] == [
        (0, 0),
        (0, 1),
        (10, 1),
        (0, 9),
        (0, 17),
    ]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panels_have_descriptions_and_use_the_datasource_variable(name: str) -> None:
    for panel in DASHBOARDS[name]["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'job=~"$job"' in target["expr"] and 'instance=~"$instance"' in target["expr"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_variables_are_datasource_job_instance_model(name: str) -> None:
    variables = DASHBOARDS[name]["templating"]["list"]
    assert [v["name"] for v in variables] == ["datasource", "job", "instance", "model"]
    assert variables[0]["current"]["value"] == DATASOURCE_UID
    assert all(v["multi"] and v["includeAll"] and v["allValue"] == ".*" for v in variables[1:])
    kind = VARIANTS.get(name)
    regex, model = (f"{kind}:.+", LABEL_NAMES[kind]["model"]) if kind else ("kvscope_.+", "model")
    assert variables[3]["definition"] == (
        f'label_values({{__name__=~"{regex}", job=~"$job", instance=~"$instance"}}, {model})'
    )


def test_overview_has_the_panels_the_issue_lists() -> None:
    titles = {p["title"] for p in DASHBOARDS["kvscope-overview.json"]["panels"]}
    expected = {
        "Requests / s",
        "Error ratio",
        "Status breakdown",
        "TTFT ≤ 1 s",
        "TPOT ≤ 100 ms",
        "Time to first token (gateway)",
        "Time to first token (engine)",
        "Time per output token (gateway)",
        "Time per output token (engine)",
        "End-to-end latency (gateway)",
        "End-to-end latency (engine)",
        "Tokens / s",
        "Running vs waiting",
        "Queue time (engine)",
        "Batch size",
        "KV-cache usage",
        "Preemptions / s",
        "Prefix-cache hit rate",
        "Device memory",
        "Upstream health",
        "Upstream kinds",
        "Log records / s",
        "Log spool size",
        "Prompt length (tokens)",
        "Output length (tokens)",
        "TTFT by cause (engine)",
    }
    assert expected - titles == set()
    heatmaps = [p for p in DASHBOARDS["kvscope-overview.json"]["panels"] if p["type"] == "heatmap"]
    assert [p["targets"][0]["format"] for p in heatmaps] == ["heatmap", "heatmap"]


def test_provisioning_pins_the_datasource_and_scrape_interval() -> None:
    sources = yaml.safe_load((PROVISIONING / "datasources" / "kvscope.yaml").read_text())["datasources"]
    prom = next(s for s in sources if s["type"] == "prometheus")
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())["global"]["scrape_interval"]
    assert (prom["uid"], prom["jsonData"]["timeInterval"]) == (DATASOURCE_UID, scrape)
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "kvscope.yaml").read_text())["providers"][0]
    assert (provider["type"], provider["options"]["path"]) == ("file", "/var/lib/grafana/dashboards/kvscope")


def test_variables_and_legends_substitute_like_grafana() -> None:
    v = Variables(rate_interval="4s", range="5m")
    assert v.substitute('rate(x{job=~"$job",m=~"${model}"}[$__rate_interval]) / $__range') == (
        'rate(x{job=~".*",m=~".*"}[4s]) / 5m'
    )
    with pytest.raises(KeyError, match=r"\$pod"):
        v.substitute('x{pod="$pod"}')
    assert legend("{{status}} {{route}}", {"status": "200", "route": "/v1/x"}, "A") == "200 /v1/x"
    assert legend("__auto", {"status": "200"}, "A") == "A"


# --- a real Prometheus (no targets) parses and evaluates every query ---------------------------------------


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory):
    require_tool("prometheus")
    with PrometheusServer(tmp_path_factory.mktemp("prometheus")) as server:
        yield server


def test_prometheus_rejects_a_broken_query(prometheus: PrometheusServer) -> None:
    with pytest.raises(PromQLError, match="bad_data"):
        prometheus.api.query("sum by (le) rate(kvscope_engine_batch_size_bucket[1m])")


def test_every_panel_query_evaluates_in_prometheus(prometheus: PrometheusServer) -> None:
    variables = Variables(rate_interval="20s", range="1h")
    errors = {}
    for expr in all_exprs():
        try:
            assert prometheus.api.query(variables.substitute(expr)) == []  # no targets, no data
        except PromQLError as exc:
            errors[expr] = exc.message
    assert errors == {}
    # the GPU row: 12 queries; the SLO error ratio; build_info: 2; engine broken streams; routing: 6; the
    # upstream kinds: 1 (overview); the CPU kernels by decode rows: 1 (overview); admission: 6 (engine:
    # shed rate, TTFT p99 by tier, queue time p50/p99 by tier, prediction error p50/p90). The engine
    # variants keep the queries whose series the engine exports (tests/test_engine_variants.py lists their
    # panels): vLLM 58, SGLang 36
    assert len(all_exprs(OURS)) == 147
    assert {VARIANTS[n]: len(all_exprs({n: DASHBOARDS[n]})) for n in VARIANTS} == {"vllm": 58, "sglang": 36}


def test_every_variable_query_is_a_valid_selector(prometheus: PrometheusServer) -> None:
    for dashboard in DASHBOARDS.values():
        for variable in dashboard["templating"]["list"][1:]:
            match = re.fullmatch(r"label_values\((\{.*\}), (\w+)\)", variable["definition"])
            assert match and match.group(2) in (variable["name"], f"{variable['name']}_name")
            assert prometheus.api.series(Variables().substitute(match.group(1))) == []


def test_values_are_formatted_in_the_panel_unit() -> None:
    from kvscope.dashboards.render import format_value

    assert [
        format_value(v, u)
        for v, u in [
            (0.0421, "s"),
            (2.5, "s"),
            (0.9512, "percentunit"),
            (3 * 2**30, "bytes"),
            (1536, "bytes"),
            (12.34, "reqps"),
            (float("nan"), "s"),
        ]
    ] == ["42.1 ms", "2.50 s", "95.12 %", "3.0 GiB", "1.5 KiB", "12.3 req/s", "NaN"]


def test_render_draws_every_panel_and_reports_missing_data(
    prometheus: PrometheusServer, tmp_path: Path
) -> None:
    from kvscope.dashboards.render import Window, render

    dashboard = DASHBOARDS["kvscope-engine.json"]
    out = tmp_path / "engine.png"
    results = render(dashboard, prometheus.api, Window(1_700_000_000, 1_700_000_060, 5), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r.title for r in results] == [p["title"] for p in dashboard["panels"] if p["type"] != "row"]
    assert all(q.error is None and not q.has_data for r in results for q in r.queries)


def test_threshold_lines_are_the_alert_thresholds() -> None:
    # Generated from alerts/kvscope.rules.yaml (kvscope.dashboards.alert_thresholds): the page's burn-rate
    # ratio, the p99 latency limits, KV-cache pressure and the preemption rate.
    lines = {
        p["title"]: p["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]
        for d in DASHBOARDS.values()
        for p in d["panels"]
        if p.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("thresholdsStyle")
    }
    page = 14.4 * (1 - overview.AVAILABILITY_SLO)
    assert lines == {
        "Error ratio": pytest.approx(page),
        "Engine HTTP 5xx ratio": pytest.approx(page),
        "Time to first token (gateway)": overview.TTFT_SLO_S,
        "Time per output token (gateway)": overview.P99_TPOT_S,
        "KV-cache usage": 0.9,
        "Preemptions / s": 0.2,
    }


def test_a_changed_alert_threshold_moves_its_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kvscope.dashboards import alert_thresholds

    rules = tmp_path / "rules.yaml"
    rules.write_text(
        alert_thresholds.RULES_FILE.read_text().replace(
            "avg_over_time(kvscope_engine_kv_cache_usage_ratio[5m]) > 0.9",
            "avg_over_time(kvscope_engine_kv_cache_usage_ratio[5m]) > 0.8",
        )
    )
    monkeypatch.setattr(alert_thresholds, "RULES_FILE", rules)
    alert_thresholds._rules.cache_clear()
    try:
        built = generate.build_dashboards(CATALOG)
    finally:
        alert_thresholds._rules.cache_clear()
    kv = next(p for p in built["kvscope-overview.json"]["panels"] if p["title"] == "KV-cache usage")
    assert kv["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 0.8
