"""Replicas that come and go, with real processes: the gateway finds stub upstreams through a real DNS server
(Debian's dnsmasq, serving a hosts file it re-reads on SIGHUP) while a steady stream of concurrent requests,
streaming and not, runs through it: a replica added to the name gets traffic; one removed finishes the streams
it holds and gets nothing new; every request succeeds. And the config file's ``upstreams`` reloaded live.

The stub upstreams of one DNS name share a port on 127.0.0.2, .3, .4 (every 127/8 address is loopback on
Linux), as a headless Service's pods share their container port."""

from __future__ import annotations

import itertools
import json
import os
import pwd
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dns.exception
import dns.nameserver
import dns.resolver
import httpx
import pytest
import yaml

from kvscope.testing.harness import Proc, free_port, spawn, sse_events, wait_http
from kvscope.testing.wait import wait_until as poll
from tests.conftest import require_tool

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
NAME = "engines.test"
CHAT = "/v1/chat/completions"
TOKENS = 4
TEXT = "".join(f"t{i} " for i in range(TOKENS))  # the stub's completion of max_tokens=4
DEADLINE_S = 60.0


def wait_until(what: str, check: Callable[[], Any], log: Path | None = None) -> Any:
    """Poll ``check`` until it returns something truthy (a test of state, not of time: the deadline only
    keeps a broken run from hanging)."""
    try:
        return poll(check, DEADLINE_S, f"never happened: {what}", interval_s=0.05)
    except AssertionError as exc:
        tail = log.read_text(errors="replace")[-3000:] if log else ""
        raise AssertionError(f"{exc}\n{tail}") from None


# --- processes ----------------------------------------------------------------------------------------------
def dnsmasq_path() -> str:
    """dnsmasq lives in /usr/sbin, which a non-root PATH may lack."""
    found = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
    return found or require_tool("dnsmasq")


@dataclass
class DnsServer:
    proc: Proc
    hosts: Path

    def serve(self, *addresses: str) -> None:
        """Make ``NAME`` resolve to ``addresses`` (A records) from now on."""
        replace(self.hosts, "".join(f"{a} {NAME}\n" for a in addresses))
        self.proc.popen.send_signal(signal.SIGHUP)  # dnsmasq re-reads --addn-hosts files


def start_dns(tmp: Path, *addresses: str) -> DnsServer:
    hosts = tmp / "hosts"
    hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))
    port = free_port()
    args = [
        dnsmasq_path(),
        "--no-daemon",
        "--conf-file=/dev/null",  # not the system's /etc/dnsmasq.conf
        "--no-resolv",
        "--no-hosts",
        f"--addn-hosts={hosts}",
        "--local=/test/",  # names under .test: the hosts file or NXDOMAIN, never forwarded
        "--listen-address=127.0.0.1",
        "--bind-interfaces",
        f"--port={port}",
        "--pid-file=",  # none
        "--log-facility=-",
    ]
    if os.geteuid() == 0:  # dnsmasq would switch to user nobody, who cannot read pytest's tmp folder
        args.append(f"--user={pwd.getpwuid(0).pw_name}")
    server = DnsServer(spawn(args, port, tmp / "dnsmasq.log"), hosts)
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", port)]
    resolver.lifetime = 0.5

    def answers() -> bool:
        assert server.proc.popen.poll() is None, server.proc.log.read_text()
        try:
            return len(resolver.resolve(NAME, "A")) == len(addresses)
        except dns.exception.DNSException:
            return False

    wait_until("dnsmasq answers", answers, server.proc.log)
    return server


def spawn_stub(tmp: Path, host: str, port: int) -> Proc:
    args = [sys.executable, "-P", "-m", "kvscope.testing.fake_upstream", "--host", host, "--port", str(port)]
    proc = spawn([*args, "--token-delay-s", "0.02"], port, tmp / f"stub-{host}.log")
    wait_http(f"http://{host}:{port}/health", proc=proc.popen)
    return proc


def spawn_gateway(tmp: Path, config: dict[str, Any]) -> tuple[Proc, Path]:
    """The gateway with INFO logs (joins, drains, leaves are INFO lines) and ``config`` in a file."""
    port = free_port()
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump({**config, "port": port}))
    args = [sys.executable, "-P", "-m", "kvscope.gateway", "--config", str(path), "--log-level", "info"]
    proc = spawn(args, port, tmp / "gateway.out")
    wait_http(proc.url + "/readyz", proc=proc.popen)
    return proc, path


