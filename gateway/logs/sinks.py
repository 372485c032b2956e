"""Request-log sinks that write JSON lines: a size-rotated JSONL file and stdout.

Both implement :class:`kvscope.gateway.logs.sink.LogSink`. ``emit`` only puts the record on a bounded queue (a
full queue drops the record and counts ``outcome="dropped"``); a writer thread encodes (msgspec) and writes
batches, so neither JSON encoding nor disk I/O runs on the event loop. Written records count as
``outcome="shipped"``, write errors as ``"failed"``.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import queue
import sys
import threading
import time
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
    linger_s = 0.02
    """The writer waits this long after the first record of a batch, so that a busy gateway wakes its writer
    thread (and hands it the GIL) once per batch instead of once per record: each wake-up is a futex call
    on the event loop and a GIL hand-over that stops it for a while. A record is on disk at most this much
    later; shutdown still writes every queued record (:meth:`aclose`)."""

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
            if self.linger_s > 0:  # the records that arrive meanwhile join this batch: one wake-up for all
                time.sleep(self.linger_s)
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
    ``path.{backup_count}`` (the oldest is deleted), like :class:`logging.handlers.RotatingFileHandler`.

    ``shared``: several processes (the workers of ``kvscope gateway --workers N``) append to the same file.
    Each batch is then written under an exclusive ``flock`` of ``.{name}.lock`` beside the file, after
    reopening the file if another worker rotated it (its inode changed) and with the size read from the file
    itself: every line is written whole, by one ``write()`` of an ``O_APPEND`` descriptor (unbuffered), no
    record lands in a rotated file behind another's back, and the file rotates once at ``max_bytes`` whoever
    writes. The lock is held for one batch's write, never across a wait for records."""

    name = "file"

    def __init__(
        self,
        metrics: GatewayMetrics,
        path: str | Path,
        max_bytes: int,
        backup_count: int,
        queue_size: int = 10_000,
        shared: bool = False,
    ) -> None:
        super().__init__(metrics, queue_size)
        self.path = Path(path)
        self._max_bytes = max_bytes
        self._backup_count = backup_count
        self._file: BinaryIO | None = None
        self._shared = shared
        self._lock_fd: int | None = None

    @property
    def lock_path(self) -> Path:
        """The lock file of a shared log (hidden, no ``*.jsonl`` name: ``kvscope logs`` never reads it)."""
        return self.path.with_name(f".{self.path.name}.lock")

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        await super().start()

    def _open(self) -> BinaryIO:
        if self._file is None:
            # shared: unbuffered, so each batch is one write() of whole lines at the end of the file
            self._file = open(self.path, "ab", buffering=0 if self._shared else -1)  # noqa: SIM115 - held open by the writer thread
        return self._file

    def _write(self, lines: list[bytes]) -> None:
        if not self._shared:
            self._write_lines(lines)
            return
        if self._lock_fd is None:
            self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            self._follow_rotation()
            self._write_lines(lines)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _follow_rotation(self) -> None:
        """Reopen ``path`` when another process rotated it (the open file is no longer the one there)."""
        if self._file is None:
            return
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        held = os.fstat(self._file.fileno())
        if current is None or (current.st_ino, current.st_dev) != (held.st_ino, held.st_dev):
            self._file.close()
            self._file = None

    def _write_lines(self, lines: list[bytes]) -> None:
        """Write ``lines``, rotating before any line that would take a non-empty file past ``max_bytes``."""
        file = self._open()
        size, chunk = (os.fstat(file.fileno()).st_size if self._shared else file.tell()), []
        for line in lines:
            if self._max_bytes > 0 and size > 0 and size + len(line) > self._max_bytes:
                _write_all(file, b"".join(chunk))
                self._rotate()
                file, size, chunk = self._open(), 0, []
            chunk.append(line)
            size += len(line)
        _write_all(file, b"".join(chunk))
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _write_all(file: BinaryIO, data: bytes) -> None:
    """``file.write(data)`` until all of ``data`` is written: one call (one ``write()`` of an unbuffered
    file) for a regular file, more only after a short write (a full disk raises OSError next)."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        view = view[written if written is not None else len(view) :]
