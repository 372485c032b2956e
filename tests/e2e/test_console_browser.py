"""The console (gateway/console/, docs/console.md) in a real headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium: kvscope/testing/browser.py) against a real ``kvscope serve`` with API
keys: a non-admin key is refused and an admin key logs in (an HttpOnly session cookie, no key in any URL);
after a few requests the charts hold series whose latest values equal the gateway's and the engine's
``/metrics`` figures, the request table lists exactly the requests sent, a request's waterfall numbers equal
its log line (and its trace id links to the configured trace UI), and the health page shows the replica and
the alert conditions. An error sent while the overview is open joins its chart, and the columns the page has
merged from its polls equal the gateway's whole answer. A screenshot of each whole page goes to
test-artifacts/console/.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvscope.gateway.auth import hash_key
from kvscope.gateway.logs.jsonl import read_records
from kvscope.gateway.logs.why import explain
from kvscope.testing.harness import free_port
from tests.conftest import require_tool
from tests.e2e.test_serve import BANNER, REPO, Serve, children_of, gone

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]
ENGINE_ARGS = "--max-model-len 512 --kv-cache-memory 32M --num-threads 1"
ADMIN, APP = "sk-kvs-console-test-admin-key", "sk-kvs-console-test-app-key"
ARTIFACTS = REPO / "test-artifacts" / "console"
MODEL = "smollm2-135m"
SHARED = "You are a terse assistant. Answer in one short sentence, without any preamble or list. " * 2
SENT = ["console-1", "console-2", "console-3", "console-4", "console-5", "console-6"]
"""The requests sent: five before the page opens (:func:`_send`), one with an unknown key while it is open
(:func:`_check_a_series_that_joins_later`)."""
TRACE_URL = "http://127.0.0.1:16686/trace/{trace_id}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """``kvscope serve`` whose gateway has an admin key (``ops``) and an application key (``app``)."""
    tmp = tmp_path_factory.mktemp("console")
    config = tmp / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "api_keys": [
                    {"name": "ops", "sha256": hash_key(ADMIN), "admin": True},
                    {"name": "app", "sha256": hash_key(APP)},
                ],
                "console": {"trace_url": TRACE_URL},
            }
        )
    )
    port, output, log_file = free_port(), tmp / "serve.out", tmp / "requests.jsonl"
    script = Path(sys.executable).with_name("kvscope")
    head = [str(script)] if script.is_file() else [sys.executable, "-P", "-m", "kvscope.cli"]
    cmd = [*head, "serve", "--port", str(port), "--log-file", str(log_file), "--engine-args", ENGINE_ARGS]
    cmd += ["--gateway-args", f"--config {config}"]
    with output.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    running = Serve(proc, port, output, log_file, {})
    try:
        deadline = time.monotonic() + 240
        while BANNER not in output.read_text(errors="replace"):
            assert proc.poll() is None, f"kvscope serve exited with {proc.returncode}:\n{output.read_text()}"
            assert time.monotonic() < deadline, f"no banner after 240 s:\n{output.read_text()[-3000:]}"
            time.sleep(0.2)
        running.children = children_of(proc.pid)
        yield running
    finally:
        for pid, start in {**running.children, **children_of(proc.pid)}.items():
            if not gone(pid, start):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require_tool("chromium")
    require_tool("chromedriver")
    from kvscope.testing.browser import headless_chromium

    driver = headless_chromium()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, condition: Any, timeout: float = 30.0, what: str = "") -> Any:
    """Poll `condition` until it is truthy; an element the page re-rendered under the poll is read again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(
        driver, timeout, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)
    )
    return wait.until(lambda d: condition(d), what)


def _by(css: str) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    return (By.CSS_SELECTOR, css)


def _screenshot(driver: Any, name: str) -> None:
    """The whole page, not only the window's height, to test-artifacts/console/``name``: the window is made
    as tall as the page for the shot, then put back."""
    size = driver.get_window_size()
    inner, total = driver.execute_script(
        "return [window.innerHeight, document.documentElement.scrollHeight];"
    )
    driver.set_window_size(size["width"], size["height"] - inner + max(inner, total))
    try:
        driver.save_screenshot(str(ARTIFACTS / name))
    finally:
        driver.set_window_size(size["width"], size["height"])


def _login(driver: Any, key: str) -> None:
    field = driver.find_element(*_by("#login-key"))
    field.clear()
    field.send_keys(key)
    driver.find_element(*_by("#login-form button")).click()