def chats(url: str) -> list[dict[str, Any]]:
    return [r for r in httpx.get(url + "/_fake/requests").json() if r["path"] == CHAT]


# --- the load -----------------------------------------------------------------------------------------------
@dataclass
class Load:
    """``workers`` threads sending chat requests back to back through the gateway, every other one
    streamed; each result is (status, complete): complete = the stub's whole completion arrived (a stream
    to its ``[DONE]`` without an error event)."""

    url: str
    workers: int = 6
    results: list[tuple[int, bool]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                i = next(self._ids)
                body = {  # a prompt of its own: no shared prefix pins the load on one replica
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": f"{i} load"}],
                    "max_tokens": TOKENS,
                    "stream": i % 2 == 0,
                }
                self.results.append(send(client, body))


def send(client: httpx.Client, body: dict[str, Any]) -> tuple[int, bool]:
    if not body.get("stream"):
        resp = client.post(CHAT, json=body)
        complete = resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == TEXT
        return resp.status_code, complete
    with client.stream("POST", CHAT, json=body) as resp:
        events = sse_events(resp.read())
    deltas = [e for e in events if e != "[DONE]"]
    text = "".join(c["delta"].get("content") or "" for e in deltas for c in json.loads(e)["choices"])
    return resp.status_code, events[-1:] == ["[DONE]"] and text == TEXT


def assert_all_succeeded(load: Load) -> None:
    assert len(load.results) > 0
    assert [r for r in load.results if r != (200, True)] == []


# --- DNS ----------------------------------------------------------------------------------------------------
@pytest.fixture
def stubs(tmp_path: Path) -> Iterator[dict[str, Proc]]:
    port = free_port()
    procs: dict[str, Proc] = {}
    try:
        for host in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            procs[host] = spawn_stub(tmp_path, host, port)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def test_dns_discovery_adds_and_drains_replicas_under_load(tmp_path: Path, stubs: dict[str, Proc]) -> None:
    a, b, c = stubs
    port = stubs[a].port
    url = {host: f"http://{host}:{port}" for host in stubs}
    dns_server = start_dns(tmp_path, a, b)
    gateway: Proc | None = None
    try:
        gateway, _ = spawn_gateway(
            tmp_path,
            {
                "discovery": {
                    "interval_s": 0.1,
                    "config_reload": False,
                    "dns": [{"name": NAME, "port": port, "models": ["fake-model"]}],
                    "nameservers": [f"127.0.0.1:{dns_server.proc.port}"],
                },
                # no health round would add a replica before the test ends: it joins by its own probe
                "routing": {"health_interval_s": 3600},
            },
        )
        log = gateway.log
        assert f"upstream {a}:{port} joined (dns:{NAME})" in log.read_text()
        with Load(gateway.url) as load, httpx.Client(base_url=gateway.url, timeout=30) as client:
            wait_until("both replicas serve", lambda: chats(url[a]) and chats(url[b]), log)
            # a replica joins the name: it gets traffic without a restart
            dns_server.serve(a, b, c)
            wait_until(f"{c} serves", lambda: len(chats(url[c])) >= 3, log)
            # streams held open on the replicas (each token waits for its gate)
            held: list[tuple[int, bool]] = []
            threads = [
                threading.Thread(target=lambda k=k: held.append(send(client, _held_body(k))), daemon=True)
                for k in range(6)
            ]
            for thread in threads:
                thread.start()
            where = wait_until("six held streams reach the replicas", lambda: _held_at(url), log)
            victim = max(where, key=lambda host: len(where[host]))
            kept = [host for host in stubs if host != victim]
            # the victim leaves the name while it holds streams: it drains
            dns_server.serve(*kept)
            line = wait_until(
                f"{victim} drains",
                lambda: re.search(
                    rf"upstream {re.escape(victim)}:{port} draining \(dns:{re.escape(NAME)} no longer lists "
                    r"it\): (\d+) requests in flight",
                    log.read_text(),
                ),
                log,
            )
            in_flight = int(line.group(1))
            assert in_flight >= len(where[victim])
            seen = len(chats(url[victim]))
            others = sum(len(chats(url[h])) for h in kept)
            # the load goes on, on the others only: the victim gets nothing but what it had in flight
            wait_until("20 more requests", lambda: sum(len(chats(url[h])) for h in kept) >= others + 20, log)
            assert len(chats(url[victim])) - seen <= in_flight - len(where[victim])
            assert f"upstream {victim}:{port} left" not in log.read_text()  # its held streams still run
            for host in stubs:  # the held streams finish, the victim's among them
                for k in range(6):
                    for i in range(TOKENS):
                        httpx.post(url[host] + "/_fake/release", json={"name": f"held{k}/{i}"})
            for thread in threads:
                thread.join(30)
            assert held == [(200, True)] * 6
            wait_until(f"{victim} leaves", lambda: f"upstream {victim}:{port} left" in log.read_text(), log)
            gone = len(chats(url[victim]))
            others = sum(len(chats(url[h])) for h in kept)
            wait_until("20 more requests", lambda: sum(len(chats(url[h])) for h in kept) >= others + 20, log)
            assert len(chats(url[victim])) == gone
        assert_all_succeeded(load)
        metrics = httpx.get(gateway.url + "/metrics").text
        assert f'upstream="{victim}:{port}"' not in metrics  # its series left with it
        assert all(
            f'kvscope_gateway_upstream_up{{kind="kvscope",upstream="{h}:{port}"}} 1.0' in metrics
            for h in kept
        )
        assert f'kvscope_gateway_discovery_errors_total{{source="dns:{NAME}"}} 0.0' in metrics
    finally:
        if gateway is not None:
            gateway.stop()
        dns_server.proc.stop()


def _held_body(k: int) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"held {k}"}],
        "max_tokens": TOKENS,
        "stream": True,
        "fake": {"hold": f"held{k}"},
    }


