"""``kvscope logs setup-es|report|search|plot|why``: request-log analytics from the command line.

Sources: a JSONL file or directory (DuckDB) or an Elasticsearch URL (``--source http://localhost:9200``).
Defaults come from ``KVSCOPE_LOGS_SOURCE``/``KVSCOPE_GATEWAY_LOG_FILE`` and ``ELASTICSEARCH_*``
(kvscope.gateway.logs.es_settings). Exit status: 0 ok, 1 runtime error (message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvscope.common.cli_help import HelpFormatter
from kvscope.gateway.logs.es_settings import CliEnv, cli_env

if TYPE_CHECKING:
    from kvscope.gateway.analytics.commands import LogSource

COMMANDS = ("setup-es", "report", "search", "plot", "why")
WIDE_HELP = (
    "every column, however wide (a table fits the terminal by leaving out the less important columns; "
    "a pipe or a file always gets every column; --format json has every field)"
)


def _count(text: str) -> int:
    """argparse type of ``--top``/``--limit``: a whole number >= 0 (a negative one reached the SQL LIMIT)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def default_plot_dir(source: str, cache_root: Path) -> Path:
    """Where ``kvscope logs plot`` writes without ``--out``: a ``plots`` folder beside the charted data (the
    log file's folder, or the folder given as the source), ``cache_root/plots`` for an Elasticsearch URL. Not
    the current directory: ``make run``'s log lives in the kvscope cache, and its charts belong with it
    rather than in whatever checkout the command was typed in; every path written is printed."""
    if source.startswith(("http://", "https://")):
        return cache_root / "plots"
    path = Path(source).expanduser()
    return (path if path.is_dir() else path.parent) / "plots"


def _connection_args(p: argparse.ArgumentParser, env: CliEnv) -> None:
    g = p.add_argument_group("Elasticsearch connection")
    g.add_argument("--api-key", default=env.api_key, help="encoded API key (default $ELASTICSEARCH_API_KEY)")
    g.add_argument("--user", default=env.username, help="basic-auth user (default $ELASTICSEARCH_USERNAME)")
    g.add_argument("--password", default=env.password, help="basic-auth password ($ELASTICSEARCH_PASSWORD)")
    g.add_argument("--ca-certs", default=env.ca_certs, help="PEM CA bundle for TLS ($ELASTICSEARCH_CA_CERTS)")
    g.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    g.add_argument(
        "--compat",
        type=int,
        choices=(8, 9),
        default=8,
        help="REST compatibility header: 8 works with ES 8.x and 9.x (default), 9 only with 9.x",
    )
    g.add_argument(
        "--index", default="kvscope-requests", help="data stream / index (default kvscope-requests)"
    )


def _source_args(p: argparse.ArgumentParser, env: CliEnv) -> None:
    p.add_argument(
        "--source",
        default=env.source or env.es_url,
        help="JSONL file/dir or Elasticsearch URL (default $KVSCOPE_LOGS_SOURCE, "
        "$KVSCOPE_GATEWAY_LOG_FILE, $ELASTICSEARCH_URL, else kvscope serve's "
        "$KVSCOPE_CACHE/logs/requests.jsonl)",
    )
    p.add_argument("--since", help="only records newer than this: 15m, 1h, 2d or an ISO-8601 time")
    _connection_args(p, env)


