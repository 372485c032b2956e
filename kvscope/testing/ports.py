"""Local TCP ports for test servers, without the race between test processes that picking by bind(0) had.

The old way (bind port 0, close, hand the number on) races twice before the server binds the number itself:
the kernel may give the same port to another process's ``bind(0)`` (the other pytest-xdist worker asks at
the same time), or use it as the source port of an outgoing connection; both draw from
``net.ipv4.ip_local_port_range`` (32768-60999 by default). Here a port is:

1. drawn from below that range (``LOW_PORT`` up to its start), where the kernel never picks a port on its
   own, so no ``bind(0)`` and no outgoing connection can take it;
2. reserved for the life of this process by binding an abstract Unix socket named after it (Linux's
   abstract namespace: a second process of this scheme, such as the other xdist worker or a second pytest
   run, finds the name taken and moves on). The socket's descriptor is left open on purpose and nothing
   refers to it, so no module state is kept; the kernel releases the name when the process ends, even on
   SIGKILL, and the descriptor is close-on-exec, so the server child does not inherit it;
3. checked free by binding it without ``SO_REUSEADDR`` (a process outside this scheme listening there, or
   a connection of an earlier process still in TIME_WAIT, is skipped).

So two callers, in one process or in several, never get the same port while the reserving process lives.
Outside Linux (no abstract namespace) it falls back to the old way.
"""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

LOW_PORT = 10_000
"""The lowest port handed out (above the registered ports most local services use)."""
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32_768
"""Linux's default start of ``ip_local_port_range`` (and IANA's dynamic range starts at 49152, above it)."""
NAME_PREFIX = "kvscope-test-port-"
"""Abstract socket name of a reservation: this prefix and the port number."""


def ephemeral_start(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``'s first field); the Linux
    default when the file is missing or unreadable."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def free_port(host: str = "127.0.0.1", low: int = LOW_PORT, high: int | None = None) -> int:
    """A TCP port on ``host`` that no other caller of this function gets while this process lives, free now.

    Draws from ``[low, high)`` (``high``: the start of the kernel's ephemeral range), starting at a random
    port and walking up (wrapping around). Raises RuntimeError when every port of the range is taken."""
    if not sys.platform.startswith("linux"):
        with socket.socket() as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    high = ephemeral_start() if high is None else high
    if high - low < 100:
        raise RuntimeError(f"no room for test ports below the ephemeral range: [{low}, {high})")
    span = high - low
    first = random.randrange(span)
    for step in range(span):
        port = low + (first + step) % span
        if _reserve(port) and _bindable(host, port):
            return port
    raise RuntimeError(f"every port in [{low}, {high}) is reserved or in use")


def _reserve(port: int) -> bool:
    """Bind the abstract Unix socket of ``port`` and leave its descriptor open until this process ends;
    False if another process (or an earlier call here) holds it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0{NAME_PREFIX}{port}")
    except OSError:
        sock.close()
        return False
    sock.detach()  # the descriptor stays open, unowned: the reservation lasts as long as the process
    return True


def _bindable(host: str, port: int) -> bool:
    """Whether a TCP socket can bind ``host:port`` right now (no listener, no lingering connection)."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
