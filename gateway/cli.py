"""``kvscope gateway …`` (run the gateway) and ``kvscope keys create …`` (make an API key).

Flags override the config file and ``KVSCOPE_GATEWAY_*`` env vars (see gateway/settings.py). List flags
(``--upstream``, ``--api-key-hash``, ``--tokenizer``, ``--trusted-proxy``) replace the file's list when given.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from kvscope.common.cli_help import HelpFormatter
from kvscope.common.settings_cli import add_flags, given
from kvscope.gateway.auth import generate_key, hash_key
from kvscope.gateway.settings import GatewaySettings, SettingsSource, check_key_name


def _gateway_parser() -> argparse.ArgumentParser:
    """``--config`` and ``--log-level``, then one flag per :class:`Flag` field of GatewaySettings (derived by
    kvscope.common.settings_cli: ``--port``, ``--upstream``, ``--keepalive`` …)."""
    p = argparse.ArgumentParser(
        prog="kvscope gateway",
        description="OpenAI-compatible gateway in front of "
        "one or more upstreams (the kvscope engine, vLLM, llama.cpp …).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", help="YAML or TOML config file (also $KVSCOPE_GATEWAY_CONFIG)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return add_flags(p, GatewaySettings)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags in config-file shape (only the flags that were given). Raises ValueError for a malformed
    ``--tokenizer``/``--api-key-hash`` value."""
    return given(args, GatewaySettings)


def serve(app: Any, settings: GatewaySettings, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until interrupted, under :func:`kvscope.gateway.server.uvicorn_config`
    (JSON 400s for parser errors, no uvicorn proxy-header rewriting, no access log: the gateway writes its
    own)."""
    import uvicorn

    from kvscope.gateway.server import uvicorn_config

    config = uvicorn_config(app, settings.host, settings.port, log_level)
    logging.getLogger("kvscope.gateway").info("event loop: %s", config.loop)
    uvicorn.Server(config).run()


def check_gateway_args(argv: list[str]) -> str | None:
    """Why ``kvscope gateway argv`` would refuse to start (a bad flag, config file or value), as its message;
    None when its settings load. Builds no app and binds nothing: ``kvscope serve`` asks before it starts its
    engines, so that a typo in ``--gateway-args`` is not found after a minute of engine start-up. A flag
    argparse refuses has its usage and message printed by argparse itself."""
    try:
        args = _gateway_parser().parse_args(argv)
    except SystemExit as exc:
        return f"the gateway options were refused (exit {exc.code})"
    try:
        SettingsSource.of(args.config, _overrides(args)).load()
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def gateway_main(argv: list[str]) -> int:
    """Entry point of ``kvscope gateway``; returns the exit code (2 for a bad configuration, e.g. an
    invalid value or a tokenizer file that does not exist). With ``--workers N`` (N > 1) this process is the
    supervisor of N workers (gateway/workers.py): 1 when the port is taken or a worker cannot start (its
    own message says why)."""
    args = _gateway_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        source = SettingsSource.of(args.config, _overrides(args))
        settings = source.load()
        if settings.workers > 1:  # the supervisor: the workers build the app (gateway/workers.py)
            from kvscope.gateway.workers import WorkerSupervisor

            return WorkerSupervisor(argv, settings, source).run()
        from kvscope.gateway.app import create_app

        app = create_app(settings, source=source)
    except (ValueError, OSError) as exc:
        print(f"kvscope gateway: {exc}", file=sys.stderr)
        return 2
    serve(app, settings, args.log_level)
    return 0


def _keys_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvscope keys", description="Manage gateway API keys.", formatter_class=HelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True, metavar="{create}", title="actions")
    create = sub.add_parser(
        "create", help="make a new key; prints it once with its config line", formatter_class=HelpFormatter
    )
    create.add_argument("--name", required=True, help="key id (logged as user.id, rate limits per name)")
    create.add_argument("--models", help="comma-separated models the key may use (default: all)")
    create.add_argument(
        "--admin", action="store_true", help="the key may open the console at /console (docs/console.md)"
    )
    create.add_argument(
        "--service-tier",
        choices=("priority", "default", "flex"),
        help="the engine tier of the key's requests, their default and the best they get (flex: batch work; "
        "docs/gateway.md, tier header)",
    )
    return p


def keys_main(argv: list[str]) -> int:
    """Entry point of ``kvscope keys``: ``create --name NAME [--models a,b] [--admin] [--service-tier T]``
    prints the key (first line, shown only now) and the config entry holding its sha256 (one JSON flow
    mapping, valid YAML, that carries every restriction, ``admin`` and ``service_tier``). The ``--api-key-hash
    NAME:SHA256`` alternative is offered only for a key with none of them, since that flag can carry none.
    Returns 2 for an invalid name or an empty ``--models`` list."""
    args = _keys_parser().parse_args(argv)
    try:
        check_key_name(args.name)
    except ValueError as exc:
        print(f"kvscope keys: {exc}", file=sys.stderr)
        return 2
    models = None if args.models is None else [m.strip() for m in args.models.split(",") if m.strip()]
    if models is not None and not models:
        print("kvscope keys: --models needs at least one model name", file=sys.stderr)
        return 2
    key = generate_key()
    entry: dict[str, Any] = {"name": args.name, "sha256": hash_key(key)}
    if models is not None:
        entry["models"] = models
    if args.admin:
        entry["admin"] = True
    if args.service_tier is not None:
        entry["service_tier"] = args.service_tier
    print(key)
    print(
        f"# API key '{args.name}' is shown above only once; store it now. The gateway keeps only its hash.",
        file=sys.stderr,
    )
    print("# add under `api_keys:` in the gateway config:", file=sys.stderr)
    print("- " + json.dumps(entry))
    if models is None and not args.admin and args.service_tier is None:
        print(f"# or pass: --api-key-hash {args.name}:{entry['sha256']}", file=sys.stderr)
    else:
        what = (
            "the model restriction" if models is not None else "admin" if args.admin else "the service tier"
        )
        print(f"# (no --api-key-hash form: that flag cannot carry {what})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(gateway_main(sys.argv[1:]))
