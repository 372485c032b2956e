"""End to end (issue 38): a gateway in front of a vLLM-kind and an SGLang-kind fake upstream
(kvscope/testing/fake_upstream.py ``--kind``, their /metrics as those servers write them), all three scraped
every second by a real Prometheus.

1. The gateway detects each upstream's kind (the /v1/models card's ``owned_by``): its per-upstream series
   carry ``kind`` and ``kvscope_gateway_upstream_info`` says which signal decided it.
2. Every panel of the engine dashboard's vLLM variant returns data (and of the SGLang variant, except the
   panels reading series the fake does not write: FAKE_SGLANG_LACKS); every query evaluates without error.
3. The overview's panels on the gateway's own series return data in front of these kinds too.
Each dashboard is rendered to test-artifacts/dashboards-kinds/<uid>.png with queries.json beside it.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvscope.dashboards.coverage import metric_names, panel_queries
from kvscope.dashboards.query import Variables
from kvscope.dashboards.render import PanelResult, Window, render
from tests.conftest import require_tool
from tests.e2e.prom import REPO, ManagedProcess, PrometheusServer, free_port, wait_for_series, wait_http_ok
from tests.test_engine_variants import FAKE_SGLANG_LACKS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODELS = {"vllm": "vllm-model", "sglang": "sglang-model"}
"""Upstream kind (and the gateway's upstream name) → the model its fake serves."""
ARTIFACTS = REPO / "test-artifacts" / "dashboards-kinds"
SCRAPE_S = 1.0
# 12 tokens 0.25 s apart: ~2.8 s in flight, more than two scrape intervals
SLOW = {"fake": {"token_delay_s": 0.25}}
MAY_BE_EMPTY = {
    "kvscope-engine-vllm": {"Draft acceptance rate": "the fake proposes no drafts (counters at 0)"},
    "kvscope-engine-sglang": {},
    "kvscope-overview": {
        "Routing prediction accuracy": "cache-aware routing only: these models route by load",
    },
}
"""Dashboard uid → panel title → why it may show no data here."""


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def gateway_config(path: Path, port: int, fakes: dict[str, str]) -> Path:
    config = {
        "host": "127.0.0.1",
        "port": port,
        # kind left to detection (auto): the cards' owned_by say vllm and sglang
        "upstreams": [{"url": url, "name": kind, "models": [MODELS[kind]]} for kind, url in fakes.items()],
        "routing": {"health_interval_s": 1.0, "health_timeout_s": 1.0},
        "logs": {"file": str(path.parent / "requests.jsonl")},
        "metrics_public": True,  # Prometheus scrapes without a key (loopback only)
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """Two fake upstreams (vLLM, SGLang: 2 slots each, so requests queue), a gateway, Prometheus."""
    require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("kinds")
    ports = {name: free_port() for name in (*MODELS, "gateway")}
    fakes = {kind: f"http://127.0.0.1:{ports[kind]}" for kind in MODELS}
    processes: list[ManagedProcess] = []
    try:
        for kind, model in MODELS.items():
            args = ["--port", str(ports[kind]), "--models", model, "--kind", kind, "--slots", "2"]
            delays = ["--first-token-delay-s", "0.02", "--token-delay-s", "0.005", "--cached-tokens", "4"]
            fake = ManagedProcess(
                python("-m", "kvscope.testing.fake_upstream", *args, *delays), tmp / f"{kind}.log"
            ).start()
            processes.append(fake)
            wait_http_ok(f"{fakes[kind]}/v1/models", 30, fake.proc)
        config = gateway_config(tmp / "gateway.yaml", ports["gateway"], fakes)
        gateway = ManagedProcess(
            python("-P", "-m", "kvscope.cli", "gateway", "--config", str(config)), tmp / "gateway.log"
        ).start()
        processes.append(gateway)
        wait_http_ok(f"http://127.0.0.1:{ports['gateway']}/healthz", 60, gateway.proc)
        targets = {
            "kvscope-gateway": [f"127.0.0.1:{ports['gateway']}"],
            **{kind: [f"127.0.0.1:{ports[kind]}"] for kind in MODELS},
        }
        with PrometheusServer(tmp / "prom", targets=targets, scrape_interval=f"{SCRAPE_S:g}s") as prom:
            wait_for_series(prom.api, 'up{job="kvscope-gateway"} == 1', 30)
            yield {"prom": prom, "gateway": f"http://127.0.0.1:{ports['gateway']}"}
    except Exception:
        for process in processes:
            print(f"--- {process.log_path.name}\n{process.log()[-4000:]}")
        raise
    finally:
        for process in reversed(processes):
            process.stop()


def chat(client: httpx.Client, model: str, content: str, stream: bool, **extra: object) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **extra,
    }
    if not stream:
        return client.post("/v1/chat/completions", json=body).status_code
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.read()
        return response.status_code


def drive_workload(base: str) -> list[list[int]]:
    """Two rounds, two scrapes apart (a series born inside one scrape interval shows no increase to
    rate()): per model 6 plain and 4 streamed chats, 4 at a time (more than the fakes' 2 slots: some
    wait; the first streamed chat of each model stays in flight across two scrapes, so the load-spread
    panels see requests in flight whatever the machine's speed); then one request the vLLM fake answers
    with a 500 and one for a model nobody serves (404), for the overview's error panels."""
    rounds: list[list[int]] = []
    with httpx.Client(base_url=base, timeout=60) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(2):
            calls = [
                (m, f"Question {i} for {m}: name a colour.", i >= 6, SLOW if i == 6 else {})
                for m in MODELS.values()
                for i in range(10)
            ]
            statuses = list(pool.map(lambda c: chat(client, *c[:3], **c[3]), calls))
            statuses.append(chat(client, MODELS["vllm"], "x", False, fake={"status": 500}))
            statuses.append(chat(client, "no-such-model", "x", False))
            rounds.append(statuses)
            time.sleep(2 * SCRAPE_S)
    return rounds


def gateway_only(dashboard: dict) -> set[str]:
    """Titles of the panels whose every query reads only the gateway's own series (or Prometheus' ``up``)."""
    by_title: dict[str, set[str]] = {}
    for panel, expr in panel_queries(dashboard):
        by_title.setdefault(panel["title"], set()).update(metric_names(expr))
    return {
        t
        for t, names in by_title.items()
        if all(n.startswith("kvscope_gateway_") or n == "up" for n in names)
    }


def render_all(prom: PrometheusServer, start: float) -> dict[str, tuple[dict, list[PanelResult]]]:
    end = time.time()
    window = Window(start, end, SCRAPE_S)
    variables = Variables(rate_interval=f"{4 * SCRAPE_S:g}s", range=f"{int(end - start) + 1}s")
    out = {}
    for name in ("kvscope-engine-vllm", "kvscope-engine-sglang", "kvscope-overview"):
        dashboard = json.loads((REPO / "dashboards" / "json" / f"{name}.json").read_text())
        out[name] = (dashboard, render(dashboard, prom.api, window, ARTIFACTS / f"{name}.png", variables))
    summary = {
        uid: [
            {
                "title": p.title,
                "queries": [{"expr": q.expr, "has_data": q.has_data, "error": q.error} for q in p.queries],
            }
            for p in panels
        ]
        for uid, (_, panels) in out.items()
    }
    (ARTIFACTS / "queries.json").write_text(json.dumps(summary, indent=2))
    return out


def test_dashboards_over_vllm_and_sglang_upstreams(stack) -> None:
    prom = stack["prom"]
    start = time.time() - 5
    for statuses in drive_workload(stack["gateway"]):
        assert statuses[:20] == [200] * 20 and statuses[20] >= 500 and statuses[21] == 404, statuses

    info = {
        (s["metric"]["upstream"], s["metric"]["kind"], s["metric"]["kind_source"])
        for s in prom.api.query("kvscope_gateway_upstream_info == 1")
    }
    assert info == {("vllm", "vllm", "models"), ("sglang", "sglang", "models")}
    up = {
        (s["metric"]["upstream"], s["metric"]["kind"]): s["value"][1]
        for s in prom.api.query("kvscope_gateway_upstream_up")
    }
    assert up == {("vllm", "vllm"): "1", ("sglang", "sglang"): "1"}

    results = render_all(prom, start)
    errors = [
        (uid, p.title, q.error) for uid, (_, ps) in results.items() for p in ps for q in p.queries if q.error
    ]
    empty = []
    for uid, (dashboard, panels) in results.items():
        required = gateway_only(dashboard) if uid == "kvscope-overview" else {p.title for p in panels}
        for panel in panels:
            for query in panel.queries:
                lacking = uid == "kvscope-engine-sglang" and metric_names(query.expr) & FAKE_SGLANG_LACKS
                if panel.title in required and panel.title not in MAY_BE_EMPTY[uid] and not lacking:
                    if not query.has_data:
                        empty.append((uid, panel.title, query.expr))
    assert (errors, empty) == ([], []), "see test-artifacts/dashboards-kinds/queries.json"
