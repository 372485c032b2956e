"""Replicas that come and go, in process: UpstreamPool.set_upstreams (join, keep, drain, leave, return, metric
series), the DNS source's answers and failures through a stub resolver, the config file's reload, and the
discovery settings. The same against a real DNS server and gateway processes: test_discovery_processes.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import dns.exception
import dns.rdata
import dns.resolver
import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvscope.gateway.metrics import UPSTREAM_ERROR_REASONS, GatewayMetrics
from kvscope.gateway.proxy.discovery import ConfigWatch, Discovery, DiscoveryError, DnsWatch
from kvscope.gateway.proxy.upstreams import UpstreamPool
from kvscope.gateway.settings import (
    DiscoveryConfig,
    DnsDiscoveryConfig,
    SettingsSource,
    UpstreamConfig,
    load_settings,
    parse_nameserver,
)

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"
UPSTREAM_SERIES = ("kvscope_gateway_upstream_up", "kvscope_gateway_upstream_outstanding_requests")


def _pool(*urls: str) -> tuple[UpstreamPool, CollectorRegistry]:
    registry = CollectorRegistry()
    settings = load_settings(None, {"upstreams": [{"url": u} for u in urls]}, env={})
    return UpstreamPool(
        settings.upstreams, settings.models, settings.routing, GatewayMetrics(registry)
    ), registry


def _configs(*urls: str) -> tuple[UpstreamConfig, ...]:
    return tuple(UpstreamConfig(url=u) for u in urls)


def _series(registry: CollectorRegistry, upstream: str) -> dict[tuple[str, str], float]:
    """``{(sample name, reason or ""): value}`` of every series labelled ``upstream``."""
    return {
        (s.name, s.labels.get("reason", "")): s.value
        for family in registry.collect()
        for s in family.samples
        if s.labels.get("upstream") == upstream and not s.name.endswith("_created")
    }


def _full_series(up: float, outstanding: float) -> dict[tuple[str, str], float]:
    return {
        ("kvscope_gateway_upstream_up", ""): up,
        ("kvscope_gateway_upstream_outstanding_requests", ""): outstanding,
        **{("kvscope_gateway_upstream_errors_total", r): 0.0 for r in UPSTREAM_ERROR_REASONS},
        ("kvscope_gateway_upstream_info", ""): 1.0,
    }


def _healthy(pool: UpstreamPool) -> None:
    for replica in pool.replicas:
        pool._set_health(replica, True)


# --- set_upstreams ----------------------------------------------------------------------------------------
def test_a_url_still_listed_keeps_its_replica_and_a_new_one_joins_unhealthy() -> None:
    pool, registry = _pool(A, B)
    _healthy(pool)
    a, b = pool.replicas
    pool.acquire(a)
    a.cards = {"m": {"id": "m"}}
    joined = pool.set_upstreams("config", _configs(B, A + "/", C))  # a trailing slash is the same URL
    assert [r.url for r in joined] == [C]
    assert pool.replicas[:2] == [a, b] and pool.replicas[0] is a and pool.replicas[1] is b
    assert (a.outstanding, a.healthy, a.cards, a.draining) == (1, True, {"m": {"id": "m"}}, False)
    c = pool.replicas[2]
    assert (c.url, c.healthy, c.outstanding, c.draining, c.sources) == (
        C,
        False,
        0,
        False,
        {"config": c.config},
    )
    assert [r.url for r in pool.candidates(None)] == [A, B]  # no traffic before its first good probe
    assert _series(registry, "127.0.0.1:9003") == _full_series(0, 0)
    assert pool.set_upstreams("config", _configs(A, B, C)) == []  # the same list again: nothing joins


def test_a_removed_replica_drains_and_leaves_with_its_last_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvscope.gateway")
    pool, registry = _pool(A, B)
    _healthy(pool)
    a, b = pool.replicas
    pool.acquire(a)
    pool.acquire(a)
    pool.report_failure(a, "status_5xx", passive=False)
    assert pool.set_upstreams("config", _configs(B)) == []
    assert (a.draining, pool.replicas, pool.candidates(None), pool.candidates("m")) == (True, [a, b], [b], [])
    decision = pool.route(None)
    assert decision is not None and decision.replica is b and pool.ready() == {}
    series = _full_series(1, 2)
    series["kvscope_gateway_upstream_errors_total", "status_5xx"] = 1.0
    assert _series(registry, "127.0.0.1:9001") == series  # its series stay while it drains
    pool.release(a)
    assert pool.replicas == [a, b] and a.outstanding == 1
    pool.release(a)
    assert pool.replicas == [b] and not pool.present(a)
    assert _series(registry, "127.0.0.1:9001") == {}
    assert _series(registry, "127.0.0.1:9002") == _full_series(1, 0)
    assert [m for m in caplog.messages if "9001" in m] == [
        "upstream 127.0.0.1:9001 joined (config)",
        "upstream 127.0.0.1:9001 draining (config no longer lists it): 2 requests in flight",
        "upstream 127.0.0.1:9001 left",
    ]


def test_an_idle_removed_replica_leaves_at_once_and_keeps_no_series_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "kvscope.gateway")
    pool, registry = _pool(A, B)
    a, b = pool.replicas
    pool.set_upstreams("config", _configs(B))
    assert pool.replicas == [b] and a.draining and _series(registry, "127.0.0.1:9001") == {}
    # a request that picked it just before (the pass-through's send, then acquire) and its failures: counted
    # on the replica, never as series again
    pool.acquire(a)
    pool.report_failure(a, "disconnect")
    pool._set_health(a, False)
    pool.release(a)
    assert (a.outstanding, pool.replicas, _series(registry, "127.0.0.1:9001")) == (0, [b], {})
    assert [m for m in caplog.messages if "9001" in m] == [
        "upstream 127.0.0.1:9001 joined (config)",
        "upstream 127.0.0.1:9001 left",
    ]


def test_a_draining_replica_listed_again_returns_with_its_requests(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvscope.gateway")
    pool, registry = _pool(A, B)
    _healthy(pool)
    a, b = pool.replicas
    pool.acquire(a)
    pool.set_upstreams("config", _configs(B))
    assert a.draining and pool.candidates(None) == [b]
    assert pool.set_upstreams("config", _configs(A, B)) == [a]  # returned: probed by the caller
    assert (a.draining, pool.replicas, pool.candidates(None)) == (False, [a, b], [a, b])
    pool.release(a)
    assert pool.replicas == [a, b] and _series(registry, "127.0.0.1:9001") == _full_series(1, 0)
    assert [m for m in caplog.messages if "9001" in m] == [
        "upstream 127.0.0.1:9001 joined (config)",
        "upstream 127.0.0.1:9001 draining (config no longer lists it): 1 requests in flight",
        "upstream 127.0.0.1:9001 returned (config) while draining 1 requests",
    ]


def test_a_replica_that_left_joins_again_as_a_new_replica() -> None:
    pool, registry = _pool(A, B)
    a = pool.replicas[0]
    pool.set_upstreams("config", _configs(B))
    (again,) = pool.set_upstreams("config", _configs(A, B))
    assert again is not a and again.url == A and not again.healthy
    assert _series(registry, "127.0.0.1:9001") == _full_series(0, 0)


def test_a_url_listed_by_two_sources_stays_until_both_drop_it() -> None:
    pool, registry = _pool(A)
    _healthy(pool)
    (a,) = pool.replicas
    named = UpstreamConfig(url=A, name="gpu-a")
    assert pool.set_upstreams("config", (named,)) == [] and a.label == "gpu-a"
    assert _series(registry, "127.0.0.1:9001") == {} and _series(registry, "gpu-a") == _full_series(1, 0)
    assert pool.set_upstreams("dns:engines", _configs(A, B))[0].url == B
    assert (pool.replicas[0] is a, a.label, list(a.sources)) == (True, "gpu-a", ["config", "dns:engines"])
    pool.set_upstreams("config", ())
    assert (pool.replicas[0] is a, a.draining, a.label) == (True, False, "127.0.0.1:9001")  # dns's config now
    assert _series(registry, "gpu-a") == {} and _series(registry, "127.0.0.1:9001") == _full_series(1, 0)
    pool.set_upstreams("dns:engines", ())
    assert pool.replicas == [] and _series(registry, "127.0.0.1:9001") == {}


async def test_draining_replicas_are_not_probed() -> None:
    probed: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        probed.append(str(request.url))
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    pool, _ = _pool(A, B)
    pool.acquire(pool.replicas[0])
    pool.set_upstreams("config", _configs(B))
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await pool.check_all(client)
    assert probed == [B + "/v1/models"]


# --- the DNS source -----------------------------------------------------------------------------------------
class StubResolver:
    """Answers from ``records[(name, rdtype)]``: a list of addresses, or an exception to raise."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str] | Exception] = {}
        self.asked: list[tuple[str, str, bool | None]] = []

    async def resolve(self, qname: str, rdtype: str, *, search: bool | None = None) -> list[Any]:
        self.asked.append((qname, rdtype, search))
        answer = self.records.get((qname, rdtype), dns.resolver.NXDOMAIN())
        if isinstance(answer, Exception):
            raise answer
        return [dns.rdata.from_text("IN", rdtype, address) for address in answer]


