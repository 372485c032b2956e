"""The engine dashboard's vLLM and SGLang variants (dashboards/engine_variants.py) and the table they and
docs/metrics.md read (dashboards/engine_names.py): names, labels, what is kept and dropped, and the series
checked against the vLLM and SGLang /metrics that the fake upstream writes from those servers' sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.dashboards.catalog import discover
from kvscope.dashboards.engine_names import (
    ENGINE_EQUIVALENTS,
    KIND_TITLES,
    LABEL_NAMES,
    METRIC_PREFIX,
    VARIANT_KINDS,
    Equivalent,
    variant_uid,
)
from kvscope.dashboards.engine_variants import MISSING, EngineDialect, translate, variant_series
from kvscope.dashboards.grafana import Target, row, timeseries
from kvscope.gateway.engines.kinds import UpstreamKind
from kvscope.testing import upstream_kinds

REPO = Path(__file__).resolve().parent.parent
CATALOG = discover()
VARIANTS = {
    kind: json.loads((REPO / "dashboards" / "json" / f"{variant_uid(kind)}.json").read_text())
    for kind in VARIANT_KINDS
}
SEL = 'job=~"$job", instance=~"$instance", model_name=~"$model"'


def test_the_variant_kinds_are_upstream_kinds() -> None:
    assert VARIANT_KINDS == (UpstreamKind.VLLM.value, UpstreamKind.SGLANG.value)
    for table in (KIND_TITLES, LABEL_NAMES, METRIC_PREFIX):
        assert tuple(table) == VARIANT_KINDS


def test_the_table_maps_defined_families_to_series_of_the_same_shape() -> None:
    families = {m.name: m for m in CATALOG.metrics}
    assert set(ENGINE_EQUIVALENTS) - set(families) == set()
    for family, by_kind in ENGINE_EQUIVALENTS.items():
        assert set(by_kind) <= set(VARIANT_KINDS), family
        for kind, eq in by_kind.items():
            assert eq.series or eq.note, (family, kind)  # an entry says something
            if eq.series is None:
                continue
            assert eq.series.startswith(METRIC_PREFIX[kind]), (family, kind)
            counter = families[family].type == "counter"
            assert eq.series.endswith("_total") == counter or eq.series == "vllm:iteration_tokens_total"


def test_cells_render_name_and_note() -> None:
    assert Equivalent("vllm:x_total", "older: `y`").cell() == "`vllm:x_total` (older: `y`)"
    assert Equivalent("vllm:x_total").cell() == "`vllm:x_total`"
    assert Equivalent(note="none here").cell() == "— (none here)"
    assert Equivalent().cell() == "—"


def test_the_dialect_writes_the_kinds_names_and_labels() -> None:
    vllm, sglang = EngineDialect(CATALOG, "vllm"), EngineDialect(CATALOG, "sglang")
    assert vllm.sum_rate("kvscope_engine_request_success_total", by=("finish_reason",)) == (
        f"sum by (finished_reason) (rate(vllm:request_success_total{{{SEL}}}[$__rate_interval]))"
    )
    # SGLang has no finish reason: a by() sums over it, a matcher on it cannot be written
    assert sglang.sum_rate("kvscope_engine_request_success_total", by=("finish_reason",)) == (
        f"sum(rate(sglang:num_requests_total{{{SEL}}}[$__rate_interval]))"
    )
    assert sglang.sel("kvscope_engine_request_success_total", 'finish_reason="stop"') == (
        MISSING + "kvscope_engine_request_success_total"
    )
    assert vllm.sel("kvscope_engine_request_success_total", 'finish_reason="stop"') == (
        f'vllm:request_success_total{{{SEL}, finished_reason="stop"}}'
    )
    assert vllm.quantile(0.5, "kvscope_engine_time_to_first_token_seconds") == (
        "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket"
        f"{{{SEL}}}[$__rate_interval])))"
    )
    assert vllm.gauge("kvscope_engine_spec_decode_num_accepted_tokens_per_pos_total", 'position="0"') == (
        f'sum(vllm:spec_decode_num_accepted_tokens_per_pos_total{{{SEL}, position="0"}})'
    )
    # no equivalent, a gateway series: marked, and still checked against our catalog
    assert vllm.sel("kvscope_engine_batch_size_count") == MISSING + "kvscope_engine_batch_size_count"
    assert sglang.sel("kvscope_gateway_upstream_up") == MISSING + "kvscope_gateway_upstream_up"
    with pytest.raises(KeyError, match="kvscope_engine_requests_runing"):
        vllm.sel("kvscope_engine_requests_runing")
    with pytest.raises(ValueError, match="no label"):
        vllm.sel("kvscope_engine_requests_running", 'status="200"')


def test_translate_drops_what_the_kind_lacks() -> None:
    q = EngineDialect(CATALOG, "vllm")
    running = q.gauge("kvscope_engine_requests_running")
    line = 0.9
    panels = [
        row("kept"),
        timeseries(
            "mixed",
            "Two queries.",
            [Target(running, "{{model}}"), Target(q.mean("kvscope_engine_batch_size"), "batch")],
            "short",
            threshold=line,
        ),
        row("emptied"),
        timeseries("gone", "No equivalent.", [Target(q.gauge("kvscope_engine_kv_cache_blocks"))], "short"),
        row("last"),
    ]
    out = translate(panels, "vllm")
    assert [p["title"] for p in out] == ["kept", "mixed"]
    mixed = out[1]
    assert [(t["refId"], t["expr"], t["legendFormat"]) for t in mixed["targets"]] == [
        ("A", f"sum(vllm:num_requests_running{{{SEL}}})", "{{model_name}}")
    ]
    assert mixed["description"] == "Two queries. vLLM: `vllm:num_requests_running`."
    assert "thresholds" not in mixed["fieldConfig"]["defaults"]
    assert "thresholdsStyle" not in mixed["fieldConfig"]["defaults"]["custom"]
    assert panels[1]["targets"][1]["expr"].startswith("sum(rate(" + MISSING)  # the input is left alone


VLLM_PANELS = [
    "Engine saturation",
    "Running vs waiting",
    "KV-cache usage",
    "Preemptions / s",
    "Prefix-cache hit rate",
    "Engine latency",
    "Time to first token (engine)",
    "Time per output token (engine)",
    "End-to-end latency (engine)",
    "Queue time (engine)",
    "Request shapes",
    "Prompt length (tokens)",
    "Output length (tokens)",
    "Request phases",
    "Prefill time",
    "Decode time",
    "Inter-token latency",
    "Finished requests / s",
    "Mean request length",
    "Inference time",
    "Mean request parameters",
    "Engine steps",
    "Tokens / s (engine)",
    "Tokens per step",
    "KV cache",
    "Prefix-cache tokens / s",
    "Preemptions per finished request",
    "Speculative decoding",
    "Draft acceptance rate",
    "Draft tokens / s",
]
SGLANG_PANELS = [
    "Engine saturation",
    "Running vs waiting",
    "KV-cache usage",
    "Preemptions / s",
    "Prefix-cache hit rate",
    "Engine latency",
    "Time to first token (engine)",
    "End-to-end latency (engine)",
    "Queue time (engine)",
    "Request shapes",
    "Prompt length (tokens)",
    "Output length (tokens)",
    "Request phases",
    "Inter-token latency",
    "Finished requests / s",
    "Mean request length",
    "Engine steps",
    "Tokens / s (engine)",
    "KV cache",
    "Prefix-cache tokens / s",
    "Preemptions per finished request",
    "Structured output",
    "Constrained requests / s",
    "Grammar compile time",
]


@pytest.mark.parametrize(("kind", "titles"), [("vllm", VLLM_PANELS), ("sglang", SGLANG_PANELS)])
def test_each_variant_keeps_the_panels_the_engine_can_fill(kind: str, titles: list[str]) -> None:
    variant = VARIANTS[kind]
    assert (variant["uid"], variant["title"]) == (
        f"kvscope-engine-{kind}",
        f"kvscope / Engine internals ({KIND_TITLES[kind]})",
    )
    assert [p["title"] for p in variant["panels"]] == titles
    legends = {
        p["title"]: [t["legendFormat"] for t in p["targets"]] for p in variant["panels"] if p["type"] != "row"
    }
    assert legends["Finished requests / s"] == ["{{finished_reason}}" if kind == "vllm" else "all"]
    for panel in variant["panels"]:
        if panel["type"] != "row":
            assert panel["description"].endswith("`."), panel["title"]
            assert "thresholds" not in panel["fieldConfig"]["defaults"], panel["title"]


def _exported(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


FAKE_SGLANG_LACKS = {
    "sglang:num_retracted_requests_total",  # newer SGLang releases (the collector cited)
    *(f"sglang:{h}_{s}" for h in ("prompt_tokens_histogram", "generation_tokens_histogram",
                                 "grammar_compilation_time_seconds") for s in ("bucket", "sum", "count")),
    "sglang:num_so_requests_total",
}  # fmt: skip
"""Series of the SGLang variant that the fake's /metrics does not write (only with
``--collect-tokens-histogram``, a grammar or a retraction in SGLang itself)."""


def test_the_variants_select_what_the_fake_engines_export() -> None:
    """Two independent readings of vLLM's and SGLang's sources: the table here and the fake upstream's
    /metrics (kvscope/testing/upstream_kinds.py)."""
    state = upstream_kinds.EngineState()
    vllm = _exported(upstream_kinds.vllm_metrics(state, "m", 2048))
    sglang = _exported(upstream_kinds.sglang_metrics(state, "m"))
    assert variant_series(VARIANTS["vllm"]) - {"up"} <= vllm
    assert variant_series(VARIANTS["sglang"]) - sglang == FAKE_SGLANG_LACKS
