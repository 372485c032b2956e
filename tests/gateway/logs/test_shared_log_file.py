"""The request log file shared by the workers of ``kvscope gateway --workers N`` (gateway/logs/sinks.py
``JsonlFileSink(shared=True)``): two writers appending and rotating the same file lose no record, split none,
and rotate it once at ``max_bytes`` whoever writes; a single-process sink makes no lock file."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvscope.gateway.logs.sinks import JsonlFileSink
from kvscope.gateway.metrics import GatewayMetrics


def _shipped(metrics: GatewayMetrics) -> float:
    value = metrics.registry.get_sample_value(
        "kvscope_gateway_log_records_total", {"sink": "file", "outcome": "shipped"}
    )
    return value or 0.0


async def test_two_writers_rotate_one_file_and_keep_every_record(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    metrics = [GatewayMetrics(CollectorRegistry()), GatewayMetrics(CollectorRegistry())]
    sinks = [JsonlFileSink(m, path, max_bytes=2000, backup_count=1000, shared=True) for m in metrics]
    for sink in sinks:
        await sink.start()

    def emit(writer: int) -> None:
        for i in range(600):  # 52-byte lines: each file holds 38
            sinks[writer].emit({"w": writer, "i": f"{i:03d}", "pad": "x" * 25})

    threads = [threading.Thread(target=emit, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sink in sinks:
        await sink.aclose()
    files = sorted(tmp_path.glob("requests.jsonl*"))
    data = [f.read_bytes() for f in files]
    assert all(chunk.endswith(b"\n") and len(chunk) <= 2000 for chunk in data)
    lines = [line for chunk in data for line in chunk.splitlines()]
    assert all(len(line) == 51 for line in lines)  # whole lines only (52 bytes with their newline)
    records = sorted((r["w"], int(r["i"])) for r in map(json.loads, lines))
    assert records == [(w, i) for w in (0, 1) for i in range(600)]
    # rotated at max_bytes whoever wrote: every file but the newest is full (38 lines), none was rotated twice
    assert len(files) == -(-1200 // 38)
    assert sum(1 for chunk in data if chunk.count(b"\n") == 38) == len(files) - 1
    assert [_shipped(m) for m in metrics] == [600, 600]
    assert (tmp_path / ".requests.jsonl.lock").exists()


async def test_a_single_process_sink_takes_no_lock(tmp_path: Path) -> None:
    sink = JsonlFileSink(GatewayMetrics(CollectorRegistry()), tmp_path / "requests.jsonl", 1000, 1)
    await sink.start()
    sink.emit({"i": 1})
    await sink.aclose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl"]
