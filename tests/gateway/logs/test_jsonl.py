"""Issue 20: a JSONL reader never parses a half-written record, and the gateway's writers never split or
interleave one. The reader side is proved on files that end mid-record (deterministic); the writer side by
recording every write call and by writing from many threads at once while a reader tails the file."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from kvscope.gateway.analytics.duckdb_logs import DuckDBLogs
from kvscope.gateway.logs.jsonl import complete_copy, complete_lines, parse_records, read_records
from kvscope.gateway.logs.sinks import JsonlFileSink, StdoutSink
from kvscope.gateway.metrics import GatewayMetrics
from kvscope.testing.records import make_record

FULL = b'{"a":1}\n{"b":"two"}\n'
TORN = b'{"c":"unterminated str'


def test_the_unterminated_tail_is_not_a_record() -> None:
    assert complete_lines(FULL + TORN) == [b'{"a":1}', b'{"b":"two"}']
    assert parse_records(FULL + TORN) == [{"a": 1}, {"b": "two"}]
    assert parse_records(FULL + b'{"c":3}') == [{"a": 1}, {"b": "two"}]  # valid JSON, but no newline yet
    assert parse_records(b"starting engine\n" + FULL) == [{"a": 1}, {"b": "two"}]  # non-record lines
    assert parse_records(b"") == [] and parse_records(TORN) == []


def test_a_complete_damaged_line_still_raises() -> None:
    with pytest.raises(msgspec.DecodeError):
        parse_records(b'{"a":1}\n{"b":\n')


def test_read_records_of_a_file_that_ends_mid_record(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    assert read_records(path) == []  # not created yet
    path.write_bytes(FULL + TORN)
    assert read_records(path) == [{"a": 1}, {"b": "two"}]
    with path.open("ab") as f:  # the writer finishes the line
        f.write(b'ing"}\n')
    assert read_records(path)[-1] == {"c": "unterminated string"}


def test_complete_copy_cuts_the_tail_and_keeps_complete_files(tmp_path: Path) -> None:
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(FULL)
    assert complete_copy(whole, tmp_path / "x") == whole  # no copy needed
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(FULL * 50_000 + TORN)  # > one 64 KiB search chunk before the tail
    (tmp_path / "copies").mkdir()
    copy = complete_copy(torn, tmp_path / "copies")
    assert copy == tmp_path / "copies" / "torn.jsonl" and copy.read_bytes() == FULL * 50_000
    no_newline = tmp_path / "none.jsonl"
    no_newline.write_bytes(TORN)
    assert complete_copy(no_newline, tmp_path / "copies").read_bytes() == b""


@pytest.mark.parametrize("lines", [1, 37, 290])
def test_complete_copy_keeps_every_complete_line_whatever_the_buffer_holds(
    tmp_path: Path, lines: int
) -> None:
    """The copy's last newline is found on disk after its buffered tail is written (lines of 1,933 bytes: no
    size lines up with the copy buffer)."""
    body = b"".join(b'{"n": "' + str(i).encode().rjust(1923, b"x") + b'"}\n' for i in range(lines))
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(body + TORN)
    (tmp_path / "copies").mkdir()
    assert complete_copy(torn, tmp_path / "copies").read_bytes() == body


def test_report_over_a_live_log_ignores_the_record_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    lines = [json.dumps(make_record(i)).encode() + b"\n" for i in range(5)]
    path.write_bytes(b"".join(lines) + lines[0][:300])  # the 6th record is half written
    logs = DuckDBLogs(path)
    report = logs.report()
    assert report.total.requests == 5 and report.extra["unparsed_lines"] == 0
    assert path.read_bytes().endswith(lines[0][:300])  # the live file itself is untouched


class WriteRecorder(io.RawIOBase):
    """A binary stream that keeps every write call and counts flushes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.flushes = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        self.flushes += 1


async def test_stdout_sink_writes_whole_lines_per_call_and_flushes() -> None:
    out = WriteRecorder()
    sink = StdoutSink(GatewayMetrics(CollectorRegistry()), stream=out)
    await sink.start()
    for i in range(300):
        sink.emit({"i": i, "pad": "x" * (i * 97)})  # up to ~29 KB per record
    await sink.aclose()
    assert out.writes and all(w.endswith(b"\n") for w in out.writes)  # a call never ends mid-record
    assert out.flushes >= len(out.writes)
    assert [r["i"] for r in parse_records(b"".join(out.writes))] == list(range(300))


async def test_file_sink_from_many_threads_never_interleaves_while_tailed(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    sink = JsonlFileSink(GatewayMetrics(CollectorRegistry()), path, max_bytes=0, backup_count=0)
    await sink.start()
    pad = "y" * 50_000  # each record needs several page-sized copies: a split write would show

    def produce(t: int) -> None:
        for i in range(40):
            sink.emit({"t": t, "i": i, "pad": pad})

    seen: list[int] = []
    stop = threading.Event()

    def tail() -> None:  # every complete line a concurrent reader sees is a whole record
        while not stop.is_set():
            seen.append(len(read_records(path)))

    reader = threading.Thread(target=tail)
    reader.start()
    producers = [threading.Thread(target=produce, args=(t,)) for t in range(8)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    await sink.aclose()
    stop.set()
    reader.join()
    records = read_records(path)
    assert sorted((r["t"], r["i"]) for r in records) == [(t, i) for t in range(8) for i in range(40)]
    assert all(r["pad"] == pad for r in records) and seen == sorted(seen)