def _held_at(url: dict[str, str]) -> dict[str, list[str]] | None:
    """Replica → the held streams it serves, once all six arrived somewhere."""
    where = {
        host: [r["body"]["fake"]["hold"] for r in chats(u) if "fake" in r["body"] and not r["completed"]]
        for host, u in url.items()
    }
    return where if sum(map(len, where.values())) == 6 else None


# --- the config file ----------------------------------------------------------------------------------------
def replace(path: Path, text: str) -> None:
    """Write ``path`` atomically (a rename, as a Kubernetes ConfigMap volume does): the gateway never reads it
    half written."""
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    tmp.replace(path)


def test_config_reload_adds_a_replica_under_load(tmp_path: Path) -> None:
    port = free_port()
    first, second = spawn_stub(tmp_path, "127.0.0.1", port), spawn_stub(tmp_path, "127.0.0.1", free_port())
    gateway: Proc | None = None
    try:
        config = {
            "upstreams": [{"url": first.url}],
            "discovery": {"interval_s": 0.1},  # config_reload: on by default
            "routing": {"health_interval_s": 3600},
        }
        gateway, path = spawn_gateway(tmp_path, config)
        log = gateway.log

        def write(**changes: Any) -> None:
            replace(path, yaml.safe_dump({**config, "port": gateway.port, **changes}))

        with Load(gateway.url, workers=4) as load:
            wait_until("the first replica serves", lambda: chats(first.url), log)
            write(upstreams=[{"url": first.url}, {"url": second.url}])
            wait_until("the second replica serves", lambda: len(chats(second.url)) >= 3, log)
            replace(path, "upstreams: [{url: ")  # broken: the running set stays
            wait_until("the error is logged", lambda: "no longer loads" in log.read_text(), log)
            write(upstreams=[{"url": second.url}], metrics_public=True)
            wait_until(
                "the first replica leaves", lambda: f"upstream {first.url[7:]} left" in log.read_text(), log
            )
            served = len(chats(first.url))
            before = len(chats(second.url))
            wait_until("20 more requests", lambda: len(chats(second.url)) >= before + 20, log)
            assert len(chats(first.url)) == served
        assert_all_succeeded(load)
        text = log.read_text()
        assert f"config reload: {path} changed metrics_public: restart the gateway to apply" in text
        assert f"discovery: config reload: {path} no longer loads" in text
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'kvscope_gateway_discovery_errors_total{source="config"} 1.0' in metrics
    finally:
        if gateway is not None:
            gateway.stop()
        first.stop()
        second.stop()
