"""Request-log sinks that write JSON lines: a size-rotated JSONL file and stdout.

Both implement :class:`kvscope.gateway.logs.sink.LogSink`. ``emit`` only puts the record on a bounded queue (a
full queue drops the record and counts ``outcome="dropped"``); a writer thread encodes (msgspec) and writes
batches, so neither JSON encoding nor disk I/O runs on the event loop. Written records count as
``outcome="shipped"``, write errors as ``"failed"``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
from pathlib import Path
from typing import BinaryIO

import msgspec

from kvscope.gateway.logs.sink import LogRecord
from kvscope.gateway.metrics import GatewayMetrics

_log = logging.getLogger("kvscope.gateway")
_STOP = object()


class ThreadedLineSink:
    """Base: bounded queue + writer thread; subclasses implement :meth:`_write`."""

    name = "lines"

    def __init__(self, metrics: GatewayMetrics, queue_size: int = 10_000) -> None:
        self._metrics = metrics
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._encoder = msgspec.json.Encoder()

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvscope-log-{self.name}", daemon=True)
        self._thread.start()

    def emit(self, record: LogRecord) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._count("dropped")

    async def aclose(self) -> None:
        if self._thread is None:
            return
        await asyncio.to_thread(self._queue.put, _STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def _count(self, outcome: str, n: int = 1) -> None:
        self._metrics.log_records.labels(self.name, outcome).inc(n)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < 512:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            records = [item for item in batch if item is not _STOP]
            if records:
                self._write_batch(records)
            if stop:
                self._close()
                return

    def _write_batch(self, records: list[LogRecord]) -> None:
        try:
            self._write([self._encoder.encode(r) + b"\n" for r in records])
        except (OSError, TypeError, ValueError) as exc:
            _log.error("log sink %s failed to write %d records: %s", self.name, len(records), exc)
            self._count("failed", len(records))
            return
        self._count("shipped", len(records))

    def _write(self, lines: list[bytes]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        """Release resources (writer thread, at shutdown)."""


class StdoutSink(ThreadedLineSink):
    """JSON lines on standard output (for containers whose runtime collects stdout)."""

    name = "stdout"

    def __init__(
        self, metrics: GatewayMetrics, queue_size: int = 10_000, stream: BinaryIO | None = None
    ) -> None:
        super().__init__(metrics, queue_size)
        self._stream = stream or sys.stdout.buffer

    def _write(self, lines: list[bytes]) -> None:
        self._stream.write(b"".join(lines))
        self._stream.flush()


class JsonlFileSink(ThreadedLineSink):
    """Appends JSON lines to ``path``; past ``max_bytes`` it rotates ``path`` → ``path.1`` → … →
    ``path.{backup_count}`` (the oldest is deleted), like :class:`logging.handlers.RotatingFileHandler`."""

    name = "file"

    def __init__(
        self,
        metrics: GatewayMetrics,
        path: str | Path,
        max_bytes: int,
        backup_count: int,
        queue_size: int = 10_000,
    ) -> None:
        super().__init__(metrics, queue_size)
        self.path = Path(path)
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._file: BinaryIO | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        await super().start()

    def _open(self) -> BinaryIO:
        if self._file is None:
            self._file = open(self.path, "ab")  # noqa: SIM115 - held open by the writer thread
        return self._file

    def _write(self, lines: list[bytes]) -> None:
        """Write ``lines``, rotating before any line that would take a non-empty file past ``max_bytes``."""
        file = self._open()
        size, chunk = file.tell(), []
        for line in lines:
            if self._max_bytes > 0 and size > 0 and size + len(line) > self._max_bytes:
                file.write(b"".join(chunk))
                self._rotate()
                file, size, chunk = self._open(), 0, []
            chunk.append(line)
            size += len(line)
        file.write(b"".join(chunk))
        file.flush()

    def _rotate(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._backup_count <= 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self._backup_count - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