ENTRY = DnsDiscoveryConfig(name="engines.test", port=8000, models=("m",), api_key="k")


async def test_a_dns_entry_names_one_upstream_per_a_and_aaaa_record() -> None:
    stub = StubResolver()
    stub.records = {
        ("engines.test", "A"): ["10.0.0.2", "10.0.0.1", "10.0.0.2"],
        ("engines.test", "AAAA"): ["fd00::1"],
    }
    upstreams, failures = await DnsWatch(ENTRY, stub).resolve()
    assert failures == []
    assert upstreams == (
        UpstreamConfig(url="http://10.0.0.1:8000", models=("m",), api_key="k"),
        UpstreamConfig(url="http://10.0.0.2:8000", models=("m",), api_key="k"),
        UpstreamConfig(url="http://[fd00::1]:8000", models=("m",), api_key="k"),
    )
    assert [u.label for u in upstreams] == ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000"]
    assert sorted(stub.asked) == [("engines.test", "A", True), ("engines.test", "AAAA", True)]
    https = DnsDiscoveryConfig(name="engines.test", port=443, scheme="https")
    assert https.upstream("fd00::2") == UpstreamConfig(url="https://[fd00::2]:443")


async def test_a_failed_lookup_keeps_the_last_known_addresses_and_nxdomain_means_none() -> None:
    stub = StubResolver()
    watch = DnsWatch(ENTRY, stub)
    stub.records = {("engines.test", "A"): ["10.0.0.1"], ("engines.test", "AAAA"): ["fd00::1"]}
    await watch.resolve()
    timeout = dns.resolver.LifetimeTimeout(timeout=5.0, errors=[])
    stub.records = {("engines.test", "A"): timeout, ("engines.test", "AAAA"): dns.resolver.NoAnswer()}
    upstreams, failures = await watch.resolve()
    assert [u.url for u in upstreams] == ["http://10.0.0.1:8000"]  # AAAA: none now; A: the last known
    assert failures == [("A", timeout)]
    servfail = dns.resolver.NoNameservers()
    stub.records = {("engines.test", "A"): servfail, ("engines.test", "AAAA"): servfail}
    upstreams, failures = await watch.resolve()
    assert [u.url for u in upstreams] == ["http://10.0.0.1:8000"] and len(failures) == 2
    stub.records = {}  # NXDOMAIN: the name is gone (a Service scaled to zero)
    assert await watch.resolve() == ((), [])