def build_parser(env: CliEnv) -> argparse.ArgumentParser:
    from kvscope.gateway.analytics.render import FORMATS
    from kvscope.gateway.analytics.report import GROUP_FIELDS

    parser = argparse.ArgumentParser(
        prog="kvscope logs", description="Request-log analytics.", formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    setup = sub.add_parser(
        "setup-es",
        help="create/update the ILM policy, templates and data stream template",
        formatter_class=HelpFormatter,
    )
    setup.add_argument(
        "--url",
        "--es",
        dest="url",
        default=env.es_url or "http://localhost:9200",
        help="Elasticsearch URL (default $ELASTICSEARCH_URL or http://localhost:9200)",
    )
    setup.add_argument(
        "--delete-after", default="30d", help="ILM: delete backing indices this long after rollover"
    )
    setup.add_argument("--rollover-max-age", default="1d", help="ILM: roll the data stream over at this age")
    setup.add_argument("--rollover-max-size", default="50gb", help="max primary shard size before rollover")
    setup.add_argument(
        "--dynamic", choices=("false", "strict"), default="false", help="mapping for unknown fields"
    )
    setup.add_argument(
        "--rollover", action="store_true", help="roll the data stream over now (apply new mappings)"
    )
    setup.add_argument("--print", action="store_true", help="print the request bodies, contact nothing")
    _connection_args(setup, env)
    rep = sub.add_parser(
        "report",
        help="requests, errors, TTFT/TPOT/e2e percentiles, slowest requests",
        formatter_class=HelpFormatter,
    )
    rep.add_argument(
        "--by",
        choices=tuple(GROUP_FIELDS),
        help="one row per value of this field, below the row of all requests (default: that row only)",
    )
    rep.add_argument("--top", type=_count, default=10, help="slowest requests to list")
    rep.add_argument("--format", choices=FORMATS, default="table")
    rep.add_argument("--wide", action="store_true", help=WIDE_HELP)
    _source_args(rep, env)
    srch = sub.add_parser(
        "search",
        help="print matching records (DuckDB SQL condition | ES query string)",
        formatter_class=HelpFormatter,
    )
    srch.add_argument(
        "query",
        help='files: SQL condition, e.g. "kvscope.e2e_s > 5"; ES: query string, '
        'e.g. "kvscope.e2e_s:>5 AND http.response.status_code:500"; an id or id prefix alone '
        "(response id, x-request-id, trace id): the requests it names",
    )
    srch.add_argument("--limit", type=_count, default=20, help="most records to print, newest first")
    srch.add_argument("--format", choices=FORMATS, default="table")
    srch.add_argument("--wide", action="store_true", help=WIDE_HELP)
    _source_args(srch, env)
    why = sub.add_parser(
        "why",
        help="why was this request slow: its latency by cause, from the engine's step "
        "records and the gateway's timings",
        formatter_class=HelpFormatter,
    )
    why.add_argument(
        "id",
        help="any id of the request, or a unique prefix of one: the response id (chatcmpl-..., what the "
        "OpenAI SDK shows), the x-request-id header, the trace id, or the log record's event.id",
    )
    why.add_argument("--format", choices=("text", "json"), default="text")
    _source_args(why, env)
    plot = sub.add_parser(
        "plot",
        help="write PNG charts: latency percentiles over time, TTFT histogram",
        formatter_class=HelpFormatter,
    )
    plot.add_argument(
        "--out",
        type=Path,
        help="output folder (default: plots/ beside the log file; $KVSCOPE_CACHE/plots for Elasticsearch)",
    )
    plot.add_argument("--bucket", help="time bucket, e.g. 30s, 5m (default: about 60 points)")
    _source_args(plot, env)
    return parser


def _log_source(args: argparse.Namespace, location: str) -> LogSource:
    from kvscope.gateway.analytics.commands import LogSource
    from kvscope.gateway.logs.es_client import EsConnectionConfig

    basic = (args.user, args.password or "") if args.user else None
    conn = EsConnectionConfig(
        hosts=(location,) if location.startswith("http") else ("http://localhost:9200",),
        api_key=args.api_key,
        basic_auth=basic,
        ca_certs=args.ca_certs,
        verify_certs=not args.insecure,
        compat_major=args.compat,
    )
    return LogSource(location=location, index=args.index, connection=conn)


async def _setup_es(args: argparse.Namespace) -> int:
    from kvscope.gateway.logs import es_setup
    from kvscope.gateway.logs.es_client import make_client

    config = es_setup.EsIndexConfig(
        data_stream=args.index,
        delete_after=args.delete_after,
        rollover_max_age=args.rollover_max_age,
        rollover_max_primary_shard_size=args.rollover_max_size,
        dynamic=args.dynamic,
    )
    if args.print:
        bodies = {
            f"PUT _ilm/policy/{config.ilm_policy}": es_setup.ilm_policy_body(config),
            f"PUT _component_template/{config.settings_template}": es_setup.settings_template_body(config),
            f"PUT _component_template/{config.mappings_template}": es_setup.mappings_template_body(config),
            f"PUT _index_template/{config.data_stream}": es_setup.index_template_body(config),
        }
        print(json.dumps(bodies, indent=2))
        return 0
    client = make_client(_log_source(args, args.url).connection, max_retries=3)
    try:
        for line in await es_setup.ensure_setup(client, config, rollover=args.rollover):
            print(f"ok  {line}")
    finally:
        await client.close()
    return 0


async def _run(args: argparse.Namespace) -> int:
    from kvscope.common.tables import terminal_width
    from kvscope.gateway.analytics import commands
    from kvscope.gateway.analytics.plot import parse_bucket
    from kvscope.gateway.analytics.render import render_records, render_report

    if args.command == "setup-es":
        return await _setup_es(args)
    if not args.source:
        raise ValueError(
            "no --source: pass a JSONL file/dir or an Elasticsearch URL (or set KVSCOPE_LOGS_SOURCE)"
        )
    source = _log_source(args, args.source)
    width = None if getattr(args, "wide", False) else terminal_width(sys.stdout)
    if args.command == "report":
        report = await commands.report(source, since=args.since, by=args.by, top=args.top)
        render_report(report, args.format, sys.stdout, width)
    elif args.command == "why":
        answer = await commands.why(source, args.id, since=args.since)
        print(json.dumps(answer.to_dict(), indent=2) if args.format == "json" else answer.text)
    elif args.command == "search":
        records = await commands.search(source, args.query, since=args.since, limit=args.limit)
        render_records(records, args.format, sys.stdout, width)
    else:
        bucket = parse_bucket(args.bucket) if args.bucket else None
        out = args.out or default_plot_dir(args.source, args.cache_root)
        for path in await commands.plot(
            source, out.expanduser().absolute(), since=args.since, bucket_s=bucket
        ):
            print(f"wrote {path}")
    return 0


def logs_main(argv: list[str], env: Mapping[str, str] | None = None) -> int:
    """Entry point of ``kvscope logs``; returns the exit status."""
    try:
        environ = os.environ if env is None else env
        args = build_parser(cli_env(environ)).parse_args(argv)
        args.cache_root = Path(
            environ.get("KVSCOPE_CACHE") or Path.home() / ".cache" / "kvscope"
        ).expanduser()
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return asyncio.run(_run(args))
    except BrokenPipeError:
        raise  # the reader left (`| head`): kvscope.cli exits quietly, as for SIGPIPE
    except (ValueError, LookupError) as exc:  # the user's input: its message says what to change
        print(f"kvscope logs {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a CLI reports every failure as one line, no traceback
        print(f"kvscope logs {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