def test_only_an_admin_key_opens_the_console(stack: Serve, browser: Any) -> None:
    banner = f"console (live charts, the newest requests, alert conditions): {stack.url}/console\n"
    assert banner in stack.output.read_text(errors="replace")
    api = stack.url + "/console/api/overview"
    refused = httpx.get(api)
    assert (refused.status_code, refused.json()["error"]["code"]) == (401, "console_login_required")
    not_admin = httpx.get(api, headers={"authorization": f"Bearer {APP}"})
    assert (not_admin.status_code, not_admin.json()["error"]["code"]) == (403, "console_admin_required")
    assert httpx.get(api, headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200

    browser.get(stack.url + "/console")
    _wait(browser, lambda d: d.find_element(*_by("#login")).is_displayed(), what="the login form")
    asked = "Log in to the console with an admin API key."
    _wait(browser, lambda d: d.find_element(*_by("#login-error")).text == asked, what="the login prompt")
    _login(browser, APP)
    refusal = "This API key may not open the console: it needs a key marked `admin: true`"
    _wait(
        browser, lambda d: d.find_element(*_by("#login-error")).text.startswith(refusal), what="the refusal"
    )
    _screenshot(browser, "console-login-refused.png")
    assert browser.get_cookies() == []
    _login(browser, ADMIN)
    _wait(browser, lambda d: not d.find_element(*_by("#login")).is_displayed(), what="the login form gone")
    (cookie,) = browser.get_cookies()
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (
        "kvscope_console",
        True,
        "Strict",
        "/console",
    )
    assert ADMIN not in cookie["value"] and ADMIN not in browser.current_url


def _metrics(url: str, key: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lb, v in samples.get(name, []) if labels.items() <= lb.items())


def _quantile(q: float, samples: dict, name: str) -> float | None:
    """Prometheus' histogram_quantile over ``sum by (le)`` of the page's ``_bucket`` samples
    (promql/quantile.go bucketQuantile), written out here independently of gateway/console/series.py."""
    buckets: dict[float, float] = {}
    for labels, value in samples.get(name + "_bucket", []):
        buckets[float(labels["le"])] = buckets.get(float(labels["le"]), 0.0) + value
    bounds = sorted(buckets)
    counts = [buckets[b] for b in bounds]
    if not counts or counts[-1] == 0:
        return None
    rank = q * counts[-1]
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if math.isinf(bounds[b]):
        return bounds[b - 1]
    start = bounds[b - 1] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    return start + (bounds[b] - start) * ((rank - below) / (counts[b] - below))


CHART_DATA = """
const c = window.kvscopeConsole, out = {t: c.data.t, dt: c.data.dt, charts: {}};
for (const [id, ch] of Object.entries(c.charts)) {
  out.charts[id] = {};
  if (ch.plot) ch.keys.forEach((k, i) => { out.charts[id][k] = ch.plot.data[i + 1]; });
  if (ch.plot) out.charts[id].__t = ch.plot.data[0];
}
return out;
"""


def _integral(chart: dict[str, list], key: str, dt: dict[float, float | None]) -> float:
    """Σ rate × dt over a chart's points: the counter's increase the rate series stands for."""
    return sum(v * (dt[t] or 0.0) for t, v in zip(chart["__t"], chart[key], strict=True) if v is not None)


def _send(url: str) -> float:
    """The five requests (two streamed, two with a shared prompt prefix, one for an unknown model); returns
    the time the first one started."""
    started = time.monotonic()
    headers = {"authorization": f"Bearer {APP}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        for i, request_id in enumerate(SENT[:4]):  # SENT[5] is sent later
            prompt = (SHARED if i >= 2 else "") + f"Say hello number {i}."
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 6,
                "temperature": 0,
                "stream": i < 2,
            }
            answer = client.post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})
            assert answer.status_code == 200, answer.text
        unknown = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answer = client.post("/v1/chat/completions", json=unknown, headers={"x-request-id": SENT[4]})
        assert answer.status_code == 404
    return started


def _engine_url(stack: Serve) -> str:
    match = re.search(r"--upstream (http://127\.0\.0\.1:\d+)", stack.output.read_text(errors="replace"))
    assert match, stack.output.read_text()[-2000:]
    return match.group(1)


