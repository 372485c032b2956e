"""One ``/metrics`` view over every worker process (``kvscope gateway --workers N``, gateway/workers.py).

Under prometheus_client's multiprocess mode (``$PROMETHEUS_MULTIPROC_DIR``, kvscope.gateway.settings
``multiprocess_dir``) each worker writes its metric values to memory-mapped files of its own in that folder;
the worker that answers a scrape reads all of them (:class:`WorkersCollector`): counters and histogram
buckets, sums and counts are added up over the workers (exact: each worker counts only what it served, and
a worker that has exited keeps its files, so a total never goes down), and each gauge is combined by the
``multiprocess_mode`` it was declared with in gateway/metrics.py:

- ``livesum``: requests in flight, requests in flight per upstream, spooled log bytes (each worker holds
  its own share);
- ``livemostrecent``: ``upstream_up`` (every worker health-checks every replica; the newest check wins);
- ``livemax``: the always-1 info series (``build_info``, ``upstream_info``).

``live`` modes drop a worker's gauges when the supervisor marks it dead (``mark_process_dead``), so an exited
worker's requests in flight do not linger.

The library cannot remove a labelled series in this mode (its values stay in the files): the per-upstream
series of a replica that left the pool, or of an upstream's kind before detection changed it, are dropped
here instead, by the answering worker's own view of the pool (:data:`UPSTREAM_FAMILIES`; every worker reads
the same sources, so the views differ only for the seconds until each has re-read them). A series that comes
back later continues from its last value (a counter that never went down: ``rate`` is unaffected).

The process collector of one process would report one worker: :class:`WorkersProcessCollector` adds up the
``process_*`` series of every live worker instead (CPU seconds, memory, open files).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client import ProcessCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

UPSTREAM_FAMILIES = {
    "kvscope_gateway_upstream_up": ("upstream", "kind"),
    "kvscope_gateway_upstream_outstanding_requests": ("upstream", "kind"),
    "kvscope_gateway_upstream_errors": ("upstream", "kind"),
    "kvscope_gateway_upstream_info": ("upstream", "kind", "kind_source"),
}
"""Family name (as the multiprocess files hold it: a counter without ``_total``) → the labels whose values
must name a series the answering worker holds now."""

LiveSeries = Callable[[], set[tuple[str, ...]]]
"""The label values of the per-upstream series the answering worker holds now: ``(upstream, kind)`` and
``(upstream, kind, kind_source)`` tuples (GatewayMetrics.live_upstream_series)."""


class WorkersCollector:
    """Every worker's ``kvscope_gateway_*`` series from the multiprocess files in ``path``, merged (module
    docstring), the per-upstream ones filtered by ``live``."""

    def __init__(self, path: Path, live: LiveSeries) -> None:
        self._path = path
        self._live = live

    def collect(self) -> Iterable[Metric]:
        files = glob.glob(os.path.join(self._path, "*.db"))
        families = MultiProcessCollector.merge(files, accumulate=True)
        live = self._live()
        for family in families:
            labels = UPSTREAM_FAMILIES.get(family.name)
            if labels is not None:
                family.samples = [s for s in family.samples if _key(s, labels) in live]
            yield family


def _key(sample: Sample, labels: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sample.labels.get(name, "") for name in labels)


def worker_pids(path: Path) -> list[int]:
    """The pids of the live workers writing to ``path``: the owners of a ``livesum`` gauge file (every
    worker has one from its start: ``kvscope_gateway_in_flight_requests``; the supervisor removes a dead
    worker's with ``mark_process_dead``), in ascending order."""
    pids = []
    for name in glob.glob(os.path.join(path, "gauge_livesum_*.db")):
        digits = Path(name).stem.rsplit("_", 1)[-1]
        if digits.isdigit():
            pids.append(int(digits))
    return sorted(pids)


_SUMMED = (
    "process_cpu_seconds_total",
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_open_fds",
)
"""``process_*`` samples added up over the workers; ``process_start_time_seconds`` is the earliest and
``process_max_fds`` the smallest (the limit the first worker to run out meets)."""


class WorkersProcessCollector:
    """``process_*`` (prometheus_client's ProcessCollector, read from ``/proc/<pid>``) of every live worker
    of ``path`` (:func:`worker_pids`), added up: ``rate(process_cpu_seconds_total[1m])`` is the cores the
    whole gateway uses, ``process_resident_memory_bytes`` its memory. The supervisor's own process (idle) is
    not counted. A worker that exits between listing and reading is skipped."""

    def __init__(self, path: Path, proc: str = "/proc") -> None:
        self._path = path
        self._proc = proc

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        values: dict[str, list[float]] = {}
        for pid in worker_pids(self._path):
            collector = ProcessCollector(pid=lambda pid=pid: pid, proc=self._proc, registry=None)
            for family in collector.collect():
                merged.setdefault(family.name, family)
                for s in family.samples:
                    values.setdefault(s.name, []).append(s.value)
        for family in merged.values():
            family.samples = [
                Sample(s.name, {}, _combine(s.name, values[s.name])) for s in family.samples[:1]
            ]
            yield family


def _combine(name: str, values: list[float]) -> float:
    if name == "process_start_time_seconds":
        return min(values)
    if name == "process_max_fds":
        return min(values)
    return sum(values) if name in _SUMMED else values[0]
