"""The gateway's build_info and process metrics on /metrics (issue 39): the Prometheus conventions every
exporter follows, so that versions during a rollout and the gateway's own CPU and memory can be graphed."""

from __future__ import annotations

import platform

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.conftest import Stack


def test_build_info_and_process_metrics(stack: Stack) -> None:
    families = {f.name: f for f in text_string_to_metric_families(stack.metrics())}
    (build,) = families["kvscope_gateway_build_info"].samples
    assert (build.labels["python"], build.value) == (platform.python_version(), 1.0)
    assert build.labels["version"]  # the installed kvscope's
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"} <= set(families)
    assert families["process_resident_memory_bytes"].samples[0].value > 0