def test_the_console_shows_what_the_gateway_and_the_engine_report(stack: Serve, browser: Any) -> None:
    started = _send(stack.url)
    browser.get(stack.url + "/console")
    _wait(browser, lambda d: d.find_element(*_by("#tile-requests .value")).text == "5", what="5 requests")
    _check_charts(stack, browser, started)
    _check_a_series_that_joins_later(stack, browser)
    _screenshot(browser, "console-overview.png")
    _check_request_table(stack, browser)
    _check_request_page(stack, browser)
    _check_health(stack, browser)
    problems = [
        e["message"]
        for e in browser.get_log("browser")
        if "Content Security Policy" in e["message"] or "Uncaught" in e["message"]
    ]
    assert problems == []


def _check_charts(stack: Serve, browser: Any, started: float) -> None:
    data = browser.execute_script(CHART_DATA)
    gateway = _metrics(stack.url, ADMIN)
    assert time.monotonic() - started < 55, "the quantiles' one-minute window no longer holds every request"
    charts, dt = data["charts"], dict(zip(data["t"], data["dt"], strict=True))
    # rates: their points add up to the counters of /metrics
    assert _total(gateway, "kvscope_gateway_requests_total") == 5
    assert round(_integral(charts["traffic"], "requests_per_s", dt)) == 5
    output = _total(gateway, "kvscope_gateway_tokens_total", type="output")
    logged = sum(r["gen_ai"]["usage"]["output_tokens"] or 0 for r in read_records(stack.log_file))
    assert output == logged > 0 and round(_integral(charts["traffic"], "output_tokens_per_s", dt)) == output
    assert _total(gateway, "kvscope_gateway_requests_total", status="404") == 1
    assert sorted(charts["errors"]) == ["__t", "errors_per_s/404"]
    assert round(_integral(charts["errors"], "errors_per_s/404", dt)) == 1
    # quantiles over the last minute: histogram_quantile of the page's buckets (every request is in it)
    for chart, name in (("ttft", "time_to_first_token_seconds"), ("tpot", "time_per_output_token_seconds")):
        for q in (50, 99):
            latest = charts[chart][f"{chart}_p{q}_s"][-1]
            assert latest == _quantile(q / 100, gateway, "kvscope_gateway_" + name), (chart, q)
            assert latest is not None and latest > 0
    cached = _total(gateway, "kvscope_gateway_cached_tokens_total")
    prompt = _total(gateway, "kvscope_gateway_tokens_total", type="input")
    assert charts["prefix"]["prefix_cache_hit_ratio"][-1] == cached / prompt and cached > 0
    # per replica: the engine's own gauges, once the gateway's scraper has sampled it idle
    engine_url = _engine_url(stack)
    label = engine_url.removeprefix("http://")

    def replica_values() -> tuple[list[float | None], list[float]]:
        now = browser.execute_script(CHART_DATA)["charts"]
        engine = _metrics(engine_url)
        shown = [
            now[c][f"{g}/{label}"][-1]
            for c, g in (("kv", "kv_usage"), ("waiting", "waiting"), ("running", "running"))
        ]
        truth = [
            _total(engine, "kvscope_engine_kv_cache_usage_ratio"),
            _total(engine, "kvscope_engine_requests_waiting"),
            _total(engine, "kvscope_engine_requests_running"),
        ]
        return shown, truth

    _wait(browser, lambda d: (v := replica_values())[0] == v[1], timeout=30, what="the engine's gauges")


PAGE_DATA = "const d = window.kvscopeConsole.data; return {t: d.t, dt: d.dt, series: d.series};"


def _check_a_series_that_joins_later(stack: Serve, browser: Any) -> None:
    """A request with an unknown key (401) while the page is open: its error line joins the errors chart, 0
    before it, and every column the page has put together from its polls equals the gateway's whole answer
    (``/console/api/overview`` without ``since``) over the same ticks."""
    answer = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"authorization": "Bearer sk-kvs-not-a-key", "x-request-id": SENT[5]},
    )
    assert answer.status_code == 401
    _wait(browser, lambda d: d.find_element(*_by("#tile-requests .value")).text == "6", what="6 requests")
    _wait(
        browser,
        lambda d: "401" in d.execute_script(PAGE_DATA)["series"]["errors_per_s"],
        what="the 401 in the page's data",
    )
    page = browser.execute_script(PAGE_DATA)
    whole = httpx.get(stack.url + "/console/api/overview", headers={"authorization": f"Bearer {ADMIN}"})
    full, n = whole.json(), len(page["t"])
    assert (full["t"][:n], full["dt"][:n]) == (page["t"], page["dt"])
    expected: dict[str, Any] = {}
    for key, col in full["series"].items():
        if isinstance(col, list):
            expected[key] = col[:n]
        else:  # a member the page has, or one with a value in its ticks (a rate's member shows once not 0)
            group = page["series"].get(key, {})
            expected[key] = {m: c[:n] for m, c in col.items() if m in group or any(c[:n])}
    assert page["series"] == expected
    errors = page["series"]["errors_per_s"]
    assert sorted(errors) == ["401", "404"]
    assert errors["401"][0] is None and errors["401"][1:].count(0) == n - 2  # one tick with the 401
    assert round(sum(v * (dt or 0.0) for v, dt in zip(errors["401"], page["dt"], strict=True) if v)) == 1