def _samples(registry: CollectorRegistry, name: str) -> dict[str, float]:
    return {s.labels["source"]: s.value for f in registry.collect() for s in f.samples if s.name == name}


async def test_a_discovery_round_adds_probes_and_counts_failures(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvscope.gateway")
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    settings = load_settings(
        None,
        {"discovery": {"dns": [{"name": "engines.test", "port": 8000}], "config_reload": True}},
        env={},
    )
    pool = UpstreamPool(settings.upstreams, settings.models, settings.routing, metrics)
    stub = StubResolver()
    discovery = Discovery(settings, pool, metrics, SettingsSource(None, {}), stub)
    assert discovery.sources == ["dns:engines.test"]  # no config file: nothing to reload
    errors = "kvscope_gateway_discovery_errors_total"
    assert _samples(registry, errors) == {"dns:engines.test": 0.0}
    probed: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        probed.append(str(request.url))
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        stub.records = {("engines.test", "A"): ["10.0.0.1", "10.0.0.2"]}
        await discovery.run_once(client)
        assert probed == ["http://10.0.0.1:8000/v1/models", "http://10.0.0.2:8000/v1/models"]
        assert [(r.url, r.healthy) for r in pool.replicas] == [
            ("http://10.0.0.1:8000", True),
            ("http://10.0.0.2:8000", True),
        ]
        stub.records = {("engines.test", "A"): dns.resolver.NoNameservers()}
        await discovery.run_once(client)
        await discovery.run_once(client)
        assert len(pool.replicas) == 2 and _samples(registry, errors) == {"dns:engines.test": 2.0}
        stub.records = {("engines.test", "A"): ["10.0.0.2"]}
        await discovery.run_once(client)
        assert [r.url for r in pool.replicas] == ["http://10.0.0.2:8000"] and len(probed) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [  # the same failure twice: logged once
        "discovery: resolving engines.test failed (A: NoNameservers: All nameservers failed to answer the "
        "query.); keeping its last known addresses (2 replicas)"
    ]
    assert "discovery: dns:engines.test answers again" in caplog.messages
    assert "upstream 10.0.0.1:8000 left" in caplog.messages


# --- the config file ----------------------------------------------------------------------------------------
async def test_config_reload_applies_upstreams_and_names_other_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps({"upstreams": [{"url": A}]}))
    source = SettingsSource.of(path, {}, env={})
    watch = ConfigWatch(source, source.load())
    assert await watch.poll() == _configs(A)  # the first read: what the gateway runs
    assert await watch.poll() is None  # unchanged
    path.write_text(json.dumps({"upstreams": [{"url": A}, {"url": B}]}))
    assert await watch.poll() == _configs(A, B)
    assert caplog.records == []
    path.write_text(json.dumps({"upstreams": [{"url": B}], "metrics_public": True, "port": 4001}))
    assert await watch.poll() == _configs(B)
    assert caplog.messages == [
        f"config reload: {path} changed port, metrics_public: restart the gateway to apply (only upstreams "
        "apply live)"
    ]
    path.write_text("upstreams: [{url: ")
    with pytest.raises(DiscoveryError, match="no longer loads"):
        await watch.poll()
    assert await watch.poll() is None  # the same broken content: reported once
    path.write_text(json.dumps({"upstreams": [], "metrics_public": True}))
    with pytest.raises(DiscoveryError, match="at least one upstream is required"):
        await watch.poll()
    path.unlink()
    with pytest.raises(DiscoveryError, match="cannot read"):
        await watch.poll()
    assert await watch.poll() is None


