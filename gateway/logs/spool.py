"""On-disk spool for log records that could not be shipped yet: append-only segments, replayed in order.

Layout of ``directory``::

    seg-000000000001.jsonl   one JSON record per line, appended only, never rewritten seg-000000000002.jsonl
    a new segment starts at ``segment_bytes`` and at every open (old ones are immutable) cursor.json
    {"segment": 1, "offset": 4096}: everything before it has been shipped rejected.jsonl           records
    Elasticsearch refused for good (4xx): kept for a human, never replayed

Durability (``fsync`` policy): ``always`` fsyncs the segment after every append (a machine crash loses
nothing that was appended); ``interval`` (default) fsyncs at most every ``fsync_interval_s`` when
:meth:`Spool.maybe_sync` runs, like Redis ``appendfsync everysec`` (a machine crash loses at most that window;
a killed process loses nothing, the page cache survives it); ``never`` leaves it to the OS. The cursor is
replaced atomically (write, fsync, rename) so a crash replays a batch at most twice, never skips one; the
Elasticsearch sink makes the replay idempotent (``create`` with ``_id``).

A line cut short by a crash (no trailing newline, or not JSON) is skipped, counted in
:attr:`SpoolBatch.corrupt` and logged.

Threads: one lock guards the files and counters; the sink appends from a worker thread and, when its memory
queue overflows, from the event loop. No fsync ever runs under the lock (it can take a second on a busy
disk): :meth:`Spool.sync` duplicates the file descriptors under the lock and fsyncs them after releasing
it, and :attr:`Spool.pending_bytes`/:attr:`Spool.pending_records` are lock-free reads, so the event loop
never waits for the disk. One consumer (the sink's shipper) reads and acks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgspec

logger = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("always", "interval", "never")


def fsync_policy(value: str) -> FsyncPolicy:
    """``value`` as a :data:`FsyncPolicy`. Raises ValueError for any other value."""
    for policy in FSYNC_POLICIES:
        if value == policy:
            return policy
    raise ValueError(f"spool fsync must be always|interval|never, got {value!r}")


_SEGMENT_GLOB = "seg-*.jsonl"
_CURSOR = "cursor.json"
REJECTED_FILE = "rejected.jsonl"


@dataclass(frozen=True, slots=True)
class SpoolConfig:
    directory: Path
    """Where segments live; created if missing. One spool directory per sink instance."""
    max_bytes: int = 1 << 30
    """Cap on unshipped bytes; appends past it are dropped (counted, logged at ERROR)."""
    segment_bytes: int = 16 << 20
    """A segment is closed and a new one started once it reaches this size."""
    fsync: FsyncPolicy = "interval"
    """``always`` | ``interval`` | ``never`` (see the module docstring)."""
    fsync_interval_s: float = 1.0
    """With ``interval``: at most this long between an append and its fsync."""

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.segment_bytes <= 0:
            raise ValueError("spool max_bytes and segment_bytes must be > 0")
        fsync_policy(self.fsync)
        if self.fsync_interval_s < 0:
            raise ValueError("spool fsync_interval_s must be >= 0")


@dataclass(frozen=True, slots=True)
class AppendResult:
    appended: int
    """Records written."""
    dropped: int
    """Records refused because the spool was at ``max_bytes``."""
    invalid: int = 0
    """Records that cannot be encoded as JSON (never written; the caller counts them failed)."""


@dataclass(slots=True)
class SpoolBatch:
    records: list[dict[str, Any]]
    """Records in spool order, oldest first."""
    end: tuple[int, int]
    """(segment, offset) just past the last line read; pass the batch to :meth:`Spool.ack`."""
    lines: int = 0
    """Complete lines consumed (records + corrupt lines that end in a newline)."""
    corrupt: int = 0
    """Lines skipped because a crash cut them short or they were not JSON."""


@dataclass(slots=True)
class _Segment:
    seq: int
    path: Path
    size: int


class Spool:
    """Append-only segmented spool; see the module docstring for layout, durability and threading.

    Invariant: ``_segments`` is ordered by ``seq`` and the cursor lies inside ``_segments[0]`` (or, with no
    segments, at ``(_next_seq, 0)``); fully consumed segments are deleted as soon as the cursor leaves them.
    """

    def __init__(self, config: SpoolConfig) -> None:
        self.config = config
        self._dir = Path(config.directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder()
        self._writer: BinaryIO | None = None
        self._unsynced: list[int] = []
        """Duplicated descriptors of closed segments still to fsync."""
        self._dirty = self._dir_dirty = False
        self._last_sync = time.monotonic()
        self._segments = [
            _Segment(int(p.stem.split("-")[1]), p, p.stat().st_size)
            for p in sorted(self._dir.glob(_SEGMENT_GLOB))
        ]
        self._next_seq = self._segments[-1].seq + 1 if self._segments else 1
        self._cursor = self._read_cursor()
        self._drop_consumed()
        self._pending_records = self._count_pending()
        self._pending_bytes = self._compute_pending_bytes()
        if self._pending_records:
            logger.warning(
                "log spool %s holds %d unshipped records from a previous run; they will be replayed first",
                self._dir,
                self._pending_records,
            )

    # ---- state -------------------------------------------------------------------------------------
    def _read_cursor(self) -> tuple[int, int]:
        path = self._dir / _CURSOR
        first = (self._segments[0].seq, 0) if self._segments else (self._next_seq, 0)
        if not path.exists():
            return first
        try:
            raw = msgspec.json.decode(path.read_bytes())
            cursor = (int(raw["segment"]), int(raw["offset"]))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            logger.error("log spool cursor %s is unreadable; replaying from the oldest segment", path)
            return first
        self._next_seq = max(self._next_seq, cursor[0])
        return max(cursor, first)

    def _count_pending(self) -> int:
        total = 0
        for seg in self._segments:
            with seg.path.open("rb") as f:
                f.seek(self._offset_in(seg))
                total += sum(chunk.count(b"\n") for chunk in iter(lambda f=f: f.read(1 << 20), b""))
        return total

    def _offset_in(self, seg: _Segment) -> int:
        return self._cursor[1] if seg.seq == self._cursor[0] else 0

    def _compute_pending_bytes(self) -> int:
        return sum(seg.size - self._offset_in(seg) for seg in self._segments)

    @property
    def pending_bytes(self) -> int:
        """Unshipped bytes on disk (what ``kvscope_gateway_log_spool_bytes`` reports). Lock-free."""
        return self._pending_bytes

    @property
    def pending_records(self) -> int:
        """Unshipped records (complete lines after the cursor). Lock-free."""
        return self._pending_records

    # ---- append ------------------------------------------------------------------------------------
    def append(self, records: Sequence[dict[str, Any]], *, sync: bool = True) -> AppendResult:
        """Append ``records`` in order; those past ``max_bytes`` are refused (the caller counts them dropped).

        With ``fsync="always"`` and ``sync=True`` it returns after the fsync; ``sync=False`` (the event
        loop's overflow path) leaves that to the next :meth:`maybe_sync`. Raises ``OSError`` when the disk
        write fails.
        """
        with self._lock:
            room = self.config.max_bytes - self._pending_bytes
            lines: list[bytes] = []
            invalid = dropped = 0
            for record in records:
                try:
                    line = self._encoder.encode(record) + b"\n"
                except (TypeError, ValueError, msgspec.EncodeError) as exc:
                    invalid += 1
                    logger.error("log spool: record cannot be encoded as JSON (%s); not spooled", exc)
                    continue
                if len(line) > room or dropped:
                    dropped += 1
                    continue
                room -= len(line)
                lines.append(line)
            self._write(lines)
        if lines and sync and self.config.fsync == "always":
            self.sync()
        return AppendResult(appended=len(lines), dropped=dropped, invalid=invalid)

    def _write(self, lines: list[bytes]) -> None:
        writer: BinaryIO | None = None
        for line in lines:
            writer = self._active_writer(len(line))
            writer.write(line)
            self._segments[-1].size += len(line)
        if writer is not None:
            writer.flush()  # readable now; survives a killed process
            self._pending_records += len(lines)
            self._pending_bytes = self._compute_pending_bytes()
            self._dirty = True

    def _active_writer(self, incoming: int) -> BinaryIO:
        seg = self._segments[-1] if self._segments else None
        full = seg is not None and seg.size > 0 and seg.size + incoming > self.config.segment_bytes
        if self._writer is None or full:
            self._close_writer()
            seq = self._next_seq
            self._next_seq += 1
            path = self._dir / f"seg-{seq:012d}.jsonl"
            self._writer = path.open("ab")
            self._segments.append(_Segment(seq, path, 0))
            if len(self._segments) == 1:
                self._cursor = (seq, 0)
            self._dir_dirty = True
        return self._writer

    def _close_writer(self, *, keep_for_sync: bool = True) -> None:
        if self._writer is not None:
            self._writer.flush()
            if keep_for_sync and self.config.fsync != "never":
                self._unsynced.append(os.dup(self._writer.fileno()))
            self._writer.close()
            self._writer = None

    # ---- durability --------------------------------------------------------------------------------
    def sync_due(self) -> bool:
        """True when :meth:`maybe_sync` would fsync now (cheap: no I/O, no lock)."""
        if self.config.fsync == "never" or not (self._dirty or self._unsynced or self._dir_dirty):
            return False
        return (
            self.config.fsync == "always"
            or time.monotonic() - self._last_sync >= self.config.fsync_interval_s
        )

    def maybe_sync(self) -> None:
        """fsync what was written if the policy says it is due (the sink calls this about once a second)."""
        if self.sync_due():
            self.sync()

    def sync(self) -> None:
        """fsync written segments (and the directory after a new segment); the lock is not held meanwhile."""
        if self.config.fsync == "never":
            return
        with self._lock:
            if self._writer is not None:
                self._writer.flush()
                self._unsynced.append(os.dup(self._writer.fileno()))
            fds, self._unsynced = self._unsynced, []
            dir_dirty, self._dir_dirty, self._dirty = self._dir_dirty, False, False
            self._last_sync = time.monotonic()
        for fd in fds:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if dir_dirty:
            fd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ---- replay ------------------------------------------------------------------------------------
    def read_batch(self, max_records: int) -> SpoolBatch:
        """Read up to ``max_records`` from the cursor without consuming them (:meth:`ack` does).

        Stops at the end of a segment, so a batch never spans two segments. Returns an empty batch
        when nothing is pending.
        """
        with self._lock:
            if not self._segments:
                return SpoolBatch([], self._cursor)
            seg = self._segments[0]
            offset = self._offset_in(seg)
            batch = SpoolBatch([], (seg.seq, offset))
            with seg.path.open("rb") as f:
                f.seek(offset)
                while len(batch.records) < max_records and offset < seg.size:
                    line = f.readline(seg.size - offset)
                    offset += len(line)
                    self._decode_into(batch, line, seg)
            batch.end = (seg.seq, offset)
            return batch

    def _decode_into(self, batch: SpoolBatch, line: bytes, seg: _Segment) -> None:
        complete = line.endswith(b"\n")
        batch.lines += complete
        try:
            if not complete:
                raise msgspec.DecodeError("line cut short (no newline)")
            batch.records.append(self._decoder.decode(line))
        except msgspec.DecodeError as exc:
            batch.corrupt += 1
            logger.error(
                "log spool %s: skipping a damaged line (%d bytes): %s", seg.path.name, len(line), exc
            )

    def ack(self, batch: SpoolBatch) -> None:
        """Mark ``batch`` shipped: advance the cursor past it, delete segments fully behind the cursor.

        The cursor file is written after the lock is released (segments are deleted first: a crash in
        between leaves a cursor into a deleted segment, which reopening resolves to the next segment).
        """
        with self._lock:
            if batch.end <= self._cursor:
                return
            self._cursor = batch.end
            self._pending_records = max(0, self._pending_records - batch.lines)
            self._drop_consumed()
            self._pending_bytes = self._compute_pending_bytes()
            cursor = self._cursor
        self._write_cursor(cursor)

    def _drop_consumed(self) -> None:
        while self._segments:
            seg = self._segments[0]
            seq, offset = self._cursor
            consumed = seq > seg.seq or (seq == seg.seq and offset >= seg.size)
            active = self._writer is not None and seg is self._segments[-1]
            if not consumed or (active and len(self._segments) > 1):
                break
            if active:
                self._close_writer(keep_for_sync=False)
            seg.path.unlink(missing_ok=True)
            self._segments.pop(0)
            floor = (self._segments[0].seq, 0) if self._segments else (self._next_seq, 0)
            self._cursor = max(self._cursor, floor) if self._segments else floor

    def _write_cursor(self, cursor: tuple[int, int]) -> None:
        tmp = self._dir / (_CURSOR + ".tmp")
        with tmp.open("wb") as f:
            f.write(msgspec.json.encode({"segment": cursor[0], "offset": cursor[1]}))
            f.flush()
            if self.config.fsync != "never":
                os.fsync(f.fileno())
        os.replace(tmp, self._dir / _CURSOR)

    # ---- dead letters and shutdown -----------------------------------------------------------------
    def reject(self, records: Sequence[dict[str, Any]], reasons: Sequence[str]) -> None:
        """Append records Elasticsearch refused for good to ``rejected.jsonl`` with the reason."""
        with self._lock, (self._dir / REJECTED_FILE).open("ab") as f:
            for record, reason in zip(records, reasons, strict=True):
                try:
                    line = self._encoder.encode({"reason": reason, "record": record})
                except (TypeError, ValueError, msgspec.EncodeError):
                    line = self._encoder.encode({"reason": reason, "record_repr": repr(record)[:65536]})
                f.write(line + b"\n")

    def close(self) -> None:
        """Close the active segment and fsync everything written (unless ``fsync='never'``)."""
        with self._lock:
            self._close_writer()
        self.sync()
