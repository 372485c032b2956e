"""``python -m tests.engine.server.fake_engine_server [kvscope engine flags]``: the engine server's own flags,
settings (environment included), app and uvicorn configuration (engine/server/cli.py) around the tests'
:class:`~tests.engine.server.fakes.FakeEngine` instead of a model — a real engine-server process that starts
in a second, for tests of what the process reads from its environment."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvicorn

from kvscope.engine.server.app import create_app
from kvscope.engine.server.cli import build_parser, configure_logging, uvicorn_config
from kvscope.engine.server.settings import server_settings
from tests.engine.server.fakes import FakeEngine


def main(argv: Sequence[str] | None = None) -> int:
    """Serve a FakeEngine until SIGINT/SIGTERM; 2 on invalid flags or environment (as ``kvscope engine``)."""
    try:
        settings = server_settings(build_parser().parse_args(argv))
    except ValueError as exc:
        print(f"fake engine server: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    uvicorn.Server(uvicorn_config(create_app(settings, engine=FakeEngine()), settings)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