async def test_a_flag_given_upstream_wins_over_the_reloaded_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps({"upstreams": [{"url": A}]}))
    source = SettingsSource.of(path, {"upstreams": [{"url": C}]}, env={})
    watch = ConfigWatch(source, source.load())
    path.write_text(json.dumps({"upstreams": [{"url": B}]}))
    assert await watch.poll() == _configs(C)


# --- settings -----------------------------------------------------------------------------------------------
def test_the_discovery_section_in_the_documented_shape() -> None:
    raw = {
        "discovery": {
            "interval_s": 5,
            "config_reload": True,
            "dns": [
                {
                    "name": "kvscope-engine-headless.default.svc.cluster.local",
                    "port": 8000,
                    "scheme": "http",
                    "models": ["smollm2-135m"],
                    "api_key": None,
                }
            ],
            "nameservers": [],
        }
    }
    settings = load_settings(None, raw, env={})  # no upstreams: DNS alone is enough
    assert settings.upstreams == () and settings.discovery == DiscoveryConfig(
        interval_s=5.0,
        dns=(
            DnsDiscoveryConfig(
                name="kvscope-engine-headless.default.svc.cluster.local", port=8000, models=("smollm2-135m",)
            ),
        ),
    )
    assert load_settings(None, {"upstreams": [{"url": A}]}, env={}).discovery == DiscoveryConfig()


@pytest.mark.parametrize(
    ("discovery", "message"),
    [
        ({"interval_s": 0}, "interval_s must be a finite number > 0"),
        ({"dns": [{"name": "x", "port": 8000, "weight": 1}]}, "unknown field `weight`"),
        ({"dns": [{"name": "x", "port": 8000, "scheme": "ftp"}]}, "Invalid enum value 'ftp'"),
        ({"dns": [{"name": "x"}]}, "missing required field `port`"),
        ({"dns": [{"name": "x", "port": 1}, {"name": "x", "port": 2}]}, "names must be unique"),
        ({"nameservers": ["dns.example:53"]}, "expected an IP address"),
        ({"refresh_s": 1}, "unknown field `refresh_s`"),
    ],
)
def test_invalid_discovery_settings_are_refused(discovery: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(None, {"upstreams": [{"url": A}], "discovery": discovery}, env={})


def test_no_upstream_and_no_dns_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one upstream is required"):
        load_settings(None, {"discovery": {"config_reload": True}}, env={})


@pytest.mark.parametrize(
    ("item", "parsed"),
    [
        ("10.96.0.10", ("10.96.0.10", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("fd00::10", ("fd00::10", 53)),
        ("[fd00::10]:5353", ("fd00::10", 5353)),
        ("[::1]", ("::1", 53)),
    ],
)
def test_nameservers_are_addresses_with_an_optional_port(item: str, parsed: tuple[str, int]) -> None:
    assert parse_nameserver(item) == parsed


@pytest.mark.parametrize("item", ["localhost", "127.0.0.1:0", "127.0.0.1:x", "[::1", "[::1]x", ""])
def test_bad_nameservers_are_refused(item: str) -> None:
    with pytest.raises(ValueError, match="nameserver"):
        parse_nameserver(item)
