"""JSONL file and stdout sinks (rotation, accounting) and the sinks the settings configure."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvscope.gateway.lifespan import build_state
from kvscope.gateway.logs.sink import LogSink
from kvscope.gateway.logs.sinks import JsonlFileSink, StdoutSink
from kvscope.gateway.metrics import GatewayMetrics
from kvscope.gateway.settings import load_settings


def _count(metrics: GatewayMetrics, sink: str, outcome: str) -> float:
    return (
        metrics.registry.get_sample_value(
            "kvscope_gateway_log_records_total", {"sink": sink, "outcome": outcome}
        )
        or 0.0
    )


async def test_file_sink_rotates_and_counts(tmp_path: Path) -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    path = tmp_path / "logs" / "requests.jsonl"
    sink = JsonlFileSink(metrics, path, max_bytes=200, backup_count=2)
    assert isinstance(sink, LogSink)
    await sink.start()
    for i in range(12):
        sink.emit({"i": i, "pad": "x" * 40})  # 52-byte lines: 3 per 200-byte file
    await sink.aclose()
    files = [path, path.with_name("requests.jsonl.1"), path.with_name("requests.jsonl.2")]
    lines = [[json.loads(line)["i"] for line in f.read_text().splitlines()] for f in files]
    assert lines == [[9, 10, 11], [6, 7, 8], [3, 4, 5]]  # the oldest files (0-2) were deleted
    assert not path.with_name("requests.jsonl.3").exists()
    assert _count(metrics, "file", "shipped") == 12


async def test_full_queue_drops_and_counts() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    out = io.BytesIO()
    sink = StdoutSink(metrics, queue_size=2, stream=out)
    for i in range(5):  # writer not started: the queue holds 2
        sink.emit({"i": i})
    assert _count(metrics, "stdout", "dropped") == 3
    await sink.start()
    await sink.aclose()
    assert out.getvalue() == b'{"i":0}\n{"i":1}\n' and _count(metrics, "stdout", "shipped") == 2


def test_settings_choose_the_sinks(tmp_path: Path) -> None:
    raw = {
        "upstreams": [{"url": "http://a"}],
        "logs": {
            "file": str(tmp_path / "r.jsonl"),
            "stdout": True,
            "elasticsearch": {"hosts": ["http://es:9200"], "spool_dir": str(tmp_path / "spool")},
        },
    }
    state = build_state(load_settings(None, raw, env={}))
    assert [s.name for s in state.sinks] == ["file", "stdout", "elasticsearch"]
    es = state.sinks[2]
    es._metrics.on_outcome("spooled", 3)
    es._metrics.on_spool_bytes(1234)
    # spooled is a transit state with its own counter, never an outcome summed with shipped/failed/dropped
    assert (
        state.metrics.registry.get_sample_value(
            "kvscope_gateway_log_records_spooled_total", {"sink": "elasticsearch"}
        )
        == 3
    )
    assert (
        state.metrics.registry.get_sample_value(
            "kvscope_gateway_log_records_total", {"sink": "elasticsearch", "outcome": "spooled"}
        )
        is None
    )
    assert state.metrics.registry.get_sample_value("kvscope_gateway_log_spool_bytes") == 1234


async def test_records_that_arrive_while_the_writer_lingers_are_one_write() -> None:
    """ThreadedLineSink.linger_s: the writer waits that long after a batch's first record, so the records
    emitted meanwhile cost one wake-up and one write; every record is still written, in order, and the
    ones queued at shutdown too."""

    class Counting(StdoutSink):
        linger_s = 0.3

        def _write(self, lines: list[bytes]) -> None:
            writes.append(len(lines))
            super()._write(lines)

    writes: list[int] = []
    metrics = GatewayMetrics(CollectorRegistry())
    out = io.BytesIO()
    sink = Counting(metrics, stream=out)
    await sink.start()
    for i in range(5):
        sink.emit({"i": i})
    for _ in range(100):  # written after one linger (0.3 s); up to 10 s for a loaded machine
        if writes:
            break
        await asyncio.sleep(0.1)
    assert writes == [5]  # the four emitted while the writer lingered joined the first
    sink.emit({"i": 5})
    await sink.aclose()  # within the next linger: shutdown writes it
    assert writes == [5, 1]
    assert [json.loads(line)["i"] for line in out.getvalue().splitlines()] == list(range(6))
    assert _count(metrics, "stdout", "shipped") == 6
