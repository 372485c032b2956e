"""Reading JSON-lines streams that another process may be appending to (the request log, the engine's stdout).

A record counts as written only once its newline is: a last line without one is a write still in flight
(or torn by a crash), never a record and never "damaged". The writers (gateway/logs/sinks.py and the engine's
stdout handler) emit each record as one write of the whole line and flush per batch, so a tailing reader
(``kvscope logs``, Filebeat, Vector, ``tail -f``) sees whole records only — this module is the reader's half
of that contract.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec


def complete_lines(data: bytes) -> list[bytes]:
    """The newline-terminated lines of ``data``, without their newlines; an unterminated tail is left out.

    Empty lines are kept (callers decide what a blank line means)."""
    return data.split(b"\n")[:-1]


def parse_records(data: bytes) -> list[dict]:
    """JSON objects of the complete lines of ``data`` that start with ``{`` (other lines — a banner, a
    warning printed to the same stream — are not records). Raises msgspec.DecodeError for a complete line
    that starts with ``{`` but is not valid JSON: a written record must parse."""
    return [msgspec.json.decode(line) for line in complete_lines(data) if line.startswith(b"{")]


def read_records(path: str | Path) -> list[dict]:
    """:func:`parse_records` of the file at ``path`` (``[]`` when it does not exist yet)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    return parse_records(data)


def ends_with_newline(path: str | Path) -> bool:
    """True when the file is empty or its last byte is a newline (every record in it is complete)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def complete_copy(path: str | Path, folder: str | Path) -> Path:
    """``path`` itself when it ends with a newline; else a copy in ``folder`` of its bytes up to and including
    the last newline (the record in flight is left out). Only the live file of a log family can have a tail,
    and only while a write is in progress, so the copy is rare. Raises OSError from the file system."""
    path = Path(path)
    if ends_with_newline(path):
        return path
    target = Path(folder) / path.name
    with open(path, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
        dst.flush()  # the last newline is looked up on disk: the buffered tail must be there
        dst.truncate(_last_newline_end(target))
    return target


def _last_newline_end(path: Path, chunk: int = 1 << 16) -> int:
    """Offset just past the last newline of ``path`` (0 when it has none)."""
    with open(path, "rb") as f:
        end = f.seek(0, 2)
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            block = f.read(end - start)
            i = block.rfind(b"\n")
            if i >= 0:
                return start + i + 1
            end = start
    return 0
