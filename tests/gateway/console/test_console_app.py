"""The console's API through the in-process gateway (gateway/console/routes.py, access.py): who may see it,
the login session, what it shows against ``/metrics`` and the request log, and that an open console leaves
no trace in either."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from kvscope.gateway.app import create_app
from kvscope.gateway.auth import hash_key
from kvscope.gateway.console.records import RecordFilter
from kvscope.gateway.console.routes import OVERVIEW_BODIES, REQUESTS_BODIES
from kvscope.gateway.logs.why import explain
from kvscope.gateway.settings import load_settings
from kvscope.testing.harness import GatewayThread, LoopThread, metric_samples, read_log, start_fake_thread

ADMIN, APP = "sk-console-admin", "sk-console-app"
STATIC = Path(__file__).resolve().parents[3] / "gateway" / "console" / "static"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.stop()


def _gateway(loop: LoopThread, tmp: Path, **config: Any) -> tuple[GatewayThread, Any]:
    fake = start_fake_thread(loop, ("fake-model",))
    base = {"upstreams": [{"url": fake.url}], "logs": {"file": str(tmp / "requests.jsonl")}}
    return GatewayThread(create_app(load_settings(None, {**base, **config}, env={}))), fake


@pytest.fixture(scope="module")
def keyed(loop: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, Path]]:
    tmp = tmp_path_factory.mktemp("console")
    gateway, fake = _gateway(
        loop,
        tmp,
        api_keys=[
            {"name": "ops", "sha256": hash_key(ADMIN), "admin": True},
            {"name": "app", "sha256": hash_key(APP)},
        ],
        console={"trace_url": "http://jaeger.example/trace/{trace_id}"},
    )
    with gateway:
        yield gateway, tmp / "requests.jsonl"
    loop.run(fake.close())


def _error(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_only_admin_keys_see_the_console_api(keyed: tuple[GatewayThread, Path]) -> None:
    url = keyed[0].url
    assert _error(httpx.get(url + "/console/api/health")) == (401, "console_login_required")
    not_admin = httpx.get(url + "/console/api/health", headers={"authorization": f"Bearer {APP}"})
    assert _error(not_admin) == (403, "console_admin_required")
    assert not_admin.json()["error"]["type"] == "permission_error"
    assert _error(httpx.get(url + "/console/api/health", headers={"authorization": "Bearer nope"})) == (
        401,
        "invalid_api_key",
    )
    assert (
        httpx.get(url + "/console/api/health", headers={"authorization": f"Bearer {ADMIN}"}).status_code
        == 200
    )
    # the page itself holds no data: it loads, and asks for a login
    page = httpx.get(url + "/console/requests/anything")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"].startswith("default-src 'self'; script-src 'self';")


def test_the_login_sets_an_httponly_session_cookie_and_logout_ends_it(
    keyed: tuple[GatewayThread, Path],
) -> None:
    url = keyed[0].url + "/console/api/session"
    assert _error(httpx.post(url, json={"key": APP})) == (403, "console_admin_required")
    assert _error(httpx.post(url, json={"key": "sk-wrong"})) == (401, "invalid_api_key")
    assert _error(httpx.post(url, content=b"{nope")) == (400, "invalid_json")
    assert _error(httpx.post(url, json={"password": ADMIN})) == (400, "invalid_value")
    login = httpx.post(url, json={"key": ADMIN})
    assert login.json() == {"auth": True, "viewer": "ops", "log_content": False}
    cookie = login.headers["set-cookie"]
    token = login.cookies["kvscope_console"]
    assert ADMIN not in cookie and len(token) == 43
    # no Secure over plain HTTP
    assert cookie == f"kvscope_console={token}; HttpOnly; Max-Age=43200; Path=/console; SameSite=strict"
    with httpx.Client(base_url=keyed[0].url, cookies={"kvscope_console": token}) as browser:
        assert browser.get("/console/api/session").json()["viewer"] == "ops"
        assert browser.delete("/console/api/session").status_code == 200
    after = httpx.get(keyed[0].url + "/console/api/session", cookies={"kvscope_console": token})
    assert _error(after) == (401, "console_login_required")


def _until(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


def test_what_the_console_shows_is_what_metrics_and_the_log_say(keyed: tuple[GatewayThread, Path]) -> None:
    gateway, log = keyed
    admin = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN}"})
    app = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {APP}"})
    sent = ["c-1", "c-2", "c-3"]
    for i, request_id in enumerate(sent):
        body = {**CHAT, "stream": i == 0} if i < 2 else {**CHAT, "model": "nope"}
        app.post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})
    for _ in range(5):  # the console's own calls are not observed
        admin.get("/console/api/overview")
        admin.get("/console/static/console.js")
    overview = _until(
        lambda: (o := admin.get("/console/api/overview").json())["totals"]["requests"] == 3 and o
    )
    samples = metric_samples(admin.get("/metrics").text)

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, lb), v in samples.items() if n == name and labels.items() <= dict(lb).items())

    totals = overview["totals"]
    assert totals["requests"] == total("kvscope_gateway_requests_total") == 3
    assert totals["by_status"] == {"200": 2.0, "404": 1.0}
    assert totals["output_tokens"] == total("kvscope_gateway_tokens_total", type="output") == 6
    assert totals["errors"] == 1
    assert overview["interval_s"] == 2.0 and overview["history_s"] == 3600.0 and overview["window_s"] == 60.0
    assert [r["label"] for r in overview["replicas"]] == [gateway.state.pool.replicas[0].label]
    newer = admin.get("/console/api/overview", params={"since": overview["t"][-1]}).json()
    assert all(t > overview["t"][-1] for t in newer["t"])

    records = read_log(log, 3)
    assert sorted(r["http"]["request"]["id"] for r in records) == sent  # nothing of the console's
    rows = admin.get("/console/api/requests").json()
    assert [r["request_id"] for r in rows["rows"]] == sent[::-1]
    assert (rows["kept"], rows["capacity"]) == (3, 1000)
    assert [r["request_id"] for r in admin.get("/console/api/requests?status=404").json()["rows"]] == ["c-3"]
    assert admin.get("/console/api/requests?status=2xx&limit=1").json()["rows"][0]["request_id"] == "c-2"
    assert _error(admin.get("/console/api/requests?status=abc")) == (400, "invalid_value")
    assert _error(admin.get("/console/api/requests?slower_than=fast")) == (400, "invalid_value")
    assert _error(admin.get("/console/api/requests?limit=0")) == (400, "invalid_value")

    (line,) = [r for r in records if r["http"]["request"]["id"] == "c-1"]
    detail = admin.get(f"/console/api/requests/{line['event']['id']}").json()
    assert detail["record"] == line
    shown = {row["field"]: row["seconds"] for row in detail["waterfall"]}
    assert shown["kvscope.e2e_s"] == line["kvscope"]["e2e_s"]
    assert {k: v for k, v in shown.items() if k.startswith("kvscope.gateway.")} == {
        f"kvscope.gateway.{k}": v for k, v in line["kvscope"]["gateway"].items()
    }
    assert detail["why"]["text"] == explain(line).text
    assert detail["trace"] == {
        "id": line["trace"]["id"],
        "url": f"http://jaeger.example/trace/{line['trace']['id']}",
    }
    assert "input" not in line["gen_ai"]  # logs.log_content is off: no prompt anywhere
    assert _error(admin.get("/console/api/requests/nope")) == (404, "not_found")
    (refused,) = [r for r in records if r["http"]["request"]["id"] == "c-3"]
    assert admin.get(f"/console/api/requests/{refused['event']['id']}").json()["why"] == {
        "error": "the record has no kvscope.engine attribution: the request was refused before the engine, "
        "the client left before the engine answered, or an older engine served it"
    }
    health = admin.get("/console/api/health").json()
    down = [a for a in health["alerts"] if a["alert"] == "KvscopeUpstreamDown"]
    assert [(a["state"], a["value"]) for a in down] == [("ok", 1.0)]


@pytest.mark.parametrize(
    "query",
    [
        "requests?limit=nan",
        "requests?limit=inf",
        "requests?limit=1e400",
        "requests?slower_than=nan",
        "requests?slower_than=inf",
        "overview?since=nan",
        "overview?since=-inf",
    ],
)
def test_a_number_parameter_that_is_not_finite_is_a_400(
    keyed: tuple[GatewayThread, Path], query: str
) -> None:
    """``limit=nan`` made ``int()`` raise (a 500); every number a console endpoint reads must be finite."""
    gateway, _ = keyed
    admin = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN}"})
    name = query.split("?")[1].split("=")[0]
    response = admin.get(f"/console/api/{query}")
    assert (response.status_code, response.json()["error"]["param"]) == (400, name)


def test_static_files_are_the_packages(keyed: tuple[GatewayThread, Path]) -> None:
    url = keyed[0].url + "/console/static/"
    for name, media in (
        ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
        ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
        ("vendor/LICENSE", "text/plain; charset=utf-8"),
        ("console.js", "text/javascript; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ):
        answer = httpx.get(url + name)
        assert (answer.status_code, answer.headers["content-type"]) == (200, media)
        assert answer.content == (STATIC / name).read_bytes()
    assert _error(httpx.get(url + "nope.js")) == (404, "not_found")
    assert httpx.get(url + "../routes.py").status_code == 404
    assert _error(httpx.post(url + "console.js")) == (405, "method_not_allowed")


def test_without_keys_the_console_is_open_and_it_can_be_turned_off(loop: LoopThread, tmp_path: Path) -> None:
    gateway, fake = _gateway(loop, tmp_path)
    with gateway:
        assert httpx.get(gateway.url + "/console/api/session").json() == {
            "auth": False,
            "viewer": "anonymous",
            "log_content": False,
        }
        assert httpx.get(gateway.url + "/console/api/requests").json()["rows"] == []
    off, fake_off = _gateway(loop, tmp_path / "off", console={"enabled": False})
    (tmp_path / "off").mkdir()
    with off:
        assert off.app.state.console is None
        assert _error(httpx.get(off.url + "/console")) == (404, "not_found")
        (record,) = read_log(tmp_path / "off" / "requests.jsonl", 1)
        assert record["url"]["path"] == "/console"  # an ordinary unknown path: observed
    for f in (fake, fake_off):
        loop.run(f.close())


def test_keys_create_admin_makes_a_key_that_opens_the_console(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from kvscope.gateway.auth import Authenticator
    from kvscope.gateway.cli import keys_main
    from kvscope.gateway.settings import KeyLimits

    assert keys_main(["create", "--name", "ops", "--admin"]) == 0
    out = capsys.readouterr()
    key, line = out.out.splitlines()
    (entry,) = yaml.safe_load(line)
    assert entry == {"name": "ops", "sha256": hash_key(key), "admin": True}
    assert out.err.endswith("# (no --api-key-hash form: that flag cannot carry admin)\n")
    settings = load_settings(None, {"upstreams": [{"url": "http://a"}], "api_keys": [entry]}, env={})
    assert Authenticator(settings.api_keys, KeyLimits()).authenticate(f"Bearer {key}").admin is True
    assert (
        settings.api_keys[0].admin
        and not load_settings(
            None, {"upstreams": [{"url": "http://a"}], "api_keys": [{**entry, "admin": False}]}, env={}
        )
        .api_keys[0]
        .admin
    )


def test_the_polls_between_two_ticks_get_the_same_encoded_answer() -> None:
    console = create_app(load_settings(None, {"upstreams": [{"url": "http://a"}]}, env={})).state.console
    console.sampler.tick(now=10.0, wall=1000.0)
    first = console.overview_body(None)
    assert console.overview_body(None) is first  # not encoded again
    assert msgspec.json.decode(first)["t"] == [1000.0]
    assert msgspec.json.decode(console.overview_body(1000.0))["t"] == []
    console.sampler.tick(now=12.0, wall=1002.0)
    assert msgspec.json.decode(console.overview_body(1000.0))["t"] == [1002.0]  # a new tick: a new answer
    assert msgspec.json.decode(console.overview_body(None))["t"] == [1000.0, 1002.0]
    for since in range(20):  # whatever a client asks, at most OVERVIEW_BODIES answers are kept
        console.overview_body(float(since))
    assert len(console.overview_bodies) == OVERVIEW_BODIES == 8


def test_request_list_polls_between_two_records_get_the_same_encoded_answer() -> None:
    console = create_app(load_settings(None, {"upstreams": [{"url": "http://a"}]}, env={})).state.console
    ring = console.records

    def record(i: int, model: str) -> dict:
        return {
            "event": {"id": f"e{i}"},
            "http": {"request": {"id": f"r{i}"}, "response": {"status_code": 200}},
            "gen_ai": {"request": {"model": model}},
        }

    ring.emit(record(1, "a"))
    ring.emit(record(2, "b"))
    every, only_a = RecordFilter(), RecordFilter(model="a")
    first = console.requests_body(every, 1000)
    assert console.requests_body(every, 1000) is first  # not built again
    assert [r["request_id"] for r in msgspec.json.decode(first)["rows"]] == ["r2", "r1"]
    assert [r["request_id"] for r in msgspec.json.decode(console.requests_body(only_a, 1000))["rows"]] == [
        "r1"
    ]
    assert [r["request_id"] for r in msgspec.json.decode(console.requests_body(every, 1))["rows"]] == ["r2"]
    ring.emit(record(3, "a"))  # a new record: new answers
    assert [r["request_id"] for r in msgspec.json.decode(console.requests_body(only_a, 1000))["rows"]] == [
        "r3",
        "r1",
    ]
    for limit in range(1, 40):  # whatever clients ask, at most REQUESTS_BODIES answers are kept
        console.requests_body(every, limit)
    assert len(console.requests_bodies) == REQUESTS_BODIES == 16


def test_rate_limit_refusals_and_content_logging(loop: LoopThread, tmp_path: Path) -> None:
    """A refusal by a key's limit is in the overview as ``/metrics`` counts it (totals and the refusals chart,
    whose rate over its ticks adds up to the counter); with ``logs.log_content`` on, a request's page shows
    its prompt and the list still never does."""
    gateway, fake = _gateway(
        loop,
        tmp_path,
        api_keys=[
            {"name": "ops", "sha256": hash_key(ADMIN), "admin": True},
            {"name": "app", "sha256": hash_key(APP), "limits": {"requests_per_minute": 1}},
        ],
        logs={"file": str(tmp_path / "requests.jsonl"), "log_content": True},
    )
    with gateway:
        app = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {APP}"})
        admin = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN}"})
        codes = [app.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)]
        assert codes == [200, 429]
        samples = metric_samples(admin.get("/metrics").text)
        by_reason = {
            dict(lb)["reason"]: v
            for (n, lb), v in samples.items()
            if n == "kvscope_gateway_rate_limited_total"
        }
        assert by_reason["requests"] == 1.0 and sum(by_reason.values()) == 1.0
        overview = _until(
            lambda: (o := admin.get("/console/api/overview").json())["totals"]["requests"] == 2 and o
        )
        assert overview["totals"]["rate_limited"] == by_reason
        refusals = overview["series"]["rate_limited_per_s"]
        assert sorted(refusals) == ["requests"]  # the limits that never refused draw no line
        assert (
            round(sum(v * dt for v, dt in zip(refusals["requests"], overview["dt"], strict=True) if dt), 9)
            == 1.0
        )
        assert admin.get("/console/api/session").json()["log_content"] is True
        rows = admin.get("/console/api/requests").json()["rows"]
        assert [r["status"] for r in rows] == [429, 200]
        assert all("input" not in r and "output" not in r and "a b c" not in str(r) for r in rows)
        detail = admin.get(f"/console/api/requests/{rows[1]['event_id']}").json()
        (message,) = detail["record"]["gen_ai"]["input"]["messages"]
        assert message["parts"] == [{"type": "text", "content": "a b c"}]
    loop.run(fake.close())
