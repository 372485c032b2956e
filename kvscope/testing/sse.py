"""The test suite's one server-sent-events reader: a whole response body in, its events out.

Framing as the WHATWG HTML spec (§9.2.6) defines it: lines end in CRLF, LF or CR; a blank line ends an event;
a line ``field: value`` loses one space after the colon; the ``data`` lines of one event join with ``\\n``;
lines starting with ``:`` are comments. It is written apart from the gateway's own splitter
(kvscope.gateway.sse), so the tests do not check the gateway's framing with the gateway's code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

DONE = "[DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass
class SSEStream:
    """A parsed body: each event's ``data`` payload in order, the comment lines, and every other line."""

    payloads: list[str] = field(default_factory=list)
    """Each event's data (its ``data:`` lines joined with ``\\n``), as text; events without data are left
    out."""
    comments: list[str] = field(default_factory=list)
    """Comment lines as sent (``: keep-alive``)."""
    other: list[str] = field(default_factory=list)
    """Lines that are neither ``data:`` nor comments (``event:``, ``id:``, …): an OpenAI stream has none."""

    @property
    def data(self) -> list[Any]:
        """The payloads decoded: JSON values, or the string ``[DONE]``. Raises ValueError on one that is
        neither."""
        return [p if p == DONE else json.loads(p) for p in self.payloads]

    @property
    def chunks(self) -> list[dict]:
        """The payloads that are JSON objects (the stream's chunks, in-band errors included)."""
        return [d for d in self.data if isinstance(d, dict)]


def parse_sse(raw: str | bytes) -> SSEStream:
    """Parse a complete SSE body (``bytes`` are decoded as UTF-8). An unfinished last event (no blank line
    after it) counts as an event, as a test reading a stream cut short wants to see it."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    stream = SSEStream()
    data: list[str] = []
    for line in [*_LINE_END.split(text), ""]:
        if not line:
            if data:
                stream.payloads.append("\n".join(data))
            data = []
        elif line.startswith(":"):
            stream.comments.append(line)
        elif line.startswith("data:"):
            value = line[len("data:") :]
            data.append(value[1:] if value.startswith(" ") else value)
        else:
            stream.other.append(line)
    return stream


def sse_events(raw: str | bytes) -> list[str]:
    """The data payloads of an SSE body, in order (comments and other fields left out)."""
    return parse_sse(raw).payloads
