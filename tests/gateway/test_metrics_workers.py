"""gateway/metrics_workers.py on multiprocess files written the way prometheus_client writes them for two
workers: counters and histograms added up, each gauge by its mode, the per-upstream series of an upstream
that left (or of its old kind) dropped by the answering worker's view, ``process_*`` of the live workers
added up."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from kvscope.gateway.metrics_workers import WorkersCollector, WorkersProcessCollector, worker_pids
from kvscope.testing.harness import metric_samples, sample


def _write(folder: Path, file: str, series: list[tuple[str, str, dict[str, str], float, float]]) -> None:
    """``(metric, sample name, labels, value, timestamp)`` into ``folder/file`` as the library stores them."""
    values = MmapedDict(str(folder / file))
    try:
        for metric, name, labels, value, stamp in series:
            key = mmap_key(metric, name, list(labels), list(labels.values()), "help")
            values.write_value(key, value, stamp)
    finally:
        values.close()


def _up(upstream: str, kind: str) -> dict[str, str]:
    return {"upstream": upstream, "kind": kind}


def test_two_workers_merge_by_mode_and_the_answering_view(tmp_path: Path) -> None:
    requests = "kvscope_gateway_requests"
    ttft = "kvscope_gateway_time_to_first_token_seconds"
    errors, up = "kvscope_gateway_upstream_errors", "kvscope_gateway_upstream_up"
    info, outstanding = "kvscope_gateway_upstream_info", "kvscope_gateway_upstream_outstanding_requests"
    status = {"model": "m", "route": "/v1/chat/completions", "status": "200"}
    for pid, served, le_01, le_1, errs in ((101, 7, 3, 4, 1), (102, 5, 5, 0, 2)):
        _write(
            tmp_path,
            f"counter_{pid}.db",
            [
                (requests, requests + "_total", status, served, 0),
                (errors, errors + "_total", {**_up("a", "vllm"), "reason": "connect"}, errs, 0),
                (errors, errors + "_total", {**_up("a", "unknown"), "reason": "connect"}, 9, 0),  # old kind
                (errors, errors + "_total", {**_up("gone", "vllm"), "reason": "connect"}, 4, 0),  # left
            ],
        )
        _write(
            tmp_path,
            f"histogram_{pid}.db",
            [
                (ttft, ttft + "_bucket", {"model": "m", "le": "0.1"}, le_01, 0),
                (ttft, ttft + "_bucket", {"model": "m", "le": "1.0"}, le_1, 0),
                (ttft, ttft + "_bucket", {"model": "m", "le": "+Inf"}, 0, 0),
                (ttft, ttft + "_sum", {"model": "m"}, 0.5 * (le_01 + le_1), 0),
            ],
        )
        _write(
            tmp_path,
            f"gauge_livesum_{pid}.db",
            [
                (
                    "kvscope_gateway_in_flight_requests",
                    "kvscope_gateway_in_flight_requests",
                    {},
                    pid - 100,
                    0,
                ),
                (outstanding, outstanding, _up("a", "vllm"), pid - 100, 0),
            ],
        )
        _write(
            tmp_path,
            f"gauge_livemostrecent_{pid}.db",
            [(up, up, _up("a", "vllm"), 1 if pid == 102 else 0, pid), (up, up, _up("gone", "vllm"), 1, 0)],
        )
        _write(
            tmp_path,
            f"gauge_livemax_{pid}.db",
            [
                (info, info, {**_up("a", "vllm"), "kind_source": "models"}, 1, 0),
                (info, info, {**_up("a", "unknown"), "kind_source": "unknown"}, 1, 0),
            ],
        )
    registry = CollectorRegistry()
    live = {("a", "vllm"), ("a", "vllm", "models")}  # the answering worker's pool: upstream a, kind vllm
    registry.register(WorkersCollector(tmp_path, lambda: live))
    m = metric_samples(generate_latest(registry).decode())
    assert sample(m, "kvscope_gateway_requests_total", **status) == 12
    assert sample(m, ttft + "_bucket", model="m", le="0.1") == 8  # 3 + 5
    assert sample(m, ttft + "_bucket", model="m", le="1.0") == 12  # cumulative: + 4 + 0
    assert sample(m, ttft + "_count", model="m") == 12
    assert sample(m, ttft + "_sum", model="m") == 6.0
    assert sample(m, "kvscope_gateway_in_flight_requests") == 3  # 1 + 2
    assert sample(m, outstanding, **_up("a", "vllm")) == 3
    assert sample(m, up, **_up("a", "vllm")) == 1  # the newer check (pid 102's)
    upstream_series = sorted(k for k in m if k[0].startswith("kvscope_gateway_upstream_"))
    assert upstream_series == [
        (errors + "_total", (("kind", "vllm"), ("reason", "connect"), ("upstream", "a"))),
        (info, (("kind", "vllm"), ("kind_source", "models"), ("upstream", "a"))),
        (outstanding, (("kind", "vllm"), ("upstream", "a"))),
        (up, (("kind", "vllm"), ("upstream", "a"))),
    ]
    assert m[upstream_series[0]] == 3 and m[upstream_series[1]] == 1
    assert worker_pids(tmp_path) == [101, 102]


def test_process_series_add_up_the_live_workers(tmp_path: Path) -> None:
    me = os.getpid()
    _write(tmp_path, f"gauge_livesum_{me}.db", [])
    _write(tmp_path, f"gauge_livesum_{me + 10_000_000}.db", [])  # no such process: skipped
    registry = CollectorRegistry()
    registry.register(WorkersProcessCollector(tmp_path))
    m = metric_samples(generate_latest(registry).decode())
    assert m[("process_resident_memory_bytes", ())] > 0
    assert m[("process_cpu_seconds_total", ())] > 0
    assert worker_pids(tmp_path) == [me, me + 10_000_000]
