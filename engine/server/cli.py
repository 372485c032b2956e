"""``kvscope engine …`` / ``python -m kvscope.engine.server …``: serve one model over the OpenAI API with
uvicorn.

``engine_main(argv) -> int`` parses the flags (derived from the fields of EngineOptions and ServerSettings,
engine/server/settings.py) into an EngineConfig (kvscope.engine.llm.build_engine_config) and ServerSettings,
warns loudly when it binds a non-loopback address without ``--api-key``, configures logging (request lines as
JSON on stdout, everything else on stderr) and runs uvicorn (on uvloop unless ``--event-loop asyncio``:
kvscope/common/event_loop.py) until SIGINT/SIGTERM. On shutdown in-flight requests fail at once with "engine
shutting down" (streams receive an in-band error event) instead of hanging until the graceful-shutdown
timeout.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvscope.common.cli_help import HelpFormatter
from kvscope.common.event_loop import resolve_event_loop
from kvscope.engine.server.access_log import ACCESS_LOGGER, JsonLineHandler
from kvscope.engine.server.settings import ServerSettings, add_arguments, engine_options, server_settings


def build_parser() -> argparse.ArgumentParser:
    """``kvscope engine``'s flags: one per :class:`EngineOptions` / :class:`ServerSettings` field
    (engine/server/settings.py), derived by kvscope.common.settings_cli."""
    return add_arguments(
        argparse.ArgumentParser(
            prog="kvscope engine",
            description="Serve a model with the kvscope engine.",
            formatter_class=HelpFormatter,
        )
    )


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword arguments given on the command line (unset flags keep the config defaults)."""
    return engine_options(args).config_kwargs()


def configure_logging(level: str) -> None:
    """Request lines (JSON) on stdout; other logs on stderr."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    errors = logging.StreamHandler(sys.stderr)
    errors.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(errors)
    access = logging.getLogger(ACCESS_LOGGER)
    access.propagate = False
    access.setLevel(logging.INFO)
    sys.stdout.flush()  # anything printed before goes out ahead of the first record
    lines = JsonLineHandler(sys.stdout.buffer)
    lines.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(lines)


def engine_main(argv: Sequence[str] | None = None) -> int:
    """Run the server; returns the process exit code (2 for invalid flags or configuration, including what
    only loading the model can judge: :func:`load_engine`)."""
    args = build_parser().parse_args(argv)
    try:
        settings = server_settings(args)
        options = engine_options(args)
        from kvscope.engine.llm import build_engine_config

        config = build_engine_config(options.model, **options.config_kwargs())
    except (ValueError, TypeError) as exc:
        print(f"kvscope engine: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if (warning := settings.exposure_warning()) is not None:
        logging.getLogger("kvscope.engine").warning("%s\n%s\n%s", "!" * 100, warning, "!" * 100)
    return _serve(settings, config)


def uvicorn_config(app: Any, settings: ServerSettings) -> Any:
    """The ``uvicorn.Config`` the engine serves ``app`` under: no access log of uvicorn's (the engine
    writes its own), 5 s graceful shutdown, the event loop ``settings.event_loop`` resolved (uvloop where
    installed), and uvicorn's h11 protocol with the request head and body read timeouts
    (kvscope/common/read_timeouts.py: ``--request-head-timeout``, ``--request-body-timeout``; a stalled
    head or body gets a JSON 408 and a close)."""
    import functools

    import uvicorn

    from kvscope.common.read_timeouts import ReadTimeoutProtocol, ReadTimeouts

    protocol = functools.partial(
        ReadTimeoutProtocol,
        read_timeouts=ReadTimeouts(settings.request_head_timeout_s, settings.request_body_timeout_s),
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        loop=resolve_event_loop(settings.event_loop),
        # uvicorn calls `http` with its keyword arguments, so a factory works; its annotation names a class
        http=protocol,  # pyright: ignore[reportArgumentType]
    )


def load_engine(config: Any) -> Any:
    """The AsyncEngine of ``config``, loaded before the server starts (model, formats, KV cache, kernels),
    so that a configuration only the load can judge — a model that does not exist or cannot be pulled,
    ``--quantization gguf`` without a GGUF, a memory budget below the weights, too few KV blocks for
    ``max_model_len``, a device this machine lacks — ends the command with one line and exit status 2, not
    a start-up traceback. Returns None after printing that line; other exceptions propagate (a defect, with
    its traceback)."""
    from kvscope.common.models.pull import PullError
    from kvscope.engine.async_engine import AsyncEngine

    try:
        return AsyncEngine(config)
    except (ValueError, TypeError, PullError) as exc:
        print(f"kvscope engine: {exc}", file=sys.stderr)
        return None


def _serve(settings: ServerSettings, config: Any) -> int:
    import uvicorn

    from kvscope.engine.server.app import create_app

    try:
        engine = load_engine(config)
    except KeyboardInterrupt:  # Ctrl-C while the model loads (uvicorn's handlers are not installed yet)
        return 130
    if engine is None:
        return 2
    app = create_app(settings, engine=engine)

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            await app.state.context.drain()
            await super().shutdown(sockets)

    server_config = uvicorn_config(app, settings)
    logging.getLogger("kvscope.engine").info("event loop: %s", server_config.loop)
    server = DrainingServer(server_config)
    try:
        server.run()
    finally:
        # already stopped by the drain unless the server never started (e.g. the port was taken)
        engine.stop()
    return 0 if server.started else 1
