"""One worker of ``kvscope gateway --workers N``, as the supervisor (gateway/workers.py) starts it:

    python -P -m kvscope.gateway.worker_main --index=I --count=N --socket-fd=FD --ready-fd=FD -- ARGS…

``ARGS`` are the ``kvscope gateway`` arguments, loaded as that command does (gateway/cli.py); the worker
builds the app with its slot (gateway/state.py ``WorkerSlot``) and serves the inherited listening socket. Not
a user command: the supervisor owns the socket, the metrics folder and the signals.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from kvscope.gateway.cli import _gateway_parser, _overrides
from kvscope.gateway.settings import SettingsSource
from kvscope.gateway.state import WorkerSlot
from kvscope.gateway.workers import serve_socket


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscope gateway worker", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--socket-fd", type=int, required=True)
    p.add_argument("--ready-fd", type=int, required=True)
    return p


def worker_main(argv: list[str]) -> int:
    """Entry point; returns 2 for a configuration that does not load (as ``kvscope gateway``)."""
    split = argv.index("--") if "--" in argv else len(argv)
    slot_args = _worker_parser().parse_args(argv[:split])
    args = _gateway_parser().parse_args(argv[split + 1 :])
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {slot_args.index}]: %(message)s",
    )
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        from kvscope.gateway.app import create_app

        source = SettingsSource.of(args.config, _overrides(args))
        settings = source.load()
        app = create_app(settings, source=source, worker=WorkerSlot(slot_args.index, slot_args.count))
    except (ValueError, OSError) as exc:
        print(f"kvscope gateway (worker {slot_args.index}): {exc}", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=slot_args.socket_fd)
    serve_socket(app, settings, args.log_level, sock, slot_args.ready_fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))