def _check_request_table(stack: Serve, browser: Any) -> None:
    browser.find_element(*_by("nav a[data-page=requests]")).click()
    ids = _wait(
        browser,
        lambda d: (
            len(r := d.find_elements(*_by("#rows tbody tr"))) == len(SENT)
            and [row.get_attribute("data-request-id") for row in r]
        ),
        what=f"{len(SENT)} rows",
    )
    assert sorted(ids) == SENT
    _screenshot(browser, "console-requests.png")
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(*_by("select[name=status]"))).select_by_value("404")
    _wait(
        browser,
        lambda d: (
            [r.get_attribute("data-request-id") for r in d.find_elements(*_by("#rows tbody tr"))] == [SENT[4]]
        ),
        what="the 404 alone",
    )
    assert browser.current_url.endswith("/console/requests?status=404")
    (refused,) = [r for r in read_records(stack.log_file) if r["http"]["request"]["id"] == SENT[4]]
    cell = _by(f"tr[data-request-id='{SENT[4]}'] td:nth-child(5)")
    status = _wait(
        browser, lambda d: ((c := d.find_element(*cell)).text, c.get_attribute("title")), what="its status"
    )
    assert status == ("404", refused["error"]["type"])


def _check_request_page(stack: Serve, browser: Any) -> None:
    (record,) = [r for r in read_records(stack.log_file) if r["http"]["request"]["id"] == SENT[0]]
    browser.get(stack.url + "/console/requests")
    row_link = _by(f"tr[data-request-id='{SENT[0]}'] a")
    _wait(browser, lambda d: d.find_element(*row_link).click() or True, what="its row")
    _wait(browser, lambda d: d.find_elements(*_by("#waterfall .wf-row")), what="the waterfall")
    shown = {
        row.get_attribute("data-field"): float(row.get_attribute("data-seconds"))
        for row in browser.find_elements(*_by("#waterfall .wf-row"))
    }
    expected: dict[str, float] = {"kvscope.e2e_s": record["kvscope"]["e2e_s"]}
    expected |= {f"kvscope.gateway.{k}": v for k, v in record["kvscope"]["gateway"].items()}
    expected |= {
        f"kvscope.engine.{k}": record["kvscope"]["engine"][k] for k in ("queue_s", "prefill_s", "decode_s")
    }
    assert shown == expected
    assert browser.find_element(*_by("#why")).text == explain(record).text
    assert browser.find_element(*_by("#request-id")).text == SENT[0]
    trace_id = record["trace"]["id"]
    link = browser.find_element(*_by("#trace-link"))
    assert (link.text, link.get_attribute("href")) == (trace_id, TRACE_URL.replace("{trace_id}", trace_id))
    _screenshot(browser, "console-request.png")


def _check_health(stack: Serve, browser: Any) -> None:
    browser.find_element(*_by("nav a[data-page=health]")).click()
    states = _wait(
        browser,
        lambda d: {
            (r.get_attribute("data-alert"), r.get_attribute("data-state"))
            for r in d.find_elements(*_by("#alerts tbody tr"))
        },
        what="the alert table",
    )
    assert ("KvscopeUpstreamDown", "ok") in states and ("KvscopeNoHealthyUpstream", "ok") in states
    assert ("KvscopeTargetDown", "not_evaluated") in states
    assert not {s for _, s in states} & {"firing", "pending"}
    replicas = _wait(browser, lambda d: [r.text for r in d.find_elements(*_by("#replicas tbody tr"))] or None)
    assert len(replicas) == 1 and "healthy" in replicas[0]
    _screenshot(browser, "console-health.png")
