"""Issue 20, engine side: the JSON request log on stdout is written one whole line per write call and flushed
per record, and lines logged from several threads at once never interleave."""

from __future__ import annotations

import json
import logging
import os
import threading

from kvscope.engine.server.access_log import JsonLineHandler
from tests.gateway.logs.test_jsonl import WriteRecorder


def _logger(name: str, handler: logging.Handler) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.handlers[:] = [handler]
    handler.setFormatter(logging.Formatter("%(message)s"))
    return logger


def test_one_write_and_one_flush_per_record() -> None:
    out = WriteRecorder()
    logger = _logger("kvscope.test.lines", JsonLineHandler(out))
    records = [json.dumps({"i": i, "text": "é" * (i * 3000)}) for i in range(6)]  # up to 30 KB of UTF-8
    for line in records:
        logger.info(line)
    assert out.writes == [(line + "\n").encode() for line in records] and out.flushes == 6


def test_threads_logging_at_once_never_interleave_in_a_pipe() -> None:
    read_fd, write_fd = os.pipe()
    chunks: list[bytes] = []
    drain = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_fd, 1 << 16), b"")))
    drain.start()
    stream = open(write_fd, "wb", buffering=0)  # a pipe: partial writes happen above 64 KiB
    logger = _logger("kvscope.test.pipe", JsonLineHandler(stream))

    def produce(t: int) -> None:
        for i in range(25):
            logger.info(json.dumps({"t": t, "i": i, "pad": str(t) * 100_000}))

    threads = [threading.Thread(target=produce, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stream.close()
    drain.join()
    os.close(read_fd)
    lines = b"".join(chunks).split(b"\n")
    assert lines[-1] == b""
    records = [json.loads(line) for line in lines[:-1]]
    assert sorted((r["t"], r["i"]) for r in records) == [(t, i) for t in range(6) for i in range(25)]
    assert all(r["pad"] == str(r["t"]) * 100_000 for r in records)
